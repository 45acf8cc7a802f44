"""Network faults on the local Modal control plane (cellfeed_testing/modal_control_plane/faults.py),
met by modal's own, unmodified client in a subprocess: what the client does with a burst of errors,
a lost reply, a slow answer (its retries, its idempotency keys, the exception it raises) is read
from what the subprocess printed and from the plane's own account of each rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cellfeed_testing.modal_control_plane import ControlPlane
from tests.conftest import wait_for

REPO = Path(__file__).resolve().parent.parent
CLIENT_TIMEOUT_S = 120


@pytest.fixture
def plane(tmp_path):
    with ControlPlane(tmp_path / "plane") as p:
        yield p


def run_client(plane: ControlPlane, code: str, cwd: Path = REPO, go_when=None):
    """Run `code` with modal's client against `plane`; the JSON it printed last. With `go_when`, the
    client's `sys.stdin.readline()` returns once `go_when()` holds on the plane (an event, not a sleep)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**env, **plane.env},
        cwd=cwd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if go_when is not None:
            wait_for(lambda: go_when() or proc.poll() is not None, "the plane's event", CLIENT_TIMEOUT_S)
            if proc.poll() is None:
                proc.stdin.write("go\n")
                proc.stdin.flush()
        out, err = proc.communicate(timeout=CLIENT_TIMEOUT_S)
    finally:  # (a client past its timeout, or a wait that failed: killed and reaped, as subprocess.run does)
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == 0, f"client exited {proc.returncode}:\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


# ---- bursts


@pytest.mark.parametrize(
    "status, calls, seen_by_caller, hits",
    [
        ("UNAVAILABLE", 4, "ServiceError", 4),  # 4 attempts (max_retries=3), all failed: the caller sees it
        ("INTERNAL", 4, "InternalError", 4),
        ("UNAVAILABLE", 3, 7, 3),  # the 4th attempt passes: retried past in silence
        ("RESOURCE_EXHAUSTED", 1, "ResourceExhaustedError", 1),  # a Dict get does not retry it: raised at once
    ],
)
def test_a_burst_reaches_the_caller_only_past_the_client_s_own_retries(plane, status, calls, seen_by_caller, hits):
    index = plane.fault("grpc_burst", "dict", op="get", after=1, calls=calls, status=status)
    got = run_client(
        plane,
        """
        import json, time, modal
        d = modal.Dict.from_name("burst", create_if_missing=True)
        d["k"] = 7
        out = {"first": d.get("k")}
        t0 = time.monotonic()
        try:
            out["second"] = d.get("k")
        except Exception as e:
            out["second"] = type(e).__name__
        out["second_s"] = time.monotonic() - t0
        out["third"] = d.get("k")
        print(json.dumps(out))
        """,
    )
    assert got["first"] == 7 and got["second"] == seen_by_caller and got["third"] == 7
    rule = plane.faults()[index]
    assert rule["hits"] == hits and rule["done"] == (hits == calls)
    # the client's retries of one call carry one idempotency key, their attempt counted up (grpc_utils.py:638-656)
    assert rule["keys_hit"] == 1 and [e["attempt"] for e in rule["events"]] == list(range(hits))
    assert len({e["key"] for e in rule["events"]}) == 1 and rule["retries_seen"] == (3 if hits > 1 else 0)
    assert rule["recovered"] == (1 if seen_by_caller == 7 else 0)
    if hits > 1:  # backoff 0.1, 0.2, 0.4 s between attempts (Retry(): grpc_utils.py:499-509, 771-772)
        assert got["second_s"] >= 0.1 + 0.2 + (0.4 if hits == 4 else 0.0) - 0.05


# ---- lost replies


def test_a_lost_queue_get_reply_loses_exactly_its_items_and_the_retry_gets_the_next(plane):
    index = plane.fault("lost_reply", "queue", op="get", partition="rank-")
    got = run_client(
        plane,
        """
        import json, modal
        q = modal.Queue.from_name("lost-get", create_if_missing=True)
        q.put_many(list(range(10)), partition="rank-0")
        q.put("task", partition="tasks")
        out = {"tasks": q.get(partition="tasks")}  # not a rank- partition: the rule lets it be
        out["empty"] = q.get_many(3, block=False, partition="rank-1")  # a rank- get that takes nothing
        out["get"] = q.get_many(3, partition="rank-0")  # takes 0, 1, 2; its reply is lost; the retry takes 3, 4, 5
        out["rest"] = q.get_many(100, block=False, partition="rank-0")
        print(json.dumps(out))
        """,
    )
    assert got == {"tasks": "task", "empty": [], "get": [3, 4, 5], "rest": [6, 7, 8, 9]}
    rule = plane.faults()[index]
    assert (rule["seen"], rule["hits"], rule["items_lost"], rule["done"]) == (2, 1, 3, True)
    # the client retried with the same key and was answered: the caller never saw the loss
    assert (rule["retries_seen"], rule["recovered"]) == (1, 1) and rule["events"][0]["attempt"] == 0


def test_lost_get_replies_past_the_client_s_retries_reach_the_caller_and_each_attempt_took_items(plane):
    index = plane.fault("lost_reply", "queue", op="get", calls=4)
    got = run_client(
        plane,
        """
        import json, modal
        q = modal.Queue.from_name("lost-gets", create_if_missing=True)
        q.put_many(list(range(10)))
        try:
            q.get_many(2)
        except Exception as e:
            out = {"error": [type(e).__module__, type(e).__name__]}
        out["rest"] = q.get_many(100, block=False)
        print(json.dumps(out))
        """,
    )
    # every attempt was applied (2 items each) and its reply lost; modal re-raises grpclib's own error
    assert got == {"error": ["grpclib.exceptions", "StreamTerminatedError"], "rest": [8, 9]}
    rule = plane.faults()[index]
    assert (rule["hits"], rule["items_lost"], rule["keys_hit"], rule["recovered"]) == (4, 8, 1, 0)
    assert [e["attempt"] for e in rule["events"]] == [0, 1, 2, 3]


def test_a_burst_and_lost_replies_on_one_call_spend_its_attempts_together(plane):
    burst = plane.fault("grpc_burst", "queue", op="get", calls=2)
    lose = plane.fault("lost_reply", "queue", op="get", calls=2)
    got = run_client(
        plane,
        """
        import json, modal
        q = modal.Queue.from_name("both", create_if_missing=True)
        q.put_many(list(range(6)))
        try:
            q.get_many(2)
        except Exception as e:
            out = {"error": type(e).__name__}
        out["rest"] = q.get_many(100, block=False)
        print(json.dumps(out))
        """,
    )
    # attempts 0 and 1 failed unapplied (the burst), 2 and 3 were applied and their replies lost
    assert got == {"error": "StreamTerminatedError", "rest": [4, 5]}
    b, lost_rule = plane.faults()[burst], plane.faults()[lose]
    assert [e["attempt"] for e in b["events"]] == [0, 1] and b["items_lost"] == 0
    assert [e["attempt"] for e in lost_rule["events"]] == [2, 3] and lost_rule["items_lost"] == 4
    assert (b["keys_hit"], b["recovered"]) == (lost_rule["keys_hit"], lost_rule["recovered"]) == (1, 0)


def test_a_lost_dict_pop_reply_removes_the_key_and_the_retry_finds_it_gone(plane):
    index = plane.fault("lost_reply", "dict", op="pop")
    got = run_client(
        plane,
        """
        import json, modal
        d = modal.Dict.from_name("lost-pop", create_if_missing=True)
        d.update(a=1, b=2, c=3)
        out = {"missing": d.pop("nope", None)}  # finds nothing: the rule waits for a pop that does
        try:
            out["a"] = d.pop("a")  # applied (a is gone), the reply lost; the retry finds no a
        except KeyError:
            out["a"] = "KeyError"
        out["contains_a"] = d.contains("a")
        out["b"] = d.pop("b", None)  # the rule is done: answered
        out["left"] = sorted(d.keys())
        print(json.dumps(out))
        """,
    )
    assert got == {"missing": None, "a": "KeyError", "contains_a": False, "b": 2, "left": ["c"]}
    rule = plane.faults()[index]
    assert (rule["seen"], rule["hits"], rule["items_lost"], rule["recovered"]) == (2, 1, 1, 1)


PROBE_APP = '''
import modal

app = modal.App("faults-probe")
image = modal.Image.debian_slim(python_version="3.11").add_local_python_source("fp_probe")


@app.function(image=image, timeout=600)
def notes(path: str, text: str) -> str:
    """Appends `text` and this call's id to `path`; returns `text`."""
    with open(path, "a") as f:
        f.write(f"{text} {modal.current_function_call_id()}\\n")
    return text


@app.function(image=image, timeout=600)
def pops(name: str, key: str) -> str:
    """Puts `key` in the Dict `name` and pops it, from inside a container."""
    d = modal.Dict.from_name(name, create_if_missing=True)
    d[key] = "v"
    try:
        return d.pop(key)
    except KeyError:
        return "KeyError"
'''


@pytest.fixture
def probe(tmp_path) -> Path:
    pkg = tmp_path / "probe" / "fp_probe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "app.py").write_text(PROBE_APP)
    return pkg.parent


def test_a_lost_spawn_reply_makes_a_second_call_when_the_client_retries(plane, probe, tmp_path):
    index = plane.fault("lost_reply", "spawn", function="notes")
    path = tmp_path / "notes.txt"
    got = run_client(
        plane,
        f"""
        import json, time
        import modal
        from fp_probe.app import app, notes
        with app.run():
            call = notes.spawn({str(path)!r}, "once")
            result = call.get(timeout=60)
            # the call whose reply was lost runs too: its output is waited for (it names itself in the
            # file) before the app stops with this client, which would cancel it
            deadline = time.monotonic() + 120
            while len(open({str(path)!r}).read().split()) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            other = [w for w in open({str(path)!r}).read().split() if w.startswith("fc-") and w != call.object_id]
            modal.FunctionCall.from_id(other[0]).get(timeout=60)
            print(json.dumps({{"id": call.object_id, "result": result}}))
        """,
        cwd=probe,
    )
    calls = plane.call_list("notes")
    rule = plane.faults()[index]
    # the spawn's retry (same idempotency key) is a new FunctionMap: the plane does not deduplicate on it
    assert got["result"] == "once" and [c["status"] for c in calls] == ["success", "success"]
    assert rule["calls_made"] == [calls[0]["id"]] and got["id"] == calls[1]["id"]
    assert (rule["retries_seen"], rule["recovered"]) == (1, 1)
    # both calls ran the body: the function ran twice for one spawn
    assert sorted(path.read_text().split()) == sorted(["once", calls[0]["id"], "once", calls[1]["id"]])


def test_a_lost_get_outputs_reply_is_asked_again_and_the_output_is_still_there(plane, probe, tmp_path):
    index = plane.fault("lost_reply", "call", op="get", function="notes")
    path = tmp_path / "notes.txt"
    got = run_client(
        plane,
        f"""
        import json
        from fp_probe.app import app, notes
        with app.run():
            call = notes.spawn({str(path)!r}, "result")
            print(json.dumps({{"result": call.get(timeout=60), "again": call.get(timeout=60)}}))
        """,
        cwd=probe,
    )
    assert got == {"result": "result", "again": "result"}
    rule = plane.faults()[index]
    # FunctionCall.get polls with clear_on_success=False (_functions.py:349-353): the output stays
    assert (rule["hits"], rule["items_lost"], rule["recovered"]) == (1, 1, 1)
    assert len(plane.call_list("notes")) == 1 and len(path.read_text().splitlines()) == 1


def test_a_container_s_requests_are_faulted_too_and_named_by_its_task(plane, probe):
    index = plane.fault("lost_reply", "dict", op="pop")
    got = run_client(
        plane,
        """
        import json
        from fp_probe.app import app, pops
        with app.run():
            print(json.dumps(pops.remote("in-container", "k")))
        """,
        cwd=probe,
    )
    assert got == "KeyError"  # the pop was applied in the container, its reply lost, the retry found no key
    ((attempt,),) = [c["attempts"] for c in plane.call_list("pops")]
    assert [e["from"] for e in plane.faults()[index]["events"]] == [attempt["task"]]


# ---- latency


def test_a_reset_connection_ends_every_request_on_it_and_the_client_retries_them_on_a_new_one(plane):
    """`connection_reset`: the matching put's connection aborts before the put is applied, and a
    blocking get in flight on the same connection (another thread of the same client) ends with it.
    Modal's client retries both on a new connection: the put is applied once, the get gets its item."""
    index = plane.fault("connection_reset", "queue", op="put", partition="work", after=1)
    gets = plane.fault("grpc_burst", "queue", op="get", partition="late", after=10**9, calls=1)  # counts only
    got = run_client(
        plane,
        """
        import json, sys, threading, modal
        q = modal.Queue.from_name("reset", create_if_missing=True)
        q.put(0, partition="work")  # the rule's first match: let through
        waiting = {}
        getter = threading.Thread(target=lambda: waiting.update(got=q.get(timeout=60, partition="late")))
        getter.start()
        sys.stdin.readline()  # the plane has the get: it is in flight on the client's one connection
        q.put(1, partition="work")  # its connection aborts, unapplied; the retry puts it once
        q.put("late", partition="late")
        getter.join(90)
        print(json.dumps({"work": q.get_many(10, block=False, partition="work"), "late": waiting.get("got")}))
        """,
        go_when=lambda: plane.faults()[gets]["seen"] >= 1,
    )
    assert got == {"work": [0, 1], "late": "late"}
    rule = plane.faults()[index]
    assert (rule["hits"], rule["done"], rule["keys_hit"], rule["recovered"]) == (1, True, 1, 1)
    assert rule["retries_seen"] == 1 and rule["events"][0]["rpc"] == "QueuePut"
    assert plane.faults()[gets]["seen"] == 2  # the get in flight ended with the connection and was sent again


def test_latency_delays_exactly_the_matching_requests(plane):
    index = plane.fault("latency", "dict", op="get", after=1, calls=2, delay_s=1.0)
    got = run_client(
        plane,
        """
        import json, time, modal
        d = modal.Dict.from_name("slow", create_if_missing=True)
        d["k"] = "v"
        took = []
        for _ in range(4):
            t0 = time.monotonic()
            assert d.get("k") == "v"
            took.append(time.monotonic() - t0)
        t0 = time.monotonic()
        d["k2"] = "w"  # a put: not a get, never delayed
        print(json.dumps({"gets": took, "put": time.monotonic() - t0}))
        """,
    )
    first, second, third, fourth = got["gets"]
    assert second >= 1.0 and third >= 1.0 and first < 0.9 and fourth < 0.9 and got["put"] < 0.9
    rule = plane.faults()[index]
    assert (rule["seen"], rule["hits"], rule["done"]) == (3, 2, True)


def test_a_rule_is_checked_when_it_is_added(plane):
    with pytest.raises(ValueError, match="needs calls="):
        plane.fault("grpc_burst", "queue")
    with pytest.raises(ValueError, match="one Modal's client retries"):
        plane.fault("grpc_burst", "queue", calls=2, status="NOT_FOUND")
    with pytest.raises(ValueError, match="partition= narrows queue"):
        plane.fault("lost_reply", "dict", partition="rank-")
    assert plane.faults() == []
