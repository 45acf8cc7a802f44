"""The local campaign: the whole system on one machine. A queue server process, producer
processes, the setup step, and one DDP trainer process per rank (gloo on CPU), with a live
status line (steps, cells/s, queue depth, producer rates, dataloader wait) and a final summary.

    cellfeed local                     # synthesizes a small atlas first
    cellfeed local --dataset PATH --producers 2 --gpus 2 --steps 100
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import time
from dataclasses import asdict
from pathlib import Path

from app.campaign import prepare, record_mixtures
from app.config import CampaignConfig
from app.flags import CAMPAIGN_FLAGS
from app.fleet import ProducerFleet, stop_campaign
from app.journal import Journal
from app.monitor import Monitor
from app.resume import resume_command, write_record
from app.status import plural, status_line, watch_line
from coordination.backends import connect
from coordination.errors import CellfeedError
from coordination.local_backend import ServerProcess
from coordination.net import free_port
from coordination.routing import producers_key
from coordination.summary import class_mix_line
from trainer import checkpoint
from trainer.launch import launch
from trainer.ranks import ask_to_stop, wait_all

STATUS_EVERY_S = 2.0
MIN_LOCAL_RANKS = 4  # `cellfeed local --gpus` may go to twice the cores, and at least this far
CHECK_EVERY_S = 0.5  # how often the ranks and producers are looked at
SLOW_STEP_S = 2.0  # steps this slow on CPU ranks are said once, with the campaign's expected time
SHORT_CPU_GENES = 64  # genes a cell that CPU ranks train briskly with --preset tiny


def default_dataset(workdir: Path, cells: int, seed: int) -> str:
    """A small synthetic atlas (written once, reused by later runs in the same workdir; written again
    where an older generator made it: its columns may be fewer, e.g. no `tissue` before version 3)."""
    import json

    from producers.synth import VERSION, SynthSpec, synthesize

    path = workdir / f"synth-{cells}-{seed}"
    made = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else None
    if made is None or made.get("metadata", {}).get("synthetic", {}).get("version") != VERSION:
        workdir.mkdir(parents=True, exist_ok=True)
        print(f"no --dataset given: synthesizing {cells:,} Tahoe-like cells into {path}")
        synthesize(str(path), SynthSpec(n_cells=cells, seed=seed), rows_per_fragment=1 << 20, overwrite=True)
    return str(path)


def run_local(
    cfg: CampaignConfig,
    workdir: str | Path = "runs",
    quiet: bool = False,
    audit_cells: bool = False,
    wandb: str | None = None,
) -> dict:
    """Run a whole campaign locally; returns the trainer's summary (rank 0). With `audit_cells`,
    each rank writes the cell ids of every step to WORKDIR/RUN/cells.rank<r>.jsonl."""
    cfg.validate()
    if wandb:
        check_wandb()
    most = max(MIN_LOCAL_RANKS, 2 * (os.cpu_count() or 1))
    if cfg.world_size > most:
        raise CellfeedError(
            f"--nodes {cfg.nodes} x --gpus {cfg.gpus}: cellfeed local runs each rank as a CPU process, and this "
            f"machine has {os.cpu_count()} cores; use {most} ranks or fewer (Modal runs up to 8 per container)"
        )
    workdir = Path(workdir).resolve()  # (the ranks and producers run in other folders)
    place_checkpoints(cfg, workdir)
    if cfg.resume:
        print(describe_resume(cfg))
    workdir = Path(workdir) / cfg.run
    try:
        fresh = not workdir.exists()  # a run that fails before training leaves no folder it made
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CellfeedError(
            f"cannot make the run folder {workdir} ({exc.strerror}): choose a --workdir you can write to"
        ) from None
    ranks = []
    try:
        return _run(cfg, workdir, quiet, audit_cells, ranks, wandb)
    except BaseException:
        if fresh and not ranks:  # never started training: nothing of it to keep
            shutil.rmtree(workdir, ignore_errors=True)
        raise


def _run(cfg: CampaignConfig, workdir: Path, quiet: bool, audit_cells: bool, ranks: list, wandb: str | None) -> dict:
    """`run_local`'s campaign in its run folder; `ranks` is filled as they start."""
    latest = checkpoint.latest(cfg.run_checkpoint_dir) if cfg.resume else None
    cfg.mixtures = record_mixtures(cfg, workdir, latest.epoch if latest else None)
    journal = Journal(workdir)
    journal.clear_stop()  # (a stop asked of an earlier run of this name is not this one's)
    server = ServerProcess(token_file=workdir / ".queue-token")
    backend = cfg.backend_spec("local", **server.where)
    queue, store = connect(backend)
    fleet, facts, state, summary, steps = None, None, "failed", None, workdir / "steps.jsonl"
    resume = resume_command(cfg, "cellfeed local", CAMPAIGN_FLAGS) + f" --workdir {shlex.quote(str(workdir.parent))}"
    resume += " --audit-cells" if audit_cells else ""
    previous_sigint, monitor = signal.getsignal(signal.SIGINT), None
    try:
        facts = prepare(cfg, queue, store, vocab_path=workdir / "vocab.json")
        if latest is not None:  # refused here, before any producer or rank starts
            checkpoint.check_same_data(latest.step, latest.data_id, facts.data_id)
            if latest.epoch >= facts.epochs:  # a finished run: nothing to train
                trained = plural(latest.epoch, "epoch")  # (the checkpoint's epoch: the first not begun)
                state = "complete"
                return {
                    "already_complete": f"run {cfg.run} is complete: {trained} trained (last checkpoint at step "
                    f"{latest.step:,}, {latest.folder}) and --epochs {facts.epochs} asks for no more; nothing to "
                    "resume. Raise --epochs to train on, or start another --run"
                }
            checkpoint.check_same_plan(latest.step, latest.epoch, latest.plan_id, store, cfg.run, facts.epochs)
        announce(cfg, facts, workdir, audit_cells)
        journal.event("resumed" if latest else "started", step=latest.step if latest else 0, ranks=cfg.world_size)
        config_path = write_record(workdir, asdict(cfg))  # the producers' config; what `--resume` continues
        fleet = ProducerFleet(config_path, server.where, cfg.producers, workdir)
        if not cfg.resume:  # (a resume appends: the report shows the whole campaign)
            steps.unlink(missing_ok=True)
        changes = dict(log_path=str(steps), progress_bar=False, tb_dir=str(workdir / "tb"), wandb_project=wandb)
        if audit_cells:
            for old in workdir.glob("cells.rank*.jsonl"):
                old.unlink()
            changes["cells_log"] = str(workdir / "cells")
        train_cfg = cfg.train_config(backend, facts, **changes)
        # the status is published before any rank starts: `cellfeed status` answers from the first step
        monitor = Monitor(cfg, facts, queue, store, journal, steps, fleet.names, resume, workdir / "tb", STATUS_EVERY_S)
        monitor.look(fleet.codes())
        master, summary_path = ("127.0.0.1", free_port()), str(workdir / "summary")  # (node 0's address)
        for node in range(cfg.nodes):  # each node's ranks meet at node 0's, as a cluster's containers do
            ranks += launch(
                train_cfg, cfg.gpus, workdir, summary_path, log_ranks=True, node=node, nodes=cfg.nodes, master=master
            )
        watch(cfg, facts, ranks, fleet, monitor, journal, quiet)
        codes = wait_all(ranks, timeout=60)
        if codes != [0] * cfg.world_size:
            # (rank 0 writes to this process's output, the others to their own files: `trainer.launch`)
            last = cfg.world_size - 1
            others = f"; ranks 1-{last}'s in {workdir}/rank<r>.log" if last > 1 else ""
            others = f"; rank 1's in {workdir}/rank1.log" if last == 1 else others
            raise CellfeedError(f"the campaign failed: trainer ranks exited {codes}; rank 0's output is above{others}")
        summary = json.loads((workdir / "summary.rank0").read_text())
        summary["classes"] = class_mix_line(facts, summary.get("audits", []))
        reports = json.loads(store.get(producers_key(cfg.run)) or "{}")
        summary["producers"] = [reports.get(n, {}) for n in fleet.names]
        summary["producer_restarts"] = sum(fleet.restarts)
        summary["resume_command"] = resume
        state = "complete" if summary.get("complete") else "stopped" if summary.get("stopped") else "incomplete"
        return summary
    except KeyboardInterrupt:
        state = "interrupted"
        raise
    finally:  # whatever happened (Ctrl-C included): stop every child, leave nothing behind
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        try:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
            if monitor is not None:  # the journal's last word (`cellfeed status` after the run)
                monitor.final(state, fleet.codes(), summary=summary)
            stop_campaign(store, cfg.run, fleet.procs if fleet else [], server)
        finally:
            signal.signal(signal.SIGINT, previous_sigint)


def announce(cfg: CampaignConfig, facts, workdir: Path, audit_cells: bool) -> None:
    """What the campaign is, where its files go, and how to watch it."""
    if cfg.corpus:
        print(
            f"corpus {cfg.corpus}: {len(facts.sources)} sources; vocabulary {facts.n_genes:,} genes "
            f"({workdir / 'vocab.json'})"
        )
        for name, cells, line in facts.sources:
            print(f"  {cells:>10,} cells per epoch from {line}")
    print(
        f"campaign {cfg.run}: {facts.cells_per_epoch:,} cells/epoch in {plural(facts.units_per_epoch, 'unit')}, "
        f"{plural(cfg.producers, 'producer')}, {plural(cfg.world_size, 'rank')} (gloo, CPU"
        + (f"; {cfg.nodes} nodes of {cfg.gpus}" if cfg.nodes > 1 else "")
        + "), "
        + (
            f"{plural(facts.total_steps, 'step')} of {cfg.batch_size} cells per rank"
            if not facts.steps_estimated
            else f"about {plural(facts.total_steps, 'step')} of up to {cfg.tokens_per_batch:,} tokens per rank"
        )
        + f" over {plural(facts.epochs, 'epoch')}"
        + (f", {facts.held_out_cells:,} held-out cells" if facts.held_out_cells else ""),
        flush=True,
    )
    if facts.class_mix:
        print(class_mix_line(facts), flush=True)
    print(
        f"checkpoints: {cfg.run_checkpoint_dir} (every {cfg.checkpoint_every} steps); step log, TensorBoard "
        f"(tb/), status: {workdir}" + (f"; cell logs: {workdir}/cells.rank<r>.jsonl" if audit_cells else ""),
        flush=True,
    )
    default_workdir = workdir.parent == Path("runs").resolve()
    print(watch_line(cfg.run, "" if default_workdir else f"--workdir {shlex.quote(str(workdir.parent))}"))
    if cfg.preset != "tiny":
        print(f"note: --preset {cfg.preset} on CPU ranks is slow; --preset tiny is the CPU model", flush=True)


def watch(cfg: CampaignConfig, facts, ranks: list, fleet, monitor, journal, quiet: bool) -> None:
    """Until the ranks end: restart dead producers, publish the status, pass a stop (asked, or Ctrl-C)
    on to the ranks, print progress. Returns when every rank has exited, or one has failed."""
    interrupts = []

    def on_interrupt(*_):  # the first Ctrl-C stops gracefully (a checkpoint); a second, at once
        interrupts.append(True)
        if len(interrupts) > 1:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    stopping, restarts, warned = False, 0, False
    while any(p.poll() is None for p in ranks):
        if any(p.poll() not in (None, 0) for p in ranks):
            break
        fleet.check()  # a dead producer is restarted; its unit is re-issued by the driver
        if sum(fleet.restarts) > restarts:
            restarts = sum(fleet.restarts)
            journal.event("producer restarted", restarts=restarts)
        snap = monitor.look(fleet.codes())
        if interrupts:
            monitor.ask("Ctrl-C")
        if monitor.asked and not stopping:
            ask_to_stop(ranks)
            stopping = True
            print(
                f"stopping ({monitor.asked}): the ranks checkpoint after this step; Ctrl-C again stops at once",
                flush=True,
            )
        # (rank 0 prints the final table after the last step; a token budget's step count is an estimate)
        if snap is not None and not quiet and (facts.steps_estimated or snap["step"] < facts.total_steps):
            print(status_line(snap), flush=True)
        note = None if (warned or snap is None) else slow_step_note(cfg, snap)
        if note:
            print(note, flush=True)
            warned = True
        time.sleep(CHECK_EVERY_S)


def slow_step_note(cfg: CampaignConfig, snap: dict) -> str | None:
    """Once steps are measured: a model too heavy for CPU ranks is said, with the time the campaign
    will take and those lighter settings it does not use yet (a long --max-genes costs as much as a
    big model); a run already as light as they make it hears the time alone."""
    if not snap["step_s"] or snap["step"] < 3 or snap["step_s"] < SLOW_STEP_S:
        return None
    eta_s = snap["eta_s"] or 0
    to_go = f"about {eta_s / 3600:.1f} h to go" if eta_s >= 3600 else f"about {eta_s / 60:.0f} min to go"
    note = (
        f"note: a step takes {snap['step_s']:.1f} s on these CPU ranks (--preset {cfg.preset}, "
        f"{cfg.genes_per_cell:,} genes a cell, batches of {cfg.batch_size}): {to_go}"
    )
    lighter = [
        flag
        for flag, applies in (
            ("--preset tiny", cfg.preset != "tiny"),
            (f"--max-genes {SHORT_CPU_GENES}", cfg.genes_per_cell > SHORT_CPU_GENES),
        )
        if applies
    ]
    if not lighter:
        return note
    return f"{note}. CPU ranks suit {' with '.join(lighter)} (a new --run); a GPU runs the rest (modal run)"


def check_wandb() -> None:
    """--wandb: the package is here and W&B can be reached (a key) or is not needed (offline)."""
    import importlib.util
    import netrc
    import os

    if importlib.util.find_spec("wandb") is None:
        raise CellfeedError("--wandb: wandb is not installed: `pip install wandb`, or leave out --wandb")
    try:
        logged_in = bool(netrc.netrc().authenticators("api.wandb.ai"))
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    if not (os.environ.get("WANDB_API_KEY") or logged_in or os.environ.get("WANDB_MODE") in ("offline", "disabled")):
        raise CellfeedError("--wandb: no W&B key: set WANDB_API_KEY, run `wandb login`, or set WANDB_MODE=offline")


def place_checkpoints(cfg: CampaignConfig, workdir: str | Path) -> None:
    """A relative checkpoint folder lives in the workdir."""
    if not Path(cfg.checkpoint_dir).is_absolute():
        cfg.checkpoint_dir = str(Path(workdir) / cfg.checkpoint_dir)


def describe_resume(cfg: CampaignConfig) -> str:
    """What `--resume` continues from, in one line; an error when the run has no checkpoint."""
    directory = cfg.run_checkpoint_dir
    latest = checkpoint.latest(directory)
    if latest is None:
        raise CellfeedError(
            f"--resume: run {cfg.run!r} has no checkpoint in {directory}; leave out --resume to start "
            "it, or name an existing run with --run"
        )
    return (
        f"resuming run {cfg.run} from its checkpoint at step {latest.step:,} (epoch {latest.epoch}, "
        f"{sum(latest.trained):,} cells of that epoch already trained): {latest.folder}"
        + (f" ({latest.passed_over})" if latest.passed_over else "")
    )
