"""`python -m deploy.first_run` against the local Modal control plane (modal's own client, `app.run()`
and containers running modal's entrypoint; not a Modal run) and a real S3 server (SeaweedFS): the
whole first run, and what it leaves behind (nothing); a campaign that fails; a missing Secret stops it
in one line before anything is made. Also deploy/README.md's cost table against app/costs.py."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

from cellfeed_testing.modal_control_plane import ControlPlane

ROOT = Path(__file__).resolve().parents[1]
SECRET = "cellfeed-s3"  # app/modal_app.py's Secret (CELLFEED_SECRET unset: the first run's own)


@contextlib.contextmanager
def control_plane(tmp_path: Path, secrets: dict, lasting: dict | None = None):
    """A plane with `secrets` and the app's Volumes told to containers (app/modal_app.py: MOUNT_ENV)."""
    from app.modal_app import MOUNT_ENV

    with ControlPlane(tmp_path / "plane", secrets=secrets, mount_env=MOUNT_ENV, lasting_volumes=lasting) as plane:
        yield plane


def first_run(plane: ControlPlane, settings: dict, bucket: str, timeout: float = 500) -> tuple[int, list[str], str]:
    """The command a user runs, with this shell's S3 settings, its `import modal` modal's own, on the plane."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_") and k != "CELLFEED_SECRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.first_run", "--bucket", f"s3://{bucket}/first", "--yes"],
        cwd=ROOT,
        env={**env, **settings, **plane.env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout.strip().splitlines(), proc.stderr


def objects_under(seaweed, bucket: str, prefix: str) -> int:
    return seaweed.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("KeyCount", 0)


def test_a_first_run_trains_every_cell_once_and_deletes_what_it_made(seaweed, tmp_path, kernel_volume):
    from app.costs import (
        PRODUCER_CPU,
        PRODUCER_MEMORY_MB,
        SETUP_CPU,
        SETUP_MEMORY_MB,
        TRAINER_CPU,
        TRAINER_MEMORY_MB,
    )

    bucket = f"first-{os.urandom(4).hex()}"
    seaweed.client().create_bucket(Bucket=bucket)
    with control_plane(tmp_path, {SECRET: seaweed.settings}, kernel_volume) as plane:
        code, out, err = first_run(plane, seaweed.settings, bucket)
        assert code == 0, "\n".join(out[-30:]) + err[-3000:]
        done = re.fullmatch(
            r"first run: ok: run (first-run-[\d-]+), 2,000 cells trained exactly once in \d+ s wall "
            r"time",
            out[-1],
        )
        assert done, out[-1]
        run = done[1]
        assert any(line.startswith("this run costs about $") for line in out)
        assert "audit: 1 epoch(s) audited, 2,000 cells trained, 0 missing, 0 duplicated" in out
        assert f"deleted the atlas at s3://{bucket}/first/{run}" in out
        assert f"deleted the checkpoints /{run} in the Volume cellfeed-checkpoints" in out  # it was there
        assert objects_under(seaweed, bucket, "first/") == 0
        assert not (plane.volume_dir / run).exists()
        described = plane.describe()
        assert described["queues"] == [] and described["dicts"] == []
        assert not [c for c in described["calls"] if c["status"] == "running"]
        # the estimate priced what ran: 1 GPU with the trainer's cores and memory, 2 producers, setup
        (setup,), (train,) = plane.history("setup"), plane.history("train")
        assert (setup["cpu"], setup["memory"]) == (SETUP_CPU, SETUP_MEMORY_MB)
        assert (train["gpu"], train["cpu"], train["memory"]) == ("H100:1", TRAINER_CPU, TRAINER_MEMORY_MB)
        assert [(c["cpu"], c["memory"]) for c in plane.history("produce")] == [(PRODUCER_CPU, PRODUCER_MEMORY_MB)] * 2


def test_a_campaign_that_fails_is_said_in_the_last_line_and_its_queue_and_dicts_are_deleted(
    seaweed, tmp_path, kernel_volume
):
    """The train call fails (after setup made the run's dict and queue): the campaign stops and
    keeps its state (for a resume); the first run deletes it, the atlas and any checkpoints, and
    says why it failed. (How a campaign stops when its producers keep failing, and resumes:
    tests/test_modal_campaign.py.)"""
    bucket = f"first-{os.urandom(4).hex()}"
    seaweed.client().create_bucket(Bucket=bucket)
    with control_plane(tmp_path, {SECRET: seaweed.settings}, kernel_volume) as plane:
        plane.fail("train", times=1)  # (train has no retries: its one attempt fails before its body runs)
        code, out, err = first_run(plane, seaweed.settings, bucket)
        assert code == 1, "\n".join(out[-30:]) + err[-3000:]
        assert out[-1] == "first run: FAILED: the campaign failed: RuntimeError: injected fault", out[-1]
        assert [c["status"] for c in plane.call_list("setup")] == ["success"]
        assert [c["status"] for c in plane.call_list("train")] == ["failure"]
        assert "deleted the run's queue and dicts" in out and any(line.startswith("deleted the atlas") for line in out)
        described = plane.describe()
        assert described["queues"] == [] and described["dicts"] == []
        assert objects_under(seaweed, bucket, "first/") == 0 and list(plane.volume_dir.iterdir()) == []


def test_a_missing_secret_is_one_line_and_nothing_is_made(seaweed, tmp_path):
    bucket = f"first-{os.urandom(4).hex()}"
    seaweed.client().create_bucket(Bucket=bucket)
    with control_plane(tmp_path, {}) as plane:
        code, out, err = first_run(plane, seaweed.settings, bucket, timeout=120)
        assert code == 1, err[-3000:]
        assert out[-1] == "first run: FAILED: 1 thing(s) missing (above); nothing was made or started"
        (line,) = [line for line in out if "cellfeed-s3" in line]
        assert line.startswith("the Modal Secret 'cellfeed-s3' is missing: run  modal secret create cellfeed-s3 ")
        assert seaweed.settings["AWS_SECRET_ACCESS_KEY"] not in "\n".join(out) + err
        assert objects_under(seaweed, bucket, "") == 0 and plane.describe()["calls"] == []


def test_the_readmes_cost_table_is_what_deploy_costs_computes():
    from app.costs import functions_per_hour

    text = (ROOT / "deploy" / "README.md").read_text()

    def figure(row: str) -> tuple[float, float]:
        """A row's $/hour as written, and the precision it is written to."""
        cell = re.search(rf"^\| {re.escape(row)} \|.*\| ([\d.]+) \|$", text, re.M)[1]
        return float(cell), 10.0 ** -len(cell.partition(".")[2])

    rate = functions_per_hour(8)
    expected = {"trainer": rate["train"], "one producer": rate["produce"], "16 producers": 16 * rate["produce"]}
    for row, value in expected.items():
        written, step = figure(row)
        assert abs(written - value) <= step / 2 + 1e-9, (row, written, value)
    total = re.search(r"campaign runs at about \$(\d+)/hour", text)[1]
    assert int(total) == round(rate["train"] + 16 * rate["produce"])
    assert "8 × H100" in text and "32 physical cores" in text and "128 GiB" in text
