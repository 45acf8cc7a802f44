"""h5ad → dataset: exact round trips (CSR/CSC/dense, counts/floats), real PBMC data, several
inputs, and every bad input named in the issue."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import lance
import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse as sp

from app.cli import main as cli
from coordination.errors import CellfeedError
from producers.convert import convert
from producers.dataset import TABLES, RowBlock, open_dataset
from producers.writer import ContentHash, DatasetWriter
from tests.conftest import PBMC, random_counts, write_h5ad


def assert_same_cells(ds, x: sp.csr_matrix) -> None:
    """Every cell's (gene, value) rows in the dataset equal the source row exactly."""
    x = sp.csr_matrix(x)
    x.eliminate_zeros()
    x.sort_indices()
    assert ds.shape == x.shape
    assert ds.n_rows == x.nnz
    everything = ds.read_rows(0, ds.n_rows)  # storage order is cell-major
    np.testing.assert_array_equal(everything.cell, np.repeat(np.arange(x.shape[0]), np.diff(x.indptr)))
    np.testing.assert_array_equal(everything.gene, x.indices)
    np.testing.assert_array_equal(everything.value.astype(np.float64), x.data.astype(np.float64))
    np.testing.assert_array_equal(ds.cell_row_start, x.indptr)
    # and cell by cell through the index, straddling cells included
    for c in range(x.shape[0]):
        rows = ds.read_cells(np.array([c]))
        lo, hi = x.indptr[c], x.indptr[c + 1]
        np.testing.assert_array_equal(rows.ids, x.indices[lo:hi])
        np.testing.assert_array_equal(rows.values.astype(np.float64), x.data[lo:hi].astype(np.float64))


@pytest.mark.parametrize("layout", ["csr", "csc", "dense"])
@pytest.mark.parametrize("kind", ["counts", "floats"])
def test_round_trip_exact(tmp_path, layout, kind):
    x = random_counts(120, 300, seed=1, floats=kind == "floats")
    src = {"csr": x, "csc": sp.csc_matrix(x), "dense": x.toarray()}[layout]
    h5 = write_h5ad(tmp_path / "in.h5ad", src)
    ds = convert([str(h5)], str(tmp_path / "ds"), rows_per_fragment=997, chunk_cells=17, progress=False)
    assert ds.value_type == (pa.uint16() if kind == "counts" else pa.float32())
    assert len(ds.fragments) == -(-x.nnz // 997)
    assert len(ds.straddling_cells()) > 0
    assert_same_cells(ds, x)
    obs = ds.obs().to_pydict()
    assert obs["cell_id"] == [f"c{i}" for i in range(120)]
    assert obs["cell_integer_id"] == list(range(120))
    cats = ds.config["metadata"]["categories"]
    assert cats["obs"]["plate"] == ["p3", "p1", "p2"] and cats["var"]["chrom"]
    assert ds.var().column("gene_id").to_pylist() == [f"g{j}" for j in range(300)]


def test_counts_above_uint16_become_float32_not_clipped(tmp_path):
    x = random_counts(20, 50, seed=2)
    x.data[0] = 70_000
    ds = convert([str(write_h5ad(tmp_path / "big.h5ad", x))], str(tmp_path / "ds"), progress=False)
    assert ds.value_type == pa.float32()
    assert ds.read_rows(0, 1).value[0] == 70_000


def test_real_pbmc_raw_converts_exactly(tmp_path):
    import anndata as ad

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adata = ad.read_h5ad(PBMC)
    ds = convert([str(PBMC)], str(tmp_path / "raw"), layer="raw.X", rows_per_fragment=5000, progress=False)
    assert_same_cells(ds, adata.raw.X)
    assert ds.obs(["bulk_labels"]).column(0).to_pylist() == adata.obs["bulk_labels"].astype(str).tolist()
    assert not ds.is_counts  # log-normalised floats


def test_real_pbmc_scaled_x_refused_then_stored_as_float(tmp_path, capsys):
    import anndata as ad

    out = tmp_path / "x"
    assert cli(["convert", str(PBMC), str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "negative values" in err[0] and "--layer raw.X" in err[0]
    assert not out.exists()
    assert cli(["convert", str(PBMC), str(out), "--allow-negative", "--quiet"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = ad.read_h5ad(PBMC).X
    ds = open_dataset(out)
    assert ds.value_type == pa.float32()
    assert_same_cells(ds, sp.csr_matrix(dense))


def test_inspect_shows_obs_and_var_columns_with_example_values(tmp_path, capsys):
    """The var columns too (names, types, values): a user picks a corpus's `gene_column` from them."""
    h5 = write_h5ad(tmp_path / "in.h5ad", random_counts(20, 6, seed=2), genes=["TP53", "CD3E", "MS4A1", "A", "B", "C"])
    assert cli(["convert", str(h5), str(tmp_path / "ds"), "--quiet"]) == 0
    capsys.readouterr()
    assert cli(["inspect", str(tmp_path / "ds"), "--values", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    obs, var = out.index("obs columns:"), out.index("var columns (gene_column names one):")
    assert [line.split()[:2] for line in out[obs + 1 : var]] == [
        ["cell_id", "string"],
        ["plate", "string"],
        ["score", "float"],
        ["cell_integer_id", "uint32"],
    ]
    assert out[var + 1] == "  gene_id              string     'TP53', 'CD3E'"  # the var index: here, symbols
    assert out[var + 2].split()[:2] == ["chrom", "string"]
    assert out[var + 3 :] == ["  gene_integer_id      uint16     0, 1"]


def test_several_inputs_concatenate_and_reorder_genes(tmp_path):
    a = random_counts(30, 40, seed=3)
    b = random_counts(25, 40, seed=4)
    genes = [f"g{j}" for j in range(40)]
    perm = np.random.default_rng(0).permutation(40)
    # b stored with its genes in another order: column j of b_perm is gene perm[j]
    b_perm = sp.csr_matrix(b.toarray()[:, perm])
    write_h5ad(tmp_path / "a.h5ad", a, genes=genes)
    write_h5ad(tmp_path / "b.h5ad", b_perm, genes=[genes[p] for p in perm])
    ds = convert(
        [str(tmp_path / "a.h5ad"), str(tmp_path / "b.h5ad")],
        str(tmp_path / "ab"),
        rows_per_fragment=100,
        progress=False,
    )
    assert_same_cells(ds, sp.vstack([a, b]).tocsr())
    assert ds.obs(["cell_integer_id"]).column(0).to_pylist() == list(range(55))


def test_mismatched_genes_is_a_clear_error(tmp_path):
    write_h5ad(tmp_path / "a.h5ad", random_counts(10, 20, seed=5))
    write_h5ad(tmp_path / "b.h5ad", random_counts(10, 20, seed=6), genes=[f"h{j}" for j in range(20)])
    with pytest.raises(CellfeedError, match="do not match"):
        convert([str(tmp_path / "a.h5ad"), str(tmp_path / "b.h5ad")], str(tmp_path / "o"), progress=False)
    assert not (tmp_path / "o").exists()


def _bad_inputs(tmp_path):
    nan = random_counts(10, 20, seed=7)
    nan.data[1] = np.nan
    neg = random_counts(10, 20, seed=8)
    neg.data[2] = -3
    (tmp_path / "text.h5ad").write_text("not hdf5")
    return {
        "does not exist": [str(tmp_path / "missing.h5ad"), str(tmp_path / "o")],
        "not an h5ad": [str(tmp_path / "text.h5ad"), str(tmp_path / "o")],
        "NaN": [str(write_h5ad(tmp_path / "nan.h5ad", nan)), str(tmp_path / "o")],
        "negative values": [str(write_h5ad(tmp_path / "neg.h5ad", neg)), str(tmp_path / "o")],
        "no layer 'counts'": [
            str(write_h5ad(tmp_path / "ok.h5ad", random_counts(10, 20, seed=9))),
            str(tmp_path / "o"),
            "--layer",
            "counts",
        ],
        "appears more than once": [
            str(write_h5ad(tmp_path / "dup.h5ad", random_counts(10, 3, seed=9), genes=["a", "b", "a"])),
            str(tmp_path / "o"),
        ],
    }


def test_bad_inputs_give_one_line_and_no_output(tmp_path, capsys):
    for needle, args in _bad_inputs(tmp_path).items():
        assert cli(["convert", *args, "--quiet"]) == 2, needle
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0], (needle, err)
        assert not (tmp_path / "o").exists()
    leftovers = [p for p in os.listdir(tmp_path) if p.startswith(".o.")]
    assert leftovers == []


def test_existing_output_needs_overwrite(tmp_path, capsys):
    h5 = str(write_h5ad(tmp_path / "in.h5ad", random_counts(10, 20, seed=10)))
    assert cli(["convert", h5, str(tmp_path / "ds"), "--quiet"]) == 0
    assert cli(["convert", h5, str(tmp_path / "ds"), "--quiet"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli(["convert", h5, str(tmp_path / "ds"), "--quiet", "--overwrite"]) == 0
    assert open_dataset(tmp_path / "ds").n_cells == 10


def test_failed_write_leaves_nothing(tmp_path):
    out = tmp_path / "partial"
    with pytest.raises(RuntimeError):
        with DatasetWriter(out, n_genes=5, value_type=pa.uint16(), rows_per_fragment=3) as w:
            w.append(pa.table({"cell_id": ["a", "b"]}), np.array([0, 2, 3]), np.array([0, 4, 1]), np.array([1, 2, 3]))
            raise RuntimeError("crash mid-write")
    assert not out.exists()
    assert os.listdir(tmp_path) == []


def test_open_rejects_broken_datasets(small_synth, tmp_path):
    import shutil

    with pytest.raises(CellfeedError, match="config.json is missing"):
        open_dataset(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(small_synth.uri, broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CellfeedError, match="not valid JSON"):
        open_dataset(broken)
    cfg = json.loads((open_dataset(small_synth.uri).location.read_bytes("config.json")))
    (broken / "config.json").write_text(json.dumps(cfg))
    shutil.rmtree(broken / "cells.lance")
    with pytest.raises(CellfeedError, match="cells table"):
        open_dataset(broken)
    cfg["tables"].pop("genes")
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CellfeedError, match="no genes table"):
        open_dataset(broken)


@pytest.mark.parametrize("slice_rows", [1 << 18, 777])
def test_row_range_reads_agree_with_one_contiguous_read(small_synth, slice_rows, monkeypatch):
    import producers.dataset

    monkeypatch.setattr(producers.dataset, "SLICE_ROWS", slice_rows)  # long ranges cut into many slices
    ds = small_synth
    table = ds.expression.to_table()  # Lance's own read of the whole table: the reference
    everything = RowBlock(*[table.column(c).to_numpy() for c in ("cell_integer_id", "gene_integer_id", "value")])
    whole = ds.read_row_ranges(np.array([[0, ds.n_rows]]))
    for name in ("cell", "gene", "value"):
        np.testing.assert_array_equal(getattr(whole, name), getattr(everything, name))
    rng = np.random.default_rng(0)
    bounds = [f.row_start for f in ds.fragments[1:4]]
    for ranges in (
        np.array([[b - 5, b + 5] for b in bounds]),  # across fragment edges: sliced reads
        np.array([[b - 9000, b + 9000] for b in bounds]),
        np.sort(rng.choice(ds.n_rows - 3, 500, replace=False))[:, None] + np.array([0, 2]),  # tiny: one take
    ):
        got = ds.read_row_ranges(ranges)
        idx = np.concatenate([np.arange(a, b) for a, b in ranges])
        for name in ("cell", "gene", "value"):
            np.testing.assert_array_equal(getattr(got, name), getattr(everything, name)[idx])
        lean = ds.read_row_ranges(ranges, with_cell_ids=False)  # what a producer reads
        assert lean.cell is None
        np.testing.assert_array_equal(lean.gene, got.gene)
        np.testing.assert_array_equal(lean.value, got.value)
    with pytest.raises(IndexError):
        ds.read_row_ranges(np.array([[0, ds.n_rows + 1]]))


def test_cells_read_through_bridged_ranges_are_each_cells_own_rows(small_synth):
    """A unit's reads may bridge the gaps between its cells (`bridge_gaps`: a balanced unit's), so the
    rows read hold rows of other cells: each cell's own are copied out (`rows_of_spans`), a slice per
    run of cells that lie end to end in what was read. Ascending, ascending with cells drawn twice (a
    balanced unit's small class) or shuffled, every cell's genes and values are its own, in the order
    asked (fragment edges included)."""
    from coordination.arrays import bridge_gaps, merge_ranges

    ds, rng = small_synth, np.random.default_rng(1)
    starts = ds.cell_row_start
    picked = np.sort(rng.choice(ds.n_cells, ds.n_cells // 3, replace=False))  # runs of touching cells, and gaps
    one_by_one = {c: ds.read_cells(np.array([c])) for c in picked.tolist()}
    ranges = bridge_gaps(merge_ranges(starts[picked], starts[picked + 1]), max_gap=5_000)
    assert (ranges[:, 1] - ranges[:, 0]).sum() > (starts[picked + 1] - starts[picked]).sum()  # gaps were read
    twice = np.sort(np.concatenate([picked, rng.choice(picked, 50, replace=False)]))  # repeats, each beside itself
    for cells in (picked, twice, rng.permutation(picked), rng.permutation(twice)):
        got = ds.read_cells(cells, ranges)
        for i, c in enumerate(cells.tolist()):
            a, b = got.offsets[i], got.offsets[i + 1]
            np.testing.assert_array_equal(got.ids[a:b], one_by_one[c].ids)
            np.testing.assert_array_equal(got.values[a:b], one_by_one[c].values)


def test_dataset_written_by_slaf_convert_opens_unchanged():
    """tests/data/slaf_counts was written by `slaf` 0.5.2's SLAFConverter (max_rows_per_file=1000)
    from random_counts(150, 400, seed=42); it opens and reads back exactly."""
    from pathlib import Path

    ds = open_dataset(Path(__file__).parent / "data" / "slaf_counts")
    assert ds.config["format_version"] == "0.5" and len(ds.fragments) > 1 and len(ds.straddling_cells()) > 0
    assert_same_cells(ds, random_counts(150, 400, seed=42))
    assert ds.obs(["plate"]).num_rows == 150


def test_the_content_hash_is_the_datas_however_it_was_appended(tmp_path):
    """`metadata.content_sha256` (what a checkpoint ties itself to) is the same for the same cells
    written in one append or in three, from int32 or int64 input arrays."""
    indptr, genes, values = np.array([0, 2, 3, 3, 6]), np.array([0, 4, 1, 0, 2, 3]), np.array([1, 2, 3, 4, 5, 6])
    obs = pa.table({"cell_id": ["a", "b", "c", "d"]})
    var = pa.table({"gene_id": [f"g{i}" for i in range(5)]})
    with DatasetWriter(tmp_path / "one", n_genes=5, value_type=pa.uint16(), rows_per_fragment=3) as w:
        w.append(obs, indptr, genes, values)
        one = w.commit(var)
    with DatasetWriter(tmp_path / "three", n_genes=5, value_type=pa.uint16(), rows_per_fragment=3) as w:
        for a, b in ((0, 1), (1, 3), (3, 4)):
            w.append(
                obs.slice(a, b - a),
                (indptr[a : b + 1] - indptr[a]).astype(np.int32),
                genes[indptr[a] : indptr[b]].astype(np.int32),
                values[indptr[a] : indptr[b]].astype(np.int32),
            )
        three = w.commit(var)
    assert one.config["metadata"]["content_sha256"] == three.config["metadata"]["content_sha256"]
    assert one.identity == three.identity and one.identity.startswith("4 cells, content ")
    with DatasetWriter(tmp_path / "other", n_genes=5, value_type=pa.uint16(), rows_per_fragment=3) as w:
        w.append(obs, indptr, genes, values + 1)
        assert w.commit(var).identity != one.identity


def _three_inputs(tmp_path):
    """Three files, the second with its genes in another order and an explicit zero, so slices
    cross file boundaries, reorder genes and drop zeros."""
    genes = [f"g{j}" for j in range(40)]
    a, b, c = random_counts(150, 40, seed=21), random_counts(90, 40, seed=22), random_counts(200, 40, seed=23)
    perm = np.random.default_rng(3).permutation(40)
    b_perm = b[:, perm].tocsr()
    b_perm.data[0] = 0  # stored, but not a non-zero: not a row
    write_h5ad(tmp_path / "a.h5ad", a, genes=genes)
    write_h5ad(tmp_path / "b.h5ad", b_perm, genes=[genes[p] for p in perm])
    write_h5ad(tmp_path / "c.h5ad", sp.csc_matrix(c), genes=genes)
    b_kept = b.copy()
    b_kept[0, perm[b_perm.indices[0]]] = 0
    b_kept.eliminate_zeros()
    return [str(tmp_path / f"{n}.h5ad") for n in "abc"], sp.vstack([a, b_kept, c]).tocsr()


def _tables(ds):
    return [lance.dataset(ds.location.join(TABLES[t])).to_table() for t in ("cells", "expression", "genes")]


def test_any_number_of_workers_in_any_order_writes_the_same_dataset(tmp_path, monkeypatch):
    """1 worker, 3 workers, and slices written in a shuffled order give equal tables and the same
    content hash, which is also the one a single stream of the same cells gets (DatasetWriter)."""
    import producers.convert as conv

    inputs, x = _three_inputs(tmp_path)
    kw = dict(rows_per_fragment=97, chunk_cells=13, slice_cells=64, block_cells=32, progress=False)
    one = convert(inputs, str(tmp_path / "one"), workers=1, **kw)
    three = convert(inputs, str(tmp_path / "three"), workers=3, **kw)
    order = []
    real_run = conv.run_slices

    def shuffled(task, plan, indexes, args, workers, on_done, helpers=None):
        indexes = list(np.random.default_rng(5).permutation(indexes))
        order.append(indexes)
        return real_run(task, plan, indexes, args, 1, on_done)

    monkeypatch.setattr(conv, "run_slices", shuffled)
    mixed = convert(inputs, str(tmp_path / "mixed"), **kw)
    assert order[1] != sorted(order[1]) and len(order[1]) == 7  # 440 cells in slices of 64
    assert_same_cells(one, x)
    for ds in (three, mixed):
        assert all(a.equals(b) for a, b in zip(_tables(one), _tables(ds)))
        assert ds.config["metadata"]["content_sha256"] == one.config["metadata"]["content_sha256"]
    with DatasetWriter(tmp_path / "stream", n_genes=40, value_type=pa.uint16(), rows_per_fragment=97) as w:
        w._content = ContentHash(32)
        w.append(pa.table({"cell_id": [str(i) for i in range(x.shape[0])]}), x.indptr, x.indices, x.data)
        assert w.commit(pa.table({"gene_id": [f"g{j}" for j in range(40)]})).identity == one.identity
    other = convert(inputs, str(tmp_path / "other"), workers=2, **{**kw, "block_cells": 64})
    assert other.config["metadata"]["content_block_cells"] == 64 and other.identity != one.identity


def _gated_slice(plan_json: str, index: int, gate: str) -> int:
    """(a worker's task) Slice 0 at once; every other slice only once the coordinator has reported
    slice 0 done (its `on_done` makes the gate)."""
    deadline = time.monotonic() + 30
    while index and not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"slice {index}: slice 0 was not reported done while the others ran")
        time.sleep(0.01)
    return index


def test_each_slice_is_reported_as_its_worker_finishes_it(tmp_path):
    """The progress bar moves slice by slice with workers, not all at once at the end: slice 1 waits
    until slice 0's completion has been reported (before, `wait(FIRST_EXCEPTION)` returned only
    when every slice was done, so slice 1 timed out)."""
    from types import SimpleNamespace

    from producers.slices import run_slices

    gate, reported = tmp_path / "slice-0-reported", []

    def on_done(index, result):
        reported.append((index, result))
        if index == 0:
            gate.touch()

    results = run_slices(_gated_slice, SimpleNamespace(to_json=lambda: "{}"), [0, 1, 2, 3], (str(gate),), 2, on_done)
    assert results == {i: i for i in range(4)}
    assert reported[0] == (0, 0) and sorted(reported) == [(i, i) for i in range(4)]


def _heaps_after_a_thread_allocates(plan_json: str, index: int, report: str) -> tuple[int, int]:
    """(a worker's task) A thread makes and frees a 160 MB array, as Lance's reader thread makes a
    slice's chunks; then glibc's own account of this process's heaps (`malloc_info`), counted, and
    the process's pid."""
    import ctypes
    import threading

    thread = threading.Thread(target=lambda: np.ones(20_000_000).sum())
    thread.start()
    thread.join()
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    report = f"{report}.{index}"  # (a file a slice: the other worker may be writing its own)
    stream = libc.fopen(report.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    return os.getpid(), open(report).read().count("<heap nr=")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_conversion_workers_threads_share_one_heap(tmp_path):
    """A worker forked for slices has one heap (glibc arena) however many threads allocate in it: a
    thread's own arena maps each large chunk afresh, and the kernel zeroes its pages again (measured:
    ~2 CPU-s more and 2.5x the peak memory per worker, 300k cells). Without producers.heap first in
    the forkserver's preload, the thread's allocation makes a second heap."""
    from types import SimpleNamespace

    from producers.slices import run_slices

    plan = SimpleNamespace(to_json=lambda: "{}")
    heaps = run_slices(_heaps_after_a_thread_allocates, plan, [0, 1], (str(tmp_path / "heaps.xml"),), 2, lambda *_: 0)
    # slice 0 ran in this process (the coordinator's own share: its heaps are the test process's), slice 1
    # in the worker process
    assert heaps[0][0] == os.getpid() and heaps[1][0] != os.getpid() and heaps[1][1] == 1


def _pid(plan_json: str, index: int) -> int:
    """(a worker's task) The process it ran in."""
    return os.getpid()


def test_one_worker_process_beside_this_one_does_both_steps():
    """Two workers are this process and one worker process, started once: both take slices in each
    step, and the second step's slices run in the same worker process as the first's."""
    from types import SimpleNamespace

    from producers.slices import run_slices, start_helpers, stop_helpers

    plan, helpers = SimpleNamespace(to_json=lambda: "{}"), start_helpers(2)
    try:
        steps = [run_slices(_pid, plan, [0, 1, 2, 3], (), 2, lambda *_: 0, helpers=helpers) for _ in range(2)]
    finally:
        stop_helpers(helpers)
    (worker,) = set(steps[0].values()) - {os.getpid()}
    assert [set(step.values()) for step in steps] == [{os.getpid(), worker}] * 2


def test_an_interrupted_conversion_leaves_nothing_and_its_rerun_reuses_its_slices(tmp_path):
    """SIGINT to `convert --workers 2` once its first slice is recorded: the output does not exist,
    the staging folder keeps the finished slices, and the same command again writes only the rest
    and gives the dataset an uninterrupted run gives."""
    import signal
    import subprocess
    import sys
    import time

    x = random_counts(3000, 60, seed=31, density=0.3)
    h5 = str(write_h5ad(tmp_path / "in.h5ad", x))
    out = tmp_path / "out"
    script = (
        "import sys; from producers.convert import convert; "
        f"convert([{h5!r}], {str(out)!r}, workers=2, slice_cells=32, block_cells=32, chunk_cells=8, progress=False)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    records = []
    while not records and proc.poll() is None and time.monotonic() < deadline:  # the event: a slice recorded
        records = list(tmp_path.glob(".out.partial-*/_convert/slice-*.json"))
        time.sleep(0.01)
    assert records, "no slice was recorded"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "run the same command again" in err, err
    assert err.rstrip().endswith("KeyboardInterrupt"), err  # (the interrupt itself, not an error stopping workers)
    assert not out.exists()
    with pytest.raises(CellfeedError):
        open_dataset(out)
    (staging,) = tmp_path.glob(".out.partial-*")
    kept = len(list((staging / "_convert").glob("slice-*.json")))
    assert 1 <= kept < 94  # 3,000 cells in slices of 32
    import producers.convert as conv

    calls = []
    real = conv.write_slice

    def counted(plan_json, index, *args):
        calls.append(index)
        return real(plan_json, index, *args)

    conv.write_slice, restore = counted, conv.write_slice
    try:
        ds = convert([h5], str(out), workers=1, slice_cells=32, block_cells=32, chunk_cells=8, progress=False)
    finally:
        conv.write_slice = restore
    assert len(calls) == 94 - kept and not staging.exists()
    fresh = convert([h5], str(tmp_path / "fresh"), slice_cells=32, block_cells=32, progress=False)
    assert ds.identity == fresh.identity and all(a.equals(b) for a, b in zip(_tables(ds), _tables(fresh)))
    referenced = {
        d.path for f in lance.dataset(ds.location.join("expression.lance")).get_fragments() for d in f.metadata.files
    }
    assert set(os.listdir(out / "expression.lance" / "data")) == referenced  # the half-written slices' files are gone


def test_a_commit_cut_short_is_finished_by_the_rerun(tmp_path, monkeypatch):
    """Interrupted in its commit (the expression table committed, the cells table written, config.json
    not): nothing is readable at the output; the rerun commits again, and one slice whose record was
    lost is written again into the table (its half-commit's manifest put aside)."""
    import producers.convert as conv

    h5 = str(write_h5ad(tmp_path / "in.h5ad", random_counts(200, 30, seed=51)))
    kw = dict(slice_cells=32, block_cells=32, rows_per_fragment=40, progress=False)

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(conv, "finish_dataset", cut)
        with pytest.raises(KeyboardInterrupt):
            convert([h5], str(tmp_path / "out"), **kw)
    assert not (tmp_path / "out").exists()
    (staging,) = tmp_path.glob(".out.partial-*")
    assert (staging / "expression.lance" / "_versions").is_dir()  # the commit got that far
    (staging / "_convert" / "slice-000003.json").unlink()  # and one slice's record is gone
    ds = convert([h5], str(tmp_path / "out"), **kw)
    fresh = convert([h5], str(tmp_path / "fresh"), **kw)
    assert ds.identity == fresh.identity and all(a.equals(b) for a, b in zip(_tables(ds), _tables(fresh)))
    assert not staging.exists() and not (tmp_path / "out" / "_convert").exists()


def test_planning_reads_no_obs_and_the_commit_gets_every_cells_obs(tmp_path, monkeypatch):
    """obs is the commit's alone (the cells table): the plan reads the matrix and the genes, and every
    cell's obs is read beside the slices' work; at 100M cells reading it first cost minutes. The
    dataset's obs are the input's, cell for cell."""
    import anndata as ad

    from producers import convert as conv

    x = random_counts(50, 40, seed=3)
    h5 = write_h5ad(tmp_path / "in.h5ad", x)
    read, planning = [], [True]
    real_read_elem = ad.io.read_elem
    monkeypatch.setattr(ad.io, "read_elem", lambda elem: read.append((elem.name, planning[0])) or real_read_elem(elem))
    real_plan = conv.plan_conversion

    def plan(*args, **kwargs):
        try:
            return real_plan(*args, **kwargs)
        finally:
            planning[0] = False

    monkeypatch.setattr(conv, "plan_conversion", plan)
    ds = conv.convert([str(h5)], str(tmp_path / "ds"), progress=False)
    assert ("/var", True) in read and ("/obs", False) in read and ("/obs", True) not in read
    assert ds.obs().to_pydict()["cell_id"] == [f"c{i}" for i in range(50)]


def _slow_slice(plan_json: str, index: int, marker: str) -> int:
    """(a task) Ends a moment after it starts, with a file saying it did."""
    time.sleep(0.3)
    open(f"{marker}.{index}", "w").close()
    return index


@pytest.mark.parametrize("started", [True, False])
def test_a_ctrl_c_while_this_process_takes_its_slice_waits_for_it_only_if_it_began(tmp_path, monkeypatch, started):
    """Ctrl-C landing as `run_slices` hands this process its first slice: a slice whose thread has
    started is let finish (its future is recorded before the thread starts; it was recorded after, so
    an interrupt in between left the slice running unwaited while the command went on to exit); one
    whose thread never started is cancelled and not waited for (`wait`'s timeout is 300 s)."""
    from concurrent.futures import wait as real_wait
    from types import SimpleNamespace

    import producers.slices as slices

    real_start, waited = slices._start_on_a_thread, []

    def interrupted(future, fn, *args):
        if started:
            real_start(future, fn, *args)
        raise KeyboardInterrupt

    def wait(futures, **kw):
        waited.append(list(futures))
        return real_wait(futures, **kw)

    monkeypatch.setattr(slices, "_start_on_a_thread", interrupted)
    monkeypatch.setattr(slices, "wait", wait)
    marker, plan = str(tmp_path / "done"), SimpleNamespace(to_json=lambda: "{}")
    with pytest.raises(KeyboardInterrupt):
        slices.run_slices(_slow_slice, plan, [0, 1, 2], (marker,), 2, lambda *_: 0)
    assert len(waited) == 1 and len(waited[0]) == (1 if started else 0)
    assert os.path.exists(f"{marker}.0") == started  # (waited for: done before the interrupt went on)
    if started:
        assert waited[0][0].result() == 0


def test_a_ctrl_c_once_the_dataset_is_out_does_not_report_the_conversion_interrupted(tmp_path, monkeypatch):
    """A Ctrl-C that lands after the dataset is published (the command's last moments): the conversion is
    done, so `cellfeed convert` says what it wrote and exits 0, and gives Ctrl-C back afterwards."""
    import signal

    from producers import convert as conv

    h5 = write_h5ad(tmp_path / "in.h5ad", random_counts(30, 20, seed=5))
    real = conv.finish_dataset

    def finish_then_ctrl_c(*args, **kwargs):
        ds = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # the Ctrl-C, the moment after the dataset is out
        return ds

    monkeypatch.setattr(conv, "finish_dataset", finish_then_ctrl_c)
    caught = []  # (a handler that records, not raises: without the fix this test fails, not the session)
    before = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        code = cli(["convert", str(h5), str(tmp_path / "ds"), "--quiet"])
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)
    assert code == 0 and not caught
    assert open_dataset(str(tmp_path / "ds")).n_cells == 30
    assert after is not signal.SIG_IGN  # the command gave Ctrl-C back


def test_an_obs_that_cannot_be_read_is_one_line_naming_the_file_and_no_dataset_appears(tmp_path):
    """obs is read beside the slices (not at planning): a damaged one still ends the conversion in one
    line that names the file, and nothing is published at the output."""
    import h5py

    h5 = write_h5ad(tmp_path / "in.h5ad", random_counts(20, 10, seed=4))
    with h5py.File(h5, "a") as f:
        f["obs"].attrs["encoding-type"] = "not-a-dataframe"
    with pytest.raises(CellfeedError, match=r"cannot read the obs of .*in\.h5ad \(IORegistryError"):
        convert([str(h5)], str(tmp_path / "ds"), progress=False)
    assert not (tmp_path / "ds").exists()
