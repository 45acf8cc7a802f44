"""A run remembers its campaign (`CAMPAIGN_RECORD`), and a resume continues it: the settings a resume
runs with (`resumed_flags`: the record, and the changes a resume may make) and the command line that
resumes a campaign (`resume_command`)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from app.config import CampaignConfig
from app.flags import MODAL_FLAGS, flag_defaults
from coordination.errors import CellfeedError
from producers.tokenizers import layout

# A run remembers its campaign: the config it ran with is kept as RUN/campaign.json (the run folder;
# on Modal the run's folder on the checkpoints Volume), and `--resume` with no other flag continues
# exactly that campaign. These flags may be given at a resume to change it, each change said in one
# line: the world and the producers (an interrupted epoch is re-planned over the new ranks, exactly
# once), more epochs (or steps), the dataset's location (its content must be the same: the
# checkpoint's data identity is checked), the corpus's mixture (from the epoch after the
# checkpoint), how often things are done, how a batch is laid out (`--tokens-per-row`), whether the
# model is compiled (`--compile`), and the remote world's settings. Every other flag defines
# the campaign (its data, tokens, sampling, seed, model and schedule): a resume that changes one is
# refused.
CAMPAIGN_RECORD = "campaign.json"
RESUME_CHANGES = frozenset(
    {
        "producers",
        "gpus",
        "nodes",
        "epochs",
        "steps",
        "dataset",
        "corpus",
        "checkpoint_every",
        "keep_checkpoints",
        "eval_every",
        "lease_s",
        "rpc_latency_ms",
        "modal_retry_s",
        "attempt_hours",
        "audit_cells",
        "trace_units",
        "tokens_per_row",  # (how a batch's cells are laid out: the same cells, the same schedule)
        "tokens_per_batch",  # (how many cells a batch draws: the schedule counts cells, the audit too)
        "compile",  # (how the step runs: the same model, cells and schedule)
    }
)


def write_record(folder, config: dict) -> Path:
    """Keep `config` as the run's campaign record (whole or not at all: written aside, then moved)."""
    import os

    path = Path(folder) / CAMPAIGN_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{CAMPAIGN_RECORD}.{os.getpid()}")
    tmp.write_text(json.dumps(config))
    os.replace(tmp, path)
    return path


def read_record(text: str, where: str) -> dict:
    """A campaign record's settings; one line naming the file when it cannot be read."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CellfeedError(
            f"{where}: the run's campaign record cannot be read ({exc}); give the campaign's flags with --resume, "
            "or start another --run"
        ) from None


def resumed_flags(run: str, recorded: dict, given: dict, defaults: dict | None = None) -> tuple[dict, list[str]]:
    """The settings a resume of `run` continues with: its recorded campaign (`CAMPAIGN_RECORD`), and
    of the flags `given` on this command line, those a resume may change (`RESUME_CHANGES`); the
    lines that say each change. A given flag that would change the campaign raises, naming the flag
    and the recorded value; one equal to the recorded value changes nothing. `defaults`: the
    command's own (a value the record lacks, as a run before a setting existed had it). A
    recorded `--steps` beside `--epochs` was a partial run's stop, not the campaign's end: it is
    not kept (alone, it sets how many epochs the campaign has, and is)."""
    defaults = flag_defaults(defaults)
    kept = {f.name for f in fields(CampaignConfig)} - {"run", "resume", "checkpoint_dir", "carried", "mixtures"}
    flags = {name: value for name, value in recorded.items() if name in kept}
    if flags.get("epochs") is not None or given.get("epochs") is not None:  # --steps beside --epochs stopped
        flags.pop("steps", None)  # that run early: the campaign's end is its epochs
    if flags.get("corpus"):  # a corpus names its genes' column in its file: a record made before --gene-column
        flags.pop("gene_column", None)  # with --corpus was refused may hold one that was dropped, never used
    notes = []
    for name, value in given.items():
        before = flags.get(name, defaults.get(name))
        if name == "max_genes" and before is None:  # (the tokenizer's own length: the same value, said or not)
            before = layout(flags.get("tokenizer", defaults.get("tokenizer"))).default_genes
        if name in ("run", "resume") or value == before:
            continue
        flag = "--" + name.replace("_", "-")
        if name not in RESUME_CHANGES:
            raise CellfeedError(
                f"{flag} {value}: run {run} was started with {flag} {before}, which is part of what its campaign "
                f"is; leave {flag} out to resume it as it was, or start another --run"
            )
        if name == "epochs" and before is not None and value < before:
            raise CellfeedError(
                f"--epochs {value}: run {run}'s campaign has {before} epochs; a resume may add epochs, not drop "
                "them (leave --epochs out to finish the campaign, or `cellfeed stop` it where it stands)"
            )
        had = "none" if before is None else before
        said = (flag if value else f"--no-{flag[2:]}") if isinstance(value, bool) else f"{flag} {value}"
        notes.append(f"{said} from this resume on (the campaign had {had})")
        flags[name] = value
    return flags, notes


def resume_command(cfg: CampaignConfig, program: str = "modal run app/modal_app.py", names=MODAL_FLAGS) -> str:
    """The command line that continues this campaign: its flags that differ from the defaults
    (files as the laptop named them), `--run`, and `--resume`."""
    import shlex

    defaults, words = flag_defaults(), program.split()
    for name in names:
        value = getattr(cfg, name)
        if name in ("run", "resume") or value is None or value == defaults.get(name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{name.replace('_', '-')}")
        else:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words + ["--run", cfg.run, "--resume"])
