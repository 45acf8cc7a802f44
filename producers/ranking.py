"""The vectorised token path: a chunk's cells mapped to tokens, ranked, truncated, binned and
framed by their specials, one NumPy pass per step over all the chunk's cells (`CellRows`: each
cell's rows contiguous, CSR-like; no Python loop per cell). The tokenizers
(`producers/tokenizers.py`) run the compiled pass (`producers/token_kernel.py`) instead and keep
this one as its reference (`kernel = False`) and for what the kernel declines; scGPT's random
gene subset is drawn here from the kernel's ranked, binned rows (`random_order`, `truncate`).

Ranking orders each cell's rows by (value descending, gene ascending) with one sort of packed
64-bit keys (cell | inverted value | gene) when values are uint16 counts or non-negative float32
and token ids fit in 24 bits (a union vocabulary passes 65,536), and a lexsort otherwise.
"""

from __future__ import annotations

import numpy as np

from coordination.arrays import CellRows, offsets_of, ragged_arange
from coordination.vocab import inside


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


# ---- ranking and binning: each cell's rows, all cells of a chunk at once


def rank_order(rows: CellRows, score: np.ndarray | None = None) -> CellRows:
    """Each cell's rows sorted by (score or value descending, gene ascending)."""
    # the bits a packed sort key gives gene ids: 16, or more for a vocabulary past 65,536 tokens (a
    # union of atlases); 0 when they are too large to pack (then the lexsort path)
    gb = max(16, (int(rows.ids.max(initial=0)) if len(rows.ids) else 0).bit_length())
    gb = gb if gb <= 24 else 0
    if score is None and rows.values.dtype == np.uint16 and gb and rows.n_cells < (1 << (48 - gb)):
        # key = cell << (16 + gb) | ~value << gb | gene: one sort orders (cell, -value, gene), and
        # the sorted keys decode back to genes and values (their low fields)
        g = np.uint64(gb)
        key = np.repeat(np.arange(rows.n_cells, dtype=np.uint64) << (g + np.uint64(16)), rows.counts)
        key |= np.invert(rows.values).astype(np.uint64) << g
        key |= rows.ids.astype(np.uint64)
        key.sort()
        genes = key.astype(np.uint16) if gb == 16 else key & np.uint64((1 << gb) - 1)  # the low field
        genes = genes.astype(rows.ids.dtype, copy=False)
        values = np.invert((key >> g).astype(np.uint16))
        return CellRows(rows.cell_ids, rows.offsets, genes, values, rows.totals)
    if (
        score is None
        and rows.values.dtype == np.float32
        and gb
        and rows.n_cells < (1 << (32 - gb))
        and not bool(np.signbit(rows.values).any())
        and not bool(np.isnan(rows.values).any())
    ):
        # the same with float32 values (log-normalised data): a non-negative float orders like its
        # 32 bits, so key = cell << (32 + gb) | ~bits << gb | gene, decoded back exactly
        g = np.uint64(gb)
        bits = np.ascontiguousarray(rows.values).view(np.uint32)
        key = np.repeat(np.arange(rows.n_cells, dtype=np.uint64) << (g + np.uint64(32)), rows.counts)
        key |= np.invert(bits).astype(np.uint64) << g
        key |= rows.ids.astype(np.uint64)
        key.sort()
        genes = (key & np.uint64((1 << gb) - 1)).astype(rows.ids.dtype, copy=False)
        values = np.invert((key >> g).astype(np.uint32)).view(np.float32)
        return CellRows(rows.cell_ids, rows.offsets, genes, values, rows.totals)
    if (
        score is not None
        and gb
        and rows.n_cells < (1 << 32)
        and score.dtype == np.float64
        and bool(np.all(score >= 0))
        and bool(np.all(np.isfinite(score)))
    ):
        return rows.take(_score_order(rows, score, gb), rows.offsets)
    cell = rows.cell_of_row()
    primary = rows.values if score is None else score
    order = np.lexsort((rows.ids, -primary.astype(np.float64), cell))
    return rows.take(order, rows.offsets)


def _score_order(rows: CellRows, score: np.ndarray, gb: int = 16) -> np.ndarray:
    """The row order of (cell, score descending, gene ascending) for non-negative float64 scores,
    exactly as a lexsort gives it (which is ~10x slower), from one argsort of packed 64-bit keys:
    cell | the top bits of the inverted score bits (a non-negative float orders like its bits) |
    gene (`gb` bits). Scores that differ only in the bits cut off tie in the key (rare: the key
    keeps ~30 of 52 mantissa bits for a few hundred cells); those runs alone are re-sorted exactly."""
    cell_bits = max(1, (rows.n_cells - 1).bit_length())
    score_bits = 64 - gb - cell_bits
    g = np.uint64(gb)
    key = np.repeat(np.arange(rows.n_cells, dtype=np.uint64) << (g + np.uint64(score_bits)), rows.counts)
    top = np.invert(score.view(np.uint64)) >> np.uint64(63 - score_bits) & np.uint64((1 << score_bits) - 1)
    key |= top << g
    key |= rows.ids.astype(np.uint64)
    order = np.argsort(key)  # (cell, gene) is unique, so no two keys are equal
    coarse = key[order] >> g
    tied = coarse[1:] == coarse[:-1]
    if not tied.any():
        return order
    ordered_score = score[order]
    bad = np.flatnonzero(tied & (ordered_score[1:] != ordered_score[:-1]))
    if not len(bad):
        return order  # only exact ties, which the key already orders by gene
    # re-sort the groups of equal truncated keys that hold unequal scores, exactly: the group's
    # rows are in (cell, gene) order now, so a stable sort by score then by cell breaks ties by gene
    group = np.concatenate([[0], np.cumsum(~tied)])
    groups = np.unique(group[bad])
    at = ragged_arange(np.searchsorted(group, groups, side="left"), np.searchsorted(group, groups, side="right"))
    rows_at = order[at]
    by_score = np.argsort(-score[rows_at], kind="stable")
    by_cell = np.argsort((key[rows_at] >> (g + np.uint64(score_bits)))[by_score], kind="stable")
    order[at] = rows_at[by_score[by_cell]]
    return order


def gene_order(rows: CellRows) -> CellRows:
    """Each cell's rows by gene: as stored (cell-major, then gene), so only checked, unless the
    rows come in another order (then sorted)."""
    genes = rows.ids.astype(np.int64)
    step = np.diff(genes)
    starts = rows.offsets[1:-1]
    step[starts[(starts > 0) & (starts < len(genes))] - 1] = 1  # a new cell may start lower
    if bool(np.all(step > 0)):
        return rows
    return rows.take(np.lexsort((rows.ids, rows.cell_of_row())), rows.offsets)


def random_order(rows: CellRows, rng: np.random.Generator) -> CellRows:
    """Each cell's rows in a seeded random order (scGPT's random gene subset when truncated)."""
    cell = rows.cell_of_row()
    order = np.lexsort((rng.random(len(cell)), cell))
    return rows.take(order, rows.offsets)


def truncate(rows: CellRows, max_genes: int) -> CellRows:
    """The first `max_genes` rows of each cell (after ordering, its top genes)."""
    counts = rows.counts
    if counts.max(initial=0) <= max_genes:
        return rows
    keep = np.minimum(counts, max_genes)
    within = np.arange(len(rows.ids)) - np.repeat(rows.offsets[:-1], counts)
    return rows.take(np.flatnonzero(within < np.repeat(keep, counts)), offsets_of(keep))


def _sortable_codes(values: np.ndarray) -> np.ndarray:
    """Unsigned integer codes that order like the (non-negative) values."""
    if np.issubdtype(values.dtype, np.integer):
        return values.astype(np.int64)
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.int64)


def _round_edges(edges: np.ndarray, dtype: np.dtype, up: bool) -> np.ndarray:
    """Edges (float64) rounded to the value type, up or down, so that comparisons with values of
    that type give the same answer as in float64: for a value v of the type,
    e <= v  <=>  round_up(e) <= v   and   e < v  <=>  round_down(e) < v."""
    if np.issubdtype(dtype, np.integer):
        return (np.ceil(edges) if up else np.floor(edges)).astype(np.int64)
    e32 = edges.astype(np.float32)
    if up:
        e32 = np.where(e32.astype(np.float64) < edges, np.nextafter(e32, np.float32(np.inf)), e32)
    else:
        e32 = np.where(e32.astype(np.float64) > edges, np.nextafter(e32, np.float32(-np.inf)), e32)
    return _sortable_codes(np.maximum(e32, np.float32(0)))


def quantile_bins(ranked: CellRows, n_bins: int, rows: np.ndarray) -> np.ndarray:
    """scGPT's per-cell binning of non-zero values into 1..n_bins-1, for the rows `rows`.

    `ranked` holds each cell's full set of non-zeros sorted by value descending. Edges are the
    cell's quantiles at n_bins-1 evenly spaced levels (NumPy's linear method, reproduced exactly).
    A value's bin is ceil((left + right) / 2), where left counts edges <= value and right counts
    edges < value: ties with edges take the middle of the tied bins — scGPT draws uniformly
    between them, we take the deterministic midpoint (rounded up).
    """
    n, levels = ranked.n_cells, n_bins - 1
    m = ranked.counts
    q = np.linspace(0, 1, levels)
    virtual = (np.maximum(m, 1)[:, None] - 1) * q[None, :]
    prev = np.floor(virtual)
    above = virtual >= (m[:, None] - 1)
    lo = np.where(above, m[:, None] - 1, prev).astype(np.int64)
    hi = np.where(above, m[:, None] - 1, prev + 1).astype(np.int64)
    gamma = virtual - prev
    # ascending position p of cell c sits at descending index offsets[c] + m[c] - 1 - p
    base = (ranked.offsets[:-1] + m - 1)[:, None]
    empty = m == 0
    a = ranked.values[np.where(empty[:, None], 0, base - lo)] if len(ranked.values) else np.zeros(lo.shape)
    b = ranked.values[np.where(empty[:, None], 0, base - hi)] if len(ranked.values) else np.zeros(lo.shape)
    diff = b - a  # in the value dtype, as NumPy's _lerp does
    edges = np.add(a, diff * gamma)
    np.subtract(b, diff * (1 - gamma), out=edges, where=gamma >= 0.5, casting="unsafe")
    cell_key = np.arange(n, dtype=np.int64)[:, None] << 32
    left_edges = (cell_key + _round_edges(edges, ranked.values.dtype, up=True)).ravel()
    right_edges = (cell_key + _round_edges(edges, ranked.values.dtype, up=False)).ravel()
    # a bin depends only on (cell, value): look up each run of equal values once (counts have
    # few distinct values per cell), then spread the answers over the rows
    cell_all = ranked.cell_of_row()
    new_run = np.ones(len(cell_all), dtype=bool)
    new_run[1:] = (cell_all[1:] != cell_all[:-1]) | (ranked.values[1:] != ranked.values[:-1])
    run_start = np.flatnonzero(new_run)
    run_key = (cell_all[run_start] << 32) + _sortable_codes(ranked.values[run_start])
    run_cell = cell_all[run_start]
    left = np.searchsorted(left_edges, run_key, side="right") - run_cell * levels
    right = np.searchsorted(right_edges, run_key, side="left") - run_cell * levels
    run_bins = ((left + right + 1) // 2).astype(np.uint8 if n_bins <= 256 else np.uint16)
    return run_bins[(np.cumsum(new_run) - 1)[rows]]


def _with_specials(
    rows: CellRows, vocab_size: int, head: int | None, tail: int | None, values: np.ndarray | None = None, value_fill=0
) -> CellRows:
    """Gene tokens of each cell framed by optional head/tail tokens (values get `value_fill` there)."""
    counts = rows.counts
    extra = (head is not None) + (tail is not None)
    offsets = offsets_of(counts + extra)
    dtype = token_dtype(vocab_size)
    tokens = np.empty(offsets[-1], dtype=dtype)
    out_values = None if values is None else np.full(offsets[-1], value_fill, dtype=values.dtype)
    gene_pos = (
        np.arange(len(rows.ids))
        - np.repeat(rows.offsets[:-1], counts)
        + np.repeat(offsets[:-1], counts)
        + (head is not None)
    )
    tokens[gene_pos] = rows.ids
    if head is not None:
        tokens[offsets[:-1]] = head
    if tail is not None:
        tokens[offsets[1:] - 1] = tail
    if out_values is not None:
        out_values[gene_pos] = values
    return CellRows(rows.cell_ids, offsets, tokens, out_values)


def to_tokens(rows: CellRows, gene_tokens: np.ndarray) -> CellRows:
    """Cells' rows with gene ids replaced by token ids (`gene_tokens`: `GeneVocab.lookup_array`)
    and the rows of genes outside dropped, as scGPT and Geneformer drop them before ranking and
    binning; where some were dropped, `totals` keeps each cell's whole total
    (Geneformer divides by the cell's whole count, its n_counts)."""
    tokens = gene_tokens[rows.ids]
    keep = inside(tokens)
    if keep.all():
        return CellRows(rows.cell_ids, rows.offsets, tokens, rows.values)
    cell = rows.cell_of_row()
    totals = np.bincount(cell, weights=rows.values, minlength=rows.n_cells)
    counts = np.bincount(cell[keep], minlength=rows.n_cells)
    return CellRows(rows.cell_ids, offsets_of(counts), tokens[keep], rows.values[keep], totals)
