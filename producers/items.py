"""A unit's cells -> numbered items: map genes to tokens, rank, tokenize and pack whole cells into
items, source by source, then merge the sources' items in proportion and number them
(`unit_items`).

A pure function of its inputs (cells and their rows, the tokenizer, the generator): the same unit
gives the same items on any producer, any number of times, which is what makes a re-issued unit
harmless (consumers drop the duplicates by key). Work is split in chunks of a few hundred cells
on a thread pool: a chunk's rows fit in cache (one sort of a whole unit's rows is several times
slower per row), and NumPy, the sort and zstd release the GIL. Chunks hold whole items, so the
items are the same as if the unit were packed at once; each chunk draws from its own child of the
unit's generator.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from coordination.arrays import CellRows, offsets_of, ragged_arange
from coordination.vocab import inside
from coordination.wire import number_items, pack_cells
from producers.dataset import RowBlock

CHUNK_CELLS = 256  # cells tokenized at once: their rows (~0.4M at 1,600 genes per cell) fit in cache


@dataclass(frozen=True)
class SourceCells:
    """Cells of one source to tokenize: cell i (local id `cells[i]`) has the rows
    `rows[first[i]:first[i] + counts[i]]` of what was read."""

    source: int  # index into the campaign's sources (`producers.sources.Source`)
    cells: np.ndarray  # int64 local cell ids
    first: np.ndarray  # int64
    counts: np.ndarray  # int64
    rows: RowBlock

    def shuffled(self, rng: np.random.Generator) -> "SourceCells":
        order = rng.permutation(len(self.cells))
        return SourceCells(self.source, self.cells[order], self.first[order], self.counts[order], self.rows)


def unit_items(
    parts: list[SourceCells],
    sources,
    tokenizer,
    *,
    epoch: int,
    key_id: int,
    run_tag: int,
    rng: np.random.Generator,
    cells_per_item: int,
    labels: np.ndarray | None = None,
    stitched: bool = False,
    shuffle: bool = False,
    pool: Executor | None = None,
) -> tuple[list[bytes], float, float]:
    """The numbered items of cells from one or more sources (`sources[p.source]` gives each part's
    global id offset and gene-to-token lookup), and the seconds spent tokenizing and packing. Each
    source's cells are tokenized apart (a source's rows share a dtype, which ranking's fast path
    needs) and, with several sources, their items interleaved in proportion (`interleave`), so any
    stretch of a unit's items (what a rank's mixing buffer holds) has every source by its share.
    `shuffle`: each part's cells are shuffled first, with its own child of `rng` (one part: `rng`)."""
    groups, tokenize_s, pack_s = [], 0.0, 0.0
    rngs = rng.spawn(len(parts)) if len(parts) > 1 else [rng]
    for part, part_rng in zip(parts, rngs):
        if shuffle:
            part = part.shuffled(part_rng)
        src = sources[part.source]
        packed, t, p = cells_to_packed(
            part.cells + src.offset,
            part.first,
            part.counts,
            part.rows,
            tokenizer,
            epoch=epoch,
            key_id=key_id,
            run_tag=run_tag,
            rng=part_rng,
            cells_per_item=cells_per_item,
            labels=labels,
            stitched=stitched,
            gene_tokens=src.gene_tokens,
            pool=pool,
        )
        groups.append(packed)
        tokenize_s, pack_s = tokenize_s + t, pack_s + p
    return number_items(interleave(groups) if len(groups) > 1 else groups[0]), tokenize_s, pack_s


def cells_to_packed(
    cells: np.ndarray,
    first: np.ndarray,
    counts: np.ndarray,
    block: RowBlock,
    tokenizer,
    *,
    epoch: int,
    key_id: int,
    run_tag: int,
    rng: np.random.Generator,
    cells_per_item: int,
    labels: np.ndarray | None = None,
    stitched: bool = False,
    gene_tokens: np.ndarray | None = None,
    pool: Executor | None = None,
) -> tuple[list[bytearray], float, float]:
    """Packed, unnumbered items of `cells`, in this order (cell i's rows are
    block[first[i]:first[i] + counts[i]], genes mapped to tokens by `gene_tokens`: `to_tokens`),
    and the seconds spent tokenizing and packing (summed over threads). `labels` is indexed by
    the ids in `cells`."""
    size = cells_per_item * max(1, CHUNK_CELLS // cells_per_item)
    bounds = list(range(0, len(cells), size))
    rngs = rng.spawn(len(bounds))

    def chunk(i: int) -> tuple[list[bytearray], float, float]:
        t0 = time.perf_counter()
        sel = slice(bounds[i], bounds[i] + size)
        at = ragged_arange(first[sel], first[sel] + counts[sel])
        rows = CellRows(cells[sel], offsets_of(counts[sel]), block.gene[at], block.value[at])
        tokens = tokenizer(rows if gene_tokens is None else to_tokens(rows, gene_tokens), rngs[i])
        t1 = time.perf_counter()
        packed = pack_cells(
            tokens,
            epoch=epoch,
            key_id=key_id,
            run_tag=run_tag,
            stitched=stitched,
            labels=None if labels is None else labels[rows.cell_ids],
            cells_per_item=cells_per_item,
        )
        return packed, t1 - t0, time.perf_counter() - t1

    jobs = map(chunk, range(len(bounds))) if (pool is None or len(bounds) == 1) else pool.map(chunk, range(len(bounds)))
    packed, tokenize_s, pack_s = [], 0.0, 0.0
    for part, t, p in jobs:
        packed += part
        tokenize_s, pack_s = tokenize_s + t, pack_s + p
    return packed, tokenize_s, pack_s


def to_tokens(rows: CellRows, gene_tokens: np.ndarray) -> CellRows:
    """Cells' rows with gene ids replaced by token ids (`gene_tokens`: `GeneVocab.lookup_array`)
    and the rows of genes outside dropped, as scGPT and Geneformer drop them before ranking and
    binning; where some were dropped, `totals` keeps each cell's whole total
    (Geneformer divides by the cell's whole count, its n_counts). Per chunk of a few hundred
    cells, in cache."""
    tokens = gene_tokens[rows.ids]
    keep = inside(tokens)
    if keep.all():
        return CellRows(rows.cell_ids, rows.offsets, tokens, rows.values)
    cell = rows.cell_of_row()
    totals = np.bincount(cell, weights=rows.values, minlength=rows.n_cells)
    counts = np.bincount(cell[keep], minlength=rows.n_cells)
    return CellRows(rows.cell_ids, offsets_of(counts), tokens[keep], rows.values[keep], totals)


def interleave(groups: list[list]) -> list:
    """The groups' elements merged in proportion, each group's in its order (element i of a group
    of n sits at (i + 0.5) / n of the way): a corpus unit's items, one group per source, so any
    stretch of the unit's items holds the sources by their shares."""
    keyed = [((i + 0.5) / len(g), k, x) for k, g in enumerate(groups) for i, x in enumerate(g)]
    return [x for _, _, x in sorted(keyed, key=lambda t: (t[0], t[1]))]
