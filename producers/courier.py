"""A producer's sender: puts a unit's items, then its done event, in order, on a thread of its own
so no call to the queue waits on the loop that tokenizes (`producers.producer`).

- Backpressure: a full partition is waited on, never sent into again (`Courier.send`).
- Heartbeats: every `heartbeat_s`, busy or not, an event names the units held and the running
  totals, and the campaign's stop key is looked at (the driver re-issues the units of a producer
  that falls silent: docs/DESIGN.md, "Routing and exactly-once").
- Going away: the units held and not done are named in one last `released` event, so they are
  issued again at once rather than when their lease runs out.

The loop talks to it through `hold` (a unit taken), `post` (a unit's items, then its done event),
`finish` (everything posted is sent), `release`, and the shared `stopping` event. Sending calls
nothing that sends back into it: `send` puts a unit's items (`_put_next`), heartbeating while it
waits for room; a heartbeat's event is put by `_event` (`_put_next` too), which never heartbeats.
"""

from __future__ import annotations

import queue as stdlib_queue
import random
import threading
import time
from collections import deque
from typing import Callable

from coordination.errors import CellfeedError
from coordination.queues import Full, Map, Queue, RequestTooLarge, request_batches
from coordination.routing import EVENTS_PARTITION, encode_event, stop_key

STOP_POLL_S = 1.0  # how often a waiting producer looks at its stop flag
RELEASE_TIMEOUT_S = 2.0  # a producer going away tries this long to name the units it will not finish
FULL_WAIT_MIN_S, FULL_WAIT_MAX_S = 0.1, 2.0  # looking for room in a full partition: this often, backing off
OUTBOX_JOBS = 16  # jobs (a unit's items, a done event) the courier may be behind the loop


class Stopped(Exception):
    """The campaign signalled a stop (or the loop was asked to stop) while this producer waited."""


class Courier:
    """Sends a producer's items and events (see the module's text)."""

    def __init__(
        self,
        queue: Queue,
        store: Map,
        *,
        run: str,
        name: str,
        heartbeat_s: float,
        put_timeout_s: float,
        totals: Callable[[], dict],
        stopping: threading.Event,
    ):
        self.queue, self.store = queue, store
        self.run, self.name = run, name
        self.heartbeat_s, self.put_timeout_s = heartbeat_s, put_timeout_s
        self.totals = totals  # the producer's running totals, for each event
        self.stopping = stopping  # set: the loop and the courier stop (shared with the loop)
        self.error: BaseException | None = None
        self._held: list[tuple[int, int]] = []  # units taken and not yet done
        self._held_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._outbox: stdlib_queue.Queue = stdlib_queue.Queue(maxsize=OUTBOX_JOBS)
        self._beat_at = 0.0
        self._started = False  # its first event says so (`encode_event`'s `started`)
        self._full_wait_s = FULL_WAIT_MIN_S  # how long to wait before looking again at a full partition
        self._full_at: dict[str, int] = {}  # partitions that refused a put -> their length then

    # ---- the loop's side

    def start(self) -> None:
        self._outbox = stdlib_queue.Queue(maxsize=OUTBOX_JOBS)
        self.error = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="cellfeed-courier")
        self._thread.start()

    def hold(self, epoch: int, unit: int) -> None:
        """(read-ahead thread) A unit was taken: heartbeats name it until its done event is sent."""
        with self._held_lock:
            self._held.append((epoch, unit))

    def post(self, sends: list[tuple[str, list[bytes]]] | None, done: tuple[int, int] | None = None) -> None:
        """(the loop) Send `sends` ([(partition, items), ...]) in order, then the done event of
        `done` (epoch, unit); `sends` None: the end (`finish`). The courier sends them on its
        thread: this waits while it is behind (backpressure), never past its failure. With no
        thread running (the held-out set, a unit produced by hand) the items are sent now."""
        if self._thread is None:
            for partition, items in sends or ():
                self.send(items, partition)
            return
        while True:
            if self.error is not None:
                raise self.error
            if self.stopping.is_set():
                raise Stopped
            try:
                return self._outbox.put((sends, done), timeout=STOP_POLL_S)
            except stdlib_queue.Full:
                continue

    def finish(self) -> None:
        """Everything posted before is sent, then the thread ends (`join`)."""
        self.post(None)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=self.put_timeout_s + 10)
        self._thread = None

    def stop_signalled(self) -> bool:
        """The campaign's stop key is set (its end, by `cellfeed local` or the Modal app)."""
        return self.store.get(stop_key(self.run)) is not None

    def release(self) -> None:
        """Going away with units taken and not done: name them in one last event, so the driver
        issues them again now rather than when their lease runs out. Best effort, one try: the
        lease still covers a producer that cannot say it (killed outright, the queue down)."""
        with self._held_lock:
            held = list(self._held)
        if not held:
            return
        try:
            self.queue.put_many(
                [encode_event(self.name, released=held)],
                block=True,
                timeout=RELEASE_TIMEOUT_S,
                partition=EVENTS_PARTITION,
            )
        except Exception:  # noqa: BLE001 - the lease covers it
            pass

    # ---- the courier's thread

    def _run(self) -> None:
        """Send, in order: each unit's items, then its done event (the jobs waiting, together).
        Every `heartbeat_s` (also when busy): an event naming the units held, and a look for the
        stop signal."""
        self._beat_at = 0.0
        try:
            while not self.stopping.is_set():  # a stop asked of the loop (`stop`, an error) ends it at once
                self._beat_if_due()
                try:
                    job = self._outbox.get(timeout=max(0.01, min(STOP_POLL_S, self._beat_at - time.monotonic())))
                except stdlib_queue.Empty:
                    continue
                if job[0] is None:  # the end: everything before it is sent
                    return
                # the jobs queued behind it go in the same requests: each partition's items in the order
                # posted, then one event for all their units (each unit's done still follows its items).
                # A call per unit's items and one per its done event capped a producer at ~20 units/s
                # under Modal's ~25 ms a call.
                jobs, end = [job], False
                while len(jobs) < OUTBOX_JOBS and not end:
                    try:
                        jobs.append(self._outbox.get_nowait())
                    except stdlib_queue.Empty:
                        break
                    end = jobs[-1][0] is None
                merged: dict[str, list[bytes]] = {}
                for sends, _ in jobs[:-1] if end else jobs:
                    for partition, items in sends:
                        merged.setdefault(partition, []).extend(items)
                for partition, items in merged.items():
                    self.send(items, partition)
                done = [d for sends, d in jobs if sends is not None and d is not None]
                if done:
                    with self._held_lock:
                        for unit in done:
                            self._held.remove(unit)
                    self._event(done=done)
                if end:
                    return
        except Stopped:
            self.stopping.set()
        except BaseException as exc:  # noqa: BLE001 - raised in the loop's thread
            self.error = exc if isinstance(exc, CellfeedError) else CellfeedError(f"sending failed: {exc}")
            self.stopping.set()

    def _beat_if_due(self) -> None:
        """A heartbeat event and a look for the stop signal, every `heartbeat_s` (not when no loop
        runs: the held-out set is sent from the caller's thread)."""
        if self._thread is None or time.monotonic() < self._beat_at:
            return
        self._beat_at = time.monotonic() + self.heartbeat_s
        if self.stop_signalled():
            raise Stopped
        self._event()

    def _event(self, done=()) -> None:
        """One event: the units just finished, the units held now, the running totals. A full
        events partition is waited on (the driver drains it every pass), without heartbeats."""
        with self._held_lock:
            held = list(self._held)
        event = encode_event(self.name, done=done, held=held, totals=self.totals(), started=not self._started)
        self._started, batches = True, deque([[event]])
        deadline = time.monotonic() + self.put_timeout_s
        while batches:
            if not self._put_next(batches, EVENTS_PARTITION, deadline):
                self._pause()

    # ---- sending

    def send(self, items: list[bytes], partition: str) -> None:
        """Put items now, in order, in requests the backend accepts (the courier's job; also the
        held-out set's, sent once before any loop runs). A full partition is backpressure: it is
        waited on (`_pause`), heartbeating meanwhile (backpressure is no silence), never sent into
        again. A request waiting `put_timeout_s` is an error; a stop is noticed within a wait."""
        batches = deque(request_batches(items))
        deadline = time.monotonic() + self.put_timeout_s
        while batches:
            left = len(batches)
            if not self._put_next(batches, partition, deadline):
                self._beat_if_due()
                self._pause()
            elif len(batches) != left:  # one went (or was split): the next has its own put_timeout_s
                deadline = time.monotonic() + self.put_timeout_s

    def _put_next(self, batches: deque, partition: str, deadline: float) -> bool:
        """One try at the first batch: put (it leaves `batches`), or split in two if the backend
        takes it for a request too large, or found full; False when the partition, marked full,
        has no room for it yet (the caller waits, then tries again). (On Modal a put whose timeout
        is under ~2 s is refused at once, and each try uploads the whole batch again.) A refusal at
        length L marks the partition full with room for L items; until it drains, each try first
        looks at its length (one small call)."""
        if self.stopping.is_set():
            raise Stopped
        batch = batches[0]
        if partition in self._full_at and not self._has_room(len(batch), partition, deadline):
            return False
        try:
            self.queue.put_many(batch, block=False, partition=partition)
            batches.popleft()
        except RequestTooLarge as exc:
            if len(batch) == 1:
                raise CellfeedError(
                    f"one item of {len(batch[0]):,} bytes is a request too large for the queue ({exc})"
                ) from None
            batches.popleft()
            batches.extendleft([batch[len(batch) // 2 :], batch[: len(batch) // 2]])
        except Full:
            self._full_at[partition] = self.queue.len(partition=partition)
        return True

    def _has_room(self, n_items: int, partition: str, deadline: float) -> bool:
        """Whether a partition marked full has room for `n_items` more now (its length: one call);
        a partition that drained to half is full no more. Past `deadline`, an error."""
        held, room_for = self.queue.len(partition=partition), self._full_at[partition]
        if held <= room_for // 2:
            del self._full_at[partition]
            return True
        if held + n_items <= room_for:
            self._full_wait_s = max(FULL_WAIT_MIN_S, self._full_wait_s / 2)
            return True
        if time.monotonic() >= deadline:
            raise CellfeedError(
                f"queue partition {partition} stayed full for {self.put_timeout_s:.0f}s: is the trainer consuming?"
            )
        return False

    def _pause(self) -> None:
        """Wait before looking at a full partition again: a jittered back-off (0.1 s up to 2 s,
        remembered between waits, so producers sharing a partition look at different moments)."""
        if self.stopping.wait(self._full_wait_s * random.uniform(0.75, 1.25)):
            raise Stopped
        self._full_wait_s = min(FULL_WAIT_MAX_S, self._full_wait_s * 2)
