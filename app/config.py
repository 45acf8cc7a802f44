"""One campaign config for Modal and local runs, validated up front, and the pieces derived from
it: the producers' config and the trainer's config."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from coordination.errors import CellfeedError
from coordination.plan import STRATEGIES, Sampling
from producers.tokenizers import TOKENIZERS

PRESETS = ("tiny", "scgpt", "base", "large")


@dataclass
class CampaignConfig:
    dataset: str  # local path or s3://bucket/prefix (S3 settings from the environment / a Modal Secret)
    run: str = ""  # names the queue/map (cellfeed-<run>) and checkpoints; default: a timestamp
    subset_filter: str | None = None  # the training split as an obs filter, e.g. "plate != 'plate14'"
    eval_filter: str | None = None  # a held-out split to evaluate on, e.g. "plate = 'plate14'"
    eval_cells: int = 512  # how many held-out cells (the first that match)
    eval_every: int = 100
    tokenizer: str = "scgpt"
    max_genes: int = 1024
    n_bins: int = 51
    strategy: str = "block"
    block_size: int = 64
    fetch_factor: int = 64
    n_scanners: int = 8
    unit_cells: int = 1024
    producers: int = 16
    gpus: int = 8  # trainer world size
    batch_size: int = 240
    grad_accum: int = 1
    steps: int | None = None  # None: train the epochs through
    epochs: int = 1
    preset: str = "scgpt"
    lr: float = 3e-4
    warmup_steps: int = 100
    compile: bool = False
    checkpoint_dir: str = "checkpoints"
    checkpoint_every: int = 500
    resume: bool = False
    seed: int = 0
    cells_per_item: int = 128
    label_column: str | None = None

    def __post_init__(self):
        if not self.run:
            self.run = time.strftime("run-%Y%m%d-%H%M%S")

    def validate(self) -> "CampaignConfig":
        if not self.dataset:
            raise CellfeedError("give a dataset: a local path or s3://bucket/prefix")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,40}", self.run):
            raise CellfeedError(f"run name {self.run!r}: use 1-41 letters, digits, '.', '_' or '-'")
        if self.tokenizer not in TOKENIZERS:
            raise CellfeedError(f"unknown tokenizer {self.tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
        if self.tokenizer == "raw":
            raise CellfeedError("the trainer learns from scgpt (bins) or geneformer (gene ids) tokens, not raw values")
        if self.strategy not in STRATEGIES:
            raise CellfeedError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if self.preset not in PRESETS:
            raise CellfeedError(f"unknown model preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        for name in ("max_genes", "producers", "gpus", "batch_size", "grad_accum", "epochs", "checkpoint_every",
                     "block_size", "fetch_factor", "n_scanners", "unit_cells", "cells_per_item", "eval_every"):
            if int(getattr(self, name)) < 1:
                raise CellfeedError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise CellfeedError(f"--steps must be >= 1, got {self.steps}")
        if not 3 <= self.n_bins <= 255:
            raise CellfeedError(f"--n-bins must be within 3..255, got {self.n_bins}")
        self.sampling.validate()
        return self

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.strategy, unit_cells=self.unit_cells, n_scanners=self.n_scanners,
                        block_size=self.block_size, fetch_factor=self.fetch_factor, batch_size=self.batch_size)

    def producer_config(self, idle_timeout_s: float = 3600.0):
        from producers.producer import ProducerConfig

        params = {"n_bins": self.n_bins} if self.tokenizer == "scgpt" else {}
        return ProducerConfig(dataset=self.dataset, run=self.run, seed=self.seed, sampling=self.sampling,
                              tokenizer=self.tokenizer, max_genes=self.max_genes, tokenizer_params=params,
                              world_size=self.gpus, cells_per_item=self.cells_per_item,
                              label_column=self.label_column, subset_filter=self.subset_filter,
                              idle_timeout_s=idle_timeout_s)

    def train_config(self, backend: dict, facts: dict, **changes):
        """The trainer's config; `facts` come from the setup step (`app.campaign.prepare`)."""
        from trainer.train import TrainConfig

        base = dict(run=self.run, backend=backend, vocab_size=facts["vocab_size"], preset=self.preset,
                    objective="bins" if self.tokenizer == "scgpt" else "genes", n_bins=self.n_bins,
                    batch_size=self.batch_size, grad_accum=self.grad_accum, lr=self.lr, warmup_steps=self.warmup_steps,
                    max_steps=self.steps, epochs=self.epochs, seed=self.seed, compile=self.compile,
                    pad_to=self.max_genes + (2 if self.tokenizer == "geneformer" else 1),
                    checkpoint_dir=f"{self.checkpoint_dir.rstrip('/')}/{self.run}", checkpoint_every=self.checkpoint_every,
                    resume=self.resume, eval_every=self.eval_every if facts["held_out_cells"] else None,
                    eval_cells=facts["held_out_cells"])
        return TrainConfig(**{**base, **changes})
