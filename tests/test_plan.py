"""Epoch plans and the Feistel permutation: bijections, exact coverage, reproducibility."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordination.errors import CellfeedError
from coordination.feistel import FeistelPermutation
from coordination.plan import DatasetGeometry, EpochPlan, Sampling

PRIMES = [5, 7, 13, 97, 1009, 65_537, 999_983]


def sizes_to_check():
    sizes = {1, 2, 3, 10**6} | set(PRIMES)
    for k in range(1, 21):
        sizes |= {2**k - 1, 2**k, 2**k + 1}
    return sorted(s for s in sizes if s <= 10**6)


@pytest.mark.parametrize("n", sizes_to_check())
def test_feistel_is_a_bijection_exhaustively(n):
    perm = FeistelPermutation(n, key=12345)
    out = perm(np.arange(n))
    assert out.min() >= 0 and out.max() < n
    assert len(np.unique(out)) == n


@settings(max_examples=25, deadline=None)
@given(n=st.integers(min_value=10**6 + 1, max_value=10**12), key=st.integers(0, 2**63))
def test_feistel_is_injective_on_samples_beyond_a_million(n, key):
    perm = FeistelPermutation(n, key)
    sample = np.unique(np.random.default_rng(key % 2**32).integers(0, n, size=20_000))
    out = perm(sample)
    assert out.max() < n and len(np.unique(out)) == len(sample)


def test_feistel_depends_on_key_and_is_not_identity():
    a, b = FeistelPermutation(1000, 1)(np.arange(1000)), FeistelPermutation(1000, 2)(np.arange(1000))
    assert not np.array_equal(a, b) and (a == np.arange(1000)).mean() < 0.05


def synthetic_geometry(seed: int, n_cells: int, rows_per_fragment: int, empty_every: int = 0) -> DatasetGeometry:
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 40, size=n_cells)
    if empty_every:
        counts[::empty_every] = 0
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    n_rows = int(starts[-1])
    frags = np.unique(np.concatenate([np.arange(0, n_rows, rows_per_fragment), [n_rows]])).astype(np.int64)
    return DatasetGeometry(f"synthetic-{seed}", starts, frags)


def check_exact_coverage(plan: EpochPlan) -> None:
    """Every selected cell is emitted by exactly one unit or is exactly one boundary cell whose
    pieces (0..P-1) are each held by exactly one unit and cover its rows."""
    starts = plan.geometry.cell_row_start
    emitted, pieces = [], {}
    rows_read = []
    for unit in plan.units():
        (part,) = unit.parts  # a one-dataset plan: one part, source 0
        assert part.source == 0
        emitted.append(part.cells)
        for c, i, p in zip(unit.pieces.tolist(), unit.piece_index.tolist(), unit.piece_count.tolist()):
            pieces.setdefault(c, []).append((i, p))
        rows_read.append(part.ranges)
        for a, b in part.ranges:  # units read only rows of their cells
            assert a < b
        # every whole cell's rows are inside the unit's ranges
        for c in part.cells[:50]:
            lo, hi = starts[c], starts[c + 1]
            assert lo == hi or np.any((part.ranges[:, 0] <= lo) & (part.ranges[:, 1] >= hi))
    emitted = np.concatenate(emitted)
    assert len(emitted) == len(np.unique(emitted))
    assert set(emitted.tolist()).isdisjoint(pieces)
    np.testing.assert_array_equal(
        np.sort(np.concatenate([emitted, np.array(sorted(pieces), dtype=np.int64)])), plan.selected
    )
    for c, held in pieces.items():
        count = held[0][1]
        assert sorted(i for i, _ in held) == list(range(count)) and all(p == count for _, p in held)
    # piece row ranges tile each boundary cell's rows and lie inside their unit's ranges
    tiles = {}
    for unit in plan.units():
        for c, i, (a, b) in zip(unit.pieces.tolist(), unit.piece_index.tolist(), unit.piece_rows.tolist()):
            tiles.setdefault(c, []).append((i, a, b))
            assert np.any((unit.parts[0].ranges[:, 0] <= a) & (unit.parts[0].ranges[:, 1] >= b))
    for c, parts in tiles.items():
        parts.sort()
        assert parts[0][1] == starts[c] and parts[-1][2] == starts[c + 1]
        assert all(parts[k][2] == parts[k + 1][1] for k in range(len(parts) - 1))
    np.testing.assert_array_equal(np.sort(plan.boundary_cells), np.array(sorted(pieces), dtype=np.int64))
    # no row read twice
    ranges = np.concatenate(rows_read)
    ranges = ranges[np.argsort(ranges[:, 0])]
    assert np.all(ranges[1:, 0] >= ranges[:-1, 1])
    assert plan.cells_per_rank(3).sum() == plan.n_cells


STRATEGY_PARAMS = [
    Sampling("sequential", unit_cells=50),
    Sampling("mixture", unit_cells=30, n_scanners=3),
    Sampling("block", block_size=8, fetch_factor=2, batch_size=16),
    Sampling("random", fetch_factor=3, batch_size=10),
]


@pytest.mark.parametrize("sampling", STRATEGY_PARAMS, ids=lambda s: s.strategy)
@pytest.mark.parametrize("rows_per_fragment", [7, 100, 1000, 10**9])
def test_every_cell_exactly_once(sampling, rows_per_fragment):
    geometry = synthetic_geometry(1, 700, rows_per_fragment, empty_every=50)
    plan = EpochPlan(geometry, sampling, seed=3, epoch=0)
    check_exact_coverage(plan)
    if sampling.strategy in ("sequential", "mixture") and rows_per_fragment < 10**9:
        assert len(plan.boundary_cells) > 0
        if rows_per_fragment == 7:  # cells longer than a fragment have 3+ pieces
            assert plan.boundary_piece_counts.max() >= 3


@pytest.mark.parametrize("sampling", STRATEGY_PARAMS, ids=lambda s: s.strategy)
def test_subset_is_covered_exactly(sampling):
    geometry = synthetic_geometry(2, 500, 120)
    subset = np.random.default_rng(0).choice(500, size=173, replace=False)
    plan = EpochPlan(geometry, sampling, seed=3, epoch=1, subset=subset)
    assert plan.n_cells == 173
    check_exact_coverage(plan)


def unit_signature(plan):
    return [(u.parts[0].cells.tolist(), u.parts[0].ranges.tolist(), u.pieces.tolist()) for u in plan.units()]


@pytest.mark.parametrize("sampling", STRATEGY_PARAMS[1:], ids=lambda s: s.strategy)
def test_same_seed_same_plan_other_epoch_other_order(sampling):
    geometry = synthetic_geometry(3, 600, 150)
    a = EpochPlan(geometry, sampling, seed=9, epoch=0)
    b = EpochPlan(geometry, sampling, seed=9, epoch=0)
    c = EpochPlan(geometry, sampling, seed=9, epoch=1)
    assert unit_signature(a) == unit_signature(b) and a.plan_id == b.plan_id
    assert unit_signature(a) != unit_signature(c) and a.plan_id != c.plan_id


def test_block_units_hold_fetch_factor_batches_of_sorted_blocks():
    geometry = synthetic_geometry(4, 1000, 300)
    plan = EpochPlan(
        geometry, Sampling("block", block_size=10, fetch_factor=4, batch_size=20, min_units=1), seed=1, epoch=0
    )
    cells = plan.unit(0).parts[0].cells
    assert len(cells) == 80 and np.all(np.diff(cells) > 0)  # 8 blocks of 10, sorted
    blocks = np.unique(cells // 10)
    assert len(blocks) == 8 and not np.array_equal(blocks, np.arange(8))


def test_bad_sampling_fails_before_work():
    geometry = synthetic_geometry(5, 10, 100)
    with pytest.raises(CellfeedError, match="unknown strategy"):
        EpochPlan(geometry, Sampling("shuffle"), 0, 0)
    for field in ("block_size", "fetch_factor", "n_scanners", "unit_cells"):
        with pytest.raises(CellfeedError, match=f"{field} must be >= 1"):
            EpochPlan(geometry, Sampling("block", **{field: 0}), 0, 0)
    with pytest.raises(CellfeedError, match="selects no cells"):
        EpochPlan(geometry, Sampling(), 0, 0, subset=np.array([], dtype=np.int64))


@pytest.mark.parametrize("strategy", ["block", "random", "sequential", "mixture"])
@pytest.mark.parametrize("n_cells, min_units", [(700, 64), (700, 2), (5, 64), (100_000, 64)])
def test_small_datasets_get_enough_units_for_every_producer_and_rank(strategy, n_cells, min_units):
    geometry = synthetic_geometry(3, n_cells, 2000)
    sampling = Sampling(strategy, batch_size=32, min_units=min_units)
    plan = EpochPlan(geometry, sampling, seed=0, epoch=0)
    big = EpochPlan(geometry, Sampling(strategy, batch_size=32, min_units=1), seed=0, epoch=0)
    assert plan.n_units >= min(min_units, n_cells)
    assert plan.n_units >= big.n_units  # units only get smaller
    assert (plan.cells_per_rank(2) > 0).all() or n_cells < 2
    cells = np.concatenate([u.parts[0].cells for u in plan.units()] + [plan.boundary_cells])
    np.testing.assert_array_equal(np.sort(cells), np.arange(n_cells))  # still every cell exactly once


@pytest.mark.parametrize("strategy", ["block", "random", "sequential", "mixture"])
@pytest.mark.parametrize("subset", [False, True])
def test_expected_cell_hash_per_rank_equals_the_units_cells(strategy, subset, monkeypatch):
    """The per-rank hash the trainer checks an epoch against (computed from ranges of the
    selection, streaming) equals the hash of the cells each rank's units and stitched cells
    actually hold; a lost or an extra cell changes it."""
    import coordination.plan as plan_module
    from coordination.audit import cells_hash

    monkeypatch.setattr(plan_module, "HASH_CHUNK", 97)  # many streaming chunks
    geometry = synthetic_geometry(7, 3000, 900, empty_every=11)  # straddlers and empty cells
    chosen = np.flatnonzero(np.random.default_rng(1).random(3000) < 0.6) if subset else None
    plan = EpochPlan(
        geometry,
        Sampling(strategy, unit_cells=40, n_scanners=3, block_size=8, fetch_factor=3, batch_size=16, min_units=1),
        seed=2,
        epoch=1,
        subset=chosen,
    )
    for world in (1, 3):
        by_rank = [[] for _ in range(world)]
        for u in plan.units():
            by_rank[u.id % world].append(u.parts[0].cells)
        for c in plan.boundary_cells.tolist():
            by_rank[c % world].append(np.array([c]))
        expected = [cells_hash(np.concatenate(parts)) for parts in by_rank]
        assert plan.cell_hash_per_rank(world) == expected
    everything = np.concatenate([u.parts[0].cells for u in plan.units()] + [plan.boundary_cells])
    assert cells_hash(everything) == plan.cell_hash_per_rank(1)[0]
    holders: dict[int, list[int]] = {}  # the units holding each boundary cell's pieces (what a resume keeps)
    for u in plan.units():
        for c in u.pieces.tolist():
            holders.setdefault(c, []).append(u.id)
    at = 0
    for c, k in zip(plan.boundary_cells.tolist(), plan.boundary_piece_counts.tolist()):
        assert sorted(plan.boundary_piece_units[at : at + k].tolist()) == sorted(holders.pop(c))
        at += k
    assert not holders and at == len(plan.boundary_piece_units)
    assert cells_hash(everything[1:]) != cells_hash(everything)  # one lost
    assert cells_hash(np.concatenate([everything[1:], everything[2:3]])) != cells_hash(everything)  # lost + duplicated
