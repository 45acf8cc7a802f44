"""Modal's own faults, injected into a whole campaign on the Modal emulator (`modal run
app/modal_app.py` against cellfeed_testing/modal_emulator: setup, train with its ranks, spawned
producers): transport bursts that outlast Modal's own retries, lost replies of queue gets (the
server gave the items out; Modal's client retried past it, or the error reached the caller), and
preemptions of `train` and of a producer (SIGINT to every process of the container, a grace
period, the same input again). Every fault fires on an event: a network fault at the n-th
matching call (seeded), a preemption once the trainer has logged its step (seeded). Then every
epoch's trained cells (`--audit-cells`, on the emulated Volume; a preempted call's steps past the
checkpoint its successor resumed from are set aside: they were trained again) are checked against
the atlas, and the run's queue and dicts are watched for a deletion before the campaign's end.
The same campaign runs once without faults, for the overhead.

    python benchmarks/modal_chaos.py           # 10 faults over 4 epochs of 40,000 cells
    python benchmarks/modal_chaos.py --quick   # 10 faults over 3 epochs of 20,000 cells: about 3 minutes on 2 cores
    python benchmarks/modal_chaos.py --tiny    # 9 (train not preempted) over 1 epoch of 600 cells, no calm run
                                               # (the test suite's)

Ends with one JSON line of the figures. Exits 1 (one line on stderr) when a campaign did not
finish, a planned fault did not fire, a cell was lost or duplicated, the run's state was deleted
before its end, or a figure is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
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
from cellfeed_testing.modal_emulator import ModalEmulator  # noqa: E402

RUN = "chaos"
PRODUCERS, GPUS, BATCH = 2, 2, 32


@dataclass
class Preemption:
    function: str  # "train" or "produce"
    at_step: int  # fires once the trainer has logged this step


@dataclass
class Outcome:
    returncode: int
    wall_s: float
    stdout: str
    stderr: str
    preempted: list = field(default_factory=list)  # (function, at step)
    rules: list = field(default_factory=list)  # the network faults, with what each did (world.faults())
    deleted_early: int = 0  # looks that found the run's queue or dict gone before its last audit
    cells: dict = field(default_factory=dict)  # epoch -> Counter of cell ids trained
    logs: str = ""  # every container's output


def network_plan(rng: random.Random, scale: float) -> list[dict]:
    """Seeded network faults (`ModalEmulator.fault`), each at the n-th matching call: outages of
    1.5-4 s (emulated clock), far past Modal's own retries (4 attempts in ~0.7 s), of every queue
    call, every dict call, every spawn and every look at a call's result; lost replies of a rank's
    get, one retried past in silence and one reaching the caller, and of a producer's task pop; a
    latency spike."""
    at = lambda a, b: int(rng.randint(a, b) * scale)  # noqa: E731
    return [
        {"kind": "transport", "target": "queue", "after": at(150, 400), "seconds": rng.uniform(2.0, 4.0)},
        {"kind": "transport", "target": "dict", "after": rng.randint(20, 60), "seconds": rng.uniform(2.0, 4.0)},
        {"kind": "transport", "target": "spawn", "after": rng.randint(1, 2), "seconds": rng.uniform(1.5, 3.0)},
        {"kind": "transport", "target": "call", "after": rng.randint(2, 6), "seconds": rng.uniform(1.5, 3.0)},
        {"kind": "lost_reply", "target": "queue", "partition": "rank-", "op": "get", "after": at(10, 40)},
        {
            "kind": "lost_reply",
            "target": "queue",
            "partition": "rank-",
            "op": "get",
            "after": at(50, 90),
            "surface": True,
        },
        {"kind": "lost_reply", "target": "queue", "partition": "tasks", "op": "get", "after": rng.randint(3, 10)},
        {"kind": "spike", "target": "queue", "after": at(100, 300), "calls": 40, "delay_s": 0.2},
    ]


def preemption_plan(rng: random.Random, steps: int) -> list[Preemption]:
    """A producer, then train, each at a seeded step in the campaign's first 60%."""
    first = rng.randint(max(2, steps // 10), max(3, steps // 4))
    return [Preemption("produce", first), Preemption("train", rng.randint(first + 2, max(first + 3, 3 * steps // 5)))]


def steps_logged(world: ModalEmulator) -> int:
    """The highest step any train attempt has logged (in the run's step log on the emulated Volume,
    which every train call appends to)."""
    log = world.volume_dir / RUN / "steps.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return max((json.loads(line)["step"] for line in lines if '"loss"' in line and line.endswith("}")), default=0)


def audited(world: ModalEmulator, epochs: int) -> bool:
    """Whether the campaign's last epoch has its audit line (after it, the end may delete)."""
    audit = re.compile(rf"epoch {epochs - 1}: [\d,]+ cells trained")
    return any(
        audit.search(log.read_text(errors="replace")) for log in (world.root / "containers").glob("*/output.log")
    )


def trained_cells(world: ModalEmulator) -> dict[int, Counter]:
    """Per epoch, the multiset of cells the ranks trained, from every train call's --audit-cells
    files (one set per call, by start time); rows of a call at or past the step the next call
    resumed from were trained again there, so they are set aside."""
    folder = world.volume_dir / RUN / "cells"
    calls: dict[str, list[dict]] = {}
    for path in sorted(folder.glob("*.rank*.jsonl")):
        calls.setdefault(path.name.split(".")[0], []).extend(
            json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")
        )
    out: dict[int, Counter] = {}
    cut = float("inf")
    for started in sorted(calls, key=int, reverse=True):
        rows = calls[started]
        for row in rows:
            if row["step"] < cut:
                out.setdefault(row["epoch"], Counter()).update(row["cells"])
        cut = min([cut] + [row["step"] for row in rows])
    return out


def run_campaign(
    root: Path,
    dataset: str,
    *,
    epochs: int,
    network: list[dict] = (),
    preemptions: list[Preemption] = (),
    timeout_s: float = 600.0,
) -> Outcome:
    args = [
        "--dataset",
        dataset,
        "--run",
        RUN,
        "--producers",
        str(PRODUCERS),
        "--gpus",
        str(GPUS),
        "--batch-size",
        str(BATCH),
        "--max-genes",
        "32",
        "--preset",
        "tiny",
        "--epochs",
        str(epochs),
        "--warmup-steps",
        "2",
        "--checkpoint-every",
        "10",
        "--lease-s",
        "4",
        "--rpc-latency-ms",
        "25",
        "--strategy",
        "block",
        "--block-size",
        "16",
        "--fetch-factor",
        "2",
        "--audit-cells",
    ]
    with ModalEmulator(root, grace_s=30) as world:
        for rule in network:
            world.fault(**rule)
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "cellfeed_testing.modal_emulator.run", "app/modal_app.py", *args],
            cwd=ROOT,
            env=world.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        outcome = Outcome(0, 0.0, "", "")
        watcher = threading.Thread(target=watch, args=(world, proc, list(preemptions), epochs, outcome), daemon=True)
        watcher.start()
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += f"\n(timed out after {timeout_s:.0f} s)"
        outcome.wall_s = time.monotonic() - start
        watcher.join(timeout=30)
        outcome.returncode, outcome.stdout, outcome.stderr = proc.returncode, out, err
        outcome.rules, outcome.cells = world.faults(), trained_cells(world)
        logs = sorted((root / "containers").glob("*/output.log"))
        outcome.logs = "".join(p.read_text(errors="replace") for p in logs)
    return outcome


def watch(
    world: ModalEmulator, proc: subprocess.Popen, pending: list[Preemption], epochs: int, outcome: Outcome
) -> None:
    """Until the campaign ends: preempt each planned function once its step is logged, and look
    for the run's queue and dict every 0.2 s (gone before the last audit: deleted early)."""
    name = f"cellfeed-{RUN}"
    while proc.poll() is None:
        described = world.describe()
        started = any(c["function"] == "train" for c in described["calls"])
        if (
            started
            and (name not in described["queues"] or name not in described["dicts"])
            and not audited(world, epochs)
        ):
            outcome.deleted_early += 1
        step = steps_logged(world) if pending else 0
        while pending and step >= pending[0].at_step:
            p = pending.pop(0)
            running = [c for c in described["calls"] if c["function"] == p.function and c["status"] == "running"]
            if running:
                try:
                    world.preempt(running[0]["id"])
                    outcome.preempted.append((p.function, step))
                except RuntimeError:
                    pass
        time.sleep(0.2)


def check(outcome: Outcome, n_cells: int, epochs: int) -> tuple[int, int, int]:
    """(cells checked: trained cells read from the logs, lost, duplicated), each epoch's multiset
    against the atlas's cells once."""
    expected = Counter(range(n_cells))
    checked = lost = duplicated = 0
    for e in range(epochs):
        got = outcome.cells.get(e, Counter())
        checked += sum(got.values())
        lost += sum((expected - got).values())
        duplicated += sum((got - expected).values())
    return checked, lost, duplicated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 epochs of 20,000 cells (about 3 minutes on 2 cores)")
    parser.add_argument(
        "--tiny", action="store_true", help="9 faults over 1 epoch of 600 cells, no calm run (the test suite's)"
    )
    parser.add_argument(
        "--cells", type=int, default=None, help="cells of the synthetic atlas (default 40,000; 20,000 quick; 600 tiny)"
    )
    parser.add_argument("--epochs", type=int, default=None, help="campaign epochs (default 4; 3 quick; 1 tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault plan")
    args = parser.parse_args()
    n_cells = args.cells or (600 if args.tiny else 20000 if args.quick else 40000)
    epochs = args.epochs or (1 if args.tiny else 3 if args.quick else 4)
    timeout_s = 300.0 if args.tiny else 900.0
    rng = random.Random(args.seed)

    from producers.synth import SynthSpec, synthesize

    work = Path(tempfile.mkdtemp(prefix="cellfeed-modal-chaos-"))
    dataset = str(work / "atlas")
    synthesize(
        dataset,
        SynthSpec(n_cells=n_cells, n_genes=2000, median_nnz=300, seed=3),
        rows_per_fragment=60_000,
        progress=False,
    )
    steps = epochs * -(-n_cells // (GPUS * BATCH))
    calm = None
    if not args.tiny:
        calm = run_campaign(work / "calm", dataset, epochs=epochs, timeout_s=timeout_s)
        if calm.returncode != 0:
            print(calm.stderr[-3000:], file=sys.stderr)
            fail(f"the campaign without faults failed (exit {calm.returncode})")
    network = network_plan(rng, scale=n_cells * epochs / 6000)
    preemptions = preemption_plan(rng, steps)
    if args.tiny:  # every network fault, and a producer preempted (the suite preempts train elsewhere)
        preemptions = preemptions[:1]
    chaos = run_campaign(
        work / "chaos", dataset, epochs=epochs, network=network, preemptions=preemptions, timeout_s=timeout_s
    )
    checked, lost, duplicated = check(chaos, n_cells, epochs)
    fired = [r for r in chaos.rules if r["hits"] > 0]
    kinds = Counter(
        {"transport": "transport_burst", "lost_reply": "lost_reply", "spike": "latency_spike"}[r["kind"]] for r in fired
    )
    kinds.update(f"preempt_{function}" for function, _ in chaos.preempted)
    overhead = round(chaos.wall_s / calm.wall_s, 3) if calm else None
    redone = sum(int(m) for m in re.findall(r"(\d+) units were produced again: their items never reached", chaos.logs))

    print(
        f"\ncampaign on the Modal emulator: {n_cells:,} cells x {epochs} epochs, {PRODUCERS} producers, {GPUS} "
        f"ranks, 25 ms a queue/map call, a 4 s lease; machine: {platform.machine()}, {os.cpu_count()} cores"
    )
    for r in chaos.rules:
        if r["kind"] == "transport":
            calls = {"spawn": "spawn", "call": "look at a call's result"}.get(r["target"], f"{r['target']} call")
            what = f"every {calls} fails for {r['seconds']:.1f} s"
        elif r["kind"] == "lost_reply":
            what = f"a {r['partition']}* get's reply is lost" + (
                " (the caller sees it)" if r["surface"] else " (Modal's client retries past it)"
            )
        else:
            what = f"{r['target']} calls {r['delay_s'] * 1000:.0f} ms late, {r['calls']} calls"
        print(
            f"  after call {r['after']:>4} ({r['target']}): {what}: {'fired' if r['hits'] else 'DID NOT FIRE'}"
            + (f", {r['items_lost']} items lost" if r["kind"] == "lost_reply" else "")
        )
    for function, step in chaos.preempted:
        print(f"  at step {step:>4}: {function} preempted (SIGINT to every process of its container)")
    print(
        f"run finished: {'yes' if chaos.returncode == 0 else f'no (exit {chaos.returncode})'}; cells checked "
        f"{checked:,}: lost {lost}, duplicated {duplicated}; run state deleted before its end: {chaos.deleted_early}"
    )
    print(
        f"wall: {chaos.wall_s:.1f}s with faults" + (f", {calm.wall_s:.1f}s without ({overhead:.2f}x)" if calm else "")
    )
    if chaos.returncode != 0:
        print(chaos.stderr[-3000:], file=sys.stderr)
    figures = {
        "faults_injected": len(fired) + len(chaos.preempted),
        "fault_kinds": dict(kinds),
        "cells_checked": checked,
        "cells_lost": lost,
        "cells_duplicated": duplicated,
        "completed": chaos.returncode == 0,
        "state_deleted_before_end": chaos.deleted_early,
        "units_redone": redone,
        "overhead_ratio": overhead,
        "wall_s": round(chaos.wall_s, 1),
        "calm_wall_s": round(calm.wall_s, 1) if calm else None,
        "seed": args.seed,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    print(json.dumps(figures))
    if chaos.returncode != 0:
        fail(f"the campaign with faults failed (exit {chaos.returncode})")
    if len(fired) < len(network) or len(chaos.preempted) < len(preemptions):
        fail(
            f"{len(fired)} of {len(network)} network faults fired and {len(chaos.preempted)} of {len(preemptions)} "
            "preemptions were made: the campaign ended before the rest"
        )
    if lost or duplicated or checked != epochs * n_cells:
        fail(f"{lost:,} cells lost and {duplicated:,} duplicated over {epochs} epochs ({checked:,} checked)")
    if chaos.deleted_early:
        fail("the run's queue or dict was deleted before the campaign's end")
    check_figures(figures, allow_none=("overhead_ratio", "calm_wall_s") if args.tiny else ())
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
