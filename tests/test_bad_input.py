"""Bad input never trains: a damaged dataset (metadata that lies, cell offsets that disagree with
the expression table, a missing fragment file), a resume onto other data, a bad flag, a path that
cannot be written and an object-store endpoint that is not a URL each end `cellfeed local` before
any training, in seconds, with one line naming the problem (no traceback), leaving no run folder."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import built_once

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--producers", "1", "--gpus", "1", "--epochs", "1", "--batch-size", "32", "--max-genes", "24", "--quiet"]


@pytest.fixture(scope="session")  # data only: built once per session (`built_once`), whatever order tests run in
def data(tmp_path_factory):
    """Two small atlases, and three damaged copies of the first."""
    import lance
    import pyarrow as pa

    from app.cli import main as cli

    def build(root: Path) -> None:
        for name, cells in (("a", 600), ("b", 400)):
            args = ["synth", str(root / name), "--cells", str(cells), "--genes", "2000", "--seed", "3", "--quiet"]
            assert cli(args) == 0
        for name in ("shifted", "lying", "nofrag", "truncated"):
            shutil.copytree(root / "a", root / name)
        cells = lance.dataset(str(root / "shifted" / "cells.lance")).to_table()
        starts = cells["cell_start_index"].to_numpy().copy()
        starts[100:200] += 5  # still increasing, in range, same total: wrong rows for 100 cells
        cells = cells.set_column(cells.column_names.index("cell_start_index"), "cell_start_index", pa.array(starts))
        lance.write_dataset(cells, str(root / "shifted" / "cells.lance"), mode="overwrite")
        config = json.loads((root / "lying" / "config.json").read_text())
        config["n_cells"] += 1000
        (root / "lying" / "config.json").write_text(json.dumps(config))
        os.remove(sorted(glob.glob(str(root / "nofrag" / "expression.lance" / "data" / "*")))[0])
        for path in glob.glob(str(root / "truncated" / "expression.lance" / "data" / "*")):
            os.truncate(path, 1000)  # every fragment cut short: the sample at open reads one

    return built_once(tmp_path_factory, "bad-input", build)


def local(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "local", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    return out, time.monotonic() - start


def refused(out: subprocess.CompletedProcess, seconds: float, says: str) -> None:
    """Exit 2, one line naming the problem, no traceback, nothing trained, in seconds."""
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(("cellfeed: error: ", "cellfeed local: error: ")), out.stderr[-2000:]
    assert says in lines[0], lines[0]
    assert '"step"' not in out.stdout and "cells trained" not in out.stdout
    assert seconds < 60  # (bounds it on a busy 2-core machine; the point is: before any training)


@pytest.mark.parametrize(
    "name, says",
    [
        ("lying", "config.json says 1,600 cells, but cells.lance holds 600: the metadata does not match the data"),
        ("shifted", "cells.lance's cell_start_index disagrees with expression.lance: cell "),
        ("nofrag", "expression fragment 0's file "),
        ("truncated", "cannot read rows of "),
    ],
    ids=["damaged-metadata", "damaged-offsets", "missing-fragment", "truncated-fragment"],
)
def test_a_damaged_dataset_is_refused_at_open(data, tmp_path, name, says):
    out, seconds = local("--dataset", str(data / name), *COMMON, "--workdir", str(tmp_path / "w"), "--run", "r")
    refused(out, seconds, says)
    assert out.stderr.strip().endswith(
        (
            "The dataset is damaged: convert it again (or copy it whole)",
            "write it again (`cellfeed convert`/`synth`) or restore it",
        )
    )
    assert not (tmp_path / "w" / "r").exists()  # no run folder left behind


def test_inspect_check_reads_every_row_and_finds_what_the_sample_may_miss(data):
    from coordination.errors import CellfeedError
    from producers.dataset import open_dataset

    assert open_dataset(str(data / "a")).check_all() == open_dataset(str(data / "a")).n_rows
    with pytest.raises(CellfeedError, match="belongs to cell 1[0-9][0-9], but cell_start_index gives it to cell"):
        open_dataset(str(data / "shifted"), verify=False).check_all()  # (opened unchecked: the full read finds it)
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "inspect", str(data / "a"), "--check", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].startswith("check: ok: "), out.stderr


def test_a_resume_onto_other_data_is_refused_and_trains_nothing(data, tmp_path):
    w = str(tmp_path / "w")
    out, _ = local("--dataset", str(data / "a"), *COMMON, "--workdir", w, "--run", "good")
    assert out.returncode == 0, out.stderr[-2000:]
    steps = (tmp_path / "w" / "good" / "steps.jsonl").read_text()
    out, seconds = local(
        "--dataset", str(data / "b"), *COMMON, "--epochs", "2", "--workdir", w, "--run", "good", "--resume"
    )
    refused(out, seconds, "--resume: the checkpoint at step 19 was trained on other data (600 cells, content ")
    assert "this campaign's is 400 cells, content " in out.stderr
    assert (tmp_path / "w" / "good" / "steps.jsonl").read_text() == steps  # nothing trained


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--lr", "nan"], "--lr nan: the peak learning rate must be a finite number in (0, 1]"),
        (["--gpus", "64"], "--gpus 64: cellfeed local runs each rank as a CPU process"),
        (["--batch-size", "0"], "argument --batch-size: expected a number >= 1, got 0 (see `cellfeed local --help`)"),
        (["--tokens-per-batch", "1000"], "--tokens-per-batch 1000 needs --tokens-per-row: padded, each cell is a row"),
    ],
    ids=["lr-nan", "gpus-64", "batch-0", "budget-unpacked"],
)
def test_a_bad_flag_is_refused_before_any_work(data, tmp_path, flags, says):
    out, seconds = local("--dataset", str(data / "a"), *COMMON, *flags, "--workdir", str(tmp_path / "w"), "--run", "r")
    refused(out, seconds, says)
    assert not (tmp_path / "w" / "r").exists()


def test_a_workdir_that_cannot_be_made_is_one_line(data):
    out, seconds = local("--dataset", str(data / "a"), *COMMON, "--workdir", "/proc/cellfeed-runs", "--run", "r")
    refused(out, seconds, "cannot make the run folder /proc/cellfeed-runs/r")


def test_an_endpoint_that_is_not_a_url_names_the_setting(tmp_path):
    out, seconds = local(
        "--dataset",
        "s3://bucket/atlas",
        *COMMON,
        "--workdir",
        str(tmp_path / "w"),
        "--run",
        "r",
        env={"AWS_ENDPOINT_URL": "not a url"},
    )
    refused(out, seconds, "AWS_ENDPOINT_URL='not a url' is not an http(s) URL")
    assert not (tmp_path / "w" / "r").exists()


def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "synth", "/proc/cellfeed-atlas", "--cells", "100", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "cellfeed: error: cannot write /proc/cellfeed-atlas (No such file or directory): choose an output path in a "
        "folder you can write to"
    ], out.stderr[-2000:]
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "synth", str(tmp_path / "new" / "atlas"), "--cells", "100", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"cellfeed: error: cannot write {tmp_path}/new/atlas: folder {tmp_path}/new does not exist; create it first"
    ]
