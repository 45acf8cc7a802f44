"""Packing: a batch's cells laid end to end in rows of at most `tokens_per_row` tokens, so the
model does not compute each short cell's padding (`--tokens-per-row`; unset, each cell is a row
padded to the longest). What is left is each row's tail. With varlen attention (CUDA's default) each
cell is a sequence of its own (`spans_of`), so attention computes a cell's own pairs and the tail's
within short pieces; the dense per-cell mask (the CPU's) still computes every pair of a row.

Where: in the trainer's collate, on the host, over the cells the mixing buffer drew for one
batch. The producers cannot do it: which cells share a batch is decided by each rank's random
draw, after the items are made. The cells of a batch are the same either way, so the learning-rate
schedule, the audit and exactly-once (all counted in cells) do not change.

How: best fit, longest first (each cell into the fullest row it still fits, else a new row), at
most `MAX_CELLS_PER_ROW` cells a row. Each position carries its cell's index in the batch
(`segments`; -1 on padding); the model lets a position attend only to positions of the same
segment, so every cell sees exactly what it would see alone (no positional embedding here: a
cell is a set of genes, so where it sits in its row changes nothing).
"""

from __future__ import annotations

import bisect

import numpy as np

from coordination.errors import CellfeedError

MAX_CELLS_PER_ROW = 32  # bounds a row's hidden positions (`model.masked_loss` sizes the head's by it)
PADDING_SPAN = 128  # a row's padding tail attends within pieces this long (`spans_of`: varlen attention)


def within_budget(lengths, tokens: int) -> int:
    """How many cells of `lengths` tokens, from the first, fit `tokens` tokens (a token-budget
    batch: `--tokens-per-batch`): at least one (the campaign refuses a budget below its longest cell)."""
    return max(1, int(np.searchsorted(np.cumsum(np.asarray(lengths, dtype=np.int64)), tokens, side="right")))


def pack_rows(lengths: np.ndarray, tokens_per_row: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Each cell's row and start in it, and the row count, for cells of `lengths` tokens packed
    best fit, longest first. A cell longer than a row is refused (the campaign checks
    --tokens-per-row against the longest sequence before it starts)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > tokens_per_row:
        raise CellfeedError(
            f"a cell of {int(lengths.max())} tokens does not fit a row of {tokens_per_row}: give --tokens-per-row "
            "at least the longest cell's tokens"
        )
    row, start = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64)
    free: list[tuple[int, int]] = []  # (room left, row) of rows that can take another cell, by room
    used, cells = [], []  # per row: tokens placed, cells placed
    order = np.argsort(-lengths, kind="stable").tolist()
    for c in order[: int(np.count_nonzero(lengths))]:
        n = int(lengths[c])
        at = bisect.bisect_left(free, (n, -1))  # the fullest row with room for n
        if at < len(free):
            r = free.pop(at)[1]
        else:
            r = len(used)
            used.append(0)
            cells.append(0)
        row[c], start[c] = r, used[r]
        used[r] += n
        cells[r] += 1
        if cells[r] < MAX_CELLS_PER_ROW and used[r] < tokens_per_row:
            bisect.insort(free, (tokens_per_row - used[r], r))
    # an empty cell (no token: Geneformer V1's and raw's for a cell with no expressed gene) takes no
    # room: it rides in the first row, which exists even when every cell is empty
    return row, start, max(1, len(used))


def segments_of(lengths: np.ndarray, row: np.ndarray, start: np.ndarray, n_rows: int, width: int) -> np.ndarray:
    """int64 [n_rows, width]: at each position, the index of the cell there; -1 on padding."""
    segments = np.full((n_rows, width), -1, dtype=np.int64)
    for c, (r, a, n) in enumerate(zip(row.tolist(), start.tolist(), np.asarray(lengths).tolist())):
        segments[r, a : a + n] = c
    return segments


def spans_of(lengths: np.ndarray, row: np.ndarray, start: np.ndarray, n_rows: int, width: int) -> tuple:
    """Rows (padded or packed), flattened, cut into spans: each cell's positions, and each row's padding
    tail in pieces of at most PADDING_SPAN (an empty cell has none): int32 bounds [n_spans + 1] (varlen
    attention's cumulative sequence lengths) and the longest span. Padding attends only within its
    piece: nothing reads it, and a whole tail as one span would cost its length squared."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = row * width + start
    used = np.zeros(n_rows, np.int64)  # each row's cells, from its start (the tail follows them)
    np.maximum.at(used, row, start + lengths)
    tails = [np.arange(r * width + used[r], (r + 1) * width, PADDING_SPAN) for r in range(n_rows)]
    cuts = np.concatenate([ends, ends + lengths, np.arange(n_rows + 1) * width, *tails])
    bounds = np.unique(cuts).astype(np.int32)  # sorted, each cut once: a span ends where the next begins
    return bounds, int(np.diff(bounds).max(initial=1))
