"""The campaign's command-line flags, described once: `cellfeed local`'s (`app/cli.py`) and `modal run
app/modal_app.py`'s (its entrypoint's signature) are both built from these, with `CampaignConfig`'s
types and defaults, so neither can drift from the config."""

from __future__ import annotations

import inspect
import typing
from dataclasses import MISSING, fields

from app.config import PRESETS, CampaignConfig
from coordination.plan import STRATEGIES
from producers.tokenizers import LAYOUTS, layout
from trainer.presets import MODEL_PRESETS

# the trainable tokenizers' own genes per cell, as help text says them ("scgpt 1024", ...)
DEFAULT_LENGTHS = tuple(f"{name} {spec.default_genes}" for name, spec in LAYOUTS.items() if spec.objective)

# Every campaign flag, described once: `cellfeed local --help` and `modal run app/modal_app.py --help`
# both show these (field name -> help; the defaults come from CampaignConfig or the local run).
FLAG_HELP = {
    "dataset": "the dataset: a local path or s3://bucket/prefix (S3 settings from AWS_* variables)",
    "corpus": "instead of --dataset: a corpus file (TOML) of several datasets with weights, each with its own "
    'filters, trained over one gene vocabulary (README, "Pretraining on a corpus")',
    "vocabulary": "a gene vocabulary file: scGPT's vocab.json, Geneformer's token dictionary (.pkl, read without "
    "running code) or JSON (default: built from the dataset(s), written to the run folder)",
    "gene_column": "the var column whose values name genes in the vocabulary, e.g. feature_name for symbols",
    "gene_medians": "geneformer over a corpus: Geneformer's gene median dictionary (.pkl or JSON, id -> median)",
    "run": "run name: names the queue, the map and the checkpoints; --resume continues it (default: a timestamp)",
    "subset_filter": "training cells as an obs filter in Lance SQL, e.g. \"plate != 'plate14'\" (default: all cells)",
    "eval_filter": "held-out cells as an obs filter, e.g. \"plate = 'plate14'\": never trained on, evaluated "
    "every --eval-every steps (default: no evaluation)",
    "eval_cells": "how many held-out cells to evaluate on (the first that match --eval-filter)",
    "eval_every": "evaluate on the held-out cells every N steps",
    "tokenizer": "scgpt (genes in rank order + expression bins), geneformer-v1 (no special tokens) or "
    "geneformer-v2 (CLS, genes, EOS; alias geneformer); geneformer needs `cellfeed stats`",
    "max_genes": f"genes per cell (default: the tokenizer's own: {', '.join(DEFAULT_LENGTHS)})",
    "n_bins": "scgpt expression bins per cell",
    "strategy": "sampling: sequential, mixture (of scanners), block (shuffled blocks of cells) or random",
    "block_size": "block sampling: consecutive cells per block",
    "fetch_factor": "block sampling: batches' worth of blocks per work unit",
    "n_scanners": "mixture sampling: fragments read together in one work unit",
    "unit_cells": "sequential/mixture sampling: consecutive cells per scanner chunk",
    "balance_by": "balanced sampling: an obs column whose values are classes (cell type, tissue, donor, assay); "
    "every epoch gives each class an exact quota, each class's cells drawn without replacement across epochs "
    "(with a corpus: within each source) (default: the data as it is)",
    "balance_power": "with --balance-by: ALPHA, from 0 (classes as the data has them) to 1 (every class equal): "
    "a class's share is proportional to its cells**(1 - ALPHA); 0.5, the square root, is the usual compromise",
    "producers": "producer processes (CPU); scale them until the trainer never waits",
    "gpus": "trainer ranks per node (GPUs of one train container; the DDP world is --nodes x --gpus)",
    "nodes": "trainer nodes: --nodes x --gpus ranks in one DDP world (on Modal a clustered train of --nodes "
    "containers of 8 GPUs; locally, groups of CPU ranks rendezvousing as nodes do)",
    "batch_size": "cells per rank per step",
    "tokens_per_row": "pack each batch's cells end to end into rows of this many tokens (at least the longest "
    "cell's), attention kept within each cell, so short cells' padding is not computed (a row's tail still is); "
    "the cells of a step are the same (default: a row per cell, padded to the longest)",
    "tokens_per_batch": "a batch by tokens, not cells (with --tokens-per-row): the cells drawn from the mixing "
    "buffer while their tokens fit N (at most --batch-size cells), so a step of short cells takes more of them; "
    "the cells per step vary, the schedule, the audit and exactly-once count cells, and step counts shown are "
    "estimates (default: --batch-size cells a batch)",
    "grad_accum": "batches accumulated per optimizer step",
    "steps": "optimizer steps; alone, as many epochs as they need (default: --epochs through)",
    "epochs": "epochs (default: 1, or as many as --steps needs)",
    "preset": "model preset: " + ", ".join(f"{name} ({p.note})" for name, p in MODEL_PRESETS.items()),
    "lr": "peak learning rate (AdamW, linear warm-up, cosine decay)",
    "warmup_steps": "learning-rate warm-up steps",
    "compile": "torch.compile the model",
    "checkpoint_every": "checkpoint every N steps (and at the end)",
    "keep_checkpoints": "checkpoints kept: the last N, and the best by held-out loss",
    "resume": "continue --run from its latest checkpoint, saying which step (locally: a run with none is an error)",
    "seed": "seed of plans, shuffles, masks and weights: the same seed gives the same run",
    "lease_s": "seconds a producer may fall silent before the units it holds are issued to another (it says what "
    "it holds 4 times a lease): shorter finds a dead or stalled producer sooner, at more calls",
    "trace_units": "each producer prints a line as it takes a unit (`producer-1: took unit 7 of epoch 0`): who "
    "holds what, to follow a campaign or pin a fault to a unit (benchmarks/chaos.py does)",
    "rpc_latency_ms": "make every queue/map call cost this many ms (± 40%), as a round trip to Modal does: "
    "run locally under the remote world's costs",
    "modal_retry_s": "Modal: how long each call to Modal retries a failing network (with backoff) before the run "
    "stops, its state kept for --resume; the default rides out a 10-minute outage",
    "audit_cells": "Modal: write the cell ids each step trained, per rank (JSON lines), to the checkpoints Volume "
    "under RUN/cells/, one file set per train call: an audit of exactly-once, cell by cell",
    "attempt_hours": "Modal: after this many hours a train call checkpoints and continues in a new call "
    "(Modal ends any call at 24 h)",
}

# The flags of `cellfeed local` and of `modal run app/modal_app.py`, in the order --help lists them.
CAMPAIGN_FLAGS = (
    "dataset",
    "corpus",
    "vocabulary",
    "gene_column",
    "gene_medians",
    "run",
    "tokenizer",
    "max_genes",
    "n_bins",
    "strategy",
    "block_size",
    "fetch_factor",
    "n_scanners",
    "unit_cells",
    "balance_by",
    "balance_power",
    "subset_filter",
    "eval_filter",
    "eval_cells",
    "eval_every",
    "producers",
    "gpus",
    "nodes",
    "batch_size",
    "tokens_per_row",
    "tokens_per_batch",
    "grad_accum",
    "steps",
    "epochs",
    "preset",
    "lr",
    "warmup_steps",
    "compile",
    "checkpoint_every",
    "keep_checkpoints",
    "resume",
    "seed",
    "lease_s",
    "rpc_latency_ms",
    "trace_units",
)
MODAL_FLAGS = CAMPAIGN_FLAGS + ("attempt_hours", "modal_retry_s", "audit_cells")


def flag_choices() -> dict[str, tuple]:
    """The flags whose values come from a fixed list."""
    from producers.tokenizers import TOKENIZER_NAMES

    trainable = tuple(n for n in TOKENIZER_NAMES if layout(n).objective)
    return {"tokenizer": trainable, "strategy": tuple(STRATEGIES), "preset": PRESETS}


def flag_defaults(overrides: dict | None = None) -> dict:
    return {f.name: f.default for f in fields(CampaignConfig) if f.default is not MISSING} | (overrides or {})


def flags_signature(names=MODAL_FLAGS, defaults: dict | None = None) -> inspect.Signature:
    """A signature with one keyword parameter per flag — its type and default from
    `CampaignConfig`, choices as a `Literal` — for a command line built from a function's
    signature (`modal run` builds its options so): the entrypoint cannot drift from the config."""
    hints = typing.get_type_hints(CampaignConfig)
    choices, defaults = flag_choices(), flag_defaults(defaults)
    params = []
    for name in names:
        kind = typing.Literal[choices[name]] if name in choices else hints[name]
        default = defaults.get(name, inspect.Parameter.empty)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind))
    return inspect.Signature(params)
