"""Balanced sampling by an obs column (`--balance-by`, `coordination.balance`): every class gets its
exact quota in every epoch, for every strategy, with a corpus, and across a resume on another number
of ranks; each class's cells are drawn without replacement across epochs; bad input is refused
before any producer starts. Quotas are computed here, apart from the product's code; the cells
come from what the producer made and the cell logs the ranks wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from coordination.audit import cells_hash
from coordination.balance import Balance, class_quotas
from coordination.errors import CellfeedError
from coordination.plan import Sampling
from coordination.queues import MemoryMap, MemoryQueue
from coordination.routing import TASKS_PARTITION, encode_task, rank_partition
from coordination.summary import PlanSummary, publish_summary
from coordination.wire import unpack_item
from producers.config import ProducerConfig
from producers.producer import Producer
from tests.conftest import synth_once
from tests.test_trainer import BATCH, Campaign, kill_mid_epoch_and_resume, read_cells

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = {
    "block": Sampling("block", block_size=8, fetch_factor=2, batch_size=BATCH),
    "random": Sampling("random", fetch_factor=2, batch_size=BATCH),
    "sequential": Sampling("sequential", unit_cells=60),
    "mixture": Sampling("mixture", unit_cells=60, n_scanners=3),
}


def quotas_by_hand(counts, alpha: float, size: int) -> np.ndarray:
    """count**(1 - alpha) shares of `size`, largest remainder, ties to the earlier class: written
    again here so the product's rounding is checked, not repeated."""
    weights = [float(c) ** (1.0 - alpha) for c in counts]
    exact = [w / sum(weights) * size for w in weights]
    out = [int(np.floor(x)) for x in exact]
    for i in sorted(range(len(out)), key=lambda i: (-(exact[i] - out[i]), i))[: size - sum(out)]:
        out[i] += 1
    return np.array(out)


@pytest.fixture(scope="session")
def atlas(tmp_path_factory):
    """3,000 cells whose `tissue` has 50 Zipf-sized classes (13..667 cells), stored in runs, in 18
    fragments. ~150 genes a cell, not a real cell's ~1,500: what is checked here is which cells each
    class gets, and every row read and ranked is suite time."""
    from producers.synth import SynthSpec

    spec = SynthSpec(n_cells=3000, n_genes=2000, seed=5, median_nnz=150, min_nnz=50, max_nnz=300)
    return synth_once(tmp_path_factory, "balance-atlas", spec, rows_per_fragment=25_000)


def tissues(ds) -> np.ndarray:
    """Each cell's tissue index (classes in name order), read from the obs table."""
    names = np.array(ds.obs(["tissue"]).column(0).to_pylist())
    return np.searchsorted(np.unique(names), names)


def test_quotas_are_exact_shares_by_largest_remainder():
    counts = [667, 333, 13, 13]
    assert class_quotas(counts, 0.0, 1026).tolist() == counts  # ALPHA 0: as the data is
    assert class_quotas(counts, 1.0, 1026).tolist() == [257, 257, 256, 256]  # 1: equal (ties to the first)
    for alpha in (0.25, 0.5, 0.75):
        assert class_quotas(counts, alpha, 5000).tolist() == quotas_by_hand(counts, alpha, 5000).tolist()
    with pytest.raises(CellfeedError, match="--balance-power must lie in 0..1"):
        Balance("tissue", 1.5).validate()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_every_strategy_gives_each_class_its_quota_every_epoch_without_replacement(atlas, strategy, alpha):
    """Two epochs of the producer's items, on 3 ranks: each epoch every class has exactly its
    quota; a class's cells are seen in turn (no cell a second time while one of its class is unseen);
    every rank gets every class in proportion; the plan's audit hashes are those of the items."""
    classes = tissues(atlas)
    counts = np.bincount(classes)
    expected = quotas_by_hand(counts, alpha, atlas.n_cells)
    queue, store = MemoryQueue(max_items=10**9, max_bytes=1 << 62), MemoryMap()
    config = ProducerConfig(
        dataset=atlas.uri,
        run="bal",
        world_size=3,
        max_genes=8,
        cells_per_item=40,
        sampling=STRATEGIES[strategy],
        balance=Balance("tissue", alpha),
    )
    producer = Producer(config, queue, store, dataset=atlas)
    seen = np.zeros(atlas.n_cells, dtype=np.int64)
    for epoch in range(2):
        plan = producer.plan(epoch)
        for u in range(plan.n_units):
            producer.process(epoch, u)
        per_rank = []
        for r in range(3):
            cells = Counter()
            while items := queue.get_many(1000, block=False, partition=rank_partition(r)):
                for data in items:
                    item = unpack_item(data)
                    cells.update(item.cell_ids.tolist())
                    assert (item.labels == classes[item.cell_ids]).all()  # each item carries its cells' classes
            per_rank.append(cells)
        trained = sum(per_rank, Counter())
        got = np.bincount(classes[list(trained.elements())], minlength=len(counts))
        assert got.tolist() == expected.tolist(), epoch
        assert [n for _, n in producer.class_mix(epoch)] == expected.tolist()
        assert [cells_hash(list(c.elements())) for c in per_rank] == plan.cell_hash_per_rank(3)
        for cells in per_rank:  # every rank carries the mix: each class within a unit's rounding of its share
            mine = np.bincount(classes[list(cells.elements())], minlength=len(counts))
            assert np.abs(mine - expected * sum(cells.values()) / expected.sum()).max() <= plan.n_units / 3 + 1
        seen[list(trained)] += list(trained.values())
        for k in range(len(counts)):  # without replacement: a class's cells seen as often as each other, +-1
            mine = seen[classes == k]
            assert mine.max() - mine.min() <= 1, (epoch, k)
    if alpha == 1.0:
        assert seen[classes == counts.argmin()].min() >= 2  # the smallest class repeated (13 cells, 60 a epoch)
        assert seen[classes == counts.argmax()].max() == 1  # the largest sub-sampled: no cell twice yet


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_scattered_classes_are_read_by_region_and_still_get_their_quotas(atlas, strategy, monkeypatch):
    """`cell_line` interleaves its lines cell by cell: its classes are read region by region
    (`ScatteredGroup`), so a unit reads no more ranges than a plain unit of its size does, and every
    line still gets its quota each epoch, drawn without replacement, the audit hashes matching."""
    import coordination.balance as balance

    monkeypatch.setattr(balance, "SCATTERED_RUNS", 4)  # (3,000 cells: a line has ~60 cells in ~50 runs)
    lines = np.array(atlas.obs(["cell_line"]).column(0).to_pylist())
    classes = np.searchsorted(np.unique(lines), lines)
    expected = quotas_by_hand(np.bincount(classes), 1.0, atlas.n_cells)
    config = ProducerConfig(
        dataset=atlas.uri,
        run="scattered",
        world_size=2,
        max_genes=8,
        sampling=STRATEGIES[strategy],
        balance=Balance("cell_line", 1.0),
    )
    producer = Producer(config, MemoryQueue(), MemoryMap(), dataset=atlas)
    assert producer.strata.scattered.all()
    plain = Producer(
        ProducerConfig(dataset=atlas.uri, run="plain", max_genes=8, sampling=STRATEGIES[strategy]),
        MemoryQueue(),
        MemoryMap(),
        dataset=atlas,
    ).plan(0)
    seen = np.zeros(atlas.n_cells, dtype=np.int64)
    for epoch in range(3):
        plan = producer.plan(epoch)
        units = list(plan.units())
        cells = np.concatenate([u.parts[0].cells for u in units])
        assert np.bincount(classes[cells], minlength=len(expected)).tolist() == expected.tolist()
        per_rank = [np.concatenate([u.parts[0].cells for u in units if u.id % 2 == r]) for r in range(2)]
        assert [cells_hash(c) for c in per_rank] == plan.cell_hash_per_rank(2)
        np.add.at(seen, cells, 1)
        for k in range(len(expected)):
            assert np.ptp(seen[classes == k]) <= 1, (epoch, k)
        if strategy in ("block", "sequential"):  # regions of consecutive cells: reads as the plain plan's
            ranges = sum(len(u.parts[0].ranges) for u in units) / sum(u.n_cells for u in units)
            plain_ranges = sum(len(u.parts[0].ranges) for u in plain.units()) / plain.n_cells
            assert ranges <= 1.5 * plain_ranges, (ranges, plain_ranges)


def test_a_corpus_keeps_its_weights_and_balances_each_source(tmp_path, atlas):
    """Two sources weighted 0.3 / 0.7 over 4,000 cells an epoch: each source gives its weight's
    share, and each source's share is split among its classes (count**(1 - ALPHA))."""
    from coordination.corpus_file import quotas
    from producers.synth import SynthSpec, synthesize

    spec = SynthSpec(n_cells=1200, n_genes=2000, seed=9, median_nnz=150, min_nnz=50, max_nnz=300)
    other = synthesize(str(tmp_path / "other"), spec, progress=False)
    corpus = tmp_path / "corpus.toml"
    corpus.write_text(
        "epoch_cells = 4000\n"
        f'[[source]]\nname = "a"\ndataset = "{atlas.uri}"\nweight = 0.3\n'
        f'[[source]]\nname = "b"\ndataset = "{other.uri}"\nweight = 0.7\n'
    )
    config = ProducerConfig(
        dataset="",
        corpus=str(corpus),
        run="balcorpus",
        world_size=2,
        max_genes=8,
        sampling=STRATEGIES["block"],
        balance=Balance("tissue", 0.5),
    )
    producer = Producer(config, MemoryQueue(), MemoryMap())
    source_quotas = quotas([0.3, 0.7], 4000)
    offsets = [0, atlas.n_cells]
    seen = Counter()
    for epoch in range(2):
        plan = producer.plan(epoch)
        units = [producer.plan(epoch).unit(u) for u in range(plan.n_units)]
        for s, (ds, offset) in enumerate(zip((atlas, other), offsets)):
            cells = np.concatenate([p.cells for u in units for p in u.parts if p.source == s])
            assert len(cells) == source_quotas[s]
            classes = tissues(ds)
            want = quotas_by_hand(np.bincount(classes), 0.5, source_quotas[s])
            assert np.bincount(classes[cells], minlength=len(want)).tolist() == want.tolist()
            seen.update((cells + offset).tolist())
    assert sum(seen.values()) == 8000


def test_killed_and_resumed_on_three_ranks_trains_each_class_its_quota(atlas, tmp_path):
    """The cell logs of a balanced campaign killed on 2 ranks mid-epoch and resumed on 3: the two
    runs together train the planned multiset, every class its quota, and the audit says so."""
    sampling = STRATEGIES["block"]
    balance = Balance("tissue", 1.0)

    def on(world):
        return lambda: Campaign(atlas, "balanced", epochs=1, sampling=sampling, world=world, balance=balance)

    campaign = Campaign(atlas, "balanced", epochs=1, sampling=sampling, balance=balance)
    plan = campaign.plans[0]
    planned = Counter(np.concatenate([p.cells for u in plan.units() for p in u.parts]).tolist())
    before, after, summary = kill_mid_epoch_and_resume(campaign, tmp_path, resume_on=on(3))
    trained = before + after
    assert trained == planned and max(planned.values()) >= 2  # small classes come several times
    classes = tissues(atlas)
    expected = quotas_by_hand(np.bincount(classes), 1.0, atlas.n_cells)
    assert np.bincount(classes[list(trained.elements())]).tolist() == expected.tolist()
    (audit,) = summary["audits"]
    assert audit["classes"] == expected.tolist() and "50 classes at their quotas" in audit["line"]
    assert read_cells(tmp_path / "b" / "cells", world=3)  # the resumed run trained on 3 ranks


@pytest.mark.parametrize("strategy", ["random", "sequential", "mixture"])
def test_the_cell_logs_of_every_strategy_hold_each_class_at_its_quota(atlas, tmp_path, strategy, monkeypatch):
    """One rank in this process trains two balanced epochs of each other strategy (block: above);
    the cells its log records, per epoch, hold every class at its quota."""
    import torch.distributed as dist

    from coordination.net import free_port
    from trainer.config import TrainConfig
    from trainer.train import train

    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WORLD_SIZE", "1")
    queue, store = MemoryQueue(max_items=10**9, max_bytes=1 << 62), MemoryMap()
    config = ProducerConfig(
        dataset=atlas.uri,
        run="logs",
        world_size=1,
        max_genes=8,
        idle_timeout_s=0.2,
        sampling=STRATEGIES[strategy],
        balance=Balance("tissue", 0.5),
    )
    producer = Producer(config, queue, store, dataset=atlas)
    for epoch in range(2):
        summary = PlanSummary.of(producer.plan(epoch), 1)
        summary.class_mix = producer.class_mix(epoch)
        publish_summary(store, "logs", summary)
        queue.put_many([encode_task(epoch, u) for u in range(summary.n_units)], partition=TASKS_PARTITION)
    producer.run()
    cfg = TrainConfig(
        run="logs",
        backend={"kind": "memory"},
        vocab_size=producer.vocab.size,
        batch_size=512,  # (which cells, not learning: 12 steps, not 94)
        epochs=2,
        run_driver=False,
        progress_bar=False,
        cells_log=str(tmp_path / "cells"),
    )
    try:
        result = train(cfg, queue=queue, store=store)
    finally:
        dist.destroy_process_group()
    classes = tissues(atlas)
    expected = quotas_by_hand(np.bincount(classes), 0.5, atlas.n_cells).tolist()
    by_epoch = {}
    for line in (tmp_path / "cells.rank0.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_epoch.setdefault(row["epoch"], []).extend(row["cells"])
    assert sorted(by_epoch) == [0, 1]
    for epoch, cells in by_epoch.items():
        assert np.bincount(classes[cells], minlength=len(expected)).tolist() == expected, epoch
    assert [a["classes"] for a in result["audits"]] == [expected, expected]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_a_missing_column_or_a_class_without_cells_is_refused_before_any_producer_starts(atlas, tmp_path):
    """One line each, exit 2, no run folder left: a column the dataset lacks (its columns named), and
    a category the column declares that no cell carries (an h5ad categorical's unused category)."""
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    out = run_cli("local", "--dataset", atlas.uri, "--balance-by", "organ", "--workdir", str(tmp_path), "--run", "m")
    assert out.returncode == 2 and not (tmp_path / "m").exists()
    (line,) = out.stderr.strip().splitlines()
    assert "no obs column 'organ'" in line and "tissue" in line

    x = sp.random(40, 30, density=0.3, format="csr", random_state=0, dtype=np.float32)
    x.data = np.ceil(x.data * 10)
    kinds = pd.Categorical(["lung"] * 25 + ["liver"] * 15, categories=["liver", "lung", "heart"])
    adata = ad.AnnData(x, obs=pd.DataFrame({"organ": kinds}, index=[f"c{i}" for i in range(40)]))
    adata.var_names = [f"g{i}" for i in range(30)]
    adata.write_h5ad(tmp_path / "organs.h5ad")
    assert run_cli("convert", str(tmp_path / "organs.h5ad"), str(tmp_path / "organs"), "--quiet").returncode == 0
    out = run_cli(
        "local",
        "--dataset",
        str(tmp_path / "organs"),
        "--balance-by",
        "organ",
        "--workdir",
        str(tmp_path),
        "--run",
        "e",
    )
    assert out.returncode == 2 and not (tmp_path / "e").exists()
    (line,) = out.stderr.strip().splitlines()
    assert "class 'heart'" in line and "has no cells" in line and "remove_unused_categories" in line


def test_stats_refuses_a_subset_filter_or_an_out_it_would_drop(tmp_path, capsys):
    """A --subset-filter with a corpus (its sources carry their filters, as `cellfeed local` says) or
    without --balance-by (gene medians are of every cell), an --out for one dataset (its medians are
    stored in it): each was dropped without a word."""
    from app.cli import main

    code = main(["stats", str(tmp_path / "c.toml"), "--balance-by", "tissue", "--subset-filter", "plate = 'p1'"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "cellfeed: error: --subset-filter plate = 'p1': with a corpus, give it per source in the corpus file"
    ]
    code = main(["stats", str(tmp_path / "ds"), "--subset-filter", "plate = 'p1'"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "cellfeed: error: --subset-filter plate = 'p1': only with --balance-by (medians are of every cell)"
    ]
    code = main(["stats", str(tmp_path / "ds"), "--out", "medians.json"])  # (so was --out, but with a corpus)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "cellfeed: error: --out medians.json: only with a corpus; a dataset's medians are stored in it"
    ]


def test_stats_shows_the_class_mix_balancing_would_plan(atlas):
    out = run_cli("stats", atlas.uri, "--balance-by", "tissue", "--balance-power", "1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].endswith("50 classes of tissue, ALPHA 1, 3,000 cells per epoch")
    largest = lines[2].split()  # classes by their cells in the data, the largest first
    assert largest[1] == "667" and largest[3] == "60"
