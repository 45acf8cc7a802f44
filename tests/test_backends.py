"""One conformance suite for every Queue/Map backend that runs here (memory, local server), and
adapter tests for the Modal backend against a recording stand-in (these are not Modal runs)."""

from __future__ import annotations

import json
import os
import queue as stdlib_queue
import re
import sys
import threading
import time

import pytest

from coordination.errors import CellfeedError
from coordination.latency import CallCounts, with_latency
from coordination.local_backend import LocalServer, ServerProcess
from coordination.local_client import LocalMap, LocalQueue
from coordination.modal_backend import ModalMap, ModalQueue, ModalUnreachable, run_object_name
from coordination.queues import MAX_ITEM_BYTES, Empty, Full, ItemTooLarge, MapGone, MemoryMap, MemoryQueue


@pytest.fixture(scope="module")
def local_server():
    server = LocalServer().start_in_thread()
    yield server
    server.shutdown()


@pytest.fixture(params=["memory", "local", "memory+latency", "local+latency"])
def backend(request, local_server):
    """Each backend, also behind the latency wrapper (2 ± 1 ms a call): the semantics must hold
    when every call is a round trip."""
    if request.param.startswith("memory"):
        pair = MemoryQueue(), MemoryMap()
    else:
        local_server.queue.__init__()  # fresh state per test
        local_server.store.__init__()
        pair = LocalQueue(local_server.address), LocalMap(local_server.address)
    return with_latency(*pair, 2.0, 1.0)[:2] if request.param.endswith("+latency") else pair


def test_fifo_partitions_and_len(backend):
    q, _ = backend
    q.put_many([b"a", b"b", b"c"], partition="p")
    q.put_many([b"x"], partition="other")
    assert q.len(partition="p") == 3 and q.len(partition="other") == 1 and q.len(total=True) == 4
    assert q.get_many(2, partition="p") == [b"a", b"b"]
    assert q.get(partition="p") == b"c"
    assert q.get(block=False, partition="p") is None and q.get_many(3, block=False, partition="p") == []


def test_blocking_get_many_waits_for_one_item_and_times_out(backend):
    q, _ = backend
    with pytest.raises(Empty):
        q.get_many(5, block=True, timeout=0.2, partition="p")
    threading.Timer(0.2, lambda: q.put_many([b"late"], partition="p")).start()  # (most likely) once it waits
    # it returns when the item arrives; 30 s only bounds a get that never wakes (a busy machine may start the
    # timer's thread late)
    assert q.get_many(5, block=True, timeout=30, partition="p") == [b"late"]


def test_item_limits_and_types(backend):
    q, _ = backend
    q.put_many([b"x" * MAX_ITEM_BYTES], partition="p")
    with pytest.raises(ItemTooLarge):
        q.put_many([b"x" * (MAX_ITEM_BYTES + 1)], partition="p")
    with pytest.raises(TypeError):
        q.put_many(["text is not bytes"], partition="p")


def test_full_partition_blocks_then_raises(backend):
    q, _ = backend
    q.put_many([b"i"] * 5000, partition="p")
    with pytest.raises(Full):
        q.put_many([b"one more"], block=False, partition="p")
    with pytest.raises(Full):
        q.put_many([b"one more"], block=True, timeout=0.2, partition="p")
    threading.Timer(0.2, lambda: q.get_many(10, partition="p")).start()  # (most likely) once it waits
    q.put_many([b"one more"], block=True, timeout=30, partition="p")  # returns on room; 30 s bounds a hang only
    assert q.len(partition="p") == 4991


def test_map_semantics(backend):
    _, m = backend
    assert m.put("k", b"bytes", skip_if_exists=True) is True
    assert m.put("k", b"other", skip_if_exists=True) is False and m.get("k") == b"bytes"
    assert m.put("s", "text") and m.get("s") == "text" and m.put("i", 42) and m.get("i") == 42
    assert "k" in m and "nope" not in m and sorted(m.keys()) == ["i", "k", "s"]
    assert m.pop("k") == b"bytes" and m.get("k") is None and m.get("k", "dflt") == "dflt"
    with pytest.raises(KeyError):
        m.pop("k")
    assert m.pop("k", None) is None


def test_put_if_absent_has_one_winner_under_contention(backend):
    _, m = backend
    winners = []

    def claim(i):
        if m.put("slot", i, skip_if_exists=True):
            winners.append(i)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and m.get("slot") == winners[0]


def test_named_maps_are_separate_created_once_and_dropped_whole(backend):
    _, m = backend
    m.put("k", b"run map")
    e0 = m.named("e0", create=True)
    e0.put("k", b"epoch map")
    assert e0.put("slot", "u1", skip_if_exists=True) is True and e0.put("slot", "u2", skip_if_exists=True) is False
    assert m.get("k") == b"run map" and e0.get("k") == b"epoch map"
    assert m.named("e0").get("slot") == "u1"  # opened again, without create: the same map
    with pytest.raises(MapGone):  # never created: opening creates nothing, using it fails
        m.named("e1").put("k", b"x")
    m.drop("e0")  # one call, whatever it held
    for stale in (e0, m.named("e0")):  # a handle from before, or a late producer's new one
        with pytest.raises(MapGone):
            stale.put("slot", "late", skip_if_exists=True)
        with pytest.raises(MapGone):
            stale.get("k")
    assert m.get("k") == b"run map"
    m.drop("never-made")  # dropping what is not there is fine
    again = m.named("e0", create=True)  # the driver may create it afresh (a resumed epoch)
    assert again.get("slot") is None


def test_latency_wrapper_costs_each_call_and_counts_it(monkeypatch):
    import types

    import coordination.latency as latency

    delays = []  # what each call slept: the cost is counted per call, not read off a busy machine's clock
    monkeypatch.setattr(latency, "time", types.SimpleNamespace(sleep=lambda s: (delays.append(s), time.sleep(s))))
    counts = CallCounts()
    q, m, _ = with_latency(
        MemoryQueue(), MemoryMap(), 20.0, 5.0, counts=counts, partition_kind=lambda p: ".items" if p == "rank-0" else ""
    )
    start = time.monotonic()
    q.put_many([b"a", b"b"], partition="rank-0")
    q.get_many(5, partition="rank-0")
    m.put("k", 1)
    m.get("k")
    m.named("e0", create=True).put("x", 1)
    m.drop("e0")
    assert len(delays) == 7 and all(0.015 <= d <= 0.025 for d in delays)  # 7 calls of 20 ± 5 ms each
    assert time.monotonic() - start >= sum(delays)  # really slept (a sleep never ends early)
    assert counts.snapshot() == {
        "queue.put_many.items": 1,
        "queue.get_many.items": 1,
        "map.put": 2,
        "map.get": 1,
        "map.create": 1,
        "map.drop": 1,
    }
    assert counts.items["queue.put_many.items"] == 2 and counts.items["queue.get_many.items"] == 2
    with pytest.raises(ValueError):
        with_latency(MemoryQueue(), MemoryMap(), 5.0, 10.0)  # jitter above the mean


def test_server_process_and_its_disappearance():
    server = ServerProcess()
    q = LocalQueue(server.address, server.token)
    q.put_many([b"a"], partition="p")
    assert q.get_many(1, partition="p") == [b"a"]
    server.close()
    start = time.monotonic()
    with pytest.raises(CellfeedError, match="local queue server"):
        q.get_many(1, timeout=1, partition="p")
    # a refused connection fails at once; 15 s (the client's bounded waits, generously for a busy machine) only
    # separates failing from hanging on a server that is gone
    assert time.monotonic() - start < 15


@pytest.mark.parametrize(
    "program, says",
    [
        ("import time; time.sleep(600)", "nothing said in 0.5 s"),  # alive, stuck before it listens
        ("pass", "it exited"),
        ("print('no address', flush=True); import time; time.sleep(600)", "it said 'no address'"),
    ],
    ids=["stuck", "exited", "other-line"],
)
def test_a_queue_server_that_does_not_start_is_one_line_not_a_hang(monkeypatch, tmp_path, program, says):
    """The server's first line says where it listens; one that never says it (stuck, gone, or saying
    something else) is killed and named within START_TIMEOUT_S, not waited on for ever."""
    from coordination import local_backend

    monkeypatch.setattr(local_backend, "START_TIMEOUT_S", 0.5)
    monkeypatch.setattr(ServerProcess, "command", (sys.executable, "-c", program))
    with pytest.raises(CellfeedError, match=rf"^the local queue server did not start \({re.escape(says)}\)$"):
        ServerProcess(token_file=tmp_path / "token")


def test_the_server_answers_only_its_runs_processes(tmp_path):
    """The local server's token is in a file only its owner can read; a client without it, or
    with another, is refused with one line naming the problem, and nothing is served."""
    import stat

    server = ServerProcess(token_file=tmp_path / "token")
    try:
        assert stat.S_IMODE(os.stat(server.token_file).st_mode) == 0o600
        LocalQueue(server.address, server.token).put_many([b"kept"], partition="p")
        for token in (None, "0" * 64):
            with pytest.raises(CellfeedError, match="refused: this queue server answers only its run's processes"):
                LocalQueue(server.address, token).get_many(1, block=False, partition="p")
        import socket

        host, port = server.address.rsplit(":", 1)
        for garbage in (b"\xff\xff\xff\xff", b"\x03\x00\x00\x00abc", b""):  # before the hello: closed, no harm
            with socket.create_connection((host, int(port))) as s:
                s.sendall(garbage)
                s.shutdown(socket.SHUT_WR)
                s.settimeout(15)
                assert s.recv(100) == b""
        assert LocalQueue(server.address, server.token).get_many(1, block=False, partition="p") == [b"kept"]
        assert server.token not in json.dumps(server.where)  # a spec names the file, never the token
    finally:
        server.close()
    assert not os.path.exists(server.token_file)


# ------------------------------------------------------------------------- modal adapter tests


class RecordingModalQueue:
    """Stands in for modal.Queue: records calls and behaves as Modal documents."""

    def __init__(self):
        self.calls, self.items = [], {}

    def put_many(self, vs, block=True, timeout=None, *, partition=None, partition_ttl=86400):
        self.calls.append(("put_many", len(vs), block, timeout, partition))
        if len(self.items.get(partition, [])) + len(vs) > 5000:
            raise stdlib_queue.Full()
        self.items.setdefault(partition, []).extend(vs)

    def get_many(self, n_values, block=True, timeout=None, *, partition=None):
        self.calls.append(("get_many", n_values, block, timeout, partition))
        items = self.items.get(partition, [])
        if not items and block:
            raise stdlib_queue.Empty()
        out, self.items[partition] = items[:n_values], items[n_values:]
        return out

    def get(self, block=True, timeout=None, *, partition=None):
        self.calls.append(("get", block, timeout, partition))
        out = self.get_many(1, block, timeout, partition=partition) if block or self.items.get(partition) else []
        return out[0] if out else None

    def len(self, *, partition=None, total=False):
        return sum(map(len, self.items.values())) if total else len(self.items.get(partition, []))


class RecordingModalDict(dict):
    def put(self, key, value, *, skip_if_exists=False):
        if skip_if_exists and key in self:
            return False
        self[key] = value
        return True

    def contains(self, key):
        return key in self


def test_modal_adapter_imports_and_constructs_offline():
    q, m = ModalQueue("cellfeed-test"), ModalMap("cellfeed-test")
    assert q._queue is None and m._dict is None  # nothing contacted Modal
    assert run_object_name("r1") == "cellfeed-r1"
    with pytest.raises(ItemTooLarge):  # checked before anything would leave the machine
        q.put_many([b"x" * (MAX_ITEM_BYTES + 1)], partition="p")
    with pytest.raises(TypeError):
        q.put_many([{"no": "pickle"}], partition="p")


def test_modal_adapter_translates_calls_and_behaviours():
    stand_in = RecordingModalQueue()
    q = ModalQueue(queue=stand_in)
    q.put_many([b"a", b"b"], block=True, timeout=3, partition="rank-0")
    assert stand_in.calls[-1] == ("put_many", 2, True, 3, "rank-0")
    assert q.get_many(5, block=True, timeout=2, partition="rank-0") == [b"a", b"b"]
    assert stand_in.calls[-1] == ("get_many", 5, True, 2, "rank-0")
    assert q.get(block=False, partition="rank-0") is None  # non-blocking get: None when empty
    with pytest.raises(Empty):
        q.get_many(5, block=True, timeout=0.1, partition="rank-0")
    assert q.get_many(5, block=False, partition="rank-0") == []
    assert stand_in.calls[-1] == ("get_many", 5, False, None, "rank-0")  # no timeout with block=False
    q.put_many([b"x"] * 5000, partition="full")
    with pytest.raises(Full):
        q.put_many([b"y"], block=False, partition="full")
    assert q.len(partition="full") == 5000 and q.len(total=True) == 5000
    d = RecordingModalDict()
    m = ModalMap(mapping=d)
    assert m.put("k", 1, skip_if_exists=True) is True and m.put("k", 2, skip_if_exists=True) is False
    assert m.get("k") == 1 and "k" in m and m.keys() == ["k"] and m.pop("k") == 1 and m.pop("k", None) is None


def test_modal_calls_retry_transient_errors_for_the_window_and_no_others(capsys):
    """What Modal's client raises once its own retries are spent (ServiceError, InternalError, its
    ConnectionError, a raw StreamTerminatedError) is retried with backoff for the window, one line
    when it starts and one when it ends; any other error is not retried; past the window,
    ModalUnreachable."""
    import modal.exception
    from grpclib.exceptions import StreamTerminatedError

    from coordination.modal_backend import retrying

    for error in (
        modal.exception.ServiceError("UNAVAILABLE"),
        modal.exception.InternalError("INTERNAL"),
        modal.exception.ConnectionError("refused"),
        modal.exception.ResourceExhaustedError("rate limit"),  # (a Dict call or a get over Modal's rate limits)
        StreamTerminatedError("reset"),
    ):
        calls = []

        def flaky():
            calls.append(1)
            if len(calls) < 3:
                raise error
            return "done"

        assert retrying(flaky, "queue get (rank-0)", retry_s=30) == "done" and len(calls) == 3
        err = capsys.readouterr().err
        assert f"Modal: queue get (rank-0) failed ({type(error).__name__}: " in err and "works again after" in err
    calls = []

    def wrong():
        calls.append(1)
        raise modal.exception.InvalidError("bad argument")

    with pytest.raises(modal.exception.InvalidError):
        retrying(wrong, "dict put", retry_s=30)
    assert len(calls) == 1  # not retried

    def down():
        raise modal.exception.ServiceError("UNAVAILABLE")

    started = time.monotonic()
    with pytest.raises(ModalUnreachable, match=r"Modal: dict get kept failing for .* min \(ServiceError"):
        retrying(down, "dict get", retry_s=1.0)
    assert 1.0 <= time.monotonic() - started < 5.0


def test_a_dict_keys_stream_cut_mid_way_is_read_again():
    """`Dict.keys()` is a server stream read lazily; a connection cut while it is read raises the
    socket's own OSError (modal does not wrap it): the whole listing is asked again."""

    class CutOnce(RecordingModalDict):
        cuts = 1

        def keys(self):
            yield "a"
            if CutOnce.cuts:
                CutOnce.cuts -= 1
                raise ConnectionResetError("connection reset by peer")
            yield "b"

    assert ModalMap(mapping=CutOnce(), retry_s=30).keys() == ["a", "b"] and CutOnce.cuts == 0


def test_modal_adapter_named_maps_and_timed_puts_offline():
    import modal.exception

    m = ModalMap("cellfeed-r1")
    e0 = m.named("e0")  # opening: nothing contacted, and never created by us
    assert e0.name == "cellfeed-r1-e0" and e0.create is False and e0._dict is None

    class TimesOut(RecordingModalQueue):
        def put_many(self, values, block=True, timeout=None, partition=None):
            raise modal.exception.TimeoutError("Queue.put could not complete within the provided timeout")

    # a put that could not complete (its own retries of a network fault ran out) is not a full partition
    # (Modal says Full when it is): it is retried for the retry window, then the run stops, its state kept
    with pytest.raises(ModalUnreachable, match="queue put .*kept failing") as failed:
        ModalQueue(queue=TimesOut(), retry_s=0.5).put_many([b"a"], block=True, timeout=1, partition="rank-0")
    assert isinstance(failed.value.__cause__.__cause__, modal.exception.TimeoutError)

    class Gone(RecordingModalDict):
        def get(self, key, default=None):
            raise modal.exception.NotFoundError("Dict not found")

    with pytest.raises(MapGone):
        ModalMap(mapping=Gone()).get("k")
