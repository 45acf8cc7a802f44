"""The driver: feeds an epoch's units to producers as tasks, re-issues units whose lease expired
(or that nobody took), knows when the epoch is complete, then clears its stitching keys.

It needs only each epoch's `PlanSummary` (unit count, cells per rank, boundary cells), which the
campaign's setup publishes into the map, so it runs anywhere — in the trainer's rank 0 (a
detached Modal campaign needs no laptop) or beside a local campaign — without Lance.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from coordination.errors import CellfeedError
from coordination.queues import Full, Map, Queue
from coordination.routing import TASKS_PARTITION, done_key, encode_task, lease_key


def steps_per_epoch(cells_per_rank: list[int], batch_size: int) -> int:
    """Batches every rank takes: the same number on all ranks (the largest rank's), so DDP
    agrees on the step count with no communication."""
    return -(-max(cells_per_rank) // batch_size)


@dataclass
class PlanSummary:
    """What consumers and the driver need of an epoch plan (JSON, well under 1 MiB for Tahoe)."""

    epoch: int
    plan_id: str
    n_units: int
    n_cells: int
    world_size: int
    cells_per_rank: list[int]
    boundary_cells: list[int] = field(default_factory=list)
    boundary_piece_counts: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, plan, world_size: int) -> "PlanSummary":
        return cls(plan.epoch, plan.plan_id, plan.n_units, plan.n_cells, world_size,
                   plan.cells_per_rank(world_size).tolist(), plan.boundary_cells.tolist(),
                   plan.boundary_piece_counts.tolist())

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "PlanSummary":
        return cls(**json.loads(data))

    def steps(self, batch_size: int) -> int:
        return steps_per_epoch(self.cells_per_rank, batch_size)


def summary_key(run: str, epoch: int) -> str:
    return f"{run}/plan/e{epoch}"


def publish_summary(store: Map, run: str, summary: PlanSummary) -> None:
    store.put(summary_key(run, summary.epoch), summary.to_bytes())


def load_summary(store: Map, run: str, epoch: int, timeout_s: float = 60.0) -> PlanSummary:
    """The epoch's summary, waiting up to `timeout_s` for the setup to publish it."""
    deadline = time.monotonic() + timeout_s
    while (data := store.get(summary_key(run, epoch))) is None:
        if time.monotonic() > deadline:
            raise CellfeedError(f"no plan published for epoch {epoch} of run {run!r} after {timeout_s:.0f}s: "
                                "did the campaign's setup step run?")
        time.sleep(0.1)
    return PlanSummary.from_bytes(data)


@dataclass
class DriverStats:
    issued: int = 0
    reissued: int = 0
    epochs: int = 0


class Driver:
    def __init__(self, queue: Queue, store: Map, run: str, *, lease_s: float = 120.0, poll_s: float = 0.2,
                 max_queued_tasks: int = 1000, stall_timeout_s: float = 600.0):
        self.queue, self.store, self.run = queue, store, run
        self.lease_s, self.poll_s = lease_s, poll_s
        self.max_queued_tasks = max_queued_tasks
        self.stall_timeout_s = stall_timeout_s
        self.stats = DriverStats()
        self._stop = threading.Event()

    def _issue(self, epoch: int, units: list[int]) -> list[int]:
        """Put tasks (as many as fit now); returns the units issued."""
        if not units:
            return []
        try:
            self.queue.put_many([encode_task(epoch, u) for u in units], block=True, timeout=self.poll_s,
                                partition=TASKS_PARTITION)
        except Full:
            return []
        self.stats.issued += len(units)
        return units

    def _expired(self, epoch: int, unit: int, issued_at: float, now: float) -> bool:
        lease = self.store.get(lease_key(self.run, epoch, unit))
        if lease is None:  # nobody holds it: lost (a producer died between taking and leasing) or not taken
            return now - issued_at > self.lease_s and self.queue.len(partition=TASKS_PARTITION) == 0
        return json.loads(lease)["expires"] < time.time()

    def run_epoch(self, summary: PlanSummary, skip_units: set[int] = frozenset()) -> None:
        """Drive one epoch to completion (every unit done), then clear its coordination keys."""
        epoch = summary.epoch
        todo = [u for u in range(summary.n_units) if u not in skip_units]
        in_flight: dict[int, float] = {}  # unit -> when it was (re-)issued
        last_progress = time.monotonic()
        while (todo or in_flight) and not self._stop.is_set():
            room = self.max_queued_tasks - self.queue.len(partition=TASKS_PARTITION)
            if room > 0 and todo:
                issued = self._issue(epoch, todo[:room])
                now = time.monotonic()
                in_flight.update({u: now for u in issued})
                todo = todo[len(issued):]
            now = time.monotonic()
            for unit, issued_at in list(in_flight.items()):
                if self.store.get(done_key(self.run, epoch, unit)) is not None:
                    del in_flight[unit]
                    last_progress = now
                elif self._expired(epoch, unit, issued_at, now):
                    if self._issue(epoch, [unit]):
                        in_flight[unit] = now
                        self.stats.reissued += 1
            if now - last_progress > self.stall_timeout_s:
                raise CellfeedError(
                    f"epoch {epoch}: no unit finished in {self.stall_timeout_s:.0f}s with {len(in_flight) + len(todo)} "
                    "left: are the producers running?"
                )
            if todo or in_flight:
                self._stop.wait(self.poll_s)
        if not self._stop.is_set():
            self.forget(summary)
            self.stats.epochs += 1

    def forget(self, summary: PlanSummary) -> None:
        """Remove an epoch's stitching, lease and done keys (its boundary cells are all emitted)."""
        from producers.stitch import forget_epoch  # the stitching protocol owns its key names

        forget_epoch(self.store, self.run, summary.epoch, np.asarray(summary.boundary_cells, dtype=np.int64),
                     np.asarray(summary.boundary_piece_counts, dtype=np.int64))
        for unit in range(summary.n_units):
            self.store.pop(done_key(self.run, summary.epoch, unit), None)
            self.store.pop(lease_key(self.run, summary.epoch, unit), None)

    def run_epochs(self, epochs: list[int], summary_timeout_s: float = 60.0,
                   resume_epoch: int | None = None) -> DriverStats:
        """Drive epochs in order. `resume_epoch`: an epoch a restarted trainer resumes mid-way —
        its old done marks and stitching state are cleared and every unit is issued again (the
        consumers drop what they already trained on by key)."""
        for epoch in epochs:
            if self._stop.is_set():
                break
            summary = load_summary(self.store, self.run, epoch, summary_timeout_s)
            if epoch == resume_epoch:
                self.forget(summary)
            self.run_epoch(summary)
        return self.stats

    def start(self, epochs: list[int], resume_epoch: int | None = None) -> threading.Thread:
        """Run the epochs in a background thread (e.g. inside trainer rank 0); errors are kept in
        `self.error`."""
        self.error: BaseException | None = None

        def target():
            try:
                self.run_epochs(epochs, resume_epoch=resume_epoch)
            except BaseException as exc:  # noqa: BLE001 - reported by the owner
                self.error = exc

        thread = threading.Thread(target=target, daemon=True, name="cellfeed-driver")
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
