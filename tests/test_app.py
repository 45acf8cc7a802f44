"""The two ways to run a campaign: `cellfeed local` end to end, and the Modal app — imported
offline, its declared resources checked, and its function bodies run here against the memory
and local backends (these are not Modal runs)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest

from app.config import CampaignConfig
from coordination.driver import Driver
from coordination.errors import CellfeedError
from coordination.local_backend import LocalMap, LocalQueue, ServerProcess
from coordination.queues import MemoryMap, MemoryQueue
from coordination.routing import rank_partition, stop_key
from coordination.wire import unpack_item

ROOT = Path(__file__).resolve().parents[1]


def offline_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    env["HOME"] = str(tmp_path)  # no ~/.modal.toml: no token anywhere
    return env


def test_modal_app_imports_offline_and_help_lists_every_flag(tmp_path):
    env = offline_env(tmp_path)
    subprocess.run([sys.executable, "-c", "import app.modal_app"], cwd=ROOT, env=env, check=True, timeout=120)
    modal_cli = Path(sys.executable).with_name("modal")
    out = subprocess.run([str(modal_cli), "run", "app/modal_app.py", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import inspect
    import re

    import app.modal_app as m
    from app.config import FLAG_HELP

    text = re.sub(r"-\s+", "-", " ".join(out.stdout.split()))  # unwrap click's columns (it wraps at hyphens too)
    for name, param in inspect.signature(m.main.info.raw_f).parameters.items():
        flag = "--" + name.replace("_", "-")
        words = " ".join(FLAG_HELP[name].split())[:40]  # every flag has its description ...
        assert re.search(re.escape(flag) + r"\b.{0,80}" + re.escape(words), text), (flag, words)
        if "default" not in FLAG_HELP[name] and name != "dataset":  # ... and its default
            shown = "no-" + flag[2:] if param.default is False else param.default
            assert re.search(re.escape(words) + r".*?\[default: " + re.escape(str(shown)), text), flag


def test_modal_functions_declare_their_resources():
    import app.modal_app as m

    assert m.train._spec_.gpus == "H100:8" and "/checkpoints" in m.train._spec_.volumes
    assert m.train._spec_.cpu == 32.0 and m.train._spec_.memory == 131_072  # 8 ranks decompress on the CPU
    assert m.produce._spec_.gpus is None and m.produce._spec_.cpu == 4.0 and m.produce._spec_.memory == 16384
    assert [s for s in m.produce._spec_.secrets] and [s for s in m.setup._spec_.secrets]
    assert not any(p.startswith(("pylance", "polars")) for p in m.TRAINER_PIP)
    assert any(p.startswith("pylance") for p in m.PRODUCER_PIP) and any(p.startswith("torch") for p in m.TRAINER_PIP)


def test_gpu_side_code_never_imports_lance_or_polars():
    code = ("import sys, trainer.train, trainer.stream, trainer.model, trainer.launch, coordination.driver, "
            "coordination.backends, coordination.modal_backend, app.config; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('lance', 'polars')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def campaign_config(ds, **changes) -> CampaignConfig:
    base = dict(dataset=ds.uri, run="app-test", producers=2, gpus=2, batch_size=32, max_genes=32, preset="tiny",
                steps=6, warmup_steps=2, checkpoint_every=3, eval_filter="plate = 'plate14'", eval_cells=64,
                eval_every=3, strategy="mixture", unit_cells=200)
    return CampaignConfig(**{**base, **changes}).validate()


def test_modal_bodies_with_the_memory_backend(small_synth):
    import app.modal_app as m

    cfg = campaign_config(small_synth, eval_filter=None)
    config = asdict(cfg)
    queue, store = MemoryQueue(), MemoryMap()
    facts = m.setup_body(config, queue, store)
    assert facts["vocab_size"] == small_synth.n_genes + 4 and facts["cells_per_epoch"] == small_synth.n_cells
    driver = Driver(queue, store, cfg.run, poll_s=0.05)
    driver_thread = driver.start([0])
    results = []
    workers = [threading.Thread(target=lambda i=i: results.append(m.produce_body(config, f"p{i}", queue, store)))
               for i in range(2)]
    for w in workers:
        w.start()
    driver_thread.join(timeout=120)
    store.put(stop_key(cfg.run), "stop")
    for w in workers:
        w.join(timeout=60)
    cells = Counter()
    for rank in range(cfg.gpus):
        seen = set()
        for data in queue.get_many(10**6, block=False, partition=rank_partition(rank)):
            item = unpack_item(data)
            if item.key not in seen:
                seen.add(item.key)
                cells.update(item.cell_ids.tolist())
    assert cells == Counter(range(small_synth.n_cells)) and sum(r["cells"] for r in results) >= small_synth.n_cells


def test_modal_train_body_runs_ranks_against_the_local_backend(small_synth, tmp_path):
    import app.modal_app as m

    cfg = campaign_config(small_synth, run="modal-body")
    config = asdict(cfg)
    server = ServerProcess()
    try:
        backend = {"kind": "local", "address": server.address}
        facts = m.setup_body(config, LocalQueue(server.address), LocalMap(server.address))
        assert facts["held_out_cells"] == 64

        def spawn_producers():
            threads = [threading.Thread(target=m.produce_body, args=(config, f"p{i}", LocalQueue(server.address),
                                                                      LocalMap(server.address)), daemon=True)
                       for i in range(cfg.producers)]
            for t in threads:
                t.start()
            return lambda deadline_s: [t.join(timeout=deadline_s) for t in threads]

        summary = m.train_body(config, facts, backend=backend, spawn_producers=spawn_producers,
                               checkpoint_dir=str(tmp_path / "ckpt"))
        # Modal re-runs a preempted train on the same input: it resumes from the checkpoint (here the
        # last step, so nothing is left to train) instead of starting over at step 0
        again = m.train_body(config, facts, backend=backend, spawn_producers=lambda: (lambda deadline_s: None),
                             checkpoint_dir=str(tmp_path / "ckpt"))
    finally:
        server.close()
    assert again["steps"] == 0
    assert summary["steps"] == 6 and math.isfinite(summary["final_loss"])
    assert [e["step"] for e in summary["eval"]] == [0, 3, 6]
    assert (tmp_path / "ckpt" / "modal-body" / "latest").read_text().strip() == "step-00000006"


def test_cellfeed_local_end_to_end(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "local", "--workdir", str(tmp_path), "--cells", "1200", "--producers", "2",
         "--gpus", "2", "--steps", "8", "--max-genes", "64", "--batch-size", "16", "--checkpoint-every", "4",
         "--eval-filter", "plate = 'plate14'", "--eval-every", "4", "--run", "ci", "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "cells/s" in out.stdout and "dataloader wait" in out.stdout and "held-out at step 8" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "ci" / "steps.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert all(r["wait_ms"] >= 0 and r["cells_per_s"] > 0 for r in rows if "loss" in r)
    assert (tmp_path / "checkpoints" / "ci" / "latest").read_text().strip() == "step-00000008"
    assert (tmp_path / "checkpoints" / "ci" / "step-00000004" / "state.pt").exists()


@pytest.mark.parametrize("change, needle", [
    (dict(tokenizer="raw"), r"--tokenizer raw: the trainer learns from scgpt, geneformer-v1, geneformer-v2"),
    (dict(tokenizer="bert"), r"unknown tokenizer 'bert'; choose one of scgpt, geneformer-v1"),
    (dict(epochs=0), "--epochs must be >= 1"),
    (dict(strategy="zigzag"), "unknown strategy"),
    (dict(preset="huge"), "unknown model preset"),
    (dict(producers=0), "--producers must be >= 1"),
    (dict(run="has space"), "run name"),
    (dict(steps=0), "--steps must be >= 1"),
])
def test_campaign_config_is_validated_up_front(change, needle):
    with pytest.raises(CellfeedError, match=needle):
        CampaignConfig(dataset="x", **change).validate()


def test_cli_local_bad_flag_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "app.cli", "local", "--workdir", str(tmp_path), "--dataset",
                          str(tmp_path / "missing"), "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"cellfeed: error: no dataset at {tmp_path / 'missing'}: "
                                               "the path does not exist"]
