"""Queue requests counted by the plane, per kind of partition (the emulator's `describe()["stats"]`).

What a benchmark or a test reads to see how producers treat a full partition: how many puts the server
took and refused, and the bytes each carried, as the server received them (after modal's client has
serialized and retried: a blocking put refused as full is retried by the client, each try a request
counted here). Partitions are grouped as the emulator grouped them: every `rank-N` as `rank-*`, the
default partition as `(default)`, any other by its key.

    plane = ControlPlane(root).start()
    counts = count_queue_requests(plane)   # before any Queue exists
    ...                                     # modal's client puts and gets
    queue_stats(plane)["rank-*"]            # {"put_requests": .., "put_full": .., "put_ok_items": .., ...}

Counters: put_requests, put_bytes (every put's values, as serialized), put_ok_items, put_ok_bytes,
put_full (RESOURCE_EXHAUSTED: README C4), put_too_large (the 413: C4), get_requests, len_requests.
"""

from __future__ import annotations

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from cellfeed_testing.modal_control_plane.store import Store


def partition_kind(key: bytes | str | None) -> str:
    key = key.decode() if isinstance(key, bytes) else (key or "")
    return "rank-*" if key.startswith("rank-") else key or "(default)"


class CountingStore(Store):
    """A `Store` that counts the Queue requests it serves (on the plane's loop: no lock needed)."""

    def __init__(self, clock=None) -> None:
        super().__init__(clock)
        self.stats: dict[str, dict[str, int]] = {}

    def count(self, key, what: str, n: int = 1) -> None:
        counts = self.stats.setdefault(partition_kind(key), {})
        counts[what] = counts.get(what, 0) + n

    async def queue_put(self, oid: str, key: bytes, values: list[bytes], ttl_s: int) -> None:
        size = sum(len(v) for v in values)
        self.count(key, "put_requests")
        self.count(key, "put_bytes", size)
        try:
            await super().queue_put(oid, key, values, ttl_s)
        except GRPCError as exc:
            if exc.status == Status.RESOURCE_EXHAUSTED:
                self.count(key, "put_full")
            elif exc.status == Status.UNKNOWN:  # C4: the 413 of a request over the size limit
                self.count(key, "put_too_large")
            raise
        self.count(key, "put_ok_items", len(values))
        self.count(key, "put_ok_bytes", size)

    async def queue_get(self, oid: str, key: bytes, n: int, timeout_s: float) -> list[bytes]:
        self.count(key, "get_requests")
        return await super().queue_get(oid, key, n, timeout_s)

    def queue_len(self, oid: str, key: bytes, total: bool) -> int:
        self.count(key, "len_requests")
        return super().queue_len(oid, key, total)


def count_queue_requests(plane) -> CountingStore:
    """From now on `plane` counts its Queue requests. Call it before any Queue or Dict exists (the
    counting store replaces the plane's empty one, keeping its clock)."""

    async def swap() -> CountingStore:
        old: Store = plane.servicer.store
        if isinstance(old, CountingStore):
            return old
        if old.queues or old.dicts:
            raise RuntimeError("count_queue_requests: the plane already holds Queues or Dicts")
        plane.servicer.store = CountingStore(old.clock)
        return plane.servicer.store

    return plane.call(swap())


def queue_stats(plane) -> dict[str, dict[str, int]]:
    """A copy of the counts, read on the plane's loop ({} when `count_queue_requests` was not called)."""

    async def read() -> dict:
        store = plane.servicer.store
        return {kind: dict(counts) for kind, counts in getattr(store, "stats", {}).items()}

    return plane.call(read())
