"""Chaos on a real local campaign: producers SIGKILLed and SIGSTOPped past their lease, the
trainer paused (queue full, producers on backpressure), all ranks killed and resumed
(tests/test_trainer.py), a unit produced twice at once (tests/test_producer.py). Each time every
epoch trains exactly the training set: 0 lost, 0 duplicated, and the run finishes by itself."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from benchmarks.chaos import Fault, lost_and_duplicated, run_campaign, trained_per_epoch
from coordination.driver import LEASE_S
from producers.synth import SynthSpec, synthesize


@pytest.fixture(scope="module")
def chaos_atlas(tmp_path_factory):
    path = tmp_path_factory.mktemp("chaos") / "atlas"
    synthesize(str(path), SynthSpec(n_cells=1500, n_genes=2000, n_plates=3, seed=2), rows_per_fragment=30_000,
               progress=False)
    return str(path), 1500


def test_producers_killed_and_stalled_and_trainer_paused_lose_and_duplicate_nothing(chaos_atlas, tmp_path):
    dataset, n_cells = chaos_atlas
    stall = LEASE_S + 4  # past the lease: the unit is re-issued, the stalled producer later sends duplicates
    # at training steps (of 235: 5 epochs of 47), whatever the machine's speed: four in epoch 0, one in epoch 4,
    # long after the stall and the pause ended (the ranks log no step while paused)
    faults = [Fault(2, "kill"), Fault(8, "stall", stall), Fault(12, "kill"), Fault(20, "pause", stall),
              Fault(200, "kill")]
    # at Modal's 25 ms a call production spans the campaign, so the faults hit producers mid-unit
    out = run_campaign(dataset, tmp_path, "chaos", epochs=5, producers=3, faults=faults, timeout_s=420,
                       extra=["--rpc-latency-ms", "25"])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert [kind for _, kind, _ in sorted(out.faults)] == ["kill", "stall", "kill", "pause", "kill"], out.faults
    checked, lost, duplicated = lost_and_duplicated(trained_per_epoch(tmp_path / "chaos"), Counter(range(n_cells)), 5)
    assert (checked, lost, duplicated) == (5 * n_cells, 0, 0)
    assert out.stdout.count("restarting it") >= 3  # each killed producer came back
    summary = json.loads((tmp_path / "chaos" / "summary.rank0").read_text())
    assert summary["units_reissued"] >= 1  # units lost with their producers were produced again
    assert out.stdout.count("cells trained, 0 missing, 0 duplicated (of 1,500 planned") == 5  # each epoch audited
    assert "exactly-once audit: 5 of 5 complete epochs checked, 7,500 cells trained, 0 missing, 0 duplicated" \
        in out.stdout


def test_a_stitching_piece_deleted_from_the_map_fails_the_cell_with_one_line():
    """A piece lost from the map cannot be made up by the last holder: it stops with one line (the
    local campaign then stops on it, keeping its checkpoint), and a resume drops the epoch's map and
    produces every unit holding a piece of an untrained boundary cell again
    (test_trainer: test_sigkill_mid_epoch_then_resume_trains_every_cell_once[sequential])."""
    import numpy as np

    from coordination.errors import CellfeedError
    from coordination.queues import MemoryMap
    from producers.stitch import offer_piece, piece_key

    store = MemoryMap()
    genes, values = np.array([3, 9], dtype=np.uint16), np.array([1, 2], dtype=np.uint16)
    assert offer_piece(store, 0, "7.1", 42, 0, 2, genes, values) is None  # the first holder waits
    store.pop(piece_key(42, 0))  # the piece is lost
    with pytest.raises(CellfeedError, match=r"^cell 42 of epoch 0: pieces \[0\] missing at the last arrival$"):
        offer_piece(store, 0, "8.0", 42, 1, 2, genes, values)
