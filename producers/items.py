"""A unit's work, one pure function (`unit_items`): its cells, as read (`CellRows`) -> numbered
items. Source by source: genes mapped to tokens, each cell ranked and tokenized, whole cells
packed into items; then the sources' items merged in proportion and numbered.

The same unit gives the same items on any producer, any number of times, which is what makes a
re-issued unit harmless (consumers drop the duplicates by key). Work is split in chunks of a few
hundred cells on a thread pool: a chunk's rows fit in cache (one sort of a whole unit's rows is
several times slower per row), and the compiled token pass, NumPy and zstd release the GIL. Chunks hold whole
items, so the items are the same as if the unit were packed at once; each chunk draws from its
own child of the unit's generator.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor
from dataclasses import dataclass, replace

import numpy as np

from coordination.arrays import CellRows
from coordination.plan import Unit
from coordination.wire import number_items, pack_cells

CHUNK_CELLS = 256  # cells tokenized at once: their rows (~0.4M at 1,600 genes per cell) fit in cache


@dataclass(frozen=True)
class ItemSettings:
    """What every unit's items share: the campaign's sources (each one's first global cell id,
    `offset`, and gene -> token lookup, `gene_tokens`: `producers.sources.Source`), the run's tag,
    cells per item, each cell's label by global id (or None), and the pool the chunks run on (None:
    the caller's thread; the items are the same)."""

    sources: list
    run_tag: int
    cells_per_item: int
    labels: np.ndarray | None = None
    pool: Executor | None = None


def unit_items(
    unit: Unit,
    cells: list[CellRows],
    tokenizer,
    settings: ItemSettings,
    rng: np.random.Generator,
    *,
    shuffle: bool = False,
    stitched: bool = False,
) -> tuple[list[bytes], float, float]:
    """The numbered items of a unit's cells (`cells[i]`: part i's, local ids), and the seconds
    spent tokenizing and packing (summed over threads). Each part's cells are tokenized apart (a
    source's rows share a dtype, which ranking's fast path needs) and, with several parts, their
    items interleaved in proportion (`interleave`), so any stretch of a unit's items (what a rank's
    mixing buffer holds) has every source by its share. `rng`: each part draws from its own child
    (one part: `rng`), which first shuffles its cells when `shuffle`. A `stitched` unit is one
    boundary cell, made whole: its id is the cell's."""
    groups, tokenize_s, pack_s = [], 0.0, 0.0
    rngs = rng.spawn(len(cells)) if len(cells) > 1 else [rng]
    for part, rows, part_rng in zip(unit.parts, cells, rngs):
        src = settings.sources[part.source]
        order = part_rng.permutation(rows.n_cells) if shuffle else np.arange(rows.n_cells)
        rows = replace(rows, cell_ids=rows.cell_ids + src.offset)
        size = settings.cells_per_item * max(1, CHUNK_CELLS // settings.cells_per_item)
        bounds = list(range(0, rows.n_cells, size))
        chunk_rngs = part_rng.spawn(len(bounds))

        def chunk(i: int) -> tuple[list[bytearray], float, float]:
            t0 = time.perf_counter()
            # the chunk's cells in their shuffled order, their genes mapped to tokens on the way
            tokens = tokenizer(rows, chunk_rngs[i], src.gene_tokens, cells=order[bounds[i] : bounds[i] + size])
            t1 = time.perf_counter()
            packed = pack_cells(
                tokens,
                epoch=unit.epoch,
                key_id=unit.id,
                run_tag=settings.run_tag,
                stitched=stitched,
                labels=None if settings.labels is None else settings.labels[tokens.cell_ids],
                cells_per_item=settings.cells_per_item,
            )
            return packed, t1 - t0, time.perf_counter() - t1

        pool = settings.pool if len(bounds) > 1 else None
        packed = []
        for items, t, p in map(chunk, range(len(bounds))) if pool is None else pool.map(chunk, range(len(bounds))):
            packed += items
            tokenize_s, pack_s = tokenize_s + t, pack_s + p
        groups.append(packed)
    return number_items(interleave(groups) if len(groups) > 1 else groups[0]), tokenize_s, pack_s


def interleave(groups: list[list]) -> list:
    """The groups' elements merged in proportion, each group's in its order (element i of a group
    of n sits at (i + 0.5) / n of the way): a corpus unit's items, one group per source, so any
    stretch of the unit's items holds the sources by their shares."""
    keyed = [((i + 0.5) / len(g), k, x) for k, g in enumerate(groups) for i, x in enumerate(g)]
    return [x for _, _, x in sorted(keyed, key=lambda t: (t[0], t[1]))]
