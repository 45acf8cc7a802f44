"""The Modal campaign: CPU producers and an H100:8 DDP trainer meeting at a modal.Queue.

    modal run app/modal_app.py --dataset s3://bucket/atlas --producers 16 --gpus 8 --steps 2000
    modal run --detach app/modal_app.py ...      # nothing depends on the laptop once it starts
    modal run app/modal_app.py --help            # every flag (works offline)
    cellfeed status RUN --modal; cellfeed stop RUN --modal   # from the laptop (app/ops.py); --nodes: modal_nodes.py

A campaign, from the laptop's side (`main`, at the bottom; what it reads and says:
`app/modal_laptop.py`): validate the flags, call `setup` (producer image: opens the dataset,
publishes every epoch's plan into the run's modal.Dict, produces the held-out set), then `train`
(GPU image) until the campaign ends.

Inside `train` (`train_body`; its work around the ranks: `app/modal_train.py`): find the run's
producer calls still running (a re-run of this input reuses them) or spawn them, start one process
per GPU (rank 0 also drives the epochs), and watch. How a call ends decides what happens to the
campaign:

- the campaign is complete: the producers are told to stop, the run's queue and dicts deleted;
- Modal preempts the container (SIGINT, ~30 s, then it is gone; Modal runs the same input
  again): the ranks checkpoint and the call ends with nothing stopped or deleted, so the re-run
  resumes from the checkpoint with the same queue, plans and producers;
- the call has run `--attempt-hours` (Modal ends any call at 24 h): the ranks checkpoint and a
  new `train` call continues the campaign; `main` follows the chain;
- a real failure (a rank fails, a producer failed all of Modal's retries, Modal's network failed
  for longer than `--modal-retry-s`): the ranks checkpoint if they can, the producers are stopped,
  and the error is raised in one line with the command that resumes the campaign. The run's queue
  and dicts are kept: they are deleted only when the campaign is complete.

Every call to Modal retries its transient errors with backoff for `--modal-retry-s` (15 minutes by default;
`coordination.modal_backend.retrying`). Volumes: `cellfeed-checkpoints`, and `cellfeed-kernels` (the compiled
token pass). S3 credentials: a Modal Secret ($CELLFEED_SECRET, default "cellfeed-s3": AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION). `convert`: h5ad to a dataset (`app/modal_convert.py`).
Tests: modal's client against a local control plane speaking Modal's API (cellfeed_testing/), never Modal."""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict

import modal

from app import costs  # each function's CPU and memory (costs.py: the estimates price the same)
from app.config import CampaignConfig
from app.flags import MODAL_FLAGS, flags_signature
from app.modal_calls import (
    PRODUCER_RETRIES,
    Fleet,
    call_by_id,
    claim_run,
    interrupt_held,
    release_claim,
    result,
    running_trainer,
    spawn,
)
from app.modal_convert import INPUTS, INPUTS_VOLUME, SLICE_RETRIES, convert_body, slice_body
from app.modal_laptop import resumed, said_failure, say_last
from app.modal_nodes import cluster, meet, node_body
from app.modal_train import end_campaign, ranks_config, started_monitor, stop_campaign, stopped, watch
from app.pins import pinned
from app.resume import resume_command, write_record
from coordination.modal_backend import retrying

APP_NAME = "cellfeed"
SECRET_NAME = os.environ.get("CELLFEED_SECRET", "cellfeed-s3")
VOLUME_NAME = "cellfeed-checkpoints"
CHECKPOINTS = "/checkpoints"  # where train's container mounts the Volume (fixed: never from the laptop's environment)
KERNELS = "/kernels"  # setup's and the producers' compiled token pass (producers/kernel_cache.py), on a Volume
MOUNT_ENV = {CHECKPOINTS: "CELLFEED_CHECKPOINT_MOUNT", KERNELS: "CELLFEED_KERNEL_MOUNT"}  # (see `mounted`)
PACKAGES = ("producers", "coordination", "trainer", "app")
DAY = 24 * 3600  # Modal's longest timeout for a call
MAX_GPUS = 8  # Modal's largest GPU count for one container ("H100:8")
PRODUCER_HOURS = 23.0  # a producer call returns after this long (Modal ends it at 24 h) and is replaced
PREEMPT_SAVE_S = 20.0  # of Modal's ~30 s grace after a preemption's SIGINT: the ranks' time to checkpoint

PRODUCER_PIP = pinned(
    "pylance", "pyarrow", "polars", "numpy", "numba", "zstandard", "boto3", "anndata", "h5py", "scipy", "tqdm", "pandas"
)
TRAINER_PIP = pinned("torch", "numpy", "zstandard", "tqdm", "tensorboard")  # no Lance, no Polars

_producer_base = modal.Image.debian_slim(python_version="3.11").pip_install(*PRODUCER_PIP)
producer_image = _producer_base.add_local_python_source(*PACKAGES)
_trainer_base = modal.Image.debian_slim(python_version="3.11").pip_install(*TRAINER_PIP)
trainer_image = _trainer_base.add_local_python_source(*PACKAGES)
# conversion containers: the producer's packages (h5ad in, Lance out), one heap from the start, before
# modal's client's threads (producers/heap.py says why)
CONVERT_PIP = PRODUCER_PIP
convert_image = _producer_base.env({"MALLOC_ARENA_MAX": "1"}).add_local_python_source(*PACKAGES)

app = modal.App(APP_NAME)
secret = modal.Secret.from_name(SECRET_NAME)
checkpoints = modal.Volume.from_name(VOLUME_NAME, create_if_missing=True)
kernels = modal.Volume.from_name("cellfeed-kernels", create_if_missing=True)
inputs_volume = modal.Volume.from_name(INPUTS_VOLUME, create_if_missing=True)  # h5ad files to convert


# ---- the bodies (plain functions: tests run them on the Modal emulator, and against local backends)


def unpacked(config: dict) -> CampaignConfig:
    """The campaign's config in a container: the files `main` carried from the laptop (a corpus
    file, a vocabulary, a median dictionary) written out to this container's disk."""
    return CampaignConfig(**config).unpack_files(tempfile.mkdtemp(prefix="cellfeed-files-")).validate()


def setup_body(config: dict) -> dict:
    """Publish plans and the held-out set (producer image); compile the token pass (or load the last run's)
    into the run's folder of the kernels Volume, committed for the producers (`producers/kernel_cache.py`)."""
    from app.campaign import prepare
    from coordination.backends import connect
    from producers.kernel_cache import cache_kernels_in, mark_seedable

    cfg = unpacked(config)
    cached = cache_kernels_in(mounted(KERNELS), cfg.run)
    facts = prepare(cfg, *connect(cfg.backend_spec("modal")), compile_pass=cached)
    if cached:
        mark_seedable(mounted(KERNELS), cfg.run)
        retrying(kernels.commit, "committing the kernels Volume", cfg.modal_retry_s)
    return asdict(facts)  # a dict: it crosses to the laptop


def produce_body(config: dict, name: str) -> dict:
    """One producer: works until rank 0 signals the stop, an hour passes without tasks, or
    `PRODUCER_HOURS` are up (it returns before Modal's 24 h; `train` starts another)."""
    print(f"modal {modal.__version__} from {modal.__file__}", flush=True)  # (the client this container runs)
    import threading

    from coordination.backends import connect
    from coordination.net import freeze_setup, keep_freed_memory
    from producers.kernel_cache import cache_kernels_in
    from producers.producer import Producer

    keep_freed_memory()
    cfg = unpacked(config)
    cache_kernels_in(mounted(KERNELS), cfg.run)  # (where setup compiled the token pass: this one loads it)
    producer = Producer(cfg.producer_config(), *connect(cfg.backend_spec("modal")), name=name)
    freeze_setup()
    retire = threading.Timer(PRODUCER_HOURS * 3600, producer.stop)
    retire.daemon = True
    retire.start()
    try:
        stats = producer.run()
    finally:
        retire.cancel()
        producer.close()
        gc.unfreeze()  # (this container may be given another input: its next producer freezes its own set-up)
    return {k: getattr(stats, k) for k in ("cells", "units", "items", "bytes")} | {"seconds": dict(stats.seconds)}


def train_body(config: dict, facts: dict) -> dict:  # facts: coordination.summary.SetupFacts as a dict
    """The GPU container's launcher (see the module's docstring for how a call ends)."""
    print(f"modal {modal.__version__} from {modal.__file__}", flush=True)  # (the client this container runs)
    from pathlib import Path

    from coordination.backends import connect
    from coordination.summary import SetupFacts
    from trainer import checkpoint
    from trainer.launch import launch, rank_server
    from trainer.ranks import checkpoint_and_stop

    started = time.monotonic()
    here = cluster() if config.get("nodes", 1) > 1 else None  # `--nodes`: this container's place in the cluster
    if here is not None and here.rank > 0:  # another node's container: its ranks join container 0's world
        rank_server()  # it imports torch while container 0 sets up
        commit = lambda: retrying(checkpoints.commit, "committing the checkpoints Volume", 60.0)  # noqa: E731
        return node_body(config, here, config["gpus"], config["nodes"], commit, PREEMPT_SAVE_S)
    cfg, facts = unpacked(config), SetupFacts.of(facts)
    cfg.checkpoint_dir = mounted(CHECKPOINTS)
    queue, store = connect(cfg.backend_spec("modal"))
    me = modal.current_function_call_id()
    other = claim_run(store, cfg.run, me, cfg.modal_retry_s)
    if other is not None:  # a second train of this run (a spawn made again, or a --resume while it runs)
        print(f"run {cfg.run} is already being trained by call {other}: this call ({me}) does nothing", flush=True)
        return {"duplicate_of": other}
    rank_server()  # it imports torch while the campaign is set up, not inside the preemption-held launch
    ensure_setup(cfg, config, facts, queue, store)
    latest = checkpoint.latest(cfg.run_checkpoint_dir)
    if latest is not None:  # a re-run of this input (preemption), a continuation, or a --resume
        checkpoint.check_same_data(latest.step, latest.data_id, facts.data_id)  # (refused before the record)
        said = f"; {latest.passed_over}" if latest.passed_over else ""
        print(f"run {cfg.run} has a checkpoint at step {latest.step}: resuming from it{said}", flush=True)
        cfg.resume = True
    fleet = Fleet(cfg, config, store, produce)
    workdir = Path(tempfile.gettempdir()) / "cellfeed" / cfg.run
    train_cfg, log = ranks_config(cfg, facts)  # (the step log and TensorBoard files on the Volume)
    write_record(cfg.run_checkpoint_dir, {k: v for k, v in config.items() if k != "carried"})  # (the laptop's paths)
    resume = resume_command(CampaignConfig(**config))  # (the laptop's file paths, not this container's)
    monitor = started_monitor(cfg, facts, queue, store, fleet, train_cfg, log, resume, latest.step if latest else 0)
    ranks = []

    def commit():  # a commit reloads the Volume, which fails while a file on it is open (modal/volume.py:889-917)
        monitor.scalars.close()  # (the monitor's TensorBoard file: opened again, as a new file, at its next write)
        retrying(checkpoints.commit, "committing the checkpoints Volume", cfg.modal_retry_s)

    try:
        master = meet(store, cfg.run, here, train_cfg) if here is not None else None  # (node 0's address)
        with interrupt_held():  # the ranks are all started, or none: a preemption cannot orphan one
            summary_path = str(workdir / "summary")
            ranks = launch(train_cfg, cfg.gpus, workdir, summary_path, node=0, nodes=cfg.nodes, master=master)
        watch(ranks, fleet, deadline=started + cfg.attempt_hours * 3600, monitor=monitor)
    except KeyboardInterrupt:  # preempted: checkpoint, leave everything in place; Modal runs this input again
        print("preempted: the ranks checkpoint; Modal runs this call again and it resumes", flush=True)
        checkpoint_and_stop(ranks, timeout=PREEMPT_SAVE_S)  # (they had the SIGINT too: the container's every process)
        monitor.journal.event("preempted")
        commit()
        raise
    except BaseException as exc:  # a real failure stops the campaign; its state stays for --resume
        stop_campaign(cfg, config, ranks, fleet, store, monitor, me, exc)
        raise
    commit()
    summary = json.loads((workdir / "summary.rank0").read_text())
    if summary["stopped"] == "asked" and monitor.asked:  # `cellfeed stop`: the campaign stops, its state kept
        stopped(cfg, fleet, store, monitor, me, commit)
        return {**summary, "resume_command": resume}
    if summary["stopped"] == "asked":  # this call's time is up: a new call continues from the checkpoint
        return hand_over(cfg, config, facts, store, me, summary)
    monitor.final("complete" if summary.get("complete") else "incomplete")  # (to the Volume: the Dict goes now)
    commit()
    end_campaign(cfg, fleet, facts, store)
    return summary


def mounted(path: str) -> str:
    """A Volume's folder in this container: `path` on Modal. The test world's container is told a
    host folder standing for it (MOUNT_ENV's variable), read here, at call time: read at import, a
    laptop's setting would move the mount in the function's definition and not in its container."""
    return os.environ.get(MOUNT_ENV[path], path)


def ensure_setup(cfg: CampaignConfig, config: dict, facts, queue, store) -> None:
    """The setup's work is still there: every epoch's plan (a Dict entry expires after 7 days
    unused: looking at it is a use) and the held-out set (a queue partition is cleared 24 h after
    its last put; a preempted rank 0 may have taken it). Else `setup` runs again."""
    from coordination.routing import EVAL_PARTITION, summary_key

    missing = [e for e in range(facts.epochs) if summary_key(cfg.run, e) not in store]
    held_out = queue.len(partition=EVAL_PARTITION) if facts.held_out_items else 0
    if missing or held_out != facts.held_out_items:
        print(
            f"the run's setup is incomplete ({len(missing)} epoch plans missing, held-out items "
            f"{held_out} of {facts.held_out_items}): running setup again",
            flush=True,
        )
        result(spawn(setup, config, retry=cfg.modal_retry_s), cfg.modal_retry_s)


def hand_over(cfg: CampaignConfig, config: dict, facts, store, call_id: str, summary: dict) -> dict:
    """This call's `--attempt-hours` are up and the ranks have checkpointed: a new `train` call
    continues the campaign from the checkpoint (it claims the run)."""
    release_claim(store, cfg.run, call_id)  # (the new call claims the run)
    after = spawn(trainer_of(cfg), config, asdict(facts), retry=cfg.modal_retry_s)
    print(f"train ran {cfg.attempt_hours:g} h: a new call {after.object_id} continues from the checkpoint", flush=True)
    return {**summary, "continued_as": after.object_id}


# ---- the functions


_produce_on = dict(image=producer_image, secrets=[secret], volumes={KERNELS: kernels}, timeout=DAY)


@app.function(**_produce_on, cpu=costs.SETUP_CPU, memory=costs.SETUP_MEMORY_MB)
def setup(config: dict) -> dict:
    return setup_body(config)


@app.function(**_produce_on, cpu=costs.PRODUCER_CPU, memory=costs.PRODUCER_MEMORY_MB, retries=PRODUCER_RETRIES)
def produce(config: dict, name: str) -> dict:
    return produce_body(config, name)


@app.function(
    image=trainer_image,
    gpu="H100:8",
    volumes={CHECKPOINTS: checkpoints},
    timeout=DAY,
    cpu=costs.TRAINER_CPU,
    memory=costs.TRAINER_MEMORY_MB,
)
def train(config: dict, facts: dict) -> dict:
    return train_body(config, facts)


# `--nodes K`: the same body on a cluster of K containers (`app/modal_nodes.py`). A cluster's size is
# fixed where its function is defined, so each K has its own function; Modal's docs ask each container
# of a cluster for all GPUs of its host (`--gpus 8`), and `rdma=True` asks for RDMA placement, for the
# gradients' all-reduce between nodes (modal/_partial_function.py:808-840).
_train_on = dict(image=trainer_image, gpu="H100:8", volumes={CHECKPOINTS: checkpoints}, timeout=DAY)


@app.function(**_train_on, cpu=costs.TRAINER_CPU, memory=costs.TRAINER_MEMORY_MB)
@modal.clustered(size=2, rdma=True)
def train_2_nodes(config: dict, facts: dict) -> dict:
    return train_body(config, facts)


@app.function(**_train_on, cpu=costs.TRAINER_CPU, memory=costs.TRAINER_MEMORY_MB)
@modal.clustered(size=4, rdma=True)
def train_4_nodes(config: dict, facts: dict) -> dict:
    return train_body(config, facts)


@app.function(**_train_on, cpu=costs.TRAINER_CPU, memory=costs.TRAINER_MEMORY_MB)
@modal.clustered(size=8, rdma=True)
def train_8_nodes(config: dict, facts: dict) -> dict:
    return train_body(config, facts)


TRAIN_ON = {1: train, 2: train_2_nodes, 4: train_4_nodes, 8: train_8_nodes}
# `modal run app/modal_app.py::convert --inputs a.h5ad,b.h5ad --out s3://b/atlas`: app/modal_convert.py
_convert_on = dict(image=convert_image, secrets=[secret], volumes={INPUTS: inputs_volume}, timeout=DAY)


@app.function(**_convert_on, cpu=costs.CONVERT_COORDINATOR_CPU, memory=costs.CONVERT_COORDINATOR_MEMORY_MB)
def convert(
    inputs: str, out: str, layer: str = "X", overwrite: bool = False, slice_cells: int = 0, block_cells: int = 0
):
    return convert_body(inputs, out, layer, overwrite, convert_slice, slice_cells or None, block_cells or None)


@app.function(**_convert_on, cpu=costs.CONVERT_CPU, memory=costs.CONVERT_MEMORY_MB, retries=SLICE_RETRIES)
def convert_slice(task: str, plan_json: str, index: int, args: list, root: str):
    return slice_body(task, plan_json, index, args, root)


def trainer_of(cfg: CampaignConfig):
    """The train function for the campaign's node count, with its GPUs per node."""
    return TRAIN_ON[cfg.nodes].with_options(gpu=f"H100:{cfg.gpus}")


# ---- the laptop's side


def campaign_of(flags: dict) -> CampaignConfig:
    """The campaign `modal run`'s flags ask for (every flag's default is None: left out, it is
    CampaignConfig's): with `--resume`, the run's recorded campaign and the changes a resume may make
    (each said), from its folder on the Volume; validated, and checked against Modal's limits."""
    from coordination.errors import CellfeedError

    given = {name: value for name, value in flags.items() if value is not None}
    if given.get("resume") and given.get("run"):
        given = resumed(given, VOLUME_NAME)
    cfg = CampaignConfig.from_flags(given)
    if cfg.gpus > MAX_GPUS:
        raise CellfeedError(f"--gpus {cfg.gpus}: a Modal container has at most {MAX_GPUS} GPUs")
    if cfg.nodes not in TRAIN_ON:
        raise CellfeedError(f"--nodes {cfg.nodes}: on Modal, one of {', '.join(map(str, TRAIN_ON))}")
    if cfg.nodes > 1 and cfg.gpus != MAX_GPUS:  # modal.clustered's docs: "Each container must request all
        # GPUs on its host (for example, gpu="H100:8")": a node of fewer would pay for 8 and use a part
        raise CellfeedError(
            f"--nodes {cfg.nodes} --gpus {cfg.gpus}: each node of a Modal cluster takes all {MAX_GPUS} GPUs of "
            f"its host; give --gpus {MAX_GPUS}, or --nodes 1 for {cfg.gpus} GPUs"
        )
    return cfg


def start(cfg: CampaignConfig, config: dict, store) -> dict:
    """(the laptop) Set the campaign up (`setup`: plans and the held-out set), start `train` and
    follow it to the campaign's end (`follow`); its summary."""
    from app.journal import DictJournal

    DictJournal(store, cfg.run).clear_stop()  # (an old request)
    facts = result(spawn(setup, config, retry=cfg.modal_retry_s), cfg.modal_retry_s)  # SetupFacts, as a dict
    print(
        f"plans published: {facts['cells_per_epoch']:,} cells/epoch, {facts['units_per_epoch']} units, "
        f"{'about ' if facts.get('steps_estimated') else ''}{facts['total_steps']:,} steps over {facts['epochs']} "
        "epoch(s); vocabulary of "
        f"{facts['n_genes']:,} genes",
        flush=True,
    )
    for name, cells, line in facts.get("sources", ()) if cfg.corpus else ():
        print(f"  {cells:>10,} cells per epoch from {line}", flush=True)
    call = spawn(trainer_of(cfg), config, facts, retry=cfg.modal_retry_s)
    return follow(result(call, cfg.modal_retry_s), cfg.modal_retry_s)


def follow(summary: dict, retry: float) -> dict:
    """A train call's summary, followed along the calls that carry the campaign on: a hand-over
    (`continued_as`: Modal's 24 h) or the call that holds the run (`duplicate_of`)."""
    while "continued_as" in summary or "duplicate_of" in summary:
        if "continued_as" in summary:
            print(f"train continues in call {summary['continued_as']} (a call ends at {DAY // 3600} h)", flush=True)
        else:  # a second trainer of the run (a spawn made again, its first reply lost): the first one trains
            print(f"the run is trained by call {summary['duplicate_of']}: following it", flush=True)
        following = summary.get("continued_as") or summary["duplicate_of"]
        summary = result(call_by_id(following), retry)
    return summary


def main(**flags) -> dict:
    """Start (or, with --resume, continue) a pretraining campaign on Modal. The flags are
    `cellfeed local`'s (described by `cellfeed local --help`; Modal 1.6's `modal run --help` can
    show no help text), plus --attempt-hours."""
    from app.status import watch_line
    from coordination.audit import verdict
    from coordination.errors import CellfeedError
    from coordination.modal_backend import run_backends

    try:
        cfg = campaign_of(flags)
        config = asdict(cfg.carry_files())  # containers cannot read this machine's files: their bytes travel
    except CellfeedError as exc:  # bad input: one line, before any call to Modal's functions
        print(f"cellfeed: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    fleet = f"{cfg.producers} producers -> " + (f"{cfg.nodes} nodes x " if cfg.nodes > 1 else "") + f"{cfg.gpus} x H100"
    print(
        f"campaign {cfg.run}: {fleet}, {'corpus ' + cfg.corpus if cfg.corpus else 'dataset ' + cfg.dataset}", flush=True
    )
    report = f"modal volume get {VOLUME_NAME} {cfg.run} runs/{cfg.run}, then cellfeed report {cfg.run}"
    print(watch_line(cfg.run, "--modal", report), flush=True)
    try:
        store = run_backends(cfg.run, retry_s=cfg.modal_retry_s)[1]
        running = running_trainer(store, cfg.run, cfg.modal_retry_s) if cfg.resume else None
        if running is not None:  # (a --resume while it runs: its stop request, plans and held-out set untouched)
            print(f"run {cfg.run} is still being trained by call {running}: following it", flush=True)
            summary = follow({"duplicate_of": running}, cfg.modal_retry_s)
        else:
            summary = start(cfg, config, store)
    except (Exception, KeyboardInterrupt) as exc:  # one line, and the command that continues the campaign
        if not said_failure(exc, cfg):  # a fault of this code, not of the input, Modal or a call: its traceback follows
            raise
        raise SystemExit(1) from None
    print(json.dumps({k: summary[k] for k in ("steps", "final_loss", "audits") if k in summary}), flush=True)
    ok, line = verdict(summary["epochs"], summary.get("stopped"), summary.get("last_step"))
    if summary.get("resume_command"):  # stopped by `cellfeed stop`: where, and how to go on
        line += f"; checkpoint at step {summary['last_step']:,}; resume: {summary['resume_command']}"
    say_last(line)  # the last line tells the truth (an epoch short or unaudited exits non-zero)
    if not ok:
        raise SystemExit(1)
    return summary


# `modal run` builds its options from the entrypoint's signature: here, one per campaign flag, with
# the config's types, so the entrypoint cannot drift from `CampaignConfig`. Every default is None, so
# `main` knows which flags were given (a resume changes only those); CampaignConfig's fill the rest
main.__signature__ = flags_signature(MODAL_FLAGS, {name: None for name in MODAL_FLAGS})
main.__annotations__ = {p.name: p.annotation for p in main.__signature__.parameters.values()}
main = app.local_entrypoint()(main)


# a container has imported modal's client and ours by now, before its function's body: frozen, they are not walked
# again by every collection of the cyclic GC (~15% of a short container's CPU here); later garbage is collected as ever
if os.environ.get("MODAL_IS_REMOTE") == "1":
    gc.freeze()
