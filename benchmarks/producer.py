"""One producer process on local disk: cells/s, cells per CPU-second, MB/s, per-stage times and
compressed bytes per cell for each tokenizer x max_genes and each sampling strategy, against a cost
floor measured in the same run (one Polars sort of the same rows by (cell, -value, gene)). Units
are as large as on a Tahoe-scale atlas (a b=16 f=256 unit is 16,384 cells).
`benchmarks/object_store.py` measures the same loop reading from S3.

The token stage runs two ways in the same run, on the same units: the compiled pass
(`producers/token_kernel.py`, what a producer runs) and the vectorised path it replaced (the
tokenizer with `kernel = False`: the code the commit before the kernel ran, moved to
`producers/ranking.py`). `speedup_*_block` is the kernel's
cells per CPU-second of the producer (all its threads) over the vectorised path's, each the best of
three interleaved rounds (one with --tiny). The kernel's
compile (a machine's first producer: an empty numba cache) and a fresh producer's first unit are
timed in child processes (--tiny: the first unit from a filled cache only, no compile), with the
fresh producer's peak memory. The process is set up as a deployed producer's (freed memory kept, the
set-up frozen out of the cyclic GC: `coordination/net.py`); `--as-before` leaves both out.

    python benchmarks/producer.py            # 200k-cell atlas, ~40k cells per configuration
    python benchmarks/producer.py --quick    # 20k-cell atlas, under a minute
    python benchmarks/producer.py --tiny     # 5k-cell atlas, 500 cells per configuration: seconds (tests)

Ends with one JSON line of the figures. Exits 1 (one line on stderr) when a producer made fewer
cells than its units hold or a figure is missing.
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

from benchmarks._checks import check_figures, fail, machine, peak_rss_mb  # noqa: E402
from coordination.arrays import CellRows, offsets_of  # noqa: E402
from coordination.latency import remote  # noqa: E402
from coordination.net import freeze_setup, keep_freed_memory  # noqa: E402
from coordination.plan import Sampling  # noqa: E402
from coordination.queues import MemoryMap, MemoryQueue  # noqa: E402
from coordination.routing import TASKS_PARTITION, encode_task  # noqa: E402
from producers.config import ProducerConfig  # noqa: E402
from producers.dataset import LOCAL_READ_THREADS, open_dataset  # noqa: E402
from producers.gene_stats import compute_gene_medians, load_gene_medians, store_gene_stats  # noqa: E402
from producers.items import CHUNK_CELLS  # noqa: E402
from producers.producer import Producer  # noqa: E402
from producers.ranking import rank_order  # noqa: E402
from producers.synth import cached_atlas  # noqa: E402

# units as large as on a Tahoe-scale atlas (min_units=1: a small benchmark atlas must not shrink them)
STRATEGIES = {
    "sequential": Sampling("sequential", unit_cells=1024, min_units=1),
    "mixture": Sampling("mixture", unit_cells=256, n_scanners=4, min_units=1),
    # Sampling's defaults: 64 blocks a unit (a campaign's batch of 240 makes its units 240 blocks)
    "block": Sampling("block", block_size=64, fetch_factor=64, batch_size=64, min_units=1),
    "block16": Sampling("block", block_size=16, fetch_factor=256, batch_size=64, min_units=1),  # scDataset's
    "random": Sampling("random", fetch_factor=16, batch_size=64, min_units=1),
}


def run_config(
    ds,
    tokenizer: str,
    max_genes: int,
    sampling: Sampling,
    cell_budget: int,
    latency_ms: float = 0.0,
    min_units: int = 1,
    balance=None,
    kernel: bool = True,
    reads_in_flight: int | None = None,
) -> dict:
    """One producer's loop (read-ahead, tokenizing threads, courier) over a random sample of at
    least `min_units` units and `cell_budget` cells: steady throughput (without the wait for the
    first unit's rows, which a producer pays once: `fill_s`), cells per CPU-second (the process's,
    all threads), stage times, per-unit read latency and the I/O Lance did (requests and bytes,
    from its own counters). `kernel`: the compiled token pass (False: the vectorised path)."""
    queue, store = remote(MemoryQueue(max_items=10**9, max_bytes=1 << 62), MemoryMap(), latency_ms)
    config = ProducerConfig(
        dataset=ds.uri,
        run="bench",
        tokenizer=tokenizer,
        max_genes=max_genes,
        sampling=sampling,
        world_size=1,
        cells_per_item=128,
        balance=balance,
        reads_in_flight=reads_in_flight,
    )
    producer = Producer(config, queue, store, dataset=ds)
    producer.tokenizer.kernel = kernel
    plan = producer.plan(0)
    units, cells = [], 0
    rng = np.random.default_rng(0)
    for u in rng.permutation(plan.n_units):  # a random sample of units (scanner units vary along storage)
        units.append(int(u))
        cells += int(plan.unit_cell_counts[u])
        if cells >= cell_budget and len(units) >= min_units:
            break
    queue.put_many([encode_task(0, u) for u in units], partition=TASKS_PARTITION)
    ds.expression.io_stats_incremental()  # reset Lance's counters
    start, cpu = time.perf_counter(), time.process_time()
    producer.run(max_units=len(units))  # the loop a deployed producer runs, read-ahead included
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    io = ds.expression.io_stats_incremental()
    stats = producer.stats
    if stats.cells != cells:
        fail(
            f"{sampling.strategy} producer ({tokenizer}, {max_genes} genes, {ds.uri}) made {stats.cells:,} of the "
            f"{cells:,} cells of its {len(units)} units"
        )
    rows = sum(plan.unit(u).n_rows for u in units)
    # the vectorised path's ranking alone, on the same cells in the producer's chunks (outside the
    # timed run): the share of "tokenize" it takes (the kernel ranks inside its one pass)
    rank_s = 0.0
    if tokenizer != "raw" and not kernel:
        for u in units[:4]:
            unit = plan.unit(u)
            block = ds.read_row_ranges(unit.parts[0].ranges)
            cell_ids, counts = np.unique(block.cell, return_counts=True)
            offsets = offsets_of(counts)
            for lo in range(0, len(cell_ids), CHUNK_CELLS):
                hi = min(lo + CHUNK_CELLS, len(cell_ids))
                rows_ = CellRows(
                    cell_ids[lo:hi],
                    offsets[lo : hi + 1] - offsets[lo],
                    block.gene[offsets[lo] : offsets[hi]],
                    block.value[offsets[lo] : offsets[hi]],
                )
                t = time.perf_counter()
                rank_order(rows_)
                rank_s += time.perf_counter() - t
        rank_s *= len(units) / min(4, len(units))
    fill_s = stats.unit_wait_s[0] if stats.unit_wait_s else 0.0  # the first unit's read: paid once per producer
    return {
        "cells": stats.cells,
        "seconds": seconds,
        "cells_per_s": stats.cells / max(1e-9, seconds - fill_s),
        "fill_s": fill_s,
        "cells_per_s_with_fill": stats.cells / seconds,
        "cells_per_cpu_s": stats.cells / max(1e-9, cpu_s),
        "mb_per_s": stats.bytes / seconds / 1e6,
        "bytes_per_cell": stats.bytes / max(1, stats.cells),
        "read": stats.seconds["read"],
        "rank": min(rank_s, stats.seconds["tokenize"]),
        "tokenize": stats.seconds["tokenize"] - min(rank_s, stats.seconds["tokenize"]),
        "pack": stats.seconds["pack"],
        "put": stats.seconds["put"],
        "stitch": stats.seconds["stitch"],
        "units": units,
        "rows": rows,
        "gets": io.read_iops,
        "bytes_read": io.read_bytes,
        "unit_read_s": list(stats.unit_read_s),
        "unit_wait_s": list(stats.unit_wait_s),
        # slice reads in flight where the producer's pacing left them (object storage; local disk: its pool)
        "reads_in_flight": ds.read_slots.limit if ds.read_slots is not None else LOCAL_READ_THREADS,
    }


def floor_cells_per_s(ds, units, plan_sampling) -> tuple[float, int]:
    """One Polars sort of the rows of the same units by (cell, -value, gene)."""
    import polars as pl

    producer = Producer(
        ProducerConfig(dataset=ds.uri, run="floor", sampling=plan_sampling), MemoryQueue(), MemoryMap(), dataset=ds
    )
    plan = producer.plan(0)
    blocks = [ds.read_row_ranges(plan.unit(u).parts[0].ranges) for u in units]
    frame = pl.DataFrame(
        {
            "cell": np.concatenate([b.cell for b in blocks]),
            "gene": np.concatenate([b.gene for b in blocks]),
            "value": np.concatenate([b.value for b in blocks]),
        }
    )
    n_cells = frame["cell"].n_unique()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        frame.sort(["cell", "value", "gene"], descending=[False, True, False])
        best = min(best, time.perf_counter() - t)
    return n_cells / best, len(frame)


def first_unit(path: str, as_before: bool = False) -> dict:
    """(a child process) A fresh producer's setup and first unit (scGPT-1024, block): what a new
    producer waits before its first items, the kernel's compile or cached load included; its process
    set up as a deployed producer's (`as_before`: malloc's defaults, nothing frozen)."""
    t0 = time.perf_counter()
    if not as_before:
        keep_freed_memory()  # (first, as app/fleet.py and app/modal_app.py do)
    ds = open_dataset(path)
    config = ProducerConfig(dataset=ds.uri, run="first", sampling=STRATEGIES["block"], world_size=1)
    queue = MemoryQueue(max_items=10**9, max_bytes=1 << 62)
    producer = Producer(config, queue, MemoryMap(), dataset=ds)
    queue.put_many([encode_task(0, 0)], partition=TASKS_PARTITION)
    if not as_before:
        freeze_setup()  # (part of a deployed producer's setup)
    t1 = time.perf_counter()
    producer.run(max_units=1)
    seconds = time.perf_counter() - t1
    return {"setup_s": t1 - t0, "first_unit_s": seconds, "cells": producer.stats.cells, "peak_rss_mb": peak_rss_mb()}


def first_units(path: str, cold: bool = True, as_before: bool = False) -> dict:
    """A fresh producer's first unit with an empty numba cache (a machine's first producer: the
    kernel compiles) and with the cache the first left (every later producer). `cold=False` (--tiny):
    the warm one only, from this checkout's own cache, which a first unit in this process fills if
    it lacks the pass (a compile is ~8 CPU-s, a tiny run's largest cost; the compile itself is
    tested: tests/test_token_kernel.py, the Modal tests whose setup compiles into an empty Volume)."""
    import subprocess
    import tempfile

    if not cold:
        first_unit(path, as_before)
    out = {"cold": None}
    with tempfile.TemporaryDirectory(prefix="cellfeed-numba-") as cache:
        for name in ("cold", "warm") if cold else ("warm",):  # the same cache: the cold run fills it
            env = {**os.environ, "NUMBA_CACHE_DIR": cache} if cold else dict(os.environ)
            run = subprocess.run(
                [sys.executable, __file__, "--first-unit", path, *(["--as-before"] if as_before else [])],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
            )
            if run.returncode != 0:
                print(run.stderr[-2000:], file=sys.stderr)
                fail(f"a fresh producer's first unit ({name} numba cache) failed (exit {run.returncode})")
            out[name] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="5k-cell atlas, 500 cells a configuration (tests)")
    parser.add_argument(
        "--rpc-latency-ms",
        type=float,
        default=0.0,
        help="every queue/map call costs this many ms (± 40%%), as a round trip to Modal (default: 0)",
    )
    parser.add_argument("--dataset", help="an existing dataset (default: synthesize one in a temp dir)")
    parser.add_argument(
        "--cells", type=int, default=None, help="atlas size (default 200,000; 20,000 quick; 5,000 tiny)"
    )
    parser.add_argument(
        "--budget", type=int, default=None, help="cells per configuration (default 40k; 4k quick; 500 tiny)"
    )
    parser.add_argument(
        "--as-before",
        action="store_true",
        help="malloc's defaults and the set-up left in the cyclic GC (a producer before keep_freed_memory and "
        "freeze_setup), for comparison",
    )
    parser.add_argument("--first-unit", metavar="DATASET", help=argparse.SUPPRESS)  # internal: child step
    args = parser.parse_args()
    if args.first_unit:
        print(json.dumps(first_unit(args.first_unit, args.as_before)))
        return
    n_cells = args.cells or (5_000 if args.tiny else 20_000 if args.quick else 200_000)
    budget = args.budget or (500 if args.tiny else 4_000 if args.quick else 40_000)
    path = args.dataset or cached_atlas(n_cells)
    ds = open_dataset(path)
    if load_gene_medians(ds) is None:
        store_gene_stats(ds, compute_gene_medians(ds, progress=False))
        ds = open_dataset(path)
    first = first_units(path, cold=not args.tiny, as_before=args.as_before)  # (child processes; cold: own cache)
    if not args.as_before:  # what a deployed producer does once set up (app/fleet.py, app/modal_app.py)
        keep_freed_memory()
        freeze_setup()

    # every strategy with the kernel; each tokenizer's block units both ways (kernel, vectorised)
    configs = [("scgpt", 1024, s, "kernel") for s in STRATEGIES]
    configs += [(tok, mg, "block", "kernel") for tok in ("scgpt", "geneformer", "raw") for mg in (1024, 2048)]
    configs = list(dict.fromkeys(configs))
    configs += [(tok, mg, "block", "vectorised") for tok in ("scgpt", "geneformer", "raw") for mg in (1024, 2048)]
    for tok, mg, strategy, how in configs:  # one unit each first: the kernel compiles (or loads) untimed
        if how == "kernel":
            run_config(ds, tok, mg, STRATEGIES[strategy], 1, args.rpc_latency_ms)
    # the block units both ways are compared: each runs 3 rounds, interleaved (kernel, vectorised,
    # kernel, ...), and keeps its best cells per CPU-second (this VM's timings move by tens of %)
    results = {}
    for round_ in range(1 if args.tiny else 3):
        for tok, mg, strategy, how in configs:
            if round_ and strategy != "block":
                continue
            r = run_config(ds, tok, mg, STRATEGIES[strategy], budget, args.rpc_latency_ms, kernel=how == "kernel")
            best = results.get((tok, mg, strategy, how))
            if best is None or r["cells_per_cpu_s"] > best["cells_per_cpu_s"]:
                results[(tok, mg, strategy, how)] = r
    seq_units = results[("scgpt", 1024, "sequential", "kernel")]["units"]
    floor, floor_rows = floor_cells_per_s(ds, seq_units, STRATEGIES["sequential"])
    report(ds, results, first, floor, floor_rows)


def report(ds, results: dict, first: dict, floor: float, floor_rows: int) -> None:
    print(
        f"\natlas: {ds.n_cells:,} cells x {ds.n_genes:,} genes, {ds.n_rows / ds.n_cells:,.0f} non-zeros/cell; "
        f"machine: {machine()}; one producer, local disk"
    )
    print(
        "stage seconds per 1k cells -- wait: for rows the read-ahead had not read yet; rank/token/pack: "
        "summed over the tokenizing threads (the kernel ranks inside its token pass)"
    )
    print(
        f"{'tokenizer':<11}{'genes':>6} {'strategy':<11}{'path':<11}{'cells/s':>9}{'/CPU-s':>8}{'MB/s':>7}"
        f"{'B/cell':>8}{'wait':>7}{'rank':>7}{'token':>7}{'pack':>7}"
    )
    for (tok, mg, strategy, how), r in results.items():
        per_k = 1000 / max(1, r["cells"])
        rank = "-" if how == "kernel" else f"{r['rank'] * per_k:.3f}"
        print(
            f"{tok:<11}{mg:>6} {strategy:<11}{how:<11}{r['cells_per_s']:>9,.0f}{r['cells_per_cpu_s']:>8,.0f}"
            f"{r['mb_per_s']:>7.1f}{r['bytes_per_cell']:>8,.0f}{r['read'] * per_k:>7.3f}{rank:>7}"
            f"{r['tokenize'] * per_k:>7.3f}{r['pack'] * per_k:>7.3f}"
        )
    seq = results[("scgpt", 1024, "sequential", "kernel")]["cells_per_s"]
    print(f"\nfloor: one Polars sort of the same {floor_rows:,} rows by (cell, -value, gene): {floor:,.0f} cells/s")
    print(f"scgpt/1024/sequential pipeline = {seq / floor:.2f} x floor throughput (target >= 0.5)")
    for s in ("mixture", "block", "block16", "random"):
        r = results[("scgpt", 1024, s, "kernel")]["cells_per_s"]
        print(f"scgpt/1024/{s:<10} = {r / seq:.2f} x sequential throughput")
    figures = {
        f"{tok}_{mg}_{s}_cells_per_s": round(r["cells_per_s"])
        for (tok, mg, s, how), r in results.items()
        if how == "kernel"
    }
    for tok, mg in (("scgpt", 1024), ("scgpt", 2048), ("geneformer", 1024), ("geneformer", 2048), ("raw", 1024)):
        new, old = results[(tok, mg, "block", "kernel")], results[(tok, mg, "block", "vectorised")]
        per_k_new, per_k_old = 1000 / new["cells"], 1000 / old["cells"]
        figures[f"{tok}_{mg}_block_cells_per_cpu_s"] = round(new["cells_per_cpu_s"])
        figures[f"{tok}_{mg}_block_cells_per_cpu_s_before"] = round(old["cells_per_cpu_s"])
        figures[f"{tok}_{mg}_block_token_rank_s_per_1k"] = round((new["tokenize"] + new["rank"]) * per_k_new, 4)
        figures[f"{tok}_{mg}_block_token_rank_s_per_1k_before"] = round((old["tokenize"] + old["rank"]) * per_k_old, 4)
        print(
            f"{tok}/{mg}/block, kernel over vectorised: {new['cells_per_cpu_s'] / old['cells_per_cpu_s']:.2f}x "
            f"cells per CPU-second; rank+token {figures[f'{tok}_{mg}_block_token_rank_s_per_1k']:.3f} s per 1k cells "
            f"(was {figures[f'{tok}_{mg}_block_token_rank_s_per_1k_before']:.3f})"
        )
    speedup = {
        tok: results[(tok, mg, "block", "kernel")]["cells_per_cpu_s"]
        / results[(tok, mg, "block", "vectorised")]["cells_per_cpu_s"]
        for tok, mg in (("scgpt", 1024), ("geneformer", 2048), ("raw", 1024))
    }
    steady = results[("scgpt", 1024, "block", "kernel")]
    cold = (
        f"{first['cold']['first_unit_s']:.2f} s with an empty numba cache (the kernel compiles), "
        if first["cold"]
        else ""
    )
    print(
        f"a fresh producer's first unit (scGPT-1024 block, {first['warm']['cells']:,} cells): {cold}"
        f"{first['warm']['first_unit_s']:.2f} s with it filled; a unit in steady state "
        f"{steady['seconds'] / len(steady['units']):.2f} s; the fresh producer's peak memory "
        f"{first['warm']['peak_rss_mb']:,.0f} MB"
    )
    figures.update(
        {
            "speedup_scgpt_block": round(speedup["scgpt"], 2),
            "speedup_geneformer_block": round(speedup["geneformer"], 2),
            "speedup_raw_block": round(speedup["raw"], 2),
            "first_unit_s_cold_cache": round(first["cold"]["first_unit_s"], 2) if first["cold"] else None,
            "first_unit_s_warm_cache": round(first["warm"]["first_unit_s"], 2),
            "first_unit_peak_rss_mb": round(first["warm"]["peak_rss_mb"]),
            "floor_cells_per_s": round(floor),
            "scgpt_1024_block_bytes_per_cell": round(results[("scgpt", 1024, "block", "kernel")]["bytes_per_cell"]),
            "pipeline_over_floor": round(seq / floor, 3),
            "machine": machine(),
        }
    )
    print(json.dumps(figures))
    check_figures(figures, allow_none=() if first["cold"] else ("first_unit_s_cold_cache",))


if __name__ == "__main__":
    main()
