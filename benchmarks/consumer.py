"""What one consumer sustains: pop + verify + decompress + dedupe + mix + batch, from the memory
and local backends, at batch 64 and 240 with max_genes 1024 (scGPT tokens); plus queue round-trip
latency. Target: >= 10x the ~4,000 cells/s an H100 trains a 51M-parameter scGPT at.

    python benchmarks/consumer.py            # 60k cells per measurement
    python benchmarks/consumer.py --quick    # 12k cells, under a minute
    python benchmarks/consumer.py --tiny     # 2k cells: seconds (the test suite's)

Ends with one JSON line of the figures. Exits 1 (one line on stderr) when a measurement consumed
fewer cells than it fed or a figure is missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._checks import check_figures, fail, machine  # noqa: E402
from coordination.errors import CellfeedError  # noqa: E402
from coordination.latency import remote  # noqa: E402
from coordination.local_backend import ServerProcess  # noqa: E402
from coordination.local_client import LocalMap, LocalQueue  # noqa: E402
from coordination.plan import Sampling  # noqa: E402
from coordination.queues import MemoryMap, MemoryQueue, request_batches  # noqa: E402
from coordination.routing import TASKS_PARTITION, encode_task, rank_partition  # noqa: E402
from producers.config import ProducerConfig  # noqa: E402
from producers.dataset import open_dataset  # noqa: E402
from producers.producer import Producer  # noqa: E402
from producers.synth import cached_atlas  # noqa: E402
from trainer.stream import ConsumerStream  # noqa: E402

TARGET = 40_000


def make_items(n_cells: int, atlas_cells: int = 20_000) -> list[bytes]:
    path = cached_atlas(atlas_cells)
    ds = open_dataset(path)
    queue = MemoryQueue(max_items=10**9, max_bytes=1 << 62)
    config = ProducerConfig(
        dataset=path,
        run="bench",
        max_genes=1024,
        world_size=1,
        sampling=Sampling("block"),
        cells_per_item=128,
        idle_timeout_s=0.1,
    )
    producer = Producer(config, queue, MemoryMap(), dataset=ds)
    plan = producer.plan(0)
    queue.put_many([encode_task(0, u) for u in range(plan.n_units)], partition=TASKS_PARTITION)
    producer.run()
    items = queue.get_many(10**9, block=False, partition=rank_partition(0))
    reps = -(-n_cells // ds.n_cells)
    return items, ds.n_cells, reps


def consume(queue, items: list[bytes], n_cells_per_rep: int, reps: int, batch_size: int) -> dict:
    """Feed `reps` epochs' worth of items while one stream consumes them; cells/s end to end."""
    died: list[BaseException] = []

    def feed():
        try:
            for epoch in range(reps):
                # re-tag each repetition's items with its epoch: the stream checks epochs and keys; one
                # request stays within the backend's size limit (32 scGPT items of 1,024 genes are ~8 MB)
                for batch in request_batches([_retag(b, epoch) for b in items]):
                    queue.put_many(batch, partition=rank_partition(0))
        except BaseException as exc:  # noqa: BLE001 - the consumer raises it (`check`) within a poll
            died.append(exc)

    def check():  # the feeder's death ends the measurement at once, not after the stream's 600 s wait
        if died:
            raise CellfeedError(f"the feeder thread died: {type(died[0]).__name__}: {died[0]}") from died[0]

    stream = ConsumerStream(
        queue,
        rank=0,
        world_size=1,
        run="bench",
        batch_size=batch_size,
        pad_to=1025,
        buffer_cells=4096,
        poll_s=0.05,
        check=check,
    )
    feeder = threading.Thread(target=feed, daemon=True)
    start = time.perf_counter()
    feeder.start()
    cells = batches = 0
    for epoch in range(reps):
        for batch in stream.epoch(epoch, [n_cells_per_rep]):
            cells += batch.size
            batches += 1
    seconds = time.perf_counter() - start
    stream.close()
    return {
        "cells_per_s": cells / seconds,
        "items_per_s": stream.stats.items / seconds,
        "batches_per_s": batches / seconds,
        "wait_s": stream.stats.wait_s,
        "cells": cells,
    }


def _retag(data: bytes, epoch: int) -> bytes:
    import struct

    out = bytearray(data)
    struct.pack_into("<I", out, 16, epoch)  # the header's epoch field
    return bytes(out)


def round_trip_us(queue, n: int = 300) -> float:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        queue.put_many([b"x" * 100], partition="rt")
        queue.get_many(1, timeout=5, partition="rt")
        samples.append((time.perf_counter() - t) * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a 2k-cell atlas, once each: seconds (the test suite's)")
    parser.add_argument(
        "--rpc-latency-ms",
        type=float,
        default=0.0,
        help="every queue/map call costs this many ms (± 40%%), as a round trip to Modal (default: 0)",
    )
    args = parser.parse_args()
    n_cells = 2_000 if args.tiny else 12_000 if args.quick else 60_000
    items, per_rep, reps = make_items(n_cells, 2_000 if args.tiny else 20_000)
    server = ServerProcess()
    try:
        backends = {
            "memory": lambda: remote(MemoryQueue(), MemoryMap(), args.rpc_latency_ms)[0],
            "local": lambda: remote(LocalQueue(server.address, server.token), MemoryMap(), args.rpc_latency_ms)[0],
        }
        results = {}
        for name, make in backends.items():
            for batch in (64, 240):
                try:
                    results[(name, batch)] = consume(make(), items, per_rep, reps, batch)
                except CellfeedError as exc:
                    fail(f"the {name} backend at batch {batch}: {exc}")
                if results[(name, batch)]["cells"] != reps * per_rep:
                    fail(
                        f"the {name} backend at batch {batch} consumed {results[(name, batch)]['cells']:,} of the "
                        f"{reps * per_rep:,} cells fed"
                    )
        trips = 30 if args.tiny else 300
        latency = {
            "memory": round_trip_us(MemoryQueue(), trips),
            "local": round_trip_us(LocalQueue(server.address, server.token), trips),
        }
        LocalMap(server.address, token=server.token).keys()
    finally:
        server.close()
    print(
        f"\n{reps} x {per_rep:,} cells of scGPT items (max_genes 1024, {len(items)} items, "
        f"{sum(map(len, items)) / per_rep:,.0f} B/cell); machine: {machine()}"
    )
    print(f"{'backend':<9}{'batch':>6}{'cells/s':>10}{'items/s':>9}{'x target':>9}{'waited s':>10}")
    for (name, batch), r in results.items():
        print(
            f"{name:<9}{batch:>6}{r['cells_per_s']:>10,.0f}{r['items_per_s']:>9,.0f}"
            f"{r['cells_per_s'] / TARGET:>9.2f}{r['wait_s']:>10.2f}"
        )
    print(
        f"queue round trip (put 1 + get 1, median): memory {latency['memory']:.0f} us, local {latency['local']:.0f} us"
    )
    figures = {
        f"consumer_cells_per_s_batch{b}{'' if n == 'memory' else '_' + n}": round(r["cells_per_s"])
        for (n, b), r in results.items()
    }
    figures.update(
        {
            "round_trip_us_memory": round(latency["memory"], 1),
            "round_trip_us_local": round(latency["local"], 1),
            "machine": machine(),
        }
    )
    print(json.dumps(figures))
    check_figures(figures)


if __name__ == "__main__":
    main()
