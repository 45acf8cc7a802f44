"""Shuffle-quality scores against brute force and simulation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cellfeed_testing.sampling_quality import block_entropy_bounds, entropy_bits, index_score, mean_pair_distance


def test_mean_pair_distance_equals_brute_force():
    rng = np.random.default_rng(0)
    for m in (1, 2, 3, 17, 64):
        ids = rng.integers(0, 10_000, size=m)
        pairs = [abs(int(a) - int(b)) for a, b in itertools.combinations(ids.tolist(), 2)]
        assert mean_pair_distance(ids) == pytest.approx(np.mean(pairs) if pairs else 0.0)


def test_index_score_is_zero_for_consecutive_and_one_for_uniform_ids():
    n, m = 200_000, 64
    assert index_score(np.arange(5000, 5000 + m), n) == pytest.approx(0.0, abs=1e-12)
    rng = np.random.default_rng(1)
    scores = [index_score(rng.choice(n, size=m, replace=False), n) for _ in range(3000)]
    assert np.mean(scores) == pytest.approx(1.0, abs=0.01)
    with pytest.raises(ValueError, match="cannot be scored"):
        index_score(np.arange(10), 10)


def test_entropy_and_the_block_bounds_hold_in_simulation():
    assert entropy_bits(np.array([1, 1, 2, 2])) == pytest.approx(1.0)
    assert entropy_bits(np.array([5] * 9)) == 0.0
    k, per_label, m = 14, 2000, 64
    labels = np.repeat(np.arange(k), per_label)  # stored in label order, as plates are
    rng = np.random.default_rng(2)
    measured = []
    for b in (1, 4, 16):
        lower, upper = block_entropy_bounds(np.full(k, per_label), b, m)
        assert lower <= upper and (b > 1 or lower == upper)
        blocks = len(labels) // b
        means = []
        for _ in range(4000):  # a batch: m/b blocks of b consecutive cells from random places
            starts = rng.choice(blocks, size=m // b, replace=False) * b
            means.append(entropy_bits(labels[(starts[:, None] + np.arange(b)).ravel()]))
        measured.append(float(np.mean(means)))
        assert measured[-1] <= upper + 0.02, (b, measured[-1], upper)
        if b == 1:  # m >> K: the bias term is accurate
            assert measured[-1] == pytest.approx(lower, abs=0.03)
    assert measured == sorted(measured, reverse=True)  # bigger blocks, less mixed batches
