"""The token stage in one compiled pass (numba): a chunk's cells, as read, to their token rows.

For each cell, one loop over its rows: map genes to tokens (dropping those outside the vocabulary,
summing the cell's whole total on the way), put the rows in token order if they are not already,
rank them with a stable LSD radix sort of one integer key (value or score, descending; equal keys
keep token order, so ties go to the lower token, as `producers.ranking.rank_order` breaks them),
then write the cell's token row: its specials, its top `max_genes` tokens, and beside them scGPT's
expression bins (from the cell's quantiles, walked once down the sorted values) or raw values.
Each sort moves one array of int64 keys that carry their rows (`_sort_keys`): scGPT's is the inverted
value and the token (`_rank_packed`: one sort for both orders, unpacked after); Geneformer's score cannot
give its count back, so its keys carry a row index, and the rows are gathered by it once (`_reorder`).

Why numba: the vectorised path (`producers/ranking.py`, kept as the reference the tests compare
with) makes a pass and a temporary per step (key build, one sort of a whole chunk, gathers,
searchsorted over every cell's edges, the specials' scatter), and NumPy's sort here is a
comparison sort of ~1,600-row cells packed into one array. A per-cell radix sort over the one or
two key bytes that differ in a cell, with everything else done while the cell is in cache, is
what a compiled loop gives, and numba compiles it from Python without a build step, releasing
the GIL (`nogil`), so the producer's tokenizing threads run chunks side by side. Compiled code is
cached on disk (`cache=True`): a producer pays the compile once per machine, not per unit.

`kernel_tokens` returns None where the kernel does not apply: a value type other than uint16
counts or float32, or float values that are negative or -0.0 (only `--allow-negative` datasets
hold them; conversion refuses NaN). The caller then takes the vectorised path. A gene id past the
lookup (a dataset that is not the one the lookup was built for) is refused in one line.
"""

from __future__ import annotations

import numba
import numpy as np

from coordination.arrays import CellRows
from coordination.errors import CellfeedError

_JIT = dict(nogil=True, cache=True)
SCGPT, GENEFORMER, RAW = 0, 1, 2  # what a cell's row holds (numba takes module constants as frozen)
MODES = {"scgpt": SCGPT, "geneformer": GENEFORMER, "raw": RAW}
_MAX63 = np.int64(0x7FFFFFFFFFFFFFFF)


@numba.njit(**_JIT)
def _sort_keys(keys, tmp, n, hist, whole):
    """keys[:n] sorted ascending, stably, as unsigned 64-bit numbers: LSD radix over their high four
    bytes (`whole`: all eight), skipping each byte every key shares (a cell's ranks differ in one to
    four of theirs). A key carries its row: a rank in its high 32 bits, a token or a row index in its low 32, so
    the sort moves one array and nothing is gathered by an index after it."""
    if n < 2:
        return
    hist[:, :] = 0
    for i in range(n):
        key = keys[i]
        for d in range(4, 8):
            hist[d, (key >> (8 * d)) & 255] += 1
        if whole:
            for d in range(4):
                hist[d, (key >> (8 * d)) & 255] += 1
    src, dst = keys, tmp
    moved = False
    for d in range(0 if whole else 4, 8):
        counts = hist[d]
        if counts[(src[0] >> (8 * d)) & 255] == n:
            continue
        total = 0  # the counts made each bucket's first position
        for b in range(256):
            c = counts[b]
            counts[b] = total
            total += c
        for i in range(n):
            key = src[i]
            b = (key >> (8 * d)) & 255
            dst[counts[b]] = key
            counts[b] += 1
        src, dst = dst, src
        moved = not moved
    if moved:
        keys[:n] = src[:n]


@numba.njit(**_JIT)
def _rank_packed(tok, val, k, is_float, ascending, keys, tmp, hist, f32, bits):
    """scGPT's rank: tok/val[:k] put in descending value order, equal values in token order, by one
    sort of `(inverted value << 32) | token`, unpacked after (the value comes back from its inverse).
    Rows already in token order are sorted by the value's bytes alone (a stable sort keeps them);
    others by the token's bytes first, so one sort puts them in both orders."""
    for i in range(k):
        if is_float:  # a non-negative float orders like its bits
            f32[0] = val[i]
            inv = np.int64(0x7FFFFFFF) - np.int64(bits[0])
        else:
            inv = np.int64(65535) - np.int64(val[i])
        keys[i] = (inv << 32) | np.int64(tok[i])
    _sort_keys(keys, tmp, k, hist, not ascending)
    for i in range(k):
        key = keys[i]
        tok[i] = key & 0xFFFFFFFF
        inv = key >> 32
        if is_float:
            bits[0] = np.int32(0x7FFFFFFF - inv)
            val[i] = f32[0]
        else:
            val[i] = 65535 - inv


@numba.njit(**_JIT)
def _reorder(ranks, k, tok, val, scratch):
    """tok/val[:k] put in the ascending order of ranks[:k] (each below 2**32), stably, by one sort of
    `(rank << 32) | row` and one gather by the rows; ranks[:k] left sorted."""
    tmp, hist, tok2, val2 = scratch
    for i in range(k):
        ranks[i] = (ranks[i] << 32) | i
    _sort_keys(ranks, tmp, k, hist, False)
    for i in range(k):
        row = ranks[i] & 0xFFFFFFFF
        tok2[i] = tok[row]
        val2[i] = val[row]
        ranks[i] = ranks[i] >> 32
    tok[:k] = tok2[:k]
    val[:k] = val2[:k]


@numba.njit(**_JIT)
def _bins_of_cell(vals, m, keep, q, n_bins, is_float, edges, out_bins):
    """scGPT's bin of each of a cell's first `keep` values into `out_bins[:keep]` (`vals[:m]`, sorted
    descending: edges at the quantiles of all m, NumPy's linear method, in the value type as NumPy's
    _lerp; bin = ceil((#edges <= v + #edges < v) / 2), as `producers.ranking.quantile_bins`). Only the
    kept values' bins are walked: a cell past `max_genes` has the rest cut from its row anyway."""
    levels = n_bins - 1
    top = m - 1
    for j in range(levels):
        virtual = (max(m, 1) - 1) * q[j]
        prev = np.floor(virtual)
        if virtual >= top:
            lo, hi = top, top
        else:
            lo, hi = np.int64(prev), np.int64(prev) + 1
        gamma = virtual - prev
        a, b = vals[top - lo], vals[top - hi]  # ascending position p is descending index m-1-p
        if is_float:
            diff = np.float64(np.float32(np.float32(b) - np.float32(a)))
        else:
            diff = np.float64(np.int64(b) - np.int64(a))
        if gamma >= 0.5:
            edges[j] = np.float64(b) - diff * (1 - gamma)
        else:
            edges[j] = np.float64(a) + diff * gamma
    # values descend and edges ascend (quantiles; the vectorised path's searchsorted assumes it
    # too), so both counts only fall: walk them down once
    left, right = levels, levels
    i = 0
    while i < keep:
        v = np.float64(vals[i])
        while left > 0 and edges[left - 1] > v:
            left -= 1
        while right > 0 and edges[right - 1] >= v:
            right -= 1
        bin_ = (left + right + 1) // 2
        while i < keep and np.float64(vals[i]) == v:
            out_bins[i] = bin_
            i += 1


@numba.njit(**_JIT)
def _gather(lo, hi, genes, values, vocab, is_float, tok, val, f32, bits):
    """Rows lo..hi of a cell, those in the vocabulary, into tok/val. Returns (how many, the cell's
    whole total, whether their tokens ascend), or a count of -1 where a float value is negative,
    -0.0 or NaN (the vectorised path's lexsort orders those), -2 where a gene id is past the lookup
    or a token past `token_limit` (numba does not check bounds: the caller refuses the data).
    `vocab`: (lookup, mapped, outside, token_limit), as `_tokenize` takes them."""
    lookup, mapped, outside, token_limit = vocab
    k, total, ascending = 0, 0.0, True
    for r in range(lo, hi):
        v = values[r]
        if is_float:
            f32[0] = v  # (f32 and bits share their memory: a float32 and its bits)
            if not (v >= 0) or bits[0] < 0:
                return -1, total, ascending
        total += np.float64(v)
        g = genes[r]
        if mapped and g >= len(lookup):
            return -2, total, ascending
        t = lookup[g] if mapped else g
        if mapped and t == outside:
            continue
        if t >= token_limit:
            return -2, total, ascending
        tok[k] = t
        val[k] = v
        if k and tok[k - 1] > t:
            ascending = False
        k += 1
    return k, total, ascending


@numba.njit(**_JIT)
def _score(v, t, total, medians):
    """Geneformer's rank value of a count, exactly as the vectorised path computes it."""
    return np.float64(v) / (total if total > 0 else 1.0) * 10_000.0 / medians[np.int64(t)]


@numba.njit(**_JIT)
def _exact_ties(keys, k, tok, val, total, medians):
    """Rows whose cut keys tie (sorted, so side by side, in token order) put in exact order:
    score descending, then token (a stable insertion sort of each run; runs are short and rare)."""
    a = 0
    while a < k:
        b = a + 1
        while b < k and keys[b] == keys[a]:
            b += 1
        for i in range(a + 1, b):
            t, v = tok[i], val[i]
            s = _score(v, t, total, medians)
            j = i - 1
            while j >= a and _score(val[j], tok[j], total, medians) < s:
                tok[j + 1], val[j + 1] = tok[j], val[j]
                j -= 1
            tok[j + 1], val[j + 1] = t, v
        a = b


@numba.njit(**_JIT)
def _score_keys(tok, val, k, total, medians, scores, keys):
    """Geneformer's rank keys: keys[:k] ascend as the score (counts / total * 10,000 / the gene's
    median, in float64 as the vectorised path computes it) descends: its bits inverted and cut to
    their top 31 (exponent and 20 bits of mantissa: a radix sort of half the bytes; the scores this
    cut makes equal are put in exact order after, by `_exact_ties`)."""
    for i in range(k):
        scores[i] = _score(val[i], tok[i], total, medians)
    score_bits = scores.view(np.int64)
    for i in range(k):
        keys[i] = (_MAX63 - score_bits[i]) >> 32


@numba.njit(**_JIT)
def _write_cell(at, tok, val, bins, keep, mode, head, tail, out_tokens, out_values):
    """The cell's token row from `at`: head, its first `keep` tokens (bins or raw values beside
    them, 0 under the head), tail. Returns where the next cell starts."""
    if head >= 0:
        out_tokens[at] = head
        if mode != GENEFORMER:
            out_values[at] = 0
        at += 1
    for i in range(keep):
        out_tokens[at + i] = tok[i]
        if mode == SCGPT:
            out_values[at + i] = bins[i]
        elif mode == RAW:
            out_values[at + i] = val[i]
    at += keep
    if tail >= 0:
        out_tokens[at] = tail
        if mode != GENEFORMER:
            out_values[at] = 0
        at += 1
    return at


@numba.njit(**_JIT)
def _tokenize(
    offsets,
    genes,
    values,
    cells,
    lookup,
    mapped,
    outside,
    token_limit,
    totals,
    is_float,
    mode,
    max_genes,
    head,
    tail,
    truncate,
    medians,
    q,
    n_bins,
    out_offsets,
    out_tokens,
    out_values,
):
    """The kernel (see the module's docstring). Writes cells `cells` (positions into `offsets`)
    into out_offsets/out_tokens/out_values and returns 0, or `_gather`'s -1 (declined) or -2
    (an id out of range), with nothing usable written. `totals`: each cell's whole total, where
    the rows were mapped already (empty: the sum of its rows here)."""
    longest = 1
    for c in cells:
        longest = max(longest, offsets[c + 1] - offsets[c])
    tok, val = np.empty(longest, out_tokens.dtype), np.empty(longest, values.dtype)
    keys, scores, bins = np.empty(longest, np.int64), np.empty(longest, np.float64), np.zeros(longest, np.int64)
    tmp, hist = np.empty(longest, np.int64), np.zeros((8, 256), np.int64)  # the sort's other buffer, counts
    scratch = (tmp, hist, np.empty(longest, out_tokens.dtype), np.empty(longest, values.dtype))
    edges = np.empty(max(1, n_bins - 1), np.float64)
    f32 = np.empty(1, np.float32)  # a float32 and, the same 4 bytes, its bits: a non-negative
    bits = f32.view(np.int32)  # float orders like its bits, which makes it a radix key
    vocab = (lookup, mapped, outside, token_limit)
    at = 0
    out_offsets[0] = 0
    for ci in range(len(cells)):
        c = cells[ci]
        # 1. the cell's rows in the vocabulary, their tokens, and its whole total
        k, total, ascending = _gather(offsets[c], offsets[c + 1], genes, values, vocab, is_float, tok, val, f32, bits)
        if k < 0:
            return k
        # 2-3. rank: a stable sort by a key that ascends as the value (or score) descends, the rows
        # in token order first (ties in the ranking go to the lower token)
        if mode == SCGPT:  # (both orders in one sort)
            _rank_packed(tok, val, k, is_float, ascending, keys, tmp, hist, f32, bits)
        elif not ascending:
            for i in range(k):
                keys[i] = np.int64(tok[i])
            _reorder(keys, k, tok, val, scratch)
        if mode == GENEFORMER:
            total = totals[c] if len(totals) else total
            _score_keys(tok, val, k, total, medians, scores, keys)
            _reorder(keys, k, tok, val, scratch)
            _exact_ties(keys, k, tok, val, total, medians)
        # 4. the cell's row: specials around its first max_genes tokens
        keep = min(k, max_genes) if truncate else k
        if mode == SCGPT:
            _bins_of_cell(val, k, keep, q, n_bins, is_float, edges, bins)
        at = _write_cell(at, tok, val, bins, keep, mode, head, tail, out_tokens, out_values)
        out_offsets[ci + 1] = at
    return 0


def kernel_tokens(
    rows: CellRows,
    lookup: np.ndarray | None,
    *,
    mode: str,
    max_genes: int,
    token_dtype,
    cells: np.ndarray | None = None,
    head: int | None = None,
    tail: int | None = None,
    truncate: bool = True,
    medians: np.ndarray | None = None,
    n_bins: int = 51,
    value_dtype=None,
) -> CellRows | None:
    """The token rows of the cells at positions `cells` of `rows` (None: all, in order), their
    genes as read mapped through `lookup` (None: they are tokens already), or None where the
    kernel does not apply. Their values: scGPT's bins (`value_dtype`, default uint8 or uint16 by
    `n_bins`, as `quantile_bins`), raw values (float32), or None (Geneformer). `rows.totals`,
    where a caller dropped genes itself: each cell's whole total."""
    if rows.values is None or rows.values.dtype not in (np.uint16, np.float32):
        return None
    cells = np.arange(rows.n_cells) if cells is None else np.ascontiguousarray(cells, dtype=np.int64)
    counts = rows.offsets[cells + 1] - rows.offsets[cells]
    extra = (head is not None) + (tail is not None)
    room = int((np.minimum(counts, max_genes) if truncate else counts).sum()) + extra * len(cells)
    bins = value_dtype or (np.uint8 if n_bins <= 256 else np.uint16)
    vdt = {"scgpt": bins, "raw": np.float32, "geneformer": np.uint8}[mode]
    # each distinct set of argument types is compiled apart (CPU-seconds each), so the kernel sees
    # four at most (ids of 2 or 4 bytes x counts or floats): one lookup type (a uint16 lookup's
    # "outside" mark kept as its value), inputs marked read-only (as Arrow's are; numba types them
    # apart), and uint32 tokens and float32 values out (bins and counts exact in both), narrowed
    # after (0.2 ms per 1,000 cells, <1% of the pass; each output type was a compile: 17 in the suite)
    out_offsets = np.empty(len(cells) + 1, np.int64)
    out_tokens = np.empty(room, np.uint32)
    out_values = np.empty(room if mode != "geneformer" else 0, np.float32)
    mapped = lookup is not None
    outside = np.iinfo(np.uint16).max if mapped and lookup.dtype == np.uint16 else -1
    lookup = lookup.astype(np.int32, copy=False) if mapped else np.zeros(1, np.int32)
    genes = rows.ids
    if genes.dtype == np.int32:
        genes = genes.view(np.uint32)  # (ids are never negative: the same values, no copy)
    elif genes.dtype not in (np.uint16, np.uint32):
        genes = genes.astype(np.uint32)
    genes, values = genes.view(), rows.values.view()
    genes.flags.writeable = values.flags.writeable = False
    medians = np.ones(1) if medians is None else medians
    ok = _tokenize(
        offsets=np.asarray(rows.offsets, dtype=np.int64),
        genes=genes,
        values=values,
        cells=cells,
        lookup=lookup,
        mapped=mapped,
        outside=outside,  # `coordination.vocab.inside`'s marks
        token_limit=len(medians) if mode == "geneformer" else np.iinfo(np.int64).max,
        totals=np.zeros(0) if rows.totals is None else np.asarray(rows.totals, dtype=np.float64),
        is_float=rows.values.dtype == np.float32,
        mode=MODES[mode],
        max_genes=max_genes,
        head=-1 if head is None else head,
        tail=-1 if tail is None else tail,
        truncate=truncate,
        medians=medians,
        q=np.linspace(0, 1, max(1, n_bins - 1)),
        n_bins=n_bins,
        out_offsets=out_offsets,
        out_tokens=out_tokens,
        out_values=out_values,
    )
    if ok == -2:
        raise CellfeedError(
            "a gene id is past the vocabulary's lookup (or a token past the gene medians): the rows are not of "
            "the dataset the campaign's vocabulary was built for; restart the producer on the campaign's dataset"
        )
    if ok == -1:
        return None
    end = int(out_offsets[-1])
    values = None if mode == "geneformer" else out_values[:end].astype(vdt, copy=False)
    return CellRows(rows.cell_ids[cells], out_offsets, out_tokens[:end].astype(token_dtype, copy=False), values)
