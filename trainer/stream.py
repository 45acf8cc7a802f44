"""The consumer stream of one rank: pop items from its partition, verify and decompress them in
a background thread, drop duplicate keys, mix cells from many items in a buffer, and yield
batches as tensors: `batch_size` cells, or with `tokens_per_batch` the cells drawn that fit it
(the next one drawn while the accelerator runs a step: `prepare`). An epoch ends by count: every
rank knows each rank's cells from the epoch's `PlanSummary`, so all take the same steps with no
communication (a rank with fewer cells yields smaller, then empty, final batches); a token
budget's end after the step whose all-reduce says no rank has cells left (`EpochIterator.end`).

A rank that waits `STARVED_AFTER_S` for cells that do not come calls `on_starved`: the trainer asks
the driver to produce again the units whose items never reached it (a get whose reply was lost, its
items gone); units on their way are not produced twice, and items it did get are dropped by key.

A rank asked to stop (`stop_asked`) stops waiting for cells within `poll_s`: its batch is what its
buffer holds (maybe none), the stop rides on that step's all-reduce, and the epoch is `cut` (no
audit; a resume trains its rest): a stop takes effect in a step or two even with producers stalled.
No Lance or Polars here: the GPU image needs only torch, numpy and zstandard.
"""

from __future__ import annotations

import queue as stdlib_queue
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from coordination.errors import CellfeedError
from coordination.queues import Empty, Queue
from coordination.routing import cell_rank, rank_partition, run_tag, unit_rank
from coordination.seeds import batch_rng
from coordination.summary import steps_per_epoch
from coordination.vocab import PAD
from coordination.wire import Item, ItemError, unpack_item
from trainer.model import Spans
from trainer.packing import pack_rows, segments_of, spans_of, within_budget

STARVED_AFTER_S = 2.0  # a rank with cells still to come and no item for this long asks for the missing units


@dataclass
class Batch:
    tokens: torch.Tensor  # int64 [B, L], PAD-padded
    attention_mask: torch.Tensor  # bool [B, L], True on real tokens
    values: torch.Tensor | None  # [B, L]: int64 bins or float32 raw values
    labels: torch.Tensor | None  # int64 [B]
    cell_ids: torch.Tensor  # int64 [B]
    completed: list = field(default_factory=list)  # item keys whose last cell is in this batch
    cells_of_partial: dict = field(default_factory=dict)  # item key -> cell ids in this batch (resume)
    unit_items: dict = field(default_factory=dict)  # unit -> its item count, for units with an item completed here
    wait_s: float = 0.0  # time the caller waited for this batch
    unit_cells: dict = field(default_factory=dict)  # unit -> its cells in this batch (stitched cells apart)
    lengths: torch.Tensor | None = None  # int64 [cells] on the host: each cell's real tokens (None: read the mask)
    segments: torch.Tensor | None = None  # packed (`trainer.packing`): int64 [rows, width], each position's cell
    spans: Spans | None = None  # the rows cut into cells and padding, for varlen attention (`model.Spans`)

    @property
    def size(self) -> int:
        return int(self.cell_ids.shape[0])

    @property
    def padded(self) -> bool:
        """Whether any position is padding, known on the host from the collate (reading the mask back
        from the GPU would wait for it, and under torch.compile break the graph). Unknown: True (the
        mask is then applied, which is right either way)."""
        return self.lengths is None or int(self.lengths.sum()) < self.tokens.numel()

    def to(self, device: torch.device) -> "Batch":
        """The model's tensors on `device` (labels, cell ids and lengths stay on the host: the class
        counts and the metrics read them, the model does not)."""
        if device.type == "cpu":
            return self
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        moved = {k: move(getattr(self, k)) for k in ("tokens", "attention_mask", "values", "segments")}
        spans = None if self.spans is None else Spans(move(self.spans.bounds), self.spans.longest)
        return replace(self, **moved, spans=spans)


@dataclass
class StreamStats:
    items: int = 0
    duplicates: int = 0
    stale: int = 0
    misrouted: int = 0
    cells: int = 0
    wait_s: float = 0.0


class ConsumerStream:
    def __init__(
        self,
        queue: Queue,
        *,
        rank: int,
        world_size: int,
        run: str,
        batch_size: int,
        pad_to: int | None = None,
        pad_token: int = PAD,
        tokens_per_row: int | None = None,
        tokens_per_batch: int | None = None,
        grad_accum: int = 1,
        spans: bool = False,
        buffer_cells: int = 4096,
        seed: int = 0,
        no_data_timeout_s: float = 600.0,
        poll_s: float = 1.0,
        fetch_items: int = 32,
        consumed: set | None = None,
        trained_cells: dict | None = None,
        pin_memory: bool | None = None,
        check=None,
        on_starved=None,
        starved_after_s: float = STARVED_AFTER_S,
        stop_asked=None,
    ):
        if batch_size < 1 or buffer_cells < 1 or (tokens_per_batch is not None and tokens_per_batch < 1):
            raise CellfeedError("batch_size, tokens_per_batch and buffer_cells must be >= 1")
        self.queue, self.rank, self.world_size = queue, rank, world_size
        self.partition, self.tag = rank_partition(rank), run_tag(run)
        self.batch_size, self.pad_to, self.buffer_cells = batch_size, pad_to, buffer_cells
        self.pad_token, self.tokens_per_row, self.tokens_per_batch = pad_token, tokens_per_row, tokens_per_batch
        self.grad_accum = grad_accum  # batches a step: an epoch of batches of cells takes whole steps
        self.spans = spans  # each batch cut into its cells' spans (`Batch.spans`: for varlen attention)
        self.seed, self.no_data_timeout_s, self.poll_s, self.fetch_items = seed, no_data_timeout_s, poll_s, fetch_items
        self.consumed = set(consumed or ())  # keys fully trained on (from a checkpoint)
        self.trained_cells = {k: set(v) for k, v in (trained_cells or {}).items()}  # partially trained items
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.check = check  # called while waiting for data: raises if the campaign failed (e.g. the driver)
        # (epoch, iterator), after `starved_after_s` with no item while cells are due, and again while it lasts
        self.on_starved, self.starved_after_s = on_starved, starved_after_s
        self.stop_asked = stop_asked or (lambda: False)  # a stop was asked of this rank: waiting for cells ends
        self.stats = StreamStats()
        self._items: stdlib_queue.Queue = stdlib_queue.Queue(maxsize=max(4, buffer_cells // 16))
        self._future: list[Item] = []  # decoded items of later epochs
        self._fetched_cells = 0  # written by the fetcher thread only
        self._taken_cells = 0  # written by the consumer only
        self._error: BaseException | None = None
        self._answered = 0.0  # when the last poll the queue answered began, items or none (written by the fetcher)
        self._closed = threading.Event()
        self._fetcher = threading.Thread(target=self._fetch, daemon=True, name=f"cellfeed-fetch-{rank}")
        self._fetcher.start()

    # ---- background: pop, verify, decompress

    def _fetch(self) -> None:
        try:
            while not self._closed.is_set():
                asked = time.monotonic()
                try:
                    raw = self.queue.get_many(
                        self.fetch_items, block=True, timeout=self.poll_s, partition=self.partition
                    )
                except Empty:
                    raw = []
                self._answered = asked  # a poll begun then was answered, items or none (not: failed to ask)
                for data in raw:
                    item = unpack_item(data, run_tag=self.tag)
                    item.raw = bytes(data)  # kept to give it back untrained at a graceful stop (`give_back`)
                    while not self._closed.is_set():
                        try:
                            self._items.put(item, timeout=self.poll_s)
                            self._fetched_cells += item.n_cells
                            break
                        except stdlib_queue.Full:
                            continue
        except BaseException as exc:  # noqa: BLE001 - raised in the consumer's thread
            self._error = exc

    # ---- what an epoch's iterator asks of the stream

    @property
    def held_cells(self) -> int:
        """Decoded cells held outside any epoch's buffer: prefetched and not yet taken, or taken and held
        for a later epoch."""
        return self._fetched_cells - self._taken_cells + sum(i.n_cells for i in self._future)

    def next_item(self, epoch: int, deadline: float, starved=None) -> Item | None:
        """The next decoded item of `epoch` (items of later epochs are held for them, those of earlier
        ones counted stale), or None at `deadline` or once a stop is asked. `starved` is called after
        `starved_after_s` with no item of this epoch while the queue keeps answering, and as often
        again while it lasts."""
        for i, item in enumerate(self._future):
            if item.epoch == epoch:
                return self._future.pop(i)
        quiet_since = time.monotonic()
        while True:
            if self.check is not None:
                self.check()
            if self._error is not None:
                if isinstance(self._error, ItemError):
                    raise CellfeedError(f"rank {self.rank}: refusing to train on a bad item: {self._error}")
                raise CellfeedError(f"rank {self.rank}: reading the queue failed: {self._error}") from self._error
            try:
                item = self._items.get(timeout=min(self.poll_s, max(0.0, deadline - time.monotonic())) or 0.01)
            except stdlib_queue.Empty:
                item = None
            if item is not None:
                self._taken_cells += item.n_cells
                if item.epoch == epoch:
                    return item
                if item.epoch > epoch:
                    self._future.append(item)
                else:
                    self.stats.stale += 1  # a late duplicate of a finished epoch
            now = time.monotonic()
            if now > deadline or self.stop_asked():
                return None
            # starved: no item of this epoch for a while (later epochs' items may keep coming), and the
            # queue has answered since (an outage that keeps the fetcher retrying is not starvation:
            # the items may be in the partition)
            if starved is not None and now - quiet_since >= self.starved_after_s and self._answered >= quiet_since:
                starved()
                quiet_since = time.monotonic()

    # ---- foreground: mix and batch

    def epoch(self, epoch: int, cells_per_rank: list[int]) -> "EpochIterator":
        """Batches of `epoch`; `cells_per_rank` are the cells each rank still has to train on
        (the plan's counts, less what a checkpoint says was trained)."""
        return EpochIterator(self, epoch, cells_per_rank)

    def give_back(self, epoch: "EpochIterator | None" = None, timeout: float = 10.0) -> int:
        """At a graceful stop (a checkpoint was just written): stop fetching, then put the items this
        rank took and has not finished back into its partition -- prefetched, held for later epochs,
        and those with cells left in `epoch`'s buffer (a resume skips their trained cells) -- so the
        resumed run finds them there instead of waiting for them to be made again. What cannot be
        put back in `timeout` is lost, as in a crash: the rank that misses it asks again. Returns
        the items put back."""
        from coordination.queues import Full, request_batches

        self.close(wait=True)
        held = []
        while not self._items.empty():  # (the fetcher has stopped: nothing else takes from it)
            held.append(self._items.get_nowait())
        held += self._future
        if epoch is not None:
            epoch.put_back()  # (a batch drawn ahead, not trained)
            held += list({id(item): item for item, _ in epoch.buffer}.values())
        raws = [item.raw for item in held if getattr(item, "raw", None) is not None]
        given, deadline = 0, time.monotonic() + timeout
        for batch in request_batches(raws):
            try:
                self.queue.put_many(
                    batch, block=True, timeout=max(0.1, deadline - time.monotonic()), partition=self.partition
                )
            except Full:
                break
            given += len(batch)
        return given

    def close(self, wait: bool = True) -> None:
        """Stop fetching. What the fetcher pops from now on is not trained (a resume produces its
        unit again). `wait=False`: return at once; the fetcher (a daemon thread) ends after its
        current poll, or with the process."""
        self._closed.set()
        if wait:
            self._fetcher.join(timeout=5 * self.poll_s + 1)


class EpochIterator:
    """Batches of one epoch; exactly `steps` of them on every rank (a token budget's: see `__init__`)."""

    def __init__(self, stream: ConsumerStream, epoch: int, cells_per_rank: list[int]):
        if len(cells_per_rank) != stream.world_size:
            raise CellfeedError(f"the plan lists {len(cells_per_rank)} ranks, the stream {stream.world_size}")
        self.s, self.epoch = stream, epoch
        self.expected = int(cells_per_rank[stream.rank])
        # a token budget's steps: None until the trainer learns no rank has a cell left (`end`; 0: none has any)
        budget = stream.tokens_per_batch is not None and any(cells_per_rank)
        self.steps = None if budget else steps_per_epoch(cells_per_rank, stream.batch_size, stream.grad_accum)
        self.step = 0
        self.cut = False  # a stop ended a batch early: the epoch is not finished, whatever `step` says
        self.received = 0  # cells taken into the buffer
        self.seen: set = set()
        self.rng = batch_rng(stream.seed, epoch, stream.rank)
        self.buffer: list[tuple[Item, int]] = []  # (item, cell index)
        self.remaining: dict = {}  # item key -> cells of it not yet batched
        self.unit_seqs: dict = {}  # unit -> the seqs of its items received (or trained before), and its item count
        self.stitched_received: set = set()  # boundary cells received
        self._ahead: tuple | None = None  # the next batch and its cells, drawn ahead (`prepare`)
        self._failed: Exception | None = None  # what drawing it ahead raised

    def complete_units(self) -> set[int]:
        """Units of this epoch whose every item has reached this rank (or was trained before a resume)."""
        return {u for u, (seqs, n) in self.unit_seqs.items() if len(seqs) >= n}

    def __iter__(self):
        return self

    @property
    def finished(self) -> bool:
        """Every step of the epoch was taken, none of them cut short by a stop."""
        return self.steps is not None and self.step >= self.steps and not self.cut

    @property
    def cells_left(self) -> int:
        """Cells of the epoch this rank has not batched yet (to come, or in the buffer)."""
        return self.expected - self.received + len(self.buffer)

    def end(self) -> None:
        """No rank has a cell of the epoch left (a token budget's epoch: the step's all-reduce said so)."""
        self.steps = self.step

    @property
    def ready_cells(self) -> int:
        """Decoded cells this rank holds and has not batched yet (prefetched, buffered, later epochs')."""
        return self.s.held_cells + len(self.buffer) + (len(self._ahead[1]) if self._ahead else 0)

    def _admit(self, item: Item) -> None:
        s = self.s
        s.stats.items += 1
        owner = cell_rank(item.key_id, s.world_size) if item.stitched else unit_rank(item.key_id, s.world_size)
        if owner != s.rank:  # routed under another world size: left in the queue by a run on another number
            s.stats.misrouted += 1  # of ranks (its owner here gets the unit produced again)
            return
        if item.stitched:
            self.stitched_received.add(item.key_id)
        else:
            self.unit_seqs.setdefault(item.key_id, (set(), item.n_items))[0].add(item.seq)
        if item.key in self.seen or item.key in s.consumed:
            s.stats.duplicates += 1
            return
        self.seen.add(item.key)
        skip = s.trained_cells.get(item.key, ())  # cells of this item trained before a restart
        cells = [i for i in range(item.n_cells) if int(item.cell_ids[i]) not in skip]
        self.received += len(cells)
        if cells:
            self.remaining[item.key] = len(cells)
            self.buffer.extend((item, i) for i in cells)

    def _fill(self) -> float:
        """Top the buffer up; returns seconds spent waiting for data."""
        s, waited = self.s, 0.0
        while self.received < self.expected and len(self.buffer) < s.buffer_cells:
            start = time.monotonic()
            starved = (lambda: s.on_starved(self.epoch, self)) if s.on_starved is not None else None
            item = s.next_item(self.epoch, start + s.no_data_timeout_s, starved)
            waited += time.monotonic() - start
            if item is None and s.stop_asked():  # the step goes on with what the buffer holds, and is the last
                self.cut = True
                break
            if item is None:
                raise CellfeedError(
                    f"rank {s.rank}: no data for {s.no_data_timeout_s:.0f}s in epoch {self.epoch} with "
                    f"{self.expected - self.received} of {self.expected} cells still expected: are producers running?"
                )
            self._admit(item)
        if self.received > self.expected:
            raise CellfeedError(
                f"rank {s.rank}: received {self.received} cells in epoch {self.epoch}, the plan "
                f"says {self.expected}: the items do not belong to this plan"
            )
        return waited

    def __next__(self) -> Batch:
        if self.steps is not None and self.step >= self.steps:
            raise StopIteration
        self.prepare(ahead=False)  # (the trainer may have had it drawn already)
        if self._failed is not None:  # (raised here, where the batch is taken: after the step before is saved)
            raise self._failed
        (batch, chosen), self._ahead = self._ahead, None
        for item, i in chosen:  # the batch's cells are taken: what each item has left
            if not item.stitched:
                batch.unit_cells[item.key_id] = batch.unit_cells.get(item.key_id, 0) + 1
            self.remaining[item.key] -= 1
            if self.remaining[item.key] == 0:
                del self.remaining[item.key]
                batch.completed.append(item.key)
                if not item.stitched:
                    batch.unit_items[item.key_id] = item.n_items
            else:
                batch.cells_of_partial.setdefault(item.key, []).append(int(item.cell_ids[i]))
        self.s.stats.cells += len(chosen)
        self.step += 1
        return batch

    def prepare(self, ahead: bool = True) -> float:
        """The next batch's cells drawn at random from the buffer (topped up first) and collated, now:
        the trainer asks while the accelerator runs a step, so the host's part overlaps it, and counts
        the seconds returned (waiting for data) in that step, not the next (`ahead`)."""
        if self._ahead is not None or self._failed is not None or (self.steps is not None and self.step >= self.steps):
            return 0.0
        s = self.s
        try:
            waited = self._fill()
        except Exception as exc:  # noqa: BLE001 - (no data, a failed campaign: `__next__` raises it)
            self._failed = exc
            return 0.0
        take = min(s.batch_size, len(self.buffer))
        picks = self.rng.choice(len(self.buffer), size=take, replace=False) if take else np.zeros(0, dtype=np.int64)
        if s.tokens_per_batch is not None and take:  # the drawn cells, in their drawn order, while their tokens fit
            lengths = [int(item.offsets[i + 1] - item.offsets[i]) for item, i in (self.buffer[p] for p in picks)]
            picks = picks[: within_budget(lengths, s.tokens_per_batch)]
        chosen = [self.buffer[i] for i in picks]
        for i in sorted(picks.tolist(), reverse=True):  # swap-remove
            self.buffer[i] = self.buffer[-1]
            self.buffer.pop()
        batch = collate(chosen, s.pad_to, s.pin_memory, s.pad_token, s.tokens_per_row, s.spans)
        batch.wait_s = 0.0 if ahead else waited
        s.stats.wait_s += waited
        self._ahead = (batch, chosen)
        return waited

    def put_back(self) -> None:
        """A prepared batch that will not be trained (a stop): its cells back into the buffer, untaken."""
        if self._ahead is not None:
            self.buffer.extend(self._ahead[1])
            self._ahead = None


def collate(
    chosen: list, pad_to: int | None, pin: bool, pad_token: int = PAD, tokens_per_row: int | None = None, spans=True
):
    """The drawn cells ((item, index) pairs) as a `Batch`: a row per cell padded to the longest (or
    `pad_to`), or, with `tokens_per_row`, packed end to end in rows of that many tokens
    (`trainer.packing`); with `spans`, cut into its cells' spans (for varlen attention)."""
    lengths = np.array([int(item.offsets[i + 1] - item.offsets[i]) for item, i in chosen], dtype=np.int64)
    n = len(chosen)
    if tokens_per_row:
        row, start, n_rows = pack_rows(lengths, tokens_per_row)
        width, segments = tokens_per_row, segments_of(lengths, row, start, n_rows, tokens_per_row)
    else:
        width = pad_to or int(lengths.max(initial=1))
        lengths = np.minimum(lengths, width)
        row, start, n_rows, segments = np.arange(n), np.zeros(n, np.int64), n, None
    bounds, longest = spans_of(lengths, row, start, n_rows, width) if spans else (None, 0)
    tokens = np.full((n_rows, width), pad_token, dtype=np.int64)
    has_values = bool(chosen) and chosen[0][0].values is not None
    float_values = has_values and chosen[0][0].values.dtype == np.float32
    values = np.zeros((n_rows, width), dtype=np.float32 if float_values else np.int64) if has_values else None
    has_labels = bool(chosen) and chosen[0][0].labels is not None
    labels = np.zeros(n, dtype=np.int64) if has_labels else None
    cell_ids = np.zeros(n, dtype=np.int64)
    for c, ((item, i), r, a, length) in enumerate(zip(chosen, row.tolist(), start.tolist(), lengths.tolist())):
        at = int(item.offsets[i])
        tokens[r, a : a + length] = item.tokens[at : at + length]
        if values is not None:
            values[r, a : a + length] = item.values[at : at + length]
        if labels is not None:
            labels[c] = item.labels[i]
        cell_ids[c] = item.cell_ids[i]
    mask = segments >= 0 if segments is not None else np.arange(width)[None, :] < lengths[:, None]
    arrays = (tokens, mask, values, labels, cell_ids, segments, bounds)
    tensors = [torch.from_numpy(x) if x is not None else None for x in arrays]
    if pin:
        tensors = [t.pin_memory() if t is not None else None for t in tensors]
    cut = Spans(tensors[6], longest) if spans else None
    return Batch(*tensors[:5], lengths=torch.from_numpy(lengths), segments=tensors[5], spans=cut)
