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
from coordination.driver import Driver
from coordination.errors import CellfeedError
from coordination.summary import load_summary, optimizer_steps, steps_per_epoch
from coordination.routing import run_tag
from coordination.seeds import mask_seed
from coordination.wire import unpack_item
from trainer import checkpoint
from trainer.config import STOP_SIGNAL, TrainConfig
from trainer.metrics import StepMetrics, Tracker, peak_flops
from trainer.schedule import Schedule, lr_factor
from trainer.model import CellTransformer, ModelConfig, masked_loss, train_flops
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
    model_cfg = ModelConfig.preset(cfg.preset, cfg.vocab_size, cfg.n_bins, cfg.objective, pad_token=cfg.pad_token,
                                   mask_token=cfg.mask_token, special_tokens=tuple(cfg.special_tokens))
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
        total_steps = step + steps_per_epoch(left, cfg.batch_size) // cfg.grad_accum + \
            optimizer_steps(later, cfg.batch_size, cfg.grad_accum)
    progress.data_id = cfg.data_id  # (kept in every checkpoint: a resume onto other data is refused)
    resumed = progress if saved is not None else None  # (on rank 0: every rank's, merged)
    driver = start_driver(cfg, queue, store, resumed, epoch, summaries, world) if rank == 0 and cfg.run_driver else None
    before = checkpoint.RankProgress.merged(saved.ranks) if saved is not None else checkpoint.RankProgress(epoch)
    stream = ConsumerStream(queue, rank=rank, world_size=world, run=cfg.run, batch_size=cfg.batch_size,
                            pad_to=cfg.pad_to, pad_token=cfg.pad_token, buffer_cells=cfg.buffer_cells, seed=cfg.seed,
                            no_data_timeout_s=cfg.no_data_timeout_s, consumed=progress.consumed,
                            trained_cells=progress.partial, check=driver.check if driver else None,
                            on_starved=lambda e, batches: ask_again(queue, store, cfg, rank, world, e, batches,
                                                                     summaries, before))
    cells_log = open(f"{cfg.cells_log}.rank{rank}.jsonl", "a") if cfg.cells_log else None
    tracker = Tracker(rank, cfg.log_path, total_steps, peak_flops(device), cfg.progress_bar, first_step=step)
    if rank == 0:
        print(f"model {cfg.preset}: {model.n_params() / 1e6:.1f}M parameters "
              f"({model.n_params(embeddings=False) / 1e6:.1f}M outside embeddings); world size {world}, {device}")
    held_out = load_held_out(queue, cfg, device) if rank == 0 and cfg.eval_every and cfg.eval_cells else None
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    if held_out is not None:
        tracker.note(step, evaluate(model, held_out, cfg, autocast))  # the starting point

    def save():
        checkpoint.save(cfg.checkpoint_dir, step, epoch, rank, world, progress, lambda: {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "config": json.dumps(asdict(cfg)),
            "schedule": json.dumps(asdict(schedule)), "audits": json.dumps(earlier_audits + audits)},
            dist.barrier, keep=cfg.keep_checkpoints, eval_loss=tracker.evals[-1]["eval_loss"] if tracker.evals else None)

    earlier_audits = json.loads(saved.state["audits"]) if saved is not None and "audits" in saved.state else \
        [{"epoch": e, "cells": sum((summaries.get(e) or load_summary(store, cfg.run, e)).cells_per_rank),
          "audited": True} for e in range(saved.epoch if saved is not None else 0)]  # (a checkpoint that predates
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
                    totals = torch.zeros(5, device=device)
                batch = batch.to(device)
                generator = torch.Generator().manual_seed(mask_seed(cfg.seed, rank, step, micro))
                sync = micro == cfg.grad_accum - 1
                with autocast, (ddp.no_sync() if not sync else nullcontext()):
                    loss_sum, n_masked, correct = masked_loss(step_model, batch, cfg.mask_ratio, generator,
                                                              cfg.n_bins, model.config)
                    counts = torch.stack([n_masked.float(), loss_sum.detach().float(), correct.float(),
                                          torch.tensor(float(bool(stop_asked)), device=device),
                                          torch.tensor(float(batch.size), device=device)])
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
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                schedule.cells_done += int(totals[4])  # every rank's cells of this step
                lr = cfg.lr * (lr_factor(step + 1, cfg.warmup_steps, cfg.max_steps) if cfg.max_steps else
                               lr_factor(schedule.cells_done, schedule.warmup_cells, total_cells))
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                # ---------------------------------------------------------------------------
                lengths = torch.cat(lengths)
                tracker.record(StepMetrics(
                    step=step, epoch=epoch, loss=float(totals[1] / totals[0].clamp(min=1)),
                    accuracy=float(totals[2] / totals[0].clamp(min=1)), lr=lr,
                    grad_norm=float(grad_norm), seconds=time.perf_counter() - started, wait_s=waited, cells=cells,
                    tokens=int(lengths.sum()), flops=train_flops(model_cfg, lengths, masked), device=device,
                    ready_cells=batches.ready_cells))
                if held_out is not None and step % cfg.eval_every == 0:
                    tracker.note(step, evaluate(model, held_out, cfg, autocast))
                stopping = bool(totals[3] > 0)  # a rank was asked to stop: all stop after this step
                if cfg.checkpoint_dir and (step % cfg.checkpoint_every == 0 or steps_done() or stopping):
                    if batches.step < batches.steps:
                        save()
                    else:  # the epoch's last step: saved once its audit is done, as the next epoch's start
                        save_after_audit = True
                if steps_done() or stopping:
                    break
            if batches.step < batches.steps:  # stopped inside the epoch (--steps are done, or asked to stop)
                break
            audits.append(audit_epoch(epoch, progress, summary, world, device))  # the epoch is complete
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
                print(f"rank {rank}: could not give back its untrained items ({type(exc).__name__}: {exc})",
                      file=sys.stderr, flush=True)
        stream.close(wait=False)  # training is over: the rank need not wait out the fetcher's poll (up to 1 s)
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
        print(f"{driver.stats.redone} units were produced again: their items never reached a rank (lost in transit)",
              flush=True)
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



def restore(saved, cfg: TrainConfig, rank: int, world: int, model, optimizer, store, summaries: dict):
    """(step, epoch, this rank's progress, the cells each rank has left of the epoch): a
    checkpoint's -- its weights and optimizer state loaded, written by this many ranks or another
    (the epoch's untrained cells are then re-planned over these ranks) -- or a fresh start."""
    if saved is None:
        if cfg.resume and rank == 0:
            print(f"no checkpoint in {cfg.checkpoint_dir}: starting at step 0")
        return 0, 0, checkpoint.RankProgress(), None
    check_resume(saved, cfg, model, store)
    model.load_state_dict(saved.state["model"])
    optimizer.load_state_dict(saved.state["optimizer"])
    everything = checkpoint.RankProgress.merged(saved.ranks)
    progress = everything if rank == 0 else everything.without_totals()  # rank 0 carries the totals
    left = None
    if saved.epoch < cfg.epochs:
        if saved.epoch not in summaries:
            summaries[saved.epoch] = load_summary(store, cfg.run, saved.epoch)
        left = summaries[saved.epoch].cells_left_per_rank(world, everything.unit_trained,
                                                          everything.trained_stitched())
    if rank == 0:
        before = sum(r.trained + r.carried for r in saved.ranks)
        moved = "" if len(saved.ranks) == world else \
            (f"; written by {len(saved.ranks)} ranks, its {sum(left or []):,} cells left are re-planned over {world}")
        print(f"resumed from step {saved.step} (epoch {saved.epoch}, {before:,} cells of it already trained{moved})")
    return saved.step, saved.epoch, progress, left


def start_driver(cfg: TrainConfig, queue, store, resumed, epoch: int, summaries: dict, world: int) -> Driver:
    """Rank 0 drives the epochs from `epoch` on; on resume (`resumed`: every rank's progress from
    the checkpoint, merged), units trained through are not produced again
    (`PlanSummary.units_to_skip`). `summaries`: the epochs' plan summaries read so far (`restore`
    added the resumed epoch's)."""
    skip = set()
    if resumed is not None and epoch < cfg.epochs:
        summary = summaries[epoch]
        skip = summary.units_to_skip(resumed.done_units(), resumed.trained_stitched())
        print(f"{len(skip):,} of epoch {epoch}'s {summary.n_units:,} units were trained through and are not "
              "produced again")
    driver = Driver(queue, store, cfg.run, lease_s=cfg.lease_s, stall_timeout_s=cfg.no_data_timeout_s,
                    world_size=world)
    driver.start(list(range(epoch, cfg.epochs)), resume_epoch=epoch if resumed is not None else None, skip_units=skip,
                 linger=True)  # (after the last epoch it still answers ranks that ask for units again)
    return driver


MAX_REDO_UNITS = 4000  # units one request names (~50 KB of JSON); the rest at the next request
HELD_OUT_QUIET_S = 5.0  # the held-out partition empty this long with the set short: some of it was lost


def ask_again(queue, store, cfg: TrainConfig, rank: int, world: int, epoch: int, batches, summaries: dict,
              before: checkpoint.RankProgress) -> None:
    """This rank has waited for cells that do not come: ask the driver for the units whose items
    never reached it (`PlanSummary.units_missing`; `before`: what a checkpoint says was trained of
    the epoch it resumed). The driver produces again only those it has finished."""
    from coordination.queues import Full
    from coordination.routing import EVENTS_PARTITION, encode_event

    summary = summaries.get(epoch) or load_summary(store, cfg.run, epoch)
    resumed = before.epoch == epoch
    missing = summary.units_missing(rank, world, batches.complete_units(), batches.stitched_received,
                                    before.unit_trained if resumed else {},
                                    before.trained_stitched() if resumed else set())
    if not missing:
        return
    try:
        queue.put_many([encode_event(f"rank-{rank}", redo=[(epoch, u) for u in missing[:MAX_REDO_UNITS]])],
                       block=True, timeout=5.0, partition=EVENTS_PARTITION)
    except Full:
        pass  # the events are backed up: the next request, a few seconds on


def load_held_out(queue, cfg: TrainConfig, device: torch.device) -> list:
    """The fixed evaluation batches: every held-out item, popped once (bounded wait)."""
    from coordination.queues import request_batches
    from coordination.routing import EVAL_PARTITION
    from trainer.stream import collate_items

    from coordination.queues import Empty

    raw, items = [], []
    deadline = time.monotonic() + cfg.no_data_timeout_s
    while sum(i.n_cells for i in items) < cfg.eval_cells:
        if time.monotonic() > deadline:
            raise CellfeedError(f"held-out set incomplete after {cfg.no_data_timeout_s:.0f}s: did the setup produce it?")
        try:
            got = queue.get_many(64, timeout=HELD_OUT_QUIET_S, partition=EVAL_PARTITION)
        except Empty:
            if not items:
                continue
            # the partition is empty, the set short: a get's reply was lost (its items are gone). Evaluate
            # on the rest; the next train call finds the set short and runs the setup again (ensure_setup)
            print(f"held-out set: {sum(i.n_cells for i in items):,} of {cfg.eval_cells:,} cells (the rest were lost "
                  "in transit): evaluating on these; the next setup restores the set", flush=True)
            break
        raw += got
        items += [unpack_item(b, run_tag=run_tag(cfg.run)) for b in got]
    for batch in request_batches(raw):  # put back: a re-run of this trainer (preemption) reads them too
        queue.put_many(batch, partition=EVAL_PARTITION)
    return [b.to(device) for b in collate_items(items, cfg.batch_size, cfg.pad_to, cfg.pad_token)]


def check_resume(saved: checkpoint.Checkpoint, cfg: TrainConfig, model, store) -> None:
    """A resume continues the same run: the checkpoint's epoch must have the plan it was trained
    on (same dataset, sampling, seed, splits), its vocabulary must be this one, and its weights must
    fit this model (the number of ranks may differ: `restore` re-plans the epoch's rest)."""
    theirs_vocab = json.loads(saved.state.get("config", "{}")).get("vocab_fingerprint", "")
    if theirs_vocab and cfg.vocab_fingerprint and theirs_vocab != cfg.vocab_fingerprint:
        raise CellfeedError(f"--resume: the checkpoint at step {saved.step} was trained on another gene vocabulary "
                            f"({theirs_vocab}, this campaign's {cfg.vocab_fingerprint}): its token ids mean other genes; "
                            "resume with the run's own --vocabulary and sources, or start a new --run")
    checkpoint.check_same_data(saved.step, saved.ranks[0].data_id, cfg.data_id)
    checkpoint.check_same_plan(saved.step, saved.epoch, saved.ranks[0].plan_id, store, cfg.run, cfg.epochs)
    mine = model.state_dict()
    theirs = saved.state["model"]
    wrong = sorted(k for k in set(mine) | set(theirs)
                   if k not in mine or k not in theirs or mine[k].shape != theirs[k].shape)
    if wrong:
        raise CellfeedError(f"--resume: the checkpoint at step {saved.step} does not fit the model of these settings "
                            f"({len(wrong)} tensors differ, e.g. {wrong[0]}): --preset, --tokenizer, --max-genes or "
                            "--n-bins changed; resume with the run's own settings, or start a new --run")


def audit_epoch(epoch: int, progress: checkpoint.RankProgress, summary, world: int, device) -> dict:
    """The end-of-epoch exactly-once check, on every rank: each rank's trained-cell count and the
    order-independent hash of their ids (`coordination.audit.cells_hash`, kept in checkpoints
    across restarts) against the plan's. An epoch resumed from a checkpoint (on any number of
    ranks) is checked as a whole: the cells trained before (carried by rank 0) and by every rank
    since, against the whole plan. Raises, naming the rank where it can, when cells were lost or
    duplicated; cheap at any scale (one all-gather of five numbers per rank)."""
    def signed(h):
        return 0 if h is None else h - 2**64 if h >= 2**63 else h

    h, c = progress.cells_hash, progress.carried_hash
    mine = torch.tensor([progress.trained, signed(h), h is not None and c is not None, progress.carried, signed(c)],
                        dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    counts = [int(t[0]) for t in every]
    hashes = [int(t[1]) % 2**64 for t in every]
    carried, carried_hash = sum(int(t[3]) for t in every), sum(int(t[4]) for t in every) % 2**64
    trained, expected = sum(counts) + carried, sum(summary.cells_per_rank)
    if not summary.cell_hash_per_rank or not all(int(t[2]) for t in every):
        return {"epoch": epoch, "cells": trained, "audited": False,
                "line": f"epoch {epoch}: {trained:,} cells trained (not audited: the plan or a checkpoint predates it)"}
    fail = ("epoch {epoch} failed its exactly-once audit: {who} trained {what} ({got:,} of {want:,}): cells were lost "
            "or duplicated; the last checkpoint is kept, and --audit-cells records which cells each step trained")
    checks = [("rank " + str(r), counts[r], hashes[r], summary.cells_per_rank[r], summary.cell_hash_per_rank[r])
              for r in range(world)] if not carried else \
        [("the resumed epoch's ranks, before and after", trained, (sum(hashes) + carried_hash) % 2**64, expected,
          sum(summary.cell_hash_per_rank) % 2**64)]
    for who, got, got_hash, want, want_hash in checks:
        if got != want or got_hash != want_hash:
            what = (f"{want - got:,} fewer cells than planned" if got < want else
                    f"{got - want:,} more cells than planned" if got > want else
                    "the planned number of cells, but not the planned cells")
            raise CellfeedError(fail.format(epoch=epoch, who=who, what=what, got=got, want=want))
    scope = "every rank" if not carried else "the whole epoch, across the resume"
    return {"epoch": epoch, "cells": trained, "audited": True, "missing": 0, "duplicated": 0,
            "line": f"epoch {epoch}: {trained:,} cells trained, 0 missing, 0 duplicated "
                    f"(of {expected:,} planned; count and cell-id hash checked on {scope})"}


@torch.no_grad()
def evaluate(model, batches: list, cfg: TrainConfig, autocast) -> dict:
    """Masked-bin (or masked-gene) accuracy on the fixed held-out batches, same masks every time."""
    model.eval()
    generator = torch.Generator().manual_seed(cfg.seed)
    totals = torch.zeros(3)
    for batch in batches:
        with autocast:
            loss_sum, n, correct = masked_loss(model, batch, cfg.mask_ratio, generator, cfg.n_bins, model.config)
        totals += torch.tensor([float(loss_sum), float(n), float(correct)])
    model.train()
    return {"eval_loss": round(float(totals[0] / totals[1].clamp(min=1)), 5),
            "eval_accuracy": round(float(totals[2] / totals[1].clamp(min=1)), 4)}


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
