"""Local campaign throughput: cells/s reaching a no-op trainer (one consumer stream that only
iterates batches) with 1 and 2 producer processes, through the local queue server, plus the
queue depth over time as a PNG.

    python benchmarks/local_scaling.py            # a 200k-cell atlas, one epoch each
    python benchmarks/local_scaling.py --quick    # a 20k-cell atlas
    python benchmarks/local_scaling.py --tiny     # a 3k-cell atlas, the PNG in a temp dir (the test suite's)
    (the PNG goes to runs/bench/, git-ignored; --png benchmarks/local_scaling.png redraws the README's)

Ends with one JSON line of the figures. Draws the PNG with matplotlib, the `bench` extra (`pip
install -e ".[bench]"`): without it, one line says no PNG is drawn and the figures still come (an
explicit `--png` needs it, checked before any work; `--no-png` does without). Exits 1 (one line on
stderr) when the consumer got fewer cells than the epoch holds or a figure is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.campaign import prepare  # noqa: E402
from app.config import CampaignConfig  # noqa: E402
from app.fleet import start_producer, stop_campaign  # noqa: E402
from benchmarks._checks import BENCH_EXTRA, check_figures, fail, machine, png_path, require, script  # noqa: E402
from coordination.backends import BackendSpec, connect  # noqa: E402
from coordination.driver import Driver  # noqa: E402
from coordination.local_backend import ServerProcess  # noqa: E402
from coordination.routing import rank_partition  # noqa: E402
from producers.synth import cached_atlas  # noqa: E402
from trainer.stream import ConsumerStream  # noqa: E402


def run(dataset: str, n_producers: int, batch: int, latency_ms: float = 0.0) -> dict:
    cfg = CampaignConfig(
        dataset=dataset,
        run=f"scaling-{n_producers}",
        producers=n_producers,
        gpus=1,
        batch_size=batch,
        max_genes=1024,
        preset="tiny",
        rpc_latency_ms=latency_ms,
    ).validate()
    server = ServerProcess()
    queue, store = connect(BackendSpec("local", **server.where, latency_ms=latency_ms))
    procs, config_path = [], None
    depth: list[tuple[float, int]] = []
    try:
        facts = prepare(cfg, queue, store)
        config_path = Path(tempfile.mkdtemp(prefix="cellfeed-scaling-")) / "campaign.json"
        config_path.write_text(json.dumps(asdict(cfg)))
        procs = [start_producer(config_path, server.where, f"producer-{i}") for i in range(n_producers)]
        driver = Driver(queue, store, cfg.run, poll_s=0.1)
        driver.start([0])
        start = time.monotonic()
        done = threading.Event()

        def sample():
            q, _ = connect(BackendSpec("local", **server.where))
            while not done.is_set():
                depth.append((time.monotonic() - start, q.len(partition=rank_partition(0))))
                time.sleep(0.25)

        threading.Thread(target=sample, daemon=True).start()
        stream = ConsumerStream(
            queue, rank=0, world_size=1, run=cfg.run, batch_size=batch, pad_to=1025, no_data_timeout_s=300
        )
        cells, arrivals = 0, []
        for b in stream.epoch(0, [facts.cells_per_epoch]):  # the no-op trainer
            cells += b.size
            arrivals.append((time.monotonic(), cells))
        end = time.monotonic()
        done.set()
        stream.close()
        if cells != facts.cells_per_epoch:
            fail(
                f"{n_producers} producer(s): the consumer got {cells:,} of the epoch's {facts.cells_per_epoch:,} cells"
            )
        # steady state: the rate between 10% and 90% of the epoch delivered (start-up excluded)
        t10 = next(t for t, c in arrivals if c >= 0.1 * cells)
        t90 = next(t for t, c in arrivals if c >= 0.9 * cells)
        if t90 <= t10:
            fail(f"{n_producers} producer(s): no steady rate (10% and 90% of the epoch arrived at once)")
        return {
            "cells": cells,
            "cells_per_s": cells / (end - start),
            "steady_cells_per_s": 0.8 * cells / max(t90 - t10, 1e-9),
            "wait_s": stream.stats.wait_s,
            "seconds": end - start,
            "depth": depth,
        }
    finally:
        stop_campaign(store, cfg.run, procs, server)
        if config_path is not None:
            shutil.rmtree(config_path.parent, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a 3k-cell atlas, the PNG in a temp dir (the test suite's)")
    parser.add_argument(
        "--rpc-latency-ms",
        type=float,
        default=0.0,
        help="every queue/map call costs this many ms (± 40%%), as a round trip to Modal (default: 0)",
    )
    parser.add_argument(
        "--png",
        default=None,
        help="where to draw the queue depth (default runs/bench/local_scaling.png, git-ignored; --tiny: a temp dir)",
    )
    parser.add_argument("--no-png", action="store_true", help="no PNG (and no need for matplotlib)")
    args = parser.parse_args()
    if not args.no_png and args.png is None and importlib.util.find_spec("matplotlib") is None:
        # the README's set-up installs the `test` extra, not `bench`: the figures are the point, the PNG a bonus
        print(f"{script()}: no PNG: matplotlib is not installed ({BENCH_EXTRA} draws it)", file=sys.stderr)
        args.no_png = True
    if not args.no_png:
        require({"matplotlib": "the queue-depth PNG"}, hint=", or --no-png")
        args.png = png_path(args.png, "local_scaling", args.tiny)
    n_cells = 3_000 if args.tiny else 20_000 if args.quick else 200_000
    path = cached_atlas(n_cells)
    results = {n: run(path, n, batch=240, latency_ms=args.rpc_latency_ms) for n in (1, 2)}
    print(
        f"\nlocal campaign, {n_cells:,}-cell atlas, scGPT tokens (1024 genes), one no-op consumer rank, batch 240; "
        f"machine: {machine()}"
    )
    print("cells/s: whole epoch incl. start-up; steady: between 10% and 90% of the epoch delivered")
    print(f"{'producers':>9}{'cells/s':>10}{'steady':>10}{'seconds':>9}{'waited s':>10}{'max depth':>10}")
    for n, r in results.items():
        print(
            f"{n:>9}{r['cells_per_s']:>10,.0f}{r['steady_cells_per_s']:>10,.0f}{r['seconds']:>9.1f}"
            f"{r['wait_s']:>10.1f}{max((d for _, d in r['depth']), default=0):>10}"
        )
    if not args.no_png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for n, r in results.items():
            ax.plot([t for t, _ in r["depth"]], [d for _, d in r["depth"]], label=f"{n} producer{'s' * (n > 1)}")
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("items waiting in rank-0 partition")
        ax.set_title("local campaign: queue depth (no-op trainer)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"queue depth plot: {args.png}")
    figures = {
        "local_cells_per_s_1_producer": round(results[1]["cells_per_s"]),
        "local_cells_per_s_2_producers": round(results[2]["cells_per_s"]),
        "local_steady_cells_per_s_1_producer": round(results[1]["steady_cells_per_s"]),
        "local_steady_cells_per_s_2_producers": round(results[2]["steady_cells_per_s"]),
        "machine": machine(),
    }
    print(json.dumps(figures))
    check_figures(figures)


if __name__ == "__main__":
    main()
