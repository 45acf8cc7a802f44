"""Operating a campaign from another terminal or a laptop: `cellfeed status`, `cellfeed stop` and
`cellfeed report`. Each reads the campaign's journal (`app.journal`) and starts nothing: a local
run's folder, or a Modal run's modal.Dict and Volume.

    cellfeed status RUN [--workdir runs] [--json]      # a local run
    cellfeed status RUN --modal                         # a Modal campaign (no GPU started)
    cellfeed stop RUN [--modal]                         # checkpoint, stop, keep the state for --resume
    cellfeed report RUN --out report.html               # one self-contained page of plots
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from app.journal import DictJournal, Journal, seen_state
from app.status import steps_of
from coordination.errors import CellfeedError

STOP_POLL_S = 1.0


def journal_of(args) -> Journal:
    """The run's journal: its local folder, or its Modal Dict (with the Volume folder as it is mounted or
    downloaded, for what outlives the Dict)."""
    if not args.modal:
        folder = Path(args.workdir).resolve() / args.run
        if not folder.is_dir():
            raise CellfeedError(f"no run {args.run!r} in {folder.parent}: name a run there, or give its --workdir")
        return Journal(folder)
    from coordination.modal_backend import ModalMap, run_object_name

    store = ModalMap(run_object_name(args.run), create=False, retry_s=args.modal_retry_s)
    return DictJournal(store, args.run)


def read_state(args, journal: Journal) -> dict:
    """The run's latest snapshot with the state a reader should believe (`journal.seen_state`)."""
    from coordination.queues import MapGone

    try:
        snap = journal.read_state()
    except MapGone:  # a Modal campaign's Dict is deleted when it completes: its last snapshot is on the Volume
        snap = volume_state(args.run)
    if snap is None:
        where = "its Modal Dict" if args.modal else journal.folder
        raise CellfeedError(f"run {args.run!r} has no status in {where} yet: it is starting, or predates status")
    state = seen_state(snap)
    if not args.modal and state in ("running", "stopping") and not pid_alive(snap.get("pid")):
        state = "incomplete"  # (its process is gone: killed)
    return {**snap, "state": state}


def volume_state(run: str) -> dict | None:
    import modal

    from app.modal_app import VOLUME_NAME

    try:
        data = b"".join(modal.Volume.from_name(VOLUME_NAME).read_file(f"{run}/state.json"))
    except FileNotFoundError:
        return None
    return json.loads(data)


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(snap: dict) -> str:
    """`cellfeed status`'s lines."""
    age = time.time() - snap.get("updated", 0)
    lines = [f"run {snap['run']}: {snap['state']} (status from {age:.0f} s ago)"]
    epoch, epochs = snap["epoch"], snap["epochs"]
    if snap["state"] == "complete":
        lines.append(f"  {epochs} of {epochs} epochs trained, {snap['cells_per_epoch']:,} cells each")
    else:
        lines.append(
            f"  epoch {epoch} (of 0-{epochs - 1}): {snap['epoch_cells_trained']:,} of {snap['cells_per_epoch']:,} "
            f"cells trained; step {snap['step']:,} of {steps_of(snap)}"
            + (f", loss {snap['loss']:.3f}" if snap["loss"] is not None else "")
        )
    if snap["cells_per_s"] is not None:
        waits = ", ".join(f"r{r} {w:.0f} ms" for r, w in enumerate(snap["wait_ms_ranks"] or []))
        lines.append(f"  {snap['cells_per_s']:,.0f} cells/s; data wait per rank at the last step: {waits}")
    alive = [p for p in snap["producers"] if not p["state"].startswith(("done", "failed", "stopped"))]
    lines.append(
        f"  producers: {len(alive)} of {len(snap['producers'])} alive: "
        + ", ".join(f"{p['name']} {p['state']}" for p in snap["producers"])
    )
    q = snap["queue"]
    lines.append(
        f"  queue: {q['tasks']:,} tasks; items per rank {' '.join(f'r{r}:{d}' for r, d in enumerate(q['ranks']))}"
    )
    ckpt = snap.get("checkpoint")
    lines.append(
        f"  last checkpoint: step {ckpt['step']:,} (epoch {ckpt['epoch']}), {ckpt['folder']}"
        if ckpt
        else "  no checkpoint yet"
    )
    if snap["state"] == "running" and snap.get("eta_s") is not None:
        lines.append(f"  ETA: {snap['eta_s'] / 60:.1f} min at {snap['step_s']:.2f} s a step")
    if snap.get("classes"):
        lines.append(f"  {snap['classes']}")
    for a in snap.get("audits", []):
        lines.append(f"  audit: {a['line']}")
    if snap.get("resume") and snap["state"] != "complete":
        lines.append(f"  resume: {snap['resume']}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    snap = read_state(args, journal_of(args))
    print(json.dumps(snap) if args.json else describe(snap))
    return 0


def cmd_stop(args) -> int:
    """Ask the run to stop; wait until it has (its ranks checkpoint, its producers stop). A run that
    is complete, before the request or by the time it is seen, is said so (exit 0)."""
    from coordination.queues import MapGone

    journal = journal_of(args)
    snap = read_state(args, journal)
    restarting = args.modal and snap["state"] == "incomplete"  # (a preempted or handed-over call starting again)
    if snap["state"] not in ("running", "stopping") and not restarting:
        return nothing_to_stop(snap)
    try:
        journal.ask_stop()
    except MapGone:  # a Modal campaign deletes its Dict as it completes: it ended since its state was read
        return nothing_to_stop(read_state(args, journal))
    print(f"asked run {args.run} to stop: its ranks checkpoint after their current step", flush=True)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        time.sleep(STOP_POLL_S)
        snap = read_state(args, journal)
        if snap["state"] == "complete":  # (its last steps ended the campaign before the request was seen)
            print(complete_line(snap, "it finished before the stop took effect; nothing to resume"))
            return 0
        if snap["state"] not in ("running", "stopping"):
            ckpt = snap.get("checkpoint")
            where = f"checkpoint at step {ckpt['step']:,}" if ckpt else "no checkpoint"
            resume = f"; resume: {snap['resume']}" if snap.get("resume") else ""
            print(f"run {args.run} {snap['state']} at step {snap['step']:,} ({where}){resume}")
            return 0
    raise CellfeedError(
        f"run {args.run!r} has not stopped in {args.timeout:.0f} s (its state: {snap['state']}); the request stands: "
        "`cellfeed status` shows when it does"
    )


def complete_line(snap: dict, then: str) -> str:
    """One line for a run that is complete (`cellfeed stop` of a finished campaign)."""
    epochs = snap["epochs"]
    return f"run {snap['run']} is complete ({epochs} of {epochs} epochs, step {snap['step']:,}): {then}"


def nothing_to_stop(snap: dict) -> int:
    """`cellfeed stop` of a run that is not running: complete (said, exit 0), else an error line."""
    if snap["state"] != "complete":
        state = snap["state"]
        raise CellfeedError(f"run {snap['run']!r} is not running (its state: {state}); there is nothing to stop")
    print(complete_line(snap, "nothing to stop"))
    return 0


def cmd_report(args) -> int:
    from app.report import write_report

    folder = Path(args.workdir).resolve() / args.run
    if not folder.is_dir():
        from app.modal_app import VOLUME_NAME

        raise CellfeedError(
            f"no run {args.run!r} in {folder.parent}: give the --workdir it ran in (a Modal campaign's folder comes "
            f"from its Volume: `modal volume get {VOLUME_NAME} {args.run} {args.workdir}/{args.run}`)"
        )
    plots = write_report(folder, Path(args.out))
    print(f"wrote {args.out}: {plots} plots")
    return 0


def add_commands(command) -> None:
    """The three commands' arguments (`command(name, help)` makes a subparser: app/cli.py)."""
    for name, help_text, func in (
        (
            "status",
            "where a campaign stands: state, epoch, cells, rates, producers, queue, checkpoint, ETA",
            cmd_status,
        ),
        (
            "stop",
            "stop a running campaign gracefully: its ranks checkpoint, its producers stop, --resume goes on",
            cmd_stop,
        ),
        ("report", "write one self-contained HTML page of a run's plots, settings and cost", cmd_report),
    ):
        p = command(name, help_text)
        p.add_argument("run", help="the run's name (its --run)")
        p.add_argument("--workdir", default="runs", help="the --workdir the run was started with (local runs)")
        if name != "report":
            p.add_argument("--modal", action="store_true", help="a campaign on Modal (`modal run app/modal_app.py`)")
            p.add_argument("--modal-retry-s", type=float, default=60.0, help="how long Modal's errors are retried")
        if name == "status":
            p.add_argument("--json", action="store_true", help="print the status as one JSON object")
        if name == "stop":
            p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the run to stop")
        if name == "report":
            p.add_argument("--out", default="report.html", help="the HTML file to write")
        p.set_defaults(func=func)
