"""The Modal path, whole, on the local Modal control plane (`cellfeed_testing/modal_control_plane`;
not a Modal run): modal's own CLI and client, `modal run app/modal_app.py` in a process of its own,
and containers running modal's own entrypoint: the entrypoint → setup → train (CPU ranks, gloo) →
spawned producers → the end, each function with its own definition. Preempted in its first minute
and again mid-epoch (SIGINT to every process of the container), with a producer that keeps failing
(the run stops, keeps its state, and its printed command resumes it: a corpus, its files carried
into the containers), expired setup state, a rerun on another GPU count, status/stop from the
laptop, two nodes (a clustered function), a node lost; the preempted campaign is balanced. Faults and
preemptions fire on events (a step logged, a call started), never on elapsed seconds; every wait has
a timeout. (A train spawn whose reply was lost, so that two train calls are made and one trains:
benchmarks/modal_chaos.py's tiny run, tests/test_benchmarks.py. A campaign longer than a call, each
call handing over after one step under Modal's 24 h timeout compressed 480 times, detached from a
laptop that goes away: tests/test_modal_laptop.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from cellfeed_testing.modal_control_plane import ControlPlane
from tests.conftest import synth_once, wait_for

ROOT = Path(__file__).resolve().parents[1]
RUN = "mcp"
SECRET = os.environ.get("CELLFEED_SECRET", "cellfeed-s3")  # app/modal_app.py's Secret (the datasets are local)
CAMPAIGN_S = 420  # the longest a `modal run` here may take (a busy 2-core machine)


@pytest.fixture(scope="session")  # data only: built once per session (`built_once`), whatever order tests run in
def atlas(tmp_path_factory):
    """1,500 cells in small fragments; plate14's cells are the held-out set. 2,000 genes, not a
    real atlas's 62,710: the tiny model's embedding (and each step's all-reduce) is then small, and
    the path under test (calls, preemptions, hand-overs) is the same."""
    from producers.synth import SynthSpec

    spec = SynthSpec(n_cells=1500, n_genes=2000, median_nnz=300, seed=3)
    return synth_once(tmp_path_factory, "modal-atlas", spec, rows_per_fragment=200_000)


def flags(atlas, **changes) -> list[str]:
    base = dict(
        dataset=atlas.uri,
        run=RUN,
        producers=1,  # one producer keeps two ranks fed here; tests of the fleet ask for 2
        gpus=2,
        batch_size=16,
        max_genes=32,
        preset="tiny",
        epochs=2,
        warmup_steps=2,
        checkpoint_every=4,
        eval_filter="plate = 'plate14'",
        eval_cells=64,
        eval_every=10,
        strategy="block",
        block_size=16,
        fetch_factor=2,
    )
    out = []
    for name, value in {**base, **changes}.items():
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out


@contextlib.contextmanager
def control_plane(tmp_path: Path, lasting: dict | None = None):
    """A plane with the app's Secret and its Volumes told to containers (app/modal_app.py: MOUNT_ENV);
    `lasting`: Volumes kept from earlier runs (conftest.py: `kernel_volume`)."""
    from app.modal_app import MOUNT_ENV

    with ControlPlane(tmp_path / "plane", secrets={SECRET: {}}, mount_env=MOUNT_ENV, lasting_volumes=lasting) as plane:
        yield plane


def laptop_env() -> dict:
    """This environment without any Modal setting of its own."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}


def client_env(plane: ControlPlane) -> dict:
    """`laptop_env()` and the plane's settings."""
    return {**laptop_env(), **plane.env}


class ModalRun:
    """`modal run app/modal_app.py ARGS`: modal's own CLI against the plane, in a process of its own.
    Its output goes to files (the containers' logs stream through it: a pipe read only at the end
    would fill and stall the client)."""

    count = 0

    def __init__(self, plane: ControlPlane, args: list[str], folder: Path, detach: bool = False) -> None:
        ModalRun.count += 1
        folder.mkdir(parents=True, exist_ok=True)
        self.out_path = folder / f"modal-run-{ModalRun.count}.out"
        self.err_path = folder / f"modal-run-{ModalRun.count}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "modal", "run", *(["--detach"] if detach else []), "app/modal_app.py", *args],
                cwd=ROOT,
                env=client_env(plane),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )

    def poll(self):
        return self.proc.poll()


def modal_run(plane: ControlPlane, args: list[str], tmp_path: Path, detach: bool = False) -> ModalRun:
    return ModalRun(plane, args, tmp_path / "runs", detach)


def finish(run: ModalRun, timeout: float = CAMPAIGN_S) -> tuple[int, str, str]:
    try:
        run.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        run.proc.wait()
        raise AssertionError(f"modal run did not end in {timeout:.0f}s:\n{run.err_path.read_text()[-3000:]}") from None
    return run.proc.returncode, run.out_path.read_text(), run.err_path.read_text()


def verdict_line(out: str) -> str:
    """The campaign's last line (`main`'s verdict; container logs streamed by `modal run` may follow it)."""
    found = [line for line in out.splitlines() if re.match(r"(complete|stopped|INCOMPLETE)\b", line)]
    assert found, out[-3000:]
    return found[-1]


def summary_json(out: str) -> dict:
    """The JSON line `main` prints before its verdict."""
    lines = out.splitlines()
    at = max(i for i, line in enumerate(lines) if re.match(r"(complete|stopped|INCOMPLETE)\b", line))
    return json.loads(next(line for line in reversed(lines[:at]) if line.startswith("{")))


def resume_command(err: str) -> list[str]:
    """The command the laptop printed after "Resume it with:" (its last such line)."""
    import shlex

    lines = err.splitlines()
    at = max(i for i, line in enumerate(lines) if line.endswith("Resume it with:"))
    return shlex.split(lines[at + 1].strip())


def calls(plane: ControlPlane, function: str | None = None) -> list[dict]:
    return plane.history(function)


def train_calls(plane: ControlPlane) -> list[dict]:
    return [c for c in calls(plane) if c["function"].startswith("train")]  # (`train_2_nodes`: --nodes 2)


def tasks_of(call: dict) -> list[str]:
    return [k["task"] for a in call["attempts"] for k in a["containers"]]


def logs_of(plane: ControlPlane, call: dict, attempt: int | None = None) -> str:
    attempts = call["attempts"] if attempt is None else [call["attempts"][attempt]]
    return "".join(plane.container_log(k["task"]) for a in attempts for k in a["containers"])


def running_train(plane: ControlPlane, function: str = "train", attempts: int = 1) -> dict | None:
    """The running call of `function` once it has `attempts` attempts and the last one's containers run."""
    for c in calls(plane, function):
        if c["status"] == "running" and len(c["attempts"]) >= attempts:
            last = c["attempts"][attempts - 1]["containers"]
            if last and all(k["exit_code"] is None for k in last):
                return c
    return None


def train_started(plane: ControlPlane, proc: ModalRun, function: str = "train", attempts: int = 1) -> dict:
    """`running_train`'s call, waited for; a `modal run` that ends first fails the test with its output."""
    what = f"{function}'s attempt {attempts} to start"
    found = wait_for(lambda: running_train(plane, function, attempts) or proc.poll() is not None, what, timeout=240)
    assert isinstance(found, dict), f"modal run ended before {what}: " + finish(proc)[2][-3000:]
    return found


def step_rows(plane: ControlPlane, task: str | None = None) -> list[dict]:
    """Rank 0's step rows from the run's step log: the running train container's own view of the
    Volume (what it wrote, committed or not) when `task` is given, else the committed Volume."""
    folder = plane.volume_view(task) if task else plane.volume_dir
    path = folder / RUN / "steps.jsonl" if folder else None
    lines = path.read_text().splitlines() if path and path.exists() else []
    return [json.loads(line) for line in lines if '"loss"' in line and line.endswith("}")]


def steps_logged(plane: ControlPlane, task: str) -> int:
    """The last step rank 0 has logged in container `task` (0: none yet)."""
    return max((row["step"] for row in step_rows(plane, task)), default=0)


def epoch_logged(plane: ControlPlane, task: str) -> int:
    rows = step_rows(plane, task)
    return rows[-1]["epoch"] if rows else -1


def rank0_task(call: dict, attempt: int = -1) -> str:
    return next(k["task"] for k in call["attempts"][attempt]["containers"] if k["rank"] == 0)


def check_campaign(plane: ControlPlane, out: str, *, epochs: int, producers: int, setups: int = 1) -> None:
    """Every epoch audited once, exactly once; the run's queue and dicts gone; no call left
    running; the fleet never doubled; `setups`: one for each `modal run` (a resume's sets up again)."""
    logs = "".join(logs_of(plane, c) for c in train_calls(plane))
    audits = re.findall(r"epoch (\d+): ([\d,]+) cells trained, 0 missing, 0 duplicated", logs)
    assert sorted(int(e) for e, _ in audits) == list(range(epochs)), logs[-3000:]
    assert "failed its exactly-once audit" not in logs
    now = plane.describe()
    assert now["queues"] == [] and now["dicts"] == []  # deleted at the end
    assert not [c for c in now["calls"] if c["status"] == "running"]
    assert len(calls(plane, "produce")) == producers  # reused across attempts, never doubled
    assert len(calls(plane, "setup")) == setups and summary_json(out)["steps"] > 0
    line = verdict_line(out)
    assert re.match(
        rf"complete: {epochs} epochs?, [\d,]+ cells, every epoch trained exactly once \(audited\)$", line
    ), line


def compiled_by_setup(plane: ControlPlane) -> bool:
    """Whether the first setup compiled the token pass into its view of the kernels Volume, which it
    commits for the producers to load (producers/kernel_cache.py)."""
    task = calls(plane, "setup")[0]["attempts"][0]["containers"][0]["task"]
    view = plane.volume_view(task, "cellfeed-kernels")
    return bool(view and list((view / RUN / "producers").glob("token_kernel._tokenize-*.nbi")))


def trained_cells(plane: ControlPlane) -> dict:
    """Per epoch, the multiset of cells the ranks trained, from every train call's --audit-cells
    files on the committed Volume (one set per call, by start time): a call's rows at or past the
    step its successor resumed from were trained again there, so they are set aside."""
    found: dict[str, list[dict]] = {}
    for path in sorted((plane.volume_dir / RUN / "cells").glob("*.rank*.jsonl")):
        found.setdefault(path.name.split(".")[0], []).extend(
            json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")
        )
    out: dict = {}
    cut = float("inf")
    for started in sorted(found, key=int, reverse=True):
        for row in found[started]:
            if row["step"] < cut:
                out.setdefault(row["epoch"], Counter()).update(row["cells"])
        cut = min([cut] + [row["step"] for row in found[started]])
    return out


def training_cells(atlas) -> Counter:
    held_out = set(np.flatnonzero(np.asarray(atlas.obs(["plate"]).column(0).to_pylist()) == "plate14").tolist())
    return Counter(c for c in range(atlas.n_cells) if c not in held_out)


def tissue_quotas(atlas) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each cell's tissue, the training cells' tissues (sorted), their counts, and the quota of each
    per epoch under `--balance-power 1`: equal shares of the training cells, by largest remainder
    (the remainder to the first by name)."""
    tissue = np.asarray(atlas.obs(["tissue"]).column(0).to_pylist())
    training = np.asarray(atlas.obs(["plate"]).column(0).to_pylist()) != "plate14"
    names, counts = np.unique(tissue[training], return_counts=True)
    quotas = np.full(len(names), len(tissue[training]) // len(names))
    quotas[: len(tissue[training]) - int(quotas.sum())] += 1
    return tissue, names, counts, quotas


def test_modal_run_whole_path_balanced_preempted_in_its_first_minute_and_again_in_its_second_epoch(atlas, tmp_path):
    """`train` is preempted as soon as its fleet is spawned (nothing to checkpoint yet), and its
    re-run is preempted again in epoch 1 of 2, once epoch 0 is audited and training is past a
    checkpoint. Each re-run resumes with the same queue, plans and producers. The call that resumes
    (a new container) reports every epoch's audit, not only its own: in `cellfeed status --json` and
    in the last status on the Volume that the report plots. The campaign is balanced
    (`--balance-by tissue --balance-power 1`): the cell logs of the three attempts hold every tissue
    at its quota in each epoch, and the audit says so. (One campaign for both: each check is the
    same as in a campaign of its own, and each campaign here costs ~25 CPU-s.)"""
    from cellfeed_testing.procs import stop_asked_while_held

    audited_0 = re.compile(r"epoch 0: [\d,]+ cells trained, 0 missing, 0 duplicated")
    tissue, names, counts, quotas = tissue_quotas(atlas)
    with control_plane(tmp_path) as plane:
        balanced = dict(balance_by="tissue", balance_power=1)
        args = flags(atlas, rpc_latency_ms=25, batch_size=32, producers=2, **balanced) + ["--audit-cells"]
        proc = modal_run(plane, args, tmp_path)  # 2 epochs x 21 steps
        call = train_started(plane, proc)
        wait_for(lambda: len(calls(plane, "produce")) == 2, "the fleet to be spawned", timeout=180)
        plane.preempt(call["id"])  # in its first minute
        call = train_started(plane, proc, attempts=2)
        during = plane.describe()
        assert f"cellfeed-{RUN}" in during["queues"] and f"cellfeed-{RUN}" in during["dicts"]  # not cleaned up
        # the events: epoch 0 audited, and training past a checkpoint (every 4 steps) of epoch 1
        task = rank0_task(call)

        def in_epoch_1() -> bool:
            rows = step_rows(plane, task)
            return bool(audited_0.search(plane.container_log(task)) and rows and rows[-1]["step"] >= 27)

        wait_for(lambda: in_epoch_1() or proc.poll() is not None, "epoch 0's audit and six steps of epoch 1", 300)
        assert proc.poll() is None, "the campaign ended before its second preemption"
        # preempted while its ranks are held: from here to the campaign's end is 15 steps (~1.5 s), which a
        # loaded machine could spend between the check above and the SIGINT; held, they wait for it
        preempting = threading.Thread(target=plane.preempt, args=(call["id"],), daemon=True)
        pid = call["attempts"][-1]["containers"][0]["pid"]
        stop_asked_while_held(pid, 2, preempting.start, wait_for, sig=signal.SIGINT)
        preempting.join(timeout=120)
        code, out, err = finish(proc)
        assert code == 0, err[-3000:]
        (train,) = calls(plane, "train")
        assert [a["outcome"] for a in train["attempts"]] == ["preempted", "preempted", "success"]
        # the second preemption's SIGINT reached every process of the container at once: the function's,
        # the rank server and both ranks (each took it as a request to checkpoint at its next step)
        assert train["attempts"][1]["containers"][0]["interrupted_processes"] >= 4
        logs = [logs_of(plane, train, a) for a in range(3)]
        assert all("reusing the 2 producers still running" in log for log in logs[1:])
        assert "preempted: the ranks checkpoint" in logs[1]
        resumed = re.search(r"resumed from step (\d+) \(epoch (\d+), ([\d,]+) cells of it already trained\)", logs[2])
        assert resumed and int(resumed[1]) >= 24 and int(resumed[2]) == 1, logs[2][-2000:]  # mid-epoch 1
        check_campaign(plane, out, epochs=2, producers=2)
        assert compiled_by_setup(plane)  # (while it produced the held-out set)
        after = cellfeed(plane, "status", RUN, "--modal", "--json")  # (the Dict is gone: the Volume's copy)
        assert after.returncode == 0, after.stderr[-2000:]
        snap = json.loads(after.stdout)
        assert snap["state"] == "complete" and [a["epoch"] for a in snap["audits"]] == [0, 1], snap["audits"]
        assert all(a["missing"] == 0 and a["duplicated"] == 0 for a in snap["audits"])
        plotted = json.loads((plane.volume_dir / RUN / "state.json").read_text())["audits"]  # (the audit plot's bars)
        assert [a["epoch"] for a in plotted] == [0, 1]
        trained = trained_cells(plane)
        for epoch in (0, 1):
            got = Counter(tissue[list(trained[epoch].elements())].tolist())
            assert [got[n] for n in names] == quotas.tolist(), epoch
        assert counts.min() < quotas.min()  # small tissues repeat
        assert all(f"{len(names)} classes at their quotas" in log for log in logs[1:])


def test_a_producer_that_keeps_failing_stops_the_run_in_one_line_and_its_printed_command_resumes_it(
    corpus, tmp_path, kernel_volume
):
    """A real failure stops the campaign but deletes nothing: the run's queue and dicts stay, the
    last lines say how to resume, and that very command (the fault mended) completes the campaign,
    every epoch exactly once. Each failing attempt is a container whose import fails before the
    body (the plane's K6): modal's own client reports it, retries it (retries=3) and raises it.
    The campaign is a corpus (`--corpus FILE --vocabulary FILE`): the containers cannot read the
    laptop's files, so the entrypoint carries them, on the first run and again on the resume; every
    source trains its quota, the vocabulary is the file's. (One campaign for both: each campaign
    here costs ~15-25 CPU-s. Its setup loads the session's token pass: that a setup with no held-out
    set tokenizes every source's first cells is tests/test_corpus.py's, and that a setup compiles into
    an empty Volume is the whole-path campaign's.)"""
    from coordination.corpus_file import CorpusSpec
    from coordination.vocab import GeneVocab
    from producers.sources import open_sources

    path, offsets, quotas = corpus
    identifiers = [s.identifiers for s in open_sources(CorpusSpec.read(path))]
    vocab = GeneVocab.build(identifiers + [[f"EXTRA{i}" for i in range(10)]])  # 10 genes no source has
    (tmp_path / "vocab.json").write_text(json.dumps(vocab.ids))
    # (one rank is enough here; batches of 64: the epoch's 2,400 cells are 38 steps)
    args = ["--corpus", path, "--vocabulary", str(tmp_path / "vocab.json"), "--run", RUN, "--producers", "2",
            "--gpus", "1", "--batch-size", "64", "--max-genes", "32", "--preset", "tiny", "--epochs", "1",
            "--warmup-steps", "2", "--checkpoint-every", "50"]  # fmt: skip
    with control_plane(tmp_path, kernel_volume) as plane:
        plane.fail("produce", times=8)  # every attempt of both producers (1 + retries=3 each): then mended
        code, out, err = finish(modal_run(plane, args, tmp_path))
        assert code != 0
        assert f"vocabulary of {vocab.n_genes:,} genes" in out  # the file's (the sources hold 10 fewer)
        assert "1,440 cells per epoch from atlas_a" in out and "240 cells per epoch from pbmc" in out
        lines = [line for line in err.splitlines() if "Modal's retries spent" in line]
        assert lines and re.search(
            r"producer-\d failed 4 times, Modal's retries spent \(RuntimeError: injected "
            r"fault\); the run stops: mend the cause, then run again with --resume",
            lines[-1],
        ), err[-3000:]
        produce = calls(plane, "produce")
        assert [len(c["attempts"]) for c in produce] == [4, 4]  # 1 + retries=3
        assert all(a["outcome"] == "failure" for c in produce for a in c["attempts"])
        described = plane.describe()
        assert described["queues"] == [f"cellfeed-{RUN}"] and f"cellfeed-{RUN}" in described["dicts"]  # kept
        assert not [c for c in described["calls"] if c["status"] == "running"]
        command = resume_command(err)
        assert command[:3] == ["modal", "run", "app/modal_app.py"] and command[-3:] == ["--run", RUN, "--resume"]
        code, out, err = finish(modal_run(plane, command[3:], tmp_path))  # (after `modal run app/modal_app.py`)
        assert code == 0, err[-3000:]
        logs = "".join(logs_of(plane, c) for c in train_calls(plane))
        assert "epoch 0: 2,400 cells trained, 0 missing, 0 duplicated" in logs, logs[-3000:]
        # audited once, exactly once; the queue and dicts deleted; nothing running; the verdict; the 2
        # producers that failed 4 times each, then the resume's 2; a setup for each `modal run`
        check_campaign(plane, out, epochs=1, producers=4, setups=2)


def test_a_campaign_through_the_planes_own_run_command_trains_every_cell_once(atlas, tmp_path, kernel_volume):
    """The product's own `modal run app/modal_app.py` served by the plane's own command-line tool,
    as a user runs it (`python -m cellfeed_testing.modal_control_plane run ... -- CMD`: its default
    Secret and mounts, and the kernels Volume kept across planes with `--lasting-volume`): setup, a
    producer, a train, Queue, Dict and the checkpoints Volume, every cell once."""
    kernels = f"cellfeed-kernels={kernel_volume['cellfeed-kernels']}"
    compiled = lambda folder: list(folder.glob(f"{RUN}/producers/token_kernel._tokenize-*.nbi"))  # noqa: E731
    published_before, started = compiled(kernel_volume["cellfeed-kernels"]), time.time()
    args = flags(atlas, producers=1, gpus=1, batch_size=64, epochs=1)
    proc = subprocess.run(
        [sys.executable, "-m", "cellfeed_testing.modal_control_plane", "run", "--root", str(tmp_path / "root"),
         "--lasting-volume", kernels, "--", sys.executable, "-m", "modal", "run", "app/modal_app.py", *args],
        cwd=ROOT, env=laptop_env(), capture_output=True, text=True, timeout=CAMPAIGN_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    # the campaign's verdict is the last line, after modal's own "App completed" and the containers' last logs
    assert any(x.startswith("✓ App completed.") for x in lines), lines[-5:]
    assert lines[-1] == "complete: 1 epoch, 1,344 cells, every epoch trained exactly once (audited)", lines[-5:]
    # the step log is on the Volume's committed folder (train committed it)
    assert list((tmp_path / "root" / "volumes").glob(f"*/{RUN}/steps.jsonl"))
    # --lasting-volume: an earlier plane's compiled pass was this plane's from its start (its index files keep
    # their times: loaded, not compiled again); else this plane's own was published for the next
    if published_before:
        indexes = [f for volume in (tmp_path / "root" / "volumes").iterdir() for f in compiled(volume)]
        assert indexes and all(f.stat().st_mtime < started for f in indexes), indexes
    else:
        assert compiled(kernel_volume["cellfeed-kernels"])


EXPIRY_CLIENT = """
import json, sys
from dataclasses import asdict

from app.config import CampaignConfig
from coordination.backends import connect
from coordination.routing import EVAL_PARTITION, summary_key
from coordination.summary import SetupFacts
import app.modal_app as m

cfg = CampaignConfig(dataset=sys.argv[1], run="expiry", gpus=2, epochs=2, eval_filter="plate = 'plate14'",
                     eval_cells=64, max_genes=32).validate()
config = asdict(cfg)


def state(step):
    print(json.dumps({"step": step, "held_out": queue.len(partition=EVAL_PARTITION),
                      "plans": [summary_key(cfg.run, e) in store for e in range(cfg.epochs)]}), flush=True)


with m.app.run():
    facts = SetupFacts(**m.setup.remote(config))
    print(json.dumps({"held_out_items": facts.held_out_items}), flush=True)
    queue, store = connect(cfg.backend_spec("modal"))
    for step in ("setup", "ensured", "advanced 25 h", "ensured again", "advanced 8 days", "ensured at last"):
        if step.startswith("advanced"):
            sys.stdin.readline()  # the test moves the plane's clock on, then says so
        if step.startswith("ensured"):
            m.ensure_setup(cfg, config, facts, queue, store)
        state(step)
"""


def test_an_expired_setup_is_done_again(atlas, tmp_path, kernel_volume):
    """Modal clears a queue partition 24 h after its last put and a Dict entry after 7 days
    unused: a train call that finds the held-out set or a plan gone runs `setup` again. The laptop
    side is modal's client in a process of its own (`app.run()`, `setup.remote`, the run's Queue and
    Dict); the plane's clock is moved on between its steps (C7, C10)."""
    with control_plane(tmp_path, kernel_volume) as plane:
        client = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(EXPIRY_CLIENT), atlas.uri],
            cwd=ROOT,
            env=client_env(plane),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def next_state() -> dict:
            while line := client.stdout.readline():  # (a blocking read: the client's own timeouts bound it)
                if line.startswith("{"):
                    return json.loads(line)
            raise AssertionError("the client ended: " + client.communicate(timeout=60)[1][-3000:])

        def advance(seconds: float) -> dict:
            plane.advance(seconds)
            client.stdin.write("advanced\n")
            client.stdin.flush()
            return next_state()

        try:
            items = next_state()["held_out_items"]
            assert items > 0
            assert next_state() == {"step": "setup", "held_out": items, "plans": [True, True]}
            assert next_state() == {"step": "ensured", "held_out": items, "plans": [True, True]}
            assert len(calls(plane, "setup")) == 1  # all there: nothing to do
            # the held-out partition's day is over
            assert advance(25 * 3600) == {"step": "advanced 25 h", "held_out": 0, "plans": [True, True]}
            assert next_state() == {"step": "ensured again", "held_out": items, "plans": [True, True]}
            assert len(calls(plane, "setup")) == 2
            # a week unused: the plans are gone (and the held-out set, a day after its last put)
            assert advance(8 * 24 * 3600) == {"step": "advanced 8 days", "held_out": 0, "plans": [False, False]}
            assert next_state() == {"step": "ensured at last", "held_out": items, "plans": [True, True]}
            assert len(calls(plane, "setup")) == 3
            _, err = client.communicate(timeout=120)
            assert client.returncode == 0, err[-3000:]
        finally:
            if client.poll() is None:
                client.kill()
                client.communicate()


def cellfeed(plane: ControlPlane, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`cellfeed ARGS` on the laptop, with modal's own client against the plane."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=ROOT,
        env=client_env(plane),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_status_and_stop_from_the_laptop_then_the_readmes_resume_finishes_the_campaign(atlas, tmp_path, kernel_volume):
    """`cellfeed status RUN --modal` reads a running campaign's Dict (no GPU started); `cellfeed stop
    RUN --modal` in epoch 1 of 3 has its ranks checkpoint and its producers stop, the state kept; the
    run's last line says where it stopped and exits 0; then exactly the README's `modal run
    app/modal_app.py --run RUN --resume` (the campaign from the run's record on the Volume) completes
    it, every epoch's cells once across the stop. The stop is asked of held ranks and they are let go
    once it is theirs (`cellfeed_testing.procs.stop_asked_while_held`): it lands before the end."""
    from cellfeed_testing.procs import stop_asked_while_held

    with control_plane(tmp_path, kernel_volume) as plane:
        # 3 epochs of 21 steps (batches of 32 on 2 ranks), at Modal's 25 ms a call
        proc = modal_run(plane, flags(atlas, rpc_latency_ms=25, epochs=3, batch_size=32) + ["--audit-cells"], tmp_path)
        call = train_started(plane, proc)
        task = rank0_task(call)
        wait_for(lambda: epoch_logged(plane, task) >= 1 or proc.poll() is not None, "a step of epoch 1", timeout=300)
        assert proc.poll() is None, "the campaign ended before epoch 1: " + finish(proc)[2][-2000:]

        def status():
            out = cellfeed(plane, "status", RUN, "--modal", "--json")
            assert out.returncode == 0, out.stderr[-2000:]
            return json.loads(out.stdout)

        def held_in_epoch_1() -> dict:  # (while the ranks are held: still in epoch 1, and its status)
            from coordination.routing import state_key

            assert epoch_logged(plane, task) == 1, "the campaign was past epoch 1 before its ranks were held"
            # the status the train function puts in the run's Dict every 5 s: one of epoch 1, seen in the
            # plane (a `cellfeed status` a look started ~10 processes), then the command once
            published = lambda: json.loads(plane.dict_value(f"cellfeed-{RUN}", state_key(RUN)) or "{}")  # noqa: E731
            wait_for(lambda: published().get("epoch", -1) >= 1, "the status in epoch 1 (every 5 s)")
            snap = status()
            assert snap["epoch"] >= 1, snap
            return snap

        snap, stopper = stop_asked_while_held(
            call["attempts"][0]["containers"][0]["pid"],
            2,
            lambda: subprocess.Popen(
                [sys.executable, "-m", "app.cli", "stop", RUN, "--modal"],
                cwd=ROOT, env=client_env(plane), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ),
            wait_for,
            during=held_in_epoch_1,
        )  # fmt: skip
        assert snap["state"] == "running" and snap["epochs"] == 3 and snap["cells_per_epoch"] == 1344
        assert snap["loss"] > 0 and len(snap["producers"]) == 1 and len(snap["queue"]["ranks"]) == 2
        stop_out, stop_err = stopper.communicate(timeout=120)
        assert stopper.returncode == 0, stop_out[-2000:] + stop_err[-2000:]
        assert re.search(rf"run {RUN} stopped at step \d+ \(checkpoint at step \d+\)", stop_out), stop_out
        code, out, err = finish(proc)
        assert code == 0, err[-3000:]
        assert f"watch it from another terminal: cellfeed status {RUN} --modal | cellfeed stop {RUN} --modal" in out
        last = verdict_line(out)
        stopped = re.match(r"stopped at step (\d+) as asked: 1 of 3 epochs complete; .*; resume: (modal run .*)$", last)
        assert stopped, last
        assert f"cellfeed-{RUN}" in plane.describe()["dicts"]  # kept for the resume
        assert json.loads(cellfeed(plane, "status", RUN, "--modal", "--json").stdout)["state"] == "stopped"
        code, out, err = finish(modal_run(plane, ["--run", RUN, "--resume", "--batch-size", "64"], tmp_path))
        assert code == 2 and "Traceback" not in err, err[-2000:]
        assert f"cellfeed: error: --batch-size 64: run {RUN} was started with " in err, err[-2000:]
        code, out, err = finish(modal_run(plane, ["--run", RUN, "--resume"], tmp_path))  # the README's, as written
        assert code == 0, err[-3000:]
        assert verdict_line(out).startswith("complete: 3 epochs, ")
        assert [trained_cells(plane).get(e) for e in (0, 1, 2)] == [training_cells(atlas)] * 3
        # the Dict is gone with the campaign; its last status stayed on the Volume
        after = json.loads(cellfeed(plane, "status", RUN, "--modal", "--json").stdout)
        assert after["state"] == "complete" and after["cells_per_epoch"] == 1344
        assert [a["epoch"] for a in after["audits"]] == [0, 1, 2]  # every epoch, across the new call
        # the report from the Volume's copy of the run (`modal volume get cellfeed-checkpoints RUN ...`)
        page = tmp_path / "report.html"
        made = cellfeed(plane, "report", RUN, "--workdir", str(plane.volume_dir), "--out", str(page))
        assert made.returncode == 0 and page.read_text().count("<svg") == 7, made.stderr[-2000:]
        assert {
            e["event"] for e in map(json.loads, (plane.volume_dir / RUN / "events.jsonl").read_text().split("\n")[:-1])
        } >= {"started", "stop asked", "stopped", "resumed", "complete"}


# --nodes 2: modal.clustered's docs ask each container of a cluster for all GPUs of its host, and the
# product refuses fewer (app/modal_app.py: --gpus 8). Here a "GPU" is a CPU rank: 2 nodes x 8 ranks on
# this machine's cores, with batches of 4 a rank (64 cells a step: an epoch of 1,344 cells is 21 steps).
NODES = dict(gpus=8, nodes=2, epochs=1, batch_size=4, producers=2)


def views_committed(plane: ControlPlane, tasks: list[str]) -> bool:
    """Whether every file of the run that these containers wrote to their views of the Volume is in
    the committed Volume as written (V8's background commits have caught up with them)."""
    for task in tasks:
        view = plane.volume_view(task)
        for path in (view / RUN).rglob("*") if view else ():
            if path.is_file():
                committed = plane.volume_dir / path.relative_to(view)
                if not committed.exists() or committed.read_bytes() != path.read_bytes():
                    return False
    return True


def test_two_nodes_preempted_then_a_node_lost_then_resumed_on_one_node_train_every_cell_once(
    atlas, tmp_path, kernel_volume
):
    """`--nodes 2 --gpus 8`: `train_2_nodes`, a clustered function: each attempt is 2 containers
    started together (K1), each told its rank and both addresses by TaskClusterHello (`::1`, from
    `i6pn.modal.local`: K2); container 1's ranks join container 0's DDP world at the address it
    publishes. One campaign, one epoch, three events:
    1. preempted past a checkpoint: every container is interrupted (each node's ranks checkpoint at
       the same step) and the input runs again on a new cluster, which resumes;
    2. container 1 of that cluster is lost past its next checkpoint (SIGKILL, no grace: K4): the
       attempt fails with its cluster, the run stops with the command that resumes it, state kept.
       The campaign runs with `modal run --detach`, so its producers outlive the failed train and the
       laptop's exit (without it Modal stops the app's calls as `modal run` ends: D5);
    3. that command with `--nodes 1 --gpus 2` replaces the producers started for 16 ranks and
       finishes the epoch on one node of 2 ranks (the cells left re-planned over them).
    Every cell once across the three, from the cell logs of every container. (A container killed
    without a grace loses what it wrote since its Volume's last background commit, V8, as on Modal:
    the ranks are held while both containers' writes are committed, so the cell logs are whole.)"""
    from cellfeed_testing.procs import ranks_held

    with control_plane(tmp_path, kernel_volume) as plane:
        proc = modal_run(plane, flags(atlas, **NODES) + ["--audit-cells"], tmp_path, detach=True)
        call = train_started(plane, proc, "train_2_nodes")
        task = rank0_task(call)
        wait_for(lambda: steps_logged(plane, task) >= 6 or proc.poll() is not None, "six steps", timeout=300)
        assert proc.poll() is None, "the campaign ended before its preemption"
        plane.preempt(call["id"])  # past a checkpoint (every 4 steps): the whole cluster is interrupted
        call = train_started(plane, proc, "train_2_nodes", attempts=2)
        task = rank0_task(call)
        # the view holds the first attempt's steps too (it may have logged past 10 before the preemption
        # landed): two of this attempt's own, past the step it resumed from, and at least ten in all
        resumed = lambda: re.search(r"resumed from step (\d+)", logs_of(plane, call, 1))  # noqa: E731
        own = lambda: (m := resumed()) and steps_logged(plane, task) >= max(10, int(m[1]) + 2)  # noqa: E731
        wait_for(lambda: own() or proc.poll() is not None, "ten steps, two of them resumed", timeout=300)
        assert proc.poll() is None, "the campaign ended before its node was lost"
        containers = call["attempts"][1]["containers"]
        with contextlib.ExitStack() as held:
            for k in containers:
                held.enter_context(ranks_held(k["pid"], 8))
            wait_for(lambda: views_committed(plane, [k["task"] for k in containers]), "a background commit", 60)
            plane.lose_container(call["id"], 1)
        code, out, err = finish(proc)
        assert code != 0 and "container 1 of its cluster exited" in err, err[-3000:]
        assert f"campaign {RUN}: 2 producers -> 2 nodes x 8 x H100" in out
        (call,) = calls(plane, "train_2_nodes")
        assert call["cluster_size"] == 2 and call["gpu"] == "H100:8" and call["status"] == "failure"
        # each container resolved i6pn.modal.local (K2) and said hello with it: the rendezvous was at `::1`
        assert [a["cluster_ips"] for a in call["attempts"]] == [["::1", "::1"]] * 2
        assert [(a["outcome"], [k["rank"] for k in a["containers"]]) for a in call["attempts"]] == [
            ("preempted", [0, 1]),
            ("failure", [0, 1]),
        ]
        # both containers interrupted, each with its rank server and 8 ranks
        assert all(k["interrupted_processes"] >= 10 for k in call["attempts"][0]["containers"])
        assert "resumed from step" in logs_of(plane, call, 1)
        # each clustered container's processes ran both sitecustomizes (the i6pn resolver's, the image
        # guard's) once: the two chaining each other ran until Python's recursion limit, in every rank server
        assert "Error in sitecustomize" not in logs_of(plane, call), logs_of(plane, call)[-3000:]
        assert [k["killed"] for k in call["attempts"][1]["containers"]] == ["its cluster failed", "lost"]
        ranks = {p.name.split(".")[1] for p in (plane.volume_dir / RUN / "cells").glob("*.rank*.jsonl")}
        assert ranks == {f"rank{r}" for r in range(16)}  # node 1's ranks wrote from its own container
        command = resume_command(err)
        assert command[:3] == ["modal", "run", "app/modal_app.py"] and command[-1] == "--resume"
        code, out, err = finish(modal_run(plane, command[3:] + ["--nodes", "1", "--gpus", "2"], tmp_path))
        assert code == 0, err[-3000:]
        assert verdict_line(out).startswith("complete: 1 epoch, ")
        logs = "".join(logs_of(plane, c) for c in calls(plane, "train"))
        assert "were started for 16 ranks: cancelling them" in logs and "resumed from step" in logs
        # another world on Modal (16 ranks -> 2, one node of 2 GPUs): the epoch's cells left are
        # re-planned over the new ranks and the audit spans the resume
        assert "written by 16 ranks, its" in logs and "re-planned over 2" in logs, logs[-3000:]
        assert re.search(r"epoch 0: [\d,]+ cells trained, 0 missing, 0 duplicated .*across the resume", logs)
        assert trained_cells(plane).get(0) == training_cells(atlas)
