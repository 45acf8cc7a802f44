"""One campaign config for Modal and local runs, validated up front, and the pieces derived from
it: the producers' config and the trainer's config. Its command-line flags: `app/flags.py`; the
record a run keeps of it, and what a resume may change: `app/resume.py`."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, fields

from coordination.balance import DEFAULT_POWER, Balance
from coordination.driver import LEASE_S, heartbeat_interval
from coordination.errors import CellfeedError
from coordination.modal_backend import RETRY_S as MODAL_RETRY_S
from coordination.plan import Sampling
from producers.tokenizers import LAYOUTS, layout
from trainer.presets import MODEL_PRESETS

PRESETS = tuple(MODEL_PRESETS)
MAX_ATTEMPT_HOURS = 23.0  # an hour short of Modal's 24 h limit on a call: time to checkpoint and hand over


@dataclass
class CampaignConfig:
    dataset: str = ""  # local path or s3://bucket/prefix (S3 settings from the environment / a Modal Secret)
    corpus: str | None = None  # instead of dataset: a corpus file (TOML, `coordination.corpus_file.CorpusSpec`)
    vocabulary: str | None = None  # a gene vocabulary file; None: built from the sources
    gene_column: str = "gene_id"
    gene_medians: str | None = None
    run: str = ""  # names the queue/map (cellfeed-<run>) and checkpoints; default: a timestamp
    subset_filter: str | None = None  # the training split as an obs filter, e.g. "plate != 'plate14'"
    eval_filter: str | None = None  # a held-out split to evaluate on (never trained on), e.g. "plate = 'plate14'"
    eval_cells: int = 512  # how many held-out cells (the first that match)
    eval_every: int = 100
    tokenizer: str = "scgpt"
    max_genes: int | None = None  # None: the tokenizer's own length (producers.tokenizers.LAYOUTS)
    n_bins: int = 51
    strategy: str = "block"
    block_size: int = 64
    fetch_factor: int = 64
    n_scanners: int = 8
    unit_cells: int = 1024
    balance_by: str | None = None  # an obs column: each class an exact quota per epoch (`coordination.balance`)
    balance_power: float = DEFAULT_POWER
    producers: int = 16
    gpus: int = 8  # trainer ranks per node
    nodes: int = 1  # trainer nodes: the DDP world is nodes x gpus ranks (`world_size`)
    batch_size: int = 240
    tokens_per_row: int | None = None  # pack each batch's cells into rows of this many tokens (None: a row per cell)
    tokens_per_batch: int | None = None  # a batch: the drawn cells that fit this many tokens (None: batch_size cells)
    grad_accum: int = 1
    steps: int | None = None  # None: train the epochs through
    epochs: int | None = None  # None: 1, or as many as `steps` needs
    preset: str = "scgpt"
    lr: float = 3e-4
    warmup_steps: int = 100
    compile: bool = False
    checkpoint_dir: str = "checkpoints"
    checkpoint_every: int = 500
    keep_checkpoints: int = 2  # the last k, and the best by held-out loss
    resume: bool = False
    seed: int = 0
    lease_s: float = LEASE_S  # a unit whose producer is silent this long is issued again
    rpc_latency_ms: float = 0.0  # every queue/map call costs this long (± 40%) more, as Modal's round trips
    attempt_hours: float = 22.0  # Modal: a train call hands over to a new one after this long (calls end at 24 h)
    modal_retry_s: float = MODAL_RETRY_S  # Modal: how long a call retries transient network errors
    audit_cells: bool = False  # Modal: each step's cell ids to the Volume (locally: `cellfeed local --audit-cells`)
    trace_units: bool = False  # each producer prints a line as it takes a unit (which producer holds what)
    # Modal: the corpus, vocabulary and median files, carried from the laptop (setting -> [file name,
    # base64 bytes]) into containers, which cannot read the laptop's disk (`carry_files`, `unpack_files`)
    carried: dict | None = None
    mixtures: str | None = None  # the run's corpus changes at resumes (`app.campaign.record_mixtures`), set locally

    def __post_init__(self):
        if not self.run:
            self.run = time.strftime("run-%Y%m%d-%H%M%S")

    def validate(self) -> "CampaignConfig":
        if bool(self.dataset) == bool(self.corpus):
            raise CellfeedError("give a dataset (a local path or s3://bucket/prefix) or a --corpus file, one of them")
        if self.corpus and (self.subset_filter or self.eval_filter):
            raise CellfeedError("with --corpus, give each source's subset_filter / eval_filter in the corpus file")
        if self.corpus and self.gene_column != type(self).gene_column:  # (the producers read the file's)
            raise CellfeedError(f"--gene-column {self.gene_column}: with --corpus, set gene_column in the corpus file")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,40}", self.run):
            raise CellfeedError(f"run name {self.run!r}: use 1-41 letters, digits, '.', '_' or '-'")
        if layout(self.tokenizer).objective is None:
            trainable = ", ".join(n for n, spec in LAYOUTS.items() if spec.objective)
            raise CellfeedError(
                f"--tokenizer {self.tokenizer}: the trainer learns from {trainable} tokens; raw values "
                "are for feeding other models (producers.producer.produce)"
            )
        if self.preset not in PRESETS:
            raise CellfeedError(f"unknown model preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        for name in (
            "producers",
            "gpus",
            "nodes",
            "batch_size",
            "grad_accum",
            "checkpoint_every",
            "block_size",
            "fetch_factor",
            "keep_checkpoints",
            "n_scanners",
            "unit_cells",
            "eval_every",
            "eval_cells",
        ):
            if int(getattr(self, name)) < 1:
                raise CellfeedError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_genes", "steps", "epochs", "tokens_per_batch"):  # optional
            if getattr(self, name) is not None and int(getattr(self, name)) < 1:
                raise CellfeedError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        longest = layout(self.tokenizer).sequence_length(self.genes_per_cell)
        if self.tokens_per_row is not None and int(self.tokens_per_row) < longest:
            raise CellfeedError(
                f"--tokens-per-row {self.tokens_per_row}: a row must hold the longest cell, {longest} tokens "
                f"({self.tokenizer} with {self.genes_per_cell} genes); give at least {longest}, e.g. {2 * longest}"
            )
        if self.tokens_per_batch is not None and self.tokens_per_row is None:
            raise CellfeedError(
                f"--tokens-per-batch {self.tokens_per_batch} needs --tokens-per-row: padded, each cell is a row "
                f"of the longest cell's {longest} tokens, so a budget's steps of short cells would compute more, "
                f"not the same; add --tokens-per-row (e.g. {2 * longest})"
            )
        if self.tokens_per_batch is not None and int(self.tokens_per_batch) < longest:
            raise CellfeedError(
                f"--tokens-per-batch {self.tokens_per_batch}: a batch must hold the longest cell, {longest} tokens "
                f"({self.tokenizer} with {self.genes_per_cell} genes); give at least {longest}"
            )
        if not 1 <= self.lease_s <= 3600:
            raise CellfeedError(f"--lease-s must be within 1..3600 seconds, got {self.lease_s}")
        if not 0 <= self.rpc_latency_ms <= 10_000:
            raise CellfeedError(f"--rpc-latency-ms must be within 0..10000, got {self.rpc_latency_ms}")
        if not 0 < self.attempt_hours <= MAX_ATTEMPT_HOURS:
            raise CellfeedError(
                f"--attempt-hours must be within 0..{MAX_ATTEMPT_HOURS:g} (Modal ends a call at 24 h), "
                f"got {self.attempt_hours}"
            )
        if not 1 <= self.modal_retry_s <= 7 * 24 * 3600:
            raise CellfeedError(f"--modal-retry-s must be within 1..604800 seconds, got {self.modal_retry_s}")
        if not 3 <= self.n_bins <= 255:
            raise CellfeedError(f"--n-bins must be within 3..255, got {self.n_bins}")
        if not (math.isfinite(self.lr) and 0 < self.lr <= 1):
            raise CellfeedError(
                f"--lr {self.lr}: the peak learning rate must be a finite number in (0, 1] "
                f"(e.g. 3e-4 for the GPU presets, 3e-3 for tiny)"
            )
        if int(self.warmup_steps) < 0:
            raise CellfeedError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        self.sampling.validate()
        if self.balance is not None:
            self.balance.validate()
        return self

    @property
    def balance(self) -> Balance | None:
        return None if self.balance_by is None else Balance(self.balance_by, float(self.balance_power))

    @classmethod
    def from_flags(cls, flags: dict) -> "CampaignConfig":
        """The config of a command line's flags, validated: a flag left out (None) takes the
        config's default."""
        unknown = sorted(set(flags) - {f.name for f in fields(cls)})
        if unknown:
            raise CellfeedError(f"unknown campaign settings: {', '.join(unknown)}")
        return cls(**{name: value for name, value in flags.items() if value is not None}).validate()

    def carry_files(self) -> "CampaignConfig":
        """(the laptop) This config with its local files' bytes inside: the corpus file (its
        datasets as resolved: on Modal they must be s3:// or in the image), the vocabulary (the
        command line's, else the corpus file's) and the median dictionary."""
        import base64
        from dataclasses import replace
        from pathlib import Path

        from coordination.corpus_file import CorpusSpec

        carried, vocabulary = {}, self.vocabulary
        if self.corpus:
            spec = CorpusSpec.read(self.corpus)
            vocabulary = vocabulary or spec.vocabulary
            carried["corpus"] = ["corpus.toml", base64.b64encode(spec.to_toml(vocabulary=False).encode()).decode()]
        for name, path in (("vocabulary", vocabulary), ("gene_medians", self.gene_medians)):
            if path:
                try:
                    data = Path(path).read_bytes()
                except OSError as exc:
                    raise CellfeedError(f"--{name.replace('_', '-')} {path}: {exc.strerror}") from None
                carried[name] = [Path(path).name, base64.b64encode(data).decode()]
        return replace(self, carried=carried or None)

    def unpack_files(self, folder) -> "CampaignConfig":
        """(a container) The carried files written under `folder`, the settings pointing at them."""
        import base64
        from pathlib import Path

        for name, (file_name, data) in (self.carried or {}).items():
            path = Path(folder) / name / file_name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(base64.b64decode(data))
            setattr(self, name, str(path))
        return self

    def backend_spec(self, kind: str, **where):
        """How processes reach this run's queue and map (`coordination.backends.connect`)."""
        from coordination.backends import BackendSpec

        return BackendSpec(kind=kind, run=self.run, latency_ms=self.rpc_latency_ms, retry_s=self.modal_retry_s, **where)

    @property
    def world_size(self) -> int:
        """The DDP world: every node's ranks."""
        return self.nodes * self.gpus

    @property
    def run_checkpoint_dir(self) -> str:
        """Where this run's checkpoints go (and `--resume` looks)."""
        return f"{self.checkpoint_dir.rstrip('/')}/{self.run}"

    @property
    def genes_per_cell(self) -> int:
        return self.max_genes or layout(self.tokenizer).default_genes

    @property
    def sampling(self) -> Sampling:
        return Sampling(
            self.strategy,
            unit_cells=self.unit_cells,
            n_scanners=self.n_scanners,
            block_size=self.block_size,
            fetch_factor=self.fetch_factor,
            batch_size=self.batch_size,
        )

    def producer_config(self, idle_timeout_s: float = 3600.0):
        from producers.config import ProducerConfig

        params = {"n_bins": self.n_bins} if self.tokenizer == "scgpt" else {}
        return ProducerConfig(
            dataset=self.dataset,
            corpus=self.corpus,
            mixtures=self.mixtures,
            vocabulary=self.vocabulary,
            gene_column=self.gene_column,
            gene_medians=self.gene_medians,
            run=self.run,
            seed=self.seed,
            sampling=self.sampling,
            tokenizer=self.tokenizer,
            max_genes=self.genes_per_cell,
            tokenizer_params=params,
            world_size=self.world_size,
            balance=self.balance,
            subset_filter=self.subset_filter,
            exclude_filter=self.eval_filter,
            idle_timeout_s=idle_timeout_s,
            heartbeat_s=heartbeat_interval(self.lease_s),
            trace_units=self.trace_units,
        )

    def train_config(self, backend, facts, **changes):
        """The trainer's config; `facts` (`coordination.summary.SetupFacts`) come from the setup step."""
        from trainer.config import TrainConfig

        spec = layout(self.tokenizer)
        base = dict(
            run=self.run,
            backend=backend,
            vocab_size=facts.vocab_size,
            pad_token=facts.pad_token,
            mask_token=facts.mask_token,
            special_tokens=facts.special_tokens,
            vocab_fingerprint=facts.vocab_fingerprint,
            data_id=facts.data_id,
            preset=self.preset,
            objective=spec.objective,
            n_bins=self.n_bins,
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            max_steps=self.steps,
            epochs=facts.epochs,
            seed=self.seed,
            compile=self.compile,
            pad_to=spec.sequence_length(self.genes_per_cell),
            tokens_per_row=self.tokens_per_row,
            tokens_per_batch=self.tokens_per_batch,
            # a token budget's warm-up: --warmup-steps of its estimated cells a step, not of --batch-size
            warmup_cells=self.warmup_steps * facts.step_cells * self.grad_accum * self.world_size
            if self.tokens_per_batch is not None and facts.step_cells
            else None,
            checkpoint_dir=self.run_checkpoint_dir,
            checkpoint_every=self.checkpoint_every,
            keep_checkpoints=self.keep_checkpoints,
            lease_s=self.lease_s,
            resume=self.resume,
            eval_every=self.eval_every if facts.held_out_cells else None,
            eval_cells=facts.held_out_cells,
        )
        return TrainConfig(**{**base, **changes})
