"""A campaign's journal: what `cellfeed status`, `cellfeed stop` and `cellfeed report` read, for a
campaign running now or one that has ended, without touching its processes.

The campaign's own process (the `cellfeed local` monitor; on Modal, `train`'s watch loop) keeps it:

    state.json     the latest snapshot (`app.status.snapshot`): state, step, rates, queue depth,
                   producers, last checkpoint, ETA, the command that resumes it. Rewritten every few
                   seconds (atomically: a reader never sees half of one) and once more at the end.
    events.jsonl   one line per event: started, resumed, stop asked, producer restarted, stopped,
                   failed, complete (the report's timeline)
    stop           present while a stop is asked (`cellfeed stop`); a campaign clears it at its start

Local runs keep these in the run folder (WORKDIR/RUN, beside steps.jsonl). A Modal campaign keeps
its live snapshot and a stop request in the run's modal.Dict (`coordination.routing.state_key`,
`stop_asked_key`: seconds to read from a laptop, no GPU started), and these files in its checkpoint
folder on the Volume, where they outlive the Dict (deleted when the campaign completes)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STALE_S = 30.0  # a "running" snapshot older than this: the process that kept it is gone (killed)


class Journal:
    """A run folder's journal files."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)

    def event(self, kind: str, **fields) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / "events.jsonl", "a") as f:
            f.write(json.dumps({"t": time.time(), "event": kind, **fields}) + "\n")

    def events(self) -> list[dict]:
        path = self.folder / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def write_state(self, snapshot: dict, final: bool = False) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".state.json.{os.getpid()}"
        tmp.write_text(json.dumps(snapshot))
        os.replace(tmp, self.folder / "state.json")

    def read_state(self) -> dict | None:
        path = self.folder / "state.json"
        return json.loads(path.read_text()) if path.exists() else None

    def ask_stop(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "stop").write_text(f"{time.time()}\n")

    def stop_asked(self) -> bool:
        return (self.folder / "stop").exists()

    def clear_stop(self) -> None:
        (self.folder / "stop").unlink(missing_ok=True)


class DictJournal(Journal):
    """A Modal campaign's journal: the live snapshot and the stop request in the run's modal.Dict
    (`store`), the events and the final snapshot in `folder` (the run's checkpoint folder on the
    Volume)."""

    def __init__(self, store, run: str, folder: str | os.PathLike | None = None):
        super().__init__(folder or ".")
        self.store, self.run, self.has_folder = store, run, folder is not None

    def event(self, kind: str, **fields) -> None:
        if self.has_folder:
            super().event(kind, **fields)

    def write_state(self, snapshot: dict, final: bool = False) -> None:
        from coordination.routing import state_key

        self.store.put(state_key(self.run), json.dumps(snapshot))
        if final and self.has_folder:
            super().write_state(snapshot)

    def read_state(self) -> dict | None:
        from coordination.routing import state_key

        value = self.store.get(state_key(self.run))
        return json.loads(value) if value else None

    def ask_stop(self) -> None:
        from coordination.routing import stop_asked_key

        self.store.put(stop_asked_key(self.run), str(time.time()))

    def stop_asked(self) -> bool:
        from coordination.routing import stop_asked_key

        return self.store.get(stop_asked_key(self.run)) is not None

    def clear_stop(self) -> None:
        from coordination.routing import stop_asked_key

        self.store.pop(stop_asked_key(self.run), None)


def seen_state(snapshot: dict | None, now: float | None = None) -> str:
    """The state a reader should believe: a "running" snapshot that has not been refreshed for
    STALE_S was left by a process that is gone (killed, or its machine lost): "incomplete"."""
    if snapshot is None:
        return "unknown"
    state = snapshot.get("state", "unknown")
    if state in ("running", "stopping") and (now or time.time()) - snapshot.get("updated", 0) > STALE_S:
        return "incomplete"
    return state
