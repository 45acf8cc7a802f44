"""The exactly-once audit's hash: an order-independent hash of a multiset of cell ids, which the
plan computes per rank and each rank keeps for the cells it trained (checkpointed)."""

from __future__ import annotations

import numpy as np

from coordination.feistel import mix64

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
