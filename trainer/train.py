"""The DDP training loop: batches come only from the consumer stream.

Run one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (torchrun, or
`trainer.launch`): `python -m trainer.train --config config.json`. gloo on CPU, NCCL + bf16
autocast on GPU, unchanged.

SIGUSR2 asks a rank to checkpoint and stop (`trainer.ranks.checkpoint_and_stop`: before a
preempted container goes, or when a Modal call's day is nearly over); so does SIGINT, which a
preemption sends to every process of the container. The request rides on the
step's all-reduce, so every rank stops after the same step; the summary says `complete: false`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from coordination.audit import epoch_ledger
from coordination.backends import connect
from coordination.errors import CellfeedError
from coordination.seeds import mask_seed
from coordination.summary import load_summary
from trainer import checkpoint
from trainer.config import STOP_SIGNAL, TrainConfig
from trainer.evaluation import evaluate, load_held_out
from trainer.exactly_once import ask_again, audit_epoch
from trainer.metrics import StepTotals, Tracker, peak_flops
from trainer.model import CellTransformer, ModelConfig, attention_on, masked_loss
from trainer.resume import earlier_audits, restore, start_driver, total_steps
from trainer.schedule import Schedule, lr_factor
from trainer.stream import ConsumerStream


def init_distributed() -> tuple[int, int, torch.device]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    return rank, world, device


def gather_texts(text: str) -> list[str]:
    """Every rank's `text`, on every rank (a collective, on gloo and NCCL alike)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, text)
    return out


@dataclass
class Run:
    """One rank's training run: everything the loop reads and changes, built by `start`."""

    cfg: TrainConfig
    store: object  # the run's map (`coordination.backends`)
    rank: int
    world: int
    device: torch.device
    model: CellTransformer
    ddp: DDP
    step_model: torch.nn.Module  # the DDP model, compiled with --compile
    optimizer: torch.optim.Optimizer
    autocast: object
    summaries: dict  # epoch -> the setup's summary of it (`coordination.summary`)
    total_cells: int  # the campaign's cells, for the schedule (without --steps)
    step: int
    epoch: int
    progress: checkpoint.RankProgress  # this rank's place in its epoch: what it consumed and trained
    left: list | None  # a resumed epoch's cells not trained yet, per rank
    schedule: Schedule
    driver: object  # rank 0's driver of the producers (None elsewhere)
    stream: ConsumerStream
    tracker: Tracker
    held_out: object  # rank 0's held-out cells (None: no evaluation)
    cells_log: object  # --audit-cells: every trained cell id, a line per batch
    stop_asked: list  # set by a signal; all-reduced with each step's counts so every rank stops together
    saved_at: int | None  # the step of this run's last checkpoint
    earlier_audits: list  # the audits of epochs finished before this run (from the checkpoint)
    audits: list = field(default_factory=list)
    batches: object = None  # the epoch's batches (`stream.epoch`)
    stopping: bool = False
    save_after_audit: bool = False

    def steps_done(self) -> bool:  # a --steps run's end
        return self.cfg.max_steps is not None and self.step >= self.cfg.max_steps

    def summary(self, epoch: int):
        """The setup's summary of `epoch` (read now if this run had not)."""
        return self.summaries.get(epoch) or load_summary(self.store, self.cfg.run, epoch)


def train(cfg: TrainConfig, queue=None, store=None) -> dict:
    stop_asked = listen_for_stop()
    rank, world, device = init_distributed()
    if queue is None:
        queue, store = connect(cfg.backend)
    run = start(cfg, queue, store, rank, world, device, stop_asked)
    try:
        while run.epoch < cfg.epochs and not run.steps_done():
            run.batches = batches = run.stream.epoch(run.epoch, run.left or run.summary(run.epoch).cells_per_rank)
            run.progress.plan_id = run.summary(run.epoch).plan_id
            micro = 0
            for batch in batches:
                # ---- one training step: gradients accumulate over `grad_accum` batches ----
                if micro == 0:
                    step = StepTotals(time.perf_counter() - batch.wait_s, torch.zeros(7, device=device))
                step.add(batch, forward_backward(run, batch, micro))
                micro += 1
                if not (micro == cfg.grad_accum and run.step + 1 == cfg.max_steps):  # (no next: --steps are done)
                    step.waited += batches.prepare()  # the next batch drawn while the accelerator runs this one
                if micro < cfg.grad_accum:
                    continue
                micro = 0
                asked, cells, cut, ranks_left = step.flags()  # every rank's (the step's one wait for the GPU)
                if batches.steps is None and ranks_left == 0:  # a token budget's epoch: no rank has a cell left
                    batches.end()
                if cut > 0:  # a rank's epoch was cut short by the stop: every rank's is (the same
                    batches.cut = True  # branch below on all ranks: a checkpoint now, no audit of it)
                if asked > 0 and cells == 0:  # a stop met every rank starved: no step
                    run.optimizer.zero_grad(set_to_none=True)
                    run.stopping = True
                    if cfg.checkpoint_dir and run.saved_at != run.step:  # (a checkpoint at this step is kept)
                        save(run)
                    break
                lr, grad_norm = optimizer_step(run, int(cells))
                run.tracker.record(
                    step.metrics(run.step, run.epoch, lr, grad_norm, run.model.config, run.device, batches.ready_cells)
                )
                if run.held_out is not None and run.step % cfg.eval_every == 0:
                    run.tracker.note(run.step, evaluate(run.model, run.held_out, cfg, run.autocast))
                run.stopping = asked > 0  # a rank was asked to stop: all stop after this step
                if cfg.checkpoint_dir and (run.step % cfg.checkpoint_every == 0 or run.steps_done() or run.stopping):
                    if not batches.finished:
                        save(run)
                    else:  # the epoch's last step: saved once its audit is done, as the next epoch's start
                        run.save_after_audit = True
                if run.steps_done() or run.stopping:
                    break
            if not batches.finished:  # stopped inside the epoch (--steps are done, or asked to stop)
                break
            close_epoch(run)  # its audit; a checkpoint the next epoch starts from
            if run.stopping:
                break
        if cfg.checkpoint_dir and not run.stopping:  # (a stop saved at its step already)
            save(run)
    finally:
        close(run)
    return finish(run)


def listen_for_stop() -> list:
    """SIGUSR2 (`checkpoint_and_stop`) and SIGINT (a preemption reaches every process of a Modal
    container, this rank too) ask for a checkpoint and a stop; a terminal's Ctrl-C never gets here:
    ranks have sessions of their own. Returns the flag list the signals append to."""
    stop_asked = []
    signal.signal(STOP_SIGNAL, lambda *_: stop_asked.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop_asked.append(True))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {STOP_SIGNAL})  # held by the launcher until now
    return stop_asked


def start(cfg: TrainConfig, queue, store, rank: int, world: int, device, stop_asked: list) -> Run:
    """The model, the optimizer, the place a resume starts from, the rank's stream and its metrics."""
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    special = tuple(cfg.special_tokens)
    try:
        attention = attention_on(cfg.packed_attention, device)
    except ValueError as exc:
        raise CellfeedError(str(exc)) from None
    model_cfg = ModelConfig.preset(
        cfg.preset,
        cfg.vocab_size,
        cfg.n_bins,
        cfg.objective,
        pad_token=cfg.pad_token,
        mask_token=cfg.mask_token,
        special_tokens=special,
        packed_attention=attention,
    )
    if attention in ("flex", "varlen") and device.type != "cuda":  # (no backward, or no kernel, on CPU)
        raise CellfeedError(f"packed_attention {attention!r} trains on CUDA only; use 'dense' or 'auto' here")
    model = CellTransformer(model_cfg).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # fused: one kernel for every parameter's update instead of a few per tensor (same state dict), on CUDA and on
    # CPU (8x faster there than the default: 3.7 ms against 31 ms a step for the tiny model's 4M parameters)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    summaries = {e: load_summary(store, cfg.run, e) for e in range(1 if cfg.max_steps else cfg.epochs)}
    saved = checkpoint.load(cfg.checkpoint_dir, device) if cfg.resume and cfg.checkpoint_dir else None
    step, epoch, progress, left = restore(saved, cfg, rank, world, model, optimizer, store, summaries)
    progress.data_id = cfg.data_id  # (kept in every checkpoint: a resume onto other data is refused)
    run_driver = rank == 0 and cfg.run_driver
    resumed = progress if saved is not None else None  # (on rank 0: every rank's, merged)
    driver = start_driver(cfg, queue, store, resumed, epoch, summaries, world) if run_driver else None
    stream = open_stream(
        cfg, queue, store, rank, world, progress, saved, epoch, summaries, driver, stop_asked, attention
    )
    tracker = Tracker(
        rank,
        cfg.log_path,
        total_steps(cfg, store, summaries, step, epoch, left),
        peak_flops(device),
        cfg.progress_bar,
        first_step=step,
        tb_dir=cfg.tb_dir,
        wandb_project=cfg.wandb_project,
        run=cfg.run,
    )
    if rank == 0:
        print(
            f"model {cfg.preset}: {model.n_params() / 1e6:.1f}M parameters "
            f"({model.n_params(embeddings=False) / 1e6:.1f}M outside embeddings); world size {world}, {device}"
        )
    held_out = load_held_out(queue, cfg, device) if rank == 0 and cfg.eval_every and cfg.eval_cells else None
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    if held_out is not None:
        tracker.note(step, evaluate(model, held_out, cfg, autocast))  # the starting point
    return Run(
        cfg, store, rank, world, device, model, ddp, torch.compile(ddp) if cfg.compile else ddp, optimizer, autocast,
        summaries, sum(sum(s.cells_per_rank) for s in summaries.values()), step, epoch, progress, left,
        Schedule.of(saved, cfg, world, summaries),  # cells trained so far, the warm-up: kept in checkpoints
        driver, stream, tracker, held_out,
        open(f"{cfg.cells_log}.rank{rank}.jsonl", "a") if cfg.cells_log else None,
        stop_asked, saved.step if saved is not None else None,
        earlier_audits(saved, cfg, store, summaries),
    )  # fmt: skip


def open_stream(cfg, queue, store, rank, world, progress, saved, epoch, summaries, driver, stop_asked, attention):
    """This rank's batches (`trainer.stream`), from where the resumed checkpoint left it."""
    before = checkpoint.RankProgress.merged(saved.ranks) if saved is not None else checkpoint.RankProgress(epoch)
    return ConsumerStream(
        queue,
        rank=rank,
        world_size=world,
        run=cfg.run,
        batch_size=cfg.batch_size,
        pad_to=cfg.pad_to,
        pad_token=cfg.pad_token,
        tokens_per_row=cfg.tokens_per_row,
        tokens_per_batch=cfg.tokens_per_batch,
        grad_accum=cfg.grad_accum,
        spans=attention == "varlen",  # batches cut into their cells' spans for varlen attention only
        buffer_cells=cfg.buffer_cells,
        seed=cfg.seed,
        no_data_timeout_s=cfg.no_data_timeout_s,
        consumed=progress.consumed,
        trained_cells=progress.partial,
        check=driver.check if driver else None,
        on_starved=lambda e, batches: ask_again(queue, store, cfg, rank, world, e, batches, summaries, before),
        stop_asked=lambda: bool(stop_asked),  # a starved rank answers a stop within a second
    )


def forward_backward(run: Run, batch, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's loss and gradients (DDP syncs them on the step's last batch). Its counts, and this
    rank's stop request and whether its epoch was cut, ride on one all-reduce. Nothing here waits for
    the GPU: the host's values travel from pinned memory, and what is read back is read after the step."""
    cfg, device = run.cfg, run.device
    batch = batch.to(device)
    generator = torch.Generator().manual_seed(mask_seed(cfg.seed, run.rank, run.step, micro))
    sync = micro == cfg.grad_accum - 1
    with run.autocast, run.ddp.no_sync() if not sync else nullcontext():
        loss_sum, n_masked, correct = masked_loss(
            run.step_model, batch, cfg.mask_ratio, generator, cfg.n_bins, run.model.config
        )
        # (a rank's stop cut its epoch: `cut`; whether this rank has cells of the epoch left after the step, which
        # ends a token budget's epoch when no rank has: on the step's last batch only, so the step is whole)
        has_left = float(sync and run.batches.cells_left > 0)
        flags = torch.tensor([float(bool(run.stop_asked)), float(batch.size), float(run.batches.cut), has_left])
        flags = (flags.pin_memory() if device.type == "cuda" else flags).to(device, non_blocking=True)
        counts = torch.cat([torch.stack([n_masked.float(), loss_sum.detach().float(), correct.float()]), flags])
        dist.all_reduce(counts)  # global masked count: every position weighs the same
        loss = loss_sum * run.world / counts[0].clamp(min=1)
        if batch.size == 0:  # an empty batch (this rank ran out first): zero gradients,
            loss = loss + 0.0 * sum(p.sum() for p in run.model.parameters())  # but DDP stays in step
        loss.backward()
    run.progress.record(batch)
    if run.cells_log is not None:
        line = {"step": run.step, "epoch": run.epoch, "cells": batch.cell_ids.tolist()}
        run.cells_log.write(json.dumps(line) + "\n")
        run.cells_log.flush()
    return counts, n_masked


def optimizer_step(run: Run, cells: int) -> tuple[float, torch.Tensor]:
    """Clip, set the learning rate (by cells trained, or by step with --steps), step. (lr, grad norm)."""
    cfg = run.cfg
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
    run.schedule.cells_done += cells  # every rank's cells of this step
    lr = cfg.lr * (
        lr_factor(run.step + 1, cfg.warmup_steps, cfg.max_steps)
        if cfg.max_steps
        else lr_factor(run.schedule.cells_done, run.schedule.warmup_cells, run.total_cells)
    )
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    return lr, grad_norm


def save(run: Run) -> None:
    """A checkpoint at this step (a collective: every rank calls it; rank 0 writes)."""
    cfg, model, optimizer = run.cfg, run.model, run.optimizer
    run.saved_at = run.step
    checkpoint.save(
        cfg.checkpoint_dir,
        run.step,
        run.epoch,
        run.rank,
        run.world,
        run.progress,
        lambda: {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "config": json.dumps(asdict(cfg)),
            "schedule": json.dumps(asdict(run.schedule)),
            "audits": json.dumps(run.earlier_audits + run.audits),
        },
        gather_texts,
        dist.barrier,
        keep=cfg.keep_checkpoints,
        eval_loss=run.tracker.evals[-1]["eval_loss"] if run.tracker.evals else None,
    )


def close_epoch(run: Run) -> None:
    """The epoch is complete: its exactly-once audit, then the next epoch (and the checkpoint it starts from)."""
    audit = audit_epoch(run.epoch, run.progress, run.summary(run.epoch), run.world, run.device)
    run.audits.append(audit)
    run.tracker.audited(run.step, audit)
    if run.rank == 0:
        print(audit["line"], flush=True)
    run.epoch += 1
    run.progress.next_epoch(run.epoch)
    run.left = None
    if run.save_after_audit:  # (a resume from it starts the next epoch, the audit in its ledger)
        save(run)
        run.save_after_audit = False


def close(run: Run) -> None:
    """Whatever the end: a stopped rank gives back what it took and did not train; the stream, the
    driver and the cells log end."""
    if run.stopping:  # asked to stop (a preemption, a hand-over) and checkpointed at this step: what this rank
        try:  # took and did not train goes back to its partition, for the resumed run
            run.stream.give_back(run.batches)
        except Exception as exc:  # noqa: BLE001 - what is not given back is asked for again after the resume
            print(
                f"rank {run.rank}: could not give back its untrained items ({type(exc).__name__}: {exc})",
                file=sys.stderr,
                flush=True,
            )
    run.stream.close(wait=True)  # (a poll, 1 s at most: a fetcher still in a queue get as the process exits
    # meets a closed Modal client, and its traceback lands in the function's logs)
    if run.driver is not None:
        run.driver.stop()
    if run.cells_log is not None:
        run.cells_log.close()


def finish(run: Run) -> dict:
    """The rank's summary: its metrics, every epoch's audit and where the run ended."""
    cfg, epoch, driver = run.cfg, run.epoch, run.driver
    in_progress = None
    if epoch < cfg.epochs:  # stopped inside an epoch: every rank's cells of it so far (all ranks are here)
        mine = torch.tensor([run.progress.trained + run.progress.carried], dtype=torch.int64, device=run.device)
        dist.all_reduce(mine)
        in_progress = int(mine)
    summary = run.tracker.finish()
    if driver is not None and driver.stats.redone:
        print(
            f"{driver.stats.redone} units were produced again: their items never reached a rank (lost in transit)",
            flush=True,
        )
    ledger = run.earlier_audits + run.audits
    summary["audits"] = run.audits
    summary["epochs"] = epoch_ledger(cfg.run, cfg.epochs, run.store, run.summaries, ledger, epoch, in_progress)
    summary["complete"] = epoch >= cfg.epochs  # every epoch trained (its audit is in `epochs`)
    stopped = None if epoch >= cfg.epochs else "asked" if run.stopping else "steps" if run.steps_done() else None
    summary["stopped"] = stopped
    summary["last_step"] = run.step
    summary["resume_skipped_units"] = driver.stats.skipped_units if driver is not None else 0
    summary["units_reissued"] = driver.stats.reissued if driver is not None else 0  # their holders fell silent
    summary["units_released"] = driver.stats.released if driver is not None else 0  # ... or said so, or restarted
    summary["units_redone"] = driver.stats.redone if driver is not None else 0  # their items never reached a rank
    summary["params"] = run.model.n_params()
    summary["final_params_checksum"] = float(sum(p.detach().double().sum() for p in run.model.parameters()))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description="One rank of a cellfeed training run (see trainer.launch).")
    parser.add_argument("--config", required=True, help="a JSON TrainConfig")
    parser.add_argument("--summary", help="write each rank's end-of-run summary (JSON) to SUMMARY.rank<r>")
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = TrainConfig(**json.load(f))
    try:
        summary = train(cfg)
        if args.summary:
            with open(f"{args.summary}.rank{dist.get_rank()}", "w") as f:
                json.dump(summary, f)
    except CellfeedError as exc:  # every rank meets it; rank 0 says it, in one line
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"cellfeed: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
