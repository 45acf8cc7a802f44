"""The held-out set: a fixed set of cells (an evaluation split) tokenized once into a queue
partition of its own, which the trainer reads whole at every evaluation."""

from __future__ import annotations

import numpy as np

from coordination.errors import CellfeedError
from coordination.plan import NO_ROWS, Unit, UnitPart
from coordination.queues import MAX_PARTITION_BYTES, MAX_PARTITION_ITEMS
from coordination.routing import EVAL_PARTITION
from coordination.seeds import held_out_rng
from producers.items import unit_items


def check_fits_partition(n_cells: int, n_items: int, n_bytes: int) -> None:
    """A held-out set is read whole from one queue partition: refuse one that cannot fit."""
    if n_items > MAX_PARTITION_ITEMS or n_bytes > MAX_PARTITION_BYTES:
        raise CellfeedError(
            f"the held-out set ({n_cells:,} cells: {n_items:,} items, {n_bytes / 2**20:,.1f} MiB) "
            f"does not fit one queue partition ({MAX_PARTITION_ITEMS:,} items, "
            f"{MAX_PARTITION_BYTES >> 20} MiB): lower --eval-cells"
        )


def produce_held_out(producer, cell_ids: np.ndarray, partition: str = EVAL_PARTITION) -> int:
    """Tokenize a fixed set of cells (global ids) with `producer`'s sources and tokenizer into
    `partition`, once. It must fit one partition: a larger set is refused before anything is put.
    Returns the number of items put."""
    items = tokenize_cells(producer, cell_ids)
    check_fits_partition(len(cell_ids), len(items), sum(len(b) for b in items))
    producer.courier.send(items, partition)
    return len(items)


def compile_token_pass(producer) -> None:
    """Tokenize a few cells of every source and drop them: the token pass is compiled (and cached:
    `producers/kernel_cache.py`) for each source's types, where no held-out set did it."""
    firsts = [src.offset + np.arange(min(4, src.ds.n_cells)) for src in producer.sources]
    tokenize_cells(producer, np.concatenate(firsts))


def tokenize_cells(producer, cell_ids: np.ndarray) -> list[bytes]:
    """The items of a fixed set of cells (global ids), as one unit (key (0, 0, seq))."""
    cell_ids = np.sort(np.asarray(cell_ids, dtype=np.int64))
    parts, cells = [], []
    for s, src in enumerate(producer.sources):
        local = cell_ids[(cell_ids >= src.offset) & (cell_ids < src.offset + src.ds.n_cells)] - src.offset
        if len(local):
            parts.append(UnitPart(s, local, NO_ROWS))
            cells.append(src.ds.read_cells(local))
    unit = Unit(0, 0, parts)
    items, _, _ = unit_items(
        unit, cells, producer.tokenizer, producer.item_settings, held_out_rng(producer.config.seed)
    )
    return items
