"""Balanced sampling (`--balance-by COLUMN --balance-power ALPHA`, `coordination.balance`): exact class
quotas, batches that carry the mix, the producer's speed and the plan's cost at atlas scale.

On the synthetic atlas's `tissue` column (50 tissues of Zipf sizes, stored in runs of one tissue
each of at least 256 cells, as an atlas ordered by experiment stores its samples), for ALPHA in
{0, 0.5, 1}:

- `class_quota_error`: cells off the exact quota, summed over classes and epochs. The items the real
  producer makes for every unit of each epoch are decoded; their cells' classes are counted against
  quotas computed here, independently (count**(1 - ALPHA), largest remainder). Goal 0.
- `batch_share_sd_vs_binomial`: through the real pipeline (producer, queue, the consumer stream and
  its mixing buffer), the spread of each class's share across full batches against a binomial
  draw's, pooled over classes: sqrt(sum var_c / sum p_c (1 - p_c) / B). Goal <= 1.2.
- `throughput_vs_unbalanced`: the producer's cells/s balanced over unbalanced (its loop over every
  unit of 3 epochs, block sampling, scGPT 1024 genes, units of a campaign's size), the median of 9
  back-to-back pairs, which runs first alternating. Goal >= 0.9.
- `rank_share_max_dev`: over 4 ranks, the largest gap between a rank's share of a class and the
  epoch's (each rank's batches carry the same mix).

And `setup_s_100m_50_classes` (goal <= 30): in a fresh process, the plan of 100M cells in 50 Zipf
classes stored in runs (and, reported apart, scattered cell by cell) built from the class codes and
the row index (`Strata.build`, the epoch's plan and its
published summary for 8 ranks, audit hashes included), with its peak memory (`setup_peak_gib`, the
process; `setup_plan_gib`, above the inputs every plan of that dataset holds).

    python benchmarks/balance.py            # 100k cells, 3 epochs, 9 throughput pairs
    python benchmarks/balance.py --quick    # 20k cells (minutes)
    python benchmarks/balance.py --tiny     # 3k cells, ALPHA 1, a 1M-cell setup (the test suite's: seconds)

Also reported, not goals: the throughput ratio and batch spread on `cell_line` (50 lines
interleaved cell by cell in every plate: scattered classes, read region by region), and the
throughput with the small units a small atlas's default plan cuts. Ends with one JSON
line; exits 1 (one line on stderr) when a figure is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._checks import check_figures, fail, machine, run_probe  # noqa: E402
from benchmarks.downstream import pipeline_epoch  # noqa: E402
from coordination.balance import Balance  # noqa: E402
from coordination.plan import Sampling  # noqa: E402
from coordination.queues import MemoryMap, MemoryQueue  # noqa: E402
from coordination.routing import TASKS_PARTITION, encode_task, rank_partition  # noqa: E402
from coordination.wire import unpack_item  # noqa: E402
from producers.config import ProducerConfig  # noqa: E402
from producers.dataset import open_dataset  # noqa: E402
from producers.producer import Producer  # noqa: E402
from producers.synth import SynthSpec, cached_atlas, synthesize  # noqa: E402

ALPHAS = (0.0, 0.5, 1.0)
COLUMN, SCATTERED = "tissue", "cell_line"
BATCH, RANKS = 64, 4
# Units as a campaign cuts them: 64 batches' worth (4,096 cells here, 15,360 for batch 240). A small
# atlas's default plan cuts at least 64 units (every producer and rank gets work): 312 cells each on
# 20k cells, every one of which reads each class's share as ranges of its own (reported apart).
UNIT_MIN = 4

SETUP = """
import json, sys, time
sys.path.insert(0, {root!r})
import numpy as np
from benchmarks._checks import peak_rss_mb
from coordination.balance import Balance, Strata
from coordination.plan import DatasetGeometry, Sampling
from coordination.summary import PlanSummary
N = {n}
# the inputs: 50 Zipf classes in runs (400 samples) or scattered cell by cell, and a row index (3,000 rows a cell)
sizes = 1.0 / np.arange(1, 51)
if {scattered}:
    codes = np.random.default_rng(0).choice(50, size=N, p=sizes / sizes.sum()).astype(np.int32)
else:
    sizes = np.floor(sizes / sizes.sum() * N).astype(np.int64)
    sizes[0] += N - sizes.sum()
    run = max(1, N // 400)
    runs = [(t, min(run, n - a)) for t, n in enumerate(sizes.tolist()) for a in range(0, n, run)]
    order = np.random.default_rng(0).permutation(len(runs))
    codes = np.repeat(np.array([runs[i][0] for i in order], dtype=np.int32), [runs[i][1] for i in order])
geometry = DatasetGeometry("synthetic", np.arange(N + 1, dtype=np.int64) * 3000,
                           np.arange(0, N * 3000 + 1, 1 << 30, dtype=np.int64))
inputs_gib = peak_rss_mb() / 1024
t = time.perf_counter()
strata = Strata.build(Balance("tissue", {alpha}), [(None, codes, [f"t{{k:02d}}" for k in range(50)])], [0], [geometry])
plan = strata.plan(lambda e: np.array([N]), Sampling("block", batch_size=240), 0, 1)
summary = PlanSummary.of(plan, 8)
seconds = time.perf_counter() - t
assert sum(summary.cells_per_rank) == N and len(summary.cell_hash_per_rank) == 8
peak = peak_rss_mb() / 1024
assert strata.scattered.all() == {scattered}  # (each layout read the way it is meant to be)
print(json.dumps({{"seconds": seconds, "peak_gib": peak, "plan_gib": peak - inputs_gib, "units": plan.n_units}}))
"""


def expected_quotas(counts: np.ndarray, alpha: float, size: int) -> np.ndarray:
    """The exact quotas, computed here apart from the product's code: shares proportional to
    count**(1 - alpha), largest remainder, ties to the earlier class."""
    weights = counts.astype(np.float64) ** (1.0 - alpha)
    exact = weights / weights.sum() * size
    out = np.floor(exact).astype(np.int64)
    for i in sorted(range(len(out)), key=lambda i: (-(exact[i] - out[i]), i))[: size - int(out.sum())]:
        out[i] += 1
    return out


def produced_epochs(ds, balance: Balance, sampling: Sampling, epochs: int) -> list[list[Counter]]:
    """Per epoch, per rank: the multiset of cell ids of the items the producer makes for every unit."""
    queue, store = MemoryQueue(max_items=10**9, max_bytes=1 << 62), MemoryMap()
    config = ProducerConfig(
        dataset=ds.uri, run="balance", sampling=sampling, world_size=RANKS, max_genes=8, balance=balance
    )
    producer = Producer(config, queue, store, dataset=ds)
    out = []
    for epoch in range(epochs):
        for u in range(producer.plan(epoch).n_units):
            producer.process(epoch, u)
        ranks = []
        for r in range(RANKS):
            got = Counter()
            while items := queue.get_many(10_000, block=False, partition=rank_partition(r)):
                for data in items:
                    got.update(unpack_item(data).cell_ids.tolist())
            ranks.append(got)
        out.append(ranks)
    producer.stop()
    return out


def quota_figures(ds, classes: np.ndarray, names: list[str], alpha: float, epochs: int) -> dict:
    counts = np.bincount(classes, minlength=len(names))
    expected = expected_quotas(counts, alpha, ds.n_cells)
    error, deviation = 0, 0.0
    seen = np.zeros(ds.n_cells, dtype=np.int64)
    repeats_early = 0  # epochs after which some class had a cell seen twice more than another of its cells
    for ranks in produced_epochs(ds, Balance(COLUMN, alpha), Sampling("block", batch_size=BATCH), epochs):
        epoch = sum(ranks, Counter())
        got = np.bincount(classes[list(epoch.elements())], minlength=len(names))
        error += int(np.abs(got - expected).sum())
        share = expected / expected.sum()
        for rank in ranks:
            mine = np.bincount(classes[list(rank.elements())], minlength=len(names))
            deviation = max(deviation, float(np.abs(mine / max(1, mine.sum()) - share).max()))
        cells = np.fromiter(epoch.keys(), dtype=np.int64)
        seen[cells] += np.fromiter(epoch.values(), dtype=np.int64)
        # without replacement: within each class, the times its cells were seen differ by at most one
        for k in range(len(names)):
            mine = seen[classes == k]
            repeats_early += int(mine.max() - mine.min() > 1)
    return {
        "class_quota_error": error,
        "rank_share_max_dev": round(deviation, 4),
        "repeat_before_all_seen": repeats_early,
    }


def batch_sd_ratio(ds, classes: np.ndarray, names: list[str], alpha: float, column: str = COLUMN) -> tuple[float, int]:
    """Pooled sd of class shares across full batches of the real stream, over a binomial draw's."""
    counts = np.bincount(classes, minlength=len(names))
    share = expected_quotas(counts, alpha, ds.n_cells) / ds.n_cells
    shares = []
    balance = Balance(column, alpha)
    with pipeline_epoch(ds, Sampling("block", batch_size=BATCH), batch_size=BATCH, balance=balance) as (batches, _):
        for b in batches:
            if b.size == BATCH:
                shares.append(np.bincount(classes[b.cell_ids.numpy()], minlength=len(names)) / BATCH)
    shares = np.array(shares)
    binomial = (share * (1 - share) / BATCH).sum()
    return float(np.sqrt(shares.var(axis=0).sum() / binomial)), len(shares)


def loop_cells_per_s(ds, sampling: Sampling, balance, epochs: int) -> float:
    """One producer's loop (read-ahead, tokenizing threads: what a deployed producer runs) over every
    unit of `epochs` epochs, scGPT at 1024 genes: cells/s from its first unit's rows on (the wait for
    those is paid once per producer)."""
    queue = MemoryQueue(max_items=10**9, max_bytes=1 << 62)
    config = ProducerConfig(dataset=ds.uri, run="speed", sampling=sampling, max_genes=1024, balance=balance)
    producer = Producer(config, queue, MemoryMap(), dataset=ds)
    tasks = [encode_task(e, u) for e in range(epochs) for u in range(producer.plan(e).n_units)]
    queue.put_many(tasks, partition=TASKS_PARTITION)
    start = time.perf_counter()
    producer.run(max_units=len(tasks))
    seconds = time.perf_counter() - start - producer.stats.unit_wait_s[0]
    planned = sum(producer.plan(e).n_cells for e in range(epochs))
    if producer.stats.cells != planned:
        fail(f"the producer made {producer.stats.cells:,} of the {planned:,} cells of {epochs} epochs")
    return producer.stats.cells / seconds


def throughput_ratio(ds, column: str, alpha: float, epochs: int, repeats: int, min_units: int = UNIT_MIN) -> float:
    """Producer cells/s balanced over unbalanced: the median of back-to-back pairs. Units of a
    campaign's size (64 batches' worth, `fetch_factor` x batch) unless `min_units` asks for more."""
    sampling = Sampling("block", batch_size=BATCH, min_units=min_units)

    def pair(i: int) -> float:  # (which runs first alternates: neither gains from a warmer machine)
        first, second = (Balance(column, alpha), None) if i % 2 == 0 else (None, Balance(column, alpha))
        a, b = loop_cells_per_s(ds, sampling, first, epochs), loop_cells_per_s(ds, sampling, second, epochs)
        return a / b if i % 2 == 0 else b / a

    return float(np.median([pair(i) for i in range(repeats)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20k cells (minutes)")
    parser.add_argument("--tiny", action="store_true", help="3k cells, a 1M-cell setup: seconds (the test suite's)")
    parser.add_argument("--dataset", help="an atlas with the synthetic `tissue` column (default: one made and cached)")
    args = parser.parse_args()
    n_cells = 3_000 if args.tiny else 20_000 if args.quick else 100_000
    epochs = 2 if args.tiny else 3
    repeats = 1 if args.tiny else 9  # pairs: one loop varies by +-5% on 2 cores
    speed_epochs = 1 if args.tiny else 3 if args.quick else 2  # every unit of them: 4 (tiny), 15, 50 units
    setup_cells = 1_000_000 if args.tiny else 100_000_000
    if args.dataset:
        ds = open_dataset(args.dataset)
    elif args.tiny:
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="cellfeed-balance-")
        atexit.register(shutil.rmtree, folder, True)  # the tiny atlas is this run's only
        path = Path(folder) / "atlas"
        ds = synthesize(str(path), SynthSpec(n_cells=n_cells, n_genes=2000, seed=3), progress=False)
    else:
        ds = open_dataset(cached_atlas(n_cells))
    if COLUMN not in ds.obs_columns:
        fail(f"{ds.uri} has no obs column {COLUMN!r}: use an atlas from `cellfeed synth` (version 3 or later)")
    from producers.selection import label_codes

    classes, names = label_codes(ds, COLUMN)
    scattered, scattered_names = label_codes(ds, SCATTERED)
    print(
        f"{ds.uri}: {ds.n_cells:,} cells, {len(names)} classes of {COLUMN} "
        f"({np.bincount(classes).max():,} .. {np.bincount(classes).min():,} cells)",
        flush=True,
    )
    quota, share_sd, through, through_scattered, rank_dev, early, batches = {}, {}, {}, {}, {}, {}, {}
    through_small, share_sd_scattered = {}, {}
    for alpha in (1.0,) if args.tiny else ALPHAS:  # (tiny: the hardest alone, for the suite's time)
        key = f"{alpha:g}"
        t = time.perf_counter()
        q = quota_figures(ds, classes, names, alpha, epochs)
        quota[key], rank_dev[key], early[key] = (
            q["class_quota_error"],
            q["rank_share_max_dev"],
            q["repeat_before_all_seen"],
        )
        share_sd[key], batches[key] = batch_sd_ratio(ds, classes, names, alpha)
        share_sd_scattered[key] = batch_sd_ratio(ds, scattered, scattered_names, alpha, SCATTERED)[0]
        through[key] = throughput_ratio(ds, COLUMN, alpha, speed_epochs, repeats)
        through_scattered[key] = throughput_ratio(ds, SCATTERED, alpha, speed_epochs, 1)
        through_small[key] = throughput_ratio(ds, COLUMN, alpha, speed_epochs, 1, min_units=Sampling().min_units)
        print(
            f"ALPHA {key}: quota error {quota[key]} cells over {epochs} epochs, rank share dev {rank_dev[key]}, "
            f"batch share sd {share_sd[key]:.3f}x binomial ({batches[key]} batches of {BATCH}; "
            f"{SCATTERED}: {share_sd_scattered[key]:.3f}x), "
            f"throughput {through[key]:.2f}x unbalanced ({SCATTERED}: {through_scattered[key]:.2f}x; "
            f"{Sampling().min_units} small units: {through_small[key]:.2f}x) "
            f"[{time.perf_counter() - t:.0f}s]",
            flush=True,
        )
    setup = run_probe(SETUP.format(root=str(ROOT), n=setup_cells, alpha=1.0, scattered=False), "the setup")
    spread = run_probe(SETUP.format(root=str(ROOT), n=setup_cells, alpha=1.0, scattered=True), "the scattered setup")
    figures = {
        "machine": machine(),
        "cells": ds.n_cells,
        "classes": len(names),
        "epochs": epochs,
        "class_quota_error": quota,
        "repeat_before_all_seen": early,
        "rank_share_max_dev": rank_dev,
        "batch_share_sd_vs_binomial": {k: round(v, 3) for k, v in share_sd.items()},
        "throughput_vs_unbalanced": {k: round(v, 3) for k, v in through.items()},
        "throughput_vs_unbalanced_scattered_classes": {k: round(v, 3) for k, v in through_scattered.items()},
        "batch_share_sd_vs_binomial_scattered_classes": {k: round(v, 3) for k, v in share_sd_scattered.items()},
        "throughput_vs_unbalanced_small_units": {k: round(v, 3) for k, v in through_small.items()},
        "setup_cells": setup_cells,
        "setup_s": round(setup["seconds"], 2),
        "setup_peak_gib": round(setup["peak_gib"], 2),
        "setup_plan_gib": round(setup["plan_gib"], 2),
        "setup_s_scattered_classes": round(spread["seconds"], 2),
        "setup_plan_gib_scattered_classes": round(spread["plan_gib"], 2),
    }
    if setup_cells == 100_000_000:
        figures["setup_s_100m_50_classes"] = figures["setup_s"]
    print(
        f"setup of {setup_cells:,} cells in 50 classes: {setup['seconds']:.1f}s, peak {setup['peak_gib']:.2f} GiB "
        f"({setup['plan_gib']:.2f} GiB above its inputs), {setup['units']:,} units; scattered cell by cell: "
        f"{spread['seconds']:.1f}s, {spread['plan_gib']:.2f} GiB above its inputs"
    )
    check_figures(figures)
    print(json.dumps(figures))
    if any(quota.values()) or any(early.values()):
        fail(f"class quotas missed: {quota} cells off, {early} classes repeated a cell before all were seen")


if __name__ == "__main__":
    main()
