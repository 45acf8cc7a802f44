"""Past one node, locally: `cellfeed local --nodes 2 --gpus 1` runs two nodes of one rank each, the
second's ranks meeting the first's at its address as a cluster's containers do (gloo), rank 0 of
node 0 driving the epochs. A campaign on 2 nodes trains every cell once per epoch; a node lost
mid-epoch (its ranks SIGKILLed) stops the campaign, which resumes on 1 node exactly once, from the
cell logs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from cellfeed_testing.procs import descendants, own_rank_server
from tests.conftest import wait_for
from tests.test_local_campaign import counts_atlas  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[1]


def flags(atlas, tmp_path: Path, *more: str) -> list[str]:
    return [
        "local", "--dataset", atlas.uri, "--workdir", str(tmp_path), "--run", "nodes", "--producers", "2",
        "--epochs", "2", "--batch-size", "16", "--max-genes", "24", "--checkpoint-every", "4", "--audit-cells",
        "--quiet", *more,
    ]  # fmt: skip


def cells(folder: Path, before: int | None = None) -> dict[int, Counter]:
    out: dict[int, Counter] = {}
    for log in folder.glob("cells.rank*.jsonl"):
        for row in map(json.loads, log.read_text().splitlines()):
            if before is None or row["step"] < before:
                out.setdefault(row["epoch"], Counter()).update(row["cells"])
    return out


def writes_to(pid: int) -> str:
    """Where the process's stdout goes (a rank other than 0 writes to WORKDIR/rank<r>.log)."""
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""


def test_two_nodes_train_an_epoch_once_and_a_node_lost_mid_epoch_resumes_on_one_node_exactly(
    counts_atlas,  # noqa: F811
    tmp_path,
):
    """Two nodes of one rank train epoch 0, every cell once (both nodes' cell logs); node 1 (rank 1)
    is then SIGKILLed in epoch 1, past a checkpoint: node 0's rank fails with it, the campaign stops
    non-zero, keeping its checkpoint; `--resume --nodes 1` finishes epoch 1, each cell once across
    both runs."""
    run = tmp_path / "nodes"
    # (own_rank_server: its ranks below it, where the test finds rank 1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", *flags(counts_atlas, tmp_path, "--nodes", "2", "--gpus", "1")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=own_rank_server(),
    )  # fmt: skip
    try:  # 19 steps an epoch (32 cells a step): past step 26 the checkpoint at step 24 is written in epoch 1
        steps = run / "steps.jsonl"
        wait_for(
            lambda: proc.poll() is not None or (steps.exists() and steps.read_text().count('"loss"') >= 26),
            "step 26",
            timeout=300,
        )
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        log = str(run / "rank1.log")
        (node1,) = [pid for pid in descendants(proc.pid) if writes_to(pid) == log]  # this campaign's own rank 1
        os.kill(node1, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0 and "the campaign failed: trainer ranks exited" in err, err[-2000:]
    assert f"rank 0's output is above; rank 1's in {run}/rank1.log" in err  # (where each rank's output is)
    assert "2 ranks (gloo, CPU; 2 nodes of 1)" in out
    assert sorted(p.name for p in run.glob("cells.rank*.jsonl")) == ["cells.rank0.jsonl", "cells.rank1.jsonl"]
    assert cells(run)[0] == Counter(range(600))  # epoch 0, on two nodes
    first = tmp_path / "first"
    first.mkdir()
    for log in run.glob("cells.rank*.jsonl"):
        shutil.copy(log, first / log.name)
    resumed = subprocess.run(
        [sys.executable, "-m", "app.cli", *flags(counts_atlas, tmp_path, "--nodes", "1", "--gpus", "1", "--resume")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    step = int(resumed.stdout.split("checkpoint at step ")[1].split(" ")[0].replace(",", ""))
    assert step >= 20 and resumed.stdout.strip().splitlines()[-1].startswith("complete: 2 epochs, 1,200 cells")
    before, after = cells(first, before=step), cells(run)
    assert [before.get(e, Counter()) + after.get(e, Counter()) for e in (0, 1)] == [Counter(range(600))] * 2
