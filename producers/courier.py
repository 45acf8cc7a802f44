"""A producer's sender: puts a unit's items, then its done event, in order, on a thread of its own
so no call to the queue waits on the loop that tokenizes (`producers.producer`).

- Backpressure: a full partition is waited on, never sent into again (`Courier.send`).
- Heartbeats: every `heartbeat_s`, busy or not, an event names the units held and the running
  totals, and the campaign's stop key is looked at (the driver re-issues the units of a producer
  that falls silent: docs/DESIGN.md, "Routing and exactly-once").
- Going away: the units held and not done are named in one last `released` event, so they are
  issued again at once rather than when their lease runs out.

The loop talks to it through `hold` (a unit taken), `post_items` / `post_done` (in order), `finish`
(everything posted is sent), `release`, and the shared `stopping` event.
"""

from __future__ import annotations

import queue as stdlib_queue
import random
import threading
import time
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
        self._full_wait_s = FULL_WAIT_MIN_S  # how long to wait before looking again at a full partition
        self._full_at: dict[str, int] = {}  # partitions that refused a put -> their length then

    # ---- the loop's side

    def start(self) -> None:
        self._outbox = stdlib_queue.Queue(maxsize=OUTBOX_JOBS)
        self.error = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="cellfeed-courier")
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def hold(self, epoch: int, unit: int) -> None:
        """(read-ahead thread) A unit was taken: heartbeats name it until its done event is sent."""
        with self._held_lock:
            self._held.append((epoch, unit))

    def post_items(self, partition: str, items: list[bytes]) -> None:
        self._post(("items", partition, items))

    def post_done(self, epoch: int, unit: int) -> None:
        self._post(("done", (epoch, unit)))

    def finish(self) -> None:
        """Everything posted before is sent, then the thread ends (`join`)."""
        self._post(("end",))

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

    def _post(self, job: tuple) -> None:
        """Give the courier a job; waits while it is behind (backpressure), never past its failure."""
        while True:
            if self.error is not None:
                raise self.error
            if self.stopping.is_set():
                raise Stopped
            try:
                return self._outbox.put(job, timeout=STOP_POLL_S)
            except stdlib_queue.Full:
                continue

    # ---- the courier's thread

    def _run(self) -> None:
        """Send, in order: each unit's items, then its done event. Every `heartbeat_s` (also when
        busy): an event naming the units held, and a look for the stop signal."""
        self._beat_at = 0.0
        try:
            while not self.stopping.is_set():  # a stop asked of the loop (`stop`, an error) ends it at once
                self._beat_if_due()
                try:
                    job = self._outbox.get(timeout=max(0.01, min(STOP_POLL_S, self._beat_at - time.monotonic())))
                except stdlib_queue.Empty:
                    continue
                if job[0] == "items":
                    self.send(job[2], job[1])
                elif job[0] == "done":
                    with self._held_lock:
                        self._held.remove(job[1])
                    self._event(done=[job[1]])
                else:  # "end": everything before it is sent
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
        """One event: the units just finished, the units held now, the running totals."""
        with self._held_lock:
            held = list(self._held)
        self._send([encode_event(self.name, done=done, held=held, totals=self.totals())], EVENTS_PARTITION)

    # ---- sending

    def send(self, items: list[bytes], partition: str) -> None:
        """Put items now, in requests the backend accepts (the courier's job; also the held-out
        set's, sent once before any loop runs)."""
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
        deadline = time.monotonic() + self.put_timeout_s
        while True:
            if self.stopping.is_set():
                raise Stopped
            if partition in self._full_at:
                self._wait_for_room(len(batch), partition, deadline)
            try:
                self.queue.put_many(batch, block=False, partition=partition)
                return
            except RequestTooLarge as exc:
                if len(batch) == 1:
                    raise CellfeedError(
                        f"one item of {len(batch[0]):,} bytes is a request too large for the queue ({exc})"
                    ) from None
                self._send(batch[: len(batch) // 2], partition)
                self._send(batch[len(batch) // 2 :], partition)
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
                raise CellfeedError(
                    f"queue partition {partition} stayed full for {self.put_timeout_s:.0f}s: is the trainer consuming?"
                )
            if partition != EVENTS_PARTITION:  # backpressure is no silence: keep heartbeating
                self._beat_if_due()
            if self.stopping.wait(self._full_wait_s * random.uniform(0.75, 1.25)):
                raise Stopped
            self._full_wait_s = min(FULL_WAIT_MAX_S, self._full_wait_s * 2)
