"""Ragged arrays: `CellRows`, the one container of cells from the rows a dataset reads to the
tokens the wire packs, and small vectorised helpers shared by readers, producers and consumers."""

from __future__ import annotations

from dataclasses import dataclass

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


def rows_of_spans(ranges: np.ndarray, spans: np.ndarray, *arrays: np.ndarray) -> list[np.ndarray]:
    """Each array's rows of `spans` ([start, stop) global rows, in the order given: ascending,
    repeated or shuffled), out of arrays read through the sorted, disjoint `ranges` (which hold every
    span) and concatenated: a slice per run of spans that lie end to end in what was read. (An index
    of every row instead took 43-49 ms of CPU for a balanced 4,000-cell unit's ~7M rows, against
    9-15 ms as slices; a balanced unit's cells repeat where a small class is drawn again.)"""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    lengths = spans[:, 1] - spans[:, 0]
    if not lengths.sum():  # (no rows: no spans, or only empty cells, which no range holds)
        return [x[:0] for x in arrays]
    first = positions_in_ranges(ranges, spans[:, 0])  # where each span starts in the arrays read
    new_run = np.ones(len(spans), dtype=bool)
    new_run[1:] = first[1:] != first[:-1] + lengths[:-1]
    at = np.flatnonzero(new_run)
    cuts = [slice(a, a + n) for a, n in zip(first[at].tolist(), np.add.reduceat(lengths, at).tolist())]
    return [np.concatenate([x[c] for c in cuts]) for x in arrays]


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


@dataclass
class CellRows:
    """Cells as ragged rows: cell i owns rows offsets[i]:offsets[i+1] (any order within). The one
    container of a unit's cells from the read to the wire: `producers.dataset.Dataset.read_cells`
    gives a unit's cells in it (`ids`: gene ids as read), a tokenizer (`producers.tokenizers`)
    maps their genes to token ids and turns each cell's rows into its token sequence, special
    tokens included, and `coordination.wire.pack_cells` packs that into items."""

    cell_ids: np.ndarray  # int64[n]
    offsets: np.ndarray  # int64[n + 1]
    ids: np.ndarray  # gene ids, or token ids
    values: np.ndarray | None  # expression values (bins or raw values once tokenized; None: none ride along)
    # each cell's total over all its genes, those outside the vocabulary included (Geneformer
    # normalises by it); None: the sum of the rows here
    totals: np.ndarray | None = None

    @property
    def n_cells(self) -> int:
        return len(self.cell_ids)

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)

    def cell_of_row(self) -> np.ndarray:
        return np.repeat(np.arange(self.n_cells, dtype=np.int64), self.counts)

    def take(self, rows: np.ndarray, offsets: np.ndarray) -> "CellRows":
        """The same cells with rows `rows` (of these), cut at `offsets`."""
        return CellRows(self.cell_ids, offsets, self.ids[rows], self.values[rows], self.totals)

    def slice(self, lo: int, hi: int) -> "CellRows":
        """Cells lo..hi-1: views of these arrays, no copy."""
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        return CellRows(
            self.cell_ids[lo:hi],
            self.offsets[lo : hi + 1] - a,
            self.ids[a:b],
            None if self.values is None else self.values[a:b],
            None if self.totals is None else self.totals[lo:hi],
        )

    def select(self, cells: np.ndarray) -> "CellRows":
        """The cells at positions `cells`, in that order, their rows gathered into arrays of their
        own (a run of consecutive cells: `slice`, no copy)."""
        cells = np.asarray(cells, dtype=np.int64)
        if len(cells) and cells[-1] - cells[0] == len(cells) - 1 and bool(np.all(np.diff(cells) == 1)):
            return self.slice(int(cells[0]), int(cells[-1]) + 1)
        starts, stops = self.offsets[cells], self.offsets[cells + 1]
        rows = ragged_arange(starts, stops)
        return CellRows(
            self.cell_ids[cells],
            offsets_of(stops - starts),
            self.ids[rows],
            None if self.values is None else self.values[rows],
            None if self.totals is None else self.totals[cells],
        )
