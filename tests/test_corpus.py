"""Pretraining on a corpus: the gene vocabulary (files read safely, scGPT's and Geneformer's
layouts, coverage checks), exact per-source epochs (quotas, every cell once before any twice,
whole passes of small sources), and tokens on real data equal to an independent computation of
scGPT's and Geneformer's rules."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from coordination.audit import cells_hash
from coordination.corpus import CorpusPlan, CorpusSource, source_of
from coordination.corpus_file import CorpusSpec, quotas
from coordination.errors import CellfeedError
from coordination.plan import DatasetGeometry, Sampling
from coordination.queues import MemoryMap, MemoryQueue
from coordination.routing import EVAL_PARTITION
from coordination.vocab import GeneVocab, published_vocab
from coordination.wire import unpack_item
from producers.config import ProducerConfig
from producers.held_out import produce_held_out
from producers.producer import Producer

TEST_DATA = Path(__file__).parent / "data"
SCGPT_VOCAB = TEST_DATA / "scgpt_default_gene_vocab.json"


def geometry(n_cells: int, seed: int, fragments: int = 3) -> DatasetGeometry:
    rng = np.random.default_rng(seed)
    starts = np.concatenate([[0], np.cumsum(rng.integers(1, 5, size=n_cells))]).astype(np.int64)
    edges = np.linspace(0, starts[-1], fragments + 1).astype(np.int64)
    return DatasetGeometry(f"g{seed}", starts, edges)


# ------------------------------------------------------------------------------------- quotas


def test_quotas_add_up_by_largest_remainder():
    assert quotas([0.6, 0.3, 0.1], 1000).tolist() == [600, 300, 100]
    assert quotas([1, 1, 1], 10).tolist() == [4, 3, 3]  # the remainder to the earlier source
    assert quotas([0.6, 0.3, 0.1], 7).sum() == 7
    assert quotas([2, 1], 1).tolist() == [1, 0]


# ----------------------------------------------------------------------------- epoch semantics


@pytest.mark.parametrize("strategy", ["block", "random", "sequential", "mixture"])
def test_corpus_epochs_give_exact_quotas_and_every_cell_once_before_any_twice(strategy):
    sizes = (900, 400, 70)
    subset = np.sort(np.random.default_rng(5).choice(400, size=300, replace=False))  # source 1: a filter
    sources = [
        CorpusSource(geometry(sizes[0], 0), None, 0),
        CorpusSource(geometry(sizes[1], 1), subset, sizes[0]),
        CorpusSource(geometry(sizes[2], 2), None, sizes[0] + sizes[1]),
    ]
    selected = [900, 300, 70]
    q = quotas([0.6, 0.3, 0.1], 1000)  # 600 of 900, 300 of 300, 100 of 70 (a pass and 30 of the next)
    sampling = Sampling(strategy, unit_cells=16, n_scanners=2, block_size=8, fetch_factor=2, batch_size=16)
    streams = [[], [], []]
    for epoch in range(3):
        plan = CorpusPlan(sources, q, sampling, seed=7, epoch=epoch)
        per_source = [[], [], []]
        for u in range(plan.n_units):
            unit = plan.unit(u)
            for s, cells, ranges in ((p.source, p.cells, p.ranges) for p in unit.parts):
                assert len(np.unique(cells)) == len(cells)  # a unit never holds a cell twice
                starts = sources[s].geometry.cell_row_start
                assert (ranges[:, 1] - ranges[:, 0]).sum() == (starts[cells + 1] - starts[cells]).sum()
                per_source[s].append(cells)
        got = [np.concatenate(p) for p in per_source]
        assert [len(g) for g in got] == q.tolist()  # exact quotas
        assert plan.unit_cell_counts.sum() == plan.n_cells == 1000
        assert plan.cells_per_rank(3).sum() == 1000
        everything = np.concatenate([g + src.offset for g, src in zip(got, sources)])
        assert sum(plan.cell_hash_per_rank(3)) % 2**64 == cells_hash(everything)  # the audit's plan
        assert source_of(everything, [s.offset for s in sources]).tolist() == [0] * q[0] + [1] * q[1] + [2] * q[2]
        for s in range(3):
            streams[s].append(np.concatenate([plan.unit_cells(u, s) for u in range(plan.n_units)]))
    # each source's stream over the epochs: whole passes, each a permutation of its selection
    for s, chosen in enumerate([np.arange(900), subset, np.arange(70)]):
        stream = np.concatenate(streams[s])
        for k in range(len(stream) // selected[s]):
            np.testing.assert_array_equal(np.sort(stream[k * selected[s] : (k + 1) * selected[s]]), chosen)
        tail = stream[len(stream) // selected[s] * selected[s] :]
        assert len(np.unique(tail)) == len(tail) and set(tail) <= set(chosen.tolist())
    # the large source continues where it stopped: epochs 0 and 1 hold 1,200 of its 900 cells,
    # so every cell came once (900) before 300 came twice
    first_two = np.concatenate(streams[0][:2])
    assert len(np.unique(first_two[:900])) == 900
    # the 70-cell source runs its passes in different orders
    assert not np.array_equal(streams[2][0][:70], streams[2][1][30:100])


def test_units_mix_sources_in_proportion():
    sources = [
        CorpusSource(geometry(6000, 0), None, 0),
        CorpusSource(geometry(3000, 1), None, 6000),
        CorpusSource(geometry(1000, 2), None, 9000),
    ]
    plan = CorpusPlan(
        sources,
        quotas([0.6, 0.3, 0.1], 10_000),
        Sampling("block", block_size=16, fetch_factor=2, batch_size=64),
        seed=0,
        epoch=0,
    )
    shares = plan.unit_source_counts / plan.unit_cell_counts[:, None]
    assert plan.n_units >= 64
    assert np.abs(shares - [0.6, 0.3, 0.1]).max() < 0.05  # each unit holds every source, by weight


def test_a_plan_is_a_pure_function_of_seed_and_epoch():
    sources = [CorpusSource(geometry(500, 0), None, 0), CorpusSource(geometry(50, 1), None, 500)]
    q = quotas([0.5, 0.5], 400)
    a, b = (CorpusPlan(sources, q, Sampling("block", block_size=4), seed=3, epoch=2) for _ in range(2))
    assert a.plan_id == b.plan_id
    assert all(np.array_equal(a.unit_cells(u, 1), b.unit_cells(u, 1)) for u in range(a.n_units))
    assert CorpusPlan(sources, q, Sampling("block", block_size=4), seed=4, epoch=2).plan_id != a.plan_id


def test_corpus_file_errors_name_the_problem(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text('[[source]]\nname = "a"\n')
    with pytest.raises(CellfeedError, match=r"\[\[source\]\] 1 has no dataset"):
        CorpusSpec.read(bad)
    bad.write_text('[[source]]\ndataset = "x"\nweight = 0\n')
    with pytest.raises(CellfeedError, match="weights must be > 0"):
        CorpusSpec.read(bad)
    bad.write_text('[[source]]\ndataset = "x"\nwieght = 1\n')
    with pytest.raises(CellfeedError, match="unknown setting 'wieght'"):
        CorpusSpec.read(bad)
    bad.write_text('epoch_cels = 3\n[[source]]\ndataset = "x"\n')
    with pytest.raises(CellfeedError, match="unknown setting 'epoch_cels'"):
        CorpusSpec.read(bad)
    bad.write_text("[[source]\n")
    with pytest.raises(CellfeedError, match="not valid TOML"):
        CorpusSpec.read(bad)
    bad.write_text('vocabulary = "v.json"\n[[source]]\ndataset = "d"\nweight = 2\n')
    spec = CorpusSpec.read(bad)  # paths relative to the corpus file
    assert spec.vocabulary == str(tmp_path / "v.json") and spec.sources[0].dataset == str(tmp_path / "d")


# ---------------------------------------------------------------------------------- vocabulary


def test_scgpt_vocabulary_gets_its_specials_appended_as_scgpt_does():
    vocab = GeneVocab.read(SCGPT_VOCAB)
    raw = json.loads(SCGPT_VOCAB.read_text())
    assert len(raw) == 48_292 and max(raw.values()) == 48_291
    # scGPT: GeneVocab.from_file, then append_token("<pad>"), ("<cls>"), ("<eoc>"): ids after the highest
    assert (vocab.pad, vocab.special("cls"), vocab.special("eos"), vocab.mask) == (48_292, 48_293, 48_294, 48_295)
    assert vocab.ids["<eoc>"] == 48_294 and vocab.size == 48_296 and vocab.n_genes == 48_292
    assert vocab.lookup(["TP53", "not-a-gene", "CD3E"]).tolist() == [raw["TP53"], -1, raw["CD3E"]]
    assert GeneVocab.from_json(vocab.to_json()).fingerprint == vocab.fingerprint


def test_geneformer_pickles_are_read_without_running_code(tmp_path):
    tokens = {"<pad>": 0, "<mask>": 1, "<cls>": 2, "<eos>": 3, "ENSG00000141510": 4, "ENSG00000105329": 5}
    (tmp_path / "token_dictionary.pkl").write_bytes(pickle.dumps(tokens))
    vocab = GeneVocab.read(tmp_path / "token_dictionary.pkl")
    assert (vocab.pad, vocab.mask, vocab.special("cls"), vocab.special("eos")) == (0, 1, 2, 3)
    medians = {"ENSG00000141510": np.float64(1.5), "ENSG00000105329": np.float32(2.25)}  # numpy scalars, as stored
    (tmp_path / "medians.pkl").write_bytes(pickle.dumps(medians))
    from coordination.vocab import read_mapping

    assert read_mapping(tmp_path / "medians.pkl", "medians") == {"ENSG00000141510": 1.5, "ENSG00000105329": 2.25}

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    (tmp_path / "evil.pkl").write_bytes(pickle.dumps({"ENSG1": Evil()}))
    with pytest.raises(CellfeedError, match=r"not a plain pickled dict \(refusing builtins.print"):
        GeneVocab.read(tmp_path / "evil.pkl")
    (tmp_path / "array.pkl").write_bytes(pickle.dumps({"ENSG1": np.arange(3)}))
    with pytest.raises(CellfeedError, match="refusing numpy"):
        GeneVocab.read(tmp_path / "array.pkl")
    (tmp_path / "v.json").write_text('{"A": 0, "B": "x"}')
    with pytest.raises(CellfeedError, match="'B' maps to 'x', not a token id"):
        GeneVocab.read(tmp_path / "v.json")


# -------------------------------------------------------------------- tokens on real data


def reference_bins(values: np.ndarray, n_bins: int) -> np.ndarray:
    """scGPT's binning of one cell's non-zeros (np.quantile edges, np.digitize, ties at the midpoint)."""
    edges = np.quantile(values, np.linspace(0, 1, n_bins - 1))
    return np.ceil((np.digitize(values, edges) + np.digitize(values, edges, right=True)) / 2).astype(np.int64)


def every_cell(producer: Producer, n_cells: int) -> dict:
    """Every cell's (tokens, values) as the producer makes them (through the held-out path: all cells, once)."""
    queue = MemoryQueue()
    producer.queue = producer.courier.queue = queue
    produce_held_out(producer, np.arange(n_cells))
    out = {}
    for data in queue.get_many(10**6, block=False, partition=EVAL_PARTITION):
        item = unpack_item(data)
        for i, cell in enumerate(item.cell_ids.tolist()):
            a, b = item.offsets[i], item.offsets[i + 1]
            out[cell] = (item.tokens[a:b].astype(np.int64), None if item.values is None else item.values[a:b])
    return out


def test_pbmc_with_scgpt_vocabulary_equals_scgpt_rule_cell_by_cell(pbmc_raw):
    ds, adata = pbmc_raw
    vocab = GeneVocab.read(SCGPT_VOCAB)
    config = ProducerConfig(dataset=ds.uri, run="pbmc", vocabulary=str(SCGPT_VOCAB), max_genes=200, threads=1)
    producer = Producer(config, MemoryQueue(), MemoryMap(), dataset=ds)
    got = every_cell(producer, ds.n_cells)
    x = adata.raw.X.tocsr()
    symbols = list(adata.raw.var_names)
    ids = {g: vocab.ids[g] for g in symbols if g in vocab.ids}
    assert 600 < len(ids) < len(symbols)  # most PBMC symbols are in scGPT's vocabulary, not all
    for cell in range(ds.n_cells):
        row = x.getrow(cell)
        kept = [(float(v), ids[symbols[g]]) for g, v in zip(row.indices, row.data) if v != 0 and symbols[g] in ids]
        values = np.array([v for v, _ in kept], dtype=np.float32)
        bins = dict(zip([t for _, t in kept], reference_bins(values, 51))) if kept else {}
        ranked = sorted(kept, key=lambda vt: (-vt[0], vt[1]))[:200]  # value descending, token ascending
        tokens, got_bins = got[cell]
        np.testing.assert_array_equal(tokens, [vocab.special("cls")] + [t for _, t in ranked])
        np.testing.assert_array_equal(got_bins, [0] + [bins[t] for _, t in ranked])
    assert published_vocab(MemoryMap(), "pbmc") is None  # nothing published by a bare producer


def test_geneformer_with_an_ensembl_dictionary_equals_its_rule(small_synth, tmp_path):
    ds = small_synth
    genes = [str(g) for g in ds.var(["gene_id"]).column(0).to_pylist()]
    rng = np.random.default_rng(0)
    inside = [g for g in genes if rng.random() < 0.8]  # a fifth of the atlas's genes unknown to the dictionary
    order = rng.permutation(len(inside))
    tokens = {"<pad>": 0, "<mask>": 1, "<cls>": 2, "<eos>": 3} | {
        inside[i]: 4 + int(order[i]) for i in range(len(inside))
    }
    medians = {g: np.float64(rng.uniform(0.5, 4.0)) for g in inside}
    (tmp_path / "token_dictionary.pkl").write_bytes(pickle.dumps(tokens))
    (tmp_path / "gene_median_dictionary.pkl").write_bytes(pickle.dumps(medians))
    config = ProducerConfig(
        dataset=ds.uri,
        run="gf",
        tokenizer="geneformer-v2",
        max_genes=64,
        threads=1,
        vocabulary=str(tmp_path / "token_dictionary.pkl"),
        gene_medians=str(tmp_path / "gene_median_dictionary.pkl"),
    )
    producer = Producer(config, MemoryQueue(), MemoryMap(), dataset=ds)
    n = 300
    got = every_cell(producer, n)
    cells = ds.read_cells(np.arange(n))
    for cell in range(n):
        mine = slice(cells.offsets[cell], cells.offsets[cell + 1])
        total = float(cells.values[mine].astype(np.float64).sum())  # n_counts: all the cell's genes
        pairs = [(genes[g], float(v)) for g, v in zip(cells.ids[mine], cells.values[mine]) if genes[g] in tokens]
        score = [(-(v / total * 10_000 / medians[g]), tokens[g]) for g, v in pairs]
        expected = [2] + [t for _, t in sorted(score)[:64]] + [3]
        np.testing.assert_array_equal(got[cell][0], expected)


def test_a_source_outside_the_vocabulary_fails_in_one_line_with_both_sides(small_synth):
    from producers.sources import attach_vocab, check_coverage, open_sources

    spec = CorpusSpec.single(small_synth.uri, vocabulary=str(SCGPT_VOCAB))
    sources = open_sources(spec, datasets={small_synth.uri: small_synth})
    vocab = GeneVocab.read(SCGPT_VOCAB)
    attach_vocab(sources, vocab)
    with pytest.raises(CellfeedError) as err:
        check_coverage(sources, vocab)
    text = str(err.value)
    assert "\n" not in text and "0.0% of its non-zeros" in text and "'ENSG00000000000'" in text
    assert "'ZZZ3'" in text and "gene_column" in text


# ------------------------------------------------------------------------------ a whole campaign


def test_cellfeed_local_trains_a_corpus_as_planned_per_source_in_every_epoch(corpus, tmp_path):
    import subprocess
    import sys

    from benchmarks.chaos import trained_per_epoch
    from coordination.corpus import source_of

    path, offsets, quotas_ = corpus
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "local",
            "--corpus",
            path,
            "--workdir",
            str(tmp_path),
            "--run",
            "mix",
            "--epochs",
            "2",
            "--max-genes",
            "32",
            "--batch-size",
            "32",
            "--audit-cells",
            "--quiet",
            "--rpc-latency-ms",
            "25",
        ],  # each queue/map call as on Modal
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "corpus " in out.stdout and "1,440 cells per epoch from atlas_a: 800 of 800 genes" in out.stdout
    assert "240 cells per epoch from pbmc: 765 of 765 genes in the vocabulary, 100.0% of non-zeros kept" in out.stdout
    vocab = GeneVocab.from_json((tmp_path / "mix" / "vocab.json").read_text())
    assert vocab.n_genes == 800 + 240 + 765  # the union: atlas_b adds its 240 new genes
    planner = Producer(ProducerConfig(dataset="", corpus=path, run="mix", world_size=2), MemoryQueue(), MemoryMap())
    trained = trained_per_epoch(tmp_path / "mix")
    for epoch in range(2):
        plan = planner.plan(epoch)
        planned = Counter(
            np.concatenate([plan.unit_cells(u, s) + offsets[s] for u in range(plan.n_units) for s in range(3)]).tolist()
        )
        assert trained[epoch] == planned, epoch  # exactly the plan, a repeated cell as often as planned
        per_source = np.bincount(source_of(list(trained[epoch].elements()), offsets), minlength=3)
        assert per_source.tolist() == list(quotas_)
    # pbmc (700 cells, 240 an epoch) continues: epoch 1 draws cells epoch 0 did not
    pbmc = [set(c for c in trained[e] if c >= offsets[2]) for e in range(2)]
    assert not pbmc[0] & pbmc[1]
    assert out.stdout.count("0 missing, 0 duplicated (of 2,400 planned") == 2


def test_inspect_a_corpus_shows_each_source(corpus):
    from app.describe import describe_corpus

    text = describe_corpus(corpus[0])
    assert "3 sources, 2,400 cells per epoch" in text
    assert "atlas_b" in text and "800 / 800" in text and "1,440" in text and "0.34" in text  # pbmc: 240 / 700 a pass


def test_cellfeed_stats_over_a_corpus_gives_each_vocabulary_genes_median_over_every_source(corpus, tmp_path):
    """Geneformer's medians over two count atlases whose genes overlap in another order, against
    np.median of every normalised value of each identifier, pooled across the sources."""
    from app.cli import main as cli
    from producers.dataset import open_dataset

    root = Path(corpus[0]).parent
    two = tmp_path / "two.toml"
    two.write_text(f'[[source]]\ndataset = "{root / "atlas_a"}"\n\n[[source]]\ndataset = "{root / "atlas_b"}"\n')
    assert cli(["stats", str(two), "--out", str(tmp_path / "medians.json"), "--quiet"]) == 0
    got = json.loads((tmp_path / "medians.json").read_text())
    pooled: dict[str, list] = {}
    for name in ("atlas_a", "atlas_b"):
        ds = open_dataset(str(root / name))
        ids = ds.var(["gene_id"]).column(0).to_pylist()
        block = ds.read_rows(0, ds.n_rows)
        values = block.value.astype(np.float64)
        totals = np.bincount(block.cell, weights=values)
        norm = values / totals[block.cell] * 10_000.0
        order = np.argsort(block.gene, kind="stable")
        bounds = np.searchsorted(block.gene[order], np.arange(ds.n_genes + 1))
        for g in range(ds.n_genes):
            pooled.setdefault(ids[g], []).append(norm[order[bounds[g] : bounds[g + 1]]])
    expected = {g: float(np.median(np.concatenate(v))) for g, v in pooled.items() if sum(map(len, v))}
    assert got.keys() == expected.keys() and len(got) > 1000  # the union: 800 + 240 new genes
    assert all(got[g] == expected[g] for g in expected)  # exact


def test_a_resume_with_a_changed_corpus_applies_it_from_the_next_epoch_or_refuses_in_one_line(tmp_path, capsys):
    """`cellfeed local --resume` with an edited corpus file: the run's mixtures (RUN/mixtures.json)
    gain the new one from the epoch after the one in progress, saying so; a source that keeps its
    name but changes its dataset or filters, or another vocabulary, is refused in one line."""
    from app.campaign import record_mixtures
    from app.config import CampaignConfig
    from coordination.corpus_file import Mixtures

    corpus_file = tmp_path / "corpus.toml"
    corpus_file.write_text(
        '[[source]]\nname = "a"\ndataset = "s3://b/a"\nweight = 0.6\n\n'
        '[[source]]\nname = "b"\ndataset = "s3://b/b"\nweight = 0.4\n'
    )
    cfg = CampaignConfig(corpus=str(corpus_file), run="mix")
    path = record_mixtures(cfg, tmp_path, None)  # a fresh run: one mixture, from epoch 0
    assert [start for start, _ in Mixtures.from_json(Path(path).read_text()).history] == [0]
    corpus_file.write_text(
        '[[source]]\nname = "a"\ndataset = "s3://b/a"\nweight = 0.2\n\n'
        '[[source]]\nname = "c"\ndataset = "s3://b/c"\nweight = 0.8\n'
    )
    record_mixtures(cfg, tmp_path, 3)  # resumed inside epoch 3
    assert "its new mixture applies from epoch 4 (epoch 3 finishes under its plan)" in capsys.readouterr().out
    mixtures = Mixtures.from_json(Path(path).read_text())
    assert [start for start, _ in mixtures.history] == [0, 4]
    assert [s.name for s in mixtures.union.sources] == ["a", "b", "c"]  # b stays: its cell ids stay put
    selected = {"a": 1000, "b": 500, "c": 300}
    assert mixtures.quotas_at(3, selected).tolist() == [900, 600, 0]
    assert mixtures.quotas_at(4, selected).tolist() == [260, 0, 1040]  # b gives nothing from epoch 4
    assert mixtures.starts(5, selected).tolist() == [4 * 900 + 260, 4 * 600, 1040]
    corpus_file.write_text('[[source]]\nname = "a"\ndataset = "s3://b/other"\nweight = 1\n')
    with pytest.raises(CellfeedError, match="^source 'a' changed its dataset or filters: .* a new name$"):
        record_mixtures(cfg, tmp_path, 5)
    corpus_file.write_text('vocabulary = "v.json"\n[[source]]\nname = "a"\ndataset = "s3://b/a"\n')
    with pytest.raises(CellfeedError, match="vocabulary and gene_column are the run's own"):
        record_mixtures(cfg, tmp_path, 5)


@pytest.mark.parametrize("compile_pass", [True, False])
def test_a_modal_setup_with_no_held_out_set_tokenizes_the_first_cells_of_every_source(
    corpus, monkeypatch, compile_pass
):
    """app/campaign.py:prepare as a Modal setup calls it (`compile_pass`): with no held-out set it
    tokenizes the first 4 cells of every source (producers/held_out.py:compile_token_pass), so the token
    pass is compiled for each source's types into the kernels Volume before the producers start and
    load it. `cellfeed local` does not ask (its producers share one machine's cache): nothing is
    tokenized. (That a Modal setup compiles into an empty Volume is tested on the control plane.)"""
    from app import campaign
    from app.config import CampaignConfig
    from producers import held_out

    path, offsets, _ = corpus
    asked, real = [], held_out.tokenize_cells
    monkeypatch.setattr(held_out, "tokenize_cells", lambda producer, ids: asked.append(real(producer, ids)) or [])
    cfg = CampaignConfig(corpus=path, run="setup-test", max_genes=32, epochs=1).validate()
    facts = campaign.prepare(cfg, MemoryQueue(), MemoryMap(), compile_pass=compile_pass)
    assert facts.cells_per_epoch == 2400
    if not compile_pass:
        assert asked == []
        return
    (items,) = asked
    cells = Counter(int(c) for item in items for c in unpack_item(item).cell_ids)
    assert cells == Counter({offset + k: 1 for offset in offsets for k in range(4)})
