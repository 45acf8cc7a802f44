"""The README's examples run as written: its `cellfeed` commands, typed as a user types them (the
`cellfeed` entry point, in a folder of their own), on the data the README's own commands make, its
corpus file taken from the README (so the two cannot drift). Every command it shows parses; the
main ones run, made small by flags appended to the README's own (the last of a repeated flag wins),
with the set-up's 4,000-cell atlas standing in as 600 cells of 2,000 genes: a few steps each."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ENTRY = Path(sys.executable).with_name("cellfeed")  # what `pip install -e .` put on the user's PATH
CELLFEED = [str(ENTRY)] if ENTRY.exists() else [sys.executable, "-m", "app.cli"]
# a campaign of a few seconds (a run name of its own: the default, a timestamp, could repeat within a second)
SHORT = ["--steps", "2", "--batch-size", "8", "--max-genes", "32", "--quiet"]


def blocks(lang: str) -> list[str]:
    """The README's fenced blocks in `lang`."""
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.MULTILINE | re.DOTALL)


def readme_commands() -> list[list[str]]:
    """Every `cellfeed` command of the README's bash blocks as argv (comments dropped, `a && b` split)."""
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            for part in line.split(" && "):
                argv = shlex.split(part, comments=True)
                if argv[:1] == ["cellfeed"]:
                    out.append(argv)
    return out


def command(text: str) -> list[str]:
    """The README's command that is exactly `text`, else its one command that starts with it."""
    shown = {tuple(argv) for argv in readme_commands()}
    found = [argv for argv in shown if " ".join(argv) == text] or [
        argv for argv in shown if " ".join(argv).startswith(text + " ")
    ]
    assert len(found) == 1, f"README.md shows {len(found)} commands `{text} ...`, expected one"
    return list(found[0])


def cellfeed(argv: list[str], *small: str, cwd: Path) -> str:
    """Run a README command (plus `small`) as a user would; its stdout, after checking it exited 0."""
    assert argv[0] == "cellfeed"
    out = subprocess.run(CELLFEED + argv[1:] + list(small), cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (
        f"`{shlex.join(argv)}` exited {out.returncode}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
    )
    return out.stdout


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    """A user's folder after the README's set-up: `tests/data` as in the repository, and the atlas
    the first `cellfeed local` writes (`runs/synth-4000-0`, which later examples use), made small:
    that command reuses an atlas already there."""
    home = tmp_path_factory.mktemp("user")
    (home / "tests").mkdir()
    (home / "tests" / "data").symlink_to(ROOT / "tests" / "data")
    (home / "runs").mkdir()
    subprocess.run(
        CELLFEED
        + [
            "synth",
            "runs/synth-4000-0",
            "--cells",
            "600",
            "--genes",
            "2000",
            "--rows-per-fragment",
            "20000",
            "--quiet",
        ],
        cwd=home,
        check=True,
        capture_output=True,
    )
    return home


def test_every_command_the_readme_shows_parses():
    from app.cli import parse_args

    commands = readme_commands()
    assert len(commands) >= 15  # the set-up, campaigns, corpus, data tools: not vacuously
    for argv in commands:
        try:
            parse_args(argv[1:])
        except SystemExit as exc:  # argparse printed why on stderr
            pytest.fail(f"README.md: `{shlex.join(argv)}` does not parse (exit {exc.code})")


def test_the_set_up_runs_the_main_job(user):
    out = cellfeed(command("cellfeed local"), *SHORT, "--run", "setup", cwd=user)
    assert "synthesizing" not in out  # it trained on the atlas the later examples use
    assert out.strip().splitlines()[-1].startswith("stopped at step 2 as --steps asked")


def test_data_tools_and_the_python_example(user, monkeypatch):
    cellfeed(command("cellfeed synth runs/atlas"), "--cells", "200", "--genes", "1000", "--quiet", cwd=user)
    cellfeed(command("cellfeed convert tests/data/pbmc68k_reduced.h5ad"), "--quiet", cwd=user)
    shown = cellfeed(command("cellfeed inspect runs/pbmc"), cwd=user)
    assert "cells       700" in shown and "var columns" in shown and re.search(r"\n  gene_id +string", shown)
    cellfeed(command("cellfeed stats runs/atlas"), "--quiet", cwd=user)
    assert (user / "runs" / "atlas" / "gene_stats.lance").exists()
    (python,) = [b for b in blocks("python") if "open_dataset(" in b]
    monkeypatch.chdir(user)
    exec(compile(python, "README.md", "exec"), {})  # as written: a path the set-up made
    for block in blocks("python"):
        compile(block, "README.md", "exec")  # the others (a server on this machine) at least are Python


def test_the_corpus_example_trains(user):
    (toml,) = blocks("toml")
    (user / "corpus.toml").write_text(toml)  # as the README says: saved in the folder the commands run in
    cellfeed(command("cellfeed synth runs/second-atlas"), "--cells", "200", "--genes", "1000", "--quiet", cwd=user)
    shown = cellfeed(command("cellfeed inspect corpus.toml"), cwd=user)
    assert "2 sources, 2,000 cells per epoch" in shown
    out = cellfeed(command("cellfeed local --corpus corpus.toml --epochs"), *SHORT, "--run", "corpus", cwd=user)
    assert "1,200 cells per epoch from tahoe: 2,000 of 2,000 genes in the vocabulary" in out
    assert "800 cells per epoch from second: 1,000 of 1,000 genes in the vocabulary, 100.0% of non-zeros kept" in out
    assert out.strip().splitlines()[-1].startswith("stopped at step 2 as --steps asked")
    cellfeed(command("cellfeed stats corpus.toml"), "--quiet", cwd=user)
    assert (user / "medians.json").stat().st_size > 0
    out = cellfeed(
        command("cellfeed local --corpus corpus.toml --tokenizer geneformer"), *SHORT, "--run", "gf", cwd=user
    )
    assert out.strip().splitlines()[-1].startswith("stopped at step 2 as --steps asked")


def test_the_balanced_example_trains_every_class_at_its_quota(user):
    """The README's balanced commands on the set-up's (small) atlas: the planned mix, then two whole
    epochs whose audits find every one of the 50 tissues at its quota."""
    shown = cellfeed(command("cellfeed stats runs/synth-4000-0 --balance-by"), cwd=user)
    assert shown.splitlines()[0].endswith("50 classes of tissue, ALPHA 1, 600 cells per epoch")
    out = cellfeed(
        command("cellfeed local --dataset runs/synth-4000-0 --balance-by"),
        *["--batch-size", "64", "--max-genes", "16", "--gpus", "1", "--producers", "1", "--quiet"],
        "--run",
        "balanced",
        cwd=user,
    )
    assert "50 classes at their quotas (12..12 cells)" in out
    assert "classes by tissue, ALPHA 1: 50, 12..12 cells each per epoch" in out
    assert "2 of 2 epochs trained every class at its quota" in out
    assert out.strip().splitlines()[-1].startswith("complete: 2 epochs")
