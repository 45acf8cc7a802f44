"""The Modal emulator answers as modal 1.6.4's client does (each test names the semantic point of
cellfeed_testing/modal_emulator/README.md it checks), and cellfeed's Modal backend is right on
it where the in-memory shim could not tell: handles, full partitions, request sizes, expiry."""

from __future__ import annotations

import builtins
import queue as stdlib_queue
import threading

import pytest

from cellfeed_testing.modal_emulator import ModalEmulator
from tests.conftest import wait_for


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    emulator = ModalEmulator(tmp_path_factory.mktemp("modal-world"), grace_s=5.0, retry_delay_s=0.2)
    emulator.install()
    yield emulator
    emulator.close()


# ---- the emulator's own semantics


def test_handles_bind_once_and_a_deleted_object_is_gone_for_them(world):  # S1, S2, S3
    import modal
    import modal.exception

    d = modal.Dict.from_name("sem-handles", create_if_missing=True)
    d.put("k", 1)
    first_id = d.object_id
    modal.Dict.objects.delete("sem-handles")
    with pytest.raises(modal.exception.NotFoundError):
        d.get("k")
    again = modal.Dict.from_name("sem-handles", create_if_missing=True)
    assert again.get("k") is None and again.object_id != first_id  # a new object under the old name
    with pytest.raises(modal.exception.NotFoundError):  # the old handle still points at the deleted one
        d.put("k", 2)
    with pytest.raises(modal.exception.NotFoundError):
        modal.Queue.from_name("sem-never-made").len()
    with pytest.raises(modal.exception.InvalidError):
        modal.Queue.from_name("bad name!")


def test_puts_follow_modals_retry_rule_on_a_full_partition(world):  # S5, S7
    import modal

    q = modal.Queue.from_name("sem-full", create_if_missing=True)
    for _ in range(5):
        q.put_many([b"x"] * 1000, partition="p")
    refused = lambda: world.describe()["stats"]["p"].get("put_full", 0)  # noqa: E731 - puts the server refused
    with pytest.raises(stdlib_queue.Full):
        q.put(b"y", block=True, timeout=1.5, partition="p")  # under ~2.1 s: refused after one try
    assert refused() == 1
    with pytest.raises(stdlib_queue.Full):
        q.put(b"y", block=False, partition="p")
    assert refused() == 2
    with pytest.raises(stdlib_queue.Full):
        q.put(b"y", block=True, timeout=3.0, partition="p")  # tries at 0, 0.1, 0.3, 0.7 s, then gives up
    assert refused() == 2 + 4 and q.len(partition="p") == 5000


def test_gets_block_return_and_raise_as_modals(world):  # S10
    import modal

    q = modal.Queue.from_name("sem-get", create_if_missing=True)
    assert q.get(block=False, partition="a") is None and q.get_many(3, block=False, partition="a") == []
    with pytest.raises(stdlib_queue.Empty):
        q.get(timeout=0.2, partition="a")
    threading.Timer(0.3, lambda: q.put_many([b"1", b"2"], partition="a")).start()
    assert q.get_many(5, timeout=10, partition="a") == [b"1", b"2"]


def test_item_and_request_size_limits(world):  # S6, S9
    import modal
    import modal.exception

    from cellfeed_testing.modal_emulator.limits import MAX_REQUEST_BYTES

    q = modal.Queue.from_name("sem-size", create_if_missing=True)
    with pytest.raises(modal.exception.InvalidError, match="1,048,585"):  # 1 MiB of bytes is 9 bytes more pickled
        q.put(b"x" * (1 << 20), partition="p")
    q.put(b"x" * ((1 << 20) - 64), partition="p")
    big = [b"y" * (1 << 19)] * (MAX_REQUEST_BYTES // (1 << 19) + 1)
    with pytest.raises(modal.exception.RequestSizeError):
        q.put_many(big, block=False, partition="p")
    with pytest.raises(modal.exception.TimeoutError):  # a timed blocking put: retried as UNKNOWN, then a timeout
        q.put_many(big, block=True, timeout=1.0, partition="p")


def test_partitions_and_dict_entries_expire_on_the_emulated_clock(world):  # S8, S12
    import modal

    q = modal.Queue.from_name("sem-ttl", create_if_missing=True)
    d = modal.Dict.from_name("sem-ttl", create_if_missing=True)
    q.put(b"a", partition="old")
    d.put("idle", 1)
    d.put("used", 1)
    world.advance(23 * 3600)
    q.put(b"b", partition="fresh")
    assert q.len(partition="old") == 1 and d.get("used") == 1  # a read is a use
    world.advance(2 * 3600)
    assert q.len(partition="old") == 0 and q.len(partition="fresh") == 1  # 24 h after its last put
    world.advance(6 * 24 * 3600 - 3600)
    assert d.get("idle") is None and d.get("used") == 1  # 7 days without a read or write


def test_function_calls_run_in_processes_and_raise_as_modals(world, tmp_path):  # S13, S14, S16
    import modal.exception

    from cellfeed_testing.modal_emulator.client import FunctionCall

    calls = _probe_app(world)
    sleeper = calls("sleeps", 30)
    with pytest.raises(builtins.TimeoutError):  # still running: the builtin TimeoutError (modal/_functions.py)
        sleeper.get(timeout=0)
    assert not issubclass(modal.exception.TimeoutError, builtins.TimeoutError)
    sleeper.cancel()
    with pytest.raises(modal.exception.RemoteError):
        sleeper.get(timeout=20)
    overtime = calls("sleeps", 30)  # its timeout is 600 s: on the emulated clock it runs past it
    wait_for(
        lambda: any(c["id"] == overtime.object_id and c["status"] == "running" for c in world.calls("sleeps")),
        "the call to start",
    )
    world.advance(601)
    with pytest.raises(modal.exception.FunctionTimeoutError):
        overtime.get(timeout=30)
    assert calls("adds", 2, 3).get(timeout=60) == 5
    world.fail("adds", times=2)  # two failures, then the third attempt runs: `retries=3`
    assert FunctionCall.from_id(calls("adds", 1, 1).object_id).get(timeout=60) == 2
    world.fail("adds", times=4)  # 1 + 3 retries, all failed: the error
    with pytest.raises(RuntimeError, match="injected fault"):
        calls("adds", 1, 1).get(timeout=60)
    with pytest.raises(ValueError, match="no negatives"):  # the remote exception, re-raised as its type
        calls("adds", -1, 1).get(timeout=60)


def test_preemption_interrupts_and_runs_the_same_input_again(world):  # S15
    calls = _probe_app(world)
    call = calls("counts_attempts", str(world.root / "attempts.txt"))
    wait_for(lambda: (world.root / "attempts.txt").exists(), "the first attempt to start")
    world.preempt(call.object_id)
    assert call.get(timeout=60) == 2  # the input ran again, and the body saw the interrupt first
    (described,) = [c for c in world.calls("counts_attempts") if c["id"] == call.object_id]
    assert [a["outcome"] for a in described["attempts"]] == ["preempted", "success"]
    assert (world.root / "attempts.txt").read_text().split() == ["start", "interrupted", "start"]


def test_a_body_imports_only_what_its_image_installs(world):  # S20
    """`probe_image` adds only `tests`: numpy (installed on this machine) is not there, in the
    body or in a Python the body starts; an image that pip-installs numpy has it; the rest of the
    repository is not in either."""
    calls = _probe_app(world)
    assert calls("imports_bare", ["json", "modal", "tests.modal_probe_app"]).get(timeout=60) == [
        "json",
        "modal",
        "tests.modal_probe_app",
    ]
    with pytest.raises(
        ModuleNotFoundError,
        match=r"No module named 'numpy': this function's image "
        r"\(debian_slim\(3.11\)\.add_local_python_source\(tests\)\)",
    ):
        calls("imports_bare", ["numpy"]).get(timeout=60)
    assert calls("imports_numpy_image", ["numpy"]).get(timeout=60) == ["numpy"]
    for image in ("imports_bare", "imports_numpy_image"):
        with pytest.raises(ModuleNotFoundError, match="No module named 'producers'"):
            calls(image, ["producers"]).get(timeout=60)


def test_an_image_allows_its_packages_dependencies_and_modals():  # S20
    from cellfeed_testing.modal_emulator.images import ImageGuard, container_spec

    spec = container_spec({"pip": ["torch==2.13.0"], "sources": ["trainer"], "label": "t"})
    guard = ImageGuard(spec["allow"], spec["sources"], spec["label"])  # (its finder wrapping: the test above)
    for ok in (
        "torch",
        "sympy",
        "networkx",
        "filelock",
        "modal",
        "grpclib",
        "google.protobuf",
        "trainer.train",
        "json",
        "cellfeed_testing.modal_emulator.client",
    ):
        assert guard.permits(ok), ok
    for refused in ("lance", "pyarrow", "polars", "zstandard", "producers", "cellfeed_testing.object_store"):
        assert not guard.permits(refused), refused
    assert container_spec({"pip": ["numpy==0.0.1"], "sources": [], "label": "x"})["other_versions"]


def _probe_app(world):
    """A tiny app of its own (tests/modal_probe_app.py), spawned through the emulator."""
    import importlib
    import sys

    sys.modules.pop("tests.modal_probe_app", None)
    probe = importlib.import_module("tests.modal_probe_app")
    return lambda name, *args: getattr(probe, name).spawn(*args)


# ---- cellfeed's Modal backend on it: each test failed before its fix


def test_a_named_map_handle_reaches_the_map_a_resumed_epoch_made_again(world):
    """Modal binds a handle to one dict: a producer's handle to an epoch map that a resumed driver
    dropped and made again used to meet the deleted dict (MapGone: a boundary piece lost)."""
    from coordination.modal_backend import ModalMap
    from coordination.queues import MapGone

    store = ModalMap("cellfeed-handles")
    store.named("e0", create=True)
    producers_handle = store.named("e0")
    producers_handle.put("piece", b"1")  # bound to the first dict
    store.drop("e0")
    store.named("e0", create=True)  # the resumed epoch's map
    assert producers_handle.put("piece", b"2", skip_if_exists=True) is True
    assert store.named("e0").get("piece") == b"2"
    store.drop("e0")  # the epoch is over for good
    with pytest.raises(MapGone):
        producers_handle.get("piece")
    with pytest.raises(MapGone):  # keys() is lazy on Modal: its error used to escape the translation
        producers_handle.keys()


@pytest.fixture
def emulated_producer(world, small_synth):
    """A real producer whose queue and map are Modal's (emulated)."""
    from coordination.modal_backend import run_backends
    from producers.config import ProducerConfig
    from producers.producer import Producer

    def make(run: str, **config):
        queue, store = run_backends(run)
        config = ProducerConfig(dataset=small_synth.uri, run=run, world_size=2, max_genes=32, **config)
        return Producer(config, queue, store, dataset=small_synth), queue

    return make


def test_a_full_partition_is_waited_on_not_sent_to_again_and_again(world, emulated_producer):
    """On Modal a put with a timeout under ~2 s is refused at once on a full partition: the
    producer used to re-send its batch (up to 2 MiB each time) in a tight loop."""
    producer, queue = emulated_producer("spin", put_timeout_s=120)
    queue.put_many([b"x" * 8] * 5000, partition="rank-0")  # full
    before = world.describe()["stats"]["rank-*"]
    batch = [b"item-%d" % i for i in range(4)]
    sender = threading.Thread(target=producer.courier.send, args=(batch, "rank-0"))
    sender.start()
    since = lambda what: world.describe()["stats"]["rank-*"].get(what, 0) - before.get(what, 0)  # noqa: E731
    wait_for(lambda: since("len_requests") >= 3, "the producer to look at the partition's length")
    assert since("put_full") == 1  # one refusal, then it waits for room
    queue.get_many(10, partition="rank-0")  # the trainer takes some
    sender.join(timeout=60)
    assert not sender.is_alive()
    assert since("put_full") == 1 and queue.len(partition="rank-0") == 5000 - 10 + 4


def test_a_request_too_large_is_split_not_reported_full(world, emulated_producer):
    """A request over Modal's size limit used to surface as a Modal TimeoutError, read as a full
    partition: the producer spun until "stayed full... is the trainer consuming?"."""
    from cellfeed_testing.modal_emulator.limits import MAX_REQUEST_BYTES as EMULATED_LIMIT
    from coordination.queues import MAX_ITEM_BYTES, MAX_REQUEST_BYTES, RequestTooLarge

    producer, queue = emulated_producer("split", put_timeout_s=30)
    assert MAX_REQUEST_BYTES < EMULATED_LIMIT  # batches are capped under the limit assumed for Modal
    items = [bytes([i]) * MAX_ITEM_BYTES for i in range(6)]  # one item of the largest size passes
    with pytest.raises(RequestTooLarge):
        queue.put_many(items, block=True, timeout=1.0, partition="rank-1")
    refused_full = world.describe()["stats"]["rank-*"].get("put_full", 0)
    producer.courier.send(items, "rank-1")
    assert sorted(queue.get_many(10, block=False, partition="rank-1")) == items
    assert world.describe()["stats"]["rank-*"].get("put_full", 0) == refused_full  # never taken for "full"


def test_a_running_call_is_running(world):
    """`FunctionCall.get(timeout=0)` on a running call raises the builtin TimeoutError: the fleet
    check used to catch modal's TimeoutError, judge a running fleet dead and spawn a second."""
    from tests.conftest import fresh_import

    with fresh_import("app.modal_calls") as modal_calls:
        calls = _probe_app(world)
        running = calls("sleeps", 30)
        assert modal_calls.call_state(running) == ("running", None)
        done = calls("adds", 1, 2)
        done.get(timeout=60)
        assert modal_calls.call_state(done) == ("ended", None)
        failed = calls("adds", -1, 2)
        wait_for(lambda: modal_calls.call_state(failed)[0] != "running", "the failing call to end")
        state, error = modal_calls.call_state(failed)
        assert state == "failed" and isinstance(error, ValueError)
        running.cancel()


def test_a_held_out_set_larger_than_a_partition_is_refused_up_front():
    from coordination.errors import CellfeedError
    from coordination.queues import MAX_PARTITION_BYTES
    from producers.held_out import check_fits_partition

    check_fits_partition(1000, 5000, MAX_PARTITION_BYTES)
    with pytest.raises(CellfeedError, match="does not fit one queue partition.*lower --eval-cells"):
        check_fits_partition(700_000, 5_001, 10)
    with pytest.raises(CellfeedError, match="does not fit one queue partition"):
        check_fits_partition(100, 100, MAX_PARTITION_BYTES + 1)
