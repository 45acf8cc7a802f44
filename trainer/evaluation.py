"""Evaluation on the held-out set: its items popped once into fixed batches (`load_held_out`),
and the masked accuracy on them (`evaluate`), the same masks every time."""

from __future__ import annotations

import time

import torch

from coordination.errors import CellfeedError
from coordination.queues import Empty, Full, request_batches
from coordination.routing import EVAL_PARTITION, run_tag
from coordination.wire import unpack_item
from trainer.config import TrainConfig
from trainer.model import masked_loss
from trainer.stream import collate

HELD_OUT_QUIET_S = 5.0  # the held-out partition empty this long with the set short: some of it was lost


def load_held_out(queue, cfg: TrainConfig, device: torch.device) -> list:
    """The fixed evaluation batches: every held-out item, popped once (bounded wait)."""
    raw, items = [], []
    deadline = time.monotonic() + cfg.no_data_timeout_s
    while sum(i.n_cells for i in items) < cfg.eval_cells:
        if time.monotonic() > deadline:
            raise CellfeedError(
                f"held-out set incomplete after {cfg.no_data_timeout_s:.0f}s: did the setup produce it?"
            )
        try:
            got = queue.get_many(64, timeout=HELD_OUT_QUIET_S, partition=EVAL_PARTITION)
        except Empty:
            if not items:
                continue
            # the partition is empty, the set short: a get's reply was lost (its items are gone). Evaluate
            # on the rest; the next train call finds the set short and runs the setup again (ensure_setup)
            print(
                f"held-out set: {sum(i.n_cells for i in items):,} of {cfg.eval_cells:,} cells (the rest were lost "
                "in transit): evaluating on these; the next setup restores the set",
                flush=True,
            )
            break
        raw += got
        items += [unpack_item(b, run_tag=run_tag(cfg.run)) for b in got]
    for batch in request_batches(raw):  # put back: a re-run of this trainer (preemption) reads them too
        try:  # (room it just made: a partition still full after the data timeout is an error, not a hang)
            queue.put_many(batch, timeout=cfg.no_data_timeout_s, partition=EVAL_PARTITION)
        except Full:
            raise CellfeedError(
                f"the held-out set could not be put back in {cfg.no_data_timeout_s:.0f}s: its partition stayed full"
            ) from None
    cells = [(item, i) for item in items for i in range(item.n_cells)]  # every cell, in order, as batches
    size = cfg.batch_size
    return [
        collate(cells[a : a + size], cfg.pad_to, False, cfg.pad_token).to(device) for a in range(0, len(cells), size)
    ]


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
    return {
        "eval_loss": round(float(totals[0] / totals[1].clamp(min=1)), 5),
        "eval_accuracy": round(float(totals[2] / totals[1].clamp(min=1)), 4),
    }
