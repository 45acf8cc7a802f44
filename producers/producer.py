"""The producer loop: take a unit (and read its cells), make its items, send them.

    run -> _take (read-ahead threads: the task, `read`) -> process (`producers.items.unit_items`) -> courier.post

Stateless and safe to kill at any point: a unit is only reported done after all its items are
put, so a unit interrupted mid-way is produced again from scratch (the driver re-issues it once
its producer falls silent) and consumers drop the duplicate items by key. A unit's output is
identical every time: cells are shuffled with a generator seeded by (seed, epoch, unit).

Coordination costs about two calls per unit, whatever the latency: one `get` of the task and one
`put` of a done event (docs/DESIGN.md, "Routing and exactly-once"). The sending, the heartbeats
and the backpressure are the courier's (`producers.courier`); the settings are
`producers.config.ProducerConfig`; the held-out set is `producers.held_out`.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from coordination.arrays import CellRows
from coordination.errors import CellfeedError
from coordination.plan import NO_ROWS, Plan, Unit, UnitPart
from coordination.queues import Empty, Map, MapGone, Queue
from coordination.routing import (
    TASKS_PARTITION,
    cell_rank,
    decode_task,
    epoch_map_name,
    rank_partition,
    run_tag,
    summary_key,
    unit_rank,
)
from coordination.seeds import cell_rng, unit_rng
from coordination.summary import PlanSummary
from coordination.vocab import GeneVocab, published_vocab
from producers.config import ProducerConfig, usable_cpus
from producers.courier import STOP_POLL_S, Courier, Stopped
from producers.dataset import Dataset
from producers.items import ItemSettings, unit_items
from producers.selection import label_codes
from producers.sources import (
    attach_vocab,
    balance_strata,
    campaign_tokenizer,
    campaign_vocab,
    epoch_plan,
    open_sources,
    source_quotas,
)
from producers.stitch import offer_piece
from producers.storage import LocalLocation, StorageUnavailable

MAX_READ_AHEAD = 16  # units read ahead at most
LOCAL_READ_AHEAD = 2  # on local disk: a read is CPU work; deeper only measured its own queueing and grew
READ_AHEAD_BYTES = 512 << 20  # rows held by the units read ahead at most (a b=16 f=256 unit holds ~100 MB)
_UNNAMED = itertools.count()  # a producer made without a name: its number in this process


@dataclass
class ProducerStats:
    units: int = 0
    cells: int = 0
    items: int = 0
    bytes: int = 0
    seconds: dict = field(default_factory=lambda: defaultdict(float))
    # per unit, the latest few thousand: how long its rows took to read, and how long the loop
    # then waited for them (0 when the read-ahead hid the read)
    unit_read_s: deque = field(default_factory=lambda: deque(maxlen=4096))
    unit_wait_s: deque = field(default_factory=lambda: deque(maxlen=4096))

    def add_time(self, stage: str, start: float) -> float:
        now = time.perf_counter()
        self.seconds[stage] += now - start
        return now


class Producer:
    """Turns work units into items on the queue; all setup and validation happens here, up front."""

    def __init__(
        self,
        config: ProducerConfig,
        queue: Queue,
        store: Map,
        dataset: Dataset | None = None,
        name: str | None = None,
        vocab: GeneVocab | None = None,
        verify: bool = False,
    ):
        self.config = config.validate()
        self.queue, self.store = queue, store
        self.mixtures = config.corpus_mixtures()
        self.spec = self.mixtures.union if self.mixtures is not None else config.corpus_spec()
        # `verify`: the sources are checked at open (the campaign's setup does it, once; the fleet's
        # producers, started after it, do not pay for it again at every start)
        self.sources = open_sources(
            self.spec,
            subset_ids=config.subset_ids,
            verify=verify,
            datasets={config.dataset: dataset} if dataset is not None else None,
        )
        self.ds = self.sources[0].ds
        # the setup's vocabulary once published (the same, built or read the same way, before): built
        # from the run's first sources, so a source added at a resume maps into the run's vocabulary
        first = {s.name for s in self.mixtures.history[0][1].sources} if self.mixtures is not None else None
        self.vocab = (
            vocab
            or published_vocab(store, config.run)
            or campaign_vocab(self.spec, [s for s in self.sources if first is None or s.spec.name in first])
        )
        attach_vocab(self.sources, self.vocab)
        self.tokenizer = campaign_tokenizer(
            self.sources, self.vocab, config.tokenizer, config.max_genes, config.gene_medians, config.tokenizer_params
        )
        self.selected = {s.spec.name: s.n_selected for s in self.sources}
        # each source's cells per epoch under the latest mixture (None: one dataset)
        self.quotas = (
            None if self.mixtures is None else self.mixtures.quotas_at(self.mixtures.history[-1][0], self.selected)
        )
        self.labels = label_codes(self.ds, config.label_column)[0] if config.label_column else None
        self.strata = balance_strata(self.sources, config.balance) if config.balance else None  # cells by class
        if self.strata is not None:  # each cell's class as its label: the trainer counts the mix it trains
            self.labels = self.strata.labels(self.sources[-1].offset + self.sources[-1].ds.n_cells)
        self.tag = run_tag(config.run)
        # (a name of its own: a producer started under another's name would tell the driver that one died)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{next(_UNNAMED)}"
        self.stats = ProducerStats()
        self._setup_loop()
        if config.reads_in_flight:  # each dataset's reads in flight fixed, not paced (`_pace_reads`)
            for source in self.sources:
                if source.ds.read_slots is not None:
                    source.ds.read_slots.fix(config.reads_in_flight)
        self.item_settings = ItemSettings(self.sources, self.tag, config.cells_per_item, self.labels, self._workers)

    def _setup_loop(self) -> None:
        """State of the loop (`run`) and its courier, apart from the data work."""
        cfg = self.config
        self._plans: dict[int, Plan] = {}
        self._plan_lock = threading.Lock()
        self._reader = ThreadPoolExecutor(
            max_workers=cfg.read_ahead or MAX_READ_AHEAD, thread_name_prefix="cellfeed-prefetch"
        )
        self.threads = cfg.threads or usable_cpus()
        self._workers = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="cellfeed-tokenize")
        self._stopping = threading.Event()  # the loop's and the courier's: set, both stop
        self.courier = Courier(
            self.queue,
            self.store,
            run=cfg.run,
            name=self.name,
            heartbeat_s=cfg.heartbeat_s,
            put_timeout_s=cfg.put_timeout_s,
            totals=self.totals,
            stopping=self._stopping,
        )
        self._epoch_maps: dict[int, Map] = {}
        self._checked_epochs: set[int] = set()  # epochs whose published plan matched this producer's
        self._unit_work_s: deque = deque(maxlen=8)  # recent units' tokenize-pack-hand-off times
        self._unit_rows: deque = deque(maxlen=8)  # ... and the rows each read from each dataset ({ReadSlots: rows})
        self._unit_bytes = 0  # the latest unit's rows in memory

    def plan(self, epoch: int) -> Plan:
        """The epoch's plan (`producers.sources.epoch_plan`), cached for this and the previous
        epoch (the read-ahead may cross)."""
        with self._plan_lock:
            if epoch not in self._plans:
                self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}
                self._plans[epoch] = epoch_plan(
                    self.sources, self.mixtures, self.config.sampling, self.config.seed, epoch, self.strata
                )
            return self._plans[epoch]

    def class_mix(self, epoch: int) -> list[list]:
        """Balanced: [[class, cells planned], ...] of `epoch` (`PlanSummary.class_mix`, which the audit checks)."""
        return self.strata.class_mix(source_quotas(self.sources, self.mixtures, epoch)) if self.strata else []

    # ---- one unit: take, read, make its items, send them

    def read(self, epoch: int, unit_id: int) -> tuple[Unit, list[CellRows], CellRows | None]:
        """A unit, its cells (per part, as `Dataset.read_cells` gives them: local ids) and the
        boundary pieces it holds (keyed by their cells; None: none), from one read of each part's
        row ranges. Storage that does not answer is tried again (1 s, 2 s, 4 s, then 5 s apart,
        for `read_retry_s`): an object store restarting mid-epoch costs time, not the run. The unit
        stays held meanwhile (the courier's heartbeats name it)."""
        unit = self.plan(epoch).unit(unit_id)
        deadline, pause = time.monotonic() + self.config.read_retry_s, 1.0
        while True:
            try:
                if not len(unit.pieces):
                    return unit, [self.sources[p.source].ds.read_cells(p.cells, p.ranges) for p in unit.parts], None
                # a scanner unit's one part: its cells and pieces, read end to end in storage order, told apart
                (part,) = unit.parts
                ds = self.sources[part.source].ds
                starts = ds.cell_row_start
                ids = np.concatenate([part.cells, unit.pieces])
                spans = np.concatenate([np.stack([starts[part.cells], starts[part.cells + 1]], 1), unit.piece_rows])
                order = np.lexsort((spans[:, 1], spans[:, 0]))
                rows, at = ds.read_cells(ids[order], part.ranges, spans[order]), np.argsort(order)
                return unit, [rows.select(at[: len(part.cells)])], rows.select(at[len(part.cells) :])
            except StorageUnavailable:
                if time.monotonic() + pause > deadline or self._stopping.is_set():
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 5.0)

    def process(self, epoch: int, unit_id: int, taken: tuple | None = None) -> None:
        """One unit: its items (`unit_items`) to its rank's partition, those of the boundary cells
        it completes to theirs, then its done event, all posted to the courier. `taken`: what
        `read` gave (the loop reads ahead), else it is read here."""
        cfg, t = self.config, time.perf_counter()
        unit, cells, pieces = taken if taken is not None else self.read(epoch, unit_id)
        self.stats.add_time("read", t)
        made = []  # (rank, (items, tokenize seconds, pack seconds))
        if unit.n_cells:
            rng = unit_rng(cfg.seed, epoch, unit.id)
            made.append(
                (
                    unit_rank(unit.id, cfg.world_size),
                    unit_items(unit, cells, self.tokenizer, self.item_settings, rng, shuffle=True),
                )
            )
            self.stats.cells += unit.n_cells
        for cell, whole in self._stitch(unit, pieces) if pieces is not None else ():  # (a scanner unit's pieces)
            one = Unit(epoch, cell, [UnitPart(0, whole.cell_ids, NO_ROWS)])  # a unit of one cell, keyed by its id
            rng = cell_rng(cfg.seed, epoch, cell)
            made.append(
                (
                    cell_rank(cell, cfg.world_size),
                    unit_items(one, [whole], self.tokenizer, self.item_settings, rng, stitched=True),
                )
            )
            self.stats.cells += 1
        for _, (items, tokenize_s, pack_s) in made:
            self.stats.seconds["tokenize"] += tokenize_s
            self.stats.seconds["pack"] += pack_s
            self.stats.items += len(items)
            self.stats.bytes += sum(len(b) for b in items)
        t = time.perf_counter()
        self.courier.post([(rank_partition(rank), items) for rank, (items, _, _) in made], (epoch, unit.id))
        self.stats.add_time("put", t)
        self.stats.units += 1

    def _stitch(self, unit: Unit, pieces: CellRows):
        """The boundary cells this unit completes, each whole (`CellRows` of one cell): each piece
        it holds is offered to the epoch's map; the last piece to arrive gets the cell."""
        for p, (cell, index, count) in enumerate(
            zip(pieces.cell_ids.tolist(), unit.piece_index.tolist(), unit.piece_count.tolist())
        ):
            a, b = int(pieces.offsets[p]), int(pieces.offsets[p + 1])
            t = time.perf_counter()
            try:
                whole = offer_piece(
                    self._epoch_map(unit.epoch),
                    unit.epoch,
                    f"{unit.id}.{index}",
                    cell,
                    index,
                    count,
                    pieces.ids[a:b],
                    pieces.values[a:b],
                )
            except MapGone:  # the epoch is complete: this is a late duplicate, the cell was emitted
                whole = None
            self.stats.add_time("stitch", t)
            if whole is not None:
                yield cell, CellRows(np.array([cell]), np.array([0, len(whole[0])]), *whole)

    def _check_plan(self, epoch: int) -> None:
        """Once per epoch: this producer's plan is the one the campaign published (same dataset
        content, sampling, seed and selection), else nothing is produced from it."""
        if epoch in self._checked_epochs:
            return
        published = self.store.get(summary_key(self.config.run, epoch))
        if published is not None:
            planned = PlanSummary.from_bytes(published)
            mine = self.plan(epoch)
            if planned.plan_id != mine.plan_id:
                raise CellfeedError(
                    f"{self.ds.uri} changed since run {self.config.run} planned epoch {epoch} (its plan "
                    f"{planned.plan_id}, this dataset's {mine.plan_id}: {planned.n_cells:,} cells planned, "
                    f"{mine.n_cells:,} now): restore the dataset, or start a new --run on the new one"
                )
        self._checked_epochs.add(epoch)

    def _epoch_map(self, epoch: int) -> Map:
        """The epoch's stitching map (the driver creates it; opening it creates nothing)."""
        if epoch not in self._epoch_maps:
            self._epoch_maps = {e: m for e, m in self._epoch_maps.items() if e >= epoch - 1}
            self._epoch_maps[epoch] = self.store.named(epoch_map_name(epoch))
        return self._epoch_maps[epoch]

    # ---- the loop

    def run(self, max_units: int | None = None) -> ProducerStats:
        """Work until the task list stays empty for `idle_timeout_s`, a stop is signalled, or
        `max_units` units are done. The next `read_ahead` units are taken and read while this one
        is worked on (deeper when storage is remote: its reads take several round trips); the
        courier thread sends while the next is worked on, so no call waits on this thread."""
        self._stopping.clear()  # a stop still signalled in the map is read by the courier's first heartbeat
        self.courier.start()
        ahead: deque = deque()
        taken_units = 0
        idle = False
        finished = False
        try:
            while True:
                while not idle and len(ahead) < self.read_ahead() and (max_units is None or taken_units < max_units):
                    ahead.append(self._reader.submit(self._take))
                    taken_units += 1
                if not ahead:
                    break
                t = time.perf_counter()
                # the oldest finished take (waiting for one if none is): never wait on a take still
                # looking for a task while a later one holds a unit's rows
                if not any(f.done() for f in ahead):
                    wait(ahead, return_when=FIRST_COMPLETED)
                done = next(f for f in ahead if f.done())
                ahead.remove(done)
                taken = done.result()
                self.stats.add_time("read", t)
                if taken is None:  # the task list stayed empty (or a stop): finish what was taken
                    idle = True
                    continue
                self.stats.unit_wait_s.append(time.perf_counter() - t)
                epoch, unit, cells = taken
                t = time.perf_counter()
                self.process(epoch, unit, cells)
                self._unit_work_s.append(time.perf_counter() - t)
                self._unit_bytes = sum(c.ids.nbytes + c.values.nbytes for c in cells[1])
                self._pace_reads(*cells)
            self.courier.finish()
            finished = True
        except Stopped:
            finished = True
        finally:
            if not finished:  # an error here (or Modal's preemption, a KeyboardInterrupt): the courier stops too
                self._stopping.set()
            if self._stopping.is_set():  # going away with units taken: named now, not after the courier's join
                self.courier.release()  # (a courier retrying a put may outlast a preemption's grace)
            self.courier.join()
        if self.courier.error is not None:
            raise self.courier.error
        return self.stats

    def _pace_reads(self, unit: Unit, cells: list[CellRows], pieces: CellRows | None) -> None:
        """Each dataset's slice reads in flight on object storage sized to this loop's pace
        (`ReadSlots.pace`): the rows read from it by the recent units over their work time. Units
        read ahead (`read_ahead`) hide a unit's read behind the work; this keeps the reads within
        a unit from queueing behind each other."""
        rows: dict = defaultdict(int)  # (keyed by the dataset's slots: sources may share a dataset)
        for part, part_cells in zip(unit.parts, cells):
            rows[self.sources[part.source].ds.read_slots] += len(part_cells.ids)
        if pieces is not None:  # (a scanner unit's boundary pieces, read with its one part)
            rows[self.sources[unit.parts[0].source].ds.read_slots] += len(pieces.ids)
        self._unit_rows.append(rows)
        work_s = max(1e-3, sum(self._unit_work_s))
        for slots in rows:
            if slots is not None:
                slots.pace(sum(r.get(slots, 0) for r in self._unit_rows) / work_s)

    def _take(self) -> tuple[int, int, tuple] | None:
        """(read-ahead thread) The next task, held and read (`read`); None when the task list stayed empty
        for `idle_timeout_s`, or a stop was signalled (an idle producer looks for the stop key at
        each empty poll, so a campaign's end stops it within a second, not at its next heartbeat)."""
        idle_until = time.monotonic() + self.config.idle_timeout_s
        while not self._stopping.is_set():
            try:
                task = self.queue.get(
                    block=True,
                    timeout=max(0.01, min(STOP_POLL_S, idle_until - time.monotonic())),
                    partition=TASKS_PARTITION,
                )
            except Empty:
                task = None
            if task is not None:
                epoch, unit = decode_task(task)
                self.courier.hold(epoch, unit)
                if self.config.trace_units:  # (after `hold`: a line says the unit is held)
                    print(f"{self.name}: took unit {unit} of epoch {epoch}", flush=True)
                self._check_plan(epoch)
                t = time.perf_counter()
                cells = self.read(epoch, unit)
                self.stats.unit_read_s.append(time.perf_counter() - t)
                return epoch, unit, cells
            if time.monotonic() >= idle_until or self.courier.stop_signalled():
                return None
        return None

    def close(self) -> None:
        """End the producer's threads once it is done: its read-ahead and tokenizing pools, its
        sources' read pools. (On Modal a function that returns with threads alive is warned of and
        keeps its container up to 30 s.)"""
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._workers.shutdown(wait=True)
        for source in self.sources:
            source.ds.close()

    def stop(self) -> None:
        """Ask a running loop to stop: `run` returns soon; units taken and not done are produced
        again elsewhere (the driver re-issues them when their lease runs out)."""
        self._stopping.set()

    def read_ahead(self) -> int:
        """Units to have taken and in reading while one is worked on: enough that a unit's read
        (a few round trips on object storage) ends before the units ahead of it are worked
        through -- 1 + read time / work time, from the recent units -- within `READ_AHEAD_BYTES`
        of rows. On local disk at most `LOCAL_READ_AHEAD`: its reads share the cores with the
        work, so a read timed while others queue looks slower, the estimate asks for more, and each
        read waits longer (a balanced unit's read: 0.06 s alone, 0.25-0.36 s at the depth the
        estimate reached). Fixed when `ProducerConfig.read_ahead` is set."""
        if self.config.read_ahead:
            return self.config.read_ahead
        local = isinstance(self.ds.location, LocalLocation)
        if not self.stats.unit_read_s or not self._unit_work_s:
            return 1 if local else 4  # a guess until measured
        read_s = float(np.median(list(self.stats.unit_read_s)[-8:]))
        work_s = max(1e-3, float(np.median(self._unit_work_s)))
        by_memory = READ_AHEAD_BYTES // max(1, self._unit_bytes)
        most = LOCAL_READ_AHEAD if local else MAX_READ_AHEAD
        return int(max(1, min(most, by_memory, 1 + np.ceil(read_s / work_s))))

    def totals(self) -> dict:
        """Running totals (cells, units, items, bytes, busy seconds), for monitors."""
        s = self.stats
        return {
            "cells": s.cells,
            "units": s.units,
            "items": s.items,
            "bytes": s.bytes,
            "busy_s": round(sum(s.seconds.values()), 3),
        }


def produce(config: ProducerConfig, queue: Queue, store: Map, max_units: int | None = None) -> ProducerStats:
    """Entry point for a producer process or Modal function."""
    return Producer(config, queue, store).run(max_units)
