"""The synthetic atlas: deterministic for a seed, Tahoe-like sizes, and a plate structure strong
enough that ordered streaming is visibly biased."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from app.cli import main as cli
from cellfeed_testing.sampling_quality import entropy_bits
from producers.dataset import open_dataset
from producers.synth import SynthSpec, plate_sizes, synthesize


def test_plate_sizes_match_tahoe_shape():
    sizes = plate_sizes(1_000_000, 14)
    frac = sizes / sizes.sum()
    assert sizes.sum() == 1_000_000
    assert abs(frac.min() - 0.047) < 0.001 and abs(frac.max() - 0.104) < 0.001
    assert len(np.unique(sizes)) == 14  # unequal
    assert plate_sizes(10, 3).sum() == 10 and plate_sizes(5, 1).tolist() == [5]


def test_counts_and_structure(small_synth):
    ds = small_synth
    nnz = np.diff(ds.cell_row_start)
    assert 1300 <= np.median(nnz) <= 1700
    assert nnz.max() <= 3300 and (nnz >= 450).mean() > 0.99
    assert ds.is_counts and ds.n_genes == 62_710
    rows = ds.read_rows(0, ds.n_rows)
    assert rows.value.min() >= 1
    # cell-major, genes strictly increasing within a cell
    same = rows.cell[1:] == rows.cell[:-1]
    assert np.all(rows.cell[1:] >= rows.cell[:-1]) and np.all(rows.gene[1:][same] > rows.gene[:-1][same])
    # heavy-tailed gene popularity: a few genes in nearly every cell, the median gene in few;
    # the top 1% of genes hold >15x their uniform share of non-zeros
    per_gene = np.sort(np.bincount(rows.gene, minlength=ds.n_genes))[::-1]
    assert per_gene[0] > 0.9 * ds.n_cells and np.median(per_gene) < 0.05 * ds.n_cells
    assert per_gene[: ds.n_genes // 100].sum() > 0.15 * per_gene.sum()
    # plates stored in order
    plates = np.array(ds.obs(["plate"]).column(0).to_pylist())
    assert np.all(plates[1:] >= plates[:-1]) and len(np.unique(plates)) == 14
    assert len(ds.straddling_cells()) > 0


def test_same_seed_same_data_other_seed_other_data(tmp_path):
    spec = SynthSpec(n_cells=300, n_genes=2000, n_plates=3, seed=11)
    a = synthesize(str(tmp_path / "a"), spec, rows_per_fragment=10_000, progress=False)
    b = synthesize(str(tmp_path / "b"), spec, rows_per_fragment=50_000, progress=False)
    c = synthesize(str(tmp_path / "c"), SynthSpec(n_cells=300, n_genes=2000, n_plates=3, seed=12), progress=False)
    ra, rb, rc = (d.read_rows(0, d.n_rows) for d in (a, b, c))
    for field in ("cell", "gene", "value"):
        np.testing.assert_array_equal(getattr(ra, field), getattr(rb, field))
    assert a.obs().equals(b.obs())
    assert len(ra) != len(rc) or not np.array_equal(ra.gene, rc.gene)


def test_plate_structure_is_measurable(small_synth):
    ds = small_synth
    rows = ds.read_rows(0, ds.n_rows)
    x = sp.csr_matrix((np.log1p(rows.value.astype(np.float32)), rows.gene, ds.cell_row_start), shape=ds.shape)
    x = sp.diags(1.0 / np.sqrt(x.multiply(x).sum(axis=1).A1 + 1e-9)) @ x  # unit-norm cells
    plates = np.array(ds.obs(["plate"]).column(0).to_pylist())
    labels, y = np.unique(plates, return_inverse=True)
    train, test = np.arange(0, ds.n_cells, 2), np.arange(1, ds.n_cells, 2)
    centroids = np.vstack([np.asarray(x[train[y[train] == k]].mean(axis=0)) for k in range(len(labels))])
    predicted = np.asarray(x[test] @ centroids.T).argmax(axis=1)
    accuracy = (predicted == y[test]).mean()
    assert accuracy > 0.9, accuracy  # chance is ~1/14

    # contiguous batches of 64 cells see ~one plate; shuffled batches see nearly all of them
    rng = np.random.default_rng(0)
    contiguous = [entropy_bits(plates[s : s + 64]) for s in range(0, ds.n_cells - 64, 64)]
    shuffled_order = rng.permutation(ds.n_cells)
    shuffled = [entropy_bits(plates[shuffled_order[s : s + 64]]) for s in range(0, ds.n_cells - 64, 64)]
    assert np.mean(contiguous) < 0.2 and np.mean(shuffled) > 3.0


def test_cell_line_and_dose_carry_signal_on_every_plate(small_synth):
    """Labels a model can learn on some plates and be judged on another: the genes most enriched
    in a cell line on 13 plates identify that line on the 14th; the genes most enriched at the
    highest dose are detected more the higher a held-out cell's dose."""
    ds = small_synth
    rows = ds.read_rows(0, ds.n_rows)
    detected = sp.csr_matrix((np.ones(len(rows), dtype=np.float32), rows.gene, ds.cell_row_start), shape=ds.shape)
    plates = np.array(ds.obs(["plate"]).column(0).to_pylist())
    held_out = plates == "plate14"

    def enriched(labels: np.ndarray, value) -> np.ndarray:
        """The 24 genes whose detection rate on the training plates rises most in cells of `value`."""
        train = ~held_out
        gain = detected[train & (labels == value)].mean(axis=0).A1 - detected[train].mean(axis=0).A1
        return np.argsort(-gain)[:24]

    lines = np.array(ds.obs(["cell_line"]).column(0).to_pylist())
    names = np.unique(lines)
    assert len(names) == 50 and all(len(np.unique(lines[plates == p])) >= 30 for p in np.unique(plates))
    scores = np.column_stack([detected[held_out][:, enriched(lines, name)].sum(axis=1).A1 for name in names])
    accuracy = (names[scores.argmax(axis=1)] == lines[held_out]).mean()
    assert accuracy > 0.8, accuracy  # chance is 1/50

    doses = np.array(ds.obs(["dose"]).column(0).to_pylist())
    levels = np.unique(doses)  # 0.05, 0.5, 5 uM
    score = detected[held_out][:, enriched(doses, levels[-1])].sum(axis=1).A1
    by_dose = [score[doses[held_out] == d].mean() for d in levels]
    assert by_dose[0] < by_dose[1] < by_dose[2], by_dose


def test_cli_synth_and_inspect(tmp_path, capsys):
    out = tmp_path / "atlas"
    assert (
        cli(
            [
                "synth",
                str(out),
                "--cells",
                "500",
                "--genes",
                "5000",
                "--plates",
                "4",
                "--seed",
                "3",
                "--rows-per-fragment",
                "100000",
                "--quiet",
            ]
        )
        == 0
    )
    assert cli(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    ds = open_dataset(out)
    assert f"cells       {ds.n_cells:,}" in text and f"non-zeros   {ds.n_rows:,}" in text
    assert f"straddling  {len(ds.straddling_cells()):,} cells" in text
    assert "plate" in text and "'plate01'" in text
    with pytest.raises(SystemExit) as exit_info:
        cli(["synth", str(tmp_path / "other"), "--cells", "0"])
    assert exit_info.value.code == 2 and "expected a number >= 1" in capsys.readouterr().err
