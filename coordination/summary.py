"""The plan contract between the halves: what consumers and the driver need of an epoch plan
(`PlanSummary`: units, cells per rank, boundary cells, per-rank audit hashes), published by the
setup into the run's map and read without Lance; and the step counts every party derives from it."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from coordination.errors import CellfeedError
from coordination.queues import Map
from coordination.routing import cell_rank, summary_key, unit_rank


def steps_per_epoch(cells_per_rank: list[int], batch_size: int, grad_accum: int = 1) -> int:
    """Batches every rank takes: the same number on all ranks (the largest rank's), so DDP
    agrees on the step count with no communication; whole optimizer steps of `grad_accum`
    batches (the last one's filled with empty batches: a step cut short at an epoch's end would
    leave its batches' gradients to the next epoch's first step, or to none)."""
    batches = -(-max(cells_per_rank) // batch_size)
    return -(-batches // grad_accum) * grad_accum


def optimizer_steps(summaries: list, batch_size: int, grad_accum: int = 1) -> int:
    """Optimizer steps in these epochs (each epoch's batches, `grad_accum` to a step): the one
    count the setup, the trainer and the status line use."""
    return sum(s.steps(batch_size, grad_accum) // grad_accum for s in summaries)


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
    # whole cells of each unit, run-length encoded ([count, repeats], ...: a block plan's units are
    # all alike): what a resume on another number of ranks re-plans the epoch's rest from
    unit_cells: list[list[int]] = field(default_factory=list)
    # balanced sampling: [[class, cells planned], ...] in class order (the labels items carry index it)
    class_mix: list[list] = field(default_factory=list)

    @classmethod
    def of(cls, plan, world_size: int) -> "PlanSummary":
        return cls(
            plan.epoch,
            plan.plan_id,
            plan.n_units,
            plan.n_cells,
            world_size,
            plan.cells_per_rank(world_size).tolist(),
            plan.boundary_cells.tolist(),
            plan.boundary_piece_counts.tolist(),
            plan.cell_hash_per_rank(world_size),
            plan.boundary_piece_units.tolist(),
            run_lengths(plan.unit_cell_counts),
        )

    def cells_left_per_rank(self, world_size: int, unit_trained: dict, trained_stitched: set) -> list[int]:
        """On resume (on any number of ranks): the cells of this epoch not trained yet that each of
        `world_size` ranks will receive -- unit u's to rank u mod W, boundary cell c's to c mod W --
        from the cells trained of each unit (`unit_trained`) and the boundary cells trained."""
        if not self.unit_cells:
            raise CellfeedError(
                f"epoch {self.epoch}'s plan was published without its unit sizes (an older "
                "cellfeed): resume it on its own number of ranks"
            )
        counts = np.repeat([c for c, _ in self.unit_cells], [n for _, n in self.unit_cells]).astype(np.int64)
        for unit, cells in unit_trained.items():
            counts[int(unit)] -= cells
        left = np.bincount(unit_rank(np.arange(self.n_units), world_size), weights=counts, minlength=world_size)
        untrained = np.array([c for c in self.boundary_cells if c not in trained_stitched], dtype=np.int64)
        left += np.bincount(cell_rank(untrained, world_size), minlength=world_size)
        return left.astype(np.int64).tolist()

    def units_to_skip(self, done_units: set[int], trained_boundary_cells: set[int]) -> set[int]:
        """On resume: the units that need not be produced again -- those whose items were all
        trained on, less any holding a piece of a boundary cell not trained yet (stitching it
        needs every piece offered again)."""
        needed, at = set(), 0
        for cell, count in zip(self.boundary_cells, self.boundary_piece_counts):
            if cell not in trained_boundary_cells:
                needed.update(self.boundary_piece_units[at : at + count])
            at += count
        return set(done_units) - needed

    def units_missing(
        self,
        rank: int,
        world_size: int,
        complete_units: set,
        received_stitched: set,
        unit_trained: dict,
        trained_stitched: set,
    ) -> list[int]:
        """On a rank that waits for cells that do not come: the units whose items it should get and
        has not all got -- units routed to it (u mod W) with cells left for it (`unit_trained`: cells
        trained before a resume) and not in `complete_units` (every item's key seen) -- and the
        holders of every boundary cell routed to it that it has neither received nor trained
        (stitching it again needs each piece offered again)."""
        counts = np.repeat([c for c, _ in self.unit_cells], [n for _, n in self.unit_cells]).astype(np.int64)
        for unit, cells in unit_trained.items():
            counts[int(unit)] -= cells
        units = np.arange(self.n_units)
        mine = units[(unit_rank(units, world_size) == rank) & (counts > 0)]
        missing = {int(u) for u in mine.tolist() if int(u) not in complete_units}
        at = 0
        for cell, count in zip(self.boundary_cells, self.boundary_piece_counts):
            if cell_rank(cell, world_size) == rank and cell not in received_stitched and cell not in trained_stitched:
                missing.update(self.boundary_piece_units[at : at + count])
            at += count
        return sorted(missing)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "PlanSummary":
        return cls(**json.loads(data))

    def steps(self, batch_size: int, grad_accum: int = 1) -> int:
        return steps_per_epoch(self.cells_per_rank, batch_size, grad_accum)


def run_lengths(values) -> list[list[int]]:
    """[[value, repeats], ...] of a sequence of ints."""
    values = np.asarray(values, dtype=np.int64)
    if not len(values):
        return []
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
    return [[int(values[a]), int(n)] for a, n in zip(starts, np.diff(np.r_[starts, len(values)]))]


def publish_summary(store: Map, run: str, summary: PlanSummary) -> None:
    store.put(summary_key(run, summary.epoch), summary.to_bytes())


def load_summary(store: Map, run: str, epoch: int, timeout_s: float = 60.0) -> PlanSummary:
    """The epoch's summary, waiting up to `timeout_s` for the setup to publish it."""
    deadline = time.monotonic() + timeout_s
    while (data := store.get(summary_key(run, epoch))) is None:
        if time.monotonic() > deadline:
            raise CellfeedError(
                f"no plan published for epoch {epoch} of run {run!r} after {timeout_s:.0f}s: "
                "did the campaign's setup step run?"
            )
        time.sleep(0.1)
    return PlanSummary.from_bytes(data)


def class_mix_line(facts, audits: list[dict] = ()) -> str:
    """One line on the class mix of a balanced campaign (`SetupFacts.class_mix`): classes and their
    quotas per epoch against their cells in the data, and how many audited epochs trained every
    class at its quota. "" when the campaign is not balanced."""
    if not facts.class_mix:
        return ""
    planned = [p for _, p, _ in facts.class_mix]
    data = [d for _, _, d in facts.class_mix]
    exact, checked = epochs_at_quota(audits)
    return (
        f"classes by {facts.balance}: {len(planned)}, {min(planned):,}..{max(planned):,} cells each per epoch "
        f"(in the data {min(data):,}..{max(data):,})"
        + (f"; {exact} of {checked} epochs trained every class at its quota" if checked else "")
    )


def epochs_at_quota(audits: list[dict]) -> tuple[int, int]:
    """(epochs that trained every class at its quota, epochs whose classes were checked) of a
    balanced campaign's audits (`trainer.exactly_once.audit_epoch`)."""
    checked = [a for a in audits if "classes" in a]
    return sum(1 for a in checked if a["classes_at_quota"]), len(checked)


@dataclass(frozen=True)
class SetupFacts:
    """What the campaign's setup learnt (`app.campaign.prepare`), for the trainer and the status
    line; a dict across Modal calls. Here, not in `app/campaign.py`, because the GPU image
    imports it and must not import the setup's Lance readers."""

    n_genes: int  # genes in the vocabulary
    vocab_size: int
    pad_token: int
    mask_token: int
    special_tokens: tuple
    vocab_fingerprint: str
    epochs: int
    cells_per_epoch: int
    units_per_epoch: int
    units_total: int
    steps_per_epoch: int
    total_steps: int
    held_out_cells: int
    held_out_items: int  # what the eval partition holds when complete
    sources: tuple = ()  # per source: name, cells per epoch, coverage line
    data_id: str = ""  # the data's identity (`producers.dataset.Dataset.identity`, every source's), for checkpoints
    balance: str = ""  # balanced sampling: "COLUMN, ALPHA a" ("": none)
    class_mix: tuple = ()  # balanced: per class, [name, cells planned in epoch 0, its selected cells in the data]
    steps_estimated: bool = False  # the step counts are estimates: a token budget's steps take varying cells
    step_cells: int = 0  # a batch's cells: batch_size, or a token budget's estimate (`app.campaign.cells_per_step`)

    @classmethod
    def of(cls, facts: "SetupFacts | dict") -> "SetupFacts":
        return facts if isinstance(facts, cls) else cls(**facts)
