"""The plan contract between the halves: what consumers and the driver need of an epoch plan
(`PlanSummary`: units, cells per rank, boundary cells, per-rank audit hashes), published by the
setup into the run's map and read without Lance; and the step counts every party derives from it."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from coordination.errors import CellfeedError
from coordination.queues import Map
from coordination.routing import summary_key



def steps_per_epoch(cells_per_rank: list[int], batch_size: int) -> int:
    """Batches every rank takes: the same number on all ranks (the largest rank's), so DDP
    agrees on the step count with no communication."""
    return -(-max(cells_per_rank) // batch_size)


def optimizer_steps(summaries: list, batch_size: int, grad_accum: int = 1) -> int:
    """Optimizer steps in these epochs (each epoch's batches, `grad_accum` to a step): the one
    count the setup, the trainer and the status line use."""
    return sum(s.steps(batch_size) // grad_accum for s in summaries)


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
    cell_hash_per_rank: list[int] = field(default_factory=list)  # `cells_hash` per rank; empty: not audited
    boundary_piece_units: list[int] = field(default_factory=list)  # the unit of each boundary piece, cell by cell

    @classmethod
    def of(cls, plan, world_size: int) -> "PlanSummary":
        return cls(plan.epoch, plan.plan_id, plan.n_units, plan.n_cells, world_size,
                   plan.cells_per_rank(world_size).tolist(), plan.boundary_cells.tolist(),
                   plan.boundary_piece_counts.tolist(), plan.cell_hash_per_rank(world_size),
                   plan.boundary_piece_units.tolist())

    def units_to_skip(self, done_units: set[int], trained_boundary_cells: set[int]) -> set[int]:
        """On resume: the units that need not be produced again -- those whose items were all
        trained on, less any holding a piece of a boundary cell not trained yet (stitching it
        needs every piece offered again)."""
        needed, at = set(), 0
        for cell, count in zip(self.boundary_cells, self.boundary_piece_counts):
            if cell not in trained_boundary_cells:
                needed.update(self.boundary_piece_units[at:at + count])
            at += count
        return set(done_units) - needed

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "PlanSummary":
        return cls(**json.loads(data))

    def steps(self, batch_size: int) -> int:
        return steps_per_epoch(self.cells_per_rank, batch_size)


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
