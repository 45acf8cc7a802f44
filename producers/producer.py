"""The producer loop: take a unit, read, rank + tokenize, pack, put, report it done.

Stateless and safe to kill at any point: a unit is only reported done after all its items are
put, so a unit interrupted mid-way is produced again from scratch (the driver re-issues it once
its producer falls silent) and consumers drop the duplicate items by key. A unit's output is
identical every time: cells are shuffled with a generator seeded by (seed, epoch, unit).

Coordination costs about two calls per unit, whatever the latency: one `get` of the task and one
`put` of a done event (docs/DESIGN.md, "Routing and exactly-once"). A heartbeat thread reports the
units held and the running totals every `heartbeat_s`, and reads the stop signal.
"""

from __future__ import annotations

import os
import queue as stdlib_queue
import random
import socket
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from coordination.arrays import offsets_of, positions_in_ranges
from coordination.errors import CellfeedError
from coordination.corpus import CorpusPlan, CorpusSpec, CorpusUnit, Mixtures
from coordination.driver import LEASE_S, heartbeat_interval
from coordination.plan import DatasetGeometry, EpochPlan, Sampling, WorkUnit
from coordination.summary import PlanSummary
from coordination.queues import (MAX_PARTITION_BYTES, MAX_PARTITION_ITEMS, Empty, Full, Map, MapGone, Queue,
                                 RequestTooLarge, request_batches)
from coordination.wire import number_items
from coordination.routing import (EVAL_PARTITION, EVENTS_PARTITION, TASKS_PARTITION, cell_rank, decode_task,
                                  encode_event, epoch_map_name, rank_partition, run_tag, stop_key, summary_key,
                                  unit_rank)
from coordination.seeds import cell_rng, held_out_rng, unit_rng
from coordination.vocab import GeneVocab, published_vocab
from producers.dataset import Dataset, RowBlock, StorageUnavailable
from producers.storage import LocalLocation
from producers.items import cells_to_packed, interleave
from producers.selection import label_codes
from producers.sources import attach_vocab, campaign_vocab, open_sources, token_medians
from producers.stitch import offer_piece
from producers.tokenizers import make_tokenizer, needs_gene_medians

STOP_POLL_S = 1.0  # how often a waiting producer looks at its stop flag
RELEASE_TIMEOUT_S = 2.0  # a producer going away tries this long to name the units it will not finish
FULL_WAIT_MIN_S, FULL_WAIT_MAX_S = 0.1, 2.0  # looking for room in a full partition: this often, backing off
OUTBOX_JOBS = 16  # jobs (a unit's items, a done event) the courier may be behind the loop
MAX_READ_AHEAD = 16  # units read ahead at most
READ_AHEAD_BYTES = 512 << 20  # rows held by the units read ahead at most (a b=16 f=256 unit holds ~100 MB)


class Stopped(Exception):
    """The campaign signalled a stop while this producer waited."""


@dataclass(frozen=True)
class ProducerConfig:
    dataset: str  # one dataset ("" with a corpus)
    run: str
    seed: int = 0
    corpus: str | None = None  # a corpus file (TOML, `coordination.corpus.CorpusSpec`) instead of one dataset
    vocabulary: str | None = None  # a gene vocabulary file; None: built from the sources (or the corpus file's)
    gene_column: str = "gene_id"  # the var column naming genes in the vocabulary
    gene_medians: str | None = None  # geneformer: a median dictionary (identifier -> median) over the corpus
    mixtures: str | None = None  # the run's corpus over its epochs (`coordination.corpus.Mixtures`, JSON): over `corpus`
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
    threads: int | None = None  # tokenizing threads; None: one per CPU this process may use
    read_ahead: int | None = None  # units read ahead of the one tokenized; None: as many as the read latency needs
    heartbeat_s: float = heartbeat_interval(LEASE_S)  # how often it says what it holds (`coordination.driver`)
    read_retry_s: float = 180.0  # how long a unit's read is tried again while storage does not answer
    put_timeout_s: float = 600.0
    idle_timeout_s: float = 10.0

    def corpus_mixtures(self) -> Mixtures | None:
        """The corpus over the run's epochs (None: one dataset); a vocabulary given on the command
        line wins over the corpus file's."""
        from dataclasses import replace
        from pathlib import Path

        if not (self.mixtures or self.corpus):
            return None
        mixtures = Mixtures.from_json(Path(self.mixtures).read_text(), self.mixtures) if self.mixtures else \
            Mixtures([(0, self.corpus_spec())])
        if self.vocabulary:
            mixtures.union = replace(mixtures.union, vocabulary=self.vocabulary)
        return mixtures

    def corpus_spec(self) -> CorpusSpec:
        """The campaign's sources: the corpus file's, or the one dataset as a corpus of one."""
        if self.corpus:
            spec = CorpusSpec.read(self.corpus)
            if self.vocabulary:  # a vocabulary given on the command line wins over the file's
                spec = CorpusSpec(spec.sources, self.vocabulary, spec.gene_column, spec.epoch_cells, spec.path)
            return spec
        return CorpusSpec.single(self.dataset, self.subset_filter, self.exclude_filter, self.gene_column,
                                 self.vocabulary)

    def validate(self) -> "ProducerConfig":
        self.sampling.validate()
        if (self.corpus or self.mixtures) and (self.subset_filter or self.exclude_filter or self.subset_ids
                                               or self.label_column):
            raise CellfeedError("with a corpus, give each source's subset_filter / eval_filter in the corpus file "
                                "(labels and id lists are for one dataset)")
        if self.world_size < 1:
            raise CellfeedError(f"world_size must be >= 1, got {self.world_size}")
        if self.threads is not None and self.threads < 1:
            raise CellfeedError(f"threads must be >= 1, got {self.threads}")
        if self.read_ahead is not None and self.read_ahead < 1:
            raise CellfeedError(f"read_ahead must be >= 1, got {self.read_ahead}")
        if self.cells_per_item < 1:
            raise CellfeedError(f"cells_per_item must be >= 1, got {self.cells_per_item}")
        if not self.run or "/" in self.run:
            raise CellfeedError(f"run id must be non-empty and without '/', got {self.run!r}")
        return self


def usable_cpus() -> int:
    """CPUs this process may run on (a container's share, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_fits_partition(n_cells: int, n_items: int, n_bytes: int) -> None:
    """A held-out set is read whole from one queue partition: refuse one that cannot fit."""
    if n_items > MAX_PARTITION_ITEMS or n_bytes > MAX_PARTITION_BYTES:
        raise CellfeedError(f"the held-out set ({n_cells:,} cells: {n_items:,} items, {n_bytes / 2**20:,.1f} MiB) does not "
                            f"fit one queue partition ({MAX_PARTITION_ITEMS:,} items, {MAX_PARTITION_BYTES >> 20} MiB): "
                            "lower --eval-cells")


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

    def __init__(self, config: ProducerConfig, queue: Queue, store: Map, dataset: Dataset | None = None,
                 name: str | None = None, vocab: GeneVocab | None = None, verify: bool = False):
        self.config = config.validate()
        self.queue, self.store = queue, store
        self.mixtures = config.corpus_mixtures()
        self.spec = self.mixtures.union if self.mixtures is not None else config.corpus_spec()
        # `verify`: the sources are checked at open (the campaign's setup does it, once; the fleet's
        # producers, started after it, do not pay for it again at every start)
        self.sources = open_sources(self.spec, subset_ids=config.subset_ids, verify=verify,
                                    datasets={config.dataset: dataset} if dataset is not None else None)
        self.ds = self.sources[0].ds
        # the setup's vocabulary once published (the same, built or read the same way, before): built
        # from the run's first sources, so a source added at a resume maps into the run's vocabulary
        first = {s.name for s in self.mixtures.history[0][1].sources} if self.mixtures is not None else None
        self.vocab = vocab or published_vocab(store, config.run) or \
            campaign_vocab(self.spec, [s for s in self.sources if first is None or s.spec.name in first])
        attach_vocab(self.sources, self.vocab)
        counts = all(s.ds.is_counts for s in self.sources)
        medians = None
        if needs_gene_medians(config.tokenizer) and counts:
            medians = token_medians(self.sources, self.vocab, config.gene_medians)
            if medians is None:
                fix = (f"run `cellfeed stats {self.ds.uri}` once" if len(self.sources) == 1 else
                       "give Geneformer's median dictionary (gene_median_dictionary.pkl or JSON) with --gene-medians")
                raise CellfeedError(f"--tokenizer {config.tokenizer} needs Geneformer's gene medians: {fix}")
        self.tokenizer = make_tokenizer(config.tokenizer, self.vocab, max_genes=config.max_genes,
                                        values_are_counts=counts, gene_medians=medians, **config.tokenizer_params)
        self.geometry = DatasetGeometry.of(self.ds)
        self.subset = self.sources[0].selection
        self.selected = {s.spec.name: s.n_selected for s in self.sources}
        # each source's cells per epoch under the latest mixture (None: one dataset)
        self.quotas = None if self.mixtures is None else \
            self.mixtures.quotas_at(self.mixtures.history[-1][0], self.selected)
        self.labels = label_codes(self.ds, config.label_column)[0] if config.label_column else None
        self.tag = run_tag(config.run)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.stats = ProducerStats()
        self._plans: dict[int, EpochPlan] = {}
        self._plan_lock = threading.Lock()
        self._setup_loop()

    def _setup_loop(self) -> None:
        """State of the coordination loop (`run`), apart from the data work."""
        cfg = self.config
        self._reader = ThreadPoolExecutor(max_workers=cfg.read_ahead or MAX_READ_AHEAD,
                                          thread_name_prefix="cellfeed-prefetch")
        self.threads = cfg.threads or usable_cpus()
        self._workers = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="cellfeed-tokenize")
        self._held: list[tuple[int, int]] = []  # units taken and not yet done
        self._held_lock = threading.Lock()
        self._stopping = threading.Event()
        self._courier: threading.Thread | None = None
        self._beat_at = 0.0
        self._courier_error: BaseException | None = None
        self._epoch_maps: dict[int, Map] = {}
        self._checked_epochs: set[int] = set()  # epochs whose published plan matched this producer's
        self._unit_work_s: deque = deque(maxlen=8)  # recent units' tokenize-pack-hand-off times
        self._unit_bytes = 0  # the latest unit's rows in memory
        self._full_wait_s = FULL_WAIT_MIN_S  # how long to wait before looking again at a full partition
        self._full_at: dict[str, int] = {}  # partitions that refused a put -> their length then (the courier's)

    def plan(self, epoch: int) -> EpochPlan | CorpusPlan:
        """The epoch's plan, cached for this and the previous epoch (the read-ahead may cross)."""
        with self._plan_lock:
            if epoch not in self._plans:
                self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}
                cfg = self.config
                m = self.mixtures
                self._plans[epoch] = \
                    CorpusPlan([s.planned() for s in self.sources], m.quotas_at(epoch, self.selected), cfg.sampling,
                               cfg.seed, epoch, m.starts(epoch, self.selected)) \
                    if m is not None else EpochPlan(self.geometry, cfg.sampling, cfg.seed, epoch, self.subset)
            return self._plans[epoch]

    # ---- one unit

    def _put(self, items: list[bytes], partition: str) -> None:
        """Hand items to the courier (the loop's sender thread; puts them in order, then the unit's
        done event), or put them now when no loop runs (the held-out set)."""
        t = time.perf_counter()
        if self._courier is None:
            self._put_now(items, partition)
        else:
            self._post(("items", partition, items))
        self.stats.add_time("put", t)
        self.stats.items += len(items)
        self.stats.bytes += sum(len(b) for b in items)

    def _put_now(self, items: list[bytes], partition: str) -> None:
        for batch in request_batches(items):
            self._send(batch, partition)

    def _send(self, batch: list[bytes], partition: str) -> None:
        """One put. A full partition is backpressure: wait for room, then send — never send a
        batch into a partition known to be full. (On Modal a put whose timeout is under ~2 s is
        refused at once, and each try uploads the whole batch again.) A refusal at length L
        marks the partition full with room for L items; until it drains, each send first looks
        at its length (one small call) and waits for room for the batch. A request too large for
        the backend is split in two. Waiting is an error after `put_timeout_s`; a stop is noticed
        within a wait."""
        deadline = time.monotonic() + self.config.put_timeout_s
        while True:
            if self._stopping.is_set():
                raise Stopped
            if partition in self._full_at:
                self._wait_for_room(len(batch), partition, deadline)
            try:
                self.queue.put_many(batch, block=False, partition=partition)
                return
            except RequestTooLarge as exc:
                if len(batch) == 1:
                    raise CellfeedError(f"one item of {len(batch[0]):,} bytes is a request too large for the "
                                        f"queue ({exc})") from None
                self._send(batch[: len(batch) // 2], partition)
                self._send(batch[len(batch) // 2:], partition)
                return
            except Full:
                self._full_at[partition] = self.queue.len(partition=partition)

    def _wait_for_room(self, n_items: int, partition: str, deadline: float) -> None:
        """Until a partition marked full has room for `n_items` more, looking at its length with
        a jittered back-off (0.1 s up to 2 s, remembered between waits, so producers sharing a
        partition look at different moments); a partition that drained to half is full no more."""
        while True:
            held, room_for = self.queue.len(partition=partition), self._full_at[partition]
            if held <= room_for // 2:
                del self._full_at[partition]
                return
            if held + n_items <= room_for:
                self._full_wait_s = max(FULL_WAIT_MIN_S, self._full_wait_s / 2)
                return
            if time.monotonic() >= deadline:
                raise CellfeedError(f"queue partition {partition} stayed full for {self.config.put_timeout_s:.0f}s: "
                                    "is the trainer consuming?")
            if partition != EVENTS_PARTITION:  # backpressure is no silence: keep heartbeating
                self._beat_if_due()
            if self._stopping.wait(self._full_wait_s * random.uniform(0.75, 1.25)):
                raise Stopped
            self._full_wait_s = min(FULL_WAIT_MAX_S, self._full_wait_s * 2)

    def produce_held_out(self, cell_ids: np.ndarray, partition: str = EVAL_PARTITION) -> int:
        """Tokenize a fixed set of cells (global ids, e.g. an evaluation split) into `partition`,
        once. It must fit one partition (the trainer reads it whole): a larger set is refused
        before anything is put. Returns the number of items put."""
        cell_ids = np.sort(np.asarray(cell_ids, dtype=np.int64))
        parts = []
        for s, src in enumerate(self.sources):
            local = cell_ids[(cell_ids >= src.offset) & (cell_ids < src.offset + src.ds.n_cells)] - src.offset
            if len(local):
                counts = np.diff(src.ds.cell_row_start)[local]
                parts.append((s, local, offsets_of(counts)[:-1], counts, src.ds.read_cells(local, with_cell_ids=False)))
        items = self._pack_parts(parts, 0, 0, held_out_rng(self.config.seed))
        check_fits_partition(len(cell_ids), len(items), sum(len(b) for b in items))
        self._put(items, partition)
        return len(items)

    def read(self, epoch: int, unit_id: int) -> tuple[WorkUnit | CorpusUnit, RowBlock | list[RowBlock]]:
        """A unit and its rows (a corpus unit: per source it draws from). Storage that does not
        answer is tried again (1 s, 2 s, 4 s, then 5 s apart, for `read_retry_s`): an object store
        restarting mid-epoch costs time, not the run. The unit stays held meanwhile (the courier's
        heartbeats name it)."""
        unit = self.plan(epoch).unit(unit_id)
        deadline, pause = time.monotonic() + self.config.read_retry_s, 1.0
        while True:
            try:
                if isinstance(unit, CorpusUnit):
                    return unit, [self.sources[s].ds.read_row_ranges(ranges, with_cell_ids=False)
                                  for s, _, ranges in unit.parts]
                return unit, self.ds.read_row_ranges(unit.ranges, with_cell_ids=False)
            except StorageUnavailable:
                if time.monotonic() + pause > deadline or self._stopping.is_set():
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 5.0)

    def process(self, epoch: int, unit_id: int, rows: tuple | None = None) -> None:
        """Produce every item of one unit (and any boundary cell it completes); `rows`: the unit
        and its rows if already read (the loop reads ahead), else they are read here."""
        cfg = self.config
        t = time.perf_counter()
        unit, block = rows if rows is not None else self.read(epoch, unit_id)
        self.stats.add_time("read", t)
        rng = unit_rng(cfg.seed, epoch, unit_id)
        # per source the unit draws from (one: the dataset's whole cells; boundary pieces below): its
        # cells, where their rows sit in what was read, and those rows
        reads = zip(unit.parts, block) if isinstance(unit, CorpusUnit) else [((0, unit.cells, unit.ranges), block)]
        parts = []
        for (s, local, ranges), rows in reads:
            starts = self.sources[s].ds.cell_row_start
            parts.append((s, local, positions_in_ranges(ranges, starts[local]), starts[local + 1] - starts[local], rows))
        cells = sum(len(local) for _, local, _, _, _ in parts)
        if cells:
            items = self._pack_parts(parts, epoch, unit_id, rng, shuffle=True)
            self._put(items, rank_partition(unit_rank(unit_id, cfg.world_size)))
            self.stats.cells += cells
        if isinstance(unit, CorpusUnit):  # a corpus unit reads whole cells: nothing to stitch
            self.stats.units += 1
            return
        # boundary pieces (one dataset's scanner plans): stitch through the map; the last arrival emits the cell
        piece_at = positions_in_ranges(unit.ranges, unit.piece_rows[:, 0]) if len(unit.pieces) else []
        for p, (cell, index, count) in enumerate(zip(unit.pieces.tolist(), unit.piece_index.tolist(),
                                                     unit.piece_count.tolist())):
            a = int(piece_at[p])
            b = a + int(unit.piece_rows[p, 1] - unit.piece_rows[p, 0])
            t = time.perf_counter()
            try:
                whole_cell = offer_piece(self._epoch_map(epoch), epoch, f"{unit_id}.{index}", cell, index, count,
                                         block.gene[a:b], block.value[a:b])
            except MapGone:  # the epoch is complete: this is a late duplicate, the cell was emitted
                whole_cell = None
            self.stats.add_time("stitch", t)
            if whole_cell is not None:
                genes, values = whole_cell
                items = self._pack_parts([(0, np.array([cell]), np.array([0]), np.array([len(genes)]),
                                           RowBlock(None, genes, values))], epoch, cell,
                                         cell_rng(cfg.seed, epoch, cell), stitched=True)
                self._put(items, rank_partition(cell_rank(cell, cfg.world_size)))
                self.stats.cells += 1
        self.stats.units += 1

    def _pack_parts(self, parts, epoch: int, key_id: int, rng: np.random.Generator, *, stitched: bool = False,
                    shuffle: bool = False) -> list[bytes]:
        """The numbered items of cells from one or more sources: `parts` holds (source, local cell
        ids, their first rows and row counts in the block, block). Each source's cells are
        tokenized apart (their genes mapped through that source's vocabulary lookup; a source's
        rows share a dtype, which ranking's fast path needs) and, with several sources, their
        items interleaved in proportion (`interleave`), so any stretch of a unit's items (what a
        rank's mixing buffer holds) has every source by its share. `shuffle`: each part's cells
        are shuffled first, with its own child of `rng` (one part: with `rng` itself)."""
        groups = []
        rngs = rng.spawn(len(parts)) if len(parts) > 1 else [rng]
        for (s, local, first, counts, block), part_rng in zip(parts, rngs):
            if shuffle:
                order = part_rng.permutation(len(local))
                local, first, counts = local[order], first[order], counts[order]
            src = self.sources[s]
            packed, tokenize_s, pack_s = cells_to_packed(
                local + src.offset, first, counts, block, self.tokenizer, epoch=epoch, key_id=key_id, run_tag=self.tag,
                rng=part_rng, cells_per_item=self.config.cells_per_item, labels=self.labels, stitched=stitched,
                gene_tokens=src.gene_tokens, pool=self._workers)
            self.stats.seconds["tokenize"] += tokenize_s
            self.stats.seconds["pack"] += pack_s
            groups.append(packed)
        return number_items(interleave(groups) if len(groups) > 1 else groups[0])

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
                    f"{self.ds.uri} changed since run {self.config.run} planned epoch {epoch} (its plan {planned.plan_id}, "
                    f"this dataset's {mine.plan_id}: {planned.n_cells:,} cells planned, {mine.n_cells:,} now): "
                    "restore the dataset, or start a new --run on the new one")
        self._checked_epochs.add(epoch)

    def _epoch_map(self, epoch: int) -> Map:
        """The epoch's stitching map (the driver creates it; opening it creates nothing)."""
        if epoch not in self._epoch_maps:
            self._epoch_maps = {e: m for e, m in self._epoch_maps.items() if e >= epoch - 1}
            self._epoch_maps[epoch] = self.store.named(epoch_map_name(epoch))
        return self._epoch_maps[epoch]

    # ---- the loop

    def _take_and_read(self) -> tuple[int, int, tuple[WorkUnit, RowBlock]] | None:
        """(read-ahead thread) The next task and its rows; None when the task list stayed empty
        for `idle_timeout_s`, or a stop was signalled (an idle producer looks for the stop key at
        each empty poll, so a campaign's end stops it within a second, not at its next heartbeat)."""
        idle_until = time.monotonic() + self.config.idle_timeout_s
        while not self._stopping.is_set():
            try:
                task = self.queue.get(block=True, timeout=max(0.01, min(STOP_POLL_S, idle_until - time.monotonic())),
                                      partition=TASKS_PARTITION)
            except Empty:
                task = None
            if task is not None:
                epoch, unit = decode_task(task)
                with self._held_lock:
                    self._held.append((epoch, unit))
                self._check_plan(epoch)
                t = time.perf_counter()
                rows = self.read(epoch, unit)
                self.stats.unit_read_s.append(time.perf_counter() - t)
                return epoch, unit, rows
            if time.monotonic() >= idle_until or self._stop_signalled():
                return None
        return None

    def _post(self, job: tuple) -> None:
        """Give the courier a job; waits while it is behind (backpressure), never past its failure."""
        while True:
            if self._courier_error is not None:
                raise self._courier_error
            if self._stopping.is_set():
                raise Stopped
            try:
                return self._outbox.put(job, timeout=STOP_POLL_S)
            except stdlib_queue.Full:
                continue

    def _courier_loop(self) -> None:
        """Send, in order: each unit's items, then its done event. Every `heartbeat_s` (also when
        busy): an event naming the units held, and a look for the stop signal."""
        self._beat_at = 0.0
        try:
            while not self._stopping.is_set():  # a stop asked of the loop (`stop`, an error) ends it at once
                self._beat_if_due()
                try:
                    job = self._outbox.get(timeout=max(0.01, min(STOP_POLL_S, self._beat_at - time.monotonic())))
                except stdlib_queue.Empty:
                    continue
                if job[0] == "items":
                    self._put_now(job[2], job[1])
                elif job[0] == "done":
                    with self._held_lock:
                        self._held.remove(job[1])
                    self._event(done=[job[1]])
                else:  # "end": everything before it is sent
                    return
        except Stopped:
            self._stopping.set()
        except BaseException as exc:  # noqa: BLE001 - raised in the loop's thread
            self._courier_error = exc if isinstance(exc, CellfeedError) else CellfeedError(f"sending failed: {exc}")
            self._stopping.set()

    def _beat_if_due(self) -> None:
        """(courier) A heartbeat event and a look for the stop signal, every `heartbeat_s`."""
        if self._courier is None or time.monotonic() < self._beat_at:
            return
        self._beat_at = time.monotonic() + self.config.heartbeat_s
        if self._stop_signalled():
            raise Stopped
        self._event()

    def _stop_signalled(self) -> bool:
        """The campaign's stop key is set (its end, by `cellfeed local` or the Modal app)."""
        return self.store.get(stop_key(self.config.run)) is not None

    def _event(self, done=()) -> None:
        """One event: the units just finished, the units held now, the running totals."""
        with self._held_lock:
            held = list(self._held)
        self._send([encode_event(self.name, done=done, held=held, totals=self.totals())], EVENTS_PARTITION)

    def run(self, max_units: int | None = None) -> ProducerStats:
        """Work until the task list stays empty for `idle_timeout_s`, a stop is signalled, or
        `max_units` units are done. The next `read_ahead` units are taken and read while this one
        is tokenized (deeper when storage is remote: its reads take several round trips); the
        courier thread sends while the next is worked on, so no call waits on this thread."""
        self._outbox = stdlib_queue.Queue(maxsize=OUTBOX_JOBS)
        self._stopping.clear()  # a stop still signalled in the map is read by the courier's first heartbeat
        self._courier_error = None
        self._courier = threading.Thread(target=self._courier_loop, daemon=True, name="cellfeed-courier")
        self._courier.start()
        ahead: deque = deque()
        taken_units = 0
        idle = False
        finished = False
        try:
            while True:
                while not idle and len(ahead) < self.read_ahead() and (max_units is None or taken_units < max_units):
                    ahead.append(self._reader.submit(self._take_and_read))
                    taken_units += 1
                if not ahead:
                    break
                t = time.perf_counter()
                taken = self._first_done(ahead).result()
                self.stats.add_time("read", t)
                if taken is not None:
                    self.stats.unit_wait_s.append(time.perf_counter() - t)
                if taken is None:  # the task list stayed empty (or a stop): finish what was taken
                    idle = True
                    continue
                epoch, unit, rows = taken
                t = time.perf_counter()
                self.process(epoch, unit, rows)
                self._unit_work_s.append(time.perf_counter() - t)
                blocks = rows[1] if isinstance(rows[1], list) else [rows[1]]
                self._unit_bytes = sum(b.gene.nbytes + b.value.nbytes for b in blocks)
                self._post(("done", (epoch, unit)))
            self._post(("end",))
            finished = True
        except Stopped:
            finished = True
        finally:
            if not finished:  # an error here (or Modal's preemption, a KeyboardInterrupt): the courier stops too
                self._stopping.set()
            if self._stopping.is_set():  # going away with units taken: named now, not after the courier's join
                self._release()  # (a courier retrying a put may outlast a preemption's grace)
            self._courier.join(timeout=self.config.put_timeout_s + 10)
            self._courier = None
        if self._courier_error is not None:
            raise self._courier_error
        return self.stats

    def _release(self) -> None:
        """Going away with units taken and not done: name them in one last event, so the driver
        issues them again now rather than when their lease runs out. Best effort, one try: the
        lease still covers a producer that cannot say it (killed outright, the queue down)."""
        with self._held_lock:
            held = list(self._held)
        if not held:
            return
        try:
            self.queue.put_many([encode_event(self.name, released=held)], block=True, timeout=RELEASE_TIMEOUT_S,
                                partition=EVENTS_PARTITION)
        except Exception:  # noqa: BLE001 - the lease covers it
            pass

    def stop(self) -> None:
        """Ask a running loop to stop: `run` returns soon; units taken and not done are produced
        again elsewhere (the driver re-issues them when their lease runs out)."""
        self._stopping.set()

    @staticmethod
    def _first_done(ahead: deque) -> Future:
        """Remove and return the oldest finished take-and-read (waiting for one if none is):
        never wait on a take still looking for a task while a later one holds a unit's rows."""
        done = next((f for f in ahead if f.done()), None)
        if done is None:
            wait(ahead, return_when=FIRST_COMPLETED)
            done = next(f for f in ahead if f.done())
        ahead.remove(done)
        return done

    def read_ahead(self) -> int:
        """Units to have taken and in reading while one is worked on: enough that a unit's read
        (a few round trips on object storage) ends before the units ahead of it are worked
        through -- 1 + read time / work time, from the recent units -- within `READ_AHEAD_BYTES`
        of rows. Fixed when `ProducerConfig.read_ahead` is set."""
        if self.config.read_ahead:
            return self.config.read_ahead
        if not self.stats.unit_read_s or not self._unit_work_s:
            return 1 if isinstance(self.ds.location, LocalLocation) else 4  # a guess until measured
        read_s = float(np.median(list(self.stats.unit_read_s)[-8:]))
        work_s = max(1e-3, float(np.median(self._unit_work_s)))
        by_memory = READ_AHEAD_BYTES // max(1, self._unit_bytes)
        return int(max(1, min(MAX_READ_AHEAD, by_memory, 1 + np.ceil(read_s / work_s))))

    def totals(self) -> dict:
        """Running totals (cells, units, items, bytes, busy seconds), for monitors."""
        s = self.stats
        return {"cells": s.cells, "units": s.units, "items": s.items, "bytes": s.bytes,
                "busy_s": round(sum(s.seconds.values()), 3)}


def produce(config: ProducerConfig, queue: Queue, store: Map, max_units: int | None = None) -> ProducerStats:
    """Entry point for a producer process or Modal function."""
    return Producer(config, queue, store).run(max_units)
