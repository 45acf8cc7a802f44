"""Faults, injected into a real local campaign (`cellfeed local`: a queue server, producer
processes, DDP ranks), by real signals, at seeded points of its progress, never of its seconds, and
only on the campaign's own processes: a producer fault fires as the campaign's n-th unit is taken,
on the producer that took it (`--trace-units` says so), so it always hits a producer holding a unit
however fast producers are; a pause fires once the ranks have logged its step. Then every epoch's
trained cells
(`--audit-cells`) are checked against the training set: lost, duplicated. The same campaign
runs once without faults, for the overhead (not in the tiny run: it has no overhead figure).

Fault kinds:
  kill      SIGKILL a producer (the campaign restarts it, as Modal retries a function)
  stall     SIGSTOP a producer 4 s past its lease (2 s tiny; its unit is re-issued), then SIGCONT: it wakes up
            holding a unit another producer already made, and sends its duplicate items
  pause     SIGSTOP every trainer rank for a while (the queue fills, producers block on
            backpressure and keep heartbeating), then SIGCONT; the pause is added to the wall
            time by construction (the tiny run pauses past the lease)

    python benchmarks/chaos.py            # 10 faults over a 20-epoch campaign
    python benchmarks/chaos.py --quick    # 6 faults over 12 epochs, within 3 minutes on 2 cores
    python benchmarks/chaos.py --tiny     # the tests': a kill, a stall, a pause past a 4 s lease; 2 x 400 cells

Ends with one JSON line of the figures. Exits 1 (one line on stderr) when a campaign did not finish
(or timed out), a planned fault was not injected, a cell was lost or duplicated, or a figure is
missing. In the tiny run the pause too lasts past the lease: producers held on backpressure must
keep heartbeating, so none of their units is issued again for the pause alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
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

from benchmarks._checks import check_figures, fail, machine  # noqa: E402
from cellfeed_testing.procs import children, own_rank_server  # noqa: E402
from coordination.driver import LEASE_S  # noqa: E402

KINDS = ("kill", "stall", "pause")
PRODUCERS, GPUS, BATCH = 3, 2, 16  # the campaign's


PRODUCER_FAULTS = ("kill", "stall")  # on the producer that takes the at-th unit; a pause: at a step
TOOK = ": took unit "  # a producer's `--trace-units` line: "producer-1: took unit 7 of epoch 0"


@dataclass
class Fault:
    share: float  # where it falls within the span of the campaign the faults are spread over (0-1)
    kind: str
    seconds: float = 0.0  # how long a stall or pause lasts (a stall outlasting the lease is the fault itself)
    at: int = 0  # on its clock, once known: a pause at this step; a kill or stall as the at-th unit is taken


@dataclass
class Outcome:
    returncode: int
    wall_s: float
    faults: list = field(default_factory=list)  # what was done: (at unit or step, kind, processes hit)
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False


def fault_plan(
    seed: int,
    n_faults: int,
    kinds=KINDS,
    pause_s: float = 4.0,
    lease_s: float = LEASE_S,
    past_lease_s: float = 4.0,
) -> list[Fault]:
    """Seeded faults spread evenly (jittered) over a span of the campaign: at least one of each
    kind, the rest kills; a stall lasts `past_lease_s` past the lease, a pause `pause_s`."""
    rng = random.Random(seed)
    chosen = list(kinds) + ["kill"] * max(0, n_faults - len(kinds))
    rng.shuffle(chosen)
    plan = []
    for i, kind in enumerate(chosen[:n_faults]):
        seconds = lease_s + past_lease_s if kind == "stall" else pause_s if kind == "pause" else 0.0
        plan.append(Fault((i + 1 + rng.uniform(-1 / 3, 1 / 3)) / (len(chosen) + 1), kind, seconds))
    return plan


def steps_logged(log: Path, offset: int, step: int) -> tuple[int, int]:
    """(offset, step) after reading the step log's complete lines from `offset`: the last step a
    rank logged (evaluation rows carry no loss)."""
    try:
        with log.open("rb") as f:
            if f.seek(0, os.SEEK_END) < offset:  # a new log (the campaign replaces an old one)
                offset, step = 0, 0
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset, step
    complete = data[: data.rfind(b"\n") + 1]
    for line in complete.splitlines():
        row = json.loads(line)
        if "loss" in row:
            step = max(step, row["step"])
    return offset + len(complete), step


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_campaign(
    dataset: str,
    workdir: Path,
    run: str,
    *,
    epochs: int,
    producers: int = PRODUCERS,
    gpus: int = GPUS,
    faults: list[Fault] = (),
    span: float = 0.4,
    span_steps: int = 0,
    extra: list[str] = (),
    timeout_s: float = 600.0,
) -> Outcome:
    """`cellfeed local` with `--audit-cells` and `--trace-units`, each fault applied at its event
    (`Fault.at`) to this campaign's own children: the faults spread over the first `span` of the
    campaign, its first `span_steps` training steps for a pause and that share of its units taken
    (known from its first line) for a kill or stall."""
    args = [
        sys.executable,
        "-m",
        "app.cli",
        "local",
        "--dataset",
        dataset,
        "--workdir",
        str(workdir),
        "--run",
        run,
        "--producers",
        str(producers),
        "--gpus",
        str(gpus),
        "--epochs",
        str(epochs),
        "--max-genes",
        "24",
        "--batch-size",
        str(BATCH),
        "--audit-cells",
        "--trace-units",
        "--quiet",
        *extra,
    ]
    start = time.monotonic()
    # its own rank server, below it, where a pause finds the ranks (not a shared one: trainer/launch.py)
    proc = subprocess.Popen(
        args, cwd=ROOT, env=own_rank_server(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    done: list = []
    threads: list[threading.Thread] = []
    lock = threading.Lock()

    def apply(fault: Fault, at: int, producer: str = "") -> None:
        if proc.poll() is not None:
            return
        with lock:  # one look at the campaign's processes at a time
            mine = children(proc.pid)
            if fault.kind == "pause":
                # the ranks: forked by the campaign's rank server (`python -m trainer.launch`)
                targets = [rank for pid, argv in mine if "trainer.launch" in argv for rank, _ in children(pid)]
            else:  # the producer that has just taken the unit (a killed one's zombie has no command line)
                targets = [pid for pid, argv in mine if "--produce" in argv and argv[-1] == producer][:1]
        if not targets:
            return
        if fault.kind == "kill":
            _signal(targets, signal.SIGKILL)
        else:
            _signal(targets, signal.SIGSTOP)
            time.sleep(fault.seconds)
            _signal(targets, signal.SIGCONT)
        with lock:
            done.append((at, fault.kind, len(targets)))

    def fire(fault: Fault, at: int, producer: str = "") -> None:  # a stall or pause runs on in its own thread
        threads.append(threading.Thread(target=apply, args=(fault, at, producer), daemon=True))
        threads[-1].start()

    out_lines: list[str] = []

    def read_stdout() -> None:  # the producers' "took unit" lines: each kill or stall at its unit
        pending, taken = [f for f in faults if f.kind in PRODUCER_FAULTS], 0
        for line in proc.stdout:
            out_lines.append(line)
            if "cells/epoch in " in line:  # the first line, printed before any producer starts
                units = epochs * units_per_epoch(line)
                for f in pending:
                    f.at = max(1, round(f.share * span * units))
                pending.sort(key=lambda f: f.at)
            elif TOOK in line:
                taken += 1
                while pending and taken >= pending[0].at:
                    fire(pending.pop(0), taken, line.split(TOOK)[0])

    def watch_steps() -> None:  # each pause once its step is logged
        log, offset, step = workdir / run / "steps.jsonl", 0, 0
        pending = [f for f in faults if f.kind not in PRODUCER_FAULTS]
        for f in pending:
            f.at = max(1, round(f.share * span_steps))
        pending.sort(key=lambda f: f.at)
        while pending and proc.poll() is None:
            offset, step = steps_logged(log, offset, step)
            while pending and step >= pending[0].at:
                fire(pending.pop(0), step)
            time.sleep(0.05)  # how often the step log is read

    err_lines: list[str] = []
    readers = [
        threading.Thread(target=read_stdout, daemon=True),
        threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True),
        threading.Thread(target=watch_steps, daemon=True),
    ]
    for t in readers:
        t.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        proc.wait()
    for t in readers + list(threads):
        t.join(timeout=60)
    return Outcome(proc.returncode, time.monotonic() - start, done, "".join(out_lines), "".join(err_lines), timed_out)


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
    return cells / units_per_epoch(stdout)


def units_per_epoch(first_line: str) -> int:
    return int(first_line.split("cells/epoch in ", 1)[1].split()[0].replace(",", ""))


def training_steps(run_dir: Path) -> int:
    """The steps the run trained (the faults' clock), from its step log."""
    return steps_logged(run_dir / "steps.jsonl", 0, 0)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="6 faults over a 12-epoch campaign (under 3 minutes)")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a kill, a stall and a pause past a 4 s lease over a 2-epoch campaign of 400 cells, "
        "without the calm run (the test suite's)",
    )
    parser.add_argument("--faults", type=int, default=None, help="faults to inject (default 10; 6 quick; 3 tiny)")
    parser.add_argument("--epochs", type=int, default=None, help="campaign epochs (default 20; 12 quick; 2 tiny)")
    parser.add_argument(
        "--cells", type=int, default=None, help="cells of the synthetic atlas (default 3,000; 400 tiny)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault plan")
    parser.add_argument(
        "--rpc-latency-ms",
        type=float,
        default=25.0,
        help="every queue/map call costs this many ms, as on Modal (default 25)",
    )
    parser.add_argument(
        "--lease-s",
        type=float,
        default=None,
        help=f"the campaign's --lease-s (default {LEASE_S:g}, the product's; tiny: 4): a stalled "
        "producer's unit is issued again after it",
    )
    parser.add_argument(
        "--pause-s",
        type=float,
        default=None,
        help="how long the trainer is paused (its wall time is added to the run's by construction; "
        "default 4; tiny: the lease + 2 s, past it)",
    )
    args = parser.parse_args()
    n_faults = args.faults or (3 if args.tiny else 6 if args.quick else 10)
    epochs = args.epochs or (2 if args.tiny else 12 if args.quick else 20)
    args.cells = args.cells or (400 if args.tiny else 3000)
    args.lease_s = args.lease_s or (4.0 if args.tiny else LEASE_S)
    past_lease_s = 2.0 if args.tiny else 4.0  # a stall's margin past the lease (the driver looks every 0.25 s)
    args.pause_s = args.pause_s if args.pause_s is not None else args.lease_s + past_lease_s if args.tiny else 4.0
    kinds = KINDS
    timeout_s = 180.0 if args.tiny else 600.0

    from producers.synth import SynthSpec, synthesize

    work = Path(tempfile.mkdtemp(prefix="cellfeed-chaos-"))
    dataset = str(work / "atlas")
    synthesize(
        dataset,
        SynthSpec(n_cells=args.cells, n_genes=2000, n_plates=4, seed=1),
        rows_per_fragment=40_000,
        progress=False,
    )
    expected = Counter(range(args.cells))

    settings = ["--rpc-latency-ms", str(args.rpc_latency_ms), "--lease-s", str(args.lease_s)]
    calm = None
    if args.tiny:  # no overhead figure: the faults land within the first 40% of the steps the plan gives
        steps = epochs * -(-args.cells // (GPUS * BATCH))
    else:
        calm = run_campaign(dataset, work, "calm", epochs=epochs, extra=settings, timeout_s=timeout_s)
        if calm.returncode != 0:
            print(calm.stderr[-2000:], file=sys.stderr)
            fail(f"the campaign without faults {'timed out' if calm.timed_out else 'failed'} (exit {calm.returncode})")
        steps = training_steps(work / "calm")  # the same campaign with faults trains as many steps
    span = 0.4 if args.tiny else 0.6  # the share of the campaign the faults land in
    plan = fault_plan(
        args.seed, n_faults, kinds=kinds, pause_s=args.pause_s, lease_s=args.lease_s, past_lease_s=past_lease_s
    )
    chaos = run_campaign(
        dataset,
        work,
        "chaos",
        epochs=epochs,
        faults=plan,
        span=span,
        span_steps=round(span * steps),
        extra=settings,
        timeout_s=timeout_s,
    )
    checked, lost, duplicated = lost_and_duplicated(trained_per_epoch(work / "chaos"), expected, epochs)
    restarts = sum(1 for line in chaos.stdout.splitlines() if "restarting it" in line)
    summary = work / "chaos" / "summary.rank0"
    facts = json.loads(summary.read_text()) if summary.exists() else {}
    reissued, released = facts.get("units_reissued"), facts.get("units_released")
    per_unit = cells_per_unit(chaos.stdout)
    # made again: units whose holder fell silent
    reproduced = round(reissued * per_unit) if reissued is not None and per_unit else None

    print(
        f"\ncampaign: {args.cells:,} cells x {epochs} epochs, {PRODUCERS} producers, {GPUS} ranks, "
        f"{args.rpc_latency_ms:.0f} ms a queue/map call, a {args.lease_s:g} s lease; machine: {machine()}"
    )
    print(f"{'at':>10}  fault (in the order they ended)")
    for at, kind, n in chaos.faults:
        what = {
            "kill": "SIGKILL a producer",
            "stall": f"SIGSTOP a producer for {args.lease_s + past_lease_s:.0f}s (past its lease)",
            "pause": f"SIGSTOP {n} trainer ranks for {args.pause_s:.0f}s",
        }[kind]
        print(f"{'step' if kind == 'pause' else 'unit'} {at:>5}  {what}")
    print(
        f"run finished: {'yes' if chaos.returncode == 0 else f'no (exit {chaos.returncode})'}; "
        f"producer restarts: {restarts}"
    )
    print(
        f"cells checked {checked:,} ({epochs} epochs): lost {lost}, duplicated {duplicated}; "
        f"{reissued} units issued again (~{reproduced if reproduced is None else f'{reproduced:,}'} cells produced "
        f"again; {released} given up at once by their producer's word or its restart, the others at their lease's end)"
    )
    overhead = round(chaos.wall_s / calm.wall_s, 3) if calm else None
    print(
        f"wall: {chaos.wall_s:.1f}s with faults" + (f", {calm.wall_s:.1f}s without ({overhead:.2f}x)" if calm else "")
    )
    if chaos.returncode != 0:
        print(chaos.stderr[-2000:])
    figures = {
        "faults_injected": len(chaos.faults),
        "fault_kinds": dict(Counter(k for _, k, _ in chaos.faults)),
        "cells_checked": checked,
        "cells_lost": lost,
        "cells_duplicated": duplicated,
        "completed": chaos.returncode == 0,
        "producer_restarts": restarts,
        "units_reissued": reissued,
        "units_released": released,
        "cells_reproduced": reproduced,
        "overhead_ratio": overhead,
        "wall_s": round(chaos.wall_s, 1),
        "calm_wall_s": round(calm.wall_s, 1) if calm else None,
        "lease_s": args.lease_s,
        "machine": machine(),
    }
    print(json.dumps(figures))
    if chaos.returncode != 0:
        fail(f"the campaign with faults {'timed out' if chaos.timed_out else 'failed'} (exit {chaos.returncode})")
    if len(chaos.faults) < len(plan):
        fail(
            f"{len(chaos.faults)} of the {len(plan)} planned faults were injected (the campaign ended before the "
            f"rest, or found no process to hit): {[f.kind for f in plan]} planned in the first {span:.0%} of it"
        )
    if lost or duplicated or checked != epochs * args.cells:
        fail(f"{lost:,} cells lost and {duplicated:,} duplicated over {epochs} epochs ({checked:,} checked)")
    if per_unit == 0.0:
        fail('the campaign\'s first line ("N cells/epoch in U units") is missing: no cells_reproduced')
    check_figures(figures, allow_none=("overhead_ratio", "calm_wall_s") if args.tiny else ())
    if args.tiny:  # (the test suite's: its atlas and runs are not kept; a failed run's are)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
