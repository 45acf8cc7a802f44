"""End to end on the memory backend: driver, producers (threads) and one consumer stream per
rank (threads) over 2 epochs. Each epoch delivers exactly the selected cell multiset across
ranks — boundary cells included, duplicates dropped — and every rank takes the same number of
steps. Bad items and missing producers end in clear errors, never hangs."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from coordination.driver import Driver
from coordination.errors import CellfeedError
from coordination.latency import with_latency
from coordination.plan import Sampling
from coordination.queues import MemoryMap, MemoryQueue
from coordination.routing import TASKS_PARTITION, encode_task, rank_partition, run_tag
from coordination.summary import PlanSummary, publish_summary
from coordination.wire import Item, pack_item
from producers.config import ProducerConfig
from producers.producer import Producer
from tests.conftest import synth_once, wait_for
from trainer.stream import ConsumerStream

EPOCHS = [0, 1]


class LosesReplies:
    """A queue whose n-th get of a rank's items (n in `which`) loses them: the server gave them out
    and the reply never came; the caller's retry sees the next items (modal 1.6.4's client, S21)."""

    def __init__(self, inner, which):
        self.inner, self.which, self.gets, self.lost = inner, set(which), 0, 0
        self.lock = threading.Lock()

    def get_many(self, n, block=True, timeout=None, *, partition=None):
        out = self.inner.get_many(n, block, timeout, partition=partition)
        if out and (partition or "").startswith("rank-"):
            with self.lock:
                self.gets += 1
                hit = self.gets in self.which
            if hit:
                self.lost += len(out)
                return self.inner.get_many(n, False, partition=partition)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="session")  # data only: built once per session (`built_once`), whatever order tests run in
def atlas(tmp_path_factory):
    """3,000 cells in 14 plates, ~200 genes a cell over 2,000 (not `small_synth`'s ~1,500 over 62,710:
    what is checked here is which cells each rank gets, and every row read and tokenized is suite time),
    in fragments of 30,000 rows: ~20 fragments, cells straddling their edges (the stitched cells)."""
    from producers.synth import SynthSpec

    spec = SynthSpec(n_cells=3000, n_genes=2000, seed=7, median_nnz=200, min_nnz=60, max_nnz=400)
    return synth_once(tmp_path_factory, "exactly-once-atlas", spec, rows_per_fragment=30_000)


def run_campaign(
    ds,
    *,
    producers: int,
    world: int,
    sampling: Sampling,
    duplicate_units=(),
    batch_size=32,
    run="e2e",
    subset_filter=None,
    latency_ms: float = 0.0,
    lose_gets=(),
):
    """`lose_gets`: the rank gets whose replies are lost (`LosesReplies`); the ranks then ask for
    the units they miss (`trainer.exactly_once.ask_again`), and the driver lingers to answer."""
    from types import SimpleNamespace

    from trainer.checkpoint import RankProgress
    from trainer.exactly_once import ask_again

    queue, store = MemoryQueue(), MemoryMap()
    registry = store._registry
    if latency_ms:  # every call a round trip: a protocol that is O(in-flight) per pass shows up here
        queue, store, _ = with_latency(queue, store, latency_ms, latency_ms / 2)
    config = ProducerConfig(
        dataset=ds.uri,
        run=run,
        seed=11,
        world_size=world,
        sampling=sampling,
        max_genes=16,
        cells_per_item=37,
        idle_timeout_s=1.0,
        subset_filter=subset_filter,
    )
    workers = [Producer(config, queue, store, dataset=ds) for _ in range(producers)]
    summaries = {e: PlanSummary.of(workers[0].plan(e), world) for e in EPOCHS}  # the campaign's setup step
    for summary in summaries.values():
        publish_summary(store, run, summary)
    for epoch, unit in duplicate_units:  # a unit produced twice (two producers took it)
        queue.put_many([encode_task(epoch, unit)], partition=TASKS_PARTITION)
    driver = Driver(queue, store, run, poll_s=0.05, stall_timeout_s=60)
    driver_thread = driver.start(EPOCHS, linger=bool(lose_gets))
    consumer_queue = LosesReplies(queue, lose_gets) if lose_gets else queue
    producer_threads = [threading.Thread(target=w.run) for w in workers]
    for t in producer_threads:
        t.start()
    delivered = {e: [[] for _ in range(world)] for e in EPOCHS}
    steps = {e: [0] * world for e in EPOCHS}
    errors = []

    def consume(rank):
        def asked(e, batches):
            ask_again(queue, store, SimpleNamespace(run=run), rank, world, e, batches, summaries, RankProgress(0))

        stream = ConsumerStream(
            consumer_queue,
            rank=rank,
            world_size=world,
            run=run,
            batch_size=batch_size,
            buffer_cells=200,
            no_data_timeout_s=60,
            poll_s=0.05,
            on_starved=asked if lose_gets else None,
            starved_after_s=0.3,
        )
        try:
            for e in EPOCHS:
                for batch in stream.epoch(e, summaries[e].cells_per_rank):
                    delivered[e][rank].extend(batch.cell_ids.tolist())
                    steps[e][rank] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            stream.close()

    consumers = [threading.Thread(target=consume, args=(r,)) for r in range(world)]
    for t in consumers:
        t.start()
    for t in consumers:
        t.join(timeout=180)
    if lose_gets:  # (a lingering driver ends when told; the trainer tells it when training is over)
        assert consumer_queue.lost > 0
        driver.stop()
    for t in producer_threads + [driver_thread]:
        t.join(timeout=180)
    assert not errors, errors
    assert driver.error is None, driver.error
    run_campaign.last_driver = driver
    return summaries, delivered, steps, registry, workers[0]


CASES = [
    (1, 1, Sampling("block", block_size=8, fetch_factor=4, batch_size=32)),
    (2, 2, Sampling("mixture", unit_cells=120, n_scanners=3)),
    (4, 3, Sampling("block", block_size=16, fetch_factor=2, batch_size=32)),
    (3, 2, Sampling("mixture", unit_cells=64, n_scanners=2)),
    (2, 3, Sampling("sequential", unit_cells=300)),
]


@pytest.mark.parametrize("latency_ms", [0.0, 3.0], ids=["instant", "3ms-calls"])
@pytest.mark.parametrize("producers, world, sampling", CASES, ids=[f"{p}p-{w}r-{s.strategy}" for p, w, s in CASES])
def test_each_epoch_delivers_every_cell_exactly_once(atlas, producers, world, sampling, latency_ms):
    summaries, delivered, steps, registry, producer = run_campaign(
        atlas,
        producers=producers,
        world=world,
        sampling=sampling,
        duplicate_units=[(0, 0), (1, 2)],
        latency_ms=latency_ms,
    )
    for e in EPOCHS:
        everything = Counter(c for rank in delivered[e] for c in rank)
        assert everything == Counter(range(atlas.n_cells))  # no loss, no duplicate
        assert [len(r) for r in delivered[e]] == summaries[e].cells_per_rank
        assert len(set(steps[e])) == 1 and steps[e][0] == summaries[e].steps(32)
        if sampling.strategy != "block":
            assert len(summaries[e].boundary_cells) > 0
    # epochs differ in order; the driver cleared the coordination keys of finished epochs
    assert delivered[0] != delivered[1]
    assert registry == {}  # every epoch's stitching map was dropped whole


def test_subset_epochs_deliver_exactly_the_subset(atlas):
    summaries, delivered, _, _, _ = run_campaign(
        atlas,
        producers=2,
        world=2,
        sampling=Sampling("mixture", unit_cells=100, n_scanners=4),
        subset_filter="plate >= 'plate05'",
        run="subset",
    )
    plates = np.array(atlas.obs(["plate"]).column(0).to_pylist())
    wanted = Counter(np.flatnonzero(plates >= "plate05").tolist())
    for e in EPOCHS:
        assert Counter(c for rank in delivered[e] for c in rank) == wanted


def test_foreign_and_corrupt_items_are_refused(atlas):
    queue = MemoryQueue()
    stream = ConsumerStream(queue, rank=0, world_size=1, run="mine", batch_size=4, no_data_timeout_s=5, poll_s=0.05)
    item = Item(
        0, 0, 0, False, run_tag("someone-else"), 1, np.array([1]), np.array([0, 2]), np.array([1, 5], dtype=np.uint16)
    )
    queue.put_many([pack_item(item)], partition=rank_partition(0))
    with pytest.raises(CellfeedError, match="another run"):
        next(iter(stream.epoch(0, [10])))
    stream.close()
    stream = ConsumerStream(queue, rank=0, world_size=1, run="mine", batch_size=4, no_data_timeout_s=5, poll_s=0.05)
    good = pack_item(
        Item(0, 0, 0, False, run_tag("mine"), 1, np.array([1]), np.array([0, 2]), np.array([1, 5], dtype=np.uint16))
    )
    queue.put_many([good[:-4] + b"\0\0\0\0"], partition=rank_partition(0))
    with pytest.raises(CellfeedError, match="checksum"):
        next(iter(stream.epoch(0, [10])))
    stream.close()


def test_no_producer_is_a_bounded_reported_wait():
    stream = ConsumerStream(
        MemoryQueue(), rank=1, world_size=2, run="idle", batch_size=4, no_data_timeout_s=0.5, poll_s=0.05
    )
    with pytest.raises(CellfeedError, match="no data for 0s in epoch 0 with 7 of 7 cells still expected"):
        next(iter(stream.epoch(0, [3, 7])))
    stream.close()
    store = MemoryMap()
    publish_summary(store, "idle", PlanSummary(0, "p", 3, 10, 1, [10]))
    driver = Driver(MemoryQueue(), store, "idle", poll_s=0.05, stall_timeout_s=0.5)
    with pytest.raises(CellfeedError, match="no unit finished in 0s with 3 left: are the producers running"):
        driver.run_epochs([0])


def test_a_token_budget_batches_the_drawn_cells_that_fit_and_the_epoch_ends_when_no_cell_is_left():
    """`tokens_per_batch`: each batch is the cells drawn from the buffer, in their drawn order, while
    their tokens fit the budget (at most `batch_size` of them), so the cells per batch vary with the
    cells' lengths; the epoch has no step count ahead, and ends once the trainer says no rank has a
    cell left (as its all-reduce does, `EpochIterator.end`): every cell once, none twice."""
    rng, packed = np.random.default_rng(5), []
    for unit in range(3):  # 3 units of one item each: 40 cells of 1..30 tokens
        lengths = rng.integers(1, 31, size=40)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = rng.integers(10, 60, size=int(offsets[-1])).astype(np.uint16)
        cells = np.arange(40 * unit, 40 * unit + 40)
        packed.append(pack_item(Item(0, unit, 0, False, run_tag("budget"), 1, cells, offsets, tokens)))

    def stream(budget):
        queue = MemoryQueue()
        queue.put_many(packed, partition=rank_partition(0))
        return ConsumerStream(
            queue, rank=0, world_size=1, run="budget", batch_size=16, tokens_per_batch=budget,
            no_data_timeout_s=10, poll_s=0.05,
        )  # fmt: skip

    plain = stream(None)
    drawn = next(iter(plain.epoch(0, [120])))  # 16 cells, as without a budget
    plain.close()
    budgeted = stream(100)
    batches, sizes, trained = budgeted.epoch(0, [120]), [], Counter()
    assert batches.steps is None and not batches.finished
    for batch in batches:
        tokens = int(batch.lengths.sum())
        assert batch.size <= 16 and (tokens <= 100 or batch.size == 1)
        if not sizes:  # the first: the same draw's cells, from the first, while they fit
            assert batch.cell_ids.tolist() == drawn.cell_ids[: batch.size].tolist()
            assert tokens + int(drawn.lengths[batch.size]) > 100
        sizes.append(batch.size)
        trained.update(batch.cell_ids.tolist())
        if batches.cells_left == 0:  # (the trainer: when the step's all-reduce says no rank has one left)
            batches.end()
    budgeted.close()
    assert trained == Counter(range(120))  # every cell once
    assert batches.finished and batches.steps == len(sizes)
    assert len(set(sizes)) > 2 and max(sizes) < 16  # the cells per batch vary with their lengths


def test_a_batch_drawn_ahead_is_the_batch_drawn_then_and_one_put_back_is_given_back():
    """`prepare` (the trainer: while the accelerator runs a step) draws and collates the next batch
    early: the epoch's batches are the same cells in the same order as drawn one at a time (a buffer
    smaller than the epoch, so draws ahead interleave with its refills; batches of cells and of a
    token budget); a prepared batch put back (a stop) returns its cells to the buffer, so
    `give_back` returns its item; what drawing ahead raises is raised where the batch is taken."""
    rng, packed = np.random.default_rng(9), []
    for unit in range(3):
        offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 9, size=40))]).astype(np.int64)
        tokens = rng.integers(10, 60, size=int(offsets[-1])).astype(np.uint16)
        cells = np.arange(40 * unit, 40 * unit + 40)
        packed.append(pack_item(Item(0, unit, 0, False, run_tag("ahead"), 1, cells, offsets, tokens)))

    def stream(items=packed, **settings):
        queue = MemoryQueue()
        queue.put_many(items, partition=rank_partition(0))
        return queue, ConsumerStream(queue, rank=0, world_size=1, run="ahead", poll_s=0.05, **settings)

    for budget in (None, 40):
        epochs = []
        for ahead in (False, True):
            _, s = stream(batch_size=16, buffer_cells=50, tokens_per_batch=budget)
            batches, drawn = s.epoch(0, [120]), []
            for batch in batches:
                drawn.append(batch.cell_ids.tolist())
                if batches.cells_left == 0 and budget:
                    batches.end()
                elif ahead:
                    batches.prepare()
                    assert batches._ahead is not None or batches.step == batches.steps  # (none after the last)
            s.close()
            epochs.append(drawn)
        assert epochs[0] == epochs[1] and len(epochs[0]) >= 8  # the same batches, cell by cell
        assert Counter(c for b in epochs[1] for c in b) == Counter(range(120))

    # one item of 40 cells, batches of 20: the batch drawn ahead holds all the item has left
    queue, stopped = stream(packed[:1], batch_size=20)
    batches = stopped.epoch(0, [40])
    assert next(batches).size == 20
    batches.prepare()  # drawn ahead; then a stop: it is never trained
    assert batches.buffer == [] and batches._ahead is not None
    assert stopped.give_back(batches) == 1  # the item is back in the partition for the resumed run
    assert len(queue.get_many(10, block=False, partition=rank_partition(0))) == 1

    _, starved = stream(packed[:1], batch_size=30, buffer_cells=30, no_data_timeout_s=0.3)  # 40 of 60 come
    batches = starved.epoch(0, [60])
    next(batches)
    batches.prepare()  # the 20 cells missing: the wait runs out here and is kept ...
    with pytest.raises(CellfeedError, match="no data for 0s in epoch 0 with 20 of 60 cells still expected"):
        next(batches)  # ... for where the batch is taken
    starved.close()


def test_a_starved_rank_answers_a_stop_with_what_it_holds_and_its_epoch_is_cut():
    """Producers stalled, a stop asked: the rank stops waiting for cells (within its poll), yields a
    batch of what its buffer holds (here the one item that came), and its epoch is not finished (no
    audit; the resume trains the rest). Without the stop the same wait runs to its timeout."""
    queue, asked = MemoryQueue(), []
    stream = ConsumerStream(
        queue, rank=0, world_size=1, run="mine", batch_size=4, no_data_timeout_s=60, poll_s=0.05,
        stop_asked=lambda: bool(asked),
    )  # fmt: skip
    item = Item(0, 0, 0, False, run_tag("mine"), 1, np.array([7]), np.array([0, 2]), np.array([1, 5], dtype=np.uint16))
    queue.put_many([pack_item(item)], partition=rank_partition(0))
    batches = stream.epoch(0, [10])  # 10 cells planned, 1 will come
    threading.Timer(0.3, lambda: asked.append(True)).start()  # the stop, while the rank waits for the other 9
    batch = next(batches)  # (without the stop: "no data for 60s" raised)
    assert batch.cell_ids.tolist() == [7] and batches.cut and not batches.finished
    stream.close()


def test_items_a_lost_reply_took_are_asked_for_again_and_every_epoch_is_exact(atlas):
    """Three gets of ranks' items lose their replies (the items are gone, the callers never saw
    them): each rank that misses cells asks, once its partition stays empty, for the units it has
    not all received; the driver produces again those it had finished (re-opening a complete epoch
    if it must), and every epoch delivers its exact multiset, boundary cells included."""
    world = 2
    summaries, delivered, steps, _, producer = run_campaign(
        atlas,
        producers=2,
        world=world,
        sampling=Sampling("block", block_size=8, fetch_factor=2, batch_size=16),
        batch_size=16,
        lose_gets=(2, 7, 15),
    )
    for e in EPOCHS:
        assert Counter(c for rank in delivered[e] for c in rank) == Counter(range(atlas.n_cells)), f"epoch {e}"
        assert len(set(steps[e])) == 1
    assert run_campaign.last_driver.stats.redone >= 1


def test_a_resumed_driver_does_not_produce_again_what_an_earlier_one_produced_ahead(atlas):
    """The driver publishes, per epoch, the units it has seen done. A driver resumed at epoch 0
    issues epoch 0's units again (the checkpoint says what was trained) but not epoch 1's units the
    earlier driver saw done: their items are in the queue. One a rank then asks for is issued."""
    import json

    from coordination.routing import EVENTS_PARTITION, decode_task, encode_event, produced_key

    queue, store = MemoryQueue(), MemoryMap()
    config = ProducerConfig(
        dataset=atlas.uri,
        run="ahead",
        world_size=1,
        max_genes=8,
        idle_timeout_s=0.5,
        sampling=Sampling("sequential", unit_cells=100),
    )
    producer = Producer(config, queue, store, dataset=atlas)
    summaries = [PlanSummary.of(producer.plan(e), 1) for e in EPOCHS]
    for summary in summaries:
        publish_summary(store, "ahead", summary)
    n0, n1 = summaries[0].n_units, summaries[1].n_units
    earlier = {"world_size": 1, "epochs": {"0": [[0, n0]], "1": [[0, n1 - 2]]}}  # an earlier driver's record
    store.put(produced_key("ahead"), json.dumps(earlier))
    other = Driver(queue, store, "ahead", world_size=2)  # on another number of ranks, the record does not hold
    assert other._produced_before() == {}
    driver = Driver(queue, store, "ahead", poll_s=0.05, stall_timeout_s=30, world_size=1)
    thread = driver.start(EPOCHS, resume_epoch=0, linger=True)
    issued = []
    while len(issued) < n0 + 2:  # take the tasks as a producer would, and report them done
        for data in queue.get_many(100, timeout=10, partition=TASKS_PARTITION):
            issued.append(decode_task(data))
            queue.put_many([encode_event("p0", done=[issued[-1]])], partition=EVENTS_PARTITION)
    assert sorted(issued) == [(0, u) for u in range(n0)] + [(1, n1 - 2), (1, n1 - 1)]
    wait_for(lambda: driver.stats.epochs == 2, "both epochs to complete")
    assert driver.stats.already_produced == n1 - 2
    queue.put_many([encode_event("rank-0", redo=[(1, 3)])], partition=EVENTS_PARTITION)  # a rank misses unit 3
    assert decode_task(queue.get_many(1, timeout=10, partition=TASKS_PARTITION)[0]) == (1, 3)
    wait_for(
        lambda: json.loads(store.get(produced_key("ahead")))["epochs"]["1"] == [[0, 3], [4, n1]],
        "the driver to publish unit 3 as in flight again",
    )
    driver.stop()
    thread.join(timeout=10)
    assert driver.error is None and driver.stats.redone == 1 and driver.stats.reopened == 1


def test_driver_reissues_expired_leases(atlas):
    queue, store = MemoryQueue(), MemoryMap()
    config = ProducerConfig(
        dataset=atlas.uri,
        run="lease",
        world_size=1,
        max_genes=8,
        idle_timeout_s=0.3,
        sampling=Sampling("sequential", unit_cells=1000),
        heartbeat_s=0.05,
    )
    producer = Producer(config, queue, store, dataset=atlas)
    summary = PlanSummary.of(producer.plan(0), 1)
    publish_summary(store, "lease", summary)
    driver = Driver(queue, store, "lease", lease_s=0.2, poll_s=0.05, stall_timeout_s=30)
    thread = driver.start([0])
    # a producer takes a task and dies with it (never says it holds it, never reports it done)
    wait_for(lambda: queue.len(partition=TASKS_PARTITION) > 0, "the driver to issue tasks")
    taken = producer._take()
    assert taken is not None
    # issued again before a healthy producer starts, which would otherwise quit after 0.3 s without a task:
    # an event, not a race between the lease's 0.2 s and the producer's idle timeout on a loaded machine
    wait_for(lambda: driver.stats.reissued >= 1, "the dead producer's unit to be issued again")
    Producer(config, queue, store, dataset=atlas).run()  # a healthy producer does the rest
    thread.join(timeout=60)
    # the unit the dead producer took was issued again, and the epoch completed (how soon after the
    # death is a figure of benchmarks/coordination.py, not a test's)
    assert driver.error is None and driver.stats.reissued >= 1 and driver.stats.epochs == 1


def test_a_rank_asks_for_its_epochs_missing_items_while_later_epochs_items_keep_coming():
    """A rank waiting for epoch 0's last item while epoch 1's items keep arriving (producers run
    ahead) is starved all the same: it asks for the missing units after `starved_after_s`, not
    only once its partition falls silent (which, with producers ahead, would be never)."""
    queue, asked, stop = MemoryQueue(), [], threading.Event()
    tag = run_tag("ahead")

    def later_items():  # epoch 1's items, one every 50 ms, until the rank has asked
        seq = 0
        while not stop.is_set() and seq < 400:
            queue.put_many(
                [
                    pack_item(
                        Item(
                            1,
                            5,
                            seq,
                            False,
                            tag,
                            400,
                            np.array([seq]),
                            np.array([0, 1]),
                            np.array([7], dtype=np.uint16),
                        )
                    )
                ],
                partition=rank_partition(0),
            )
            seq += 1
            stop.wait(0.05)

    feeder = threading.Thread(target=later_items, daemon=True)
    feeder.start()
    # (items come 10 times a poll: neither the rank's nor its fetcher's wait ever runs out)
    stream = ConsumerStream(
        queue,
        rank=0,
        world_size=1,
        run="ahead",
        batch_size=4,
        no_data_timeout_s=30,
        poll_s=0.5,
        on_starved=lambda e, batches: (asked.append(e), stop.set()),
        starved_after_s=0.3,
    )
    batches, got = stream.epoch(0, [3]), []
    reader = threading.Thread(target=lambda: got.append(next(iter(batches))), daemon=True)  # waits for epoch 0's cells
    reader.start()
    try:
        wait_for(lambda: asked, "the rank to ask for epoch 0's missing units", timeout=15)
        assert asked[0] == 0 and stream._future  # it had epoch 1's items in hand all the while
        queue.put_many(
            [
                pack_item(
                    Item(
                        0,
                        0,
                        0,
                        False,
                        tag,
                        1,
                        np.array([0, 1, 2]),
                        np.array([0, 1, 2, 3]),
                        np.array([7, 8, 9], dtype=np.uint16),
                    )
                )
            ],
            partition=rank_partition(0),
        )
        reader.join(timeout=15)  # the unit asked for came: the epoch's batch
        assert sorted(got[0].cell_ids.tolist()) == [0, 1, 2]
    finally:
        stop.set()
        stream.close()
        feeder.join(timeout=5)


def events_read_by_the_driver(queue: MemoryQueue, monkeypatch) -> list[dict]:
    """Every producer event the driver drains from `queue` from now on, decoded, as it reads them."""
    from coordination.routing import EVENTS_PARTITION, decode_event

    seen, queue_get = [], queue.get_many

    def watching_get(n, block=True, timeout=None, *, partition=None):
        out = queue_get(n, block, timeout, partition=partition)
        if partition == EVENTS_PARTITION:
            seen.extend(decode_event(e) for e in out)
        return out

    monkeypatch.setattr(queue, "get_many", watching_get)
    return seen


def test_a_producer_going_away_names_its_units_and_they_are_issued_at_once(atlas, monkeypatch):
    """A producer interrupted mid-unit (Modal's preemption raises KeyboardInterrupt in its body)
    names the units it took and will not finish in one last event; the driver issues them again in
    its next pass, long before their lease (60 s here) would run out, and the epoch completes."""
    queue, store = MemoryQueue(), MemoryMap()
    config = ProducerConfig(
        dataset=atlas.uri,
        run="away",
        world_size=1,
        max_genes=8,
        idle_timeout_s=0.5,
        sampling=Sampling("sequential", unit_cells=200),
        heartbeat_s=30,
    )
    publish_summary(store, "away", PlanSummary.of(Producer(config, queue, store, dataset=atlas).plan(0), 1))
    going = Producer(config, queue, store, dataset=atlas)
    done = []

    def preempted_at_second_unit(epoch, unit, rows):
        if done:
            raise KeyboardInterrupt
        done.append(unit)
        return Producer.process(going, epoch, unit, rows)

    monkeypatch.setattr(going, "process", preempted_at_second_unit)
    seen = events_read_by_the_driver(queue, monkeypatch)
    driver = Driver(queue, store, "away", lease_s=60, poll_s=0.05, stall_timeout_s=60)
    thread = driver.start([0])
    with pytest.raises(KeyboardInterrupt):
        going.run()
    wait_for(lambda: any(e["released"] for e in seen), "the driver to read the released units", timeout=10)
    released = [u for e in seen for u in e["released"]]
    wait_for(lambda: driver.stats.reissued >= len(released), "the released units to be issued again", timeout=10)
    Producer(config, queue, store, dataset=atlas).run()  # a healthy producer does the rest
    thread.join(timeout=30)
    assert not thread.is_alive() and driver.error is None and driver.stats.epochs == 1
    assert released and all(e == 0 for e, _ in released) and done[0] not in {u for _, u in released}


def test_a_producer_killed_outright_and_started_again_under_its_name_has_its_units_issued_at_once(atlas, monkeypatch):
    """A producer killed outright says nothing (no `released` event). When a process starts again
    under its name (the local fleet's restart, Modal's retry of its call), its first event says so,
    and the driver issues the units the dead one was named holding in its next pass: the epoch
    completes long before their 60 s lease would have run out."""
    queue, store = MemoryQueue(), MemoryMap()
    config = ProducerConfig(
        dataset=atlas.uri,
        run="again",
        world_size=1,
        max_genes=8,
        idle_timeout_s=0.5,
        sampling=Sampling("sequential", unit_cells=200),
        heartbeat_s=0.05,
        read_ahead=1,  # it holds only the unit it works on: no take lands after the driver read its last event
    )
    publish_summary(store, "again", PlanSummary.of(Producer(config, queue, store, dataset=atlas).plan(0), 1))
    seen = events_read_by_the_driver(queue, monkeypatch)
    dying = Producer(config, queue, store, dataset=atlas, name="producer-0")
    done, killed = [], []

    def killed_at_second_unit(epoch, unit, rows):
        if done:  # once the driver has read its first unit done and a heartbeat naming this one, it dies
            ours = lambda key: {u for e in seen if e["p"] == "producer-0" for u in e[key]}  # noqa: E731
            wait_for(lambda: (0, done[0]) in ours("done") and (epoch, unit) in ours("held"), "its events read")
            killed.append((epoch, unit))
            raise KeyboardInterrupt
        done.append(unit)
        return Producer.process(dying, epoch, unit, rows)

    monkeypatch.setattr(dying, "process", killed_at_second_unit)
    monkeypatch.setattr(dying.courier, "release", lambda: None)  # killed outright: no last event
    driver = Driver(queue, store, "again", lease_s=60, poll_s=0.05, stall_timeout_s=60)
    thread = driver.start([0])
    with pytest.raises(KeyboardInterrupt):
        dying.run()
    lost = {u for e in seen if e["p"] == "producer-0" for u in e["held"]} - {(0, u) for u in done}
    assert lost == set(killed) and driver.stats.reissued == 0  # the unit it died with, still in its lease
    assert not any(e["started"] for e in seen[1:])  # only a producer's first event says it started
    # its first event says it started: the dead one's units are issued again, and it makes them (it stays
    # until the epoch is done: not a race between its idle timeout and the driver's next pass)
    again = Producer(replace(config, idle_timeout_s=60), queue, store, dataset=atlas, name="producer-0")
    making = threading.Thread(target=again.run, daemon=True)
    making.start()
    wait_for(lambda: not thread.is_alive(), "the epoch to complete well within the 60 s lease", timeout=30)
    again.stop()
    making.join(timeout=30)
    assert driver.error is None and driver.stats.epochs == 1 and not making.is_alive()
    assert driver.stats.released == 1 and driver.stats.reissued >= 1
    starts = [e for e in seen if e["started"]]
    assert [e["p"] for e in starts] == ["producer-0", "producer-0"]


def test_the_last_line_says_complete_only_when_every_epoch_was_trained_and_audited():
    from coordination.audit import verdict

    def ep(e, trained, audited=True, planned=6000):
        return {"epoch": e, "planned": planned, "trained": trained, "audited": audited}

    assert verdict([ep(0, 6000), ep(1, 6000)]) == (
        True,
        "complete: 2 epochs, 12,000 cells, every epoch trained exactly once (audited)",
    )
    ok, line = verdict([ep(0, 6000), ep(1, 5472, False)])  # a resume that cut an epoch short
    assert not ok and line == "INCOMPLETE: epoch 1: 5,472 of 6,000 cells trained"
    ok, line = verdict([ep(0, 6000, audited=False), ep(1, 0, False)])
    assert not ok and line == (
        "INCOMPLETE: epoch 0: 6,000 cells trained but not audited; epoch 1: not trained (6,000 cells planned)"
    )
    assert verdict([ep(0, 6001, False)])[0] is False  # more than planned is no success either
    assert verdict([ep(0, 6000), ep(1, 960, False)], "steps", 250) == (
        True,
        "stopped at step 250 as --steps asked: 1 of 2 epochs complete; epoch 1: 960 of 6,000 cells",
    )
    assert verdict([ep(0, 3000, False)], "asked", 10) == (
        True,
        "stopped at step 10 as asked: 0 of 1 epochs complete; epoch 0: 3,000 of 6,000 cells",
    )


def test_the_drivers_record_and_its_task_list_depth():
    """What a resumed driver reads (the units seen done, as ranges) and how long the task list is
    kept: about a second of the producers' take (two passes' worth when passes are slow)."""
    from collections import deque

    from coordination.driver import MIN_QUEUED_TASKS, EpochState, Flight, done_ranges

    summary = PlanSummary(0, "p", 10, 100, 1, [100])
    state = EpochState(summary, deque([7, 8]), {2: Flight(0), 3: Flight(1)})
    assert done_ranges(state) == [[0, 2], [4, 7], [9, 10]]
    assert done_ranges(EpochState(summary, deque(range(10)))) == []
    driver = Driver(MemoryQueue(), MemoryMap(), "d", max_queued_tasks=128)
    assert driver._depth(0, 0.0) == MIN_QUEUED_TASKS  # no rate yet
    assert driver._depth(15, 0.25) == 60  # 60 tasks a second: a second's worth
    assert driver._depth(30, 0.5) == 60
    assert driver._depth(35, 0.75) == 52  # the rate falls (smoothed): the list shortens
    assert driver._depth(75, 2.75) == 128  # a 2 s pass: two passes' worth (4 s at ~40/s), at most 128
    assert Driver(MemoryQueue(), MemoryMap(), "d", max_queued_tasks=32)._depth(0, 0.0) == 16
