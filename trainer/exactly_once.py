"""A rank's side of exactly-once: asking the driver again for the units whose items never came
(`ask_again`), and the end-of-epoch audit of the cells every rank trained against the plan
(`audit_epoch`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from coordination.errors import CellfeedError
from coordination.queues import Full
from coordination.routing import EVENTS_PARTITION, encode_event
from coordination.summary import load_summary
from trainer import checkpoint
from trainer.config import TrainConfig

MAX_REDO_UNITS = 4000  # units one request names (~50 KB of JSON); the rest at the next request


def ask_again(
    queue,
    store,
    cfg: TrainConfig,
    rank: int,
    world: int,
    epoch: int,
    batches,
    summaries: dict,
    before: checkpoint.RankProgress,
) -> None:
    """This rank has waited for cells that do not come: ask the driver for the units whose items
    never reached it (`PlanSummary.units_missing`; `before`: what a checkpoint says was trained of
    the epoch it resumed). The driver produces again only those it has finished."""
    summary = summaries.get(epoch) or load_summary(store, cfg.run, epoch)
    resumed = before.epoch == epoch
    missing = summary.units_missing(
        rank,
        world,
        batches.complete_units(),
        batches.stitched_received,
        before.unit_trained if resumed else {},
        before.trained_stitched() if resumed else set(),
    )
    if not missing:
        return
    try:
        queue.put_many(
            [encode_event(f"rank-{rank}", redo=[(epoch, u) for u in missing[:MAX_REDO_UNITS]])],
            block=True,
            timeout=5.0,
            partition=EVENTS_PARTITION,
        )
    except Full:
        pass  # the events are backed up: the next request, a few seconds on


def audit_epoch(epoch: int, progress: checkpoint.RankProgress, summary, world: int, device) -> dict:
    """The end-of-epoch exactly-once check, on every rank: each rank's trained-cell count and the
    order-independent hash of their ids (`coordination.audit.cells_hash`, kept in checkpoints
    across restarts) against the plan's. An epoch resumed from a checkpoint (on any number of
    ranks) is checked as a whole: the cells trained before (carried by rank 0) and by every rank
    since, against the whole plan. Raises, naming the rank where it can, when cells were lost or
    duplicated; cheap at any scale (one all-gather of five numbers per rank)."""

    def signed(h):
        return 0 if h is None else h - 2**64 if h >= 2**63 else h

    h, c = progress.cells_hash, progress.carried_hash
    mine = torch.tensor(
        [progress.trained, signed(h), h is not None and c is not None, progress.carried, signed(c)],
        dtype=torch.int64,
        device=device,
    )
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    counts = [int(t[0]) for t in every]
    hashes = [int(t[1]) % 2**64 for t in every]
    carried, carried_hash = sum(int(t[3]) for t in every), sum(int(t[4]) for t in every) % 2**64
    trained, expected = sum(counts) + carried, sum(summary.cells_per_rank)
    if not summary.cell_hash_per_rank or not all(int(t[2]) for t in every):
        return {
            "epoch": epoch,
            "cells": trained,
            "audited": False,
            "line": f"epoch {epoch}: {trained:,} cells trained (not audited: the plan or a checkpoint predates it)",
        }
    fail = (
        "epoch {epoch} failed its exactly-once audit: {who} trained {what} ({got:,} of {want:,}): cells were lost "
        "or duplicated; the last checkpoint is kept, and --audit-cells records which cells each step trained"
    )
    checks = (
        [
            ("rank " + str(r), counts[r], hashes[r], summary.cells_per_rank[r], summary.cell_hash_per_rank[r])
            for r in range(world)
        ]
        if not carried
        else [
            (
                "the resumed epoch's ranks, before and after",
                trained,
                (sum(hashes) + carried_hash) % 2**64,
                expected,
                sum(summary.cell_hash_per_rank) % 2**64,
            )
        ]
    )
    for who, got, got_hash, want, want_hash in checks:
        if got != want or got_hash != want_hash:
            what = (
                f"{want - got:,} fewer"
                if got < want
                else f"{got - want:,} more"
                if got > want
                else "the planned number of"
            ) + (" cells than planned" if got != want else " cells, but not the planned cells")
            raise CellfeedError(fail.format(epoch=epoch, who=who, what=what, got=got, want=want))
    scope = "every rank" if not carried else "the whole epoch, across the resume"
    out = {
        "epoch": epoch,
        "cells": trained,
        "audited": True,
        "missing": 0,
        "duplicated": 0,
        "line": f"epoch {epoch}: {trained:,} cells trained, 0 missing, 0 duplicated "
        f"(of {expected:,} planned; count and cell-id hash checked on {scope})",
    }
    if summary.class_mix:  # balanced: the cells trained per class, every rank's summed, against the quotas
        classes = class_counts(progress, summary, device)
        planned = [n for _, n in summary.class_mix]
        out.update(classes=classes, classes_at_quota=classes == planned)
        out["line"] += (
            f"; {len(planned)} classes at their quotas ({min(planned):,}..{max(planned):,} cells)"
            if out["classes_at_quota"]
            else f"; classes off their quotas by {sum(abs(a - b) for a, b in zip(classes, planned)):,} cells"
        )
    return out


def class_counts(progress: checkpoint.RankProgress, summary, device) -> list[int]:
    """(a collective) The cells every rank trained per class of a balanced campaign, summed."""
    classes = torch.tensor([progress.labels.get(k, 0) for k in range(len(summary.class_mix))], device=device)
    dist.all_reduce(classes)
    return [int(n) for n in classes.tolist()]
