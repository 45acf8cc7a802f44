"""One producer reading from object storage as the product does: the same atlas on local disk, on
a real S3 server (SeaweedFS on 127.0.0.1) and on that server behind two proxies that give every
request a remote store's time to first byte (default 30 ± 10 ms: the same region; 100 ± 20 ms:
another region) and each connection a bandwidth cap. scGPT, 1,024 genes, units as large as on a
Tahoe-scale atlas; for each strategy: cells/s, its share of the local rate behind each proxy (JSON
`ratio_30ms`, `ratio_100ms`), GETs per 1,000 cells, bytes fetched per cell, read amplification
(bytes fetched / the rows' bytes as uint16 gene + uint16 value), p50/p99 time to read a unit's
rows and how long the loop then waited for them, the server's CPU per 1,000 cells (it shares this
machine's cores), and the producer's start-up time. Rates are steady rates: the wait for a
producer's first unit (shown as "fill") is paid once per producer and reported apart. Every
setting runs in each of 3 interleaved rounds (`--rounds`): a rate is the median of its rounds, a
ratio the median of each round's ratio (single runs of a few units varied by tens of % on this VM),
and `wait_share_*` says whether reads kept up: the loop's waits for rows over its steady time.

    python benchmarks/object_store.py            # 100k-cell atlas, >= 60k cells and 8 units per setting
    python benchmarks/object_store.py --quick    # >= 20k cells and 8 units per setting, ~4 minutes
    python benchmarks/object_store.py --tiny     # 3k-cell atlas, >= 500 cells and 1 unit per setting (tests:
                                                 # with one unit, a rate leaves out its read)

Ends with one JSON line of the figures. Exits 1 (one line on stderr) when a producer made fewer
cells than its units hold, the proxied store saw no request, or a figure is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._checks import check_figures, fail, machine  # noqa: E402
from benchmarks.producer import STRATEGIES, run_config  # noqa: E402
from cellfeed_testing.object_store import REGION, S3Proxy, SeaweedServer  # noqa: E402
from coordination.queues import MemoryMap, MemoryQueue  # noqa: E402
from producers.config import ProducerConfig  # noqa: E402
from producers.dataset import open_dataset  # noqa: E402
from producers.producer import Producer  # noqa: E402
from producers.storage import REMOTE_READS_START, ReadSlots, S3Settings  # noqa: E402
from producers.synth import cached_atlas  # noqa: E402

ROW_BYTES = 4  # a non-zero as the producer needs it: uint16 gene + uint16 value


def upload(server: SeaweedServer, folder: str, bucket: str, prefix: str) -> str:
    """Copy a dataset folder into the bucket, file by file (the bytes Lance wrote, unchanged), each
    in one PUT: SeaweedFS serves ranged GETs of multipart-uploaded objects at several times the CPU."""
    s3 = server.client()
    s3.create_bucket(Bucket=bucket)
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            with open(path, "rb") as body:
                s3.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(folder).as_posix()}", Body=body)
    return f"s3://{bucket}/{prefix}"


def _serve_proxy(upstream: str, options: dict, cpus: set[int] | None, conn) -> None:
    """(child process) The proxy, on its own CPUs: answers "counts" and stops on "stop"."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    with S3Proxy(upstream, **options) as proxy:
        conn.send(proxy.endpoint)
        while conn.recv() != "stop":
            conn.send((proxy.requests, proxy.bytes_down))


class ProxyProcess:
    """An `S3Proxy` in a process of its own, so its CPU is not the producer's."""

    def __init__(self, upstream: str, cpus: set[int] | None, **options):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_proxy, args=(upstream, options, cpus, child), daemon=True)
        self._proc.start()
        self.endpoint = self._conn.recv()

    @property
    def requests(self) -> int:
        self._conn.send("counts")
        return self._conn.recv()[0]

    def close(self) -> None:
        self._conn.send("stop")
        self._proc.join(timeout=10)


def start_up_s(uri: str, settings: S3Settings | None) -> float:
    """Open the dataset and build a producer (cell index, plan geometry, tokenizer): what a new
    producer pays before its first unit."""
    t = time.perf_counter()
    ds = open_dataset(uri, settings)
    producer = Producer(ProducerConfig(dataset=uri, run="startup"), MemoryQueue(), MemoryMap(), dataset=ds)
    producer.plan(0)
    return time.perf_counter() - t


def pooled(runs: list[dict]) -> dict:
    """One setting's rounds as one: the median rate and fill; counts summed; the per-unit read and
    wait times pooled, each run's first wait left out (its fill); `wait_share`: the loop's waits for
    rows over the steady time (0: the reads always kept ahead)."""
    out = {k: sum(r[k] for r in runs) for k in ("cells", "rows", "gets", "bytes_read", "server_cpu_s")}
    out["cells_per_s"] = float(np.median([r["cells_per_s"] for r in runs]))
    out["fill_s"] = float(np.median([r["fill_s"] for r in runs]))
    out["reads_in_flight"] = int(np.median([r["reads_in_flight"] for r in runs]))
    out["unit_read_s"] = [t for r in runs for t in r["unit_read_s"]]
    out["unit_wait_s"] = [t for r in runs for t in r["unit_wait_s"][1:]]
    out["wait_share"] = sum(out["unit_wait_s"]) / max(1e-9, sum(r["seconds"] - r["fill_s"] for r in runs))
    return out


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=">= 20k cells and 8 units per setting, 3 rounds")
    parser.add_argument(
        "--tiny", action="store_true", help="a 3k-cell atlas, >= 500 cells and 1 unit per setting (the test suite's)"
    )
    parser.add_argument("--cells", type=int, default=None, help="atlas size (default 100,000; 3,000 tiny)")
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help="cells per setting, at least 8 units (1 tiny); random a quarter of it, at ~2 GETs a cell "
        "(default 60,000; 20,000 quick; 500 tiny)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of every setting, interleaved; rates are their medians (default 3; 1 tiny)",
    )
    parser.add_argument("--latency-ms", type=float, default=30.0, help="proxy: time to first byte (default 30)")
    parser.add_argument("--jitter-ms", type=float, default=10.0, help="proxy: ± uniform jitter (default 10)")
    parser.add_argument(
        "--far-latency-ms", type=float, default=100.0, help="the second proxy: time to first byte (default 100)"
    )
    parser.add_argument("--far-jitter-ms", type=float, default=20.0, help="the second proxy: ± jitter (default 20)")
    parser.add_argument(
        "--bandwidth-mbps",
        type=float,
        default=800.0,
        help="proxy: per-connection cap in Mbit/s, about one S3 connection's (default 800)",
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated (default: all)")
    parser.add_argument(
        "--reads-in-flight",
        type=int,
        default=None,
        help="slice reads in flight per dataset on S3, fixed (default: paced by the producer, up to 256; "
        "64 was the fixed number before pacing)",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="let the producer, the server and the proxy share all cores (default: the producer "
        "on CPU 0, the server and the proxy on the others, as if the store were remote)",
    )
    args = parser.parse_args()
    n_cells = args.cells or (3_000 if args.tiny else 100_000)  # a b=16 f=256 unit is 16,384 cells: fewer give
    budget = args.budget or (500 if args.tiny else 20_000 if args.quick else 60_000)  # too few units
    # at least 8 units: a block16 unit is ~16k cells, and the units read during the first one's wait
    # (the fill, left out of a rate) made 3 of them look several times faster than a steady producer
    min_units = 1 if args.tiny else 8
    strategies = args.strategies.split(",")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")

    path = cached_atlas(n_cells)
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and len(cpus) >= 2
    store_cpus = set(cpus[1:]) if pin else None
    rounds = args.rounds or (1 if args.tiny else 3)
    fixed = args.reads_in_flight
    runs: dict[tuple[str, str], list[dict]] = {}  # (strategy, store) -> its run in each round
    with SeaweedServer(cpus=store_cpus) as server:
        t = time.perf_counter()
        uri = upload(server, path, "bench", "atlas")
        upload_s = time.perf_counter() - t
        near, far = f"s3_{args.latency_ms:.0f}ms", f"s3_{args.far_latency_ms:.0f}ms"
        proxies = {
            name: ProxyProcess(
                server.endpoint, store_cpus, latency_ms=lat, jitter_ms=jit, bandwidth_mbps=args.bandwidth_mbps
            )
            for name, lat, jit in (
                (near, args.latency_ms, args.jitter_ms),
                (far, args.far_latency_ms, args.far_jitter_ms),
            )
        }
        if pin:  # from here on (and every thread started from here) the producer runs on CPU 0
            os.sched_setaffinity(0, {cpus[0]})
        try:
            keys = dict(
                access_key_id=server.settings["AWS_ACCESS_KEY_ID"],
                secret_access_key=server.settings["AWS_SECRET_ACCESS_KEY"],
                region=REGION,
            )
            stores = {"local": (path, None), "s3": (uri, S3Settings(endpoint=server.endpoint, **keys))}
            stores.update({name: (uri, S3Settings(endpoint=p.endpoint, **keys)) for name, p in proxies.items()})
            opened = {name: open_dataset(u, settings) for name, (u, settings) in stores.items()}
            startup = {name: start_up_s(u, settings) for name, (u, settings) in stores.items()}
            run_config(opened["local"], "scgpt", 1024, STRATEGIES["block"], min(4000, budget))  # warm-up, not reported
            for _ in range(rounds):  # rounds interleaved: a slow minute of this VM's spreads over every setting
                for strategy in strategies:
                    for name, ds in opened.items():  # the stores back to back, per strategy
                        proxy = proxies.get(name)
                        requests_before, server_cpu = proxy.requests if proxy else 0, server.cpu_seconds()
                        cells = budget // 4 if strategy == "random" else budget  # (its reads: ~1,000x a block's)
                        sampling = STRATEGIES[strategy]
                        if ds.read_slots is not None:  # each run paced from scratch, as a new producer's reads
                            ds.read_slots = ReadSlots(REMOTE_READS_START)  # (not by the setting before it)
                        r = run_config(ds, "scgpt", 1024, sampling, cells, min_units=min_units, reads_in_flight=fixed)
                        r["http_requests"] = proxy.requests - requests_before if proxy else None
                        if proxy and not r["http_requests"]:
                            fail(f"{strategy} on the {name} store: no request reached its proxy")
                        r["server_cpu_s"] = server.cpu_seconds() - server_cpu
                        runs.setdefault((strategy, name), []).append(r)
        finally:
            for proxy in proxies.values():
                proxy.close()
    results = {key: pooled(rs) for key, rs in runs.items()}

    def ratio(strategy: str, store: str, base: str = "local") -> float:
        """The median over rounds of the store's rate over `base`'s in the same round."""
        pairs = zip(runs[(strategy, store)], runs[(strategy, base)])
        return float(np.median([r["cells_per_s"] / b["cells_per_s"] for r, b in pairs]))

    print(
        f"\natlas: {n_cells:,} cells, {opened['local'].n_rows / n_cells:,.0f} non-zeros/cell, "
        f"{len(opened['local'].fragments)} fragments; machine: {machine()}; "
        f"one producer, scgpt 1024; proxies {args.latency_ms:.0f} ± {args.jitter_ms:.0f} ms and "
        f"{args.far_latency_ms:.0f} ± {args.far_jitter_ms:.0f} ms, "
        f"{args.bandwidth_mbps:.0f} Mbit/s per connection; upload {upload_s:.1f}s"
    )
    print(
        f"{'strategy':<11}{'store':<9}{'cells/s':>9}{'x local':>8}{'x s3':>6}{'GET/1k':>8}{'B/cell':>8}"
        f"{'amplif':>7}{'read p50':>9}{'p99':>7}{'wait p50':>9}{'p99':>7}{'waited':>7}{'fill':>6}{'server':>8}"
        f"{'reads':>6}"
        f"   (cells/s: median of {rounds} round(s); x: median of each round's ratio; read/wait/fill: ms per unit; "
        "waited: share of the steady time; server: its CPU ms per 1k cells; reads: in flight, as paced)"
    )
    for (strategy, name), r in results.items():
        cells = max(1, r["cells"])
        over_s3 = f"{ratio(strategy, name, 's3'):.2f}" if name in proxies else ""  # only the proxied rows
        print(
            f"{strategy:<11}{name:<9}{r['cells_per_s']:>9,.0f}{ratio(strategy, name):>8.2f}"
            f"{over_s3:>6}"
            f"{r['gets'] / cells * 1000:>8.0f}{r['bytes_read'] / cells:>8,.0f}"
            f"{r['bytes_read'] / max(1, r['rows'] * ROW_BYTES):>7.2f}"
            f"{pct(r['unit_read_s'], 50) * 1e3:>9.0f}{pct(r['unit_read_s'], 99) * 1e3:>7.0f}"
            f"{pct(r['unit_wait_s'], 50) * 1e3:>9.0f}{pct(r['unit_wait_s'], 99) * 1e3:>7.0f}"
            f"{r['wait_share']:>7.2f}{r['fill_s'] * 1e3:>6.0f}{r['server_cpu_s'] / cells * 1e6:>8.0f}"
            f"{r['reads_in_flight']:>6}"
        )
    print("start-up (open + cell index + plan): " + ", ".join(f"{k} {v:.2f}s" for k, v in startup.items()))
    proxied = [r for (s, n), rs in runs.items() if n in proxies for r in rs]
    print(
        f"HTTP requests through the proxy: {sum(r['http_requests'] for r in proxied):,} "
        f"(Lance counted {sum(r['gets'] for r in proxied):,} reads)"
    )

    def rate(strategy: str, store: str) -> float:
        return results[(strategy, store)]["cells_per_s"]

    figures = {f"{n}_{s}_cells_per_s": round(r["cells_per_s"]) for (s, n), r in results.items()}
    for name in proxies:
        figures.update({f"{name}_over_local_{s}": round(ratio(s, name), 3) for s in strategies})
        figures.update({f"{name}_over_s3_{s}": round(ratio(s, name, "s3"), 3) for s in strategies})
    # each strategy behind each proxy as a share of its local rate (the goal: >= 0.9 at 100 ms)
    figures[f"ratio_{args.latency_ms:.0f}ms"] = {s: round(ratio(s, near), 3) for s in strategies}
    figures[f"ratio_{args.far_latency_ms:.0f}ms"] = {s: round(ratio(s, far), 3) for s in strategies}
    # do the reads keep up? the share of the steady time the loop waited for a unit's rows (0: never)
    for name in ("local", near, far):
        figures[f"wait_share_{name}"] = {s: round(results[(s, name)]["wait_share"], 3) for s in strategies}
    # the slice reads each producer kept in flight behind each proxy (paced: `Producer._pace_reads`)
    for name in (near, far):
        figures[f"reads_in_flight_{name}"] = {s: results[(s, name)]["reads_in_flight"] for s in strategies}
    figures["rounds"] = rounds
    figures.update(
        {
            f"server_cpu_ms_per_1k_cells_{s}": round(
                results[(s, "s3")]["server_cpu_s"] / max(1, results[(s, "s3")]["cells"]) * 1e6, 1
            )
            for s in strategies
        }
    )
    figures.update(
        {
            f"gets_per_1k_cells_{s}": round(results[(s, near)]["gets"] / max(1, results[(s, near)]["cells"]) * 1000, 1)
            for s in strategies
        }
    )
    figures.update(
        {
            f"read_amplification_{s}": round(
                results[(s, "local")]["bytes_read"] / max(1, results[(s, "local")]["rows"] * ROW_BYTES), 3
            )
            for s in strategies
        }
    )
    if "block" in strategies:  # (figures of strategies --strategies left out are not made up)
        figures.update(
            {
                "local_block_cells_per_s": round(rate("block", "local")),
                f"{near}_block_cells_per_s": round(rate("block", near)),
                f"{far}_block_cells_per_s": round(rate("block", far)),
            }
        )
    for s in ("block16", "block"):
        if s in strategies and "sequential" in strategies:
            figures[f"{s}_over_sequential_local"] = round(rate(s, "local") / rate("sequential", "local"), 3)
    figures.update(
        {
            "startup_s": {k: round(v, 2) for k, v in startup.items()},
            "latency_ms": [args.latency_ms, args.far_latency_ms],
            "machine": machine(),
        }
    )
    print(json.dumps(figures))
    check_figures(figures)


if __name__ == "__main__":
    main()
