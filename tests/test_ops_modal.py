"""`cellfeed status`, `stop` and `report` of a Modal campaign where they used to fail: on a machine
with no Modal credentials (one line, at once: modal's real client, no server), and a stop that comes
after the campaign's end (the run is complete: said so, locally and on Modal). After a campaign
resumed, status and the report keep every epoch's audit, not only the last call's: that is checked
on a preempted campaign in tests/test_modal_campaign.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]


def no_credentials_env(home: Path) -> dict:
    """This machine's environment without any Modal setting or emulator, HOME an empty folder: modal's
    real client finds no token (no MODAL_TOKEN_*, no ~/.modal.toml)."""
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_") and k != "PYTHONPATH"}
    return {**env, "HOME": str(home)}


@pytest.mark.parametrize("command", [["status", "first", "--modal"], ["stop", "first", "--modal"]])
def test_an_operation_on_a_modal_run_without_credentials_says_so_in_one_line_at_once(tmp_path, command):
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", *command],
        cwd=ROOT,
        env=no_credentials_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr.splitlines() == [
        "cellfeed: error: no Modal credentials: run `modal token new` or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"
    ]
    assert time.monotonic() - started < 30  # (not --modal-retry-s of retries: a missing token does not come back)


def test_modals_auth_error_is_never_retried(monkeypatch):
    """`retrying` turns modal's AuthError into one line at once, whatever its retry window; a token
    that is configured but refused is said so."""
    import modal.exception

    from coordination.modal_backend import ModalNoCredentials, retrying

    calls = []

    def refused():
        calls.append(1)
        raise modal.exception.AuthError("Token missing. Could not authenticate client.")

    for name in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/nonexistent")
    started = time.monotonic()
    with pytest.raises(ModalNoCredentials, match=r"^no Modal credentials: run `modal token new`"):
        retrying(refused, "dict get", retry_s=900)
    assert calls == [1] and time.monotonic() - started < 5
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-x")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-x")
    with pytest.raises(ModalNoCredentials, match=r"^Modal did not accept this machine's credentials \(Token"):
        retrying(refused, "dict get", retry_s=900)
    assert calls == [1, 1]


def run_folder(root: Path, state: str) -> Path:
    """A local run's folder whose journal says `state`, as the campaign's monitor writes it (here
    kept by this process: its pid is alive)."""
    folder = root / "runs" / "done"
    folder.mkdir(parents=True)
    snap = {
        "run": "done",
        "state": state,
        "updated": time.time(),
        "pid": os.getpid(),
        "epochs": 3,
        "step": 252,
        "checkpoint": {"step": 252, "epoch": 3, "folder": str(folder)},
        "resume": "" if state == "complete" else "cellfeed local --run done --resume",
    }
    (folder / "state.json").write_text(json.dumps(snap))
    return folder


def stop(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "stop", "done", "--workdir", str(root / "runs"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_stop_of_a_complete_run_says_it_is_complete(tmp_path):
    run_folder(tmp_path, "complete")
    done = stop(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["run done is complete (3 of 3 epochs, step 252): nothing to stop"]
    assert done.stderr == "" and not (tmp_path / "runs" / "done" / "stop").exists()  # (nothing asked)


def test_a_stop_that_the_campaigns_end_overtakes_says_the_run_is_complete(tmp_path):
    """The campaign's last steps end it before it looks for the request: its last state is complete,
    and `cellfeed stop` says so (no `resume:` with nothing after it)."""
    folder = run_folder(tmp_path, "running")

    def the_campaign():  # (it ends when the request lands, without acting on it)
        wait_for(lambda: (folder / "stop").exists(), "the stop request")
        snap = json.loads((folder / "state.json").read_text())
        (folder / "state.json").write_text(json.dumps({**snap, "state": "complete", "resume": ""}))

    ends = threading.Thread(target=the_campaign)
    ends.start()
    done = stop(tmp_path)
    ends.join()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "asked run done to stop: its ranks checkpoint after their current step",
        "run done is complete (3 of 3 epochs, step 252): it finished before the stop took effect; nothing to resume",
    ]
    assert "resume:" not in done.stdout and done.stderr == ""


def test_a_modal_campaigns_dict_gone_as_the_stop_is_asked_means_it_completed(tmp_path, monkeypatch, capsys):
    """On Modal the campaign deletes its Dict as it completes: a request that finds it gone reads the
    run's last status from the Volume, and says the run is complete."""
    from app import ops
    from app.journal import DictJournal
    from coordination.queues import MapGone

    class Dict:  # the run's Dict: running when first read, deleted by the time the request is put
        reads = 0

        def get(self, key, default=None):
            self.reads += 1
            if self.reads > 1:
                raise MapGone("modal.Dict cellfeed-emu is gone")
            return json.dumps({"run": "emu", "state": "running", "updated": time.time(), "epochs": 3, "step": 200})

        def put(self, key, value, **_):
            raise MapGone("modal.Dict cellfeed-emu is gone")

    final = {"run": "emu", "state": "complete", "updated": time.time(), "epochs": 3, "step": 252, "resume": ""}
    monkeypatch.setattr(ops, "journal_of", lambda args: DictJournal(Dict(), "emu"))
    monkeypatch.setattr(ops, "volume_state", lambda run: final)  # (the campaign's last status, on the Volume)
    from app.cli import main

    assert main(["stop", "emu", "--modal"]) == 0
    assert capsys.readouterr().out.splitlines() == ["run emu is complete (3 of 3 epochs, step 252): nothing to stop"]


def test_a_report_of_a_run_not_here_says_where_a_modal_runs_folder_comes_from(tmp_path):
    """`cellfeed report` reads a run's folder (a Modal campaign's: its copy from the Volume); without it,
    one line, with the command that fetches a Modal run's folder."""
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "report", "emu"],
        cwd=tmp_path,
        env=no_credentials_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        f"cellfeed: error: no run 'emu' in {tmp_path / 'runs'}: give the --workdir it ran in (a Modal campaign's "
        "folder comes from its Volume: `modal volume get cellfeed-checkpoints emu runs/emu`)"
    ]
