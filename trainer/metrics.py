"""Per-step metrics, global over ranks: loss, step time (the slowest rank's), dataloader wait
(the slowest rank's, and each rank's), cells/s and tokens/s, MFU, peak memory. A progress bar,
JSON lines and TensorBoard scalars on rank 0; a summary at the end (medians exclude warm-up steps).

MFU = training FLOPs of the step (see `model.train_flops`: 6·N·tokens + attention, real tokens
only) / (step time x devices x the device's peak dense bf16 FLOP/s). Peaks used: H100 and H200
SXM 989.4 TFLOP/s, A100 312 TFLOP/s (NVIDIA's dense, no-sparsity figures). None on CPU.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm

PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
WARMUP_STEPS = 5


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class StepMetrics:
    step: int
    epoch: int
    loss: float
    accuracy: float
    lr: float
    grad_norm: float
    seconds: float  # this rank's step, waiting included
    wait_s: float  # time this rank waited for its batch
    cells: int
    tokens: int  # real tokens (no padding)
    flops: float
    device: torch.device
    ready_cells: int = 0  # decoded cells waiting in this rank's consumer after the step (its prefetch)
    slots: int = 0  # the batches' positions, padding included (tokens / slots: the work that was real)


class Tracker:
    def __init__(
        self,
        rank: int,
        log_path: str | None,
        total_steps: int | None,
        peak: float | None,
        bar: bool = True,
        first_step: int = 0,
        tb_dir: str | None = None,
        wandb_project: str | None = None,
        run: str = "",
    ):
        self.rank, self.peak = rank, peak
        self.rows: list[dict] = []
        self.evals: list[dict] = []
        self.log = open(log_path, "a") if (log_path and rank == 0) else None
        self.tb = None
        if tb_dir and rank == 0:  # (imported here: TensorBoard's writer costs half a second to import)
            from coordination.scalars import ScalarWriter

            self.tb = ScalarWriter(tb_dir, filename_suffix=".trainer")
        self.wandb = None
        if wandb_project and rank == 0:  # (checked installed, with a key or offline, before the run started)
            import wandb

            folder = os.path.dirname(os.path.abspath(tb_dir or log_path or "."))
            import hashlib

            run_id = hashlib.sha1(folder.encode()).hexdigest()[:16]  # (the run folder's: a --resume continues it)
            self.wandb = wandb.init(project=wandb_project, name=run or None, id=run_id, dir=folder, resume="allow")
        self.bar = tqdm(total=total_steps, initial=first_step, desc="train", unit="step", disable=rank != 0 or not bar)

    def record(self, m: StepMetrics) -> dict:
        world = dist.get_world_size()
        # on the step's device: NCCL reduces CUDA tensors only. Each rank's wait in its own slot: the sum is all of them
        summed = torch.zeros(5 + world, dtype=torch.float64, device=m.device)
        summed[:5] = torch.tensor([m.cells, m.tokens, m.flops, m.ready_cells, m.slots], dtype=torch.float64)
        summed[5 + self.rank] = m.wait_s
        maxed = torch.tensor([m.seconds, m.wait_s], dtype=torch.float64, device=m.device)
        dist.all_reduce(summed)
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
        seconds = float(maxed[0])
        row = {
            "step": m.step,
            "epoch": m.epoch,
            "loss": round(m.loss, 5),
            "accuracy": round(m.accuracy, 4),
            "lr": m.lr,
            "grad_norm": round(m.grad_norm, 4),
            "step_s": round(seconds, 5),
            "wait_ms": round(float(maxed[1]) * 1000, 3),
            "cells": int(summed[0]),
            "cells_per_s": round(float(summed[0]) / seconds, 1),
            "tokens_per_s": round(float(summed[1]) / seconds, 1),
            "padding": round(1.0 - float(summed[1]) / float(summed[4]), 4) if float(summed[4]) else 0.0,
            "mfu": round(float(summed[2]) / (seconds * world * self.peak), 4) if self.peak else None,
            "peak_mem_mb": round(peak_memory_mb(m.device), 1),
            "ready_cells": int(summed[3]),
            "wait_ms_ranks": [round(float(w) * 1000, 3) for w in summed[5:]],
        }
        self.rows.append(row)
        if self.log:
            self.log.write(json.dumps(row) + "\n")
            self.log.flush()
        keys = (
            "loss",
            "accuracy",
            "lr",
            "grad_norm",
            "step_s",
            "wait_ms",
            "cells_per_s",
            "tokens_per_s",
            "padding",
            "ready_cells",
        )
        scalars = {f"train/{k}": row[k] for k in keys + (("mfu",) if row["mfu"] is not None else ())}
        scalars.update({f"data_wait_ms/rank{r}": wait for r, wait in enumerate(row["wait_ms_ranks"])})
        self._scalars(scalars, m.step)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{m.loss:.3f}", cells_s=f"{row['cells_per_s']:,.0f}", wait_ms=row["wait_ms"])
        return row

    def note(self, step: int, values: dict) -> None:
        """Record evaluation figures taken after `step` steps, and log them."""
        self.evals.append({"step": step, **values})
        if self.log:
            self.log.write(json.dumps({"step": step, **values}) + "\n")
            self.log.flush()
        self._scalars({f"eval/{k}": v for k, v in values.items()}, step)
        if self.rank == 0:
            self.bar.write(f"step {step}: " + ", ".join(f"{k} {v}" for k, v in values.items()))

    def audited(self, step: int, audit: dict) -> None:
        """An epoch's exactly-once audit (`trainer.exactly_once.audit_epoch`), in the step log and TensorBoard."""
        if self.log:
            self.log.write(json.dumps({"step": step, "audit": audit}) + "\n")
            self.log.flush()
        if self.tb:  # (by epoch: W&B's steps only go forward, so its audits are in the run's summary)
            for k in ("cells", "missing", "duplicated"):  # (an epoch that could not be audited has cells only)
                if k in audit:
                    self.tb.add_scalar(f"audit/{k}", audit[k], audit["epoch"])
        if self.wandb:
            self.wandb.summary[f"audit/epoch{audit['epoch']}"] = audit.get("line", "")

    def _scalars(self, values: dict, step: int) -> None:
        """One step's scalars to TensorBoard and W&B (rank 0). W&B ignores a step below its last
        (a resumed run's steps trained again): TensorBoard keeps them."""
        if self.tb:
            for tag, value in values.items():
                self.tb.add_scalar(tag, value, step)
        if self.wandb:
            self.wandb.log(values, step=step)

    def finish(self) -> dict:
        self.bar.close()
        if self.log:
            self.log.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
        rows = self.rows[WARMUP_STEPS:] if len(self.rows) > 2 * WARMUP_STEPS else self.rows
        if not rows:
            return {"steps": 0}

        def med(k):
            values = [r[k] for r in rows if r[k] is not None]
            return statistics.median(values) if values else None

        total_s = sum(r["step_s"] for r in rows)
        out = {
            "steps": len(self.rows),
            "first_loss": self.rows[0]["loss"],
            "final_loss": self.rows[-1]["loss"],
            "median_step_s": med("step_s"),
            "median_wait_ms": med("wait_ms"),
            "cells_per_s": sum(r["cells"] for r in rows) / total_s,
            "median_mfu": med("mfu"),
            "tokens_per_s": med("tokens_per_s"),
            "padding": med("padding"),  # the fraction of positions computed that were padding
            "peak_mem_mb": max(r["peak_mem_mb"] for r in self.rows),
            "eval": self.evals,
        }
        if self.rank == 0:
            print(
                f"\n{'steps':>6} {'median step':>12} {'cells/s':>9} {'tokens/s':>10} {'wait ms':>8} "
                f"{'MFU':>6} {'loss':>14} {'peak MB':>8}"
            )
            mfu = f"{out['median_mfu']:.1%}" if out["median_mfu"] is not None else "n/a"
            print(
                f"{out['steps']:>6} {out['median_step_s'] * 1000:>10.1f}ms {out['cells_per_s']:>9,.0f} "
                f"{out['tokens_per_s']:>10,.0f} {out['median_wait_ms']:>8.1f} {mfu:>6} "
                f"{out['first_loss']:>6.3f}->{out['final_loss']:<6.3f} {out['peak_mem_mb']:>8,.0f}"
            )
        return out


@dataclass
class StepTotals:
    """One optimizer step's batches, summed: their time (waits included) and what they held."""

    started: float
    totals: torch.Tensor  # all-reduced: masked, loss sum, correct, stop asked, cells, epoch cut, ranks with cells left
    waited: float = 0.0
    cells: int = 0
    masked: torch.Tensor | int = 0  # this rank's hidden positions (on the device: read after the step)
    slots: int = 0
    lengths: list = field(default_factory=list)

    def add(self, batch, counts: tuple[torch.Tensor, torch.Tensor]) -> None:
        reduced, n_masked = counts
        self.totals += reduced
        self.waited, self.cells, self.masked = (
            self.waited + batch.wait_s,
            self.cells + batch.size,
            self.masked + n_masked,
        )
        self.slots += batch.tokens.numel()
        # the collate's host-side lengths: reading the mask back from the GPU is one more wait for the step
        self.lengths.append(batch.lengths if batch.lengths is not None else batch.attention_mask.sum(dim=1).cpu())

    def flags(self) -> tuple[float, float, float, float]:
        """(stop asked, cells, epoch cut, ranks with cells left after the step), every rank's, summed
        over the step's batches: read back at once."""
        asked, cells, cut, ranks_left = self.totals[3:].tolist()
        return asked, cells, cut, ranks_left

    def metrics(self, step: int, epoch: int, lr: float, grad_norm, model_config, device, ready_cells) -> "StepMetrics":
        """The step's metrics as the tracker records them (flops of real tokens: `train_flops`)."""
        from trainer.model import train_flops

        lengths, totals = torch.cat(self.lengths), self.totals
        return StepMetrics(
            step=step,
            epoch=epoch,
            loss=float(totals[1] / totals[0].clamp(min=1)),
            accuracy=float(totals[2] / totals[0].clamp(min=1)),
            lr=lr,
            grad_norm=float(grad_norm),
            seconds=time.perf_counter() - self.started,
            wait_s=self.waited,
            cells=self.cells,
            tokens=int(lengths.sum()),
            flops=train_flops(model_config, lengths, int(self.masked)),
            device=device,
            ready_cells=ready_cells,
            slots=self.slots,
        )
