"""The downstream-parity harness (`benchmarks/downstream.py`): the held-out plate is never
trained on and is evaluated whole, the probe computes what it says, and it learns plate-independent
labels from the real stream."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.downstream import LinearProbe, macro_f1, parity_codes, pipeline_epoch, train_probe
from coordination.plan import Sampling
from producers.selection import label_codes
from producers.synth import SynthSpec, synthesize

HELD_OUT = "plate = 'plate14'"
SAMPLING = Sampling("block", block_size=16, fetch_factor=4, batch_size=64)


def test_held_out_plate_is_never_streamed_and_probe_logits_are_bin_weighted_gene_rows(small_synth):
    ds = small_synth
    plates, names = label_codes(ds, "plate")
    held_out = np.flatnonzero(plates == names.index("plate14"))
    with pipeline_epoch(ds, SAMPLING, max_genes=4096, held_out_filter=HELD_OUT) as (batches, held):
        trained = np.sort(np.concatenate([b.cell_ids.numpy() for b in batches]))
    np.testing.assert_array_equal(trained, np.setdiff1d(np.arange(ds.n_cells), held_out))  # each once
    held_ids = np.concatenate([b.cell_ids.numpy() for b in held])
    np.testing.assert_array_equal(np.sort(held_ids), held_out)  # the whole plate, once
    # every expressed gene reaches the probe (max_genes above any cell's count), after CLS
    nnz = np.diff(ds.cell_row_start)
    np.testing.assert_array_equal(np.concatenate([b.attention_mask.sum(1).numpy() - 1 for b in held]), nnz[held_ids])

    # the probe's logits: bins scaled to a root mean square of 1, times the genes' weight rows
    batch = held[0]
    probe = LinearProbe(ds.n_genes + 4, [5, 3])
    torch.nn.init.normal_(probe.bag.weight)
    torch.nn.init.normal_(probe.bias)
    got = torch.cat(probe(batch), dim=1).detach().numpy()
    w, b = probe.bag.weight.detach().numpy(), probe.bias.detach().numpy()
    for row in range(0, batch.size, 97):
        real = batch.attention_mask[row].numpy() & (batch.values[row].numpy() > 0)  # gene tokens, not CLS/PAD
        tokens, bins = batch.tokens[row].numpy()[real], batch.values[row].numpy()[real].astype(np.float64)
        scaled = bins * np.sqrt(len(bins)) / np.linalg.norm(bins)
        np.testing.assert_allclose(got[row], scaled @ w[tokens] + b, rtol=1e-4, atol=1e-4)


def test_probe_learns_cell_line_from_the_stream(tmp_path):
    """On an atlas whose cell lines are easy to tell apart (marker_fraction 0.05), one epoch of
    the stream teaches the probe cell lines it then finds on the plate it never saw."""
    spec = SynthSpec(n_cells=3000, n_genes=5000, marker_fraction=0.05, seed=7)
    ds = synthesize(str(tmp_path / "atlas"), spec, rows_per_fragment=250_000, progress=False)
    codes, n_classes, vocab = parity_codes(ds)
    with pipeline_epoch(ds, SAMPLING, max_genes=4096, held_out_filter=HELD_OUT) as (batches, held):
        run = train_probe(batches, held, codes, n_classes, vocab, planned_cells=3000)
    untrained = macro_f1(LinearProbe(vocab, n_classes), held, codes)  # zero weights: one class for all
    assert untrained["cell_line"] < 0.05
    assert run.cells == ds.n_cells - sum(b.size for b in held)
    assert run.f1["cell_line"] > 0.25, run.f1  # chance: 1/50; ~0.5 here
    assert [c for c, _ in run.curve] == sorted(c for c, _ in run.curve) and run.curve[-1] == (run.cells, run.f1)
