"""The producer loop: take a unit, lease it, read, rank + tokenize, pack, put, mark it done.

Stateless and safe to kill at any point: a unit is only marked done after all its items are
put, so a unit interrupted mid-way is produced again from scratch (the driver re-issues it when
its lease expires) and consumers drop the duplicate items by key. A unit's output is identical
every time: cells are shuffled with a generator seeded by (seed, epoch, unit).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from coordination.arrays import offsets_of, positions_in_ranges, ragged_arange
from coordination.errors import CellfeedError
from coordination.plan import DatasetGeometry, EpochPlan, Sampling, WorkUnit, derive_key
from coordination.queues import Empty, Full, Map, Queue
from coordination.routing import (EVAL_PARTITION, TASKS_PARTITION, cell_rank, decode_task, done_key, lease_key,
                                  producer_report_key, rank_partition, run_tag, stop_key, unit_rank)
from coordination.wire import pack_items
from producers.dataset import Dataset, RowBlock, error_text, open_dataset
from producers.gene_stats import load_gene_medians
from producers.ranking import CellRows
from producers.stitch import offer_piece
from producers.tokenizers import make_tokenizer, needs_gene_medians

STOP_POLL_S = 1.0  # how often an idle producer checks for a stop
PUT_BATCH_ITEMS = 32  # items per put_many call (32 x <=1 MiB stays far inside a 64 MiB partition)


@dataclass(frozen=True)
class ProducerConfig:
    dataset: str
    run: str
    seed: int = 0
    sampling: Sampling = field(default_factory=Sampling)
    tokenizer: str = "scgpt"
    max_genes: int | None = None  # None: the tokenizer's own length (coordination.tokens)
    tokenizer_params: dict = field(default_factory=dict)
    world_size: int = 1
    cells_per_item: int = 128
    label_column: str | None = None  # an obs column carried as int labels (e.g. "plate")
    subset_filter: str | None = None  # a Lance SQL filter on obs, e.g. "plate != 'plate14'"
    subset_ids: tuple[int, ...] | None = None
    exclude_filter: str | None = None  # cells never to produce for training, e.g. the held-out split
    lease_s: float = 120.0
    put_timeout_s: float = 600.0
    idle_timeout_s: float = 10.0

    def validate(self) -> "ProducerConfig":
        self.sampling.validate()
        if self.world_size < 1:
            raise CellfeedError(f"world_size must be >= 1, got {self.world_size}")
        if self.cells_per_item < 1:
            raise CellfeedError(f"cells_per_item must be >= 1, got {self.cells_per_item}")
        if not self.run or "/" in self.run:
            raise CellfeedError(f"run id must be non-empty and without '/', got {self.run!r}")
        return self


def select_cells(ds: Dataset, subset_filter: str | None = None, subset_ids=None, exclude_filter: str | None = None,
                 *, option: str = "--subset-filter") -> np.ndarray | None:
    """The selected cell ids (None = all cells): an obs filter and/or an id list, less the cells
    that `exclude_filter` matches (a held-out split is never trained on). `option` names the
    filter in errors."""
    if subset_filter is None and subset_ids is None and exclude_filter is None:
        return None
    selected = np.arange(ds.n_cells, dtype=np.int64)
    if subset_filter is not None:
        selected = filter_cells(ds, subset_filter, option)
    if subset_ids is not None:
        ids = np.unique(np.asarray(subset_ids, dtype=np.int64))
        if len(ids) and (ids[0] < 0 or ids[-1] >= ds.n_cells):
            raise CellfeedError(f"subset ids must lie in 0..{ds.n_cells - 1}")
        selected = np.intersect1d(selected, ids)
    if exclude_filter is not None:
        selected = np.setdiff1d(selected, filter_cells(ds, exclude_filter, "--eval-filter"), assume_unique=True)
    if len(selected) == 0:
        what = f"{option} {subset_filter!r}" if subset_filter is not None else "the cell subset"
        extra = f" once the --eval-filter {exclude_filter!r} cells are held out" if exclude_filter is not None else ""
        raise CellfeedError(f"{what} selects no cells{extra}; check the filter (`cellfeed inspect DATASET` lists "
                            "the obs columns and their values)")
    return selected


def filter_cells(ds: Dataset, expression: str, option: str) -> np.ndarray:
    """Sorted ids of the cells whose obs match a Lance SQL filter; `option` names it in errors."""
    try:
        table = ds.cells.to_table(columns=["cell_integer_id"], filter=expression)
    except Exception as exc:  # noqa: BLE001 - Lance reports filter syntax/column errors
        text = error_text(exc)
        hint = "" if "Valid fields" in text else f" (obs columns: {', '.join(ds.obs_columns)})"
        raise CellfeedError(f"bad {option} {expression!r}: {text}{hint}") from None
    return np.sort(table.column(0).to_numpy().astype(np.int64))


def label_codes(ds: Dataset, column: str) -> tuple[np.ndarray, list[str]]:
    """Per-cell int32 codes of an obs column, and the label names they index."""
    import pyarrow.compute as pc

    encoded = pc.dictionary_encode(ds.obs([column]).column(0)).combine_chunks()
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int32), encoded.dictionary.to_pylist()


@dataclass
class ProducerStats:
    units: int = 0
    cells: int = 0
    items: int = 0
    bytes: int = 0
    seconds: dict = field(default_factory=lambda: defaultdict(float))

    def add_time(self, stage: str, start: float) -> float:
        now = time.perf_counter()
        self.seconds[stage] += now - start
        return now


class Producer:
    """Turns work units into items on the queue; all setup and validation happens here, up front."""

    def __init__(self, config: ProducerConfig, queue: Queue, store: Map, dataset: Dataset | None = None,
                 name: str | None = None):
        self.config = config.validate()
        self.queue, self.store = queue, store
        self.ds = dataset or open_dataset(config.dataset)
        medians = None
        if needs_gene_medians(config.tokenizer) and self.ds.is_counts:
            medians = load_gene_medians(self.ds)
            if medians is None:
                raise CellfeedError(f"--tokenizer {config.tokenizer} needs Geneformer's gene medians, which "
                                    f"{self.ds.uri} does not have yet: run `cellfeed stats {self.ds.uri}` once")
        self.tokenizer = make_tokenizer(config.tokenizer, self.ds.n_genes, max_genes=config.max_genes,
                                        values_are_counts=self.ds.is_counts, gene_medians=medians,
                                        **config.tokenizer_params)
        self.geometry = DatasetGeometry.of(self.ds)
        self.subset = select_cells(self.ds, config.subset_filter, config.subset_ids, config.exclude_filter)
        self.labels = label_codes(self.ds, config.label_column)[0] if config.label_column else None
        self.tag = run_tag(config.run)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.stats = ProducerStats()
        self._plans: dict[int, EpochPlan] = {}
        self._plan_lock = threading.Lock()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cellfeed-prefetch")

    def plan(self, epoch: int) -> EpochPlan:
        """The epoch's plan, cached for this and the previous epoch (the read-ahead may cross)."""
        with self._plan_lock:
            if epoch not in self._plans:
                self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}
                self._plans[epoch] = EpochPlan(self.geometry, self.config.sampling, self.config.seed, epoch,
                                               self.subset)
            return self._plans[epoch]

    # ---- one unit

    def _put(self, items: list[bytes], partition: str) -> None:
        for i in range(0, len(items), PUT_BATCH_ITEMS):
            batch = items[i:i + PUT_BATCH_ITEMS]
            try:
                self.queue.put_many(batch, block=True, timeout=self.config.put_timeout_s, partition=partition)
            except Full:
                raise CellfeedError(
                    f"queue partition {partition} stayed full for {self.config.put_timeout_s:.0f}s: "
                    "is the trainer consuming?"
                ) from None
            self.stats.items += len(batch)
            self.stats.bytes += sum(len(b) for b in batch)

    def _emit(self, rows: CellRows, epoch: int, key_id: int, stitched: bool, partition: str,
              rng: np.random.Generator) -> None:
        t = time.perf_counter()
        tokens = self.tokenizer(rows, rng)
        t = self.stats.add_time("tokenize", t)
        labels = None if self.labels is None else self.labels[rows.cell_ids]
        items = pack_items(tokens, epoch=epoch, key_id=key_id, run_tag=self.tag, stitched=stitched,
                           labels=labels, cells_per_item=self.config.cells_per_item)
        t = self.stats.add_time("pack", t)
        self._put(items, partition)
        self.stats.add_time("put", t)
        self.stats.cells += rows.n_cells

    def produce_held_out(self, cell_ids: np.ndarray, partition: str = EVAL_PARTITION) -> int:
        """Tokenize a fixed set of cells (e.g. an evaluation split) into `partition`, once."""
        cell_ids = np.sort(np.asarray(cell_ids, dtype=np.int64))
        block = self.ds.read_cells(cell_ids)
        counts = np.diff(self.ds.cell_row_start)[cell_ids]
        rows = CellRows(cell_ids, offsets_of(counts), block.gene, block.value)
        self._emit(rows, 0, 0, False, partition, np.random.default_rng(derive_key(self.config.seed, "held-out")))
        return len(cell_ids)

    def read(self, epoch: int, unit_id: int) -> tuple[WorkUnit, RowBlock]:
        unit = self.plan(epoch).unit(unit_id)
        return unit, self.ds.read_row_ranges(unit.ranges)

    def process(self, epoch: int, unit_id: int, prefetched: Future | None = None) -> None:
        """Produce every item of one unit (and any boundary cell it completes). With a read
        already under way (`prefetched`), only the time spent waiting for it counts as read."""
        cfg = self.config
        t = time.perf_counter()
        unit, block = prefetched.result() if prefetched is not None else self.read(epoch, unit_id)
        t = self.stats.add_time("read", t)
        cell_col = block.cell
        rng = np.random.default_rng(derive_key(cfg.seed, epoch, "unit", unit_id))
        # whole cells, shuffled; each cell's rows are contiguous in the block
        order = rng.permutation(len(unit.cells))
        cells = unit.cells[order]
        lo = np.searchsorted(cell_col, cells, side="left")
        hi = np.searchsorted(cell_col, cells, side="right")
        rows_idx = ragged_arange(lo, hi)
        whole = CellRows(cells, offsets_of(hi - lo), block.gene[rows_idx], block.value[rows_idx])
        self.stats.add_time("read", t)
        if whole.n_cells:
            self._emit(whole, epoch, unit_id, False, rank_partition(unit_rank(unit_id, cfg.world_size)), rng)
        # boundary pieces: stitch through the map; the last arrival emits the cell
        piece_at = positions_in_ranges(unit.ranges, unit.piece_rows[:, 0]) if len(unit.pieces) else []
        for p, (cell, index, count) in enumerate(zip(unit.pieces.tolist(), unit.piece_index.tolist(),
                                                     unit.piece_count.tolist())):
            a = int(piece_at[p])
            b = a + int(unit.piece_rows[p, 1] - unit.piece_rows[p, 0])
            t = time.perf_counter()
            whole_cell = offer_piece(self.store, cfg.run, epoch, f"{unit_id}.{index}", cell, index, count,
                                     block.gene[a:b], block.value[a:b])
            self.stats.add_time("stitch", t)
            if whole_cell is not None:
                rows = CellRows(np.array([cell], dtype=np.int64), np.array([0, len(whole_cell[0])]), *whole_cell)
                cell_rng = np.random.default_rng(derive_key(cfg.seed, epoch, "cell", cell))
                self._emit(rows, epoch, cell, True, rank_partition(cell_rank(cell, cfg.world_size)), cell_rng)
        self.stats.units += 1

    # ---- the loop

    def _lease(self, epoch: int, unit: int) -> None:
        value = json.dumps({"producer": self.name, "expires": time.time() + self.config.lease_s})
        self.store.put(lease_key(self.config.run, epoch, unit), value)

    def _take_task(self, block: bool) -> tuple[int, int, Future] | None:
        """The next unit not yet done, leased and with its read started; None when the task list
        stayed empty for `idle_timeout_s` (or at once if not `block`), or a stop was signalled."""
        run = self.config.run
        idle_until = time.monotonic() + self.config.idle_timeout_s
        while self.store.get(stop_key(run)) is None:
            wait = min(STOP_POLL_S, idle_until - time.monotonic()) if block else 0.0
            try:
                task = self.queue.get(block=block, timeout=max(wait, 0.01) if block else None,
                                      partition=TASKS_PARTITION)
            except Empty:
                task = None
            if task is None:
                if not block or time.monotonic() >= idle_until:
                    return None
                continue
            epoch, unit = decode_task(task)
            if self.store.get(done_key(run, epoch, unit)) is not None:
                continue  # a re-issued unit that another producer finished meanwhile
            self._lease(epoch, unit)
            return epoch, unit, self._reader.submit(self.read, epoch, unit)
        return None

    def run(self, max_units: int | None = None) -> ProducerStats:
        """Work until the task list stays empty for `idle_timeout_s`, a stop is signalled, or
        `max_units` units are done. The next unit is read while this one is tokenized."""
        run = self.config.run
        pending = None
        while max_units is None or self.stats.units < max_units:
            current = pending or self._take_task(block=True)
            if current is None:
                break
            more = max_units is None or self.stats.units + 1 < max_units
            pending = self._take_task(block=False) if more else None
            epoch, unit, reading = current
            self.process(epoch, unit, reading)
            self.store.put(done_key(run, epoch, unit), self.name)
            self.store.pop(lease_key(run, epoch, unit), None)
            self.report()
        return self.stats

    def report(self) -> None:
        """Publish running totals (cells, units, bytes, busy seconds) for monitors (once per unit)."""
        s = self.stats
        self.store.put(producer_report_key(self.config.run, self.name), json.dumps(
            {"cells": s.cells, "units": s.units, "items": s.items, "bytes": s.bytes,
             "busy_s": round(sum(s.seconds.values()), 3), "time": time.time()}))


def produce(config: ProducerConfig, queue: Queue, store: Map, max_units: int | None = None) -> ProducerStats:
    """Entry point for a producer process or Modal function."""
    return Producer(config, queue, store).run(max_units)
