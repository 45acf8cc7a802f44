"""The DDP training loop: batches come only from the consumer stream.

Run one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (torchrun, or
`trainer.launch`): `python -m trainer.train --config config.json`. gloo on CPU, NCCL + bf16
autocast on GPU, unchanged.

SIGUSR2 asks a rank to checkpoint and stop (`trainer.launch.checkpoint_and_stop`: before a
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
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from coordination.audit import epoch_ledger
from coordination.backends import connect
from coordination.errors import CellfeedError
from coordination.seeds import mask_seed
from coordination.summary import load_summary, optimizer_steps, steps_per_epoch
from trainer import checkpoint
from trainer.config import STOP_SIGNAL, TrainConfig
from trainer.evaluation import evaluate, load_held_out
from trainer.exactly_once import ask_again, audit_epoch
from trainer.metrics import StepMetrics, Tracker, peak_flops
from trainer.model import CellTransformer, ModelConfig, masked_loss, train_flops
from trainer.resume import restore, start_driver
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


def train(cfg: TrainConfig, queue=None, store=None) -> dict:
    stop_asked = []  # set by STOP_SIGNAL; all-reduced with each step's counts so every rank stops together
    signal.signal(STOP_SIGNAL, lambda *_: stop_asked.append(True))
    # a preemption's SIGINT reaches every process of a Modal container at once, this rank too: it asks
    # for the same checkpoint-and-stop (a terminal's Ctrl-C never gets here: ranks have sessions of their own)
    signal.signal(signal.SIGINT, lambda *_: stop_asked.append(True))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {STOP_SIGNAL})  # held by the launcher until now
    rank, world, device = init_distributed()
    if queue is None:
        queue, store = connect(cfg.backend)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model_cfg = ModelConfig.preset(
        cfg.preset,
        cfg.vocab_size,
        cfg.n_bins,
        cfg.objective,
        pad_token=cfg.pad_token,
        mask_token=cfg.mask_token,
        special_tokens=tuple(cfg.special_tokens),
    )
    model = CellTransformer(model_cfg).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    step_model = torch.compile(ddp) if cfg.compile else ddp
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    summaries = {e: load_summary(store, cfg.run, e) for e in range(1 if cfg.max_steps else cfg.epochs)}
    # a campaign of epochs ends when every epoch's cells are trained, on any number of ranks; its
    # step count (for the progress bar) follows from this run's ranks. `max_steps` (--steps) is an
    # explicit partial run.
    total_steps = cfg.max_steps or optimizer_steps(list(summaries.values()), cfg.batch_size, cfg.grad_accum)
    total_cells = sum(sum(s.cells_per_rank) for s in summaries.values())  # (the schedule's, without --steps)

    saved = checkpoint.load(cfg.checkpoint_dir, device) if cfg.resume and cfg.checkpoint_dir else None
    step, epoch, progress, left = restore(saved, cfg, rank, world, model, optimizer, store, summaries)
    schedule = Schedule.of(saved, cfg, world, summaries)  # cells trained so far, the warm-up: kept in checkpoints
    if left is not None and not cfg.max_steps:  # a resume: the epoch's rest (maybe on other ranks), then the others
        later = [summaries.get(e) or load_summary(store, cfg.run, e) for e in range(epoch + 1, cfg.epochs)]
        total_steps = (
            step
            + steps_per_epoch(left, cfg.batch_size) // cfg.grad_accum
            + optimizer_steps(later, cfg.batch_size, cfg.grad_accum)
        )
    progress.data_id = cfg.data_id  # (kept in every checkpoint: a resume onto other data is refused)
    resumed = progress if saved is not None else None  # (on rank 0: every rank's, merged)
    driver = start_driver(cfg, queue, store, resumed, epoch, summaries, world) if rank == 0 and cfg.run_driver else None
    before = checkpoint.RankProgress.merged(saved.ranks) if saved is not None else checkpoint.RankProgress(epoch)
    stream = ConsumerStream(
        queue,
        rank=rank,
        world_size=world,
        run=cfg.run,
        batch_size=cfg.batch_size,
        pad_to=cfg.pad_to,
        pad_token=cfg.pad_token,
        buffer_cells=cfg.buffer_cells,
        seed=cfg.seed,
        no_data_timeout_s=cfg.no_data_timeout_s,
        consumed=progress.consumed,
        trained_cells=progress.partial,
        check=driver.check if driver else None,
        on_starved=lambda e, batches: ask_again(queue, store, cfg, rank, world, e, batches, summaries, before),
        stop_asked=lambda: bool(stop_asked),  # a starved rank answers a stop within a second
    )
    cells_log = open(f"{cfg.cells_log}.rank{rank}.jsonl", "a") if cfg.cells_log else None
    tracker = Tracker(
        rank,
        cfg.log_path,
        total_steps,
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
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    )
    if held_out is not None:
        tracker.note(step, evaluate(model, held_out, cfg, autocast))  # the starting point

    saved_at = [saved.step if saved is not None else None]  # the step of this run's last checkpoint

    def save():
        saved_at[0] = step
        checkpoint.save(
            cfg.checkpoint_dir,
            step,
            epoch,
            rank,
            world,
            progress,
            lambda: {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "config": json.dumps(asdict(cfg)),
                "schedule": json.dumps(asdict(schedule)),
                "audits": json.dumps(earlier_audits + audits),
            },
            gather_texts,
            dist.barrier,
            keep=cfg.keep_checkpoints,
            eval_loss=tracker.evals[-1]["eval_loss"] if tracker.evals else None,
        )

    earlier_audits = (
        json.loads(saved.state["audits"])
        if saved is not None and "audits" in saved.state
        else [
            {
                "epoch": e,
                "cells": sum((summaries.get(e) or load_summary(store, cfg.run, e)).cells_per_rank),
                "audited": True,
            }
            for e in range(saved.epoch if saved is not None else 0)
        ]
    )  # (a checkpoint that predates
    # the ledger: its trainer audited every epoch it finished, or stopped)
    audits: list[dict] = []
    stopping, batches, save_after_audit = False, None, False
    steps_done = lambda: cfg.max_steps is not None and step >= cfg.max_steps  # noqa: E731 - a --steps run's end
    try:
        while epoch < cfg.epochs and not steps_done():
            summary = summaries.get(epoch) or load_summary(store, cfg.run, epoch)
            progress.plan_id = summary.plan_id
            left = left or summary.cells_per_rank  # (a resumed epoch's: its cells not trained yet)
            micro = 0
            batches = stream.epoch(epoch, left)
            for batch in batches:
                # ---- one training step (gradients accumulate over `grad_accum` batches) ----------
                if micro == 0:  # the step's totals, over all its batches (waits included)
                    started, waited, cells, lengths, masked = time.perf_counter() - batch.wait_s, 0.0, 0, [], 0
                    totals = torch.zeros(6, device=device)
                batch = batch.to(device)
                generator = torch.Generator().manual_seed(mask_seed(cfg.seed, rank, step, micro))
                sync = micro == cfg.grad_accum - 1
                with autocast, ddp.no_sync() if not sync else nullcontext():
                    loss_sum, n_masked, correct = masked_loss(
                        step_model, batch, cfg.mask_ratio, generator, cfg.n_bins, model.config
                    )
                    counts = torch.stack(
                        [
                            n_masked.float(),
                            loss_sum.detach().float(),
                            correct.float(),
                            torch.tensor(float(bool(stop_asked)), device=device),
                            torch.tensor(float(batch.size), device=device),
                            torch.tensor(float(batches.cut), device=device),  # (a rank's stop cut its epoch)
                        ]
                    )
                    dist.all_reduce(counts)  # global masked count: every position weighs the same
                    loss = loss_sum * world / counts[0].clamp(min=1)
                    if int(n_masked) == 0:  # an empty batch (this rank ran out first): zero gradients,
                        loss = loss + 0.0 * sum(p.sum() for p in model.parameters())  # but DDP stays in step
                    loss.backward()
                totals += counts
                waited, cells, masked = waited + batch.wait_s, cells + batch.size, masked + int(n_masked)
                lengths.append(batch.attention_mask.sum(dim=1).cpu())
                progress.record(batch)
                if cells_log is not None:
                    cells_log.write(json.dumps({"step": step, "epoch": epoch, "cells": batch.cell_ids.tolist()}) + "\n")
                    cells_log.flush()
                micro += 1
                if not sync:
                    continue
                micro = 0
                if totals[5] > 0:  # a rank's epoch was cut short by the stop: every rank's is (the same branch
                    batches.cut = True  # below on all ranks: a checkpoint now, no audit of an epoch not finished)
                if totals[3] > 0 and totals[4] == 0:  # a stop met every rank starved: no cell, no step
                    optimizer.zero_grad(set_to_none=True)
                    stopping = True
                    if cfg.checkpoint_dir and saved_at[0] != step:  # (not again: a checkpoint at this step is kept)
                        save()
                    break
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                schedule.cells_done += int(totals[4])  # every rank's cells of this step
                lr = cfg.lr * (
                    lr_factor(step + 1, cfg.warmup_steps, cfg.max_steps)
                    if cfg.max_steps
                    else lr_factor(schedule.cells_done, schedule.warmup_cells, total_cells)
                )
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                # ---------------------------------------------------------------------------
                lengths = torch.cat(lengths)
                tracker.record(
                    StepMetrics(
                        step=step,
                        epoch=epoch,
                        loss=float(totals[1] / totals[0].clamp(min=1)),
                        accuracy=float(totals[2] / totals[0].clamp(min=1)),
                        lr=lr,
                        grad_norm=float(grad_norm),
                        seconds=time.perf_counter() - started,
                        wait_s=waited,
                        cells=cells,
                        tokens=int(lengths.sum()),
                        flops=train_flops(model_cfg, lengths, masked),
                        device=device,
                        ready_cells=batches.ready_cells,
                    )
                )
                if held_out is not None and step % cfg.eval_every == 0:
                    tracker.note(step, evaluate(model, held_out, cfg, autocast))
                stopping = bool(totals[3] > 0)  # a rank was asked to stop: all stop after this step
                if cfg.checkpoint_dir and (step % cfg.checkpoint_every == 0 or steps_done() or stopping):
                    if not batches.finished:
                        save()
                    else:  # the epoch's last step: saved once its audit is done, as the next epoch's start
                        save_after_audit = True
                if steps_done() or stopping:
                    break
            if not batches.finished:  # stopped inside the epoch (--steps are done, or asked to stop)
                break
            audits.append(audit_epoch(epoch, progress, summary, world, device))  # the epoch is complete
            tracker.audited(step, audits[-1])
            if rank == 0:
                print(audits[-1]["line"], flush=True)
            epoch += 1
            progress.next_epoch(epoch)
            left = None
            if save_after_audit:  # (a resume from it starts the next epoch, the audit in its ledger)
                save()
                save_after_audit = False
            if stopping:
                break
        if cfg.checkpoint_dir and not stopping:  # (a stop saved at its step already)
            save()
    finally:
        if stopping:  # asked to stop (a preemption, a hand-over) and checkpointed at this step: what this rank
            try:  # took and did not train goes back to its partition, for the resumed run
                stream.give_back(batches)
            except Exception as exc:  # noqa: BLE001 - what is not given back is asked for again after the resume
                print(
                    f"rank {rank}: could not give back its untrained items ({type(exc).__name__}: {exc})",
                    file=sys.stderr,
                    flush=True,
                )
        stream.close(wait=True)  # (a poll, 1 s at most: a fetcher still in a queue get as the process exits
        # meets a closed Modal client, and its traceback lands in the function's logs)
        if driver is not None:
            driver.stop()
        if cells_log is not None:
            cells_log.close()
    in_progress = None
    if epoch < cfg.epochs:  # stopped inside an epoch: every rank's cells of it so far (all ranks are here)
        mine = torch.tensor([progress.trained + progress.carried], dtype=torch.int64, device=device)
        dist.all_reduce(mine)
        in_progress = int(mine)
    summary = tracker.finish()
    if driver is not None and driver.stats.redone:
        print(
            f"{driver.stats.redone} units were produced again: their items never reached a rank (lost in transit)",
            flush=True,
        )
    summary["audits"] = audits
    summary["epochs"] = epoch_ledger(cfg.run, cfg.epochs, store, summaries, earlier_audits + audits, epoch, in_progress)
    summary["complete"] = epoch >= cfg.epochs  # every epoch trained (its audit is in `epochs`)
    summary["stopped"] = None if epoch >= cfg.epochs else "asked" if stopping else "steps" if steps_done() else None
    summary["last_step"] = step
    summary["resume_skipped_units"] = driver.stats.skipped_units if driver is not None else 0
    summary["units_reissued"] = driver.stats.reissued if driver is not None else 0  # their holders fell silent
    summary["units_redone"] = driver.stats.redone if driver is not None else 0  # their items never reached a rank
    summary["params"] = model.n_params()
    summary["final_params_checksum"] = float(sum(p.detach().double().sum() for p in model.parameters()))
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
