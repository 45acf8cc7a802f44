"""Producers end to end on a real Lance dataset with the in-memory queue/map: every selected
cell arrives exactly once (after dropping duplicate keys), on the right rank, with the tokens an
independent per-cell computation gives, through duplicate and crashed units."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from coordination.errors import CellfeedError
from coordination.plan import Sampling
from coordination.queues import MemoryMap, MemoryQueue
from coordination.routing import (
    EVENTS_PARTITION,
    TASKS_PARTITION,
    decode_event,
    decode_task,
    encode_task,
    epoch_map_name,
    rank_partition,
    run_tag,
)
from coordination.vocab import CLS
from coordination.wire import unpack_item
from producers.config import ProducerConfig
from producers.producer import Producer
from producers.selection import label_codes
from tests.conftest import wait_for
from tests.test_tokenizers import reference_bins

WORLD = 2


def enqueue_epoch(queue, producer: Producer, epoch: int, extra_units=()):
    """What the driver does to start an epoch: create its stitching map, issue its units."""
    plan = producer.plan(epoch)
    producer.store.named(epoch_map_name(epoch), create=True)
    tasks = [encode_task(epoch, u) for u in list(range(plan.n_units)) + list(extra_units)]
    queue.put_many(tasks, partition=TASKS_PARTITION)
    return plan


def drain(queue, run: str, epoch: int):
    """All items per rank, decoded, duplicates dropped by key: {rank: [Item]}."""
    out = {}
    for rank in range(WORLD):
        seen, items = set(), []
        for data in queue.get_many(10**6, block=False, partition=rank_partition(rank)):
            item = unpack_item(data, run_tag=run_tag(run), epoch=epoch)
            if item.key not in seen:
                seen.add(item.key)
                items.append(item)
        out[rank] = items
    return out


def check_scgpt_tokens(ds, items, n_check=40, max_genes=64):
    checked = 0
    for item in items:
        for i, cell in enumerate(item.cell_ids[:3].tolist()):
            rows = ds.read_cells(np.array([cell]))
            genes, values = rows.ids.astype(np.int64), rows.values
            order = sorted(range(len(genes)), key=lambda j: (-int(values[j]), genes[j]))[:max_genes]
            got = item.tokens[item.offsets[i] : item.offsets[i + 1]].astype(np.int64)
            np.testing.assert_array_equal(got, [CLS] + [int(genes[j]) + 4 for j in order])
            bins = reference_bins(values, 51)
            np.testing.assert_array_equal(
                item.values[item.offsets[i] : item.offsets[i + 1]], [0] + [int(bins[j]) for j in order]
            )
            checked += 1
        if checked >= n_check:
            return
    assert checked > 0


@pytest.mark.parametrize("strategy", ["sequential", "mixture", "block", "random"])
def test_every_cell_exactly_once_across_threads(small_synth, strategy):
    before = set(threading.enumerate())
    queue, store = MemoryQueue(), MemoryMap()
    config = ProducerConfig(
        dataset=small_synth.uri,
        run=f"t-{strategy}",
        seed=4,
        world_size=WORLD,
        sampling=Sampling(strategy, unit_cells=150, n_scanners=3, block_size=8, fetch_factor=4, batch_size=32),
        max_genes=64,
        cells_per_item=50,
        label_column="plate",
        idle_timeout_s=0.5,
        read_ahead=3,
        threads=2,
    )  # three units in reading at once per producer
    producers = [Producer(config, queue, store, dataset=small_synth) for _ in range(3)]
    plan = enqueue_epoch(queue, producers[0], 0, extra_units=[0, 1])  # two units produced twice
    threads = [threading.Thread(target=p.run) for p in producers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for p in producers:  # done: no thread they started outlives them (on Modal: none as the function returns)
        p.close()
    assert not [t.name for t in threading.enumerate() if t not in before and t.name.startswith("cellfeed-")]
    by_rank = drain(queue, config.run, 0)
    cells = np.concatenate([it.cell_ids for items in by_rank.values() for it in items])
    np.testing.assert_array_equal(np.sort(cells), np.arange(small_synth.n_cells))
    counts = [sum(it.n_cells for it in by_rank[r]) for r in range(WORLD)]
    assert counts == plan.cells_per_rank(WORLD).tolist()
    for rank, items in by_rank.items():
        for it in items:
            expected_rank = (it.key_id if it.stitched else it.key_id) % WORLD
            assert expected_rank == rank
    if strategy in ("sequential", "mixture"):
        assert any(it.stitched for items in by_rank.values() for it in items)
    codes, names = label_codes(small_synth, "plate")
    for it in by_rank[0][:5]:
        np.testing.assert_array_equal(it.labels, codes[it.cell_ids])
    check_scgpt_tokens(small_synth, by_rank[0] + by_rank[1])


def test_unit_output_is_identical_every_time(small_synth):
    config = ProducerConfig(
        dataset=small_synth.uri,
        run="same",
        world_size=1,
        max_genes=32,
        sampling=Sampling("block", block_size=4, fetch_factor=2, batch_size=16),
    )
    outputs = []
    for _ in range(2):
        queue = MemoryQueue()
        Producer(config, queue, MemoryMap(), dataset=small_synth).process(0, 3)
        outputs.append(queue.get_many(1000, block=False, partition=rank_partition(0)))
    assert outputs[0] == outputs[1] and len(outputs[0]) > 0


@pytest.mark.parametrize("tokenizer", ["scgpt", "raw"])
def test_chunked_threaded_tokenizing_equals_one_pass(small_synth, monkeypatch, tokenizer):
    """A unit tokenized in chunks on several threads gives exactly the items of tokenizing all its
    cells at once and packing them (item boundaries included)."""
    import producers.items as items_module
    from coordination.arrays import CellRows
    from coordination.seeds import unit_rng
    from coordination.wire import pack_items

    monkeypatch.setattr(items_module, "CHUNK_CELLS", 40)  # several chunks of 2 items each
    sampling = Sampling("block", block_size=16, fetch_factor=8, batch_size=32, min_units=1)
    config = ProducerConfig(
        dataset=small_synth.uri,
        run="chunks",
        world_size=1,
        max_genes=48,
        cells_per_item=20,
        tokenizer=tokenizer,
        sampling=sampling,
        threads=3,
    )
    producer = Producer(config, MemoryQueue(), MemoryMap(), dataset=small_synth)
    unit = producer.plan(0).unit(2)
    assert unit.n_cells > 3 * 40
    queue = MemoryQueue()
    producer.queue = producer.courier.queue = queue
    producer.process(0, 2)
    got = queue.get_many(10**6, block=False, partition=rank_partition(0))

    cells = unit.parts[0].cells[unit_rng(0, 0, 2).permutation(unit.n_cells)]  # the one-pass reference
    block = small_synth.read_cells(cells)
    rows = CellRows(
        cells,
        np.concatenate([[0], np.cumsum(np.diff(small_synth.cell_row_start)[cells])]),
        block.ids.astype(np.int64) + 4,
        block.values,
    )  # the built vocabulary: gene g is token g + 4
    expected = pack_items(
        producer.tokenizer(rows, None), epoch=0, key_id=2, run_tag=run_tag("chunks"), cells_per_item=20
    )
    assert got == expected


class CrashingQueue(MemoryQueue):
    """Raises once after `after` successful puts, like a producer killed mid-unit."""

    def __init__(self, after):
        super().__init__()
        self.after = after

    def put_many(self, values, block=True, timeout=None, *, partition=None):
        if partition not in (TASKS_PARTITION, EVENTS_PARTITION):
            if self.after == 0:
                self.after = -1
                raise RuntimeError("killed")
            self.after -= 1
        super().put_many(values, block, timeout, partition=partition)


def test_crash_mid_unit_then_rerun_delivers_exactly_once(small_synth):
    queue, store = CrashingQueue(after=1), MemoryMap()
    config = ProducerConfig(
        dataset=small_synth.uri,
        run="crash",
        world_size=WORLD,
        max_genes=16,
        sampling=Sampling("sequential", unit_cells=400),
        cells_per_item=40,
        idle_timeout_s=0.2,
    )
    producer = Producer(config, queue, store, dataset=small_synth)
    plan = enqueue_epoch(queue, producer, 0)
    with pytest.raises(CellfeedError, match="sending failed: killed"):
        producer.run()
    # the crashed unit (and those read ahead) were taken but never reported done: the driver
    # re-issues them once nobody names them held for a lease (here: by hand)
    events = [decode_event(e) for e in queue.get_many(1000, block=False, partition=EVENTS_PARTITION)]
    done = {u for e in events for _, u in e["done"]}
    queued = {decode_task(t)[1] for t in queue.get_many(1000, block=False, partition=TASKS_PARTITION)}
    crashed = sorted(set(range(plan.n_units)) - done - queued)
    assert len(crashed) >= 1
    queue.put_many([encode_task(0, u) for u in sorted(queued)], partition=TASKS_PARTITION)
    queue.put_many([encode_task(0, u) for u in crashed], partition=TASKS_PARTITION)
    Producer(config, queue, store, dataset=small_synth).run()
    by_rank = drain(queue, config.run, 0)
    cells = np.concatenate([it.cell_ids for items in by_rank.values() for it in items])
    np.testing.assert_array_equal(np.sort(cells), plan.selected)


def test_subset_filter_selects_cells(small_synth):
    queue, store = MemoryQueue(), MemoryMap()
    config = ProducerConfig(
        dataset=small_synth.uri,
        run="subset",
        world_size=WORLD,
        max_genes=8,
        subset_filter="plate != 'plate01'",
        sampling=Sampling("mixture", unit_cells=200),
        idle_timeout_s=0.2,
    )
    producer = Producer(config, queue, store, dataset=small_synth)
    enqueue_epoch(queue, producer, 0)
    producer.run()
    plates = np.array(small_synth.obs(["plate"]).column(0).to_pylist())
    cells = np.concatenate([it.cell_ids for items in drain(queue, "subset", 0).values() for it in items])
    np.testing.assert_array_equal(np.sort(cells), np.flatnonzero(plates != "plate01"))


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(tokenizer="bert"), "unknown tokenizer"),
        (dict(max_genes=0), "max_genes must be >= 1"),
        (dict(sampling=Sampling("block", block_size=0)), "block_size must be >= 1"),
        (dict(sampling=Sampling("block", fetch_factor=0)), "fetch_factor must be >= 1"),
        (dict(sampling=Sampling("zigzag")), "unknown strategy"),
        (dict(reads_in_flight=0), r"reads_in_flight must be 1\.\.256, got 0"),
        (dict(subset_filter="plate = 'nope'"), "selects no cells"),
        (
            dict(subset_filter="no_such_column > 1"),
            r"^bad --subset-filter 'no_such_column > 1': .*No field named "
            r"no_such_column\. Valid fields are cell_id, plate[^/]*$",
        ),
        (
            dict(subset_filter="plate = "),
            r"^bad --subset-filter 'plate = ': .*Expected: an expression.*\(obs columns: "
            r"cell_id, plate, [^/]*\)$",
        ),
        (dict(tokenizer="geneformer"), "cellfeed stats"),
    ],
)
def test_bad_settings_fail_before_any_work(small_synth, change, needle):
    queue = MemoryQueue()
    queue.put_many([encode_task(0, 0)], partition=TASKS_PARTITION)
    config = ProducerConfig(dataset=small_synth.uri, run="bad", **change)
    with pytest.raises(CellfeedError, match=needle):
        Producer(config, queue, MemoryMap(), dataset=small_synth)
    assert queue.len(partition=TASKS_PARTITION) == 1  # nothing was taken


def test_float_dataset_refused_by_count_tokenizer(tmp_path):
    from producers.convert import convert
    from tests.conftest import random_counts, write_h5ad

    ds = convert(
        [str(write_h5ad(tmp_path / "f.h5ad", random_counts(20, 30, seed=1, floats=True)))],
        str(tmp_path / "ds"),
        progress=False,
    )
    with pytest.raises(CellfeedError, match="needs integer counts"):
        Producer(ProducerConfig(dataset=ds.uri, run="f", tokenizer="geneformer"), MemoryQueue(), MemoryMap())


@pytest.mark.parametrize("strategy", ["sequential", "mixture"])
def test_cells_cut_into_many_pieces(tmp_path, strategy):
    """Fragments smaller than a cell: cells in 2..4 pieces, several pieces of one cell in one unit."""
    from producers.synth import SynthSpec, synthesize

    ds = synthesize(
        str(tmp_path / "tiny"),
        SynthSpec(n_cells=120, n_genes=5000, n_plates=2, seed=3),
        rows_per_fragment=700,
        progress=False,
    )
    queue, store = MemoryQueue(), MemoryMap()
    config = ProducerConfig(
        dataset=ds.uri,
        run="tiny",
        world_size=WORLD,
        max_genes=4096,
        idle_timeout_s=0.3,
        sampling=Sampling(strategy, unit_cells=3, n_scanners=16),
    )
    producers = [Producer(config, queue, store, dataset=ds) for _ in range(2)]
    plan = enqueue_epoch(queue, producers[0], 0)
    assert plan.boundary_piece_counts.max() >= 3
    threads = [threading.Thread(target=p.run) for p in producers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    items = [it for its in drain(queue, "tiny", 0).values() for it in its]
    cells = np.concatenate([it.cell_ids for it in items])
    np.testing.assert_array_equal(np.sort(cells), np.arange(ds.n_cells))
    for it in items:  # every cell carries all its genes (max_genes exceeds any cell)
        for i, cell in enumerate(it.cell_ids.tolist()):
            n = ds.cell_row_start[cell + 1] - ds.cell_row_start[cell]
            assert it.offsets[i + 1] - it.offsets[i] == n + 1


def _counts_dataset(path, dense: np.ndarray, rows_per_fragment: int):
    import pyarrow as pa

    from producers.writer import DatasetWriter

    n_cells, n_genes = dense.shape
    with DatasetWriter(path, n_genes=n_genes, value_type=pa.uint16(), rows_per_fragment=rows_per_fragment) as w:
        indptr = np.concatenate([[0], np.cumsum((dense > 0).sum(axis=1))])
        w.append(
            pa.table({"cell_id": [f"c{i}" for i in range(n_cells)]}), indptr, np.nonzero(dense)[1], dense[dense > 0]
        )
        return w.commit(pa.table({"gene_id": [f"g{j}" for j in range(n_genes)]}))


def geneformer_medians(dense: np.ndarray) -> np.ndarray:
    """Independently: per gene, the median over cells where it is non-zero of x / n_counts * 10,000."""
    norm = dense / dense.sum(axis=1, keepdims=True) * 10_000.0
    return np.array(
        [np.median(norm[dense[:, j] > 0, j]) if (dense[:, j] > 0).any() else 0.0 for j in range(dense.shape[1])]
    )


def test_gene_medians_known_answers(tmp_path):
    from producers.gene_stats import compute_gene_medians

    # cell totals 10, 20, 40, 50. gene 0: 1/10, 2/20, 10/40 -> 1000, 1000, 2500 -> median 1000; gene 1:
    # 9/10, 30/40 -> 9000, 7500 -> an even count takes the mean, 8250; gene 2: never expressed -> 0;
    # gene 3: 18/20, 50/50 -> 9000, 10000 -> 9500
    dense = np.array([[1, 9, 0, 0], [2, 0, 0, 18], [10, 30, 0, 0], [0, 0, 0, 50]])
    ds = _counts_dataset(tmp_path / "ds", dense, rows_per_fragment=3)
    expected = [1000.0, 8250.0, 0.0, 9500.0]
    np.testing.assert_array_equal(compute_gene_medians(ds, progress=False), expected)
    np.testing.assert_array_equal(geneformer_medians(dense), expected)


@pytest.mark.parametrize("collect_limit", [1, 40, 1 << 24])  # every radix pass down to the last bit .. one pass
def test_gene_medians_equal_an_independent_computation(tmp_path, collect_limit):
    from producers.gene_stats import compute_gene_medians

    rng = np.random.default_rng(7)
    dense = rng.integers(0, 4, size=(300, 40)) * rng.integers(1, 600, size=(300, 40))
    dense[:, 3] = 0  # never expressed
    dense[:, 5] = np.where(rng.random(300) < 0.5, 7, 0)  # ties
    dense[0] = 0  # an empty cell
    ds = _counts_dataset(tmp_path / "ds", dense, rows_per_fragment=97)  # cells straddle fragments
    got = compute_gene_medians(ds, progress=False, collect_limit=collect_limit, chunk_rows=1000)
    np.testing.assert_array_equal(got, geneformer_medians(np.asarray(dense[1:], dtype=np.float64)))


def test_gene_medians_and_geneformer_producer(tmp_path, capsys):
    from app.cli import main as cli
    from producers.dataset import open_dataset
    from producers.gene_stats import load_gene_medians

    rng = np.random.default_rng(2)
    n_cells, n_genes = 80, 30
    dense = rng.integers(1, 4, size=(n_cells, n_genes)) * rng.integers(0, 600, size=(n_cells, n_genes))
    dense[:, 0] += 1  # no empty cell
    _counts_dataset(tmp_path / "ds", dense, rows_per_fragment=300)
    assert cli(["stats", str(tmp_path / "ds"), "--quiet"]) == 0
    assert "WARN" not in capsys.readouterr().err  # Lance's "no existing dataset" warning stays out
    ds = open_dataset(tmp_path / "ds")
    expected = geneformer_medians(dense.astype(np.float64))
    np.testing.assert_array_equal(load_gene_medians(ds), expected)
    assert cli(["stats", str(tmp_path / "ds"), "--quiet"]) == 0  # again: replaces the table
    np.testing.assert_array_equal(load_gene_medians(open_dataset(tmp_path / "ds")), expected)
    for version in ("geneformer-v1", "geneformer-v2"):
        queue, store = MemoryQueue(), MemoryMap()
        config = ProducerConfig(
            dataset=ds.uri,
            run="gf",
            tokenizer=version,
            max_genes=10,
            world_size=1,
            sampling=Sampling("block", block_size=4, fetch_factor=1, batch_size=8),
            idle_timeout_s=0.2,
        )
        producer = Producer(config, queue, store, dataset=ds)
        enqueue_epoch(queue, producer, 0)
        producer.run()
        items = drain(queue, "gf", 0)[0]  # world size 1: everything on rank 0
        assert sorted(np.concatenate([it.cell_ids for it in items]).tolist()) == list(range(n_cells))
        for it in items[:3]:
            cell = int(it.cell_ids[0])
            row = dense[cell].astype(np.float64)
            genes = np.flatnonzero(row)
            norm = row[genes] / row.sum() * 10_000.0 / expected[genes]
            ranked = [genes[j] + 4 for j in sorted(range(len(genes)), key=lambda j: (-norm[j], genes[j]))[:10]]
            want = ranked if version == "geneformer-v1" else [1] + ranked + [2]
            np.testing.assert_array_equal(it.tokens[it.offsets[0] : it.offsets[1]], want)


def test_a_stop_is_noticed_within_seconds_while_blocked_on_a_full_partition(small_synth):
    from coordination.queues import Full
    from coordination.routing import stop_key

    class WatchedQueue(MemoryQueue):
        """Counts, per partition, the puts refused as full and the lengths looked at since."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.refused, self.looks_since_refused = {}, {}

        def put_many(self, values, block=True, timeout=None, *, partition=None):
            try:
                super().put_many(values, block, timeout, partition=partition)
            except Full:
                self.refused[partition] = self.refused.get(partition, 0) + 1
                self.looks_since_refused[partition] = 0
                raise

        def len(self, *, partition=None, total=False):
            if partition in self.looks_since_refused:
                self.looks_since_refused[partition] += 1
            return super().len(partition=partition, total=total)

    queue, store = WatchedQueue(max_items=100), MemoryMap()  # the trainer consumes nothing: backpressure
    config = ProducerConfig(
        dataset=small_synth.uri,
        run="stop",
        world_size=1,
        max_genes=8,
        cells_per_item=1,
        sampling=Sampling("sequential", unit_cells=300),
        heartbeat_s=0.5,
        idle_timeout_s=60,
    )
    producer = Producer(config, queue, store, dataset=small_synth)
    enqueue_epoch(queue, producer, 0)
    thread = threading.Thread(target=producer.run)
    thread.start()
    # blocked: a put to the full partition was refused and the producer has looked at its length again since
    # (the look that marks it full, then its waits for room)
    wait_for(
        lambda: queue.looks_since_refused.get(rank_partition(0), 0) >= 3 or not thread.is_alive(),
        "the producer waiting for room in its full partition",
        timeout=60,
    )
    assert thread.is_alive() and queue.len(partition=rank_partition(0)) > 100 - 32  # puts go 32 at a time
    store.put(stop_key("stop"), "stop")
    # a heartbeat (0.5 s) and a back-off (2 s at most) apart; the bound separates noticing the stop from never
    # noticing it (put_timeout_s is 600 s, idle_timeout_s 60 s), generously for a busy machine
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_the_courier_sends_the_jobs_waiting_together_each_units_done_after_its_items():
    """Under a queue's per-call latency a call per unit capped a producer (~20 units/s at Modal's
    25 ms): the jobs waiting behind the one being sent go out together: each partition's items in
    the order posted, in one request, then one event naming their units."""
    from coordination.routing import EVENTS_PARTITION, decode_event
    from producers.courier import Courier

    class GatedQueue(MemoryQueue):  # an items put waits at the gate until every job is posted
        def __init__(self):
            super().__init__()
            self.entered, self.gate, self.puts = threading.Event(), threading.Event(), []

        def put_many(self, values, block=True, timeout=None, *, partition=None):
            if partition != EVENTS_PARTITION:
                self.entered.set()
                assert self.gate.wait(30)
                self.puts.append((partition, list(values)))
            return super().put_many(values, block, timeout, partition=partition)

    queue = GatedQueue()
    courier = Courier(
        queue, MemoryMap(), run="r", name="p", heartbeat_s=60, put_timeout_s=30, totals=dict,
        stopping=threading.Event(),
    )  # fmt: skip
    courier.start()
    for u in range(6):
        courier.hold(0, u)
        courier.post([(f"rank-{u % 2}", [b"item-%d" % u])], (0, u))
        if u == 0:  # (the event: the courier is sending unit 0's items)
            assert queue.entered.wait(30)
    queue.gate.set()
    courier.finish()
    courier.join()
    assert courier.error is None
    # unit 0 was on its way alone; the five behind it went as one request per partition
    assert queue.puts == [("rank-0", [b"item-0"]), ("rank-1", [b"item-1", b"item-3", b"item-5"]),
                          ("rank-0", [b"item-2", b"item-4"])]  # fmt: skip
    events = [decode_event(e) for e in queue.get_many(100, block=False, partition=EVENTS_PARTITION)]
    assert [e["done"] for e in events if e["done"]] == [[(0, 0)], [(0, u) for u in range(1, 6)]]
    assert events[-1]["held"] == []


def test_read_ahead_on_local_disk_stays_one_unit_ahead_however_slow_reads_look(small_synth):
    """`Producer.read_ahead` sizes the read-ahead as 1 + read time / work time, but on local disk at
    most `LOCAL_READ_AHEAD`: a local read is CPU work beside the tokenizing, so a read timed while
    others queue looks slower and the estimate grew with its own depth (a balanced unit's read:
    0.06 s alone, 0.25-0.36 s at the depth it reached)."""
    from producers.producer import LOCAL_READ_AHEAD

    producer = Producer(
        ProducerConfig(dataset=small_synth.uri, run="ahead"), MemoryQueue(), MemoryMap(), dataset=small_synth
    )
    try:
        assert producer.read_ahead() == 1  # nothing measured yet: a guess
        producer._unit_work_s.extend([0.1] * 8)
        producer._unit_bytes = 1 << 20
        producer.stats.unit_read_s.extend([0.05] * 8)
        assert producer.read_ahead() == 2  # a read shorter than a unit's work: one ahead covers it
        producer.stats.unit_read_s.extend([1.0] * 8)
        assert producer.read_ahead() == LOCAL_READ_AHEAD == 2  # not 1 + 1.0 / 0.1 = 11
    finally:
        producer.close()
