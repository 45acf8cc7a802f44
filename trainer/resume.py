"""A rank's start: from a checkpoint (its weights, optimizer state and progress, written by this
many ranks or another, after checking it continues the same run) or from nothing; and rank 0's
driver, which skips the units a checkpoint says were trained through."""

from __future__ import annotations

import json

from coordination.driver import Driver
from coordination.errors import CellfeedError
from coordination.summary import load_summary, optimizer_steps, steps_per_epoch
from trainer import checkpoint
from trainer.config import TrainConfig


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
    load_optimizer(optimizer, saved.state["optimizer"])
    everything = checkpoint.RankProgress.merged(saved.ranks)
    progress = everything if rank == 0 else everything.without_totals()  # rank 0 carries the totals
    left = None
    if saved.epoch < cfg.epochs:
        if saved.epoch not in summaries:
            summaries[saved.epoch] = load_summary(store, cfg.run, saved.epoch)
        left = summaries[saved.epoch].cells_left_per_rank(world, everything.unit_trained, everything.trained_stitched())
    if rank == 0:
        before = sum(r.trained + r.carried for r in saved.ranks)
        moved = (
            ""
            if len(saved.ranks) == world
            else (
                f"; written by {len(saved.ranks)} ranks, its {sum(left or []):,} cells left are re-planned over {world}"
            )
        )
        print(f"resumed from step {saved.step} (epoch {saved.epoch}, {before:,} cells of it already trained{moved})")
    return saved.step, saved.epoch, progress, left


def load_optimizer(optimizer, state: dict) -> None:
    """The checkpoint's optimizer state, stepped as this run steps. Each saved param group carries
    the saving run's `fused` and `foreach` (a checkpoint written before AdamW was fused on CPU,
    or by another build), and torch's `load_state_dict` takes the groups whole: the run would go
    on unfused, its `step` counts left where the unfused update keeps them."""
    groups = state["param_groups"]
    if len(groups) == len(optimizer.param_groups):  # (else torch's own error says they differ)
        how = [{k: g.get(k) for k in ("fused", "foreach")} for g in optimizer.param_groups]
        state = {**state, "param_groups": [{**saved, **h} for saved, h in zip(groups, how)]}
    optimizer.load_state_dict(state)


def check_resume(saved: checkpoint.Checkpoint, cfg: TrainConfig, model, store) -> None:
    """A resume continues the same run: the checkpoint's epoch must have the plan it was trained
    on (same dataset, sampling, seed, splits), its vocabulary must be this one, and its weights must
    fit this model (the number of ranks may differ: `restore` re-plans the epoch's rest)."""
    theirs_vocab = json.loads(saved.state.get("config", "{}")).get("vocab_fingerprint", "")
    if theirs_vocab and cfg.vocab_fingerprint and theirs_vocab != cfg.vocab_fingerprint:
        raise CellfeedError(
            f"--resume: the checkpoint at step {saved.step} was trained on another gene vocabulary "
            f"({theirs_vocab}, this campaign's {cfg.vocab_fingerprint}): its token ids mean other genes; "
            "resume with the run's own --vocabulary and sources, or start a new --run"
        )
    checkpoint.check_same_data(saved.step, saved.ranks[0].data_id, cfg.data_id)
    checkpoint.check_same_plan(saved.step, saved.epoch, saved.ranks[0].plan_id, store, cfg.run, cfg.epochs)
    mine = model.state_dict()
    theirs = saved.state["model"]
    wrong = sorted(
        k for k in set(mine) | set(theirs) if k not in mine or k not in theirs or mine[k].shape != theirs[k].shape
    )
    if wrong:
        raise CellfeedError(
            f"--resume: the checkpoint at step {saved.step} does not fit the model of these settings "
            f"({len(wrong)} tensors differ, e.g. {wrong[0]}): --preset, --tokenizer, --max-genes or "
            "--n-bins changed; resume with the run's own settings, or start a new --run"
        )


def start_driver(cfg: TrainConfig, queue, store, resumed, epoch: int, summaries: dict, world: int) -> Driver:
    """Rank 0 drives the epochs from `epoch` on; on resume (`resumed`: every rank's progress from
    the checkpoint, merged), units trained through are not produced again
    (`PlanSummary.units_to_skip`). `summaries`: the epochs' plan summaries read so far (`restore`
    added the resumed epoch's)."""
    skip = set()
    if resumed is not None and epoch < cfg.epochs:
        summary = summaries[epoch]
        skip = summary.units_to_skip(resumed.done_units(), resumed.trained_stitched())
        print(
            f"{len(skip):,} of epoch {epoch}'s {summary.n_units:,} units were trained through and are not "
            "produced again"
        )
    driver = Driver(queue, store, cfg.run, lease_s=cfg.lease_s, stall_timeout_s=cfg.no_data_timeout_s, world_size=world)
    driver.start(
        list(range(epoch, cfg.epochs)),
        resume_epoch=epoch if resumed is not None else None,
        skip_units=skip,
        linger=True,
    )  # (after the last epoch it still answers ranks that ask for units again)
    return driver


def total_steps(cfg: TrainConfig, store, summaries: dict, step: int, epoch: int, left) -> int | None:
    """The run's optimizer steps (for the progress bar): a campaign of epochs ends when every epoch's
    cells are trained, on any number of ranks, so its steps follow from this run's ranks; a resume
    adds the epoch's rest (maybe on other ranks) and the later epochs'. --steps is a partial run.
    None with a token budget: a step's cells depend on the cells drawn."""
    if cfg.max_steps:
        return cfg.max_steps
    if cfg.tokens_per_batch is not None:
        return None
    if left is None:
        return optimizer_steps(list(summaries.values()), cfg.batch_size, cfg.grad_accum)
    later = [summaries.get(e) or load_summary(store, cfg.run, e) for e in range(epoch + 1, cfg.epochs)]
    return (
        step
        + steps_per_epoch(left, cfg.batch_size, cfg.grad_accum) // cfg.grad_accum
        + optimizer_steps(later, cfg.batch_size, cfg.grad_accum)
    )


def earlier_audits(saved, cfg: TrainConfig, store, summaries: dict) -> list[dict]:
    """The audits of the epochs finished before this run: the checkpoint's ledger (one that predates
    the ledger: its trainer audited every epoch it finished, or stopped)."""
    if saved is not None and "audits" in saved.state:
        return json.loads(saved.state["audits"])
    done = saved.epoch if saved is not None else 0
    return [
        {
            "epoch": e,
            "cells": sum((summaries.get(e) or load_summary(store, cfg.run, e)).cells_per_rank),
            "audited": True,
        }
        for e in range(done)
    ]
