"""How well shuffled are the batches a trainer receives? Scores the field uses, over batches of
cell ids and labels, and scDataset's bounds for block sampling with batched fetching.

- `entropy_bits`: Shannon entropy (bits) of a label (e.g. plate) within one batch; compare with
  batches drawn truly at random from the same cells.
- `index_score`: the mean |id_i - id_j| over pairs of cells in a batch, scaled so that a batch of
  consecutive ids scores 0 and a batch of uniformly random ids scores 1 (in expectation).
- `block_entropy_bounds`: H(p) - (K-1)·b/(2m·ln 2) <= E[H] <= H(p) - (K-1)/(2m·ln 2) for block
  size b, batch size m and K labels with proportions p (scDataset). The terms are the
  Miller-Madow bias of an entropy estimate from m/b (lower) or m (upper) samples, accurate when
  those are many more than K; with 16 blocks of 4 and K = 14 a simulation lands 0.11 bits below
  the "lower" bound (tests/test_sampling_quality.py).
"""

from __future__ import annotations

import math

import numpy as np


def entropy_bits(labels: np.ndarray) -> float:
    """Shannon entropy (bits) of the labels of one batch."""
    _, counts = np.unique(np.asarray(labels), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def mean_pair_distance(ids: np.ndarray) -> float:
    """Mean |id_i - id_j| over the m(m-1)/2 pairs of a batch, in O(m log m): with the ids sorted,
    the k-th smallest (0-based) is the larger of k pairs and the smaller of m-1-k."""
    x = np.sort(np.asarray(ids, dtype=np.float64))
    m = len(x)
    if m < 2:
        return 0.0
    return float((x * (2 * np.arange(m) - m + 1)).sum() / (m * (m - 1) / 2))


def index_score(ids: np.ndarray, n_cells: int) -> float:
    """`mean_pair_distance` of a batch scaled so that consecutive ids give 0 and ids drawn
    uniformly from 0..n_cells-1 give 1 in expectation: (d - (m+1)/3) / ((n+1)/3 - (m+1)/3), where
    (m+1)/3 is the mean pair distance of m consecutive ids and (n+1)/3 that of two distinct ids
    drawn without replacement from n."""
    m = len(ids)
    sequential, uniform = (m + 1) / 3, (n_cells + 1) / 3
    if uniform <= sequential:
        raise ValueError(f"a batch of {m} from {n_cells} cells cannot be scored: it holds (nearly) all of them")
    return (mean_pair_distance(ids) - sequential) / (uniform - sequential)


def block_entropy_bounds(proportions: np.ndarray, block_size: int, batch_size: int) -> tuple[float, float]:
    """scDataset's sandwich bound on the expected per-batch label entropy (bits) of block sampling
    with batched fetching: (lower, upper)."""
    p = np.asarray(proportions, dtype=np.float64)
    p = p[p > 0] / p.sum()
    h = float(-(p * np.log2(p)).sum())
    k = len(p)
    step = (k - 1) / (2 * batch_size * math.log(2))
    return h - block_size * step, h - step
