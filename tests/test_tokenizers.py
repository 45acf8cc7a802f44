"""Every tokenizer against a straightforward per-cell NumPy implementation, token for token."""

from __future__ import annotations

import numpy as np
import pytest

from coordination.arrays import CellRows
from coordination.errors import CellfeedError
from coordination.vocab import CLS, EOS, GeneVocab
from producers.ranking import gene_order, rank_order, truncate
from producers.tokenizers import layout, make_tokenizer

VOCAB = GeneVocab.build([[f"G{g}" for g in range(3000)]])  # gene g -> token g + 4, as a one-dataset run's


def tokenizer(name, medians=None, **params):
    """A tokenizer over `VOCAB`, fed rows of raw gene ids shifted past the specials (a one-dataset
    run's lookup: gene g -> token g + 4); `medians` per gene, as `cellfeed stats` stores them."""
    per_token = None if medians is None else np.concatenate([np.ones(4), medians])
    tok = make_tokenizer(name, VOCAB, gene_medians=per_token, **params)
    return lambda rows, rng=None: tok(CellRows(rows.cell_ids, rows.offsets, rows.ids + np.uint16(4), rows.values), rng)


def random_cells(seed: int, n_cells: int = 60, n_genes: int = 3000, floats: bool = False) -> CellRows:
    """Cells with heavy ties (counts), some empty, some with one value, genes unsorted."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 400, size=n_cells)
    counts[:3] = [0, 1, 2]
    genes, values = [], []
    for c in counts:
        g = rng.choice(n_genes, size=c, replace=False)
        genes.append(g)
        if floats:
            values.append(np.round(rng.gamma(1.0, 2.0, size=c), 1).astype(np.float32) + np.float32(0.1))
        else:
            values.append(np.minimum(rng.geometric(0.4, size=c), 65535).astype(np.uint16))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return CellRows(
        np.arange(100, 100 + n_cells, dtype=np.int64),
        offsets,
        np.concatenate(genes).astype(np.uint16),
        np.concatenate(values),
    )


def per_cell(rows: CellRows):
    for i in range(rows.n_cells):
        lo, hi = rows.offsets[i], rows.offsets[i + 1]
        yield rows.ids[lo:hi].astype(np.int64), rows.values[lo:hi]


def tokens_of(tok, i):
    return tok.ids[tok.offsets[i] : tok.offsets[i + 1]].astype(np.int64)


def values_of(tok, i):
    return tok.values[tok.offsets[i] : tok.offsets[i + 1]]


def reference_bins(values: np.ndarray, n_bins: int) -> np.ndarray:
    """scGPT's binning with the deterministic midpoint for ties (np.quantile + np.digitize)."""
    edges = np.quantile(values, np.linspace(0, 1, n_bins - 1))
    left = np.digitize(values, edges)
    right = np.digitize(values, edges, right=True)
    return np.ceil((left + right) / 2).astype(np.int64)


@pytest.mark.parametrize("floats", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_genes", [1, 7, 64, 1024])
def test_scgpt_matches_reference(seed, max_genes, floats):
    rows = random_cells(seed, floats=floats)
    tok = tokenizer("scgpt", max_genes=max_genes, n_bins=51)(rows)
    np.testing.assert_array_equal(tok.cell_ids, rows.cell_ids)
    for i, (genes, values) in enumerate(per_cell(rows)):
        order = sorted(range(len(genes)), key=lambda j: (-float(values[j]), genes[j]))[:max_genes]
        expected_tokens = [CLS] + [int(genes[j]) + 4 for j in order]
        np.testing.assert_array_equal(tokens_of(tok, i), expected_tokens)
        bins = reference_bins(values, 51) if len(values) else np.zeros(0, dtype=np.int64)
        np.testing.assert_array_equal(values_of(tok, i), [0] + [int(bins[j]) for j in order])
        if len(values):
            assert 1 <= bins.min() and bins.max() <= 50


def test_scgpt_random_selection_is_a_seeded_subset_with_the_same_bins():
    rows = random_cells(5)
    tok = tokenizer("scgpt", max_genes=32, gene_selection="random")
    a, b = tok(rows, np.random.default_rng(1)), tok(rows, np.random.default_rng(1))
    c = tok(rows, np.random.default_rng(2))
    np.testing.assert_array_equal(a.ids, b.ids)
    assert not np.array_equal(a.ids, c.ids)
    for i, (genes, values) in enumerate(per_cell(rows)):
        got = tokens_of(a, i)
        assert got[0] == CLS and len(got) == 1 + min(32, len(genes))
        chosen = got[1:] - 4
        assert len(set(chosen)) == len(chosen) and set(chosen) <= set(genes.tolist())
        bins = reference_bins(values, 51) if len(values) else []
        by_gene = dict(zip(genes.tolist(), list(bins)))
        np.testing.assert_array_equal(values_of(a, i)[1:], [by_gene[g] for g in chosen])


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("max_genes", [1, 18, None])
@pytest.mark.parametrize("version", ["geneformer-v1", "geneformer-v2"])
def test_geneformer_matches_reference(seed, max_genes, version):
    rows = random_cells(seed)
    medians = np.random.default_rng(seed).uniform(0.5, 4.0, size=3000)
    medians[::7] = np.round(medians[::7])  # ties in the normalised value
    tok = tokenizer(version, medians, max_genes=max_genes)(rows)
    n = max_genes or {"geneformer-v1": 2048, "geneformer-v2": 4094}[version]
    for i, (genes, values) in enumerate(per_cell(rows)):
        total = float(values.astype(np.float64).sum())
        norm = values.astype(np.float64) / total * 10_000.0 / medians[genes]
        order = sorted(range(len(genes)), key=lambda j: (-norm[j], genes[j]))[:n]
        ranked = [int(genes[j]) + 4 for j in order]
        expected = ranked if version == "geneformer-v1" else [CLS] + ranked + [EOS]
        np.testing.assert_array_equal(tokens_of(tok, i), expected)  # an empty cell: [] (v1) or [CLS, EOS] (v2)
        assert len(expected) <= layout(version).sequence_length(n)
    assert tok.values is None


def test_geneformer_alias_is_v2():
    rows = random_cells(1)
    medians = np.ones(3000)
    a = tokenizer("geneformer", medians)(rows)
    b = tokenizer("geneformer-v2", medians)(rows)
    np.testing.assert_array_equal(a.ids, b.ids)


@pytest.mark.parametrize("as_stored", [False, True])
@pytest.mark.parametrize("floats", [False, True])
def test_raw_matches_reference(floats, as_stored):
    rows = random_cells(4, floats=floats)
    if as_stored:  # each cell's genes ascending, as read from storage (the path that sorts nothing)
        order = np.lexsort((rows.ids, rows.cell_of_row()))
        offsets = rows.offsets.copy()
        offsets[-2:] = offsets[-3]  # and two empty cells at the end (the first is empty too)
        order = order[: offsets[-1]]
        rows = CellRows(rows.cell_ids, offsets, rows.ids[order], rows.values[order])
        assert rows.counts[0] == 0 and gene_order(rows) is rows
    tok = tokenizer("raw", max_genes=50)(rows)
    for i, (genes, values) in enumerate(per_cell(rows)):
        order = np.argsort(genes, kind="stable")[:50]
        np.testing.assert_array_equal(tokens_of(tok, i), genes[order] + 4)
        np.testing.assert_array_equal(values_of(tok, i), values[order].astype(np.float32))


@pytest.mark.parametrize("floats", [False, True])
def test_rank_order_fast_path_equals_general_path(floats):
    rows = random_cells(9, floats=floats)
    if floats:  # and exact float ties, as log-normalised values have
        rows.values[::5] = (
            rows.values[1::5][: len(rows.values[::5])]
            if len(rows.values[1::5]) >= len(rows.values[::5])
            else rows.values[::5]
        )
    fast = rank_order(rows)
    general = rank_order(rows, score=rows.values.astype(np.float64))
    np.testing.assert_array_equal(fast.ids, general.ids)
    np.testing.assert_array_equal(fast.values, general.values)
    top = truncate(fast, 5)
    assert top.counts.max() == 5 and np.array_equal(top.counts, np.minimum(rows.counts, 5))


@pytest.mark.parametrize("offset", [60_000, 200_000, 1 << 30])  # 17, 18 bits, and too wide to pack
def test_rank_order_with_token_ids_past_16_bits_equals_lexsort(offset):
    """A union vocabulary passes 65,536 tokens: the packed keys widen their gene field (or fall
    back to the lexsort) and still order exactly by (value or score descending, token ascending)."""
    rows = random_cells(3)
    wide = CellRows(rows.cell_ids, rows.offsets, rows.ids.astype(np.int64) + offset, rows.values)
    cell = wide.cell_of_row()
    for score in (None, np.random.default_rng(1).choice([0.5, 1.0, 2.0], size=len(wide.ids))):
        primary = wide.values.astype(np.float64) if score is None else score
        expected = np.lexsort((wide.ids, -primary, cell))
        ranked = rank_order(wide, score=score)
        np.testing.assert_array_equal(ranked.ids, wide.ids[expected])
        np.testing.assert_array_equal(ranked.values, wide.values[expected])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rank_by_score_equals_lexsort_with_exact_and_one_ulp_ties(seed):
    """The packed-key ranking (a truncated score in the key) equals a plain lexsort, also when
    scores tie exactly, differ in the last bit only, or span many orders of magnitude."""
    rows = random_cells(seed, n_cells=300)
    rng = np.random.default_rng(seed)
    base = rng.choice([0.0, 1.0, 1.5, 3.0, 1e-7, 2.5e6], size=len(rows.ids))
    ulps = rng.integers(-2, 3, size=len(rows.ids))
    score = np.array(
        [
            np.nextafter(b, np.inf) if u > 0 else np.nextafter(b, -np.inf) if u < 0 and b > 0 else b
            for b, u in zip(base, ulps)
        ]
    )
    score[::7] = rng.random(len(score[::7])) * 10.0 ** rng.integers(-5, 6, size=len(score[::7]))
    for s in (score, np.abs(score)):
        cell = rows.cell_of_row()
        expected = np.lexsort((rows.ids, -s, cell))
        ranked = rank_order(rows, score=s)
        np.testing.assert_array_equal(ranked.ids, rows.ids[expected])
        np.testing.assert_array_equal(ranked.values, rows.values[expected])


def test_bad_tokenizer_settings_fail_before_work():
    small = GeneVocab.build([[f"G{g}" for g in range(10)]])
    with pytest.raises(CellfeedError, match="unknown tokenizer"):
        make_tokenizer("bert", small)
    with pytest.raises(CellfeedError, match="max_genes must be >= 1"):
        make_tokenizer("scgpt", small, max_genes=0)
    with pytest.raises(CellfeedError, match="needs integer counts.*--tokenizer scgpt"):
        make_tokenizer("geneformer", small, values_are_counts=False, gene_medians=np.ones(small.size))
    with pytest.raises(CellfeedError, match="cellfeed stats"):
        make_tokenizer("geneformer", small)
    with pytest.raises(CellfeedError, match="gene_selection"):
        make_tokenizer("scgpt", small, gene_selection="best")
