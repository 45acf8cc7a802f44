"""One producer process on local disk: cells/s, MB/s, per-stage times and compressed bytes per
cell for each tokenizer x max_genes and each sampling strategy, against a cost floor measured in
the same run (one Polars sort of the same rows by (cell, -value, gene)). Units are as large as on
a Tahoe-scale atlas (a b=16 f=256 unit is 16,384 cells). `benchmarks/object_store.py` measures
the same loop reading from S3.

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
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._checks import check_figures, fail  # noqa: E402
from coordination.arrays import CellRows, offsets_of  # noqa: E402
from coordination.latency import remote  # noqa: E402
from coordination.plan import Sampling  # noqa: E402
from coordination.queues import MemoryMap, MemoryQueue  # noqa: E402
from coordination.routing import TASKS_PARTITION, encode_task  # noqa: E402
from producers.config import ProducerConfig  # noqa: E402
from producers.dataset import open_dataset  # noqa: E402
from producers.gene_stats import compute_gene_medians, load_gene_medians, store_gene_stats  # noqa: E402
from producers.items import CHUNK_CELLS  # noqa: E402
from producers.producer import Producer  # noqa: E402
from producers.synth import cached_atlas  # noqa: E402
from producers.tokenizers import rank_order  # noqa: E402

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
) -> dict:
    """One producer's loop (read-ahead, tokenizing threads, courier) over a random sample of at
    least `min_units` units and `cell_budget` cells: steady throughput (without the wait for the
    first unit's rows, which a producer pays once: `fill_s`), stage times, per-unit read latency
    and the I/O Lance did (requests and bytes, from its own counters)."""
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
    )
    producer = Producer(config, queue, store, dataset=ds)
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
    start = time.perf_counter()
    producer.run(max_units=len(units))  # the loop a deployed producer runs, read-ahead included
    seconds = time.perf_counter() - start
    io = ds.expression.io_stats_incremental()
    stats = producer.stats
    if stats.cells != cells:
        fail(
            f"{sampling.strategy} producer ({tokenizer}, {max_genes} genes, {ds.uri}) made {stats.cells:,} of the "
            f"{cells:,} cells of its {len(units)} units"
        )
    rows = sum(plan.unit(u).n_rows for u in units)
    # ranking alone, on the same cells in the producer's chunks (outside the timed run): the
    # share of "tokenize" it takes
    rank_s = 0.0
    if tokenizer != "raw":
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
    args = parser.parse_args()
    n_cells = args.cells or (5_000 if args.tiny else 20_000 if args.quick else 200_000)
    budget = args.budget or (500 if args.tiny else 4_000 if args.quick else 40_000)
    path = args.dataset or cached_atlas(n_cells)
    ds = open_dataset(path)
    if load_gene_medians(ds) is None:
        store_gene_stats(ds, compute_gene_medians(ds, progress=False))
        ds = open_dataset(path)

    configs = [("scgpt", 1024, s) for s in STRATEGIES]
    configs += [
        (tok, mg, "block")
        for tok in ("scgpt", "geneformer", "raw")
        for mg in (1024, 2048)
        if (tok, mg) != ("scgpt", 1024)
    ]
    results = {}
    for tok, mg, strategy in configs:
        results[(tok, mg, strategy)] = run_config(ds, tok, mg, STRATEGIES[strategy], budget, args.rpc_latency_ms)
    seq_units = results[("scgpt", 1024, "sequential")]["units"]
    floor, floor_rows = floor_cells_per_s(ds, seq_units, STRATEGIES["sequential"])

    print(
        f"\natlas: {ds.n_cells:,} cells x {ds.n_genes:,} genes, {ds.n_rows / ds.n_cells:,.0f} non-zeros/cell; "
        f"machine: {platform.machine()}, {os.cpu_count()} cores; one producer, local disk"
    )
    print(
        "stage seconds per 1k cells -- wait: for rows the read-ahead had not read yet; rank/token/pack: "
        "summed over the tokenizing threads"
    )
    print(
        f"{'tokenizer':<11}{'genes':>6} {'strategy':<11}{'cells/s':>9}{'MB/s':>7}{'B/cell':>8}"
        f"{'wait':>7}{'rank':>7}{'token':>7}{'pack':>7}{'stitch':>7}"
    )
    for (tok, mg, strategy), r in results.items():
        per_k = 1000 / max(1, r["cells"])
        print(
            f"{tok:<11}{mg:>6} {strategy:<11}{r['cells_per_s']:>9,.0f}{r['mb_per_s']:>7.1f}"
            f"{r['bytes_per_cell']:>8,.0f}{r['read'] * per_k:>7.3f}{r['rank'] * per_k:>7.3f}"
            f"{r['tokenize'] * per_k:>7.3f}{r['pack'] * per_k:>7.3f}{r['stitch'] * per_k:>7.3f}"
        )
    seq = results[("scgpt", 1024, "sequential")]["cells_per_s"]
    print(f"\nfloor: one Polars sort of the same {floor_rows:,} rows by (cell, -value, gene): {floor:,.0f} cells/s")
    print(f"scgpt/1024/sequential pipeline = {seq / floor:.2f} x floor throughput (target >= 0.5)")
    for s in ("mixture", "block", "block16", "random"):
        r = results[("scgpt", 1024, s)]["cells_per_s"]
        print(f"scgpt/1024/{s:<10} = {r / seq:.2f} x sequential throughput")
    figures = {f"{tok}_{mg}_{s}_cells_per_s": round(r["cells_per_s"]) for (tok, mg, s), r in results.items()}
    figures.update(
        {
            "floor_cells_per_s": round(floor),
            "scgpt_1024_block_bytes_per_cell": round(results[("scgpt", 1024, "block")]["bytes_per_cell"]),
            "pipeline_over_floor": round(seq / floor, 3),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        }
    )
    print(json.dumps(figures))
    check_figures(figures)


if __name__ == "__main__":
    main()
