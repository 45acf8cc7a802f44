"""The two ways to run a campaign: `cellfeed local` end to end, and the Modal app imported offline,
its resources and flags checked (the whole Modal path runs on the local control plane with modal's
own client: tests/test_modal_campaign.py; none of these is a Modal run)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.config import CampaignConfig
from coordination.errors import CellfeedError

ROOT = Path(__file__).resolve().parents[1]


def offline_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    env["HOME"] = str(tmp_path)  # no ~/.modal.toml: no token anywhere
    return env


def test_modal_app_imports_offline_and_help_lists_every_flag(tmp_path):
    """`modal run --help` (modal's own CLI, offline) lists one option per campaign flag: the
    entrypoint's parameters are derived from CampaignConfig (Modal 1.6 shows no help text)."""
    from app.flags import MODAL_FLAGS

    env = offline_env(tmp_path)
    subprocess.run([sys.executable, "-c", "import app.modal_app"], cwd=ROOT, env=env, check=True, timeout=120)
    modal_cli = Path(sys.executable).with_name("modal")
    out = subprocess.run(
        [str(modal_cli), "run", "app/modal_app.py", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    listed = set(re.findall(r"--([a-z][a-z0-9-]*)", out.stdout))
    assert {name.replace("_", "-") for name in MODAL_FLAGS} <= listed, out.stdout


def non_default_flags() -> dict:
    """A value for every flag that is not its default (and is valid)."""
    from dataclasses import MISSING, fields

    from app.flags import MODAL_FLAGS, flag_choices

    choices, defaults = flag_choices(), {f.name: f.default for f in fields(CampaignConfig) if f.default is not MISSING}
    strings = dict(
        dataset="s3://bucket/atlas",
        run="round-trip",
        subset_filter="plate != 'p1'",
        eval_filter="plate = 'p2'",
        vocabulary="/v/vocab.json",
        gene_column="feature_name",
        gene_medians="/v/medians.pkl",
        balance_by="tissue",
    )
    values = {}
    for name in MODAL_FLAGS:
        if name == "corpus":  # replaces --dataset (and the filters): its own round trip in the test
            continue
        default = defaults.get(name)
        if name in strings:
            values[name] = strings[name]
        elif name in choices:
            values[name] = [c for c in choices[name] if c != default][-1]
        elif isinstance(default, bool):
            values[name] = True
        elif isinstance(default, float):
            values[name] = default / 2 if default else 5.0
        elif name in ("tokens_per_row", "tokens_per_batch"):  # (the longest cell fits: max_genes 3 + CLS + EOS)
            values[name] = 12
        else:  # ints and optional ints
            values[name] = (default or 2) + 1
    return values


def modal_run_context(args: list[str]):
    """`modal run app/modal_app.py ARGS` parsed by modal's own CLI (its `run` group resolves the file's
    local entrypoint and builds its options), offline: the entrypoint's click context, not run."""
    from modal.cli.run import run as modal_run

    group = modal_run.make_context("modal run", ["app/modal_app.py", *args])
    rest = [*group._protected_args, *group.args]  # (click 8.2: the subcommand's name and what follows)
    name, command, rest = modal_run.resolve_command(group, rest)
    return command.make_context(name, rest, parent=group)


def test_every_setting_a_user_gives_is_a_flag_of_both_commands():
    """Each CampaignConfig field is a flag of `modal run`, and all but its three Modal-only ones of
    `cellfeed local`, with help, unless `not_flags` says what sets it. `compile` had help, a config field
    and a path to `torch.compile` in the trainer, but was in neither command's flags: `--compile` was
    refused. (`cells_per_item` and `label_column`, which nothing could set, left the campaign's config:
    the producer's own defaults were all a campaign ever had.)"""
    from dataclasses import fields

    from app.flags import CAMPAIGN_FLAGS, FLAG_HELP, MODAL_FLAGS

    not_flags = {  # each set elsewhere, as said
        "checkpoint_dir",  # the run's folder: `--workdir` locally, the checkpoints Volume on Modal
        "carried",  # Modal: the laptop's files carried into containers
        "mixtures",  # the corpus changes a run's resumes made, from its record
    }
    settings = {f.name for f in fields(CampaignConfig)} - not_flags
    assert settings == set(MODAL_FLAGS) == set(FLAG_HELP)
    assert set(MODAL_FLAGS) - set(CAMPAIGN_FLAGS) == {"attempt_hours", "modal_retry_s", "audit_cells"}
    assert "compile" in CAMPAIGN_FLAGS


def test_a_gene_column_flag_with_a_corpus_is_refused_for_the_files_own(tmp_path):
    """The producers read a corpus's `gene_column` from its file (`ProducerConfig.corpus_spec`): a
    `--gene-column` beside `--corpus` would be dropped without a word, so it is refused in one line."""
    says = r"^--gene-column feature_name: with --corpus, set gene_column in the corpus file$"
    with pytest.raises(CellfeedError, match=says):
        CampaignConfig(corpus=str(tmp_path / "c.toml"), run="c", gene_column="feature_name").validate()
    assert CampaignConfig(corpus=str(tmp_path / "c.toml"), run="c").validate().gene_column == "gene_id"


def test_every_flag_round_trips_through_modal_run_and_cellfeed_local():
    """The same flags give the same CampaignConfig through `modal run`'s options (built by
    modal's own CLI code from the entrypoint) and `cellfeed local`'s parser."""
    from app.cli import build_parser
    from app.flags import CAMPAIGN_FLAGS

    values = non_default_flags()
    args = [
        a for name, v in values.items() for a in (f"--{name.replace('_', '-')}", str(v)) if not isinstance(v, bool)
    ] + [f"--{n.replace('_', '-')}" for n, v in values.items() if v is True]
    expected = CampaignConfig(**values).validate()
    ctx = modal_run_context(list(args))
    assert CampaignConfig.from_flags(ctx.params) == expected
    modal_only = ("--attempt-hours", "--modal-retry-s")  # (and --audit-cells, a flag of `cellfeed local`'s own)
    local_args = [a for i, a in enumerate(args) if a not in modal_only and (i == 0 or args[i - 1] not in modal_only)]
    parsed = vars(build_parser().parse_args(["local", *local_args]))
    assert parsed["audit_cells"] is True
    assert (
        CampaignConfig(**{k: parsed[k] for k in CAMPAIGN_FLAGS}).validate()
        == CampaignConfig(
            **{
                **values,
                "attempt_hours": CampaignConfig.attempt_hours,
                "audit_cells": False,
                "modal_retry_s": CampaignConfig.modal_retry_s,
            }
        ).validate()
    )
    corpus_args = ["--corpus", "/c/corpus.toml", "--run", "c"]
    ctx = modal_run_context(list(corpus_args))
    parsed = vars(build_parser().parse_args(["local", *corpus_args]))
    assert CampaignConfig.from_flags(ctx.params).corpus == parsed["corpus"] == "/c/corpus.toml"


def test_a_resume_continues_its_recorded_campaign_and_says_or_refuses_each_changed_flag(tmp_path, capsys):
    """`--resume` alone continues the campaign its run recorded; a flag a resume may change is
    applied and said; one that defines the campaign is refused in one line naming the flag and the
    recorded value (locally before anything starts; `modal run`: tests/test_modal_campaign.py)."""
    from dataclasses import asdict

    from app.cli import build_parser, main
    from app.resume import resumed_flags

    recorded = asdict(CampaignConfig(dataset="/d", run="r", epochs=3, batch_size=32, producers=2, seed=7))
    flags, notes = resumed_flags("r", recorded, {})
    assert (flags["dataset"], flags["epochs"], flags["batch_size"], flags["seed"], notes) == ("/d", 3, 32, 7, [])
    flags, notes = resumed_flags("r", recorded, {"epochs": 5, "producers": 4, "batch_size": 32, "seed": 7})
    assert (flags["epochs"], flags["producers"], flags["batch_size"]) == (5, 4, 32)
    assert notes == [
        "--epochs 5 from this resume on (the campaign had 3)",
        "--producers 4 from this resume on (the campaign had 2)",
    ]
    partial = {**recorded, "steps": 30}  # --steps beside --epochs stopped that run early: not the campaign's end
    assert resumed_flags("r", partial, {})[0].get("steps") is None
    assert resumed_flags("r", {**partial, "epochs": None}, {})[0]["steps"] == 30  # alone, it is the campaign's length
    steps_only = {**partial, "epochs": None}  # given --epochs, a --steps campaign ends with its epochs
    assert resumed_flags("r", steps_only, {"epochs": 4})[0].get("steps") is None
    assert resumed_flags("r", recorded, {"max_genes": 1024})[1] == []  # scgpt's own length: no change
    assert resumed_flags("r", recorded, {"audit_cells": True})[1] == [
        "--audit-cells from this resume on (the campaign had False)"
    ]
    flags, notes = resumed_flags("r", recorded, {"compile": True})  # (how the step runs, not what it computes)
    assert flags["compile"] is True and notes == ["--compile from this resume on (the campaign had False)"]
    # ... and off again, locally too (`--no-compile`)
    assert build_parser().parse_args(["local", "--no-compile", "--no-audit-cells"]).compile is False
    flags, notes = resumed_flags("r", {**recorded, "compile": True}, {"compile": False})
    assert flags["compile"] is False and notes == ["--no-compile from this resume on (the campaign had True)"]
    # a corpus's record from before --gene-column with --corpus was refused: the dropped column is dropped again
    corpus = {**recorded, "dataset": None, "corpus": "/c.toml", "gene_column": "feature_name"}
    flags, notes = resumed_flags("r", corpus, {})
    assert "gene_column" not in flags and CampaignConfig(**flags).validate().gene_column == "gene_id"
    with pytest.raises(CellfeedError, match=r"^--batch-size 64: run r was started with --batch-size 32, which is"):
        resumed_flags("r", recorded, {"batch_size": 64})
    with pytest.raises(CellfeedError, match=r"^--epochs 2: run r's campaign has 3 epochs; a resume may add epochs"):
        resumed_flags("r", recorded, {"epochs": 2})
    # the command line: `--tokenizer` changed at a resume is one line, exit 2, before anything runs
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "campaign.json").write_text(json.dumps(recorded))
    code = main(["local", "--run", "r", "--resume", "--tokenizer", "geneformer", "--workdir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("cellfeed: error: --tokenizer geneformer: run r was started with --tokenizer scgpt")


def test_modal_entrypoint_refuses_more_gpus_than_a_container_has_before_any_call(tmp_path):
    """modal's own `modal run` against the local control plane: refused in one line before any call."""
    from cellfeed_testing.modal_control_plane import ControlPlane

    with ControlPlane(tmp_path / "plane", secrets={"cellfeed-s3": {}}) as plane:
        out = subprocess.run(
            [sys.executable, "-m", "modal", "run", "app/modal_app.py", "--dataset", "s3://bucket/atlas", "--gpus", "9"],
            cwd=ROOT,
            env={**offline_env(tmp_path), **plane.env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0 and "--gpus 9: a Modal container has at most 8 GPUs" in out.stderr, out.stderr
        assert plane.describe()["calls"] == []  # refused before setup ran


def test_the_volume_mount_is_fixed_whatever_the_laptops_environment(monkeypatch):
    """Read at import, a laptop's CELLFEED_CHECKPOINT_MOUNT moved the mount in train's definition but
    not in its container (checkpoints on the container's disk); now only the container reads it."""
    from tests.conftest import fresh_import

    monkeypatch.setenv("CELLFEED_CHECKPOINT_MOUNT", "/elsewhere")
    with fresh_import("app.modal_app") as m:
        assert list(m.train._spec_.volumes) == ["/checkpoints"]
        assert m.mounted(m.CHECKPOINTS) == "/elsewhere"  # (an emulated container's stand-in folder)
        monkeypatch.delenv("CELLFEED_CHECKPOINT_MOUNT")
        assert m.mounted(m.CHECKPOINTS) == "/checkpoints"


def test_modal_functions_declare_their_resources():
    import app.modal_app as m

    assert m.train._spec_.gpus == "H100:8" and "/checkpoints" in m.train._spec_.volumes
    assert m.train._spec_.cpu == 32.0 and m.train._spec_.memory == 131_072  # 8 ranks decompress on the CPU
    assert m.produce._spec_.gpus is None and m.produce._spec_.cpu == 4.0 and m.produce._spec_.memory == 16384
    assert [s for s in m.produce._spec_.secrets] and [s for s in m.setup._spec_.secrets]
    assert not any(p.startswith(("pylance", "polars")) for p in m.TRAINER_PIP)
    assert any(p.startswith("pylance") for p in m.PRODUCER_PIP) and any(p.startswith("torch") for p in m.TRAINER_PIP)


def test_gpu_side_code_never_imports_lance_or_polars():
    code = (
        "import sys, trainer.train, trainer.stream, trainer.model, trainer.launch, coordination.driver, "
        "coordination.backends, coordination.modal_backend, app.config, app.flags, app.resume, app.modal_train; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lance', 'polars')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def campaign_config(ds, **changes) -> CampaignConfig:
    base = dict(
        dataset=ds.uri,
        run="app-test",
        producers=2,
        gpus=2,
        batch_size=32,
        max_genes=32,
        preset="tiny",
        steps=6,
        warmup_steps=2,
        checkpoint_every=3,
        eval_filter="plate = 'plate14'",
        eval_cells=64,
        eval_every=3,
        strategy="mixture",
        unit_cells=200,
    )
    return CampaignConfig(**{**base, **changes}).validate()


def test_cellfeed_local_end_to_end_logging_to_wandb_offline(tmp_path):
    """`cellfeed local` end to end: 2 producers, 2 ranks, held-out evaluation and checkpoints, and
    `--wandb PROJECT`: rank 0 logs the same scalars to W&B (here in wandb's offline mode: a run file on
    disk, no network). Without a W&B key or offline mode it is refused before anything starts, in one
    line. (One campaign for both: a campaign here costs ~12 CPU-s.)"""
    base = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"HOME": str(tmp_path)}  # no netrc
    flags = ["local", "--workdir", str(tmp_path), "--cells", "1200", "--producers", "2", "--gpus", "2",
             "--steps", "8", "--max-genes", "64", "--batch-size", "16", "--checkpoint-every", "4",
             "--eval-filter", "plate = 'plate14'", "--eval-every", "4", "--run", "ci", "--quiet",
             "--wandb", "cellfeed-test"]  # fmt: skip
    cli = [sys.executable, "-m", "app.cli", *flags]
    refused = subprocess.run(cli, cwd=ROOT, env=base, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "cellfeed: error: --wandb: no W&B key: set WANDB_API_KEY, run `wandb login`, or set WANDB_MODE=offline"
    )
    assert not (tmp_path / "ci").exists()
    env = base | {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    out = subprocess.run(cli, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "cells/s" in out.stdout and "dataloader wait" in out.stdout and "held-out at step 8" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "ci" / "steps.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert all(r["wait_ms"] >= 0 and r["cells_per_s"] > 0 for r in rows if "loss" in r)
    assert (tmp_path / "checkpoints" / "ci" / "latest").read_text().strip() == "step-00000008"
    assert (tmp_path / "checkpoints" / "ci" / "step-00000004" / "state.pt").exists()
    (record,) = (tmp_path / "ci" / "wandb").glob("offline-run-*/run-*.wandb")
    data = record.read_bytes()  # wandb's own record log: its history rows name each scalar
    assert all(tag in data for tag in (b"train/loss", b"train/cells_per_s", b"data_wait_ms/rank0", b"cellfeed-test"))


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(tokenizer="raw"), r"--tokenizer raw: the trainer learns from scgpt, geneformer-v1, geneformer-v2"),
        (dict(tokenizer="bert"), r"unknown tokenizer 'bert'; choose one of scgpt, geneformer-v1"),
        (dict(epochs=0), "--epochs must be >= 1"),
        (dict(strategy="zigzag"), "unknown strategy"),
        (dict(preset="huge"), "unknown model preset"),
        (dict(producers=0), "--producers must be >= 1"),
        (dict(run="has space"), "run name"),
        (dict(steps=0), "--steps must be >= 1"),
        (dict(tokens_per_row=2000, tokens_per_batch=1000), r"--tokens-per-batch 1000: a batch must hold the longest"),
        (dict(tokens_per_batch=5000), r"--tokens-per-batch 5000 needs --tokens-per-row: padded, each cell is a row"),
    ],
)
def test_campaign_config_is_validated_up_front(change, needle):
    with pytest.raises(CellfeedError, match=needle):
        CampaignConfig(dataset="x", **change).validate()


def test_cli_local_bad_flag_is_one_line(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "local",
            "--workdir",
            str(tmp_path),
            "--dataset",
            str(tmp_path / "missing"),
            "--quiet",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"cellfeed: error: no dataset at {tmp_path / 'missing'}: the path does not exist"
    ]


def test_modal_carries_the_corpus_vocabulary_and_medians_files_into_containers(tmp_path):
    """A container cannot read the laptop's disk: `main` carries the files' bytes in the config,
    a container writes them out and reads the same corpus, with the corpus file's vocabulary."""
    import shutil
    from dataclasses import asdict

    from coordination.corpus_file import CorpusSpec

    laptop = tmp_path / "laptop"
    laptop.mkdir()
    (laptop / "vocab.json").write_text('{"A": 0, "B": 1}')
    (laptop / "medians.json").write_text('{"A": 1.5}')
    (laptop / "corpus.toml").write_text(
        'vocabulary = "vocab.json"\nepoch_cells = 10\n\n[[source]]\nname = "x"\n'
        'dataset = "s3://bucket/x"\nweight = 2\neval_filter = "plate = \'p\'"\n'
    )
    cfg = CampaignConfig(corpus=str(laptop / "corpus.toml"), gene_medians=str(laptop / "medians.json"), run="c")
    carried = CampaignConfig(**json.loads(json.dumps(asdict(cfg.carry_files()))))  # as it crosses to Modal
    shutil.rmtree(laptop)
    container = carried.unpack_files(tmp_path / "container").validate()
    spec = CorpusSpec.read(container.corpus)
    assert spec.sources[0].dataset == "s3://bucket/x" and spec.sources[0].weight == 2 and spec.epoch_cells == 10
    assert spec.sources[0].eval_filter == "plate = 'p'"
    assert json.loads(Path(container.vocabulary).read_text()) == {"A": 0, "B": 1}
    assert json.loads(Path(container.gene_medians).read_text()) == {"A": 1.5}
    assert str(tmp_path / "container") in container.corpus


def test_modal_refuses_a_cluster_node_of_fewer_than_all_its_hosts_gpus():
    """modal.clustered: each container of a cluster takes every GPU of its host (H100:8); a node of 2 is
    refused before any call, in one line that says what to give instead."""
    import app.modal_app as m
    from coordination.errors import CellfeedError

    with pytest.raises(CellfeedError, match=r"--nodes 2 --gpus 2: each node of a Modal cluster takes all 8 GPUs"):
        m.campaign_of({"dataset": "s3://bucket/atlas", "nodes": 2, "gpus": 2})
    assert m.campaign_of({"dataset": "s3://bucket/atlas", "nodes": 2, "gpus": 8}).world_size == 16
    assert m.campaign_of({"dataset": "s3://bucket/atlas", "nodes": 1, "gpus": 2}).world_size == 2


def test_the_entrypoint_reaches_setup_with_modals_real_function_objects(monkeypatch, capsys):
    """With modal's real objects (nothing emulated), `modal run`'s entrypoint builds the campaign from
    its flags and spawns `setup` through the product's own helpers; an error that is not the input's,
    Modal's or a call's (here a stand-in for setup's spawn) is not swallowed into one line: it
    propagates with its traceback, after the command that resumes the campaign."""
    import app.journal
    import app.modal_app as m
    import coordination.modal_backend as mb

    class Reached(Exception):
        pass

    def spawned(config, *args, **kwargs):
        raise Reached(config)

    class NoJournal:
        def __init__(self, *a, **k):
            pass

        def clear_stop(self):
            pass

    monkeypatch.setattr(app.journal, "DictJournal", NoJournal)
    monkeypatch.setattr(mb, "run_backends", lambda *a, **k: (None, None))
    monkeypatch.setattr(m.setup, "spawn", spawned, raising=False)
    with pytest.raises(Reached) as reached:
        m.main.info.raw_f(dataset="s3://bucket/atlas", producers=3, gpus=2)
    config = reached.value.args[0]
    assert (config["dataset"], config["producers"], config["gpus"]) == ("s3://bucket/atlas", 3, 2)
    assert "Resume it with:\n  modal run app/modal_app.py --dataset s3://bucket/atlas" in capsys.readouterr().err
