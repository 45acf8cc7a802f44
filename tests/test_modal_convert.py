"""Conversion fanned out over Modal, on the local Modal control plane (not a Modal run): modal's own
CLI runs `modal run app/modal_app.py::convert`, the coordinator's container plans and commits, one
`convert_slice` container per slice scans and writes (8 slices), inputs on the inputs Volume, the
output on S3 (SeaweedFS) with the app's Secret. A slice's first attempt fails: Modal retries it. The
dataset equals the one a local conversion writes."""

from __future__ import annotations

import shutil
import subprocess
import sys

import lance
import numpy as np
import scipy.sparse as sp

from cellfeed_testing.modal_control_plane import ControlPlane
from producers.convert import convert
from producers.dataset import TABLES, open_dataset
from producers.storage import S3Settings
from tests.conftest import random_counts, write_h5ad
from tests.test_modal_campaign import ROOT, SECRET, client_env


def test_modal_fan_out_converts_eight_slices_with_a_retry_and_commits_once(tmp_path, seaweed):
    a, b = random_counts(300, 50, seed=41), random_counts(212, 50, seed=42)
    inputs = [write_h5ad(tmp_path / "a.h5ad", a), write_h5ad(tmp_path / "b.h5ad", b)]
    bucket = "modal-convert"
    seaweed.client().create_bucket(Bucket=bucket)
    with ControlPlane(
        tmp_path / "plane", secrets={SECRET: seaweed.settings}, mount_env={"/inputs": "CELLFEED_INPUTS_MOUNT"}
    ) as plane:
        for path in inputs:  # what `modal volume put cellfeed-inputs a.h5ad b.h5ad` leaves on the Volume
            shutil.copy(path, plane.volume_folder("cellfeed-inputs") / path.name)
        plane.fail("convert_slice", 1)  # the first slice call's first attempt fails before its body runs
        run = subprocess.run(
            [sys.executable, "-m", "modal", "run", "app/modal_app.py::convert", "--inputs", "a.h5ad,b.h5ad",
             "--out", f"s3://{bucket}/atlas", "--slice-cells", "64", "--block-cells", "64"],
            cwd=ROOT, env=client_env(plane), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        slices = plane.history("convert_slice")
        coordinator = plane.history("convert")
    assert len(coordinator) == 1 and coordinator[0]["status"] == "success"
    assert len(slices) == 16 and all(c["status"] == "success" for c in slices)  # 8 scans, then 8 writes
    assert sorted(len(c["attempts"]) for c in slices) == [1] * 15 + [2]  # the failed attempt, retried
    assert "wrote s3://" in run.stdout + run.stderr
    settings = S3Settings.from_env(seaweed.settings)
    remote = open_dataset(f"s3://{bucket}/atlas", settings)
    local = convert([str(p) for p in inputs], str(tmp_path / "local"), slice_cells=64, block_cells=64, progress=False)
    assert remote.identity == local.identity and remote.n_cells == 512
    x = sp.vstack([a, b]).tocsr()
    rows = remote.read_rows(0, remote.n_rows)
    np.testing.assert_array_equal(rows.gene, x.indices)
    np.testing.assert_array_equal(rows.value, x.data)
    opts = settings.lance_options()
    for table in ("cells", "expression"):
        there = lance.dataset(remote.location.join(TABLES[table]), storage_options=opts).to_table()
        assert there.equals(lance.dataset(local.location.join(TABLES[table])).to_table()), table
