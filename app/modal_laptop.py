"""The laptop's side of `modal run app/modal_app.py`, what its entrypoint (`app/modal_app.py:main`)
reads and says: a resume's campaign from the run's record on the checkpoints Volume (`resumed`), a
campaign that ended badly in one line with the command that resumes it (`said_failure`), and the
campaign's verdict as the last line (`say_last`)."""

from __future__ import annotations

import atexit
import os
import sys

import modal

from app.config import CampaignConfig
from app.modal_calls import CallFailed
from app.resume import CAMPAIGN_RECORD, read_record, resume_command, resumed_flags
from coordination.modal_backend import RETRY_S, ModalUnreachable, retrying


def recorded_campaign(run: str, volume: str, retry_s: float) -> dict | None:
    """The run's campaign record on the `volume` Volume (`train` writes it), or None."""
    path = f"{run}/{CAMPAIGN_RECORD}"

    def read():
        try:
            data = b"".join(modal.Volume.from_name(volume).read_file(path))
        except FileNotFoundError:
            return None
        return read_record(data.decode(errors="replace"), f"{path} on the {volume} Volume")

    return retrying(read, f"reading {path} from the {volume} Volume", retry_s)


def resumed(given: dict, volume: str) -> dict:
    """(`--resume --run RUN`) The flags a resume continues with: the run's recorded campaign on the
    `volume` Volume and the changes a resume may make (each said); with no record yet, those given."""
    recorded = recorded_campaign(given["run"], volume, given.get("modal_retry_s", RETRY_S))
    if recorded is None:
        print(f"run {given['run']} has no campaign on the {volume} Volume yet: resuming with the flags given")
        return given
    flags, notes = resumed_flags(given["run"], recorded, given)
    flags.update(run=given["run"], resume=True)
    for note in notes:
        print(f"resume: {note}", flush=True)
    return flags


def said_failure(exc: BaseException, cfg: CampaignConfig) -> bool:
    """A campaign that failed, said on stderr in one line with the command that continues it; whether
    the error was expected (the input's, Modal's or a call's, or an interrupt). One that was not is a
    fault of this code: the caller lets its traceback follow."""
    from coordination.errors import CellfeedError

    expected = isinstance(exc, (CallFailed, CellfeedError, modal.exception.Error, OSError, KeyboardInterrupt))
    if isinstance(exc, KeyboardInterrupt):  # modal/runner.py:503-514: an app not detached is stopped now
        print(
            "interrupted: without `modal run --detach`, Modal stops this campaign's calls as `modal run` ends "
            "(its last checkpoint stays); with --detach the train call goes on: "
            f"`cellfeed status {cfg.run} --modal` shows it, `cellfeed stop {cfg.run} --modal` stops it",
            file=sys.stderr,
        )
    elif isinstance(exc, ModalUnreachable):  # this laptop lost Modal: a train call may still be running there
        print(
            f"cellfeed: error: {exc}. A train call already started may still be running in Modal: look at "
            "the app in Modal's dashboard before resuming (two trainers on one run must not run at once)",
            file=sys.stderr,
        )
    elif isinstance(exc, CallFailed):  # a call's end (its function's error, or Modal's): said by the call
        print(f"cellfeed: error: {exc}", file=sys.stderr)
    elif expected:
        last = (str(exc).strip().splitlines() or [""])[-1]
        print(f"cellfeed: error: {type(exc).__name__}: {last}", file=sys.stderr)
    print(
        f"the campaign's queue, plans and checkpoints are kept. Resume it with:\n  {resume_command(cfg)}",
        file=sys.stderr,
        flush=True,
    )
    return expected


def say_last(line: str) -> None:
    """`line` as the process's last. Under `modal run` it is said as the process ends, after what
    modal prints once the entrypoint returns (the containers' last logs, its "App completed" line:
    modal/runner.py:539-551)."""
    if under_modal_cli():
        atexit.register(print, line, flush=True)
    else:  # (a script calling the entrypoint, deploy/first_run: its own last line comes after)
        print(line, flush=True)


def under_modal_cli() -> bool:
    """Whether this process is modal's CLI (`modal run`, or `python -m modal run`)."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return os.path.basename(sys.argv[0]) == "modal" or getattr(main_spec, "name", "") == "modal.__main__"
