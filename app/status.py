"""What a local campaign shows: the live status line (steps, loss, cells/s, queue depths, each
producer's state) and the summary at the end."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from app.config import CampaignConfig
from coordination.routing import TASKS_PARTITION, producers_key, rank_partition


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def last_step(log: Path) -> dict | None:
    if not log.exists():
        return None
    rows = [json.loads(line) for line in log.read_text().splitlines()[-20:] if line.strip()]
    rows = [r for r in rows if "loss" in r]
    return rows[-1] if rows else None


IDLE_AFTER_S = 5.0  # a running producer with no unit finished for this long and no task queued is idle


def producer_states(
    reports: dict, names: list[str], procs: list[subprocess.Popen], tasks: int, all_done: bool = False
) -> list[str]:
    """Each producer's state: starting, working (with its rate), idle (nothing left to take), done
    (exited) or failed. `reports`: the producers' totals as the driver publishes them."""
    states = []
    for name, proc in zip(names, procs):
        code = proc.poll()
        r = reports.get(name)
        if code is not None:
            states.append("done" if code == 0 else f"failed ({code})")
        elif r is None:
            states.append("starting")
        elif tasks == 0 and (all_done or time.time() - r["heard"] > IDLE_AFTER_S):
            states.append("idle")
        else:
            states.append(
                f"working {r['cells'] / max(1e-9, r['busy_s']):,.0f} cells/s" if r.get("busy_s") else "working"
            )
    return states


def status_line(
    cfg: CampaignConfig,
    queue,
    store,
    log: Path,
    started: float,
    total_steps: int,
    names: list[str],
    procs: list[subprocess.Popen],
    units_total: int,
) -> str:
    row = last_step(log)
    tasks = queue.len(partition=TASKS_PARTITION)
    depth = [queue.len(partition=rank_partition(r)) for r in range(cfg.gpus)]
    reports = json.loads(store.get(producers_key(cfg.run)) or "{}")
    units = sum(r.get("units", 0) for r in reports.values())
    parts = [f"{time.monotonic() - started:5.0f}s"]
    if row:
        parts += [
            f"step {row['step']}/{total_steps}",
            f"loss {row['loss']:.3f}",
            f"{row['cells_per_s']:,.0f} cells/s",
            f"wait {row['wait_ms']:.0f}ms",
        ]
    else:
        parts += ["ranks starting (torch, DDP, first batch)"]
    parts += [
        f"units {units:,}/{units_total:,} done, {tasks:,} queued",
        f"queue {' '.join(f'r{r}:{d}' for r, d in enumerate(depth))} items"
        + (f", {row['ready_cells']:,} cells ready in the ranks" if row and "ready_cells" in row else ""),
        "producers " + ", ".join(producer_states(reports, names, procs, tasks, units >= units_total)),
    ]
    return " | ".join(parts)


def print_summary(summary: dict, workdir: Path, objective: str = "bins") -> None:
    produced = sum(p.get("cells", 0) for p in summary["producers"])
    busy = sum(p.get("busy_s", 0) for p in summary["producers"])
    print(
        f"\nproducers: {produced:,} cells in {busy:.1f} busy seconds "
        f"({produced / max(busy, 1e-9):,.0f} cells/s per busy producer)"
    )
    if summary["steps"]:
        print(
            f"trainer: {summary['steps']} steps, loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
            f"{summary['cells_per_s']:,.0f} cells/s, median step {summary['median_step_s'] * 1000:.1f} ms, "
            f"median dataloader wait {summary['median_wait_ms']:.1f} ms"
        )
    for e in summary.get("eval", []):
        print(
            f"  held-out at step {e['step']}: masked-{objective[:-1]} accuracy {e['eval_accuracy']:.3f}, "
            f"loss {e['eval_loss']:.3f}"
        )
    audits = summary.get("audits", [])
    if audits:  # each epoch's own line was printed as it ended
        checked = [a for a in audits if a["audited"]]
        print(
            f"exactly-once audit: {len(checked)} of {plural(len(audits), 'complete epoch')} checked, "
            f"{sum(a['cells'] for a in checked):,} cells trained, {sum(a['missing'] for a in checked)} missing, "
            f"{sum(a['duplicated'] for a in checked)} duplicated"
        )
    print(f"step log: {workdir}/steps.jsonl")
