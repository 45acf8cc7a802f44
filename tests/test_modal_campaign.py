"""The Modal path, whole, on the Modal emulator (not a Modal run): `modal run app/modal_app.py`'s
entrypoint → setup → train (2 CPU ranks, gloo) → spawned producers → the end, each function under
its own image: preempted in its first minute and again mid-epoch (SIGINT to every process of the
container, at Modal's 25 ms a call), with a producer that keeps failing (the run stops, keeps its
state, and its printed command resumes it), and as a campaign longer than Modal's limit on a call
(on the emulator's fast clock). A failing network (outages past Modal's own retries, lost replies,
a producer preempted) is tests/test_benchmarks.py::test_modal_chaos: the same campaign, its cells
checked one by one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cellfeed_testing.modal_emulator import ModalEmulator
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]
RUN = "emu"


@pytest.fixture(scope="session")  # data only: built once per worker, whatever order tests run in
def atlas(tmp_path_factory):
    """1,500 cells in small fragments; plate14's cells are the held-out set. 2,000 genes, not a
    real atlas's 62,710: the tiny model's embedding (and each step's all-reduce) is then small, and
    the path under test (calls, preemptions, hand-overs) is the same."""
    from producers.synth import SynthSpec, synthesize

    out = tmp_path_factory.mktemp("modal-atlas") / "atlas"
    return synthesize(
        str(out),
        SynthSpec(n_cells=1500, n_genes=2000, median_nnz=300, seed=3),
        rows_per_fragment=200_000,
        progress=False,
    )


def flags(atlas, **changes) -> list[str]:
    base = dict(
        dataset=atlas.uri,
        run=RUN,
        producers=2,
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


def modal_run(world: ModalEmulator, args: list[str]) -> subprocess.Popen:
    """`modal run app/modal_app.py ARGS` against the emulator, in a process of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "cellfeed_testing.modal_emulator.run", "app/modal_app.py", *args],
        cwd=ROOT,
        env=world.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def container_log(world: ModalEmulator, call_id: str, attempt: int) -> str:
    return (world.root / "containers" / f"{call_id}-{attempt}" / "output.log").read_text(errors="replace")


def step_rows(world: ModalEmulator) -> list[dict]:
    """Rank 0's step rows, from the run's step log on the emulated Volume (every train call appends to it)."""
    path = world.volume_dir / RUN / "steps.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if '"loss"' in line and line.endswith("}")]


def steps_logged(world: ModalEmulator) -> int:
    """The last step rank 0 has logged (0: none yet)."""
    return max((row["step"] for row in step_rows(world)), default=0)


def epoch_logged(world: ModalEmulator) -> int:
    """The epoch of the last step rank 0 has logged (-1: none yet)."""
    rows = step_rows(world)
    return rows[-1]["epoch"] if rows else -1


def train_attempt_of(world: ModalEmulator, function: str) -> dict | None:
    """The running call of `function` once its first attempt has started."""
    return next((c for c in world.calls(function) if c["status"] == "running" and c["attempts"]), None)


def train_attempt(world: ModalEmulator, n: int = 0) -> dict | None:
    """The running train call once its attempt `n` has started."""
    calls = [c for c in world.calls("train") if c["status"] == "running" and len(c["attempts"]) > n]
    return calls[0] if calls else None


def check_campaign(world: ModalEmulator, out: str, *, epochs: int, producers: int) -> None:
    """Every epoch audited once, exactly once; the run's queue and dicts gone; no call left
    running; the fleet never doubled."""
    trains = [c for c in world.calls() if c["function"].startswith("train")]  # (`train_2_nodes`: --nodes 2)
    logs = "".join(container_log(world, c["id"], a) for c in trains for a in range(len(c["attempts"])))
    audits = re.findall(r"epoch (\d+): ([\d,]+) cells trained, 0 missing, 0 duplicated", logs)
    assert sorted(int(e) for e, _ in audits) == list(range(epochs)), logs[-3000:]
    assert "failed its exactly-once audit" not in logs
    world_now = world.describe()
    assert world_now["queues"] == [] and world_now["dicts"] == []  # deleted at the end
    assert not [c for c in world_now["calls"] if c["status"] in ("running", "pending")]
    assert len(world.calls("produce")) == producers  # reused across attempts, never doubled
    lines = out.strip().splitlines()
    assert len(world.calls("setup")) == 1 and json.loads(lines[-2])["steps"] > 0
    assert re.match(
        rf"complete: {epochs} epochs?, [\d,]+ cells, every epoch trained exactly once \(audited\)$", lines[-1]
    ), lines[-1]


def trained_cells(world: ModalEmulator) -> dict:
    """Per epoch, the multiset of cells the ranks trained, from every train call's --audit-cells
    files on the emulated Volume (one set per call, by start time): a call's rows at or past the
    step its successor resumed from were trained again there, so they are set aside."""
    from collections import Counter

    calls: dict[str, list[dict]] = {}
    for path in sorted((world.volume_dir / RUN / "cells").glob("*.rank*.jsonl")):
        calls.setdefault(path.name.split(".")[0], []).extend(
            json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")
        )
    out: dict = {}
    cut = float("inf")
    for started in sorted(calls, key=int, reverse=True):
        for row in calls[started]:
            if row["step"] < cut:
                out.setdefault(row["epoch"], Counter()).update(row["cells"])
        cut = min([cut] + [row["step"] for row in calls[started]])
    return out


def test_modal_run_whole_path_preempted_in_its_first_minute_and_again_mid_epoch(atlas, tmp_path):
    """At Modal's 25 ms a call: `train` is preempted as soon as its fleet is spawned (nothing to
    checkpoint yet), and its re-run is preempted again once training is past a checkpoint
    (mid-epoch 0). Each re-run resumes with the same queue, plans and producers."""
    with ModalEmulator(tmp_path / "world", grace_s=30) as world:
        proc = modal_run(world, flags(atlas, rpc_latency_ms=25, batch_size=32, epochs=1))  # 21 steps
        call = wait_for(lambda: train_attempt(world), "train to start")
        wait_for(lambda: len(world.calls("produce")) == 2, "the fleet to be spawned")
        world.preempt(call["id"])  # in its first minute
        wait_for(lambda: train_attempt(world, 1), "train's input to run again")
        during = world.describe()
        assert f"cellfeed-{RUN}" in during["queues"] and f"cellfeed-{RUN}" in during["dicts"]  # not cleaned up
        # the event: a checkpoint is written (every 4 steps) and training is past it
        wait_for(lambda: steps_logged(world) >= 6 or proc.poll() is not None, "six steps")
        world.preempt(call["id"])
        code, out, err = finish(proc)
        assert code == 0, err[-3000:]
        (train,) = world.calls("train")
        assert [a["outcome"] for a in train["attempts"]] == ["preempted", "preempted", "success"]
        # the second preemption's SIGINT reached every process of the container at once: the function's,
        # the rank server and both ranks (each took it as a request to checkpoint at its next step)
        assert train["attempts"][1]["interrupted_processes"] >= 4
        logs = [container_log(world, train["id"], a) for a in range(3)]
        assert all("reusing the 2 producers still running" in log for log in logs[1:])
        assert "preempted: the ranks checkpoint" in logs[1]
        resumed = re.search(r"resumed from step (\d+) \(epoch (\d+), ([\d,]+) cells of it already trained\)", logs[2])
        assert resumed and int(resumed[1]) >= 6 and int(resumed[2]) == 0, logs[2][-2000:]  # mid-epoch 0
        check_campaign(world, out, epochs=1, producers=2)


def test_a_producer_that_keeps_failing_stops_the_run_in_one_line_and_its_printed_command_resumes_it(atlas, tmp_path):
    """A real failure stops the campaign but deletes nothing: the run's queue and dicts stay, the
    last lines say how to resume, and that very command (the fault mended) completes the campaign,
    every epoch exactly once."""
    import shlex

    with ModalEmulator(tmp_path / "world", grace_s=10, retry_delay_s=0.2) as world:
        world.fail("produce", times=8)  # every attempt of both producers (1 + retries=3 each): then mended
        # (one rank is enough here; batches of 64: the resumed epoch is 21 steps, not 84)
        code, out, err = finish(modal_run(world, flags(atlas, epochs=1, gpus=1, batch_size=64)))
        assert code != 0
        lines = [line for line in err.splitlines() if "Modal's retries spent" in line]
        assert lines and re.search(
            r"producer-\d failed 4 times, Modal's retries spent \(RuntimeError: injected "
            r"fault\); the run stops: mend the cause, then run again with --resume",
            lines[-1],
        )
        assert all(len(c["attempts"]) == 4 for c in world.calls("produce"))  # 1 + retries=3
        described = world.describe()
        assert described["queues"] == [f"cellfeed-{RUN}"] and f"cellfeed-{RUN}" in described["dicts"]  # kept
        assert not [c for c in described["calls"] if c["status"] in ("running", "pending")]
        command = err.strip().splitlines()[-1].strip()
        assert err.strip().splitlines()[-2].endswith("Resume it with:") and command.startswith("modal run ")
        assert command.endswith(f"--run {RUN} --resume")
        resumed = modal_run(world, shlex.split(command)[3:])  # (after `modal run app/modal_app.py`)
        code, out, err = finish(resumed)
        assert code == 0, err[-3000:]
        trains = world.calls("train")
        logs = "".join(container_log(world, c["id"], a) for c in trains for a in range(len(c["attempts"])))
        assert re.search(r"epoch 0: [\d,]+ cells trained, 0 missing, 0 duplicated", logs), logs[-3000:]
        assert world.describe()["queues"] == [] and world.describe()["dicts"] == []  # complete: now deleted


def test_a_train_spawn_whose_reply_was_lost_trains_the_run_once(atlas, tmp_path):
    """The train spawn's reply is lost: the client spawns again (the emulator's worst reading of a
    retry, S21: a new call), and a second train call of the run starts. The one that claims the run
    first trains it; the other finds it held and does nothing; `modal run` follows the trainer, and
    the epoch is trained exactly once by one trainer and one fleet."""
    with ModalEmulator(tmp_path / "world") as world:
        world.fault("lost_reply", "spawn", after=1)  # setup's spawn goes through; train's reply is lost
        code, out, err = finish(modal_run(world, flags(atlas, epochs=1, gpus=1, batch_size=64)))
        assert code == 0, err[-3000:]
        trains = world.calls("train")
        assert len(trains) == 2, trains  # (the fault did make a second train call)
        logs = [container_log(world, c["id"], 0) for c in trains]
        assert sum(f"run {RUN} is already being trained by call" in log for log in logs) == 1, logs
        check_campaign(world, out, epochs=1, producers=2)


def test_a_campaign_longer_than_a_call_continues_in_new_calls(atlas, tmp_path):
    """Each train call hands over to a new one when its --attempt-hours are up (Modal ends a call
    at 24 h). Here the hours are up at once, so every call trains one step (the event), saves and
    hands over: an epoch of 3 steps spans 3 calls and is still trained exactly once; on the
    emulator's clock a day is three minutes (a minute was reached by a call on 2 cores under a load
    of 9, whose producers retire at 23 h), and no call reaches it."""
    with ModalEmulator(tmp_path / "world", grace_s=10, clock_speed=24 * 20) as world:
        # one rank, batches of 512: the epoch's 1,344 cells are 3 steps
        code, out, err = finish(modal_run(world, flags(atlas, epochs=1, gpus=1, batch_size=512, attempt_hours=1e-6)))
        assert code == 0, err[-3000:]
        trains = world.calls("train")
        assert len(trains) >= 3 and all(c["status"] == "success" for c in trains)
        # train.with_options(gpu=...) changes the GPUs only: every call keeps the function's 32 cores and
        # 128 GiB (modal/_function_variants.py: unset options are not sent; S25)
        assert {(c["gpu"], c["cpu"], c["memory"]) for c in trains} == {("H100:1", 32.0, 131_072)}
        assert out.count("train continues in call") == len(trains) - 1
        assert not [a for c in world.describe()["calls"] for a in c["attempts"] if a["outcome"] == "timeout"]
        check_campaign(world, out, epochs=1, producers=2)


def test_an_expired_setup_is_done_again(atlas, tmp_path):
    """Modal clears a queue partition 24 h after its last put and a Dict entry after 7 days
    unused: a train call that finds the held-out set or a plan gone runs `setup` again."""
    from dataclasses import asdict

    from app.config import CampaignConfig
    from coordination.backends import connect
    from coordination.routing import EVAL_PARTITION, summary_key
    from coordination.summary import SetupFacts
    from tests.conftest import fresh_import

    with ModalEmulator(tmp_path / "world") as world:
        world.install()
        with fresh_import("app.modal_app") as m:
            cfg = CampaignConfig(
                dataset=atlas.uri,
                run="expiry",
                gpus=2,
                epochs=2,
                eval_filter="plate = 'plate14'",
                eval_cells=64,
                max_genes=32,
            ).validate()
            config = asdict(cfg)
            facts = SetupFacts(**m.setup.remote(config))
            queue, store = connect(cfg.backend_spec("modal"))
            assert queue.len(partition=EVAL_PARTITION) == facts.held_out_items > 0
            m.ensure_setup(cfg, config, facts, queue, store)
            assert len(world.calls("setup")) == 1  # all there: nothing to do
            world.advance(25 * 3600)
            assert queue.len(partition=EVAL_PARTITION) == 0  # the held-out partition's day is over
            m.ensure_setup(cfg, config, facts, queue, store)
            assert len(world.calls("setup")) == 2 and queue.len(partition=EVAL_PARTITION) == facts.held_out_items
            world.advance(8 * 24 * 3600)
            assert summary_key(cfg.run, 1) not in store  # a week unused
            m.ensure_setup(cfg, config, facts, queue, store)
            assert len(world.calls("setup")) == 3 and all(summary_key(cfg.run, e) in store for e in range(2))


def test_modal_run_trains_a_corpus_with_its_files_carried_into_the_containers(corpus, tmp_path):
    """`modal run --corpus FILE --vocabulary FILE`: the containers cannot read the laptop's files,
    so the entrypoint carries them; every source trains its quota, the vocabulary is the file's."""
    from coordination.corpus_file import CorpusSpec
    from coordination.vocab import GeneVocab
    from producers.sources import open_sources

    path, offsets, quotas = corpus
    identifiers = [s.identifiers for s in open_sources(CorpusSpec.read(path))]
    vocab = GeneVocab.build(identifiers + [[f"EXTRA{i}" for i in range(10)]])  # 10 genes no source has
    (tmp_path / "vocab.json").write_text(json.dumps(vocab.ids))
    args = [
        "--corpus",
        path,
        "--vocabulary",
        str(tmp_path / "vocab.json"),
        "--run",
        RUN,
        "--producers",
        "2",
        "--gpus",
        "1",
        "--batch-size",
        "16",
        "--max-genes",
        "32",
        "--preset",
        "tiny",
        "--epochs",
        "1",
        "--warmup-steps",
        "2",
        "--checkpoint-every",
        "50",
    ]
    with ModalEmulator(tmp_path / "world") as world:
        code, out, err = finish(modal_run(world, args))
        assert code == 0, out[-2000:] + err[-3000:]
        assert f"vocabulary of {vocab.n_genes:,} genes" in out  # the file's (the sources hold 10 fewer)
        assert "1,440 cells per epoch from atlas_a" in out and "240 cells per epoch from pbmc" in out
        check_campaign(world, out, epochs=1, producers=2)
        logs = "".join(container_log(world, c["id"], 0) for c in world.calls("train"))
        assert "epoch 0: 2,400 cells trained, 0 missing, 0 duplicated" in logs


def test_a_rerun_with_another_gpus_count_resumes_the_epoch_on_it(atlas, tmp_path):
    """`modal run --resume --gpus 1` after a campaign on 2 GPUs stopped inside epoch 1 (its
    --steps): the checkpoint's epoch is finished on one rank, its rest re-planned, and audited
    across both runs."""
    with ModalEmulator(tmp_path / "world") as world:
        # batches of 32: 21 steps an epoch, so step 30 is inside epoch 1
        code, out, err = finish(
            modal_run(world, flags(atlas, steps=30, checkpoint_every=10, batch_size=32) + ["--audit-cells"])
        )
        assert code == 0, out[-2000:] + err[-3000:]
        assert out.strip().splitlines()[-1].startswith("stopped at step 30 as --steps asked: 1 of 2 epochs complete")
        code, out, err = finish(modal_run(world, flags(atlas, gpus=1, batch_size=32) + ["--resume", "--audit-cells"]))
        assert code == 0, out[-2000:] + err[-3000:]
        assert out.strip().splitlines()[-1].startswith("complete: 2 epochs, ")
        from collections import Counter

        held_out = set(np.flatnonzero(np.asarray(atlas.obs(["plate"]).column(0).to_pylist()) == "plate14").tolist())
        train_cells = Counter(c for c in range(atlas.n_cells) if c not in held_out)
        cells = trained_cells(world)  # the cell logs of both runs: every epoch exactly once, across 2 -> 1 ranks
        assert [cells.get(e) for e in (0, 1)] == [train_cells, train_cells]
        trains = world.calls("train")
        logs = container_log(world, trains[-1]["id"], 0)
        assert "written by 2 ranks, its" in logs and "re-planned over 1" in logs, logs[-3000:]
        assert re.search(r"epoch 1: [\d,]+ cells trained, 0 missing, 0 duplicated .*across the resume", logs), logs[
            -3000:
        ]


def cellfeed(world: ModalEmulator, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`cellfeed ARGS` on the laptop, whose `import modal` is the emulator's."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=ROOT,
        env=world.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_status_and_stop_from_the_laptop_then_the_readmes_resume_finishes_the_campaign(atlas, tmp_path):
    """`cellfeed status emu --modal` reads a running campaign's Dict (no GPU started); `cellfeed stop
    emu --modal` in epoch 1 of 3 has its ranks checkpoint and its producers stop, the state kept; the
    run's last line says where it stopped and exits 0; then exactly the README's `modal run
    app/modal_app.py --run emu --resume` (the campaign from the run's record on the Volume) completes
    it, every epoch's cells once across the stop. The stop is asked of held ranks and they are let go
    once it is theirs (`cellfeed_testing.procs.stop_asked_while_held`): it lands before the end."""
    from collections import Counter

    from cellfeed_testing.procs import stop_asked_while_held

    with ModalEmulator(tmp_path / "world", grace_s=10) as world:
        # 3 epochs of 42 steps (batches of 16), at Modal's 25 ms a call
        proc = modal_run(world, flags(atlas, rpc_latency_ms=25, epochs=3) + ["--audit-cells"])
        call = wait_for(lambda: train_attempt(world), "train to start")
        wait_for(lambda: epoch_logged(world) >= 1 or proc.poll() is not None, "a step of epoch 1")
        assert proc.poll() is None, "the campaign ended before epoch 1: " + proc.communicate()[1][-2000:]

        def status():
            out = cellfeed(world, "status", RUN, "--modal", "--json")
            assert out.returncode == 0, out.stderr[-2000:]
            return json.loads(out.stdout)

        def held_in_epoch_1() -> dict:  # (while the ranks are held: still in epoch 1, and its status)
            assert epoch_logged(world) == 1, "the campaign was past epoch 1 before its ranks were held"
            return wait_for(lambda: (s := status())["epoch"] >= 1 and s, "the status in epoch 1 (every 5 s)")

        snap, stopper = stop_asked_while_held(
            call["attempts"][0]["pid"],
            2,
            lambda: subprocess.Popen(
                [sys.executable, "-m", "app.cli", "stop", RUN, "--modal"],
                cwd=ROOT, env=world.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ),
            wait_for,
            during=held_in_epoch_1,
        )  # fmt: skip
        assert snap["state"] == "running" and snap["epochs"] == 3 and snap["cells_per_epoch"] == 1344
        assert snap["loss"] > 0 and len(snap["producers"]) == 2 and len(snap["queue"]["ranks"]) == 2
        stop_out, stop_err = stopper.communicate(timeout=120)
        assert stopper.returncode == 0, stop_out[-2000:] + stop_err[-2000:]
        assert re.search(r"run emu stopped at step \d+ \(checkpoint at step \d+\)", stop_out), stop_out
        code, out, err = finish(proc)
        assert code == 0, err[-3000:]
        assert "watch it from another terminal: cellfeed status emu --modal | cellfeed stop emu --modal" in out
        last = out.strip().splitlines()[-1]
        stopped = re.match(r"stopped at step (\d+) as asked: 1 of 3 epochs complete; .*; resume: (modal run .*)$", last)
        assert stopped, last
        assert f"cellfeed-{RUN}" in world.describe()["dicts"]  # kept for the resume
        assert json.loads(cellfeed(world, "status", RUN, "--modal", "--json").stdout)["state"] == "stopped"
        code, out, err = finish(modal_run(world, ["--run", RUN, "--resume", "--batch-size", "64"]))  # (from its record)
        assert code == 2 and "Traceback" not in err, err[-2000:]
        assert err.strip().splitlines()[-1].startswith("cellfeed: error: --batch-size 64: run emu was started with ")
        code, out, err = finish(modal_run(world, ["--run", RUN, "--resume"]))  # the README's resume, as written
        assert code == 0, err[-3000:]
        assert out.strip().splitlines()[-1].startswith("complete: 3 epochs, ")
        held_out = set(np.flatnonzero(np.asarray(atlas.obs(["plate"]).column(0).to_pylist()) == "plate14").tolist())
        train_cells = Counter(c for c in range(atlas.n_cells) if c not in held_out)
        assert [trained_cells(world).get(e) for e in (0, 1, 2)] == [train_cells] * 3
        # the Dict is gone with the campaign; its last status stayed on the Volume
        after = json.loads(cellfeed(world, "status", RUN, "--modal", "--json").stdout)
        assert after["state"] == "complete" and after["cells_per_epoch"] == 1344
        assert [a["epoch"] for a in after["audits"]] == [0, 1, 2]  # every epoch, across the new call
        # the report from the Volume's copy of the run (`modal volume get cellfeed-checkpoints emu ...`)
        page = tmp_path / "report.html"
        made = cellfeed(world, "report", RUN, "--workdir", str(world.volume_dir), "--out", str(page))
        assert made.returncode == 0 and page.read_text().count("<svg") == 7, made.stderr[-2000:]
        assert {
            e["event"] for e in map(json.loads, (world.volume_dir / RUN / "events.jsonl").read_text().split("\n")[:-1])
        } >= {"started", "stop asked", "stopped", "resumed", "complete"}


def test_modal_run_on_two_nodes_trains_every_cell_once(atlas, tmp_path):
    """`--nodes 2 --gpus 1`: `train_2_nodes`, a clustered function, runs each input in 2 containers
    started together (S27); container 1's rank joins container 0's DDP world at the address it
    publishes. Preempted mid-epoch (every container interrupted: each node's rank checkpoints at the
    same step), the input runs again on a new cluster and resumes. Every cell once, from the cell
    logs of both nodes and both attempts."""
    from collections import Counter

    with ModalEmulator(tmp_path / "world", grace_s=30) as world:
        proc = modal_run(world, flags(atlas, gpus=1, nodes=2, epochs=1, batch_size=16) + ["--audit-cells"])
        call = wait_for(lambda: train_attempt_of(world, "train_2_nodes"), "train to start")
        wait_for(lambda: steps_logged(world) >= 6 or proc.poll() is not None, "six steps")
        world.preempt(call["id"])  # past a checkpoint (every 4 steps): the whole cluster is interrupted
        code, out, err = finish(proc)
        assert code == 0, err[-3000:]
        assert "campaign emu: 2 producers -> 2 nodes x 1 x H100" in out
        (call,) = world.calls("train_2_nodes")
        assert [(a["outcome"], len(a["pids"])) for a in call["attempts"]] == [("preempted", 2), ("success", 2)]
        assert call["attempts"][0]["interrupted_processes"] >= 6  # both containers, each with its rank server and rank
        assert "resumed from step" in container_log(world, call["id"], 1)
        held_out = set(np.flatnonzero(np.asarray(atlas.obs(["plate"]).column(0).to_pylist()) == "plate14").tolist())
        train_cells = Counter(c for c in range(atlas.n_cells) if c not in held_out)
        assert trained_cells(world).get(0) == train_cells
        assert {p.name.split(".")[1] for p in (world.volume_dir / RUN / "cells").glob("*.rank*.jsonl")} == {
            "rank0",
            "rank1",
        }
        check_campaign(world, out, epochs=1, producers=2)


def test_a_node_lost_mid_epoch_on_modal_then_resumed_on_one_node_is_exact(atlas, tmp_path):
    """Container 1 of a 2-node train is lost mid-epoch, past a checkpoint (SIGKILL, no grace): the
    attempt fails with its cluster, the run stops with the command that resumes it, state kept. That
    command with `--nodes 1` replaces the producers started for 2 ranks and finishes the epoch on one
    node: every cell once across both, from the cell logs."""
    import shlex
    from collections import Counter

    with ModalEmulator(tmp_path / "world", grace_s=10) as world:
        proc = modal_run(world, flags(atlas, gpus=1, nodes=2, epochs=1, batch_size=16) + ["--audit-cells"])
        call = wait_for(
            lambda: next((c for c in world.calls("train_2_nodes") if c["status"] == "running"), None), "train"
        )
        wait_for(lambda: steps_logged(world) >= 6 or proc.poll() is not None, "six steps")
        assert proc.poll() is None
        world.lose_container(call["id"], 1)
        code, out, err = finish(proc)
        assert code != 0 and "container 1 of its cluster exited" in err, err[-3000:]
        command = shlex.split(err.strip().splitlines()[-1].strip())
        assert command[:3] == ["modal", "run", "app/modal_app.py"] and command[-1] == "--resume"
        code, out, err = finish(modal_run(world, command[3:] + ["--nodes", "1"]))
        assert code == 0, err[-3000:]
        assert out.strip().splitlines()[-1].startswith("complete: 1 epoch, ")
        logs = "".join(container_log(world, c["id"], 0) for c in world.calls("train"))
        assert "were started for 2 ranks: cancelling them" in logs and "resumed from step" in logs
        held_out = set(np.flatnonzero(np.asarray(atlas.obs(["plate"]).column(0).to_pylist()) == "plate14").tolist())
        assert trained_cells(world).get(0) == Counter(c for c in range(atlas.n_cells) if c not in held_out)


def test_a_balanced_campaign_preempted_on_modal_trains_every_tissue_at_its_quota(atlas, tmp_path):
    """`--balance-by tissue --balance-power 1` through `modal run`, preempted mid-epoch: the cell
    logs of both attempts hold every tissue at its quota (equal shares of the training cells, by
    largest remainder), and the audit says so."""
    from collections import Counter

    tissue = np.asarray(atlas.obs(["tissue"]).column(0).to_pylist())
    training = np.asarray(atlas.obs(["plate"]).column(0).to_pylist()) != "plate14"
    names, counts = np.unique(tissue[training], return_counts=True)
    share = len(tissue[training]) / len(names)  # ALPHA 1: every tissue the same, the remainder to the first
    quotas = np.full(len(names), int(share))
    quotas[: len(tissue[training]) - int(quotas.sum())] += 1
    with ModalEmulator(tmp_path / "world", grace_s=30) as world:
        args = flags(atlas, epochs=1, balance_by="tissue", balance_power=1) + ["--audit-cells"]
        proc = modal_run(world, args)
        call = wait_for(lambda: train_attempt(world), "train to start")
        wait_for(lambda: steps_logged(world) >= 6 or proc.poll() is not None, "six steps")
        world.preempt(call["id"])
        code, out, err = finish(proc)
        assert code == 0, err[-3000:]
        trained = trained_cells(world)[0]
        got = Counter(tissue[list(trained.elements())].tolist())
        assert [got[n] for n in names] == quotas.tolist() and counts.min() < quotas.min()  # small tissues repeat
        logs = "".join(container_log(world, call["id"], a) for a in range(2))
        assert f"{len(names)} classes at their quotas" in logs
        check_campaign(world, out, epochs=1, producers=2)
