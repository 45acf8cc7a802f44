"""Elastic resume at Tahoe scale, simulated (as benchmarks/coordination.py does: the real plan,
summary, checkpoint and driver code on a 100M-cell geometry, no data): a campaign on N = 8 ranks
is killed halfway through an epoch and resumed on M = 4 (and on 16).

The checkpoint is what 8 ranks would have written: each rank trained its units (u mod 8) in the
order the driver issues them, the last ~4,096 cells (its mixing buffer) spread over the last
units it held, items of 128 cells. Measured, in a fresh process per resume:

- `resume_to_first_step_s`: from nothing to the driver issuing the epoch's first remaining unit
  on the new ranks: reading the checkpoint's progress files and the epoch's plan summary (JSON,
  as the trainer does), merging the ranks' progress, re-planning the cells left over M ranks,
  the units to skip, and the driver's start. (A producer's own start at 100M cells is
  `producer_start_s_100m` in benchmarks/coordination.py; the first step also waits for one unit.)
- `reproduced_per_trained`: cells produced again after the resume (the units not skipped hold
  cells already trained: their items are made again and dropped by key) per cell trained before
  the kill; goal <= 1.05 with the default units (64 batches of 240 cells).
- `rest_spread_cells`: the largest minus the smallest share of the rest among the M ranks.

    python benchmarks/elastic.py           # 100M cells, 8 -> 4 and 8 -> 16 ranks
    python benchmarks/elastic.py --quick   # 10M cells
    python benchmarks/elastic.py --tiny    # 200k cells (the test suite's)

Ends with one JSON line of the figures; exits 1 (one line on stderr) when a figure is missing or
the re-planned rest does not add up to the cells not trained.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._checks import check_figures, fail, peak_rss_mb, run_probe  # noqa: E402
from coordination.plan import Sampling  # noqa: E402

SAMPLING = Sampling("block", block_size=64, fetch_factor=64, batch_size=240)  # a campaign's default units
N_FROM = 8
CELLS_PER_ITEM, BUFFER_CELLS = 128, 4096


def write_checkpoint(n_cells: int, folder: Path, killed_at: float = 0.5) -> dict:
    """The plan summary of a `n_cells` geometry for 8 ranks, and the progress files 8 ranks would
    have written `killed_at` of the way through its epoch."""
    from benchmarks.coordination import tahoe_geometry
    from coordination.plan import EpochPlan
    from coordination.summary import PlanSummary
    from trainer.checkpoint import RankProgress

    plan = EpochPlan(tahoe_geometry(n_cells), SAMPLING, seed=0, epoch=0)
    summary = PlanSummary.of(plan, N_FROM)
    (folder / "summary.json").write_bytes(summary.to_bytes())
    counts = plan.unit_cell_counts
    trained_total = 0
    for r in range(N_FROM):
        progress = RankProgress(0, plan_id=summary.plan_id)
        target = int(killed_at * summary.cells_per_rank[r])
        done = 0
        units = np.arange(r, plan.n_units, N_FROM)
        for u in units.tolist():
            n = int(counts[u])
            items = -(-n // CELLS_PER_ITEM)
            progress.unit_items[u] = items
            if done + n <= target - BUFFER_CELLS:  # trained through
                progress.consumed.update((0, "unit", u, s) for s in range(items))
                progress.unit_trained[u] = n
                done += n
                continue
            # the units the buffer was mixing: about half of each one's cells trained, item by item
            share = min(n, max(0, target - done)) // 2
            for s in range(items):
                size = min(CELLS_PER_ITEM, n - s * CELLS_PER_ITEM)
                take = min(size, share - s * CELLS_PER_ITEM // 2) if share else 0
                if take <= 0:
                    break
                progress.partial[(0, "unit", u, s)] = set(range(take))  # stand-in cell ids: sizes are what count
            progress.unit_trained[u] = sum(len(v) for k, v in progress.partial.items() if k[2] == u)
            done += progress.unit_trained[u]
            if done >= target - BUFFER_CELLS // 2:
                break
        progress.trained = done
        progress.cells_hash = None  # the hash is not what this measures
        (folder / f"progress-rank{r}.json").write_text(progress.to_json())
        trained_total += done
    return {"units": plan.n_units, "trained_before": trained_total, "cells": n_cells}


def resume_probe(folder: Path, world: int) -> dict:
    """A resume on `world` ranks from the files in `folder`, in a fresh process: seconds to the
    driver's first issued unit, the rest per rank, the cells produced again."""
    code = f"""
import json, sys, time
sys.path.insert(0, {str(ROOT)!r})
t = time.perf_counter()
import numpy as np
from pathlib import Path
from benchmarks._checks import peak_rss_mb
from coordination.driver import Driver
from coordination.queues import MemoryMap, MemoryQueue
from coordination.routing import TASKS_PARTITION
from coordination.summary import PlanSummary, publish_summary
from trainer.checkpoint import RankProgress
folder = Path({str(folder)!r})
summary = PlanSummary.from_bytes((folder / "summary.json").read_bytes())
ranks = [RankProgress.from_json((folder / f"progress-rank{{r}}.json").read_text()) for r in range({N_FROM})]
merged = RankProgress.merged(ranks)
left = summary.cells_left_per_rank({world}, merged.unit_trained, merged.trained_stitched())
skip = summary.units_to_skip(merged.done_units(), merged.trained_stitched())
queue, store = MemoryQueue(), MemoryMap()
publish_summary(store, "probe", summary)
driver = Driver(queue, store, "probe", poll_s=0.01)
driver.start([0], resume_epoch=0, skip_units=skip)
while not queue.len(partition=TASKS_PARTITION):
    time.sleep(0.001)
seconds = time.perf_counter() - t
driver.stop()
counts = np.repeat([c for c, _ in summary.unit_cells], [n for _, n in summary.unit_cells])
redo = [u for u in range(summary.n_units) if u not in skip]
reproduced = int(sum(int(merged.unit_trained.get(u, 0)) for u in redo))
print(json.dumps({{"seconds": seconds, "left": left, "reproduced": reproduced,
                  "units_skipped": len(skip), "trained_before": merged.carried, "rss_mb": peak_rss_mb()}}))
"""
    return run_probe(code, f"the resume probe on {world} ranks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10M cells")
    parser.add_argument("--tiny", action="store_true", help="200k cells (the test suite's)")
    args = parser.parse_args()
    n_cells = 200_000 if args.tiny else 10_000_000 if args.quick else 100_000_000
    folder = Path(tempfile.mkdtemp(prefix="cellfeed-elastic-"))
    atexit.register(shutil.rmtree, folder, True)  # the checkpoint is this run's only
    t = time.perf_counter()
    made = write_checkpoint(n_cells, folder)
    setup_s = time.perf_counter() - t
    figures = {
        "cells": n_cells,
        "units": made["units"],
        "from_ranks": N_FROM,
        "trained_before": made["trained_before"],
        "checkpoint_written_s": round(setup_s, 1),
    }
    for world in (4, 16):
        r = resume_probe(folder, world)
        rest = n_cells - r["trained_before"]
        if sum(r["left"]) != rest:
            fail(f"the rest re-planned over {world} ranks is {sum(r['left']):,} cells, {rest:,} were not trained")
        figures[f"to_{world}"] = {
            "resume_to_first_step_s": round(r["seconds"], 2),
            "rss_mb": round(r["rss_mb"]),
            "reproduced_per_trained": round(r["reproduced"] / max(1, r["trained_before"]), 4),
            "cells_reproduced": r["reproduced"],
            "units_skipped": r["units_skipped"],
            "rest_spread_cells": int(max(r["left"]) - min(r["left"])),
            "rest_cells": rest,
        }
        print(
            f"{N_FROM} -> {world} ranks at {n_cells:,} cells ({made['units']:,} units): resumed to the first "
            f"issued unit in {r['seconds']:.2f} s ({r['rss_mb']:,.0f} MB RSS); {r['reproduced']:,} cells produced "
            f"again for {r['trained_before']:,} trained before the kill "
            f"({r['reproduced'] / max(1, r['trained_before']):.4f} per cell); the rest "
            f"{rest:,} cells, spread {max(r['left']) - min(r['left']):,} cells among ranks"
        )
    figures["peak_rss_mb_writer"] = round(peak_rss_mb())
    print(json.dumps(figures))
    check_figures(figures)


if __name__ == "__main__":
    main()
