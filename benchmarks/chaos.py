"""Faults, injected into a real local campaign (`cellfeed local`: a queue server, producer
processes, DDP ranks), by real signals, at seeded moments; then every epoch's trained cells
(`--audit-cells`) are checked against the training set: lost, duplicated. The same campaign
runs once without faults, for the overhead.

Fault kinds:
  kill      SIGKILL a producer (the campaign restarts it, as Modal retries a function)
  stall     SIGSTOP a producer past its lease (its unit is re-issued), then SIGCONT: it wakes up
            holding a unit another producer already made, and sends its duplicate items
  pause     SIGSTOP every trainer rank for a while (the queue fills, producers block on
            backpressure and keep heartbeating), then SIGCONT; the pause is added to the wall
            time by construction (tests/test_chaos.py pauses past the lease)

    python benchmarks/chaos.py            # 10 faults over a 20-epoch campaign
    python benchmarks/chaos.py --quick    # 6 faults over 12 epochs, within 3 minutes on 2 cores
    python benchmarks/chaos.py --tiny     # a kill and a pause over 3 epochs of 400 cells (the test suite's)

Ends with one JSON line of the figures. Exits 1 (one line on stderr) when a campaign did not finish
(or timed out), a planned fault was not injected, a cell was lost or duplicated, or a figure is
missing. The tiny run has no stall: a stall lasts 4 s past the lease (16 s in all) by construction.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._checks import check_figures, fail  # noqa: E402
from coordination.driver import LEASE_S  # noqa: E402

KINDS = ("kill", "stall", "pause")


@dataclass
class Fault:
    at_s: float  # seconds after training began
    kind: str
    seconds: float = 0.0  # how long a stall or pause lasts


@dataclass
class Outcome:
    returncode: int
    wall_s: float
    faults: list = field(default_factory=list)  # what was done: (at_s, kind, processes hit)
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False


def fault_plan(seed: int, n_faults: int, span_s: float, kinds=KINDS, pause_s: float = 4.0) -> list[Fault]:
    """Seeded faults spread over the first `span_s` seconds of training: at least one of each
    kind, the rest kills; a stall lasts past the lease (16 s), a pause `pause_s`."""
    rng = random.Random(seed)
    chosen = list(kinds) + ["kill"] * max(0, n_faults - len(kinds))
    rng.shuffle(chosen)
    gap = span_s / (len(chosen) + 1)
    plan = []
    for i, kind in enumerate(chosen[:n_faults]):
        seconds = LEASE_S + 4 if kind == "stall" else pause_s if kind == "pause" else 0.0
        plan.append(Fault(round(gap * (i + 1) + rng.uniform(-gap / 3, gap / 3), 2), kind, seconds))
    return sorted(plan, key=lambda f: f.at_s)


def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if int(p) != os.getpid()]


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_campaign(dataset: str, workdir: Path, run: str, *, epochs: int, producers: int = 3, gpus: int = 2,
                 faults: list[Fault] = (), extra: list[str] = (), timeout_s: float = 600.0,
                 seed: int = 0) -> Outcome:
    """`cellfeed local` with `--audit-cells`, the faults applied by a thread at their moments
    (counted from the first trained step)."""
    args = [sys.executable, "-m", "app.cli", "local", "--dataset", dataset, "--workdir", str(workdir), "--run", run,
            "--producers", str(producers), "--gpus", str(gpus), "--epochs", str(epochs), "--max-genes", "24",
            "--batch-size", "16", "--audit-cells", "--quiet", *extra]
    start = time.monotonic()
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done: list = []
    stopped: set[int] = set()
    rng = random.Random(seed)
    producer_of = rf"app\.local --produce {workdir}/{run}/.* --name producer-"
    ranks_of = rf"trainer\.train --config {workdir}/{run}/"

    lock = threading.Lock()

    def apply(fault: Fault, began: float) -> None:
        while proc.poll() is None and time.monotonic() - began < fault.at_s:
            time.sleep(0.05)
        if proc.poll() is not None:
            return
        with lock:  # one target at a time: a producer stalled by one fault is not picked by another
            if fault.kind == "pause":
                targets = _pids(ranks_of)
            else:
                found = [p for p in _pids(producer_of) if p not in stopped]
                targets = [rng.choice(found)] if found else []
            stopped.update(targets if fault.kind != "kill" else [])
        if not targets:
            return
        at = round(time.monotonic() - began, 1)
        if fault.kind == "kill":
            _signal(targets, signal.SIGKILL)
        else:
            _signal(targets, signal.SIGSTOP)
            time.sleep(fault.seconds)
            _signal(targets, signal.SIGCONT)
            stopped.difference_update(targets)
        with lock:
            done.append((at, fault.kind, len(targets)))

    def inject() -> None:  # each fault at its own moment, from the first trained step
        steps = workdir / run / "steps.jsonl"
        while proc.poll() is None and not (steps.exists() and steps.read_text().strip()):
            time.sleep(0.05)
        began = time.monotonic()
        threads = [threading.Thread(target=apply, args=(f, began), daemon=True) for f in faults]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        out, err = proc.communicate()
    injector.join(timeout=60)
    return Outcome(proc.returncode, time.monotonic() - start, done, out, err, timed_out)


def trained_per_epoch(run_dir: Path) -> dict[int, Counter]:
    """Per epoch, the multiset of cell ids the ranks trained on (the --audit-cells logs)."""
    epochs: dict[int, Counter] = {}
    for log in sorted(run_dir.glob("cells.rank*.jsonl")):
        for line in log.read_text().splitlines():
            row = json.loads(line)
            epochs.setdefault(row["epoch"], Counter()).update(row["cells"])
    return epochs


def lost_and_duplicated(trained: dict[int, Counter], expected: Counter, epochs: int) -> tuple[int, int, int]:
    """(cells checked, lost, duplicated) over the epochs, against the expected multiset each."""
    lost = duplicated = checked = 0
    for e in range(epochs):
        got = trained.get(e, Counter())
        checked += sum(expected.values())
        lost += sum((expected - got).values())
        duplicated += sum((got - expected).values())
    return checked, lost, duplicated


def cells_per_unit(stdout: str) -> float:
    """From the campaign's first line: "campaign R: N cells/epoch in U units, ..."."""
    words = stdout.split("cells/epoch in ", 1)
    if len(words) < 2:
        return 0.0
    cells = int(words[0].split()[-1].replace(",", ""))
    return cells / int(words[1].split()[0].replace(",", ""))


def training_s(run_dir: Path) -> float:
    """Seconds the run trained after its first step (the faults' clock): its later steps' times,
    waits included, from the step log."""
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    return sum(row["step_s"] for row in rows if "step_s" in row) - rows[0].get("step_s", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="6 faults over a 12-epoch campaign (under 3 minutes)")
    parser.add_argument("--tiny", action="store_true",
                        help="a kill and a pause over a 3-epoch campaign of 400 cells (the test suite's)")
    parser.add_argument("--faults", type=int, default=None, help="faults to inject (default 10; 6 quick; 2 tiny)")
    parser.add_argument("--epochs", type=int, default=None, help="campaign epochs (default 20; 12 quick; 3 tiny)")
    parser.add_argument("--cells", type=int, default=None, help="cells of the synthetic atlas (default 3,000; 400 tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault plan")
    parser.add_argument("--rpc-latency-ms", type=float, default=25.0,
                        help="every queue/map call costs this many ms, as on Modal (default 25): production then "
                             "spans the campaign, so faults land on producers mid-unit, not on idle ones")
    parser.add_argument("--pause-s", type=float, default=None,
                        help="how long the trainer is paused (its wall time is added to the run's by construction; "
                             "default 4; 1 tiny)")
    args = parser.parse_args()
    n_faults = args.faults or (2 if args.tiny else 6 if args.quick else 10)
    epochs = args.epochs or (3 if args.tiny else 12 if args.quick else 20)
    args.cells = args.cells or (400 if args.tiny else 3000)
    args.pause_s = args.pause_s if args.pause_s is not None else 1.0 if args.tiny else 4.0
    kinds = ("kill", "pause") if args.tiny else KINDS
    timeout_s = 180.0 if args.tiny else 600.0

    from producers.synth import SynthSpec, synthesize

    work = Path(tempfile.mkdtemp(prefix="cellfeed-chaos-"))
    dataset = str(work / "atlas")
    synthesize(dataset, SynthSpec(n_cells=args.cells, n_genes=2000, n_plates=4, seed=1), rows_per_fragment=40_000,
               progress=False)
    expected = Counter(range(args.cells))

    latency = ["--rpc-latency-ms", str(args.rpc_latency_ms)]
    calm = run_campaign(dataset, work, "calm", epochs=epochs, extra=latency, timeout_s=timeout_s)
    if calm.returncode != 0:
        print(calm.stderr[-2000:], file=sys.stderr)
        fail(f"the campaign without faults {'timed out' if calm.timed_out else 'failed'} (exit {calm.returncode})")
    # faults land within the first `span` s of training; the tiny campaign trains for a few seconds only, its
    # faults land within the first third of that (the run with faults may train faster than the calm one)
    span = 0.4 * training_s(work / "calm") if args.tiny else max(10.0, 0.6 * calm.wall_s)
    plan = fault_plan(args.seed, n_faults, span, kinds=kinds, pause_s=args.pause_s)
    chaos = run_campaign(dataset, work, "chaos", epochs=epochs, faults=plan, seed=args.seed, extra=latency,
                         timeout_s=timeout_s)
    checked, lost, duplicated = lost_and_duplicated(trained_per_epoch(work / "chaos"), expected, epochs)
    restarts = sum(1 for line in chaos.stdout.splitlines() if "restarting it" in line)
    summary = work / "chaos" / "summary.rank0"
    reissued = json.loads(summary.read_text()).get("units_reissued", 0) if summary.exists() else None
    per_unit = cells_per_unit(chaos.stdout)
    # made again: units whose holder fell silent
    reproduced = round(reissued * per_unit) if reissued is not None and per_unit else None

    print(f"\ncampaign: {args.cells:,} cells x {epochs} epochs, 3 producers, 2 ranks, {args.rpc_latency_ms:.0f} ms a "
          f"queue/map call; machine: {platform.machine()}, {os.cpu_count()} cores")
    print(f"{'at s':>6}  fault")
    for at, kind, n in sorted(chaos.faults):
        what = {"kill": "SIGKILL a producer", "stall": f"SIGSTOP a producer for {LEASE_S + 4:.0f}s (past its lease)",
                "pause": f"SIGSTOP {n} trainer ranks for {args.pause_s:.0f}s"}[kind]
        print(f"{at:>6.1f}  {what}")
    print(f"run finished: {'yes' if chaos.returncode == 0 else f'no (exit {chaos.returncode})'}; "
          f"producer restarts: {restarts}")
    print(f"cells checked {checked:,} ({epochs} epochs): lost {lost}, duplicated {duplicated}; "
          f"{reissued} units issued again (~{reproduced if reproduced is None else f'{reproduced:,}'} cells produced "
          "again)")
    print(f"wall: {chaos.wall_s:.1f}s with faults, {calm.wall_s:.1f}s without ({chaos.wall_s / calm.wall_s:.2f}x)")
    if chaos.returncode != 0:
        print(chaos.stderr[-2000:])
    figures = {"faults_injected": len(chaos.faults), "fault_kinds": dict(Counter(k for _, k, _ in chaos.faults)),
               "cells_checked": checked, "cells_lost": lost, "cells_duplicated": duplicated,
               "completed": chaos.returncode == 0, "producer_restarts": restarts,
               "units_reissued": reissued, "cells_reproduced": reproduced,
               "overhead_ratio": round(chaos.wall_s / calm.wall_s, 3), "wall_s": round(chaos.wall_s, 1),
               "calm_wall_s": round(calm.wall_s, 1), "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    print(json.dumps(figures))
    if chaos.returncode != 0:
        fail(f"the campaign with faults {'timed out' if chaos.timed_out else 'failed'} (exit {chaos.returncode})")
    if len(chaos.faults) < len(plan):
        fail(f"{len(chaos.faults)} of the {len(plan)} planned faults were injected (the campaign ended before the "
             f"rest, or found no process to hit): {[f.kind for f in plan]} planned over {span:.1f}s")
    if lost or duplicated or checked != epochs * args.cells:
        fail(f"{lost:,} cells lost and {duplicated:,} duplicated over {epochs} epochs ({checked:,} checked)")
    if per_unit == 0.0:
        fail("the campaign's first line (\"N cells/epoch in U units\") is missing: no cells_reproduced")
    check_figures(figures)


if __name__ == "__main__":
    main()
