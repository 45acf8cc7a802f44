"""The same dataset written to and read from s3:// on a real S3-compatible server (SeaweedFS on
127.0.0.1, directly and through a 30 ms latency proxy) gives identical results; storage failures
give one clear line without secrets."""

from __future__ import annotations

import time

import numpy as np
import pytest

from app.cli import main as cli
from coordination.errors import CellfeedError
from coordination.net import free_port
from coordination.plan import Sampling
from producers.convert import convert
from producers.dataset import open_dataset
from producers.storage import REMOTE_READS_MAX, ReadSlots, S3Location, S3Settings, StorageUnavailable, reads_in_flight
from producers.synth import SynthSpec, synthesize
from tests.conftest import random_counts, wait_for, write_h5ad


def assert_same_dataset(a, b):
    assert a.shape == b.shape and a.n_rows == b.n_rows and a.value_type == b.value_type
    assert [(f.row_start, f.row_end) for f in a.fragments] == [(f.row_start, f.row_end) for f in b.fragments]
    np.testing.assert_array_equal(a.cell_row_start, b.cell_row_start)
    np.testing.assert_array_equal(a.straddling_cells(), b.straddling_cells())
    assert a.obs().equals(b.obs()) and a.var().equals(b.var())
    ranges = np.array([[0, 10], [a.n_rows // 2, a.n_rows // 2 + 100], [a.n_rows - 7, a.n_rows]])
    for x, y in (
        (a.read_rows(0, a.n_rows), b.read_rows(0, b.n_rows)),
        (a.read_row_ranges(ranges), b.read_row_ranges(ranges)),
    ):
        for field in ("cell", "gene", "value"):
            np.testing.assert_array_equal(getattr(x, field), getattr(y, field))


def test_synth_to_s3_equals_local(s3, tmp_path):
    spec = SynthSpec(n_cells=400, n_genes=3000, n_plates=4, seed=5)
    local = synthesize(str(tmp_path / "atlas"), spec, rows_per_fragment=50_000, progress=False)
    remote = synthesize(f"s3://{s3}/atlases/a1", spec, rows_per_fragment=50_000, progress=False)
    assert remote.uri == f"s3://{s3}/atlases/a1"
    assert_same_dataset(local, open_dataset(f"s3://{s3}/atlases/a1"))


def test_convert_to_s3_and_inspect(s3, tmp_path, capsys):
    h5 = write_h5ad(tmp_path / "in.h5ad", random_counts(60, 80, seed=1))
    local = convert([str(h5)], str(tmp_path / "ds"), rows_per_fragment=100, progress=False)
    assert cli(["convert", str(h5), f"s3://{s3}/ds", "--rows-per-fragment", "100", "--quiet"]) == 0
    assert_same_dataset(local, open_dataset(f"s3://{s3}/ds"))
    assert cli(["inspect", f"s3://{s3}/ds"]) == 0
    assert "cells       60" in capsys.readouterr().out
    # a second write to the same prefix is refused, not mixed in
    assert cli(["convert", str(h5), f"s3://{s3}/ds", "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_failed_s3_write_leaves_no_objects(s3):
    import pyarrow as pa

    from producers.writer import DatasetWriter

    uri = f"s3://{s3}/half"
    with pytest.raises(RuntimeError):
        with DatasetWriter(uri, n_genes=5, value_type=pa.uint16(), rows_per_fragment=2) as writer:
            writer.append(
                pa.table({"cell_id": ["a", "b"]}), np.array([0, 2, 3]), np.array([0, 4, 1]), np.array([1, 2, 3])
            )
            raise RuntimeError("crash mid-write")
    assert not S3Location(uri).exists()
    with pytest.raises(CellfeedError, match="config.json is missing"):
        open_dataset(uri)


@pytest.mark.parametrize(
    "case, needle",
    [("missing bucket", "does not exist"), ("unreachable", "unreachable"), ("no dataset", "config.json is missing")],
)
def test_s3_errors_are_one_clear_line(s3, monkeypatch, capsys, case, needle):
    uri = {
        "missing bucket": "s3://no-such-bucket-here/x",
        "unreachable": f"s3://{s3}/x",
        "no dataset": f"s3://{s3}/empty",
    }[case]
    if case == "unreachable":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    assert cli(["inspect", uri]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert "cellfeed-test-secret" not in err[0]


def test_bad_credentials_are_reported_without_the_secret(seaweed):
    settings = S3Settings(
        endpoint=seaweed.endpoint, access_key_id="AKIAWRONGKEY", secret_access_key="super-secret-value"
    )
    with pytest.raises(CellfeedError) as info:
        open_dataset("s3://some-bucket/ds", settings)
    message = str(info.value)
    assert "access denied" in message and "AWS_ACCESS_KEY_ID" in message
    assert "super-secret-value" not in message and "\n" not in message


def test_reads_through_a_latency_proxy_are_identical_and_pay_the_latency(s3, seaweed, tmp_path, monkeypatch):
    from cellfeed_testing.object_store import S3Proxy

    spec = SynthSpec(n_cells=300, n_genes=2000, n_plates=3, seed=9)
    local = synthesize(str(tmp_path / "atlas"), spec, rows_per_fragment=20_000, progress=False)
    synthesize(f"s3://{s3}/atlas", spec, rows_per_fragment=20_000, progress=False)
    with S3Proxy(seaweed.endpoint, latency_ms=30, jitter_ms=5, bandwidth_mbps=800) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)  # requests are signed for the proxy's address
        started = time.monotonic()
        remote = open_dataset(f"s3://{s3}/atlas")
        assert_same_dataset(local, remote)
        elapsed = time.monotonic() - started
        requests = proxy.requests
        # the reads in flight follow the pace asked of them, sized from the reads just timed
        slots = remote.read_slots
        slow, fast = slots.pace(1.0), slots.pace(1e9)
        assert (slow, fast) == (4, REMOTE_READS_MAX)
        assert slow <= slots.pace(1e5) <= fast and slots.limit == slots.pace(1e5)
        slots.pace(1.0)  # 4 slices at a time: the same rows
        ranges = np.array([[i * remote.n_rows // 40, i * remote.n_rows // 40 + 50] for i in range(40)])
        for field in ("cell", "gene", "value"):
            np.testing.assert_array_equal(
                getattr(remote.read_row_ranges(ranges), field), getattr(local.read_row_ranges(ranges), field)
            )
    assert requests >= 5 and proxy.bytes_down > 0
    assert elapsed >= 0.025 * requests / 16  # every request paid its time to first byte (up to 16 at once)
    assert local.read_slots is None  # local disk: a fixed pool (LOCAL_READ_THREADS), no pacing


def test_reads_in_flight_are_littles_law_with_headroom_within_bounds():
    """Reads a second x seconds a read, doubled (READS_HEADROOM), rounded up; at least 4, at most 256."""
    assert reads_in_flight(100, 0.05) == 10  # 2 x 100/s x 0.05 s
    assert reads_in_flight(1_000, 0.03) == 60
    assert reads_in_flight(2_000, 0.12) == REMOTE_READS_MAX == 256  # 480 wanted
    assert reads_in_flight(1, 0.001) == 4


def test_read_slots_hold_reads_to_their_limit_and_a_faster_pace_lets_the_waiting_in():
    import threading

    slots, lock = ReadSlots(2), threading.Lock()
    with slots.read(100):  # one read timed: a pace can be sized from it
        pass
    inside, release, entered = [], threading.Event(), [threading.Event() for _ in range(5)]

    def reader(i: int) -> None:
        with slots.read(100):
            with lock:
                inside.append(i)
                entered[len(inside) - 1].set()
            assert release.wait(30)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    assert entered[1].wait(30)  # two are in; the others wait for a slot
    assert slots.held == 2 and not entered[2].is_set()
    assert slots.pace(1e12) == REMOTE_READS_MAX  # a pace no read time can meet: the most, at once
    assert entered[4].wait(30) and slots.held == 5
    release.set()
    for t in threads:
        t.join(30)
    assert sorted(inside) == [0, 1, 2, 3, 4] and slots.held == 0
    assert slots.pace(1.0) == 4  # a row a second: the fewest
    slots.fix(8)  # a producer's `reads_in_flight`: fixed, whatever pace is asked
    assert slots.pace(1e12) == slots.pace(1.0) == 8 == slots.limit


def test_reads_waiting_for_a_slot_get_one_in_the_order_they_came():
    """A freed slot goes to the oldest waiting read (whose rows the producer needs first). The thread
    that freed it and asks again at once (a pool thread taking its next slice) waits behind them."""
    import threading

    slots, order, lock = ReadSlots(1), [], threading.Lock()
    gates = [threading.Event() for _ in range(4)]

    def reader(i: int) -> None:
        with slots.read(1):
            with lock:
                order.append(i)
            assert gates[i].wait(30)
        if i == 0:
            with slots.read(1):
                with lock:
                    order.append("0 again")

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    threads[0].start()
    wait_for(lambda: order == [0], "the first read in")
    for i in (1, 2, 3):  # each waits behind the one before it
        threads[i].start()
        wait_for(lambda: slots.waiting == i, f"read {i} waiting")
    for i in range(4):
        gates[i].set()
        if i < 3:
            wait_for(lambda: len(order) == i + 2, f"read {i + 1} in")
    for t in threads:
        t.join(30)
    assert order == [0, 1, 2, 3, "0 again"] and slots.held == 0 == slots.waiting


def test_a_read_that_waits_too_long_for_a_slot_is_a_storage_outage(monkeypatch):
    import threading

    import producers.storage

    monkeypatch.setattr(producers.storage, "READ_SLOT_WAIT_S", 0.05)
    slots, stuck, release = ReadSlots(1), threading.Event(), threading.Event()

    def hold() -> None:
        with slots.read(1):
            stuck.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert stuck.wait(30)
        with pytest.raises(StorageUnavailable, match=r"no read of the object store ended in 0 s \(1 in flight\)"):
            with slots.read(1):
                pass
    finally:
        release.set()
        holder.join(30)


def test_upload_script_stages_a_local_dataset(s3, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    spec = SynthSpec(n_cells=200, n_genes=1000, n_plates=2, seed=8)
    local = synthesize(str(tmp_path / "atlas"), spec, rows_per_fragment=40_000, progress=False)
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "deploy/upload.py", local.uri, f"s3://{s3}/staged"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert_same_dataset(local, open_dataset(f"s3://{s3}/staged"))
    again = subprocess.run(
        [sys.executable, "deploy/upload.py", local.uri, f"s3://{s3}/staged"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_s3_timeouts_and_retries_are_one_setting_for_lance_and_boto3(monkeypatch):
    from producers import storage

    settings = S3Settings.from_env({})
    assert (
        (settings.connect_timeout_s, settings.request_timeout_s, settings.retries)
        == (storage.CONNECT_TIMEOUT_S, storage.REQUEST_TIMEOUT_S, storage.RETRIES)
        == (5.0, 30.0, 3)
    )
    env = {
        "CELLFEED_S3_CONNECT_TIMEOUT_S": "0.5",
        "CELLFEED_S3_REQUEST_TIMEOUT_S": "2",
        "CELLFEED_S3_RETRIES": "1",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:1",
    }
    settings = S3Settings.from_env(env)
    opts = settings.lance_options()
    assert (opts["connect_timeout"], opts["timeout"], opts["client_max_retries"], opts["client_retry_timeout"]) == (
        "500ms",
        "2000ms",
        "1",
        "4",
    )
    assert float(opts["lance_aimd_min_rate"]) >= 100  # an outage does not throttle reads to a crawl
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = S3Location("s3://b/x").client.meta.config  # what boto3 uses for config.json and the checks
    assert (config.connect_timeout, config.read_timeout, config.retries["total_max_attempts"]) == (0.5, 2.0, 2)
    with pytest.raises(CellfeedError, match="CELLFEED_S3_RETRIES='many'"):
        S3Settings.from_env({"CELLFEED_S3_RETRIES": "many"})


def test_producers_ride_out_an_s3_server_restart(tmp_path):
    """The S3 server is killed mid-epoch and started again 3 s later on the same data: producers
    reading from it retry, and the epoch still yields every cell exactly once. Lance must not take
    the outage for throttling and crawl on after it (producers/storage.py: MIN_REQUEST_RATE): the
    epoch ends seconds after the server answers again, not minutes."""
    import threading

    from cellfeed_testing.object_store import SeaweedServer
    from coordination.plan import Sampling
    from coordination.queues import MemoryMap, MemoryQueue
    from coordination.routing import TASKS_PARTITION, encode_task, epoch_map_name, rank_partition
    from coordination.wire import unpack_item
    from producers.config import ProducerConfig
    from producers.producer import Producer

    with SeaweedServer() as server:
        server.client().create_bucket(Bucket="outage")
        settings = S3Settings(
            endpoint=server.endpoint,
            access_key_id=server.settings["AWS_ACCESS_KEY_ID"],
            secret_access_key=server.settings["AWS_SECRET_ACCESS_KEY"],
        )
        synthesize(
            "s3://outage/atlas",
            SynthSpec(n_cells=1200, n_genes=1000, n_plates=3, seed=4, median_nnz=100),
            rows_per_fragment=20_000,
            progress=False,
            settings=settings,
        )
        ds = open_dataset("s3://outage/atlas", settings)
        queue, store = MemoryQueue(), MemoryMap()
        config = ProducerConfig(
            dataset=ds.uri,
            run="outage",
            max_genes=16,
            idle_timeout_s=3.0,
            sampling=Sampling("block", block_size=8, fetch_factor=1, batch_size=16, min_units=1),
        )
        producers = [Producer(config, queue, store, dataset=ds) for _ in range(2)]
        plan = producers[0].plan(0)
        store.named(epoch_map_name(0), create=True)
        queue.put_many([encode_task(0, u) for u in range(plan.n_units)], partition=TASKS_PARTITION)
        errors = []

        def work(p):
            try:
                p.run()
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(p,)) for p in producers]
        for t in threads:
            t.start()
        wait_for(lambda: sum(p.stats.units for p in producers) >= 3, "3 units produced before the outage")
        server.restart(down_s=3.0)  # killed mid-epoch, back on the same data and port
        # they finish within seconds of the store's return (the timeout only bounds a broken run)
        wait_for(lambda: sum(p.stats.units for p in producers) == plan.n_units or errors, "every unit produced", 300)
        # (no stop: a stop abandons what the courier has not sent yet; on the empty task list each
        # producer ends by itself after its idle_timeout_s, its courier's posts sent first)
        for t in threads:
            t.join(timeout=60)
        assert errors == [] and not any(t.is_alive() for t in threads)
        # the outage was met: a unit's read (its retries included) waited it out
        assert max(s for p in producers for s in p.stats.unit_read_s) >= 3.0
        cells = [
            c
            for data in queue.get_many(10**6, block=False, partition=rank_partition(0))
            for c in unpack_item(data).cell_ids.tolist()
        ]
        assert sorted(cells) == list(range(1200))  # every cell once (no driver here: no unit re-issued)
        assert sum(p.stats.units for p in producers) == plan.n_units


def test_convert_in_slices_by_two_workers_to_s3_commits_once(s3, tmp_path):
    """Slices written by two worker processes straight to the bucket are a dataset only once
    committed, equal to a local conversion; a prefix holding another plan's unfinished slices is
    refused, not mixed in."""
    h5 = write_h5ad(tmp_path / "in.h5ad", random_counts(100, 80, seed=3))
    kw = dict(rows_per_fragment=50, slice_cells=16, block_cells=16, progress=False)
    local = convert([str(h5)], str(tmp_path / "ds"), **kw)
    remote = convert([str(h5)], f"s3://{s3}/sliced", workers=2, **kw)
    assert remote.identity == local.identity
    assert_same_dataset(local, remote)
    assert not S3Location(f"s3://{s3}/sliced").exists("_convert")  # the records go at the commit
    S3Location(f"s3://{s3}/other").write_bytes("_convert/slice-000000.json", b"{}")  # someone's unfinished work
    with pytest.raises(CellfeedError, match="holds files but no dataset"):
        convert([str(h5)], f"s3://{s3}/other", **kw)


@pytest.mark.parametrize("fixed", [None, 5])
def test_a_producer_on_s3_paces_its_reads_by_its_own_work_and_makes_every_cell_once(s3, monkeypatch, fixed):
    """After each unit the producer sizes each dataset's reads in flight to its pace: the rows of its
    recent units over their work time (`Producer._pace_reads`); `reads_in_flight` in its config fixes them."""
    import producers.dataset
    from coordination.queues import MemoryMap, MemoryQueue
    from producers.config import ProducerConfig
    from producers.producer import Producer
    from tests.test_producer import WORLD, drain, enqueue_epoch

    monkeypatch.setattr(producers.dataset, "REMOTE_READS_START", 1_000)  # a limit no pace gives (4..256)
    paces, pace = [], ReadSlots.pace
    monkeypatch.setattr(ReadSlots, "pace", lambda self, rows_per_s: paces.append(rows_per_s) or pace(self, rows_per_s))
    spec = SynthSpec(n_cells=600, n_genes=1500, n_plates=3, seed=3)
    ds = synthesize(f"s3://{s3}/paced", spec, rows_per_fragment=30_000, progress=False)
    assert ds.read_slots.limit == 1_000
    config = ProducerConfig(
        dataset=ds.uri,
        run="paced",
        world_size=WORLD,
        sampling=Sampling("block", unit_cells=100, block_size=8, fetch_factor=4, batch_size=32),
        max_genes=32,
        idle_timeout_s=0.5,
        reads_in_flight=fixed,
    )
    producer = Producer(config, MemoryQueue(), MemoryMap(), dataset=ds)
    try:
        plan = enqueue_epoch(producer.queue, producer, 0)
        producer.run()
    finally:
        producer.close()
    cells = np.concatenate([it.cell_ids for items in drain(producer.queue, "paced", 0).values() for it in items])
    np.testing.assert_array_equal(np.sort(cells), np.arange(ds.n_cells))
    assert len(paces) == plan.n_units and min(paces) > 0  # a pace a unit: rows a second of work
    if fixed:
        assert ds.read_slots.limit == fixed and ds.read_slots.fixed
    else:
        assert 4 <= ds.read_slots.limit <= REMOTE_READS_MAX  # paced: no longer the start's 1,000


@pytest.mark.token_pass_free
def test_a_latency_proxy_that_stops_accepting_says_why_and_close_does_not():
    """Its accepting thread must not end unseen: an accept that fails (out of file descriptors, say)
    is kept as `error`, which `cellfeed s3-server` checks and raises; `close` is no error."""
    import socket

    from cellfeed_testing.object_store import S3Proxy

    with S3Proxy("http://127.0.0.1:9", latency_ms=0, jitter_ms=0) as proxy:  # (the upstream is never reached here)
        proxy._listener.shutdown(socket.SHUT_RDWR)  # (its accept fails now, as one out of descriptors would)
        wait_for(lambda: proxy.error is not None, "the proxy's accept to fail", timeout=10)
        assert isinstance(proxy.error, OSError)
    with S3Proxy("http://127.0.0.1:9", latency_ms=0, jitter_ms=0) as proxy:
        pass
    assert proxy.error is None
