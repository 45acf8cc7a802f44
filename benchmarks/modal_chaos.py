"""Modal's own faults, injected into a whole campaign run by modal's REAL client: `modal run
app/modal_app.py` (the installed `modal` package's CLI) against the local Modal control plane
(cellfeed_testing/modal_control_plane), whose containers run `python -m modal._container_entrypoint`
with the same package: setup, train with its ranks, spawned producers, the run's Queue and Dict,
the checkpoints Volume. The faults are the plane's (faults.py: a layer around its handlers, fired
on the n-th matching request, seeded, and placed within the requests the calm run below made) and
its preemptions (SIGINT to every process of the container, a grace, SIGKILL; the same input again):

- gRPC bursts that outlast modal's own retries (4 attempts in ~0.7 s) on the queue, the Dict, the
  producers' spawns and the looks at a call's result: the error reaches the product, which retries;
- lost replies (the server applied the request, then the stream ended without a reply: modal's
  client retries it under the same idempotency key, and the plane, not deduplicating, applies it
  again): two rank gets (one retried past in silence, one lost 5 times: the error reaches the
  caller) and a producer's task get (their items are gone); a Dict pop that found its key (the
  run's Dict holds what an earlier campaign of the name left when `cellfeed stop` stopped it: its
  stop request and the producers' stop; the new campaign pops both, the first pop's reply is
  lost); the spawn of `train` (a second train call is made: the run's claim lets one train);
  setup's result (asked again, still there);
- a latency spike; a producer's connection reset as it puts items (every call in flight on it ends
  unanswered: modal's client retries them on a new connection); preemptions of a producer and of
  `train` once the trainer has logged a seeded step (read from the running train container's own
  view of the Volume).

Then every epoch's trained cells (`--audit-cells`, on the Volume; a preempted call's steps past the
checkpoint its successor resumed from are set aside: they were trained again) are checked against
the atlas, and the run's queue and Dict are watched for a deletion before the campaign's end. The
same campaign runs once without faults, for the overhead. The containers print which `modal` they
imported (app/modal_app.py's train and produce bodies): the JSON names it.

    python benchmarks/modal_chaos.py           # 4 epochs of 40,000 cells
    python benchmarks/modal_chaos.py --quick   # 3 epochs of 20,000 cells: about 4 minutes on 2 cores
    python benchmarks/modal_chaos.py --tiny    # 1 epoch of 600 cells, train not preempted, no calm run
                                               # (the test suite's)

Ends with one JSON line of the figures. Exits 1 (one line on stderr) when a campaign did not
finish, a planned fault did not fire, a cell was lost or duplicated, the run's state was deleted
before its end, the containers did not all name the same `modal`, or a figure is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
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

from app.modal_app import MOUNT_ENV  # noqa: E402  (where containers find the app's Volume views)
from benchmarks._checks import check_figures, fail, machine  # noqa: E402
from cellfeed_testing.modal_control_plane import ControlPlane  # noqa: E402

RUN = "chaos"
PRODUCERS, GPUS, BATCH = 2, 2, 32
SECRET = os.environ.get("CELLFEED_SECRET", "cellfeed-s3")  # app/modal_app.py's Secret (S3 settings: none here)
CLIENT_LINE = re.compile(r"^modal (\S+) from (\S+)$", re.M)  # what train and produce print as they start
WATCH_S = 0.2
NEVER = 1 << 62  # a rule placed past any request: it only counts the requests it matches


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
    rules: list = field(default_factory=list)  # the network faults, with what each did (plane.faults())
    labels: list = field(default_factory=list)  # each rule's fault kind, as the JSON counts it
    deleted_early: int = 0  # looks that found the run's queue or dict gone before its last audit
    cells: dict = field(default_factory=dict)  # epoch -> Counter of cell ids trained
    logs: str = ""  # every container's output
    calls: list = field(default_factory=list)  # plane.call_list() at the end
    call_logs: dict = field(default_factory=dict)  # call id -> its containers' output


def network_plan(rng: random.Random, scale: float, seen: list[int] | None = None) -> list[tuple[str, dict]]:
    """Seeded network faults, (the fault kind the JSON counts, the plane's rule), each at the n-th
    matching request. `seen`: each rule's matching requests in a calm run of the same campaign
    (`counting`); a rule is then placed no later than a seeded 10-40% of them. How many requests a
    campaign makes follows its speed (a faster rank drains its partition in fewer gets), so a place
    sized only by the campaign's cells can lie past its last request, and that fault never fires."""
    at = lambda a, b: max(1, int(rng.randint(a, b) * scale))  # noqa: E731
    rank_get = {"kind": "lost_reply", "target": "queue", "op": "get", "partition": "rank-"}
    plan = [
        # bursts: with several callers at once, each burst is long enough that some caller spends
        # all 4 of its attempts (grpc_utils.py:499-509) and the error reaches the product
        ("grpc_burst", {"kind": "grpc_burst", "target": "queue", "after": at(150, 400), "calls": 40}),
        ("grpc_burst", {"kind": "grpc_burst", "target": "dict", "after": rng.randint(20, 60), "calls": 24}),
        (
            "grpc_burst",
            {"kind": "grpc_burst", "target": "spawn", "function": "produce", "calls": 6, "status": "INTERNAL"},
        ),
        ("grpc_burst", {"kind": "grpc_burst", "target": "call", "after": rng.randint(2, 6), "calls": 8}),
        # lost replies: applied, no reply; modal's client retries them
        ("lost_reply_get", {**rank_get, "after": at(10, 40)}),  # retried past in silence
        # 4 in a row on rank 0's partition (its fetcher is its one caller): all of modal's attempts lost
        ("lost_reply_get", {**rank_get, "partition": "rank-0", "after": at(25, 45), "calls": 4}),
        ("lost_reply_get", {**rank_get, "partition": "tasks", "after": rng.randint(3, 10)}),  # a producer's task
        ("lost_reply_pop", {"kind": "lost_reply", "target": "dict", "op": "pop"}),
        ("lost_reply_spawn", {"kind": "lost_reply", "target": "spawn", "function": "train"}),
        ("lost_reply_result", {"kind": "lost_reply", "target": "call", "op": "get", "function": "setup"}),
        ("latency", {"kind": "latency", "target": "queue", "after": at(100, 300), "calls": 40, "delay_s": 0.2}),
        # a producer's connection drops (TCP RST) as it puts items: its every call in flight ends unanswered
        ("transport_reset", {"kind": "connection_reset", "target": "queue", "op": "put", "after": at(20, 60)}),
    ]
    for (_, rule), n in zip(plan, seen or ()):
        if rule.get("after"):
            rule["after"] = max(1, min(rule["after"], int(n * rng.uniform(0.1, 0.4))))
    return plan


def counting(plan: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The plan's rules placed past any request (they only count what matches them: a calm run's `seen`)."""
    return [(label, {**rule, "after": NEVER}) for label, rule in plan]


def preemption_plan(rng: random.Random, steps: int) -> list[Preemption]:
    """A producer, then train, each at a seeded step in the campaign's first 60%."""
    first = rng.randint(max(2, steps // 10), max(3, steps // 4))
    return [Preemption("produce", first), Preemption("train", rng.randint(first + 2, max(first + 3, 3 * steps // 5)))]


def _last_step(path: Path) -> int:
    """The highest step in a step log's tail (a line being written is skipped)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            tail = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return 0
    steps = (json.loads(x)["step"] for x in tail if x.startswith("{") and x.endswith("}") and '"loss"' in x)
    return max(steps, default=0)


def steps_logged(plane: ControlPlane, calls: list[dict]) -> tuple[int, str | None]:
    """(the highest step a running train container has logged, its call): read from that container's
    own view of the checkpoints Volume (the step log every train call appends to)."""
    best, who = 0, None
    for call in calls:
        if call["function"] != "train" or call["status"] != "running":
            continue
        for attempt in call["attempts"]:
            if attempt["ended"]:
                continue
            views = plane.servicer.containers.folder_for(attempt["task"]) / "volumes"
            for log in views.glob(f"*/{RUN}/steps.jsonl"):
                step = _last_step(log)
                if step > best:
                    best, who = step, call["id"]
    return best, who


def container_logs(plane: ControlPlane, calls: list[dict]) -> dict[str, str]:
    """Every container's output, by task id."""
    return {a["task"]: plane.container_log(a["task"]) for c in calls for a in c["attempts"]}


def audited(plane: ControlPlane, calls: list[dict], epochs: int) -> bool:
    """Whether the campaign's last epoch has its audit line (after it, the end may delete)."""
    audit = re.compile(rf"epoch {epochs - 1}: [\d,]+ cells trained")
    logs = container_logs(plane, [c for c in calls if c["function"] == "train"])
    return any(audit.search(log) for log in logs.values())


def trained_cells(volume: Path) -> dict[int, Counter]:
    """Per epoch, the multiset of cells the ranks trained, from every train call's --audit-cells
    files (one set per call, by start time); rows of a call at or past the step the next call
    resumed from were trained again there, so they are set aside."""
    folder = volume / RUN / "cells"
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


def campaign_args(dataset: str, epochs: int) -> list[str]:
    return [
        "--dataset", dataset, "--run", RUN, "--producers", str(PRODUCERS), "--gpus", str(GPUS),
        "--batch-size", str(BATCH), "--max-genes", "32", "--preset", "tiny", "--epochs", str(epochs),
        "--warmup-steps", "2", "--checkpoint-every", "10", "--lease-s", "4", "--rpc-latency-ms", "25",
        "--strategy", "block", "--block-size", "16", "--fetch-factor", "2", "--audit-cells",
    ]  # fmt: skip


def client_env(plane: ControlPlane) -> dict[str, str]:
    """This environment without the laptop's own Modal settings, with the plane's."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}, **plane.env}


# what a `cellfeed stop` of an earlier campaign of the run left in its Dict (app/journal.py's stop request,
# app/modal_app.py's stop for the producers), written by the product's own backend with modal's client
SEED_STOPPED_RUN = f"""
from app.journal import DictJournal
from coordination.modal_backend import run_backends
from coordination.routing import stop_key
store = run_backends({RUN!r})[1]
DictJournal(store, {RUN!r}).ask_stop()
store.put(stop_key({RUN!r}), "stop")
"""


def run_campaign(
    root: Path,
    dataset: str,
    *,
    epochs: int,
    network: list[tuple[str, dict]] = (),
    preemptions: list[Preemption] = (),
    timeout_s: float = 600.0,
    kernels: str | None = None,
) -> Outcome:
    lasting = {"cellfeed-kernels": Path(kernels)} if kernels else None  # V9: the compiled token pass, kept
    with ControlPlane(root, secrets={SECRET: {}}, mount_env=MOUNT_ENV, lasting_volumes=lasting) as plane:
        env = client_env(plane)
        subprocess.run([sys.executable, "-c", SEED_STOPPED_RUN], cwd=ROOT, env=env, check=True, timeout=120)
        outcome = Outcome(0, 0.0, "", "", labels=[label for label, _ in network])
        for _, rule in network:
            plane.fault(**rule)
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "modal", "run", "app/modal_app.py", *campaign_args(dataset, epochs)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            process_group=0,
        )
        watcher = threading.Thread(target=watch, args=(plane, proc, list(preemptions), epochs, outcome), daemon=True)
        watcher.start()
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\n(timed out after {timeout_s:.0f} s)"
        outcome.wall_s = time.monotonic() - start
        watcher.join(timeout=60)
        outcome.returncode, outcome.stdout, outcome.stderr = proc.returncode, out, err
        outcome.rules, outcome.calls = plane.faults(), plane.call_list()
        outcome.cells = trained_cells(plane.volume_dir)
        outcome.call_logs = {c["id"]: "".join(container_logs(plane, [c]).values()) for c in outcome.calls}
        outcome.logs = "".join(outcome.call_logs.values())
    return outcome


def watch(plane: ControlPlane, proc: subprocess.Popen, pending: list, epochs: int, outcome: Outcome) -> None:
    """Until the campaign ends: preempt each planned function once the trainer has logged its step,
    and look for the run's queue and dict every 0.2 s (gone before the last audit: deleted early)."""
    name = f"cellfeed-{RUN}"
    while proc.poll() is None:
        described = plane.describe()
        calls = described["calls"]
        started = any(c["function"] == "train" for c in calls)
        if started and (name not in described["queues"] or name not in described["dicts"]):
            if not audited(plane, calls, epochs):
                outcome.deleted_early += 1
        step, trainer = steps_logged(plane, calls) if pending else (0, None)
        while pending and step >= pending[0].at_step:
            p = pending.pop(0)
            running = [c["id"] for c in calls if c["function"] == p.function and c["status"] == "running"]
            target = trainer if p.function == "train" else (running[0] if running else None)
            if target is not None:
                try:
                    plane.preempt(target)
                    outcome.preempted.append((p.function, step))
                except Exception as exc:  # noqa: BLE001 - said, and the missing preemption fails the run
                    print(f"preempting {p.function} at step {step} failed: {exc}", file=sys.stderr)
        time.sleep(WATCH_S)


def check(outcome: Outcome, n_cells: int, epochs: int) -> tuple[int, int, int]:
    """(cells checked: trained cells read from the audit files, lost, duplicated), each epoch's
    multiset against the atlas's cells once."""
    expected = Counter(range(n_cells))
    checked = lost = duplicated = 0
    for e in range(epochs):
        got = outcome.cells.get(e, Counter())
        checked += sum(got.values())
        lost += sum((expected - got).values())
        duplicated += sum((got - expected).values())
    return checked, lost, duplicated


def describe_rule(label: str, r: dict) -> str:
    where = r["target"] + "".join(f" {k}={r[k]}" for k in ("op", "partition", "function") if r[k])
    if r["kind"] == "grpc_burst":
        what = f"{r['calls']} requests fail {r['status']}; {r['keys_hit'] - r['recovered']} client calls gave up"
    elif r["kind"] == "latency":
        what = f"{r['calls']} requests {r['delay_s'] * 1000:.0f} ms late"
    elif r["kind"] == "connection_reset":
        what = f"{r['hits']} connections reset, {r['recovered']} calls recovered by modal's retry"
    else:
        what = f"{r['hits']} replies lost ({r['items_lost']} taken), {r['recovered']} recovered by modal's retry"
    fired = "fired" if r["hits"] else "DID NOT FIRE"
    return f"  {label:<18} after {r['after']:>4} of {where}: {what}: {fired}"


def client_of(outcome: Outcome) -> tuple[str | None, str | None, int]:
    """(modal's version, its `__init__.py`, containers that said) from what train and produce printed."""
    said = set(CLIENT_LINE.findall(outcome.logs))
    if len(said) != 1:
        return None, None, len(said)
    (version, path), n = next(iter(said)), len(CLIENT_LINE.findall(outcome.logs))
    return version, path, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 epochs of 20,000 cells (about 4 minutes on 2 cores)")
    parser.add_argument("--tiny", action="store_true", help="1 epoch of 600 cells, no calm run (the test suite's)")
    parser.add_argument(
        "--cells", type=int, default=None, help="cells of the synthetic atlas (default 40,000; 20,000 quick; 600 tiny)"
    )
    parser.add_argument("--epochs", type=int, default=None, help="campaign epochs (default 4; 3 quick; 1 tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault plan")
    parser.add_argument("--rules-json", help="write each network fault, with what it did (plane.faults()), here")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (atlas, planes, containers' logs)")
    parser.add_argument(
        "--kernels",
        help="a folder keeping the cellfeed-kernels Volume across runs, as a workspace does (the compiled token "
        "pass: a setup loads it instead of compiling; the test suite passes its own)",
    )
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
    calm, scale = None, n_cells * epochs / 6000
    if not args.tiny:  # (its rules fire never: they count each one's requests, where the plan places it)
        calm = run_campaign(
            work / "calm",
            dataset,
            epochs=epochs,
            network=counting(network_plan(random.Random(args.seed), scale)),
            timeout_s=timeout_s,
            kernels=args.kernels,
        )
        if calm.returncode != 0:
            print(calm.stderr[-3000:], file=sys.stderr)
            fail(f"the campaign without faults failed (exit {calm.returncode})")
    network = network_plan(rng, scale, seen=[r["seen"] for r in calm.rules] if calm else None)
    preemptions = preemption_plan(rng, steps)
    if args.tiny:  # every network fault, and a producer preempted (the suite preempts train elsewhere)
        preemptions = preemptions[:1]
    chaos = run_campaign(
        work / "chaos",
        dataset,
        epochs=epochs,
        network=network,
        preemptions=preemptions,
        timeout_s=timeout_s,
        kernels=args.kernels,
    )
    checked, lost, duplicated = check(chaos, n_cells, epochs)
    fired = [(label, r) for label, r in zip(chaos.labels, chaos.rules) if r["hits"] > 0]
    kinds = Counter(label for label, _ in fired)
    kinds.update(f"preempt_{function}" for function, _ in chaos.preempted)
    overhead = round(chaos.wall_s / calm.wall_s, 3) if calm else None
    redone = sum(int(m) for m in re.findall(r"(\d+) units were produced again: their items never reached", chaos.logs))
    version, client_file, reported = client_of(chaos)
    train_calls = [c for c in chaos.calls if c["function"] == "train"]
    # a train call that started ranks said so ("model tiny: ...; world size 2"); a second one of the run did nothing
    trainers = sum(1 for c in train_calls if "; world size " in chaos.call_logs[c["id"]])
    gave_up = sum(r["keys_hit"] - r["recovered"] for r in chaos.rules if r["kind"] != "latency")

    print(
        f"\ncampaign through `modal run` (modal {version}, its own client and container entrypoint) on the local "
        f"control plane: {n_cells:,} cells x {epochs} epochs, {PRODUCERS} producers, {GPUS} ranks, 25 ms more a "
        f"queue/map call, a 4 s lease; machine: {machine()}"
    )
    for label, r in zip(chaos.labels, chaos.rules):
        print(describe_rule(label, r))
    for function, step in chaos.preempted:
        print(f"  at step {step:>4}: {function} preempted (SIGINT to every process of its container)")
    print(
        f"train calls: {len(train_calls)}, of which trained: {trainers}; client calls whose error reached the "
        f"product: {gave_up}; units produced again: {redone}"
    )
    print(
        f"run finished: {'yes' if chaos.returncode == 0 else f'no (exit {chaos.returncode})'}; cells checked "
        f"{checked:,}: lost {lost}, duplicated {duplicated}; run state deleted before its end: {chaos.deleted_early}"
    )
    print(
        f"wall: {chaos.wall_s:.1f}s with faults" + (f", {calm.wall_s:.1f}s without ({overhead:.2f}x)" if calm else "")
    )
    if chaos.returncode != 0:
        print(chaos.stdout[-2000:], chaos.stderr[-3000:], file=sys.stderr)
    figures = {
        "faults_injected": len(fired) + len(chaos.preempted),
        "fault_kinds": dict(kinds),
        "cells_checked": checked,
        "cells_lost": lost,
        "cells_duplicated": duplicated,
        "completed": chaos.returncode == 0,
        "state_deleted_before_end": chaos.deleted_early,
        "units_redone": redone,
        "client_calls_failed_to_product": gave_up,
        "train_calls": len(train_calls),
        "trainers": trainers,
        "overhead_ratio": overhead,
        "wall_s": round(chaos.wall_s, 1),
        "calm_wall_s": round(calm.wall_s, 1) if calm else None,
        "modal_client_file": client_file,
        "modal_client_version": version,
        "containers_naming_the_client": reported,
        "seed": args.seed,
        "machine": machine(),
    }
    if args.rules_json:
        Path(args.rules_json).write_text(json.dumps([{"label": k, **r} for k, r in zip(chaos.labels, chaos.rules)]))
    print(json.dumps(figures))
    if chaos.returncode != 0:
        fail(f"the campaign with faults failed (exit {chaos.returncode})")
    if len(fired) < len(network) or len(chaos.preempted) < len(preemptions):
        unfired = [label for label, r in zip(chaos.labels, chaos.rules) if not r["hits"]]
        fail(
            f"{len(fired)} of {len(network)} network faults fired (not: {', '.join(unfired) or 'none'}) and "
            f"{len(chaos.preempted)} of {len(preemptions)} preemptions were made: the campaign ended before the rest"
        )
    if lost or duplicated or checked != epochs * n_cells:
        fail(f"{lost:,} cells lost and {duplicated:,} duplicated over {epochs} epochs ({checked:,} checked)")
    if chaos.deleted_early:
        fail("the run's queue or dict was deleted before the campaign's end")
    if client_file is None:
        said = sorted(set(CLIENT_LINE.findall(chaos.logs)))
        fail(f"the containers named {reported} different modal clients (or none): {said}")
    if trainers != 1:
        fail(f"{trainers} train calls trained the run (of {len(train_calls)}): one trainer a run")
    check_figures(figures, allow_none=("overhead_ratio", "calm_wall_s") if args.tiny else ())
    if args.keep:
        print(f"kept: {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
