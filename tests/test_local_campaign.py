"""`cellfeed local` as a user runs it: every trainable tokenizer trains end to end with 1 and 2
ranks (real processes, gloo), a held-out split is never trained on, a step budget longer than an
epoch runs the epochs it needs, --resume says what it resumes, options may stand among paths, and
a small real dataset gives every producer and rank work."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from benchmarks.chaos import trained_per_epoch
from cellfeed_testing.procs import children, cmdline, descendants, own_rank_server, ranks_held
from tests.conftest import PBMC, built_once, wait_for

ROOT = Path(__file__).resolve().parents[1]
EVAL = "plate = 'plate14'"


@pytest.fixture(scope="session")  # data only: built once per session (`built_once`), whatever order tests run in
def counts_atlas(tmp_path_factory):
    """600 synthetic cells with Geneformer's gene medians stored (`cellfeed stats`)."""
    from app.cli import main as cli
    from producers.dataset import open_dataset

    def build(folder: Path) -> None:
        out = str(folder / "ds")
        assert cli(["synth", out, "--cells", "600", "--genes", "3000", "--rows-per-fragment", "40000", "--quiet"]) == 0
        assert cli(["stats", out, "--quiet"]) == 0

    return open_dataset(built_once(tmp_path_factory, "counts-atlas", build) / "ds")


def local(args: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "local", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def start_local(args: list[str], **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", "local", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def interrupt(proc: subprocess.Popen) -> None:
    """If the campaign still runs (a failed check), Ctrl-C it: it stops its own children."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def training_began(proc: subprocess.Popen, steps: Path) -> None:
    """Wait until the campaign logged its first step (producers are mid-campaign then)."""
    wait_for(
        lambda: proc.poll() is not None or (steps.exists() and steps.read_text().strip()),
        "the campaign's first step",
        timeout=300,
    )  # 300: torch and gloo start slowly on a busy machine
    assert proc.poll() is None, "the campaign ended before its first step was seen: " + proc.communicate()[1][-2000:]


@pytest.mark.parametrize(
    "tokenizer, gpus, packed",
    [  # each tokenizer once (the alias for V2), one and two ranks; V2's cells packed 2 to a row of 52 tokens
        ("geneformer-v1", 1, False),
        ("geneformer", 2, True),
        ("scgpt", 1, False),
    ],
)
def test_every_tokenizer_trains_with_a_held_out_split_and_steps_beyond_an_epoch(
    counts_atlas, tmp_path, tokenizer, gpus, packed
):
    plates = np.asarray(counts_atlas.obs(["plate"]).column(0).to_pylist())
    held_out = set(np.flatnonzero(plates == "plate14").tolist())
    train = set(range(counts_atlas.n_cells)) - held_out
    assert held_out and train
    per_rank = -(-len(train) // gpus)  # about; the plan's largest rank decides
    steps = int(1.5 * per_rank / 16)  # more than one epoch of batches of 16
    out = local(
        [
            "--dataset",
            counts_atlas.uri,
            "--workdir",
            str(tmp_path),
            "--run",
            "t",
            "--tokenizer",
            tokenizer,
            "--gpus",
            str(gpus),
            "--producers",
            "2",
            "--max-genes",
            "24",
            "--batch-size",
            "16",
            "--steps",
            str(steps),
            "--eval-filter",
            EVAL,
            "--eval-every",
            "10",
            "--audit-cells",
            "--quiet",
        ]
        + (["--tokens-per-row", "52"] if packed else [])
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"{steps} steps of 16 cells per rank over 2 epochs" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "t" / "steps.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses)
    assert all(0 <= r["padding"] < 1 for r in rows if "loss" in r)
    epochs = trained_per_epoch(tmp_path / "t")
    assert set(epochs) == {0, 1}
    assert epochs[0] == Counter(train)  # the whole training split once, no held-out cell
    assert max(epochs[1].values()) == 1 and set(epochs[1]) <= train  # part of epoch 1, no duplicate
    assert sum(epochs[1].values()) > 0
    assert "held-out at step" in out.stdout
    assert f"epoch 0: {len(train):,} cells trained, 0 missing, 0 duplicated" in out.stdout  # the audit
    assert "epoch 1: 0 missing" not in out.stdout and "epoch 1: " not in out.stdout.replace("complete; epoch 1: ", "")
    assert (
        out.stdout.strip()
        .splitlines()[-1]
        .startswith(f"stopped at step {steps} as --steps asked: 1 of 2 epochs complete; epoch 1: ")
    )  # partial, as asked: exit 0
    # (a partial epoch has no audit line of its own; the last line counts its cells)


def test_steps_beyond_the_given_epochs_is_refused(counts_atlas, tmp_path):
    out = local(
        ["--dataset", counts_atlas.uri, "--workdir", str(tmp_path), "--steps", "1000", "--epochs", "1", "--quiet"]
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "cellfeed: error: --steps 1000 is more than --epochs 1 hold (10 steps of 32 cells per rank): raise "
        "--epochs, or leave it out to train as many epochs as the steps need"
    ]


def test_bad_eval_filter_names_the_option(counts_atlas, tmp_path):
    out = local(["--dataset", counts_atlas.uri, "--workdir", str(tmp_path), "--eval-filter", "plat = 'x'", "--quiet"])
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("cellfeed: error: bad --eval-filter \"plat = 'x'\": ") and "No field named plat" in line
    assert ".rs:" not in line and "/" not in line.split(": ", 2)[2]


def test_geneformer_on_floats_suggests_what_works(tmp_path):
    from app.cli import main as cli

    assert cli(["convert", str(PBMC), str(tmp_path / "pbmc"), "--layer", "raw.X", "--quiet"]) == 0
    out = local(
        ["--dataset", str(tmp_path / "pbmc"), "--workdir", str(tmp_path), "--tokenizer", "geneformer", "--quiet"]
    )
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "needs integer counts" in line and "--tokenizer scgpt" in line and "gene_medians" not in line


def test_resume_says_what_it_resumes_or_that_there_is_nothing(tmp_path):
    from app.config import CampaignConfig
    from app.local import describe_resume
    from coordination.errors import CellfeedError
    from trainer import checkpoint

    out = local(["--workdir", str(tmp_path), "--run", "nothing-yet", "--resume", "--quiet"])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"cellfeed: error: --resume: run 'nothing-yet' has no checkpoint in {tmp_path}/checkpoints/nothing-yet; "
        "leave out --resume to start it, or name an existing run with --run"
    ]
    folder = tmp_path / "ck" / "r" / "step-00000007"  # a 2-rank checkpoint at step 7, as the trainer saves it
    texts = [checkpoint.RankProgress(epoch=1, trained=trained).to_json() for trained in (40, 24)]
    checkpoint.save(folder.parent, 7, 1, 0, 2, checkpoint.RankProgress(), dict, lambda _: texts, lambda: None)
    cfg = CampaignConfig(dataset="-", run="r", checkpoint_dir=str(tmp_path / "ck"))
    assert describe_resume(cfg) == (
        f"resuming run r from its checkpoint at step 7 (epoch 1, 64 cells of that epoch already trained): {folder}"
    )
    with pytest.raises(CellfeedError, match="has no checkpoint"):
        describe_resume(CampaignConfig(dataset="-", run="other", checkpoint_dir=str(tmp_path / "ck")))


def test_convert_takes_options_between_paths(tmp_path):
    import anndata as ad

    from app.cli import main as cli
    from producers.dataset import open_dataset
    from tests.test_convert import assert_same_cells

    assert cli(["convert", str(PBMC), "--layer", "raw.X", str(tmp_path / "a"), "--quiet"]) == 0
    assert cli(["convert", "--quiet", str(PBMC), str(tmp_path / "b"), "--layer", "raw.X"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = ad.read_h5ad(PBMC).raw.X
    for name in ("a", "b"):
        assert_same_cells(open_dataset(tmp_path / name), raw)


def test_small_real_dataset_gives_every_producer_and_rank_work(tmp_path):
    from app.cli import main as cli
    from app.config import CampaignConfig
    from app.local import run_local

    assert cli(["convert", str(PBMC), str(tmp_path / "pbmc"), "--layer", "raw.X", "--quiet"]) == 0
    cfg = CampaignConfig(
        dataset=str(tmp_path / "pbmc"),
        run="pbmc",
        producers=2,
        gpus=2,
        batch_size=16,
        max_genes=32,
        preset="tiny",
        lr=3e-3,
        warmup_steps=2,
        checkpoint_every=1000,
    )
    summary = run_local(cfg, tmp_path, quiet=True, audit_cells=True)
    # the 700 cells are cut into units enough for both producers (70: 10 cells a unit), all produced.
    # Which producer made how many is timing: on a loaded machine one may start after the other has
    # taken every task (and report nothing), so the test does not ask each for a share
    assert sum(p.get("units", 0) for p in summary["producers"]) >= 70
    per_rank = [
        sum(
            len(json.loads(line)["cells"])
            for line in (tmp_path / "pbmc" / f"cells.rank{r}.jsonl").read_text().splitlines()
        )
        for r in range(2)
    ]
    assert min(per_rank) > 0 and sum(per_rank) == 700  # both ranks trained, every cell once
    assert [(a["epoch"], a["cells"], a["missing"], a["duplicated"]) for a in summary["audits"]] == [(0, 700, 0, 0)]


def test_status_line_shows_queue_tasks_and_producer_states(tmp_path):
    import time

    from app.config import CampaignConfig
    from app.status import StepLog, snapshot, status_line
    from coordination.queues import MemoryMap, MemoryQueue
    from coordination.routing import TASKS_PARTITION, producers_key, rank_partition
    from coordination.summary import SetupFacts

    cfg = CampaignConfig(dataset="x", run="s", gpus=2, checkpoint_dir=str(tmp_path / "checkpoints"))
    facts = SetupFacts(10, 14, 0, 1, (), "", 1, 700, 7, 7, 5, 10, 0, 0)
    queue, store = MemoryQueue(), MemoryMap()
    queue.put_many([b"a", b"b", b"c"], partition=rank_partition(1))
    queue.put(b"t", partition=TASKS_PARTITION)
    report = {"cells": 500, "units": 2, "busy_s": 0.25, "heard": time.time()}
    store.put(producers_key("s"), json.dumps({"p0": report, "p1": {**report, "units": 1}}))
    log = tmp_path / "steps.jsonl"
    log.write_text(
        json.dumps({"step": 3, "epoch": 0, "loss": 2.5, "cells": 64, "cells_per_s": 900.0, "step_s": 0.07,
                    "wait_ms_ranks": [1.0, 12.0], "ready_cells": 40}) + "\n"
        + json.dumps({"step": 3, "audit": {"epoch": 0, "cells": 700}}) + "\n"
    )  # fmt: skip
    snap = snapshot(cfg, facts, queue, store, StepLog(log), time.time(), ["p0", "p1", "p2", "p3"], [None, 0, None, -9])
    line = status_line(snap)
    assert "step 3/10" in line and "900 cells/s" in line and "wait 12ms" in line
    assert "units 3/7 done, 1 queued" in line and "queue r0:0 r1:3 items, 40 cells ready in the ranks" in line
    assert "producers working 2,000 cells/s, done, starting, failed (-9)" in line
    assert snap["wait_ms_ranks"] == [1.0, 12.0] and snap["audits"] == [{"epoch": 0, "cells": 700}]
    assert snap["eta_s"] == round(0.07 * 7, 1) and snap["epoch_cells_trained"] == 64 and snap["checkpoint"] is None


def test_a_killed_producer_is_restarted_and_every_epoch_is_still_exact(counts_atlas, tmp_path):
    run_dir = tmp_path / "kill"  # 4 epochs: the campaign runs on after the kill (the death is seen within 0.5 s)
    # a 4 s lease: the units the killed producer held are issued again after 4 s of its silence, not 12
    proc = start_local(
        [
            "--dataset",
            counts_atlas.uri,
            "--workdir",
            str(tmp_path),
            "--run",
            "kill",
            "--producers",
            "2",
            "--gpus",
            "2",
            "--max-genes",
            "24",
            "--batch-size",
            "16",
            "--epochs",
            "4",
            "--rpc-latency-ms",
            "20",
            "--lease-s",
            "4",
            "--audit-cells",
            "--quiet",
        ]
    )
    try:
        training_began(proc, run_dir / "steps.jsonl")
        producer = wait_for(lambda: child_named(proc.pid, "producer-0"), "the campaign's producer-0")
        os.kill(
            producer, signal.SIGKILL
        )  # our campaign's own child: its pid stays reserved until the campaign reaps it
        out, err = proc.communicate(timeout=400)  # bounds a broken run only
    finally:
        interrupt(proc)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    assert "producer-0 exited with code -9: restarting it in 1s (1 of 3 restarts)" in out
    epochs = trained_per_epoch(run_dir)
    everything = Counter(range(counts_atlas.n_cells))
    assert [epochs[e] for e in range(4)] == [everything] * 4  # 0 lost, 0 duplicated, in every epoch
    assert (
        out.strip().splitlines()[-1]
        == f"complete: 4 epochs, {4 * counts_atlas.n_cells:,} cells, every epoch trained exactly once (audited)"
    )
    again = local(
        [
            "--dataset",
            counts_atlas.uri,
            "--workdir",
            str(tmp_path),
            "--run",
            "kill",
            "--max-genes",
            "24",
            "--batch-size",
            "16",
            "--epochs",
            "4",
            "--resume",
            "--quiet",
        ]
    )  # a finished run: nothing to do
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-2000:]
    assert again.stdout.strip().splitlines()[-1].startswith("run kill is complete: 4 epochs trained")


@pytest.mark.parametrize("presses", [1, 2], ids=["once-graceful", "twice-at-once"])
def test_ctrl_c_stops_every_child_once_gracefully_twice_at_once(counts_atlas, tmp_path, presses):
    """Ctrl-C in the campaign's terminal (SIGINT to its foreground process group): the first asks the
    ranks to checkpoint after their step and stops the campaign like `cellfeed stop` (exit 0, the last
    line says where and how to resume); a second, sent once the first is being acted on, stops at once
    (exit 130). Either way every process the campaign started is gone."""
    proc = start_local(
        [
            "--dataset",
            counts_atlas.uri,
            "--workdir",
            str(tmp_path),
            "--run",
            "ctrlc",
            "--epochs",
            "20",
            "--max-genes",
            "24",
            "--quiet",
        ],
        start_new_session=True,
        env=own_rank_server(),  # its ranks below it, where the test looks
    )  # its own group, as a terminal's foreground job
    out = ""
    try:
        training_began(proc, tmp_path / "ctrlc" / "steps.jsonl")
        started = {pid: started_at(pid) for pid in descendants(proc.pid)}  # what this campaign started, no other's
        kinds = " ".join(" ".join(cmdline(pid)) for pid in started)
        assert all(k in kinds for k in ("coordination.local_backend", "app.fleet --produce", "trainer.launch")), kinds
        assert any(children(pid) for pid in started if "trainer.launch" in cmdline(pid))  # the rank server's ranks
        if presses == 1:
            os.killpg(proc.pid, signal.SIGINT)
        else:  # the second once the first is acted on (its line is printed), the ranks held meanwhile: the
            with ranks_held(proc.pid, 2):  # first's stop (checkpoint, ranks exit) cannot end before it lands
                os.killpg(proc.pid, signal.SIGINT)
                line = proc.stdout.readline()
                while line and not line.startswith("stopping (Ctrl-C)"):
                    out, line = out + line, proc.stdout.readline()
                assert line.startswith("stopping (Ctrl-C): the ranks checkpoint"), out[-2000:]
                os.killpg(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
        out += rest
    finally:
        interrupt(proc)
    if presses == 1:
        assert proc.returncode == 0, err[-2000:]
        last = out.strip().splitlines()[-1]
        stopped = re.match(
            r"stopped at step (\d+) as asked: \d+ of 20 epochs complete.*; checkpoint at step \1; resume: ", last
        )
        assert stopped and re.search(r"resume: cellfeed local --dataset .* --run ctrlc --resume --workdir ", last), last
        from trainer import checkpoint

        assert checkpoint.latest(tmp_path / "checkpoints" / "ctrlc").step == int(stopped[1])  # saved at the stop
        assert json.loads((tmp_path / "ctrlc" / "state.json").read_text())["state"] == "stopped"
    else:
        assert proc.returncode == 130
        assert err.strip().splitlines()[-1] == "cellfeed: interrupted" and "Traceback" not in err, err[-2000:]
    # the campaign killed (or stopped) each before exiting; a SIGKILLed process is gone moments later. 30 s only
    # bounds a process that outlived the campaign (that fails the test)
    wait_for(
        lambda: not [pid for pid, at in started.items() if running(pid, at)],
        "the queue server, producers and ranks to be gone after the campaign",
        timeout=30,
    )


def test_a_sigkilled_campaign_leaves_no_process_behind(counts_atlas, tmp_path):
    """`cellfeed local` killed outright (SIGKILL: no clean-up runs): its queue server and producers
    end with it (each watches a pipe from it), its ranks with their rank server."""
    proc = start_local(
        [
            "--dataset",
            counts_atlas.uri,
            "--workdir",
            str(tmp_path),
            "--run",
            "killed",
            "--epochs",
            "20",
            "--max-genes",
            "24",
            "--quiet",
        ],
        start_new_session=True,
        env=own_rank_server(),  # its rank server below it (a shared one's launcher gone: test_launch.py)
    )
    try:
        training_began(proc, tmp_path / "killed" / "steps.jsonl")
        started = {pid: started_at(pid) for pid in descendants(proc.pid)}
        kinds = " ".join(" ".join(cmdline(pid)) for pid in started)
        assert all(k in kinds for k in ("coordination.local_backend", "app.fleet --produce", "trainer.launch")), kinds
        proc.kill()
        proc.wait(timeout=30)
    finally:
        interrupt(proc)
    wait_for(
        lambda: not [pid for pid, at in started.items() if running(pid, at)],
        "the queue server, producers and ranks to end with the killed campaign",
        timeout=30,
    )


# --------------------------------------------------- this test's own processes, from /proc (Linux)


def child_named(pid: int, name: str) -> int | None:
    """The pid of `pid`'s child started as a producer `--name name`, if one runs."""
    for child, args in children(pid):
        if "--produce" in args and args[-2:] == ["--name", name]:
            return child
    return None


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def started_at(pid: int) -> str | None:
    """The process's start time (clock ticks after boot): with the pid, names one process for good."""
    fields = _stat(pid)
    return fields[19] if fields else None


def running(pid: int, at: str | None) -> bool:
    """Whether the process `pid` that started at `at` still runs (not gone, not a zombie)."""
    fields = _stat(pid)
    return bool(fields) and fields[19] == at and fields[0] not in ("Z", "X")


def test_an_incomplete_run_ends_with_its_numbers_and_a_non_zero_exit(tmp_path, monkeypatch, capsys):
    """The last line of `cellfeed local` is the verdict on the trainer's ledger of every asked
    epoch: a run whose epoch came out short (here forced: the ledger as such a run leaves it)
    prints INCOMPLETE with the numbers and exits 1; the same run complete exits 0."""
    import app.local
    from app.cli import main

    def finished(epoch_1_trained):
        ledger = [
            {"epoch": 0, "planned": 6000, "trained": 6000, "audited": True},
            {"epoch": 1, "planned": 6000, "trained": epoch_1_trained, "audited": epoch_1_trained == 6000},
        ]
        return lambda cfg, workdir, **kw: {
            "steps": 0,
            "producers": [],
            "epochs": ledger,
            "stopped": None,
            "last_step": 750,
            "audits": [],
        }

    args = ["local", "--dataset", str(tmp_path / "ds"), "--workdir", str(tmp_path), "--epochs", "2", "--quiet"]
    monkeypatch.setattr(app.local, "run_local", finished(5472))
    assert main(args) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == "INCOMPLETE: epoch 1: 5,472 of 6,000 cells trained"
    monkeypatch.setattr(app.local, "run_local", finished(6000))
    assert main(args) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("complete: 2 epochs, 12,000 cells")


def test_a_trainer_killed_on_three_ranks_resumes_on_one_from_the_default_workdir(counts_atlas, tmp_path):
    """As the README says it, from a user's own folder and the default (relative) `runs`: a
    3-rank campaign whose whole trainer is SIGKILLed mid-epoch after a checkpoint, then `--resume
    --gpus 1` from the same folder, its batches packed from there on (`--tokens-per-row`: a resume may
    change how a batch is laid out). From the cell logs (the first run's up to its checkpoint, the
    resumed run's whole): every epoch trains every cell exactly once, across 3 -> 1 ranks."""
    import re
    import shutil

    common = [
        "--dataset",
        counts_atlas.uri,
        "--run",
        "el",
        "--producers",
        "2",
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--max-genes",
        "24",
        "--checkpoint-every",
        "4",
        "--audit-cells",
        "--quiet",
    ]
    env = dict(own_rank_server(), PYTHONPATH=str(ROOT))  # its ranks below it: the test kills them
    run_dir = tmp_path / "runs" / "el"
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "local", *common, "--gpus", "3"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # 13 steps an epoch (48 cells a step): past step 6 a checkpoint (step 4) is written and epoch 0 is not done
        wait_for(
            lambda: (
                proc.poll() is not None
                or ((run_dir / "steps.jsonl").exists() and (run_dir / "steps.jsonl").read_text().count('"loss"') >= 6)
            ),
            "step 6",
            timeout=300,
        )
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        ranks = [pid for pid in descendants(proc.pid) if "trainer." in " ".join(cmdline(pid))]
        assert ranks
        for pid in ranks:  # the whole trainer, at once (the rank server and its ranks: this campaign's own)
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        interrupt(proc)
    first = tmp_path / "first"
    first.mkdir()
    for log in run_dir.glob("cells.rank*.jsonl"):
        shutil.copy(log, first / log.name)
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "local", *common, "--gpus", "1", "--tokens-per-row", "52", "--resume"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "--tokens-per-row 52 from this resume on (the campaign had none)" in out.stdout + out.stderr
    resumed_at = int(re.search(r"checkpoint at step ([\d,]+)", out.stdout).group(1).replace(",", ""))
    assert 0 < resumed_at < 13  # inside epoch 0
    epochs: dict = {}
    for folder, before in ((first, resumed_at), (run_dir, None)):
        for log in folder.glob("cells.rank*.jsonl"):
            for row in map(json.loads, log.read_text().splitlines()):
                if before is None or row["step"] < before:
                    epochs.setdefault(row["epoch"], Counter()).update(row["cells"])
    assert len(list(first.glob("cells.rank*.jsonl"))) == 3 and len(list(run_dir.glob("cells.rank*.jsonl"))) == 1
    assert [epochs.get(e) for e in (0, 1)] == [Counter(range(counts_atlas.n_cells))] * 2
    assert (
        out.stdout.strip().splitlines()[-1]
        == f"complete: 2 epochs, {2 * counts_atlas.n_cells:,} cells, every epoch trained exactly once (audited)"
    )


def test_the_status_answers_before_any_rank_starts_on_a_loaded_machine(counts_atlas, tmp_path, monkeypatch):
    """`cellfeed status` read "no status yet: it is starting" after a run on a loaded machine had
    logged 30 steps: the monitor that publishes the status was made after the ranks started, and
    its first snapshot waited on TensorBoard's import (tens of seconds under load). Now the status is
    published before any rank starts: checked at the moment the first rank would start (the
    launch, stood in for here), with every core busy."""
    import app.local
    from app.config import CampaignConfig
    from app.journal import Journal
    from app.ops import describe

    seen = []

    def launch(*args, **kwargs):  # the first rank's start: what would `cellfeed status` read now?
        seen.append(Journal(tmp_path / "busy").read_state())
        raise KeyboardInterrupt  # (the campaign ends here, cleaning up as after a Ctrl-C)

    monkeypatch.setattr(app.local, "launch", launch)
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        cfg = CampaignConfig(dataset=counts_atlas.uri, run="busy", producers=1, gpus=1, preset="tiny", max_genes=24)
        with pytest.raises(KeyboardInterrupt):
            app.local.run_local(cfg, tmp_path, quiet=True)
    finally:
        for p in load:
            p.kill()
            p.wait()
    assert seen and seen[0]["state"] == "running" and seen[0]["step"] == 0 and seen[0]["run"] == "busy"
    assert describe(seen[0]).startswith("run busy: running")


def test_the_slow_step_note_advises_only_what_would_change_something():
    from app.config import CampaignConfig
    from app.local import slow_step_note

    snap = {"step_s": 3.2, "step": 5, "eta_s": 7200}

    def note(**settings):
        return slow_step_note(CampaignConfig(dataset="d", batch_size=32, **settings), snap)

    assert note(preset="tiny", max_genes=64).endswith("batches of 32): about 2.0 h to go")  # nothing left to advise
    assert "CPU ranks suit --max-genes 64 (a new --run)" in note(preset="tiny", max_genes=256)
    assert "CPU ranks suit --preset tiny with --max-genes 64" in note(preset="scgpt", max_genes=1200)
    assert slow_step_note(CampaignConfig(dataset="d"), {**snap, "step_s": 0.5}) is None  # not slow: no note
