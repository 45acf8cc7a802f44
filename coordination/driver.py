"""The driver: feeds an epoch's units to producers as tasks, re-issues units whose producer fell
silent (or that were taken and never claimed), knows when the epoch is complete, then drops the
epoch's stitching map whole.

It needs only each epoch's `PlanSummary` (unit count, cells per rank, boundary cells), which the
campaign's setup publishes into the map, so it runs anywhere — in the trainer's rank 0 (a
detached Modal campaign needs no laptop) or beside a local campaign — without Lance.

Its coordination calls do not grow with the units in flight: each pass drains the producers'
events with one `get_many`, reads the task list's length once, and tops the task list up with one
`put_many`; who holds what, and since when, is kept in memory (docs/DESIGN.md, "Routing and
exactly-once").
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from coordination.errors import CellfeedError
from coordination.queues import Full, Map, Queue
from coordination.routing import (
    EVENTS_PARTITION,
    TASKS_PARTITION,
    decode_event,
    encode_task,
    epoch_map_name,
    produced_key,
    producers_key,
)
from coordination.summary import PlanSummary, load_summary

LEASE_S = 12.0  # a unit whose producer is silent this long is re-issued (the campaign's --lease-s)
HEARTBEATS_PER_LEASE = 4  # a producer says what it holds this often per lease: a lease is 4 missed heartbeats
EVENTS_PER_CALL = 1000
PUBLISH_EVERY_S = 2.0  # how often the producers' totals are published for monitors
TASK_LIST_S = 1.0  # the task list holds what the producers take in this long (see `Driver._depth`)
MIN_QUEUED_TASKS = 16


def done_ranges(state: "EpochState") -> list[list[int]]:
    """[[start, end), ...] of an epoch's units neither still to issue nor in flight: O(units) in
    numpy (1.5M units: milliseconds), as the driver publishes it every few seconds."""
    done = np.ones(state.summary.n_units + 2, dtype=bool)
    done[[0, -1]] = False  # sentinels: every run has a start and an end
    done[np.fromiter(state.todo, dtype=np.int64, count=len(state.todo)) + 1] = False
    done[np.fromiter(state.flights, dtype=np.int64, count=len(state.flights)) + 1] = False
    edges = np.flatnonzero(np.diff(done.astype(np.int8)))
    return edges.reshape(-1, 2).tolist()


def heartbeat_interval(lease_s: float) -> float:
    """How often a producer under this lease says what it holds."""
    return lease_s / HEARTBEATS_PER_LEASE


@dataclass
class DriverStats:
    issued: int = 0
    reissued: int = 0
    released: int = 0  # units marked lost at a producer's word (its `released`, or a restart under its name)
    skipped_units: int = 0  # a resumed epoch's units not produced again (trained through)
    already_produced: int = 0  # later epochs' units an earlier driver of the run saw done (not produced again)
    redone: int = 0  # units produced again because a rank never got their items (a lost reply)
    reopened: int = 0  # complete epochs opened again for such units
    epochs: int = 0
    events: int = 0
    passes: int = 0
    pass_s: list = field(default_factory=list)  # seconds of each pass's calls (bounded sample)
    first_reissue_at: float | None = None  # time.monotonic() of the first re-issue

    def pass_seconds(self) -> float | None:
        """Median seconds a pass spends in its calls."""
        return round(sorted(self.pass_s)[len(self.pass_s) // 2], 3) if self.pass_s else None


@dataclass
class Flight:
    """A unit issued and not yet done: where it is, as far as the driver knows."""

    seq: int  # its place in the FIFO task list's issue order
    taken_at: float | None = None  # when the task list had moved past it (someone took it)
    seen_at: float | None = None  # when it was last taken or named held in an event (a claim lasts lease_s)
    holder: str | None = None  # the first producer to name it held since it was issued: most likely its taker

    def lost(self, now: float) -> bool:
        """Its producer will not finish it: issued again in this pass, not a lease later. False if
        it was already."""
        was = self.seen_at == float("-inf")
        self.taken_at, self.seen_at = self.taken_at or now, float("-inf")
        return not was


@dataclass
class EpochState:
    summary: PlanSummary
    todo: deque  # units not yet issued
    flights: dict = field(default_factory=dict)  # unit -> Flight: issued, not yet done


class Driver:
    def __init__(
        self,
        queue: Queue,
        store: Map,
        run: str,
        *,
        lease_s: float = LEASE_S,
        poll_s: float = 0.25,
        max_queued_tasks: int = 128,
        stall_timeout_s: float = 600.0,
        world_size: int | None = None,
    ):
        self.queue, self.store, self.run = queue, store, run
        self.world_size = world_size  # the ranks' number: items in the queue are routed by it
        self.lease_s, self.poll_s = lease_s, poll_s
        self.max_queued_tasks = max_queued_tasks
        self.stall_timeout_s = stall_timeout_s
        self.stats = DriverStats()
        self.producers: dict[str, dict] = {}  # name -> last totals, "heard" (time.time())
        self._issued_seq = 0
        self._published = 0.0
        self._stop = threading.Event()
        self._taken_at: tuple[int, float] | None = None  # (tasks taken, when) at the last pass
        self._take_rate: float | None = None  # tasks taken per second, smoothed
        self._states: dict[int, EpochState] = {}  # every epoch this driver started, by epoch (active or not)
        self.error: BaseException | None = None

    # ---- calls: a constant number per pass

    def _issue(self, epoch: int, units: list[int], flights: dict, order: deque) -> list[int]:
        """Put tasks (as many as fit now); returns the units issued."""
        if not units:
            return []
        try:
            self.queue.put_many(
                [encode_task(epoch, u) for u in units], block=True, timeout=self.poll_s, partition=TASKS_PARTITION
            )
        except Full:
            return []
        for u in units:
            flights[u] = Flight(self._issued_seq)
            order.append((self._issued_seq, epoch, u))
            self._issued_seq += 1
        self.stats.issued += len(units)
        return units

    def _drain(self) -> list[dict]:
        events = []
        while True:
            batch = self.queue.get_many(EVENTS_PER_CALL, block=False, partition=EVENTS_PARTITION)
            events += [decode_event(e) for e in batch]
            if len(batch) < EVENTS_PER_CALL:
                return events

    def _publish(self, force: bool = False) -> None:
        """The producers' totals (for monitors) and the units produced so far per epoch (for a
        resumed driver), every PUBLISH_EVERY_S: two puts."""
        if force or time.monotonic() - self._published >= PUBLISH_EVERY_S:
            self.store.put(producers_key(self.run), json.dumps(self.producers))
            done = {
                e: [[0, s.summary.n_units]] if not s.todo and not s.flights else done_ranges(s)
                for e, s in self._states.items()
            }
            self.store.put(produced_key(self.run), json.dumps({"world_size": self.world_size, "epochs": done}))
            self._published = time.monotonic()

    def _produced_before(self) -> dict[int, set[int]]:
        """Per epoch, the units an earlier driver of this run saw done; none when it drove another
        number of ranks (their items in the queue are routed to ranks that no longer exist)."""
        data = json.loads(self.store.get(produced_key(self.run)) or "{}")
        if not data or data.get("world_size") != self.world_size:
            return {}
        return {int(e): {u for a, b in spans for u in range(a, b)} for e, spans in data["epochs"].items()}

    def _depth(self, taken: int, now: float) -> int:
        """How many tasks to keep in the list: what the producers take in TASK_LIST_S, or in two
        passes if a pass takes longer (their recent rate), at least MIN_QUEUED_TASKS, at most
        `max_queued_tasks`. A short list keeps a unit issued again (a lease run out, a producer
        going away, a rank asking) near its head: the list is FIFO, and behind 128 tasks it would
        wait for all of them to be produced."""
        horizon = TASK_LIST_S
        if self._taken_at is not None and now > self._taken_at[1]:
            interval = now - self._taken_at[1]
            rate = (taken - self._taken_at[0]) / interval
            self._take_rate = rate if self._take_rate is None else 0.8 * self._take_rate + 0.2 * rate
            horizon = max(TASK_LIST_S, 2 * interval)  # (slow passes: the list must last until the next one)
        self._taken_at = (taken, now)
        wanted = MIN_QUEUED_TASKS if self._take_rate is None else math.ceil(self._take_rate * horizon)
        return int(min(self.max_queued_tasks, max(MIN_QUEUED_TASKS, wanted)))

    # ---- the epochs

    def _redo(self, asked: list[tuple[int, int]], active: dict, summaries: dict, order: deque) -> None:
        """A rank asks for units again: their items never reached it (a reply lost after the queue
        gave them out: Modal's client then retries, and the items are gone). Units the driver still
        has to issue or holds in flight are coming anyway; a done unit is issued again (consumers
        drop what they did get by key), opening its epoch again if it was complete (its stitching
        map made afresh: every holder of a missing stitched cell is among the units asked for)."""
        for e in sorted({e for e, _ in asked}):
            units = sorted({u for e2, u in asked if e2 == e})
            state = active.get(e)
            if state is None:
                if e not in summaries:
                    continue  # not an epoch of this driver's (a stale request from before a resume)
                self.store.named(epoch_map_name(e), create=True)
                state = active[e] = self._states[e] = EpochState(summaries[e], deque())
                reordered = dict(sorted(active.items()))  # (kept in epoch order)
                active.clear()
                active.update(reordered)
                self.stats.reopened += 1
            pending = set(state.todo)
            redo = [u for u in units if u not in state.flights and u not in pending and 0 <= u < state.summary.n_units]
            issued = set(self._issue(e, redo, state.flights, order))
            self.stats.redone += len(issued)
            state.todo.extend(u for u in redo if u not in issued)  # (the task list was full: a later pass)

    def run_epochs(
        self,
        epochs: list[int],
        summary_timeout_s: float = 60.0,
        resume_epoch: int | None = None,
        skip_units: set[int] = frozenset(),
        linger: bool = False,
    ) -> DriverStats:
        """Drive epochs in order, each to completion (every unit done), then drop its stitching
        map. The next epoch's units are issued as soon as this epoch has none left to issue, so
        producers never idle on an epoch's last stragglers (consumers hold later-epoch items
        aside). Each epoch's map is created fresh when it starts; a resumed epoch's half-finished
        stitching is dropped first, and its units are issued again but `skip_units` (trained
        through, holding no piece of an untrained boundary cell: `PlanSummary.units_to_skip`);
        consumers drop what they already trained on by key. Later epochs' units that an earlier
        driver of this run saw done (`produced_key`: their items are in the queue) are not issued
        again, and their maps are kept; an item of them that the ranks of a stopped trainer had
        popped is asked for again by the rank that misses it (`_redo`). With `linger`, the driver
        goes on after the last epoch until stopped, answering such requests: the trainer stops it
        when training is over."""
        waiting = deque(epochs)
        earlier = self._produced_before() if resume_epoch is not None else {}
        active: dict[int, EpochState] = {}  # started and not complete, in epoch order
        order: deque = deque()  # (seq, epoch, unit) in issue order: the FIFO task list's contents and past
        summaries: dict[int, PlanSummary] = {}  # every epoch started (a complete one may be opened again)
        closed: set[int] = set()

        def start_next() -> None:
            epoch = waiting.popleft()
            summary = summaries[epoch] = load_summary(self.store, self.run, epoch, summary_timeout_s)
            self._states[epoch] = EpochState(summary, deque())  # (replaced below; what `_publish` reports)
            units = range(summary.n_units)
            if epoch == resume_epoch:
                self.store.drop(epoch_map_name(epoch))
                units = [u for u in units if u not in skip_units]
                self.stats.skipped_units += summary.n_units - len(units)
            elif epoch in earlier:  # produced ahead before the trainer stopped: in the queue already
                units = [u for u in units if u not in earlier[epoch]]
                self.stats.already_produced += summary.n_units - len(units)
            self.store.named(epoch_map_name(epoch), create=True)  # (an existing map is kept)
            active[epoch] = self._states[epoch] = EpochState(summary, deque(units))

        if waiting:
            start_next()
        last_progress = time.monotonic()
        while (active or linger) and not self._stop.is_set():
            started = now = time.monotonic()
            redo, progressed = self._take_events(active, now)
            if progressed:
                last_progress = now
            if redo:
                self._redo(redo, active, summaries, order)
                last_progress = now
            if not active:  # (lingering) every epoch is complete: only a rank's request can come
                self._stop.wait(self.poll_s)
                continue
            queued = self.queue.len(partition=TASKS_PARTITION)
            taken_before = self._issued_seq - queued  # FIFO: every task issued before this one was taken
            depth = self._depth(taken_before, now)
            self._mark_taken(active, order, taken_before, now)
            queued += self._reissue_lost(active, order, now)
            queued = self._issue_ahead(active, order, depth, queued)
            if waiting and not active[max(active)].todo:  # the newest epoch is all issued: start the next
                start_next()
            if self._close_complete(active, closed):
                last_progress = now
            self._publish()
            self.stats.passes += 1
            if len(self.stats.pass_s) < 10_000:
                self.stats.pass_s.append(time.monotonic() - started)
            if now - last_progress > self.stall_timeout_s:
                left = sum(len(s.todo) + len(s.flights) for s in active.values())
                raise CellfeedError(
                    f"epoch {min(active)}: no unit finished in {self.stall_timeout_s:.0f}s with "
                    f"{left} left: are the producers running?"
                )
            if active:
                self._stop.wait(self.poll_s)
        return self.stats

    def _take_events(self, active: dict, now: float) -> tuple[list, bool]:
        """The producers' and ranks' events since the last pass (who finished what, who holds what):
        flights updated; (the ranks' redo requests, whether a unit was done)."""
        redo, progressed = [], False
        for event in self._drain():
            self.stats.events += 1
            if event["redo"]:  # a rank's
                redo += event["redo"]
                continue
            producer = event["p"]
            self.producers[producer] = {**(event["totals"] or self.producers.get(producer, {})), "heard": time.time()}
            if event["started"]:  # a process under a name an earlier one had: what that one held is lost
                for e, state in active.items():
                    for u, flight in state.flights.items():
                        if flight.holder == producer and (e, u) not in event["held"]:
                            self.stats.released += flight.lost(now)
            for e, u in event["done"]:
                if e in active and active[e].flights.pop(u, None) is not None:
                    progressed = True
            for e, u in event["held"]:
                if e in active and u in active[e].flights:
                    flight = active[e].flights[u]  # (a stalled producer waking later does not become its holder)
                    flight.seen_at, flight.holder = now, flight.holder or producer
            for e, u in event["released"]:  # its producer is going away: issued again in this pass
                if e in active and u in active[e].flights:
                    self.stats.released += active[e].flights[u].lost(now)
        return redo, progressed

    def _mark_taken(self, active: dict, order: deque, taken_before: int, now: float) -> None:
        """The tasks queue is FIFO: every task issued before the first still queued has been taken."""
        while order and order[0][0] < taken_before:
            seq, e, u = order.popleft()
            flight = active[e].flights.get(u) if e in active else None
            if flight is not None and flight.seq == seq and flight.taken_at is None:
                flight.taken_at = flight.seen_at = now

    def _issue_ahead(self, active: dict, order: deque, depth: int, queued: int) -> int:
        """New units, oldest epoch first, until `depth` tasks are queued; the tasks queued now."""
        for e, state in list(active.items()):
            room = depth - queued
            if room > 0 and state.todo:
                batch = [state.todo.popleft() for _ in range(min(room, len(state.todo)))]
                issued = self._issue(e, batch, state.flights, order)
                state.todo.extendleft(reversed(batch[len(issued) :]))
                queued += len(issued)
        return queued

    def _reissue_lost(self, active: dict, order: deque, now: float) -> int:
        """Units taken, and neither done nor named held for lease_s: their producer died (or stalled, or
        its events were lost): issued again (consumers drop the duplicates by key). How many."""
        issued = 0
        for e, state in active.items():
            lost = [u for u, f in state.flights.items() if f.taken_at is not None and now - f.seen_at > self.lease_s]
            for _ in self._issue(e, lost, state.flights, order):
                self.stats.reissued += 1
                if self.stats.first_reissue_at is None:
                    self.stats.first_reissue_at = time.monotonic()
                issued += 1
        return issued

    def _close_complete(self, active: dict, closed: set) -> bool:
        """Every epoch with no unit to issue or in flight is complete: its stitching map goes. Any closed?"""
        complete = [e for e, state in active.items() if not state.todo and not state.flights]
        for e in complete:
            del active[e]
            self.store.drop(epoch_map_name(e))
            self._publish(force=True)  # the final totals of the epoch
            self.stats.epochs += e not in closed  # (an epoch opened again by `_redo` closes again)
            closed.add(e)
        return bool(complete)

    def start(
        self,
        epochs: list[int],
        resume_epoch: int | None = None,
        skip_units: set[int] = frozenset(),
        linger: bool = False,
    ) -> threading.Thread:
        """Run the epochs in a background thread (e.g. inside trainer rank 0); an error is kept in
        `self.error` for the owner to raise (`check`)."""

        def target():
            try:
                self.run_epochs(epochs, resume_epoch=resume_epoch, skip_units=skip_units, linger=linger)
            except BaseException as exc:  # noqa: BLE001 - reported by the owner
                self.error = exc

        thread = threading.Thread(target=target, daemon=True, name="cellfeed-driver")
        thread.start()
        return thread

    def check(self) -> None:
        """Raise the driver's error, if it had one (the trainer calls this every step)."""
        if self.error is not None:
            raise CellfeedError(f"the driver failed: {self.error}") from self.error

    def stop(self) -> None:
        self._stop.set()
