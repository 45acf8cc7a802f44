"""Named objects, Queues and Dicts: the control plane's state, held as the bytes the client sent.

modal's client serializes keys, values and items itself (`modal/_serialization.py`; `dict.py:500`,
`queue.py:677`), so the server never unpickles anything: it stores, orders, counts and expires bytes.
Every refusal is a gRPC status, the one Modal's server answers (the client maps it: `_grpc_client.py:27-44`).
Each rule names its row in README.md (C1, C2, ...).

Everything here runs on the server's one event loop: no locks, and a blocking `get` is a coroutine
waiting on its queue's `Changed`, never a thread.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from cellfeed_testing.modal_control_plane.limits import (
    DICT_ENTRY_TTL_S,
    MAX_ITEM_BYTES,
    MAX_PARTITION_BYTES,
    MAX_PARTITION_ITEMS,
    MAX_REQUEST_BYTES,
)

MAX_PARTITION_KEY_BYTES = 64  # C6: "Partition keys must be non-empty and must not exceed 64 bytes" (queue.py:297)
MAX_PARTITIONS = 100_000  # C6: "up to 100,000 partitions" (queue.py:294)
MAX_LEN_REPORTED = 100_000  # C9: Dict.len "will return at most 100,000" (dict.py:515)
DEFAULT_ENVIRONMENT = "main"  # C1: one environment; the client sends "" when none is configured


class Clock:
    """Server time: monotonic seconds plus what a test `advance`s (to reach a TTL without waiting a day)."""

    def __init__(self) -> None:
        self._offset = 0.0

    def now(self) -> float:
        return time.monotonic() + self._offset

    def advance(self, seconds: float) -> None:
        self._offset += seconds


@dataclass
class Partition:
    items: deque = field(default_factory=deque)  # bytes, oldest first (C5: FIFO per partition)
    nbytes: int = 0
    expires_at: float = float("inf")  # C7: the TTL runs from the last put


class Changed:
    """Wakes every coroutine waiting on it (a put or a delete; an app's new log). What an
    `asyncio.Condition` would do on one event loop, without its lock: on Python 3.11, a
    `Condition.wait()` inside `wait_for` whose handler is cancelled while the timeout cancels the wait
    (grpclib cancels a handler when its client's connection is lost: a container killed mid-get) leaves
    the wait re-acquiring the lock in a task of its own, which then holds it for good, and every later
    `async with` on it waits for ever. Seen in the suite: one queue's gets and puts hung 7 minutes after
    a lost node, the handler's log saying "Lock is not acquired". A waiter here checks its condition and
    registers with no `await` between (one loop: nothing runs in between), so no wake-up is missed."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future] = set()

    def notify_all(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def wait(self, timeout_s: float) -> bool:
        """Until the next `notify_all` (True) or `timeout_s` (False)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self._waiters.discard(waiter)


@dataclass
class QueueState:
    name: str | None
    created_at: float
    partitions: dict[bytes, Partition] = field(default_factory=dict)
    deleted: bool = False
    changed: Changed = field(default_factory=Changed)  # a put or a delete wakes blocked gets


@dataclass
class DictState:
    name: str | None
    created_at: float
    entries: dict[bytes, tuple[bytes, float]] = field(default_factory=dict)  # key -> (value, last use)
    deleted: bool = False


def refuse(status: Status, message: str) -> GRPCError:
    return GRPCError(status, message)


class Store:
    """Queues and Dicts by object id, and the names that lead to them (C1-C3)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or Clock()
        self.names: dict[tuple[str, str, str], str] = {}  # (kind, environment, name) -> object id
        self.queues: dict[str, QueueState] = {}
        self.dicts: dict[str, DictState] = {}
        self.waiting_gets: Counter = Counter()  # (queue id, partition) -> blocked QueueGets: tests wait on it
        self._ids = itertools.count(1)

    def new_id(self, prefix: str) -> str:
        # Modal's ids are a prefix and a random tail ("qu-...", "di-...", "fc-..."); ours count too, for logs
        return f"{prefix}-{next(self._ids):05d}{secrets.token_hex(6)}"

    # ---- names: C1 (get or create), C2 (delete), C3 (a new object after a delete)

    def get_or_create(self, kind: str, name: str, environment: str, creation_type: int) -> str:
        from modal_proto import api_pb2

        table = self.queues if kind == "queue" else self.dicts
        if creation_type == api_pb2.OBJECT_CREATION_TYPE_EPHEMERAL:  # C1: no name; lives with its heartbeats
            return self._create(kind, table, None)
        key = (kind, environment or DEFAULT_ENVIRONMENT, name)
        oid = self.names.get(key)
        if oid is not None:
            if creation_type == api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS:
                raise refuse(Status.ALREADY_EXISTS, f"{kind.capitalize()} {name!r} already exists")
            return oid
        if creation_type not in (
            api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING,
            api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS,
        ):
            raise refuse(Status.NOT_FOUND, f"{kind.capitalize()} {name!r} not found")
        oid = self.names[key] = self._create(kind, table, name)
        return oid

    def _create(self, kind: str, table: dict, name: str | None) -> str:
        oid = self.new_id("qu" if kind == "queue" else "di")
        table[oid] = (QueueState if kind == "queue" else DictState)(name, time.time())
        return oid

    def by_id(self, kind: str, oid: str):
        obj = (self.queues if kind == "queue" else self.dicts).get(oid)
        if obj is None or obj.deleted:  # C2: handles to a deleted object get NOT_FOUND, never retried
            raise refuse(Status.NOT_FOUND, f"{kind.capitalize()} {oid} not found")
        return obj

    async def delete(self, kind: str, oid: str) -> None:
        obj = self.by_id(kind, oid)
        obj.deleted = True
        for key, value in list(self.names.items()):
            if value == oid:
                del self.names[key]
        if kind == "queue":  # blocked gets answer NOT_FOUND at once
            obj.changed.notify_all()

    # ---- queues: C4 (sizes), C5 (FIFO), C6 (partition keys), C7 (TTL), C8 (blocking get)

    def _partition(self, q: QueueState, key: bytes, create: bool) -> Partition | None:
        if len(key) > MAX_PARTITION_KEY_BYTES:  # C6 (the client checks too: queue.py:326-334)
            raise refuse(Status.INVALID_ARGUMENT, "Queue partition key must be between 1 and 64 characters.")
        p = q.partitions.get(key)
        if p is not None and self.clock.now() >= p.expires_at:  # C7: cleared when its TTL runs out
            del q.partitions[key]
            p = None
        if p is None and create:
            if len(q.partitions) >= MAX_PARTITIONS:
                raise refuse(Status.RESOURCE_EXHAUSTED, f"Queue has {MAX_PARTITIONS:,} partitions")
            p = q.partitions[key] = Partition()
        return p

    async def queue_put(self, oid: str, key: bytes, values: list[bytes], ttl_s: int) -> None:
        q: QueueState = self.by_id("queue", oid)
        size = sum(len(v) for v in values)
        if size > MAX_REQUEST_BYTES:  # C4: an HTTP 413, which grpclib reports as UNKNOWN with this text
            raise refuse(Status.UNKNOWN, "Received :status = '413'")
        for v in values:
            if len(v) > MAX_ITEM_BYTES:  # C4: 1 MiB an item, as serialized
                raise refuse(Status.INVALID_ARGUMENT, f"Queue item of {len(v):,} bytes exceeds the 1 MiB limit")
        p = self._partition(q, key, create=True)
        if len(p.items) + len(values) > MAX_PARTITION_ITEMS or p.nbytes + size > MAX_PARTITION_BYTES:
            # C4: a full partition is RESOURCE_EXHAUSTED, which a blocking put retries (queue.py:687-699)
            raise refuse(Status.RESOURCE_EXHAUSTED, "Queue partition is full")
        p.items.extend(values)
        p.nbytes += size
        p.expires_at = self.clock.now() + (ttl_s or 24 * 3600)  # C7
        q.changed.notify_all()

    async def queue_get(self, oid: str, key: bytes, n: int, timeout_s: float) -> list[bytes]:
        """C8: up to `n` items at once, else wait up to `timeout_s` (the client asks 50 s at most a
        request and loops: queue.py:506-526); an empty answer is how a wait ends."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            q: QueueState = self.by_id("queue", oid)  # C2: deleted (also while waiting): NOT_FOUND
            p = self._partition(q, key, create=False)
            if p is not None and p.items:
                out = [p.items.popleft() for _ in range(min(max(n, 1), len(p.items)))]
                p.nbytes -= sum(len(v) for v in out)
                return out
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            self.waiting_gets[oid, key] += 1
            try:
                if not await q.changed.wait(left):
                    return []
            finally:
                self.waiting_gets[oid, key] -= 1

    def queue_len(self, oid: str, key: bytes, total: bool) -> int:
        q: QueueState = self.by_id("queue", oid)
        if total:
            return sum(len(p.items) for k in list(q.partitions) if (p := self._partition(q, k, create=False)))
        p = self._partition(q, key, create=False)
        return len(p.items) if p else 0

    def queue_clear(self, oid: str, key: bytes, everything: bool) -> None:
        q: QueueState = self.by_id("queue", oid)
        if everything:
            q.partitions.clear()
        else:
            q.partitions.pop(key, None)

    # ---- dicts: C9 (operations), C10 (entry TTL), C11 (value size)

    def _entry(self, d: DictState, key: bytes, touch: bool) -> bytes | None:
        found = d.entries.get(key)
        if found is None:
            return None
        now = self.clock.now()
        if now - found[1] > DICT_ENTRY_TTL_S:  # C10: gone 7 days after its last read or write
            del d.entries[key]
            return None
        if touch:
            d.entries[key] = (found[0], now)
        return found[0]

    def dict_update(self, oid: str, updates: list[tuple[bytes, bytes]], if_not_exists: bool) -> bool:
        d: DictState = self.by_id("dict", oid)
        if sum(len(k) + len(v) for k, v in updates) > MAX_REQUEST_BYTES:  # C4's 413 (dict.py:545-551)
            raise refuse(Status.UNKNOWN, "Received :status = '413'")
        for _, v in updates:
            if len(v) > MAX_ITEM_BYTES:  # C11
                raise refuse(Status.INVALID_ARGUMENT, f"Dict value of {len(v):,} bytes exceeds the 1 MiB limit")
        if if_not_exists:
            if len(updates) != 1:  # C9: put(skip_if_exists=True) sends exactly one (dict.py:560-566)
                raise refuse(Status.INVALID_ARGUMENT, "if_not_exists needs exactly one update")
            if self._entry(d, updates[0][0], touch=False) is not None:
                return False
        now = self.clock.now()
        for k, v in updates:
            d.entries[k] = (v, now)
        return True

    def dict_get(self, oid: str, key: bytes) -> bytes | None:
        return self._entry(self.by_id("dict", oid), key, touch=True)

    def dict_peek(self, name: str, key: bytes) -> bytes | None:
        """(the plane's own look, no client's call) Dict `name`'s entry, its last use left as it was."""
        oid = self.names.get(("dict", DEFAULT_ENVIRONMENT, name))
        return None if oid is None else self._entry(self.by_id("dict", oid), key, touch=False)

    def dict_pop(self, oid: str, key: bytes) -> bytes | None:
        d: DictState = self.by_id("dict", oid)
        value = self._entry(d, key, touch=False)
        if value is not None:
            del d.entries[key]
        return value

    def dict_len(self, oid: str) -> int:
        d: DictState = self.by_id("dict", oid)
        return min(MAX_LEN_REPORTED, sum(1 for k in list(d.entries) if self._entry(d, k, touch=False) is not None))

    def dict_contents(self, oid: str) -> list[tuple[bytes, bytes]]:
        d: DictState = self.by_id("dict", oid)
        return [(k, v) for k in list(d.entries) if (v := self._entry(d, k, touch=False)) is not None]

    def dict_clear(self, oid: str) -> None:
        self.by_id("dict", oid).entries.clear()
