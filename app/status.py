"""What a local campaign shows: the live status line (steps, loss, cells/s, queue depths, each
producer's state) and the summary at the end."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import deque
from pathlib import Path

from app.config import CampaignConfig
from coordination.routing import TASKS_PARTITION, producers_key, rank_partition
from coordination.summary import class_mix_line, epochs_at_quota


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def watch_line(run: str, where: str = "", report: str | None = None) -> str:
    """A run's first lines end with how to watch it from another terminal. `where`: the flags that
    find the run (`--workdir DIR`, `--modal`); `report`: how its report is made, where that differs."""
    where = f" {where}" if where else ""
    report = report or f"cellfeed report {run}{where}"
    return f"watch it from another terminal: cellfeed status {run}{where} | cellfeed stop {run}{where} | {report}"


IDLE_AFTER_S = 5.0  # a running producer with no unit finished for this long and no task queued is idle
ETA_STEPS = 20  # the ETA comes from the median of the last this many steps


class StepLog:
    """Rank 0's step log (`trainer.metrics.Tracker`), read as it grows: each `update` reads only the
    lines written since the last (a days-long campaign's log is not read whole every few seconds).
    Keeps the last steps (for the rate and the ETA), the current epoch's cells per step (a step
    trained again after a resume replaces its first try), and the epochs' audits, one per epoch. A
    resumed campaign appends to its run's log (locally the run folder's, on Modal the Volume's), so
    the audits are every epoch's, not only those of the last call."""

    def __init__(self, path: str | os.PathLike):
        self.path, self.offset = Path(path), 0
        self.recent: deque = deque(maxlen=ETA_STEPS)
        self.epoch, self.epoch_cells, self.audits = None, {}, []

    def update(self) -> "StepLog":
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            row = json.loads(line)
            if "audit" in row:  # (an epoch audited again, its checkpoint lost to a preemption: the last audit)
                self.audits = [a for a in self.audits if a["epoch"] != row["audit"]["epoch"]] + [row["audit"]]
            elif "loss" in row:
                self.recent.append(row)
                if row["epoch"] != self.epoch:
                    self.epoch, self.epoch_cells = row["epoch"], {}
                self.epoch_cells[row["step"]] = row["cells"]
        return self

    @property
    def last(self) -> dict | None:
        return self.recent[-1] if self.recent else None


def producer_states(
    reports: dict, names: list[str], codes: list[int | None], tasks: int, all_done: bool = False
) -> list[str]:
    """Each producer's state: starting, working (with its rate), idle (nothing left to take), done
    (exited) or failed. `reports`: the producers' totals as the driver publishes them; `codes`: each
    producer's exit code, None while it runs (or where only its reports are known, on Modal)."""
    states = []
    for name, code in zip(names, codes):
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


def snapshot(
    cfg: CampaignConfig,
    facts,
    queue,
    store,
    log: StepLog,
    started: float,
    names: list[str],
    codes: list[int | None],
    state: str = "running",
    resume: str = "",
) -> dict:
    """What a campaign is doing now, as one JSON-able dict: the live status line, `cellfeed status`
    and the journal (`app.journal`) are made of it. `facts`: the setup's `SetupFacts`; `started`:
    wall-clock start (time.time()); `codes`: each producer's exit code, None while it runs."""
    from trainer import checkpoint

    rows, row = list(log.update().recent), log.last
    tasks = queue.len(partition=TASKS_PARTITION)
    depth = [queue.len(partition=rank_partition(r)) for r in range(cfg.world_size)]
    reports = json.loads(store.get(producers_key(cfg.run)) or "{}")
    units = sum(r.get("units", 0) for r in reports.values())
    latest = checkpoint.latest_meta(cfg.run_checkpoint_dir)
    step_s = statistics.median(r["step_s"] for r in rows[-ETA_STEPS:]) if rows else None
    step = row["step"] if row else (latest.step if latest else 0)
    epoch_cells = sum(log.epoch_cells.values())  # the current epoch's cells trained
    return {
        "run": cfg.run,
        "state": state,
        "updated": time.time(),
        "started": started,
        "pid": os.getpid(),
        "epochs": facts.epochs,
        "cells_per_epoch": facts.cells_per_epoch,
        "epoch": row["epoch"] if row else (latest.epoch if latest else 0),
        "epoch_cells_trained": epoch_cells,
        "step": step,
        # a token budget's step count is an estimate, never below the steps taken; the ETA then goes by cells
        "total_steps": max(facts.total_steps, step) if facts.steps_estimated else facts.total_steps,
        "steps_estimated": facts.steps_estimated,
        "loss": row["loss"] if row else None,
        "cells_per_s": row["cells_per_s"] if row else None,
        "step_s": step_s,
        "wait_ms_ranks": row.get("wait_ms_ranks") if row else None,
        "ready_cells": row.get("ready_cells") if row else None,
        "eta_s": eta_s(facts, row, step, step_s, epoch_cells),
        "units_done": units,
        "units_total": facts.units_total,
        "queue": {"tasks": tasks, "ranks": depth},
        "producers": [
            {
                "name": n,
                "state": s,
                "cells": reports.get(n, {}).get("cells", 0),
                "busy_s": reports.get(n, {}).get("busy_s", 0),
            }
            for n, s in zip(names, producer_states(reports, names, codes, tasks, units >= facts.units_total))
        ],
        "checkpoint": {"step": latest.step, "epoch": latest.epoch, "folder": str(latest.folder)} if latest else None,
        "audits": log.audits,
        "classes": class_mix_line(facts, log.audits),
        "class_mix": [list(c) for c in facts.class_mix],
        "resume": resume,
    }


class CampaignScalars:
    """What only the campaign's monitor sees, in TensorBoard beside the trainer's scalars (the same
    folder: one run there), at the trainer's step: queue depths, and each producer's throughput
    since the last snapshot (cells it made per second of wall time, idle time included)."""

    def __init__(self, tb_dir: str | os.PathLike):
        import threading

        self.tb_dir, self.writer = str(tb_dir), None  # (made at the first `add`)
        self.before: dict[str, tuple[float, int]] = {}  # producer -> (when, cells) at the last snapshot
        # TensorBoard's import takes a while (seconds under load): begun now, beside the campaign's start
        threading.Thread(target=lambda: __import__("coordination.scalars"), daemon=True).start()

    def add(self, snap: dict) -> None:
        if self.writer is None:
            from coordination.scalars import ScalarWriter

            self.writer = ScalarWriter(self.tb_dir, filename_suffix=".campaign")
        step = snap["step"]
        self.writer.add_scalar("queue/tasks", snap["queue"]["tasks"], step)
        for r, depth in enumerate(snap["queue"]["ranks"]):
            self.writer.add_scalar(f"queue/rank{r}_items", depth, step)
        if snap["ready_cells"] is not None:
            self.writer.add_scalar("queue/cells_ready_in_ranks", snap["ready_cells"], step)
        for p in snap["producers"]:
            when, cells = self.before.get(p["name"], (None, 0))  # (the first snapshot is the baseline)
            if when is not None and snap["updated"] > when and p["cells"] >= cells:  # (a restart starts from 0)
                self.writer.add_scalar(
                    f"producers/{p['name']}_cells_per_s", (p["cells"] - cells) / (snap["updated"] - when), step
                )
            self.before[p["name"]] = (snap["updated"], p["cells"])
        self.writer.flush()

    def close(self) -> None:
        """Close the event file (a Modal Volume is committed only with no file open); a later `add`
        writes a new one beside it."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def eta_s(facts, row: dict | None, step: int, step_s: float | None, epoch_cells: int) -> float | None:
    """Seconds left: the steps left at the recent step time, or with a token budget (its steps an
    estimate) the cells left at the recent rate (`epoch_cells`: the current epoch's trained)."""
    if not step_s or row is None:
        return None
    if not facts.steps_estimated:
        return round(step_s * max(0, facts.total_steps - step), 1)
    left = facts.cells_per_epoch * (facts.epochs - row["epoch"]) - epoch_cells
    return round(max(0, left) / row["cells_per_s"], 1) if row["cells_per_s"] else None


def steps_of(snap: dict) -> str:
    """The campaign's step count as shown: `~N` where it is an estimate (a token budget's)."""
    return ("~" if snap.get("steps_estimated") else "") + f"{snap['total_steps']:,}"


def status_line(snap: dict) -> str:
    """The live line a local campaign prints every few seconds."""
    parts = [f"{snap['updated'] - snap['started']:5.0f}s"]
    if snap["loss"] is not None:
        wait = max(snap["wait_ms_ranks"] or [0])
        parts += [
            f"step {snap['step']}/{steps_of(snap)}",
            f"loss {snap['loss']:.3f}",
            f"{snap['cells_per_s']:,.0f} cells/s",
            f"wait {wait:.0f}ms",
        ]
    else:
        parts += ["ranks starting (torch, DDP, first batch)"]
    queue = snap["queue"]
    parts += [
        f"units {snap['units_done']:,}/{snap['units_total']:,} done, {queue['tasks']:,} queued",
        f"queue {' '.join(f'r{r}:{d}' for r, d in enumerate(queue['ranks']))} items"
        + (f", {snap['ready_cells']:,} cells ready in the ranks" if snap["ready_cells"] is not None else ""),
        "producers " + ", ".join(p["state"] for p in snap["producers"]),
    ]
    if snap.get("class_mix"):  # balanced: the classes planned, and the epochs audited at their quotas
        at_quota, audited = epochs_at_quota(snap["audits"])
        parts.append(f"{len(snap['class_mix'])} classes, {at_quota}/{audited} epochs at quota")
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
    if summary.get("classes"):
        print(summary["classes"])
    print(f"step log: {workdir}/steps.jsonl")
