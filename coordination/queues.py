"""The Queue and Map interfaces (shaped after `modal.Queue` / `modal.Dict` in modal 1.x) and the
in-memory shim that tests use.

What we rely on, and what the shim enforces so tests catch what Modal would reject:

- `put_many(values, block=True, timeout=None, *, partition=None)`: raises `queue.Full` at once when
  `block=False` and the partition is full (so does Modal's client for any timeout under ~2 s:
  callers wait for room themselves, `producers.courier.Courier.send`). Items are bytes of at
  most `MAX_ITEM_BYTES` (1 MiB less a margin for Modal's serialization; `ItemTooLarge`
  otherwise); a partition holds at most 5,000 items and 64 MiB; one request at most
  `REQUEST_LIMIT_BYTES` (`RequestTooLarge` otherwise: split it and send the halves).
- `get_many(n, block=True, timeout=None, *, partition=None)`: blocking returns at least one item
  or raises `queue.Empty` after `timeout`; non-blocking returns `[]` when empty.
- `get(block, timeout, *, partition)`: one item; non-blocking returns None when empty.
- `len(*, partition=None, total=False)`.
- Partition keys are None (the default partition) or strings of 1..64 bytes.
- Map: `put(key, value, *, skip_if_exists=False) -> bool` (False when the key existed and was
  kept), `get(key, default=None)`, `pop(key, default=...)` (KeyError when missing and no default),
  `__contains__`, `keys()`.
- Named maps beside a run's map, for state that must go away in one call (an epoch's stitching):
  `named(name, create=False)` is another map of the same backend (a `modal.Dict` of its own on
  Modal); `drop(name)` deletes it whole. A map that was dropped, or opened without `create` and
  never created, raises `MapGone` on use — so a late duplicate producer cannot re-create it. A
  handle follows its name: after a drop and a new `named(name, create=True)` (a resumed epoch),
  an old handle reaches the new map (on Modal, whose handles bind to one object id, the backend
  opens the name again when its object was deleted).
"""

from __future__ import annotations

import queue as stdlib_queue
import threading
import time
from collections import deque
from typing import Any, Protocol, runtime_checkable

from coordination.errors import CellfeedError

MODAL_ITEM_LIMIT = 1 << 20  # Modal's limit on an item, counted as its client serializes it
# cloudpickle adds 9-18 bytes to a bytes value (1,048,576 -> 1,048,585: cellfeed_testing/modal_control_plane, C4)
MAX_ITEM_BYTES = MODAL_ITEM_LIMIT - 1024
MAX_PARTITION_ITEMS = 5_000
MAX_PARTITION_BYTES = 64 << 20
MAX_PARTITION_KEY_BYTES = 64

Full = stdlib_queue.Full
Empty = stdlib_queue.Empty


class ItemTooLarge(CellfeedError):
    """An item over Modal's 1 MiB limit (producers split items so this never happens)."""


class RequestTooLarge(CellfeedError):
    """A put request over the backend's request-size limit (Modal: HTTP 413, `RequestSizeError`)."""


class MapGone(CellfeedError):
    """A named map that was dropped (or never created): its epoch is over."""


@runtime_checkable
class Queue(Protocol):
    def put_many(
        self, values: list[bytes], block: bool = True, timeout: float | None = None, *, partition: str | None = None
    ) -> None: ...

    def get_many(
        self, n_values: int, block: bool = True, timeout: float | None = None, *, partition: str | None = None
    ) -> list[bytes]: ...

    def get(self, block: bool = True, timeout: float | None = None, *, partition: str | None = None) -> Any: ...

    def len(self, *, partition: str | None = None, total: bool = False) -> int: ...


@runtime_checkable
class Map(Protocol):
    def put(self, key: str, value: Any, *, skip_if_exists: bool = False) -> bool: ...

    def get(self, key: str, default: Any = None) -> Any: ...

    def pop(self, key: str, *default: Any) -> Any: ...

    def __contains__(self, key: str) -> bool: ...

    def keys(self) -> list[str]: ...

    def named(self, name: str, create: bool = False) -> "Map": ...

    def drop(self, name: str) -> None: ...


MAX_REQUEST_ITEMS = 32  # items in one put_many request
# Modal's request-size limit is undocumented; assume a gRPC server's default 4 MiB (the control plane's
# figure, cellfeed_testing/modal_control_plane/README.md C4) and send half of it, so a request is never refused
REQUEST_LIMIT_BYTES = 4 << 20
MAX_REQUEST_BYTES = REQUEST_LIMIT_BYTES // 2


def request_batches(items: list[bytes], max_items: int = MAX_REQUEST_ITEMS, max_bytes: int = MAX_REQUEST_BYTES):
    """Consecutive slices of `items` of at most `max_items` and `max_bytes` each (an item alone may
    be larger): what one put_many request carries."""
    start = 0
    while start < len(items):
        end, size = start, 0
        while end < len(items) and end - start < max_items and (end == start or size + len(items[end]) <= max_bytes):
            size += len(items[end])
            end += 1
        yield items[start:end]
        start = end


def validate_partition(partition: str | None) -> str:
    if partition is None:
        return ""
    if not isinstance(partition, str) or not 1 <= len(partition.encode()) <= MAX_PARTITION_KEY_BYTES:
        raise ValueError(f"partition key must be a string of 1..{MAX_PARTITION_KEY_BYTES} bytes, got {partition!r}")
    return partition


def validate_item(value: bytes) -> int:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"queue items are bytes (no pickle on the data path), got {type(value).__name__}")
    size = len(value)
    if size > MAX_ITEM_BYTES:
        raise ItemTooLarge(f"queue item of {size:,} bytes exceeds the 1 MiB limit")
    return size


class MemoryQueue:
    """A thread-safe, partitioned FIFO with Modal's limits and blocking semantics."""

    def __init__(self, max_items: int = MAX_PARTITION_ITEMS, max_bytes: int = MAX_PARTITION_BYTES):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: dict[str, deque] = {}
        self._bytes: dict[str, int] = {}
        self._cond = threading.Condition()

    def _fits(self, key: str, n: int, size: int) -> bool:
        return len(self._items.get(key, ())) + n <= self.max_items and self._bytes.get(key, 0) + size <= self.max_bytes

    def put_many(self, values, block=True, timeout=None, *, partition=None) -> None:
        key = validate_partition(partition)
        sizes = [validate_item(v) for v in values]
        total = sum(sizes)
        if total > REQUEST_LIMIT_BYTES:
            raise RequestTooLarge(f"a put request of {total:,} bytes is over the {REQUEST_LIMIT_BYTES >> 20} MiB limit")
        if len(values) > self.max_items or total > self.max_bytes:
            raise ItemTooLarge(f"a put of {len(values)} items / {total:,} bytes can never fit one partition")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._fits(key, len(values), total):
                if not block:
                    raise Full(f"partition {partition!r} is full")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise Full(f"partition {partition!r} stayed full for {timeout}s")
                self._cond.wait(remaining)
            self._items.setdefault(key, deque()).extend(bytes(v) for v in values)
            self._bytes[key] = self._bytes.get(key, 0) + total
            self._cond.notify_all()

    def put(self, value, block=True, timeout=None, *, partition=None) -> None:
        self.put_many([value], block, timeout, partition=partition)

    def get_many(self, n_values, block=True, timeout=None, *, partition=None) -> list[bytes]:
        key = validate_partition(partition)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items.get(key):
                if not block:
                    return []
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise Empty()
                self._cond.wait(remaining)
            items = self._items[key]
            out = [items.popleft() for _ in range(min(n_values, len(items)))]
            self._bytes[key] -= sum(len(v) for v in out)
            self._cond.notify_all()
            return out

    def get(self, block=True, timeout=None, *, partition=None):
        values = self.get_many(1, block, timeout, partition=partition)
        return values[0] if values else None

    def len(self, *, partition=None, total=False) -> int:
        with self._cond:
            if total:
                return sum(len(v) for v in self._items.values())
            return len(self._items.get(validate_partition(partition), ()))


class MemoryMap:
    """A thread-safe dict with modal.Dict's put-if-absent; `named` maps share one registry."""

    def __init__(self, registry: dict | None = None):
        self._data: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._registry = {} if registry is None else registry  # name -> MemoryMap, shared by siblings
        self._gone = False

    def _check(self) -> None:
        if self._gone:
            raise MapGone("this map was dropped (its epoch is over)")

    def put(self, key, value, *, skip_if_exists=False) -> bool:
        if isinstance(value, (bytes, bytearray)) and len(value) > MAX_ITEM_BYTES:
            raise ItemTooLarge(f"map value of {len(value):,} bytes exceeds the 1 MiB limit")
        with self._lock:
            self._check()
            if skip_if_exists and key in self._data:
                return False
            self._data[key] = value
            return True

    def get(self, key, default=None):
        with self._lock:
            self._check()
            return self._data.get(key, default)

    def pop(self, key, *default):
        with self._lock:
            self._check()
            if key in self._data:
                return self._data.pop(key)
        if default:
            return default[0]
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        with self._lock:
            self._check()
            return key in self._data

    def keys(self) -> list[str]:
        with self._lock:
            self._check()
            return list(self._data)

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def named(self, name: str, create: bool = False) -> "NamedMap":
        if create:
            with self._lock:
                self._registry.setdefault(name, MemoryMap(self._registry))
        return NamedMap(self._registry, name, self._lock)

    def drop(self, name: str) -> None:
        with self._lock:
            found = self._registry.pop(name, None)
        if found is not None:
            with found._lock:
                found._gone = True


class NamedMap:
    """A named map by name, resolved on every call (the interface's contract: a handle follows its
    name; Modal's handles bind once, and `ModalMap` opens the name again): `MapGone` while it does
    not exist, the live map once it does."""

    def __init__(self, registry: dict, name: str, lock: threading.Lock):
        self._registry, self.name, self._lock = registry, name, lock

    def _map(self) -> MemoryMap:
        with self._lock:
            found = self._registry.get(self.name)
        if found is None:
            raise MapGone(f"map {self.name!r} does not exist (dropped, or not created yet)")
        return found

    def put(self, key, value, *, skip_if_exists=False) -> bool:
        return self._map().put(key, value, skip_if_exists=skip_if_exists)

    def get(self, key, default=None):
        return self._map().get(key, default)

    def pop(self, key, *default):
        return self._map().pop(key, *default)

    def __contains__(self, key) -> bool:
        return key in self._map()

    def keys(self) -> list[str]:
        return self._map().keys()

    def __len__(self) -> int:
        return len(self._map())
