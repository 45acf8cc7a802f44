"""A unit's cells -> items: rank, tokenize and pack whole cells into numbered items.

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

import numpy as np

from coordination.arrays import offsets_of, ragged_arange
from coordination.wire import number_items, pack_cells
from producers.dataset import RowBlock
from producers.ranking import CellRows

CHUNK_CELLS = 256  # cells tokenized at once: their rows (~0.4M at 1,600 genes per cell) fit in cache


def cells_to_items(cells: np.ndarray, first: np.ndarray, counts: np.ndarray, block: RowBlock, tokenizer, *,
                   epoch: int, key_id: int, run_tag: int, rng: np.random.Generator, cells_per_item: int,
                   labels: np.ndarray | None = None, stitched: bool = False, totals: np.ndarray | None = None,
                   pool: Executor | None = None) -> tuple[list[bytes], float, float]:
    """Items of `cells`, in this order (cell i's rows are block[first[i]:first[i] + counts[i]];
    `totals[i]` its total before genes outside the vocabulary were dropped), and the seconds
    spent tokenizing and packing (summed over threads)."""
    size = cells_per_item * max(1, CHUNK_CELLS // cells_per_item)
    bounds = list(range(0, len(cells), size))
    rngs = rng.spawn(len(bounds))

    def chunk(i: int) -> tuple[list[bytearray], float, float]:
        t0 = time.perf_counter()
        sel = slice(bounds[i], bounds[i] + size)
        at = ragged_arange(first[sel], first[sel] + counts[sel])
        rows = CellRows(cells[sel], offsets_of(counts[sel]), block.gene[at], block.value[at],
                        None if totals is None else totals[sel])
        tokens = tokenizer(rows, rngs[i])
        t1 = time.perf_counter()
        packed = pack_cells(tokens, epoch=epoch, key_id=key_id, run_tag=run_tag, stitched=stitched,
                            labels=None if labels is None else labels[rows.cell_ids], cells_per_item=cells_per_item)
        return packed, t1 - t0, time.perf_counter() - t1

    jobs = map(chunk, range(len(bounds))) if (pool is None or len(bounds) == 1) else pool.map(chunk, range(len(bounds)))
    packed, tokenize_s, pack_s = [], 0.0, 0.0
    for part, t, p in jobs:
        packed += part
        tokenize_s, pack_s = tokenize_s + t, pack_s + p
    return number_items(packed), tokenize_s, pack_s


def map_genes(block: RowBlock, first: np.ndarray, counts: np.ndarray,
              gene_tokens: np.ndarray) -> tuple[RowBlock, np.ndarray, np.ndarray, np.ndarray | None]:
    """Cells' rows with gene ids replaced by token ids (`gene_tokens[gene]`, -1: outside the
    vocabulary) and the rows of genes outside dropped, as scGPT and Geneformer drop them before
    ranking and binning. Returns the new rows (cell i's at first'[i]:first'[i] + counts'[i]) and,
    when rows were dropped, each cell's total over all its rows (Geneformer divides by the
    cell's whole count, its `n_counts`; None: nothing dropped, the rows' sum is the total)."""
    at = ragged_arange(first, first + counts)
    tokens = gene_tokens[block.gene[at]]
    values = block.value[at]
    new_first = offsets_of(counts)[:-1]
    totals = None
    if len(tokens) and tokens.min() < 0:
        keep = tokens >= 0
        cell = np.repeat(np.arange(len(counts)), counts)
        totals = np.bincount(cell, weights=values, minlength=len(counts))
        counts = np.bincount(cell[keep], minlength=len(counts)).astype(np.int64)
        tokens, values, new_first = tokens[keep], values[keep], offsets_of(counts)[:-1]
    return RowBlock(None, tokens, values), new_first, counts, totals
