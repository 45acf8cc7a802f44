"""The local Modal control plane (cellfeed_testing/modal_control_plane) driven by modal's own client.

Every test starts a plane in this process and runs the installed, unmodified `modal` package in a
subprocess against it (`MODAL_SERVER_URL`, a test token): what the subprocess prints is what modal's
client returned. Waits poll the plane's state for an event, with a timeout; nothing sleeps to sync.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from cellfeed_testing.modal_control_plane import ControlPlane
from tests.conftest import wait_for

REPO = Path(__file__).resolve().parent.parent
CLIENT_TIMEOUT_S = 120


@pytest.fixture(params=["tcp"])
def plane(request, tmp_path):
    with ControlPlane(tmp_path / "plane", transport=request.param) as p:
        yield p


def client_env(plane: ControlPlane) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    return {**env, **plane.env}


def start_client(plane: ControlPlane, code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=client_env(plane),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen):
    """The JSON the client printed last; its stderr on failure."""
    out, err = proc.communicate(timeout=CLIENT_TIMEOUT_S)
    assert proc.returncode == 0, f"client exited {proc.returncode}:\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def run_client(plane: ControlPlane, code: str):
    return finish(start_client(plane, code))


# ---- the server itself


def test_every_rpc_is_answered_and_an_unimplemented_one_names_itself(plane):
    from modal_proto.api_grpc import ModalClientBase

    from cellfeed_testing.modal_control_plane.server import Servicer

    assert not Servicer.__abstractmethods__
    assert set(Servicer().__mapping__()) == set(ModalClientBase.__mapping__(Servicer()))
    got = run_client(
        plane,
        """
        import json, modal
        try:
            modal.App.lookup("no-such-app")
        except modal.exception.UnimplementedError as e:
            print(json.dumps([type(e).__name__, str(e)]))
        """,
    )
    assert got == ["UnimplementedError", "AppGetOrCreate is not implemented by cellfeed's Modal control plane"]
    assert plane.servicer.unimplemented_calls == ["AppGetOrCreate"]


def test_the_client_is_modal_s_installed_package(plane):
    installed = str(metadata.distribution("modal").locate_file("modal/__init__.py"))
    got = run_client(plane, "import json, modal; print(json.dumps([modal.__file__, modal.__version__]))")
    assert got == [installed, metadata.version("modal")]
    # and this package provides no `modal` of its own
    assert not [p for p in (REPO / "cellfeed_testing" / "modal_control_plane").rglob("modal*")]


# ---- Dict


@pytest.mark.parametrize("plane", ["tcp", "unix"], indirect=True)
def test_dict_round_trips_exact_values(plane):
    got = run_client(
        plane,
        """
        import json, modal
        d = modal.Dict.from_name("coord", create_if_missing=True)
        out = {}
        out["put"] = d.put("plan", {"epoch": 1, "units": [3, 1, 2]})
        out["skip"] = d.put("plan", "other", skip_if_exists=True)
        out["skip_new"] = d.put(("t", 7), b"\\x00\\xff" * 3, skip_if_exists=True)
        out["get"] = d.get("plan")
        out["get_tuple_key"] = list(d.get(("t", 7)))
        out["missing"] = d.get("nope", "default")
        out["contains"] = [d.contains("plan"), d.contains("nope")]
        out["len"] = d.len()
        out["keys"] = sorted(map(str, d.keys()))
        out["pop"] = d.pop("plan")
        try:
            d.pop("plan")
        except KeyError:
            out["pop_again"] = "KeyError"
        out["pop_default"] = d.pop("plan", 5)
        out["len_after"] = d.len()
        out["other_handle"] = list(modal.Dict.from_name("coord").get(("t", 7)))
        print(json.dumps(out))
        """,
    )
    assert got == {
        "put": True,
        "skip": False,
        "skip_new": True,
        "get": {"epoch": 1, "units": [3, 1, 2]},
        "get_tuple_key": [0, 255, 0, 255, 0, 255],
        "missing": "default",
        "contains": [True, False],
        "len": 2,
        "keys": ["('t', 7)", "plan"],
        "pop": {"epoch": 1, "units": [3, 1, 2]},
        "pop_again": "KeyError",
        "pop_default": 5,
        "len_after": 1,
        "other_handle": [0, 255, 0, 255, 0, 255],
    }
    # the server holds the client's serialized bytes, never Python objects
    (state,) = plane.servicer.store.dicts.values()
    assert all(isinstance(k, bytes) and isinstance(v, bytes) for k, (v, _) in state.entries.items())


def test_a_deleted_dict_is_gone_for_old_handles_and_a_new_one_is_another_object(plane):
    got = run_client(
        plane,
        """
        import json, modal
        d = modal.Dict.from_name("run", create_if_missing=True)
        d["k"] = 1
        old_id = d.object_id
        modal.Dict.objects.delete("run")
        out = {}
        try:
            d.get("k")
        except modal.exception.NotFoundError:
            out["old_handle"] = "NotFoundError"
        try:
            modal.Dict.from_name("run").hydrate()
        except modal.exception.NotFoundError:
            out["lookup"] = "NotFoundError"
        modal.Dict.objects.delete("run", allow_missing=True)
        new = modal.Dict.from_name("run", create_if_missing=True)
        out["new_empty"] = new.len()
        out["new_is_other"] = new.object_id != old_id
        print(json.dumps(out))
        """,
    )
    assert got == {"old_handle": "NotFoundError", "lookup": "NotFoundError", "new_is_other": True, "new_empty": 0}


# ---- Queue


@pytest.mark.parametrize("plane", ["tcp", "unix"], indirect=True)
def test_queue_partitions_are_fifo_and_independent(plane):
    got = run_client(
        plane,
        """
        import json, modal
        q = modal.Queue.from_name("feed", create_if_missing=True)
        q.put_many([1, 2, 3])
        q.put_many([b"a", b"b"], partition="rank-0")
        q.put({"unit": 9}, partition="rank-1")
        out = {}
        out["len"] = [q.len(), q.len(partition="rank-0"), q.len(partition="rank-1"), q.len(total=True)]
        out["default"] = q.get_many(2)
        out["rank0"] = [x.decode() for x in q.get_many(5, partition="rank-0")]
        out["rank1"] = q.get(partition="rank-1")
        out["nonblocking_empty"] = [q.get(block=False, partition="rank-1"), q.get_many(3, block=False, partition="rank-1")]
        out["rest"] = q.get()
        q.put_many(list(range(10)), partition="rank-0")
        q.clear(partition="rank-0")
        q.put(1, partition="x"); q.put(2)
        out["after_clear"] = [q.len(partition="rank-0"), q.len(total=True)]
        q.clear(all=True)
        out["after_clear_all"] = q.len(total=True)
        try:
            q.put(1, partition="p" * 65)
        except modal.exception.InvalidError:
            out["long_key"] = "InvalidError"
        try:
            q.put(b"x" * (1 << 20))
        except modal.exception.InvalidError:
            out["item_over_1MiB"] = "InvalidError"
        q.put(b"x" * ((1 << 20) - 100))  # under the limit as serialized
        out["item_under"] = len(q.get())
        print(json.dumps(out))
        """,
    )
    assert got == {
        "len": [3, 2, 1, 6],
        "default": [1, 2],
        "rank0": ["a", "b"],
        "rank1": {"unit": 9},
        "nonblocking_empty": [None, []],
        "rest": 3,
        "after_clear": [0, 2],
        "after_clear_all": 0,
        "long_key": "InvalidError",
        "item_over_1MiB": "InvalidError",
        "item_under": (1 << 20) - 100,
    }


def test_queue_get_blocks_until_a_put_or_its_timeout(plane):
    waiter = start_client(
        plane,
        """
        import json, queue, time, modal
        q = modal.Queue.from_name("tasks", create_if_missing=True)
        t0 = time.monotonic()
        try:
            q.get(timeout=0.5, partition="other")
        except queue.Empty:
            empty_after = time.monotonic() - t0
        got = q.get_many(3, timeout=60, partition="tasks")  # woken by the other client's put
        print(json.dumps({"empty_after": empty_after, "got": got, "left": q.len(partition="tasks")}))
        """,
    )
    # the second get is blocked in the server: then, and only then, another client puts
    store = plane.servicer.store

    def blocked_in_second_get():
        assert waiter.poll() is None, waiter.communicate()
        oid = store.names.get(("queue", "main", "tasks"))
        return oid and store.waiting_gets[oid, b"tasks"] == 1

    wait_for(blocked_in_second_get, "the waiting client's blocking get", timeout=60)
    run_client(
        plane,
        """
        import json, modal
        modal.Queue.from_name("tasks").put_many([7, 8, 9, 10], partition="tasks")
        print("{}")
        """,
    )
    got = finish(waiter)
    assert got["got"] == [7, 8, 9] and got["left"] == 1
    assert 0.5 <= got["empty_after"] < 5


def test_queue_delete_frees_the_name_and_old_handles_fail(plane):
    got = run_client(
        plane,
        """
        import json, modal
        q = modal.Queue.from_name("events", create_if_missing=True)
        q.put(1)
        modal.Queue.objects.delete("events")
        out = {}
        try:
            q.len()
        except modal.exception.NotFoundError:
            out["old_handle"] = "NotFoundError"
        try:
            modal.Queue.objects.delete("events")
        except modal.exception.NotFoundError:
            out["delete_missing"] = "NotFoundError"
        out["fresh_len"] = modal.Queue.from_name("events", create_if_missing=True).len()
        print(json.dumps(out))
        """,
    )
    assert got == {"old_handle": "NotFoundError", "delete_missing": "NotFoundError", "fresh_len": 0}
