"""Small vectorised helpers on ragged arrays, shared by readers, producers and consumers."""

from __future__ import annotations

import numpy as np


def ragged_arange(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start, stop) for each pair, without a Python loop."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(stops, dtype=np.int64) - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return np.arange(total, dtype=np.int64) + shift


def offsets_of(counts: np.ndarray) -> np.ndarray:
    """[0, c0, c0+c1, ...]: CSR offsets from per-row counts."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def positions_in_ranges(ranges: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Where global rows land when the sorted, disjoint `ranges` are read and concatenated."""
    ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    i = np.searchsorted(ranges[:, 0], rows, side="right") - 1
    return offsets_of(ranges[:, 1] - ranges[:, 0])[i] + np.asarray(rows, dtype=np.int64) - ranges[i, 0]


def merge_ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Sorted [start, stop) ranges with touching neighbours merged; empty ranges dropped."""
    keep = stops > starts
    starts, stops = starts[keep], stops[keep]
    if len(starts) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], stops[order]
    new = np.ones(len(starts), dtype=bool)
    new[1:] = starts[1:] > stops[:-1]
    merged_stops = np.maximum.reduceat(stops, np.flatnonzero(new))
    return np.stack([starts[new], merged_stops], axis=1).astype(np.int64)


def bridge_gaps(ranges: np.ndarray, max_gap: int) -> np.ndarray:
    """Sorted, disjoint ranges with every gap of at most `max_gap` rows bridged: fewer, longer reads
    of which the reader keeps only the rows it needs (a call costs more than that many rows)."""
    ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    if len(ranges) < 2:
        return ranges
    new = np.ones(len(ranges), dtype=bool)
    new[1:] = ranges[1:, 0] - ranges[:-1, 1] > max_gap
    starts = np.flatnonzero(new)
    return np.stack([ranges[starts, 0], np.maximum.reduceat(ranges[:, 1], starts)], axis=1)
