"""The learning-rate schedule: linear warm-up, then cosine decay to 10%, as a function of how far
the campaign is. A campaign of epochs measures that in cells trained (every rank's, every
epoch's), so its curve is the same on any number of ranks and across resumes on another number;
the state (`Schedule`) is kept in checkpoints. A `--steps` run measures it in steps."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from trainer.config import TrainConfig


def lr_factor(done: float, warmup: float, total: float) -> float:
    """Linear warm-up over `warmup`, then cosine decay to 10% at `total`; `done` counts this step
    in. A campaign of epochs counts cells (the same curve on any number of ranks, across resumes
    on another number); a `--steps` run counts steps."""
    if done <= warmup:
        return max(done, 1e-9) / max(warmup, 1e-9)
    if total <= warmup:
        return 1.0
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (done - warmup) / (total - warmup))))


@dataclass
class Schedule:
    """Where the learning-rate schedule stands: cells trained in the campaign so far (every rank's,
    every epoch's) and the warm-up in cells, fixed when the campaign starts (`--warmup-steps` of
    that run's global batch, or of a token budget's estimated cells a step), so a resume on another
    number of ranks follows the same curve."""

    cells_done: int = 0
    warmup_cells: int = 0

    @classmethod
    def of(cls, saved, cfg: TrainConfig, world: int, summaries: dict) -> "Schedule":
        if saved is not None and "schedule" in saved.state:
            return cls(**json.loads(saved.state["schedule"]))
        fresh = cls(0, cfg.warmup_cells or cfg.warmup_steps * cfg.batch_size * cfg.grad_accum * world)
        if saved is not None:  # a checkpoint from before the schedule was kept: the cells its epochs held
            fresh.cells_done = sum(
                sum(summaries[e].cells_per_rank) for e in range(saved.epoch) if e in summaries
            ) + sum(r.trained + r.carried for r in saved.ranks)
        return fresh
