"""Remote-world costs, locally: wrap any Queue/Map so every call costs a network round trip.

On Modal every `Queue`/`Dict` call is a round trip of tens of ms. `with_latency(queue, store,
mean_ms, jitter_ms)` returns wrappers that sleep a uniformly jittered latency on each call
(before a blocking call waits, as the request travels) and count calls by kind in one shared
`CallCounts`, so tests and benchmarks see — and can bound — what a protocol would cost there.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter


class CallCounts:
    """Calls by kind ("queue.put_many", "map.get", ...), and items moved by the queue calls."""

    def __init__(self):
        self._lock = threading.Lock()
        self.calls: Counter = Counter()
        self.items: Counter = Counter()

    def add(self, kind: str, items: int = 0) -> None:
        with self._lock:
            self.calls[kind] += 1
            if items:
                self.items[kind] += items

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.calls)


class Latency:
    """A per-call delay of `mean_ms` ± `jitter_ms` (uniform), seeded."""

    def __init__(self, mean_ms: float, jitter_ms: float = 0.0, seed: int = 0):
        if mean_ms < 0 or jitter_ms < 0 or jitter_ms > mean_ms:
            raise ValueError(f"latency {mean_ms} ± {jitter_ms} ms: need 0 <= jitter <= mean")
        self.mean_s, self.jitter_s = mean_ms / 1000, jitter_ms / 1000
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def wait(self) -> None:
        if self.mean_s:
            with self._lock:
                delay = self.mean_s + self._rng.uniform(-self.jitter_s, self.jitter_s)
            time.sleep(delay)


class LatencyQueue:
    def __init__(self, inner, latency: Latency, counts: CallCounts, partition_kind=None):
        self.inner, self.latency, self.counts = inner, latency, counts
        self._kind = partition_kind or (lambda partition: "")

    def _call(self, name: str, partition, items: int = 0) -> None:
        self.counts.add(f"queue.{name}{self._kind(partition)}", items)
        self.latency.wait()

    def put_many(self, values, block=True, timeout=None, *, partition=None) -> None:
        self._call("put_many", partition, len(values))
        self.inner.put_many(values, block, timeout, partition=partition)

    def put(self, value, block=True, timeout=None, *, partition=None) -> None:
        self._call("put", partition, 1)
        self.inner.put(value, block, timeout, partition=partition)

    def get_many(self, n_values, block=True, timeout=None, *, partition=None) -> list[bytes]:
        self._call("get_many", partition)
        out = self.inner.get_many(n_values, block, timeout, partition=partition)
        if out:
            self.counts.items[f"queue.get_many{self._kind(partition)}"] += len(out)
        return out

    def get(self, block=True, timeout=None, *, partition=None):
        self._call("get", partition)
        return self.inner.get(block, timeout, partition=partition)

    def len(self, *, partition=None, total=False) -> int:
        self._call("len", partition)
        return self.inner.len(partition=partition, total=total)


class LatencyMap:
    def __init__(self, inner, latency: Latency, counts: CallCounts):
        self.inner, self.latency, self.counts = inner, latency, counts

    def _call(self, name: str) -> None:
        self.counts.add(f"map.{name}")
        self.latency.wait()

    def put(self, key, value, *, skip_if_exists=False) -> bool:
        self._call("put")
        return self.inner.put(key, value, skip_if_exists=skip_if_exists)

    def get(self, key, default=None):
        self._call("get")
        return self.inner.get(key, default)

    def pop(self, key, *default):
        self._call("pop")
        return self.inner.pop(key, *default)

    def __contains__(self, key) -> bool:
        self._call("contains")
        return key in self.inner

    def keys(self) -> list[str]:
        self._call("keys")
        return self.inner.keys()

    def named(self, name: str, create: bool = False) -> "LatencyMap":
        if create:  # creating is a call; opening is not (Modal resolves the name on first use)
            self._call("create")
        return LatencyMap(self.inner.named(name, create), self.latency, self.counts)

    def drop(self, name: str) -> None:
        self._call("drop")
        self.inner.drop(name)

    def __getattr__(self, name):  # anything else the backend offers, one call each
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self._call(name)
            return attr(*args, **kwargs)

        return call


def remote(queue, store, latency_ms: float):
    """(queue, store) as they cost on Modal: each call `latency_ms` ± 40% (unchanged when 0)."""
    return with_latency(queue, store, latency_ms, 0.4 * latency_ms)[:2] if latency_ms else (queue, store)


def with_latency(
    queue,
    store,
    mean_ms: float,
    jitter_ms: float = 0.0,
    *,
    counts: CallCounts | None = None,
    seed: int = 0,
    partition_kind=None,
):
    """(queue, store) wrapped so each call costs mean_ms ± jitter_ms and is counted in `counts`.
    `partition_kind(partition) -> str` suffixes queue call kinds (e.g. ".items" vs ".tasks")."""
    counts = counts or CallCounts()
    latency = Latency(mean_ms, jitter_ms, seed)
    return LatencyQueue(queue, latency, counts, partition_kind), LatencyMap(store, latency, counts), counts
