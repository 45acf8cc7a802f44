"""Coordination at Modal's latency and Tahoe's scale, simulated in one process.

The real driver and the real producer loop (`Producer.run`: take, lease/heartbeat, done, stop)
coordinate through the in-memory queue and map behind the latency wrapper (25 ± 10 ms a call, as
Modal's Queue/Dict). Only the data work is simulated: a producer spends a unit's cells / rate
seconds (its compute) and puts real-size items (128 cells, 2 KiB a cell); 8 consumer ranks pop
them and count cells from item headers (no decompression). Plans are real: the block plan of a
100M-cell, 62,710-gene geometry with Tahoe-like fragments; each simulated epoch is a window of
its first units (a whole Tahoe epoch is ~100k units, ~25 minutes at 64k cells/s).

Reports: delivered cells/s against the producers' total capacity (efficiency), coordination calls
per 1,000 cells by kind (item puts/gets apart), the driver's CPU seconds per 1M cells, the same
three for 64 ranks (8 nodes x 8 GPUs: `*_64_ranks`), driver pass time, time from a producer's death to
its unit's re-issue, the gap between epochs, time to the first batch, and the setup and producer
start-up seconds / peak RSS at 100M cells (each in a fresh process).

    python benchmarks/coordination.py [--quick] [--producers 64] [--rate 1000] [--latency-ms 25]
    python benchmarks/coordination.py --tiny   # the test suite's (seconds): 4 producers, 2 x 16 units, a 3 s
                                               # lease, probes at 200k cells

Ends with one JSON line of the figures. Exits 1 (one line on stderr) when the simulation did not
deliver every cell (at once, before the later phases), the full-partition phase took none, or a
figure is missing (the re-issue after the death included: the tiny run lasts past the driver's
lease for it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._checks import check_figures, fail, run_probe  # noqa: E402
from coordination.driver import LEASE_S, Driver, heartbeat_interval  # noqa: E402
from coordination.latency import with_latency  # noqa: E402
from coordination.plan import DatasetGeometry, EpochPlan, Sampling  # noqa: E402
from coordination.queues import Empty, MemoryMap, MemoryQueue  # noqa: E402
from coordination.routing import TASKS_PARTITION, rank_partition, run_tag, unit_rank  # noqa: E402
from coordination.summary import PlanSummary, publish_summary  # noqa: E402
from coordination.wire import HEADER, MAGIC, VERSION  # noqa: E402
from producers.config import ProducerConfig  # noqa: E402
from producers.producer import Producer, ProducerStats  # noqa: E402

TAHOE_CELLS, TAHOE_GENES = 100_000_000, 62_710
ROWS_PER_FRAGMENT = 1 << 22
SAMPLING = Sampling("block", block_size=64, fetch_factor=16, batch_size=64)  # 1,024 cells a unit
WORLD = 8
CELLS_PER_ITEM, BYTES_PER_CELL = 128, 2048
RUN = "sim"


def tahoe_geometry(n_cells: int = TAHOE_CELLS, seed: int = 0) -> DatasetGeometry:
    """Row offsets of a Tahoe-like atlas (non-zeros per cell lognormal, median ~1,500), from arrays."""
    rng = np.random.default_rng(seed)
    starts = np.empty(n_cells + 1, dtype=np.int64)
    starts[0] = 0
    step = 10_000_000
    total = 0
    for a in range(0, n_cells, step):  # in chunks: no 100M-element temporary of float64
        counts = np.clip(rng.lognormal(np.log(1500), 0.5, size=min(step, n_cells - a)), 200, 8000).astype(np.int64)
        np.cumsum(counts, out=starts[a + 1 : a + 1 + len(counts)])
        starts[a + 1 : a + 1 + len(counts)] += total
        total = int(starts[a + len(counts)])
    fragments = np.append(np.arange(0, total, ROWS_PER_FRAGMENT, dtype=np.int64), total)
    return DatasetGeometry(f"tahoe-like-{n_cells}-{seed}", starts, fragments)


def fake_item(epoch: int, unit: int, seq: int, n_items: int, n_cells: int, payload: bytes) -> bytes:
    """A header the consumer would accept and a payload of a real item's size (not decoded here)."""
    body = payload[: n_cells * BYTES_PER_CELL]
    return (
        HEADER.pack(
            MAGIC, VERSION, 0, run_tag(RUN), epoch, unit, seq, n_items, n_cells, n_cells * 1025, 1, 1, len(body), 0
        )
        + body
    )


NO_CELLS = SimpleNamespace(ids=np.empty(0, np.uint32), values=np.empty(0, np.float32))


class SimulatedProducer(Producer):
    """The real producer loop; the data work is a sleep at `rate` cells/s and real-size items."""

    def __init__(self, queue, store, name: str, rate: float, plans: dict, payload: bytes, world: int = 0, **config):
        # reads are instant here, so one unit ahead is enough (the real producer sizes it from its reads)
        world = world or WORLD
        self.config = ProducerConfig(dataset="-", run=RUN, world_size=world, sampling=SAMPLING, read_ahead=1, **config)
        self.queue, self.store, self.name = queue, store, name
        self.rate, self.plans, self.payload = rate, plans, payload
        self.stats = ProducerStats()
        self.died = threading.Event()
        self._setup_loop()

    def plan(self, epoch):
        return self.plans[epoch]

    def read(self, epoch, unit):
        # (unit, cells per part, pieces): nothing is read; the loop sizes its read-ahead by the cells' bytes
        return None, [NO_CELLS], None

    def _pace_reads(self, unit, cells, pieces):  # nothing is read: no reads to pace
        pass

    def process(self, epoch, unit_id, rows=None):
        cells = int(self.plans[epoch].unit_cell_counts[unit_id])
        time.sleep(cells / self.rate)
        if self.died.is_set():  # killed mid-unit: never finishes, never reports again
            raise SystemExit
        n_items = -(-cells // CELLS_PER_ITEM)
        items = [
            fake_item(epoch, unit_id, s, n_items, min(CELLS_PER_ITEM, cells - s * CELLS_PER_ITEM), self.payload)
            for s in range(n_items)
        ]
        self.courier.post([(rank_partition(unit_rank(unit_id, self.config.world_size)), items)], (epoch, unit_id))
        self.stats.cells += cells
        self.stats.items += len(items)
        self.stats.bytes += sum(len(b) for b in items)
        self.stats.units += 1


def window_summary(plan: EpochPlan, n_units: int, world: int = 0) -> PlanSummary:
    """The summary of the epoch's first `n_units` units (the simulated window) for `world` ranks."""
    world = world or WORLD
    counts = plan.unit_cell_counts[:n_units]
    per_rank = np.bincount(np.arange(n_units) % world, weights=counts, minlength=world).astype(np.int64)
    return PlanSummary(plan.epoch, plan.plan_id, n_units, int(counts.sum()), world, per_rank.tolist())


def consume(queue, rank: int, summaries: dict, log: dict, stop: threading.Event) -> None:
    """Pop this rank's items, count cells per epoch from headers; record arrival times."""
    got = defaultdict(int)
    while not stop.is_set() and any(got[e] < s.cells_per_rank[rank] for e, s in summaries.items()):
        try:
            items = queue.get_many(64, block=True, timeout=1.0, partition=rank_partition(rank))
        except Empty:
            continue
        now = time.monotonic()
        for data in items:
            fields = HEADER.unpack_from(data)
            epoch, n_cells = fields[4], fields[8]
            if got[epoch] == 0:
                log["first"][epoch].append(now)
            got[epoch] += n_cells
            log["cells"].append((now, n_cells))
            if got[epoch] >= summaries[epoch].cells_per_rank[rank]:
                log["last"][epoch].append(now)


def simulate(
    *,
    producers: int,
    rate: float,
    units: int,
    epochs: int,
    latency_ms: float,
    jitter_ms: float,
    kill: bool,
    max_seconds: float,
    plans: dict,
    lease_s: float = LEASE_S,
    kill_after_s: float = 5.0,
    world: int = 0,
) -> dict:
    """One simulated campaign; `world` ranks (default WORLD) pop their partitions."""
    world = world or WORLD
    queue, store = MemoryQueue(), MemoryMap()
    kind = lambda p: ".tasks" if p == TASKS_PARTITION else ".items" if (p or "").startswith("rank-") else ""  # noqa: E731
    queue, store, counts = with_latency(queue, store, latency_ms, jitter_ms, partition_kind=kind)
    summaries = {e: window_summary(plans[e], units, world) for e in range(epochs)}
    for s in summaries.values():
        publish_summary(store, RUN, s)
    payload = os.urandom(CELLS_PER_ITEM * BYTES_PER_CELL)
    setup_calls = sum(counts.snapshot().values())
    log = {"first": defaultdict(list), "last": defaultdict(list), "cells": []}
    stop = threading.Event()
    started = time.monotonic()
    driver, driver_cpu = Driver(queue, store, RUN, lease_s=lease_s, world_size=world), []

    def drive():  # (`Driver.start`'s thread, with its CPU time measured: what one driver costs per cell)
        cpu = time.thread_time()
        driver.run_epochs(list(range(epochs)))
        driver_cpu.append(time.thread_time() - cpu)

    threading.Thread(target=drive, daemon=True, name="cellfeed-driver").start()
    sims = [
        SimulatedProducer(
            queue,
            store,
            f"p{i}",
            rate,
            plans,
            payload,
            world,
            idle_timeout_s=3600,
            heartbeat_s=heartbeat_interval(lease_s),
        )
        for i in range(producers)
    ]
    threads = [threading.Thread(target=p.run, daemon=True) for p in sims]
    consumers = [
        threading.Thread(target=consume, args=(queue, r, summaries, log, stop), daemon=True) for r in range(world)
    ]
    for t in threads + consumers:
        t.start()
    killed_at = None
    if kill:  # a producer dies mid-unit once the campaign is running
        time.sleep(min(kill_after_s, max_seconds / 4))
        killed_at = time.monotonic()
        sims[0].died.set()
    for t in consumers:
        t.join(timeout=max(0.0, max_seconds - (time.monotonic() - started)))
    elapsed = time.monotonic() - started
    stop.set()
    driver.stop()
    deadline = time.monotonic() + 10
    while not driver_cpu and time.monotonic() < deadline:  # (its thread ends within a pass)
        time.sleep(0.05)
    from coordination.routing import stop_key

    store.inner.put(stop_key(RUN), "stop")
    cells = sum(n for _, n in log["cells"])
    expected = sum(s.n_cells for s in summaries.values())
    t0 = min(t for t, _ in log["cells"]) if log["cells"] else started
    t1 = max(t for t, _ in log["cells"]) if log["cells"] else started
    # the producers' capacity over the delivery window, counting the killed one only while alive
    capacity = rate * (producers - (max(0.0, t1 - killed_at) / max(t1 - started, 1e-9) if killed_at else 0.0))
    calls = counts.snapshot()
    coordination = {k: v for k, v in calls.items() if not k.endswith(".items")}
    gaps = [
        min(log["first"][e + 1]) - max(log["last"][e])
        for e in range(epochs - 1)
        if log["first"].get(e + 1) and len(log["last"].get(e, [])) == sum(1 for c in summaries[e].cells_per_rank if c)
    ]
    return {
        "finished": cells >= expected,
        "cells": cells,
        "expected_cells": expected,
        "seconds": round(elapsed, 1),
        "delivered_cells_per_s": round(cells / max(t1 - started, 1e-9)),  # from the campaign's start
        "efficiency": round(cells / max(t1 - started, 1e-9) / capacity, 3),
        "first_batch_s": round(t0 - started, 2),
        "calls_per_1k_cells": round((sum(coordination.values()) - setup_calls) / max(cells, 1) * 1000, 2),
        "calls_by_kind_per_1k": {k: round(v / max(cells, 1) * 1000, 3) for k, v in sorted(calls.items())},
        "epoch_gap_s": round(max(0.0, max(gaps)), 2) if gaps else None,  # < 0: the epochs overlapped
        "epoch_overlap_s": round(-max(gaps), 2) if gaps and max(gaps) < 0 else 0.0,
        "driver_pass_s": driver.stats.pass_seconds() if hasattr(driver.stats, "pass_seconds") else None,
        "reissue_s": (
            round(driver.stats.first_reissue_at - killed_at, 1)
            if killed_at and getattr(driver.stats, "first_reissue_at", None)
            else None
        ),
        "reissued": driver.stats.reissued,
        "driver_cpu_s_per_1m_cells": round(driver_cpu[0] / max(cells, 1) * 1e6, 3) if driver_cpu else None,
        "world": world,
    }


def with_plane_client(modal_env: dict) -> None:
    """modal's client in this process from now on: `modal_env`'s MODAL_* settings replace this
    environment's, and the client modal made from the old ones (`Client.from_env` keeps one) is closed
    first, so the next call makes one from these."""
    import modal

    try:
        modal.Client.from_env().close()  # (made now if there was none: no request is sent)
    except modal.exception.AuthError:
        pass  # no token in the old settings: no client to close
    for name in [k for k in os.environ if k.startswith("MODAL_")]:
        del os.environ[name]
    os.environ.update(modal_env)


def full_partition_phase(
    *,
    seconds: float,
    latency_ms: float,
    jitter_ms: float,
    plans: dict,
    producers: int = 4,
    rate: float = 2000.0,
    speedup: float = 4.0,
    ranks: int = 2,
) -> dict:
    """Producers `speedup` x faster than the trainer, on a modal.Queue served by the local Modal
    control plane (cellfeed_testing/modal_control_plane) through modal's own client, in this process
    (a full partition is RESOURCE_EXHAUSTED, which a put with a timeout under ~2 s gets back at once:
    modal's client retries it with backoff until its timeout), at `latency_ms` a call: what producers
    upload, and how many calls they make, per cell the queue takes, counted by the plane. A producer
    that re-sends into a full partition without waiting shows up here."""
    import tempfile

    from cellfeed_testing.modal_control_plane import ControlPlane
    from cellfeed_testing.modal_control_plane.queue_stats import count_queue_requests, queue_stats
    from coordination.latency import with_latency
    from coordination.modal_backend import run_backends

    global WORLD
    world_before, WORLD = WORLD, ranks
    root = tempfile.mkdtemp(prefix="cellfeed-spin-")
    plane = ControlPlane(root).start()
    count_queue_requests(plane)
    saved_env = {k: v for k, v in os.environ.items() if k.startswith("MODAL_")}
    try:
        with_plane_client(plane.env)
        queue, store = run_backends("spin")
        kind = lambda p: ".items" if (p or "").startswith("rank-") else ""  # noqa: E731
        queue, store, counts = with_latency(queue, store, latency_ms, jitter_ms, partition_kind=kind)
        summary = window_summary(plans[0], plans[0].n_units)  # more units than the phase can use
        publish_summary(store, RUN, summary)
        payload = os.urandom(CELLS_PER_ITEM * BYTES_PER_CELL)
        driver = Driver(queue, store, RUN)
        driver.start([0])
        sims = [
            SimulatedProducer(queue, store, f"p{i}", rate, plans, payload, idle_timeout_s=3600)
            for i in range(producers)
        ]
        stop = threading.Event()
        consumed = [0]
        per_rank_rate = producers * rate / speedup / ranks

        def consumer(rank: int) -> None:  # the trainer: pops at a fixed pace, whatever is queued
            started = time.monotonic()
            while not stop.is_set():
                try:
                    items = queue.get_many(8, block=True, timeout=1.0, partition=rank_partition(rank))
                except Empty:
                    continue
                consumed[0] += sum(HEADER.unpack_from(d)[8] for d in items)
                ahead = consumed[0] / ranks / per_rank_rate - (time.monotonic() - started)
                if ahead > 0:
                    stop.wait(ahead)

        threads = [threading.Thread(target=p.run, daemon=True) for p in sims]
        threads += [threading.Thread(target=consumer, args=(r,), daemon=True) for r in range(ranks)]
        for t in threads:
            t.start()
        before = counts.snapshot()
        time.sleep(seconds)
        calls = {k: v - before.get(k, 0) for k, v in counts.snapshot().items()}
        stats = queue_stats(plane).get("rank-*", {})
        stop.set()
        driver.stop()
        for sim in sims:
            sim._stopping.set()
        for t in threads:
            t.join(timeout=10)
    finally:
        with_plane_client(saved_env)  # (modal's client in this process: the one it had before, if any)
        plane.stop()
        shutil.rmtree(root, ignore_errors=True)
        WORLD = world_before
    accepted_cells = stats.get("put_ok_items", 0) * CELLS_PER_ITEM
    producer_calls = calls.get("queue.put_many.items", 0) + calls.get("queue.len.items", 0)
    return {
        "seconds": seconds,
        "producers": producers,
        "producer_rate": rate,
        "trainer_rate": producers * rate / speedup,
        "consumed_cells": consumed[0],
        "accepted_cells": accepted_cells,
        "put_requests": stats.get("put_requests", 0),
        "puts_refused_full": stats.get("put_full", 0),
        "full_partition_bytes_sent_per_delivered": round(
            stats.get("put_bytes", 0) / max(1, stats.get("put_ok_bytes", 0)), 3
        ),
        "full_partition_calls_per_1k_cells": round(producer_calls / max(1, accepted_cells) * 1000, 2),
        "producer_item_calls": {k: v for k, v in calls.items() if k.endswith(".items") and "get" not in k},
    }


def startup_probe(what: str, n_cells: int, strategy: str = "block") -> dict:
    """Seconds and peak RSS of one start-up step at `n_cells` (the row index, then the epoch's
    plan: its summary for "setup", one unit for "producer"), in a fresh process."""
    code = f"""
import json, resource, sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from benchmarks._checks import peak_rss_mb
t = time.perf_counter()
from dataclasses import replace
from benchmarks.coordination import SAMPLING, WORLD, tahoe_geometry
from coordination.summary import PlanSummary
from coordination.plan import EpochPlan
geometry = tahoe_geometry({n_cells})
t_index = time.perf_counter() - t
plan = EpochPlan(geometry, replace(SAMPLING, strategy={strategy!r}, unit_cells=1024), seed=0, epoch=0)
if {what!r} == "setup":
    summary = PlanSummary.of(plan, WORLD)
    assert sum(summary.cells_per_rank) == {n_cells}
else:
    unit = plan.unit(plan.n_units // 2)
    assert unit.n_cells > 0
print(json.dumps({{"seconds": time.perf_counter() - t, "index_s": t_index, "n_units": plan.n_units,
                  "rss_mb": peak_rss_mb()}}))
"""
    return run_probe(code, f"the {what} start-up probe ({strategy}, {n_cells:,} cells)", timeout_s=600)


def driver_probe(n_cells: int) -> dict:
    """The driver through one whole epoch of the 100M-cell block plan (~98k units), in a fresh
    process that holds only the plan's summary (as trainer rank 0 does): instant stand-in
    producers take tasks and report them done in batches, so this measures the driver's own
    seconds, passes and peak RSS at Tahoe's unit count."""
    import tempfile

    root = str(Path(__file__).resolve().parents[1])
    folder = tempfile.TemporaryDirectory(prefix="cellfeed-driver-probe-")  # removed once the probe is done
    summary_path = Path(folder.name) / "summary.json"
    make = f"""
import sys
sys.path.insert(0, {root!r})
from benchmarks.coordination import SAMPLING, WORLD, tahoe_geometry
from coordination.plan import EpochPlan
from coordination.summary import PlanSummary
summary = PlanSummary.of(EpochPlan(tahoe_geometry({n_cells}), SAMPLING, 0, 0), WORLD)
open({str(summary_path)!r}, "wb").write(summary.to_bytes())
"""
    drive = f"""
import json, resource, sys, threading, time
sys.path.insert(0, {root!r})
from benchmarks._checks import peak_rss_mb
from coordination.driver import Driver
from coordination.summary import PlanSummary, publish_summary
from coordination.queues import Empty, MemoryMap, MemoryQueue
from coordination.routing import EVENTS_PARTITION, TASKS_PARTITION, decode_task, encode_event
summary = PlanSummary.from_bytes(open({str(summary_path)!r}, "rb").read())
queue, store = MemoryQueue(), MemoryMap()
publish_summary(store, "probe", summary)
driver = Driver(queue, store, "probe", poll_s=0.01)
stop = threading.Event()
def producers():
    while not stop.is_set():
        try:
            tasks = [decode_task(t) for t in queue.get_many(1000, timeout=0.1, partition=TASKS_PARTITION)]
        except Empty:
            continue
        queue.put_many([encode_event("p", done=tasks)], partition=EVENTS_PARTITION)
threading.Thread(target=producers, daemon=True).start()
t = time.perf_counter()
stats = driver.run_epochs([0])
stop.set()
print(json.dumps({{"seconds": time.perf_counter() - t, "units": summary.n_units, "passes": stats.passes,
                  "rss_mb": peak_rss_mb()}}))
"""
    with folder:
        run_probe(make, f"the driver probe ({n_cells:,} cells) making the plan's summary", timeout_s=600)
        return run_probe(drive, f"the driver probe ({n_cells:,} cells) running the driver", timeout_s=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run at the same latency (about two minutes)")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the smallest run that still sees a re-issue: 4 producers at 2,000 cells/s, 2 x 16 units, "
        "one dying at 2 s, a 3 s lease, 3 s of the full-partition phase, start-up probes at 200k "
        "cells, the producer's for block sampling only (the test suite's)",
    )
    parser.add_argument("--producers", type=int, default=64, help="simulated producers (default: 64)")
    parser.add_argument("--rate", type=float, default=1000.0, help="cells/s of one producer (default: 1000)")
    parser.add_argument("--units", type=int, default=2000, help="units per simulated epoch window (default: 2000)")
    parser.add_argument("--epochs", type=int, default=2, help="simulated epochs (default: 2)")
    parser.add_argument("--latency-ms", type=float, default=25.0, help="per-call latency (default: 25)")
    parser.add_argument("--jitter-ms", type=float, default=10.0, help="per-call jitter (default: 10)")
    parser.add_argument(
        "--lease-s",
        type=float,
        default=None,
        help=f"the driver's lease: a dead producer's unit is issued again after it (default {LEASE_S:g}, "
        "the product's; 3 tiny)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop the simulation after this long (default 600; 90 quick; 60 tiny)",
    )
    parser.add_argument(
        "--spin-seconds",
        type=float,
        default=60.0,
        help="length of the full-partition phase on the local Modal control plane (default: 60; --quick: 20)",
    )
    parser.add_argument(
        "--startup-cells",
        type=int,
        default=TAHOE_CELLS,
        help="cells of the geometry for the setup/start-up probes (default: 100M)",
    )
    args = parser.parse_args()
    if args.quick:  # a smaller simulation at the same latency; the start-up probes stay at 100M cells
        # 800 units: a unit takes its producer ~1 s, so a shorter window is mostly the first units' fill
        # (300 units gave efficiency 0.93 with the same protocol and 0.96 at the full size)
        args.producers, args.units = min(args.producers, 32), min(args.units, 800)
        args.max_seconds = args.max_seconds or 90.0
        args.spin_seconds = min(args.spin_seconds, 20.0)
    kill_after_s = 5.0  # the producers must still be busy when one dies; the run outlasts the lease after it
    if args.tiny:  # 4 s of the producers' work: one dies at 2 s
        args.producers, args.units = min(args.producers, 4), min(args.units, 16)
        args.lease_s = args.lease_s or 3.0
        args.rate, kill_after_s = 2000.0, 2.0
        args.max_seconds = args.max_seconds or 60.0
        args.spin_seconds = min(args.spin_seconds, 3.0)
        args.startup_cells = min(args.startup_cells, 200_000)
    args.max_seconds = args.max_seconds or 600.0
    args.lease_s = args.lease_s or LEASE_S
    t = time.perf_counter()
    geometry = tahoe_geometry(max(2_000_000, 2 * args.units * 1024))  # room for the simulated windows' units
    plans = {e: EpochPlan(geometry, replace(SAMPLING), seed=0, epoch=e) for e in range(args.epochs)}
    print(f"plans for the simulated windows built in {time.perf_counter() - t:.1f}s")
    campaign = dict(
        producers=args.producers,
        rate=args.rate,
        units=args.units,
        epochs=args.epochs,
        latency_ms=args.latency_ms,
        jitter_ms=args.jitter_ms,
        max_seconds=args.max_seconds,
        plans=plans,
        lease_s=args.lease_s,
    )

    def finished(run: dict) -> dict:  # the rest would measure nothing that matters for a run that did not do its work
        if not run["finished"]:
            fail(
                f"did not finish: the simulation delivered {run['cells']:,} of {run['expected_cells']:,} cells "
                f"in {run['seconds']}s ({run['world']} ranks)"
            )
        return run

    sim = finished(simulate(**campaign, kill=True, kill_after_s=kill_after_s))
    # past one node: the same campaign for 64 ranks (8 nodes x 8 GPUs), no death; one driver serves them all
    sim64 = finished(simulate(**campaign, kill=False, world=64))
    spin = full_partition_phase(
        seconds=args.spin_seconds, latency_ms=args.latency_ms, jitter_ms=args.jitter_ms, plans=plans
    )
    setup = startup_probe("setup", args.startup_cells)
    probed = ("block",) if args.tiny else ("block", "sequential", "mixture")  # (tiny: the same probe, once)
    starts = {s: startup_probe("producer", args.startup_cells, s) for s in probed}
    driven = driver_probe(args.startup_cells)
    start = {
        "seconds": max(r["seconds"] for r in starts.values()),  # the worst strategy, in each figure
        "rss_mb": max(r["rss_mb"] for r in starts.values()),
    }
    rows = [
        ("producers x rate", f"{args.producers} x {args.rate:,.0f} cells/s = {args.producers * args.rate:,.0f}"),
        ("latency per call", f"{args.latency_ms:.0f} ± {args.jitter_ms:.0f} ms"),
        ("window", f"{args.units:,} units x {args.epochs} epochs, {sim['expected_cells']:,} cells"),
        ("finished", f"{sim['finished']} ({sim['cells']:,} cells in {sim['seconds']}s)"),
        ("delivered cells/s", f"{sim['delivered_cells_per_s']:,}"),
        ("efficiency", f"{sim['efficiency']:.3f}"),
        ("coordination calls / 1k cells", f"{sim['calls_per_1k_cells']}"),
        ("time to first item", f"{sim['first_batch_s']} s"),
        (
            "epoch gap",
            f"{sim['epoch_gap_s']} s"
            + (
                f" (the next epoch's first items came {sim['epoch_overlap_s']} s before this one's last)"
                if sim["epoch_overlap_s"]
                else ""
            ),
        ),
        ("driver pass", f"{sim['driver_pass_s']} s"),
        ("re-issue after a death", f"{sim['reissue_s']} s ({sim['reissued']} re-issued; a {args.lease_s:g} s lease)"),
        (
            "driver CPU per 1M cells",
            f"{sim['driver_cpu_s_per_1m_cells']} s (8 ranks), {sim64['driver_cpu_s_per_1m_cells']} s (64)",
        ),
        (
            "64 ranks (8 nodes x 8 GPUs)",
            f"efficiency {sim64['efficiency']:.3f}, {sim64['calls_per_1k_cells']} calls / 1k cells, "
            f"{sim64['delivered_cells_per_s']:,} cells/s, first item {sim64['first_batch_s']} s",
        ),
        (f"setup at {args.startup_cells / 1e6:g}M cells", f"{setup['seconds']:.1f} s, {setup['rss_mb']:,.0f} MB RSS"),
        (
            f"driver, one epoch at {args.startup_cells / 1e6:g}M",
            f"{driven['units']:,} units in {driven['seconds']:.1f} s "
            f"({driven['passes']:,} passes), {driven['rss_mb']:,.0f} MB RSS",
        ),
        (
            "full partition: bytes sent / taken",
            f"{spin['full_partition_bytes_sent_per_delivered']} "
            f"({spin['put_requests']:,} puts, {spin['puts_refused_full']:,} refused full)",
        ),
        (
            "full partition: producer calls / 1k",
            f"{spin['full_partition_calls_per_1k_cells']} "
            f"(producers {spin['producers']} x {spin['producer_rate']:,.0f} cells/s, "
            f"trainer {spin['trainer_rate']:,.0f} cells/s, {spin['seconds']:.0f} s)",
        ),
    ] + [
        (
            f"producer start at {args.startup_cells / 1e6:g}M, {s}",
            f"{r['seconds']:.1f} s, {r['rss_mb']:,.0f} MB RSS, {r['n_units']:,} units",
        )
        for s, r in starts.items()
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("calls per 1,000 cells by kind:")
    for k, v in sim["calls_by_kind_per_1k"].items():
        print(f"  {k:<24} {v}")
    figures = {
        **sim,
        "efficiency_64_ranks": sim64["efficiency"],
        "calls_per_1k_cells_64_ranks": sim64["calls_per_1k_cells"],
        "driver_cpu_s_per_1m_cells_64_ranks": sim64["driver_cpu_s_per_1m_cells"],
        "ranks_64": {k: v for k, v in sim64.items() if k not in ("calls_by_kind_per_1k", "reissue_s")},  # (no death)
        "full_partition": spin,
        "full_partition_bytes_sent_per_delivered": spin["full_partition_bytes_sent_per_delivered"],
        "full_partition_calls_per_1k_cells": spin["full_partition_calls_per_1k_cells"],
        "producer_start_s_100m": round(start["seconds"], 2),
        "producer_start_rss_mb_100m": round(start["rss_mb"]),
        "setup_s_100m": round(setup["seconds"], 2),
        "driver_epoch_s_100m": round(driven["seconds"], 2),
        "driver_rss_mb_100m": round(driven["rss_mb"]),
        "producer_start_100m_by_strategy": {
            s: {"seconds": round(r["seconds"], 2), "rss_mb": round(r["rss_mb"])} for s, r in starts.items()
        },
        "setup_rss_mb_100m": round(setup["rss_mb"]),
        "startup_cells": args.startup_cells,
        "latency_ms": args.latency_ms,
        "jitter_ms": args.jitter_ms,
        "producers": args.producers,
        "rate": args.rate,
        "lease_s": args.lease_s,
    }
    print(json.dumps(figures))
    if spin["accepted_cells"] == 0:  # a benchmark that did not do its work fails
        fail("did not finish: the full-partition phase took no cells")
    check_figures(figures, allow_none=("epoch_gap_s",) if args.epochs == 1 else ())  # (one epoch: no gap)


if __name__ == "__main__":
    main()
