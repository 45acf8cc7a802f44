"""The Modal campaign: CPU producers and an H100:8 DDP trainer meeting at a modal.Queue.

    modal run app/modal_app.py --dataset s3://bucket/atlas --producers 16 --gpus 8 --steps 2000
    modal run --detach app/modal_app.py ...      # nothing depends on the laptop once it starts
    modal run app/modal_app.py --help            # every flag (works offline)

Flow: the local entrypoint validates the config and calls `setup` (producer image: opens the
dataset, publishes every epoch's plan into the run's modal.Dict, produces the held-out set),
then `train` (GPU image). Rank 0 of `train` spawns the producers, drives the epochs (tasks,
leases, re-issues) and, at the end, signals the producers to stop and deletes the run's queue
and dict. Checkpoints go to the `cellfeed-checkpoints` Volume. S3 credentials come from a
Modal Secret (name: $CELLFEED_SECRET, default "cellfeed-s3") holding AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL and AWS_REGION.
"""

from __future__ import annotations

import os
from typing import Literal

import modal
import modal.exception

APP_NAME = "cellfeed"
SECRET_NAME = os.environ.get("CELLFEED_SECRET", "cellfeed-s3")
VOLUME_NAME = "cellfeed-checkpoints"
CHECKPOINTS = "/checkpoints"
PACKAGES = ("producers", "coordination", "trainer", "app")
PRODUCER_CPU, PRODUCER_MEMORY_MB = 4.0, 16_384
# 8 ranks pop, verify and decompress items and collate batches on the CPU (Modal's default is 0.125 core)
TRAINER_CPU, TRAINER_MEMORY_MB = 32.0, 131_072
DAY = 24 * 3600
STOP_GRACE_S = 60.0  # after training: how long all producers together get to stop before being cancelled

PRODUCER_PIP = ("pylance>=0.30", "pyarrow>=16", "polars>=1.0", "numpy>=1.26", "zstandard>=0.22", "boto3>=1.34",
                "anndata>=0.10", "h5py>=3.9", "scipy>=1.11", "tqdm>=4.66", "pandas>=2")
TRAINER_PIP = ("torch==2.13.0", "numpy>=1.26", "zstandard>=0.22", "tqdm>=4.66")  # no Lance, no Polars

producer_image = modal.Image.debian_slim(python_version="3.11").pip_install(*PRODUCER_PIP) \
    .add_local_python_source(*PACKAGES)
trainer_image = modal.Image.debian_slim(python_version="3.11").pip_install(*TRAINER_PIP) \
    .add_local_python_source(*PACKAGES)

app = modal.App(APP_NAME)
secret = modal.Secret.from_name(SECRET_NAME)
checkpoints = modal.Volume.from_name(VOLUME_NAME, create_if_missing=True)


def _campaign(config: dict):
    from app.config import CampaignConfig

    return CampaignConfig(**config).validate()


def setup_body(config: dict, queue=None, store=None) -> dict:
    """Publish plans and the held-out set (runs in the producer image)."""
    from app.campaign import prepare
    from coordination.modal_backend import run_backends

    cfg = _campaign(config)
    if queue is None:
        queue, store = run_backends(cfg.run)
    return prepare(cfg, queue, store)


def produce_body(config: dict, name: str, queue=None, store=None) -> dict:
    """One producer: works until rank 0 signals the stop (or an hour without tasks)."""
    from coordination.modal_backend import run_backends
    from producers.producer import Producer

    cfg = _campaign(config)
    if queue is None:
        queue, store = run_backends(cfg.run)
    stats = Producer(cfg.producer_config(), queue, store, name=name).run()
    return {"cells": stats.cells, "units": stats.units, "items": stats.items, "bytes": stats.bytes,
            "seconds": dict(stats.seconds)}


def train_body(config: dict, facts: dict, *, backend: dict | None = None, spawn_producers=None,
               checkpoint_dir: str = CHECKPOINTS) -> dict:
    """Rank launcher inside the GPU container: start (or find) the producer fleet, one process per
    GPU (rank 0 also drives the epochs), wait, then stop the producers — one deadline for all, then
    cancel stragglers — and delete the run's queue and dicts.

    Safe to re-run: Modal re-runs a preempted `train` on the same input, so a run with a checkpoint
    resumes from it, and the fleet of the first attempt is found in the map and reused, never
    doubled. `backend`/`spawn_producers` are injectable so the body runs here against the local
    backend (`spawn_producers()` starts them and returns `stop(deadline_s)`)."""
    import json
    from pathlib import Path

    from coordination.backends import connect
    from coordination.routing import stop_key
    from trainer import checkpoint
    from trainer.launch import launch, wait_all

    cfg = _campaign(config)
    cfg.checkpoint_dir = checkpoint_dir
    latest = checkpoint.latest(cfg.run_checkpoint_dir)
    if latest is not None and not cfg.resume:  # a re-run of this input (preemption): carry on
        print(f"run {cfg.run} has a checkpoint at step {latest.step}: resuming from it")
        cfg.resume = True
    backend = backend or {"kind": "modal", "run": cfg.run}
    workdir = Path("/tmp/cellfeed") / cfg.run
    train_cfg = cfg.train_config(backend, facts, log_path=str(workdir / "steps.jsonl"))
    _, store = connect(backend)
    stop_producers = spawn_producers() if spawn_producers is not None else _fleet(cfg, config, store)
    try:
        codes = wait_all(launch(train_cfg, cfg.gpus, workdir, summary_path=str(workdir / "summary")), timeout=DAY)
        if codes != [0] * cfg.gpus:
            raise RuntimeError(f"trainer ranks exited {codes}; their output is in the function's logs")
        if backend["kind"] == "modal":
            checkpoints.commit()
        return json.loads((workdir / "summary.rank0").read_text())
    finally:
        store.put(stop_key(cfg.run), "stop")
        stop_producers(STOP_GRACE_S)
        if backend["kind"] == "modal":
            from coordination.modal_backend import delete_run_backends

            delete_run_backends(cfg.run, facts["epochs"])


def _fleet(cfg, config: dict, store):
    """The run's producer calls: those of an earlier attempt of this input while any still runs
    (their ids are in the map), else a new fleet. Returns `stop(deadline_s)`."""
    import json

    from coordination.routing import fleet_key

    calls = []
    if not store.put(fleet_key(cfg.run), "[]", skip_if_exists=True):  # an earlier attempt spawned one
        earlier = [modal.FunctionCall.from_id(i) for i in json.loads(store.get(fleet_key(cfg.run)) or "[]")]
        calls = [c for c in earlier if _running(c)]
        if calls:
            print(f"reusing the {len(calls)} producers still running from an earlier attempt of this run")
    if not calls:
        calls = [produce.spawn(config, f"producer-{i}") for i in range(cfg.producers)]
        store.put(fleet_key(cfg.run), json.dumps([c.object_id for c in calls]))

    def stop(deadline_s: float) -> None:
        import time

        deadline = time.monotonic() + deadline_s
        for call in calls:
            try:
                call.get(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - still running past the deadline, or failed: cancel it
                call.cancel()

    return stop


def _running(call) -> bool:
    """Whether a producer call is still running (it has no result yet)."""
    try:
        call.get(timeout=0)
    except modal.exception.TimeoutError:
        return True
    except Exception:  # noqa: BLE001 - it failed: not running
        return False
    return False


@app.function(image=producer_image, secrets=[secret], cpu=2.0, memory=8192, timeout=3600)
def setup(config: dict) -> dict:
    return setup_body(config)


@app.function(image=producer_image, secrets=[secret], cpu=PRODUCER_CPU, memory=PRODUCER_MEMORY_MB, retries=3,
              timeout=DAY)
def produce(config: dict, name: str) -> dict:
    return produce_body(config, name)


@app.function(image=trainer_image, gpu="H100:8", volumes={CHECKPOINTS: checkpoints}, timeout=DAY,
              cpu=TRAINER_CPU, memory=TRAINER_MEMORY_MB)
def train(config: dict, facts: dict) -> dict:
    return train_body(config, facts)


def _describe_flags() -> None:
    """modal 1.6's `modal run` turns a local entrypoint's signature into flags with no help text
    and no defaults shown. Attach ours (`app.config.FLAG_HELP`, the same words as `cellfeed local
    --help`) so `modal run app/modal_app.py --help` explains every flag. Only under the Modal CLI
    (already imported then); elsewhere, and if Modal's builder changes, nothing happens."""
    import sys

    from app.config import FLAG_HELP

    modal_cli = sys.modules.get("modal.cli.run")
    build = getattr(modal_cli, "_add_click_options", None)
    if build is None or getattr(build, "describes_cellfeed", False):
        return

    def with_help(func, parameters):
        func = build(func, parameters)
        for option in getattr(func, "__click_params__", []):
            if option.name in FLAG_HELP:
                option.help = FLAG_HELP[option.name]
                option.show_default = "default" not in option.help
        return func

    with_help.describes_cellfeed = True
    modal_cli._add_click_options = with_help


_describe_flags()


@app.local_entrypoint()
def main(
    dataset: str,
    producers: int = 16,
    gpus: int = 8,
    steps: int = 0,
    epochs: int = 0,
    batch_size: int = 240,
    grad_accum: int = 1,
    max_genes: int = 0,
    preset: Literal["tiny", "scgpt", "base", "large"] = "scgpt",
    tokenizer: Literal["scgpt", "geneformer-v1", "geneformer-v2", "geneformer"] = "scgpt",
    n_bins: int = 51,
    strategy: Literal["sequential", "mixture", "block", "random"] = "block",
    block_size: int = 64,
    fetch_factor: int = 64,
    n_scanners: int = 8,
    unit_cells: int = 1024,
    subset_filter: str = "",
    eval_filter: str = "",
    eval_cells: int = 512,
    eval_every: int = 100,
    lr: float = 3e-4,
    warmup_steps: int = 100,
    checkpoint_every: int = 500,
    keep_checkpoints: int = 2,
    run: str = "",
    resume: bool = False,
    compile: bool = False,
    seed: int = 0,
):
    """Start a pretraining campaign on Modal (every flag: `modal run app/modal_app.py --help`)."""
    from dataclasses import asdict

    from app.config import CampaignConfig

    flags = dict(locals())
    optional = {"steps", "epochs", "max_genes", "subset_filter", "eval_filter"}  # 0 / "": not given
    cfg = CampaignConfig(**{k: (v or None) if k in optional else v for k, v in flags.items()}).validate()
    config = asdict(cfg)
    print(f"campaign {cfg.run}: {cfg.producers} producers -> {cfg.gpus} x H100, dataset {cfg.dataset}")
    facts = setup.remote(config)
    print(f"plans published: {facts['cells_per_epoch']:,} cells/epoch, {facts['units_per_epoch']} units, "
          f"{facts['total_steps']:,} steps over {facts['epochs']} epoch(s)")
    summary = train.with_options(gpu=f"H100:{cfg.gpus}").remote(config, facts)
    print(summary)
