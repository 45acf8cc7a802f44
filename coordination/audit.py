"""The exactly-once audit's hash: an order-independent hash of a multiset of cell ids, which the
plan computes per rank and each rank keeps for the cells it trained (checkpointed)."""

from __future__ import annotations

import numpy as np

from coordination.feistel import mix64
from coordination.summary import load_summary

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def cell_hashes(cells) -> np.ndarray:
    """Each cell id's 64-bit hash (splitmix64 of id + 1: no id hashes to 0)."""
    with np.errstate(over="ignore"):
        return mix64((np.asarray(cells, dtype=np.int64).astype(np.uint64) + np.uint64(1)) * _GOLDEN)


def cells_hash(cells) -> int:
    """An order-independent hash of a multiset of cell ids: the sum of their hashes mod 2**64.
    A rank's trained cells hash to the plan's value exactly when (but for a 2**-64 chance) they
    are the planned cells, each once: a lost and a duplicated cell do not cancel."""
    return int(cell_hashes(cells).sum(dtype=np.uint64))


def verdict(epochs: list[dict], stopped: str | None = None, steps: int | None = None) -> tuple[bool, str]:
    """A run's last line, and whether it did all it was asked. `epochs`: every asked epoch's
    `{"epoch", "planned", "trained", "audited"}` (the trainer's ledger, across resumes);
    `stopped`: "steps" (an explicit `--steps` run reached them) or "asked" (the user asked it to
    stop), else None. A run that trained every epoch's planned cells, each audited, is complete;
    one stopped by `--steps` or by the user says where it stopped and is not a failure; anything
    else -- an epoch short, over, not audited, not reached -- is INCOMPLETE, with the numbers."""

    def cells(e):
        return f"epoch {e['epoch']}: {e['trained']:,} of {e['planned']:,} cells"

    total = sum(e["planned"] for e in epochs)
    if epochs and all(e["trained"] == e["planned"] and e["audited"] for e in epochs):
        return True, (
            f"complete: {len(epochs)} epoch{'s' * (len(epochs) != 1)}, {total:,} cells, every epoch "
            "trained exactly once (audited)"
        )
    short = [e for e in epochs if not (e["trained"] == e["planned"] and e["audited"])]
    if stopped in ("steps", "asked"):
        why = f"at step {steps:,} as --steps asked" if stopped == "steps" else f"at step {steps or 0:,} as asked"
        started = [cells(e) for e in short if e["trained"]]
        return True, (
            f"stopped {why}: " + "; ".join([f"{len(epochs) - len(short)} of {len(epochs)} epochs complete"] + started)
        )
    parts = []
    for e in short:
        if e["trained"] == e["planned"]:
            parts.append(f"epoch {e['epoch']}: {e['trained']:,} cells trained but not audited")
        elif e["trained"] == 0:
            parts.append(f"epoch {e['epoch']}: not trained ({e['planned']:,} cells planned)")
        else:
            parts.append(cells(e) + " trained")
    return False, "INCOMPLETE: " + "; ".join(parts)


def epoch_ledger(
    run: str, epochs: int, store, summaries: dict, audits: list[dict], epoch: int, in_progress: int | None
) -> list[dict]:
    """Every asked epoch: cells planned, cells trained (in this run and the runs it resumed), and
    whether its exactly-once audit passed: what the run's last line is made of (`verdict`).
    `audits`: the epochs finished (this run's and the checkpoint's); `in_progress`: every rank's
    cells of `epoch` so far, when the run stopped inside it."""
    done = {a["epoch"]: a for a in audits}
    out = []
    for e in range(epochs):
        summary = summaries.get(e)
        if summary is None:
            summary = summaries[e] = load_summary(store, run, e)
        planned = sum(summary.cells_per_rank)
        if e in done:
            out.append({"epoch": e, "planned": planned, "trained": done[e]["cells"], "audited": done[e]["audited"]})
        else:
            out.append(
                {
                    "epoch": e,
                    "planned": planned,
                    "trained": in_progress if e == epoch and in_progress else 0,
                    "audited": False,
                }
            )
    return out
