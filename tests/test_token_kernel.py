"""The compiled token pass (`producers/token_kernel.py`) against the vectorised path it replaced
(`producers/ranking.py`: a tokenizer with `kernel = False`), token for token, over random ragged
inputs: empty cells, heavy ties, values 0 and 65,535, cells longer and shorter than `max_genes`,
genes outside the vocabulary, gene -> token maps that are not monotone, tokens past 65,536 (a
union vocabulary), gene ids stored as int32, float values, and the inputs the kernel hands back
(negative floats, -0.0, NaN). `tests/test_tokenizers.py` checks both paths'
tokens against an independent per-cell computation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordination.arrays import CellRows
from coordination.errors import CellfeedError
from coordination.vocab import OUTSIDE_16, GeneVocab
from producers.token_kernel import kernel_tokens
from producers.tokenizers import make_tokenizer

N_GENES = 700
SMALL = GeneVocab.build([[f"G{g}" for g in range(N_GENES)]])
LARGE = GeneVocab.build([[f"G{g}" for g in range(70_000)]])  # a union vocabulary: int32 lookups, uint32 tokens


def ragged(rng: np.random.Generator, n_cells: int, longest: int, floats: bool, spread: int) -> CellRows:
    """Cells of 0..longest rows (the first few empty or of one row), genes in stored (ascending)
    order, counts with many ties (`spread`: how far they reach) or positive floats."""
    counts = rng.integers(0, longest + 1, size=n_cells)
    counts[: min(2, n_cells)] = [0, 1][: min(2, n_cells)]
    genes = [np.sort(rng.choice(N_GENES, size=c, replace=False)) for c in counts]
    if floats:
        values = np.round(rng.gamma(1.0, 2.0, size=counts.sum()), 1).astype(np.float32) + np.float32(0.1)
    else:
        values = np.minimum(rng.geometric(1.0 / spread, size=counts.sum()), 65535).astype(np.uint16)
        values[rng.random(len(values)) < 0.02] = 65535  # the largest count, and explicit zeros
        values[rng.random(len(values)) < 0.01] = 0
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    ids = np.concatenate(genes).astype(np.uint16) if n_cells else np.zeros(0, np.uint16)
    return CellRows(np.arange(n_cells, dtype=np.int64) * 7 + 3, offsets, ids, values)


def lookup_of(rng: np.random.Generator, kind: str, vocab: GeneVocab) -> np.ndarray | None:
    """None (genes are tokens), the dataset's own order, or shuffled with a tenth outside. In the
    large vocabulary the genes are its last ones: tokens past 65,536."""
    if kind == "none":
        return None
    first = 69_000 if vocab is LARGE else 0
    names = [f"G{first + g}" for g in (range(N_GENES) if kind == "ordered" else rng.permutation(N_GENES))]
    lookup = vocab.lookup_array(names)
    if kind == "shuffled":
        lookup[rng.choice(N_GENES, size=N_GENES // 10, replace=False)] = OUTSIDE_16 if lookup.dtype == np.uint16 else -1
    return lookup


def both_paths(name: str, vocab: GeneVocab, rng: np.random.Generator, **params):
    medians = None
    if name.startswith("geneformer"):
        medians = rng.random(vocab.size) * 3
        medians[rng.choice(vocab.size, size=vocab.size // 20)] = 0.0  # no median: taken as 1
    kernel = make_tokenizer(name, vocab, gene_medians=medians, **params)
    vectorised = make_tokenizer(name, vocab, gene_medians=medians, **params)
    vectorised.kernel = False
    return kernel, vectorised


def assert_same(a: CellRows, b: CellRows) -> None:
    assert np.array_equal(a.cell_ids, b.cell_ids)
    assert np.array_equal(a.offsets, b.offsets)
    assert a.ids.dtype == b.ids.dtype and np.array_equal(a.ids, b.ids)
    assert (a.values is None) == (b.values is None)
    if a.values is not None:
        assert a.values.dtype == b.values.dtype and np.array_equal(a.values, b.values)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    name=st.sampled_from(["scgpt", "geneformer-v1", "geneformer-v2", "raw"]),
    n_cells=st.integers(0, 40),
    longest=st.sampled_from([1, 5, 60, 400]),
    max_genes=st.sampled_from([1, 3, 50, 500]),
    floats=st.booleans(),
    spread=st.sampled_from([2, 40, 5000]),
    lookup=st.sampled_from(["none", "ordered", "shuffled"]),
    large_vocab=st.booleans(),
    some_cells=st.booleans(),
    int32_ids=st.booleans(),
)
def test_kernel_equals_the_vectorised_path(
    seed, name, n_cells, longest, max_genes, floats, spread, lookup, large_vocab, some_cells, int32_ids
):
    """`some_cells`: a shuffled subset of the cells, as a producer's chunk takes them; `int32_ids`:
    gene ids as a dataset of more than 65,535 genes stores them."""
    rng = np.random.default_rng(seed)
    floats = floats and not name.startswith("geneformer")  # (Geneformer needs counts)
    vocab = LARGE if large_vocab else SMALL
    rows = ragged(rng, n_cells, longest, floats, spread)
    table = lookup_of(rng, lookup, vocab)
    if table is None:
        rows = CellRows(rows.cell_ids, rows.offsets, rows.ids + np.uint16(4), rows.values)  # past the specials
    if int32_ids:
        rows = CellRows(rows.cell_ids, rows.offsets, rows.ids.astype(np.int32), rows.values)
    kernel, vectorised = both_paths(name, vocab, rng, max_genes=max_genes)
    cells = rng.permutation(n_cells)[: rng.integers(0, n_cells + 1)] if some_cells else None
    assert_same(kernel(rows, None, table, cells=cells), vectorised(rows, None, table, cells=cells))


@pytest.mark.parametrize("n_bins", [3, 51, 300])
@pytest.mark.parametrize("selection", ["top", "random"])
def test_scgpt_bins_and_random_selection_equal_the_vectorised_path(n_bins, selection):
    """Bins of every width (uint16 past 256), and the random subset drawn from the same ranked rows."""
    rng = np.random.default_rng(n_bins)
    rows = ragged(rng, 50, 650, floats=False, spread=300)
    table = lookup_of(rng, "shuffled", SMALL)
    kernel, vectorised = both_paths("scgpt", SMALL, rng, max_genes=200, n_bins=n_bins, gene_selection=selection)
    assert_same(kernel(rows, np.random.default_rng(5), table), vectorised(rows, np.random.default_rng(5), table))


def test_rows_mapped_already_keep_their_totals():
    """Rows a caller mapped itself (`to_tokens`, with `totals` of the genes it dropped): Geneformer
    still divides by each cell's whole total."""
    from producers.ranking import to_tokens

    rng = np.random.default_rng(3)
    rows = ragged(rng, 30, 300, floats=False, spread=20)
    mapped = to_tokens(rows, lookup_of(rng, "shuffled", SMALL))
    assert mapped.totals is not None
    kernel, vectorised = both_paths("geneformer", SMALL, rng, max_genes=100)
    assert_same(kernel(mapped), vectorised(mapped))


def test_negative_floats_are_handed_back_to_the_vectorised_path():
    """The kernel orders non-negative floats by their bits; negative values (an --allow-negative
    dataset) go to the vectorised path's lexsort, with the same result."""
    rng = np.random.default_rng(4)
    rows = ragged(rng, 20, 100, floats=True, spread=2)
    rows.values[::3] *= np.float32(-1)
    assert kernel_tokens(rows, None, mode="scgpt", max_genes=10, token_dtype=np.uint16) is None
    kernel, vectorised = both_paths("scgpt", SMALL, rng, max_genes=10)
    assert_same(kernel(rows), vectorised(rows))
    for odd in (np.float32(-0.0), np.float32(np.nan)):
        rows = ragged(rng, 5, 50, floats=True, spread=2)
        rows.values[7] = odd
        assert kernel_tokens(rows, None, mode="scgpt", max_genes=10, token_dtype=np.uint16) is None


def test_a_gene_past_the_lookup_is_refused_in_one_line():
    """numba does not check bounds: a gene id the lookup does not cover (rows of another dataset)
    is refused, not read from past the array."""
    rng = np.random.default_rng(5)
    rows = ragged(rng, 10, 50, floats=False, spread=5)
    short = lookup_of(rng, "ordered", SMALL)[: N_GENES // 2]
    with pytest.raises(CellfeedError, match="past the vocabulary's lookup"):
        kernel_tokens(rows, short, mode="scgpt", max_genes=10, token_dtype=np.uint16)


def test_geneformer_scores_an_ulp_apart_and_equal_rank_exactly():
    """The kernel sorts Geneformer's scores by their top 31 bits, then orders the rows that cut
    makes equal by the exact score: medians one ulp apart, 2**30 to 2**32 ulps apart (about where the cut
    falls: equal after it or not), and equal ones (ties: lower token)."""
    rng = np.random.default_rng(8)
    rows = ragged(rng, 40, 300, floats=False, spread=3)  # counts 1..~10: many equal
    base = np.float64(1.7)
    near = np.array([base, np.nextafter(base, 2), np.nextafter(np.nextafter(base, 2), 2), base * 2])
    near = np.concatenate([near, base * (1 + np.array([2.0**-22, 2.0**-21, 2.0**-20]))])
    medians = near[rng.integers(0, len(near), size=SMALL.size)]
    kernel = make_tokenizer("geneformer-v1", SMALL, gene_medians=medians, max_genes=100)
    vectorised = make_tokenizer("geneformer-v1", SMALL, gene_medians=medians, max_genes=100)
    vectorised.kernel = False
    table = lookup_of(rng, "shuffled", SMALL)
    assert_same(kernel(rows, None, table), vectorised(rows, None, table))


KERNEL = """
import numba

@numba.njit(cache=True)
def f(x):
    return x + {add}
"""
LOAD = """
import json, sys
from producers.kernel_cache import cache_kernels_in
assert cache_kernels_in(*sys.argv[1:])
import kernel
stats = kernel.f.stats
print(json.dumps({"value": kernel.f(1), "hits": len(stats.cache_hits), "misses": len(stats.cache_misses)}))
"""


def load_kernel(copy: Path, add: int, *cache_args) -> dict:
    """Run KERNEL (returning x + `add`) from a copy of its code at `copy`, cached as `cache_kernels_in(*cache_args)`
    says, in a fresh process: its value and numba's cache hits and misses."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    folder = copy / "kernels"  # (the same folder name in every copy, as /root/producers)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernel.py").write_text(KERNEL.format(add=add))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{folder}{':'}{root}"}
    out = subprocess.run([sys.executable, "-c", LOAD, *map(str, cache_args)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_a_kernel_compiled_by_one_copy_of_the_code_is_loaded_by_another(tmp_path):
    """producers/kernel_cache.py: a Modal container gets the code at a path of its own, and so does
    each of the test world's; a kernel compiled by one copy is loaded by another (a hit, no compile)
    and a changed source is compiled again (numba's content stamp), never loaded."""
    cache = tmp_path / "cache"
    cache.mkdir()

    def run(copy: str, add: int) -> dict:
        return load_kernel(tmp_path / copy, add, cache)

    assert run("a", 1) == {"value": 2, "hits": 0, "misses": 1}  # compiled, into the shared folder
    assert run("b", 1) == {"value": 2, "hits": 1, "misses": 0}  # another copy: loaded
    assert run("c", 2) == {"value": 3, "hits": 0, "misses": 1}  # a changed source: compiled again
    assert sorted(p.name for p in cache.iterdir()) == ["kernels"]  # one folder, not one per copy


def test_a_new_runs_folder_starts_as_a_copy_of_the_last_whole_one_and_loads_it(tmp_path):
    """producers/kernel_cache.py: `_seed`: a Volume's first campaign compiles the pass and its setup marks
    the folder seedable; a later run's folder starts as a copy of the newest marked one, so its setup loads
    it (a hit, no compile). A folder compiled into after its mark (a producer's variant: its index may sit
    beside another's code) is not copied; a changed source compiles again, in its run's folder only."""
    from producers.kernel_cache import mark_seedable

    volume = tmp_path / "volume"
    volume.mkdir()
    files = lambda run: sorted(p.name for p in (volume / run / "kernels").iterdir())  # noqa: E731
    assert load_kernel(tmp_path / "a", 1, volume, "run-a") == {"value": 2, "hits": 0, "misses": 1}
    mark_seedable(str(volume), "run-a")
    assert load_kernel(tmp_path / "b", 1, volume, "run-b") == {"value": 2, "hits": 1, "misses": 0}
    assert files("run-b") == files("run-a") and not (volume / "run-b" / ".seedable").exists()
    assert load_kernel(tmp_path / "c", 2, volume, "run-c") == {"value": 3, "hits": 0, "misses": 1}
    mark_seedable(str(volume), "run-c")
    assert files("run-a") == files("run-b")  # (run-c compiled in its own folder alone)
    assert load_kernel(tmp_path / "d", 2, volume, "run-d") == {"value": 3, "hits": 1, "misses": 0}  # run-c's
    assert load_kernel(tmp_path / "c", 5, volume, "run-c") == {"value": 6, "hits": 0, "misses": 1}  # after its mark
    assert load_kernel(tmp_path / "e", 1, volume, "run-e") == {"value": 2, "hits": 1, "misses": 0}  # run-a's
    assert sorted(p.name for p in volume.iterdir()) == ["run-a", "run-b", "run-c", "run-d", "run-e"]  # (no staging)


def test_each_run_keeps_its_kernels_in_a_folder_of_its_own(tmp_path):
    """On the kernels Volume each campaign compiles into its run's folder: commits are last-writer-wins
    per file, and two runs' numbered variants in one folder could pair an index with the other's code.
    A folder that does not exist (no Volume mounted) leaves numba's default and makes nothing."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import os, sys\nfrom producers.kernel_cache import cache_kernels_in\n"
        "print(cache_kernels_in(sys.argv[1], 'run-a'), os.environ.get('NUMBA_CACHE_DIR'))"
    )
    root = Path(__file__).resolve().parents[1]
    for folder, expect in ((tmp_path, f"True {tmp_path / 'run-a'}"), (tmp_path / "none", "False None")):
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}
        out = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.split("\n")[0] == expect, out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-a"]


def test_every_tokenizer_and_token_width_runs_one_compiled_variant_per_input_type():
    """numba compiles the pass once per distinct set of argument types (in every fresh clone and on
    every new machine: this test's 18 variants took 44 CPU-s cold, its 3 now 15), so the kernel takes
    outputs of one type and the caller narrows them: each tokenizer, bin width and token width
    (uint16 and uint32 vocabularies) over the same rows runs one variant, and each other input type
    (int32 ids, float values) one more. The tokens are the vectorised path's, in the caller's types."""
    from producers import token_kernel

    rng = np.random.default_rng(11)
    counts = ragged(rng, 20, 300, floats=False, spread=40)
    floats = ragged(rng, 20, 300, floats=True, spread=40)
    wide_ids = CellRows(counts.cell_ids, counts.offsets, counts.ids.astype(np.int32), counts.values)
    before = set(token_kernel._tokenize.signatures)
    for rows in (counts, floats, wide_ids):
        for vocab in (SMALL, LARGE):
            table = lookup_of(rng, "shuffled", vocab)
            for name, params in (("scgpt", {}), ("scgpt", {"n_bins": 300}), ("geneformer", {}), ("raw", {})):
                if name == "geneformer" and rows is floats:
                    continue  # (Geneformer needs counts)
                kernel, vectorised = both_paths(name, vocab, rng, max_genes=100, **params)
                assert_same(kernel(rows, None, table), vectorised(rows, None, table))
    used = set(token_kernel._tokenize.signatures) - before
    input_types = {(sig[1].dtype, sig[2].dtype) for sig in token_kernel._tokenize.signatures}
    # at most ids of 2 or 4 bytes x counts or floats; before, each token and value width too (18 here)
    assert len(set(token_kernel._tokenize.signatures)) == len(input_types) <= 4, used
