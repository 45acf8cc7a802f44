"""A campaign's monitor: every few seconds, where the campaign stands (`app.status.snapshot`) goes
into its journal (`app.journal`: `cellfeed status` reads it), the queue's and producers' scalars
into TensorBoard beside the trainer's, and a stop request (`cellfeed stop`) is looked for. The same
object serves `cellfeed local` (a run folder's journal) and Modal's `train` (the run's Dict)."""

from __future__ import annotations

import time
from pathlib import Path

from app.config import CampaignConfig
from app.journal import Journal
from app.status import CampaignScalars, StepLog, snapshot


class Monitor:
    """`every_s`: how often a snapshot is published (on Modal each is 2 Dict calls and a queue length
    per rank); `stop_every_s`: how often a stop request is looked for (a file locally, a Dict get on
    Modal), so a stop takes effect within about that long; `tb_dir`: where the trainer's TensorBoard
    files are (the run folder's tb/, or on Modal the Volume's).

    Made before the ranks start, and looked at once then: `cellfeed status` answers from the first
    step on, however loaded the machine (TensorBoard's import, seconds under load, is not waited for
    before the first snapshot)."""

    def __init__(
        self, cfg: CampaignConfig, facts, queue, store, journal: Journal, log: Path, names, resume: str,
        tb_dir: str | Path, every_s: float, stop_every_s: float = 0.5,
    ):  # fmt: skip
        self.cfg, self.facts, self.queue, self.store, self.journal = cfg, facts, queue, store, journal
        self.names, self.resume, self.every_s, self.stop_every_s = list(names), resume, every_s, stop_every_s
        self.steps, self.scalars = StepLog(log), CampaignScalars(tb_dir)
        self.started, self.asked, self.due, self.stop_due = time.time(), None, 0.0, 0.0

    def snapshot(self, state: str, codes: list | None = None) -> dict:
        codes = codes if codes is not None else [None] * len(self.names)
        return snapshot(
            self.cfg,
            self.facts,
            self.queue,
            self.store,
            self.steps,
            self.started,
            self.names,
            codes,
            state,
            self.resume,
        )

    def look(self, codes: list | None = None) -> dict | None:
        """Notes a stop request in `asked` (every `stop_every_s`); returns the snapshot, published,
        when one is due (else None). A failure here (the Dict, the Volume, TensorBoard's writer) is
        said and the campaign goes on: the status is a report, not part of training."""
        now = time.monotonic()
        try:
            if self.asked is None and now >= self.stop_due:
                self.stop_due = now + self.stop_every_s
                if self.journal.stop_asked():
                    self.ask("cellfeed stop", self.steps.last["step"] if self.steps.last else None)
            if now < self.due:
                return None
            self.due = now + self.every_s
            snap = {**self.snapshot("stopping" if self.asked else "running", codes), "stop_asked": self.asked}
            self.journal.write_state(snap)  # (first: the status does not wait for TensorBoard)
            self.scalars.add(snap)
        except Exception as exc:  # noqa: BLE001 - see above
            print(f"the campaign's status was not published ({type(exc).__name__}: {exc})", flush=True)
            return None
        return snap

    def ask(self, by: str, step: int | None = None) -> None:
        """A stop was asked (by `cellfeed stop`, or Ctrl-C): noted once, in the journal's events."""
        if self.asked is None:
            self.asked = by
            self.journal.event("stop asked", by=by, step=step)

    def final(self, state: str, codes: list | None = None, **extra) -> dict | None:
        """The campaign's last snapshot and event (`state`: complete, stopped, failed, interrupted, incomplete)."""
        try:
            snap = self.snapshot(state, codes)
            for p in snap["producers"]:  # (they stop with the campaign, now)
                p["state"] = f"stopped with the campaign, {p['cells']:,} cells made"
            self.journal.write_state(
                {**snap, "resume": self.resume if state != "complete" else "", **extra}, final=True
            )
            self.journal.event(state, step=snap["step"])
            self.scalars.close()
            return snap
        except Exception as exc:  # noqa: BLE001 - the status is a report: the campaign's own end matters more
            print(f"could not record the campaign's last status ({type(exc).__name__}: {exc})", flush=True)
            return None
