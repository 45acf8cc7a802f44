"""The local Modal control plane (cellfeed_testing/modal_control_plane) driven by modal's own client.

Every test starts a plane in this process and runs the installed, unmodified `modal` package in a
subprocess against it (`MODAL_SERVER_URL`, a test token): what the subprocess prints is what modal's
client returned. Waits poll the plane's state for an event, with a timeout; nothing sleeps to sync.
"""

from __future__ import annotations

import contextlib
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


SECRETS = {"cp-secret": {"CP_TOKEN": "s3cr3t-value"}}  # the probe app's functions name it
MOUNT_ENV = {"/data": "DATA_DIR"}


@pytest.fixture(params=["tcp"])
def plane(request, tmp_path, kernel_volume):
    kw = dict(secrets=SECRETS, mount_env=MOUNT_ENV, lasting_volumes=kernel_volume)  # (conftest.py)
    with ControlPlane(tmp_path / "plane", transport=request.param, **kw) as p:
        yield p


def client_env(plane: ControlPlane) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    return {**env, **plane.env}


def start_client(plane: ControlPlane, code: str, cwd: Path = REPO) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=client_env(plane),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen):
    """The JSON the client printed last; its stderr on failure."""
    out, err = proc.communicate(timeout=CLIENT_TIMEOUT_S)
    assert proc.returncode == 0, f"client exited {proc.returncode}:\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def run_client(plane: ControlPlane, code: str, cwd: Path = REPO):
    return finish(start_client(plane, code, cwd))


# ---- the server itself


def test_every_rpc_is_answered_and_an_unimplemented_one_names_itself(plane, tmp_path):
    from modal_proto.api_grpc import ModalClientBase

    from cellfeed_testing.modal_control_plane.server import Servicer

    assert not Servicer.__abstractmethods__
    servicer = Servicer(tmp_path)  # its root given: a default one is a folder in /tmp the test would leave behind
    assert set(servicer.__mapping__()) == set(ModalClientBase.__mapping__(servicer))
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
        out["nonblocking_empty"] = [
            q.get(block=False, partition="rank-1"), q.get_many(3, block=False, partition="rank-1")
        ]
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


# ---- apps, functions, spawn, containers

PROBE_APP = '''
import os, subprocess, sys, time
import modal

app = modal.App("cellfeed-control-plane-probe")
# pip_install first: modal refuses a build step after add_local_* (_image.py:677)
image = modal.Image.debian_slim(python_version="3.11").pip_install("numpy>=1.26").add_local_python_source("cp_probe")


@app.function(image=image, retries=2, timeout=600)
def adds(a: int, b: int) -> int:
    print(f"adds({a}, {b}) in {os.environ['MODAL_TASK_ID']}")
    if a < 0:
        raise ValueError("no negatives")
    return a + b


@app.function(image=image, timeout=600)
def dies(code: int) -> int:
    os._exit(code)


@app.function(image=image, timeout=600)
def bars(n: int) -> int:
    """A progress bar's output: n updates rewriting one line with a carriage return, never a newline."""
    for i in range(n):
        sys.stderr.write(f"\\rstep {i:>9,} of {n:,} " + "#" * 40)
    sys.stderr.flush()
    return n


@app.function(image=image, timeout=600)
def where() -> dict:
    remote = os.environ.get("MODAL_IS_REMOTE")
    return {"modal": modal.__file__, "remote": remote, "cwd": os.getcwd(), "env": sorted(os.environ)}


@app.function(image=image, timeout=600)
def blocks(path: str) -> None:
    """Starts a child, and another in a session of its own; notes every pid, then waits."""
    child = subprocess.Popen(["sleep", "600"])
    escaped = subprocess.Popen(["sleep", "600"], start_new_session=True)
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid} {escaped.pid}")
    os.rename(path + ".tmp", path)
    time.sleep(600)


vol = modal.Volume.from_name("cp-vol", create_if_missing=True)
secret = modal.Secret.from_name("cp-secret")
env_image = (
    modal.Image.debian_slim(python_version="3.11")
    .env({"CP_SPACED": "a b=c", "CP_TOKEN": "from-the-image"})
    .env({"CP_LATER": "1"})
    .add_local_python_source("cp_probe")
)


@app.function(image=env_image, secrets=[secret], timeout=600)
def env_of() -> dict:
    return {k: os.environ.get(k) for k in ("CP_SPACED", "CP_TOKEN", "CP_LATER")}


@app.function(image=image, volumes={"/data": vol}, secrets=[secret], timeout=600)
def writes(name: str, text: str, hold_open: bool = False) -> dict:
    """Writes a file on the Volume (where the plane says /data is), commits; the Secret's variable."""
    import json
    root = json.loads(os.environ["MODAL_CONTROL_PLANE_VOLUMES"])["/data"]
    os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
    with open(os.path.join(root, name), "w") as f:
        f.write(text)
    out = {"secret": os.environ.get("CP_TOKEN"), "data_dir_is_root": os.environ.get("DATA_DIR") == root}
    held = open(os.path.join(root, name)) if hold_open else None
    try:
        vol.commit()
        out["commit"] = "ok"
    except RuntimeError as e:
        out["commit"] = str(e)
    if held:
        held.close()
    return out


@app.function(image=image, volumes={"/data": vol}, timeout=600)
def reads(name: str) -> str:
    with open(os.path.join(os.environ["DATA_DIR"], name)) as f:
        return f.read()


@app.function(image=image, retries=0, timeout=600)
def counts_attempts(path: str) -> int:
    """Notes each start and each interrupt (a preemption's SIGINT) in `path`; returns the starts."""
    try:  # from before the start is noted: the test preempts on seeing it, and the SIGINT can land at once
        with open(path, "a") as f:
            f.write("start\\n")
        if "interrupted" not in open(path).read():  # the first attempt waits to be preempted
            time.sleep(600)
    except KeyboardInterrupt:
        with open(path, "a") as f:
            f.write("interrupted\\n")
        raise
    return sum(1 for line in open(path) if line.strip() == "start")


@app.local_entrypoint()
def main(a: int = 1, b: int = 2):
    print("RESULT", adds.spawn(a, b).get(timeout=60))
'''


@pytest.fixture
def probe(tmp_path) -> Path:
    """A folder holding `cp_probe`, a tiny app package (the client's working directory)."""
    pkg = tmp_path / "probe" / "cp_probe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "app.py").write_text(PROBE_APP)
    return pkg.parent


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_spawn_get_remote_and_exceptions_run_in_real_container_entrypoints(plane, probe):
    got = run_client(
        plane,
        """
        import json, modal
        from cp_probe.app import app, adds, dies, where
        out = {}
        with app.run():
            call = adds.spawn(2, 3)
            out["spawn_get"] = call.get(timeout=60)
            out["get_again"] = modal.FunctionCall.from_id(call.object_id).get(timeout=60)
            out["remote"] = adds.remote(4, 5)
            out["where"] = where.remote()
            try:
                adds.remote(-1, 1)
            except ValueError as e:
                out["raises"] = [type(e).__name__, str(e)]
            try:
                dies.spawn(3).get(timeout=60)
            except modal.exception.RemoteError as e:
                out["dies"] = str(e)
        print(json.dumps(out))
        """,
        cwd=probe,
    )
    assert got["spawn_get"] == 5 and got["get_again"] == 5 and got["remote"] == 9
    assert got["raises"] == ["ValueError", "no negatives"]
    assert "exited with code 3 without an output" in got["dies"]
    installed = str(metadata.distribution("modal").locate_file("modal/__init__.py"))
    assert got["where"]["modal"] == installed and got["where"]["remote"] == "1"
    assert got["where"]["cwd"].endswith("/fs/root")  # Modal's /root, where add_local_python_source put cp_probe
    # the failing input ran 1 + retries=2 times, each attempt in a container of its own
    calls = plane.servicer.calls.values()
    (failing,) = [c for c in calls if c.output and c.output.result.exception.startswith("ValueError")]
    assert [c.attempt for c in failing.containers] == [0, 1, 2]
    assert plane.servicer.unimplemented_calls == []


def test_a_container_writing_one_endless_line_is_not_stalled(plane, probe):
    """A progress bar never ends its line: 1.5 MB of carriage-return updates (past a line reader's 64
    KiB limit, which ended the plane's reader and then stalled the container on a full pipe) reach the
    container's log whole, and the call returns."""
    got = run_client(
        plane,
        """
        import json
        from cp_probe.app import app, bars
        with app.run():
            print(json.dumps({"n": bars.remote(20_000)}))
        """,
        cwd=probe,
    )
    assert got["n"] == 20_000
    (call,) = [c for c in plane.servicer.calls.values() if c.output is not None]
    log = (plane.servicer.containers.folder_for(call.containers[-1].task_id) / "stderr.log").read_bytes()
    # (after the last update the container may print an interrupt's traceback: the app stops with its client)
    bars, last, _ = log.partition(b"\rstep    19,999 of 20,000 ")
    assert log.count(b"\r") == 20_000 and last and b"\n" not in bars


@pytest.mark.parametrize("plane", ["tcp", "unix"], indirect=True)
def test_modal_run_cli_runs_a_local_entrypoint_that_spawns(plane, probe):
    proc = subprocess.run(
        [sys.executable, "-m", "modal", "run", "cp_probe/app.py", "--a", "3", "--b", "4"],
        env=client_env(plane),
        cwd=probe,
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "RESULT 7" in proc.stdout.splitlines()
    # the container's own print reached `modal run`'s terminal through AppGetLogs
    assert any(line.startswith("adds(3, 4) in ta-") for line in proc.stdout.splitlines()), proc.stdout
    (app,) = plane.servicer.apps.values()
    assert app.stopped  # the client disconnected: an ephemeral app stops


def _pids_of_a_blocked_container(plane, probe, tmp_path):
    """A client that spawns `blocks` and stays in `app.run()` until the file `leave` exists (the
    container's processes are checked alive meanwhile); the client, the container's pids, `leave`."""
    pid_file, leave = tmp_path / "pids", tmp_path / "leave"
    client = start_client(
        plane,
        f"""
        import os, time
        from cp_probe.app import app, blocks
        with app.run():
            call = blocks.spawn({str(pid_file)!r})
            deadline = time.monotonic() + 120
            while not os.path.exists({str(leave)!r}) and time.monotonic() < deadline:
                time.sleep(0.05)
        print("{{}}")
        """,
        cwd=probe,
    )
    pids = [
        int(p) for p in wait_for(lambda: pid_file.exists() and pid_file.read_text(), "the container's pids").split()
    ]
    assert all(alive(p) for p in pids)
    return client, pids, leave


def test_an_app_s_containers_stop_when_its_client_disconnects(plane, probe, tmp_path):
    client, pids, leave = _pids_of_a_blocked_container(plane, probe, tmp_path)
    leave.touch()
    finish(client)  # it left `app.run()`: AppClientDisconnect
    wait_for(lambda: not any(alive(p) for p in pids), "the app's container processes to end", timeout=30)
    (app,) = plane.servicer.apps.values()
    assert app.stopped


def test_no_process_the_plane_started_remains_after_it_stops(tmp_path, probe):
    plane = ControlPlane(tmp_path / "plane", secrets=SECRETS).start()
    try:
        client, pids, _ = _pids_of_a_blocked_container(plane, probe, tmp_path)
    finally:
        plane.stop()
    try:
        started = plane.servicer.containers.started_pids
        assert started and pids[0] in started
        assert [p for p in pids + started if alive(p)] == []
    finally:
        client.kill()
        client.communicate(timeout=CLIENT_TIMEOUT_S)


# ---- Volumes and Secrets


def test_a_volume_file_written_and_committed_in_a_container_is_read_back_on_the_laptop(plane, probe):
    got = run_client(
        plane,
        """
        import json, modal
        from cp_probe.app import app, writes, reads
        out = {}
        with app.run():
            out["writes"] = writes.remote("run/log.txt", "step 1\\nstep 2\\n")
            out["another_container_reads"] = reads.remote("run/log.txt")
        v = modal.Volume.from_name("cp-vol")
        out["read_file"] = b"".join(v.read_file("run/log.txt")).decode()
        out["listdir"] = sorted(e.path for e in v.listdir("/", recursive=True))
        try:
            b"".join(v.read_file("run/missing.txt"))
        except FileNotFoundError:
            out["missing"] = "FileNotFoundError"
        print(json.dumps(out))
        """,
        cwd=probe,
    )
    assert got == {
        "writes": {"secret": "s3cr3t-value", "data_dir_is_root": True, "commit": "ok"},
        "another_container_reads": "step 1\nstep 2\n",
        "read_file": "step 1\nstep 2\n",
        "listdir": ["run", "run/log.txt"],
        "missing": "FileNotFoundError",
    }


def test_a_lasting_volume_carries_what_the_first_plane_committed_to_the_next_ones(tmp_path, probe):
    """V9: a named Volume outlives a run, as a workspace's does on Modal (the suite's planes share the
    compiled token pass this way: conftest.py's `kernel_volume`). The first plane to stop with files
    publishes them, whole; a later plane's commits stay its own (runs' numbered files never mix)."""
    kept = {"cp-vol": tmp_path / "kept"}
    client = "import json\nfrom cp_probe.app import app, reads, writes\nwith app.run():\n    print(json.dumps({}))"
    with ControlPlane(tmp_path / "one", secrets=SECRETS, mount_env=MOUNT_ENV, lasting_volumes=kept) as p:
        both = "[writes.remote('a/x.txt', 'one')['commit'], writes.remote('top.txt', 'top')['commit']]"
        assert run_client(p, client.format(both), cwd=probe) == ["ok", "ok"]
    assert (kept["cp-vol"] / "a" / "x.txt").read_text() == "one" and (kept["cp-vol"] / "top.txt").read_text() == "top"
    with ControlPlane(tmp_path / "two", secrets=SECRETS, mount_env=MOUNT_ENV, lasting_volumes=kept) as p:
        assert run_client(p, client.format("reads.remote('a/x.txt')"), cwd=probe) == "one"
        assert run_client(p, client.format("writes.remote('a/x.txt', 'two')"), cwd=probe)["commit"] == "ok"
    assert (kept["cp-vol"] / "a" / "x.txt").read_text() == "one"
    assert sorted(q.name for q in tmp_path.iterdir()) == ["kept", "one", "probe", "two"]  # no copy left half-way
    assert sorted(q.name for q in kept["cp-vol"].iterdir()) == ["a", "top.txt"]


def test_a_commit_with_a_file_open_on_the_volume_fails_as_modal_says(plane, probe):
    # modal's commit reloads, and a reload "will fail if there are open files" (volume.py:899-930)
    got = run_client(
        plane,
        """
        import json, modal
        from cp_probe.app import app, writes
        with app.run():
            out = writes.remote("held.txt", "x", True)
        out["committed"] = b"".join(modal.Volume.from_name("cp-vol").read_file("held.txt")).decode()
        print(json.dumps(out))
        """,
        cwd=probe,
    )
    assert got["commit"].startswith("there are open files preventing the operation")
    assert got["committed"] == "x"  # the commit itself went through; its reload failed


def test_a_secret_must_exist_and_its_variables_reach_only_the_containers_naming_it(plane, probe):
    got = run_client(
        plane,
        """
        import json, modal
        out = {}
        try:
            modal.Secret.from_name("no-such-secret").hydrate()
        except modal.exception.NotFoundError:
            out["missing"] = "NotFoundError"
        from cp_probe.app import app, where
        with app.run():
            out["unnamed"] = where.remote()
        print(json.dumps(out))
        """,
        cwd=probe,
    )
    assert got["missing"] == "NotFoundError"
    assert "CP_TOKEN" not in got["unnamed"]["env"]


def test_an_images_env_reaches_its_containers_and_a_secret_overrides_it(plane, probe):
    """`Image.env` layers (quoted values, one layer over another) set their containers' variables; a
    Secret's variable of the same name wins, as variables set when a container starts do."""
    got = run_client(
        plane,
        """
        import json
        from cp_probe.app import app, env_of
        with app.run():
            print(json.dumps(env_of.remote()))
        """,
        cwd=probe,
    )
    assert got == {"CP_SPACED": "a b=c", "CP_TOKEN": "s3cr3t-value", "CP_LATER": "1"}


# ---- one command: python -m cellfeed_testing.modal_control_plane run -- CMD ARGS...


def run_command(args: list[str], cwd: Path, tmp_path: Path, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["CP_TOKEN"] = "from-the-laptop"
    return subprocess.run(
        [sys.executable, "-m", "cellfeed_testing.modal_control_plane", "run", "--root", str(tmp_path / "root"), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        **kw,
    )


@pytest.mark.parametrize("transport", [[], ["--unix"]])
def test_run_serves_modal_run_and_exits_with_its_status(probe, tmp_path, transport):
    flags = [*transport, "--secret", "cp-secret=CP_TOKEN", "--mount-env", "/data=DATA_DIR"]
    proc = run_command(
        [*flags, "--", sys.executable, "-m", "modal", "run", "cp_probe/app.py", "--a", "5", "--b", "6"], probe, tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "RESULT 11" in proc.stdout.splitlines()
    failing = run_command([*flags, "--", sys.executable, "-c", "import sys; sys.exit(3)"], probe, tmp_path)
    assert failing.returncode == 3, failing.stderr[-4000:]


@pytest.mark.parametrize(
    "flag, spec, why",
    [
        ("--lasting-volume", "cellfeed-kernels", "expected NAME=FOLDER"),
        ("--mount-env", "data=DATA_DIR", "expected /MOUNT/PATH=VARIABLE"),
        ("--secret", "cp=CP_NOT_SET_ANYWHERE", "not in this environment: CP_NOT_SET_ANYWHERE"),
    ],
)
def test_run_refuses_a_malformed_option_in_one_line_before_starting_a_plane(flag, spec, why, tmp_path):
    from cellfeed_testing.modal_control_plane.__main__ import main

    with pytest.raises(SystemExit) as refused:
        main(["run", "--root", str(tmp_path / "root"), flag, spec, "--", "true"])
    assert str(refused.value) == f"{flag} {spec}: {why}"
    assert not (tmp_path / "root").exists()  # nothing was started


def test_run_stops_the_containers_its_command_left_running(probe, tmp_path):
    # the command leaves without disconnecting its app (os._exit): its container runs on until the plane stops
    pid_file = tmp_path / "pids"
    script = textwrap.dedent(
        f"""
        import os, time
        from cp_probe.app import app, blocks
        with app.run():
            blocks.spawn({str(pid_file)!r})
            deadline = time.monotonic() + 120
            while not os.path.exists({str(pid_file)!r}) and time.monotonic() < deadline:
                time.sleep(0.05)
            print("PIDS", open({str(pid_file)!r}).read(), flush=True)
            os._exit(0)
        """
    )
    proc = run_command(["--secret", "cp-secret=CP_TOKEN", "--", sys.executable, "-c", script], probe, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("PIDS ")]
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == 3 and not [p for p in pids if alive(p)]


def test_with_options_variants_keep_what_they_do_not_set_and_more_than_8_gpus_is_refused(plane, probe):
    got = run_client(
        plane,
        """
        import json, modal
        from cp_probe.app import app, adds
        out = {}
        with app.run():
            out["variant"] = adds.with_options(gpu="H100:2", timeout=30).remote(1, 2)
            try:
                adds.with_options(gpu="H100:9").spawn(1, 2)
            except modal.exception.InvalidError as e:
                out["nine"] = str(e)
        print(json.dumps(out))
        """,
        cwd=probe,
    )
    assert got == {"variant": 3, "nine": "H100:9: a container has at most 8 GPUs"}
    base, variant = [f.definition for f in plane.servicer.functions.values() if f.definition.function_name == "adds"][
        :2
    ]
    assert (variant.resources.gpu_config.count, variant.timeout_secs) == (2, 30)
    assert variant.retry_policy.retries == base.retry_policy.retries == 2  # kept from the base (S25)


def test_a_preemption_signals_each_process_of_a_container_once(monkeypatch):
    """C17: one SIGINT per process. The plane signals the container's group and then each listed process
    outside it; signalled twice, a process could take the second SIGINT inside its handler of the first
    (a trainer's preemption handler, cut off before it committed its checkpoint)."""
    from collections import Counter

    from cellfeed_testing.modal_control_plane import containers

    script = (
        "import subprocess, sys, time\n"
        "same = subprocess.Popen(['sleep', '60'])\n"
        "own = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "print(same.pid, own.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        same, own = map(int, leader.stdout.readline().split())
        pids = containers._tree(leader.pid)
        assert sorted(pids) == sorted([leader.pid, same, own]) and os.getpgid(own) != leader.pid
        delivered = Counter()
        monkeypatch.setattr(
            containers.os, "killpg", lambda g, sig: delivered.update(p for p in pids if os.getpgid(p) == g)
        )
        monkeypatch.setattr(containers.os, "kill", lambda p, sig: delivered.update([p]))
        containers._signal_tree(pids, leader.pid, 0)
        assert delivered == Counter(pids)  # each once: the leader and its child by the group, the other by pid
    finally:
        monkeypatch.undo()
        for pid in containers._tree(leader.pid):
            os.kill(pid, 9)
        leader.wait(timeout=10)


def test_a_container_stopped_again_in_its_grace_is_interrupted_once(tmp_path):
    """A second stop while a container is in its grace (preempted, then its app stopped) sends no second
    SIGINT into the handler of the first; it SIGKILLs at its own, earlier, deadline."""
    import asyncio

    from cellfeed_testing.modal_control_plane.containers import Container, Containers

    notes = tmp_path / "sigints"
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, lambda *_: open(sys.argv[1], 'a').write('SIGINT\\n'))\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    time.sleep(0.01)\n"
    )

    async def stopped_twice() -> int:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, str(notes), stdout=asyncio.subprocess.PIPE, start_new_session=True
        )
        assert (await proc.stdout.readline()).strip() == b"ready"
        c, containers = Container("ta-1", None, 0, tmp_path, proc=proc), Containers(tmp_path, str, None, None)
        first = asyncio.create_task(containers.kill(c, "preempted", grace_s=30))
        for _ in range(500):  # the first SIGINT handled (an event, not a time)
            if notes.exists() and notes.read_text() == "SIGINT\n":
                break
            await asyncio.sleep(0.01)
        await containers.kill(c, "its app stopped", grace_s=0.5)
        await asyncio.wait_for(first, 10)
        return proc.returncode

    assert asyncio.run(stopped_twice()) == -9
    assert notes.read_text() == "SIGINT\n"


def test_a_commit_carries_a_file_replaced_by_one_of_the_same_size_and_mtime(tmp_path):
    """V3: a pointer file replaced (`os.replace`) by one of the same size within one tick of the clock that
    stamps mtimes looks unchanged by size and mtime; its new inode says it changed, and the commit carries it."""
    from cellfeed_testing.modal_control_plane.volumes import Volume, VolumeRPCs

    class Rpcs(VolumeRPCs):
        def __init__(self, v: Volume):
            self.volumes = {v.volume_id: v}

    committed, view = tmp_path / "committed", tmp_path / "view"
    committed.mkdir()
    view.mkdir()
    (view / "latest").write_text("step-00000028")
    rpcs, entry = Rpcs(Volume("vo-1", None, committed, 2, 0.0)), [view, {}, False]
    rpcs.commit_view("vo-1", entry)
    assert (committed / "latest").read_text() == "step-00000028"
    was = (view / "latest").stat()
    (view / ".latest.tmp").write_text("step-00000029")
    os.utime(view / ".latest.tmp", ns=(was.st_atime_ns, was.st_mtime_ns))  # (the same tick)
    os.replace(view / ".latest.tmp", view / "latest")
    rpcs.commit_view("vo-1", entry)
    assert (committed / "latest").read_text() == "step-00000029"


def test_a_preempted_input_is_interrupted_and_runs_again_not_counted_as_a_retry(plane, probe, tmp_path):
    notes = tmp_path / "notes"
    client = start_client(
        plane,
        f"""
        import json
        from cp_probe.app import app, counts_attempts
        with app.run():
            print(json.dumps(counts_attempts.spawn({str(notes)!r}).get(timeout=120)))
        """,
        cwd=probe,
    )
    wait_for(lambda: notes.exists() and notes.read_text() == "start\n", "the first attempt to start")
    (call,) = plane.calls("counts_attempts")
    (first,) = plane.preempt(call.call_id, grace_s=10)
    assert finish(client) == 2  # a retries=0 function ran twice: a preemption is not a retry
    assert notes.read_text() == "start\ninterrupted\nstart\n"
    assert [(c.task_id == first, c.retry_count) for c in call.containers] == [(True, 0), (False, 0)]


# ---- cellfeed's Modal backend on the plane (issue 41: what the emulator's tests held), modal's client in
# this process: the plane's environment is set here and modal's cached client (`Client.from_env`'s, made on
# first use from the environment) is closed before and after, so no test reaches another test's plane.


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A plane counting its Queue requests (queue_stats.py), and modal's client in this process on it."""
    import modal

    from cellfeed_testing.modal_control_plane.queue_stats import count_queue_requests

    with ControlPlane(tmp_path / "here") as p:
        count_queue_requests(p)
        for name in [k for k in os.environ if k.startswith("MODAL_")]:
            monkeypatch.delenv(name)
        for name, value in p.env.items():
            monkeypatch.setenv(name, value)
        modal.Client.from_env().close()
        try:
            yield p
        finally:
            modal.Client.from_env().close()


def rank_stats(plane: ControlPlane) -> dict:
    from cellfeed_testing.modal_control_plane.queue_stats import queue_stats

    return queue_stats(plane).get("rank-*", {})


@pytest.fixture
def producer_on(here, small_synth):
    """A real producer whose queue and map are the run's modal.Queue and modal.Dict on the plane."""
    from coordination.modal_backend import run_backends
    from producers.config import ProducerConfig
    from producers.producer import Producer

    made = []

    def make(run: str, **config):
        queue, store = run_backends(run, retry_s=30)
        config = ProducerConfig(dataset=small_synth.uri, run=run, world_size=2, max_genes=32, **config)
        made.append(Producer(config, queue, store, dataset=small_synth))
        return made[-1], queue

    yield make
    for producer in made:
        producer.close()


def test_a_deleted_objects_old_handle_stays_gone_when_its_name_is_made_again(here):  # emulator S1-S3
    import modal

    d = modal.Dict.from_name("sem-handles", create_if_missing=True)
    d.put("k", 1)
    first_id = d.object_id
    modal.Dict.objects.delete("sem-handles")
    again = modal.Dict.from_name("sem-handles", create_if_missing=True)
    assert again.get("k") is None and again.object_id != first_id  # a new object under the old name
    with pytest.raises(modal.exception.NotFoundError):  # the old handle still points at the deleted one
        d.put("k", 2)
    assert again.len() == 0
    with pytest.raises(modal.exception.NotFoundError):
        modal.Queue.from_name("sem-never-made").len()


def test_a_full_partition_refuses_a_put_and_counts_the_refusal(here):  # emulator S5, S7 (README C4)
    import queue as stdlib_queue

    import modal

    q = modal.Queue.from_name("sem-full", create_if_missing=True)
    for _ in range(5):
        q.put_many([b"x"] * 1000, partition="rank-0")
    with pytest.raises(stdlib_queue.Full):
        q.put(b"y", block=False, partition="rank-0")
    assert rank_stats(here)["put_full"] == 1  # one request, refused: RESOURCE_EXHAUSTED
    q.get_many(2, partition="rank-0")
    q.put(b"y", block=False, partition="rank-0")  # room again
    assert q.len(partition="rank-0") == 5000 - 2 + 1
    assert rank_stats(here)["put_ok_items"] == 5001


def test_partitions_and_dict_entries_expire_on_the_planes_clock(here):  # emulator S8, S12 (README C7, C10)
    import modal

    def advance(seconds: float) -> None:
        async def move() -> None:
            here.servicer.store.clock.advance(seconds)

        here.call(move())

    q = modal.Queue.from_name("sem-ttl", create_if_missing=True)
    d = modal.Dict.from_name("sem-ttl", create_if_missing=True)
    q.put(b"a", partition="old")
    d.put("idle", 1)
    d.put("used", 1)
    advance(23 * 3600)
    q.put(b"b", partition="fresh")
    assert q.len(partition="old") == 1 and d.get("used") == 1  # a read is a use
    advance(2 * 3600)
    assert q.len(partition="old") == 0 and q.len(partition="fresh") == 1  # 24 h after its last put
    advance(6 * 24 * 3600 - 3600)
    assert d.get("idle") is None and d.get("used") == 1  # 7 days without a read or write


def test_a_producer_waits_on_a_full_partition_instead_of_sending_again(here, producer_on):
    """On Modal a put with a timeout under ~2 s is refused at once on a full partition: the producer
    used to re-send its batch (up to 2 MiB each time) in a tight loop. It now looks at the length."""
    import threading

    producer, queue = producer_on("spin", put_timeout_s=120)
    queue.put_many([b"x" * 8] * 5000, partition="rank-0")  # full
    before = rank_stats(here)
    batch = [b"item-%d" % i for i in range(4)]
    sender = threading.Thread(target=producer.courier.send, args=(batch, "rank-0"))
    sender.start()

    def since(what: str) -> int:
        return rank_stats(here).get(what, 0) - before.get(what, 0)

    wait_for(lambda: since("len_requests") >= 3, "the producer to look at the partition's length")
    assert since("put_full") == 1  # one refusal, then it waits for room
    queue.get_many(10, partition="rank-0")  # the trainer takes some
    sender.join(timeout=60)
    assert not sender.is_alive()
    assert since("put_full") == 1 and queue.len(partition="rank-0") == 5000 - 10 + 4
    assert queue.get_many(5000, block=False, partition="rank-0")[-4:] == batch


def test_a_request_over_the_size_limit_is_split_not_taken_for_a_full_partition(here, producer_on):
    """A request over Modal's size limit (the plane's 4 MiB, README C4) used to surface as a Modal
    TimeoutError, read as a full partition: the producer spun until "stayed full...". modal's client
    raises RequestSizeError for it; the backend says RequestTooLarge and the courier splits."""
    import modal

    from cellfeed_testing.modal_control_plane.store import MAX_REQUEST_BYTES as PLANE_LIMIT
    from coordination.queues import MAX_ITEM_BYTES, MAX_REQUEST_BYTES, RequestTooLarge

    producer, queue = producer_on("split", put_timeout_s=30)
    assert MAX_REQUEST_BYTES < PLANE_LIMIT  # batches are capped under the limit assumed for Modal
    items = [bytes([i]) * MAX_ITEM_BYTES for i in range(6)]  # one item of the largest size passes
    with pytest.raises(modal.exception.RequestSizeError):
        modal.Queue.from_name("cellfeed-split", create_if_missing=True).put_many(items, block=False, partition="rank-1")
    with pytest.raises(RequestTooLarge):
        queue.put_many(items, block=True, timeout=1.0, partition="rank-1")
    assert rank_stats(here)["put_too_large"] >= 2
    producer.courier.send(items, "rank-1")
    assert sorted(queue.get_many(10, block=False, partition="rank-1")) == items
    assert rank_stats(here).get("put_full", 0) == 0  # never taken for "full"


def test_a_named_map_handle_reaches_the_map_a_resumed_epoch_made_again(here):
    """Modal binds a handle to one Dict: a producer's handle to an epoch map that a resumed driver
    dropped and made again used to meet the deleted Dict (MapGone: a boundary piece lost)."""
    from coordination.modal_backend import ModalMap
    from coordination.queues import MapGone

    store = ModalMap("cellfeed-handles", retry_s=30)
    store.named("e0", create=True)
    producers_handle = store.named("e0")
    producers_handle.put("piece", b"1")  # bound to the first Dict
    store.drop("e0")
    store.named("e0", create=True)  # the resumed epoch's map
    assert producers_handle.put("piece", b"2", skip_if_exists=True) is True
    assert store.named("e0").get("piece") == b"2"
    store.drop("e0")  # the epoch is over for good
    with pytest.raises(MapGone):
        producers_handle.get("piece")
    with pytest.raises(MapGone):  # keys() is lazy on Modal: its error used to escape the translation
        producers_handle.keys()
    assert here.describe()["dicts"] == []  # both of the epoch's maps were deleted


def test_a_held_out_set_larger_than_a_partition_is_refused_before_the_plane_would(here):
    """The held-out set is read whole from one partition: a set over the partition's limits is refused
    up front (producers/held_out.py), with the limits the plane enforces (README C4)."""
    import queue as stdlib_queue

    import modal

    from cellfeed_testing.modal_control_plane import store as plane_store
    from coordination.errors import CellfeedError
    from coordination.queues import MAX_PARTITION_BYTES, MAX_PARTITION_ITEMS
    from producers.held_out import check_fits_partition

    limits = (plane_store.MAX_PARTITION_ITEMS, plane_store.MAX_PARTITION_BYTES)
    assert (MAX_PARTITION_ITEMS, MAX_PARTITION_BYTES) == limits
    check_fits_partition(1000, 5000, MAX_PARTITION_BYTES)
    with pytest.raises(CellfeedError, match="does not fit one queue partition.*lower --eval-cells"):
        check_fits_partition(700_000, 5_001, 10)
    with pytest.raises(CellfeedError, match="does not fit one queue partition"):
        check_fits_partition(100, 100, MAX_PARTITION_BYTES + 1)
    q = modal.Queue.from_name("held-out", create_if_missing=True)  # what the plane does with one more item
    q.put_many([b"c"] * MAX_PARTITION_ITEMS, partition="eval")
    with pytest.raises(stdlib_queue.Full):
        q.put(b"c", block=False, partition="eval")


# ---- calls: a running call, cancel, timeout (emulator S13, S14, S16: README C12-C14), and
# app/modal_calls.call_state reading them through modal's client

CALLS_APP = '''
import os, time
import modal

app = modal.App("cellfeed-control-plane-calls")
image = modal.Image.debian_slim(python_version="3.11").add_local_python_source("cp_probe")


@app.function(image=image, timeout=600)
def sleeps(path: str) -> None:
    """Notes that it started, then sleeps until it is cancelled."""
    open(path, "w").close()
    time.sleep(600)


@app.function(image=image, timeout=2)
def overruns() -> None:
    time.sleep(600)


@app.function(image=image, retries=0, timeout=600)
def adds(a: int, b: int) -> int:
    if a < 0:
        raise ValueError("no negatives")
    return a + b
'''


@pytest.fixture
def calls_probe(probe) -> Path:
    (probe / "cp_probe" / "calls.py").write_text(CALLS_APP)
    return probe


def test_a_running_call_is_running_and_a_cancelled_or_timed_out_one_raises(plane, calls_probe, tmp_path):
    """`FunctionCall.get(timeout=0)` on a running call raises the builtin TimeoutError: the fleet check
    (app/modal_calls.call_state) used to catch modal's TimeoutError, judge a running fleet dead and spawn
    a second. A cancelled call raises RemoteError (TERMINATED); one past its timeout raises
    FunctionTimeoutError, a modal.exception.TimeoutError that is not the builtin one."""
    started = tmp_path / "started"
    got = run_client(
        plane,
        f"""
        import builtins, json, os, time
        import modal
        from app.modal_calls import call_state
        from cp_probe.calls import app, sleeps, overruns, adds
        out = {{}}
        with app.run():
            running = sleeps.spawn({str(started)!r})
            deadline = time.monotonic() + 60
            while not os.path.exists({str(started)!r}) and time.monotonic() < deadline:
                time.sleep(0.05)
            try:
                running.get(timeout=0)
            except builtins.TimeoutError as e:
                out["running_get"] = [type(e).__module__, type(e).__name__]
            out["running"] = call_state(running, retry=30)[0]
            done = adds.spawn(1, 2)
            out["done"] = [done.get(timeout=60), call_state(done, retry=30)[0]]
            failed = adds.spawn(-1, 2)
            try:
                failed.get(timeout=60)
            except ValueError:
                pass
            state, error = call_state(failed, retry=30)
            out["failed"] = [state, type(error).__name__, str(error)]
            running.cancel(terminate_containers=True)  # (without: at its next heartbeat, 15 s)
            try:
                running.get(timeout=60)
            except Exception as e:
                out["cancelled"] = type(e).__name__
            out["cancelled_state"] = call_state(running, retry=30)[0]
            try:
                overruns.remote()
            except modal.exception.FunctionTimeoutError as e:
                out["timeout"] = [type(e).__name__, isinstance(e, builtins.TimeoutError)]
        print(json.dumps(out))
        """,
        cwd=calls_probe,
    )
    assert got["running_get"] == ["builtins", "TimeoutError"] and got["running"] == "running"
    assert got["done"] == [3, "ended"]
    assert got["failed"] == ["failed", "ValueError", "no negatives"]
    assert (got["cancelled"], got["cancelled_state"]) == ("RemoteError", "failed")
    assert got["timeout"] == ["FunctionTimeoutError", False]
    statuses = {c["function"]: c["status"] for c in plane.call_list() if c["function"] in ("sleeps", "overruns")}
    assert statuses == {"sleeps": "cancelled", "overruns": "timeout"}


def test_a_volume_removes_a_file_and_a_folder_only_when_told_recursive(here):  # emulator S23 (README V6)
    """What deploy/first_run's clean-up does to the checkpoints Volume, from the laptop."""
    import modal

    volume = modal.Volume.from_name("cellfeed-checkpoints", create_if_missing=True)
    committed = here.volume_dir
    (committed / "r" / "sub").mkdir(parents=True)
    (committed / "r" / "sub" / "step-1.pt").write_bytes(b"x")
    (committed / "r" / "state.json").write_text("{}")
    with pytest.raises(modal.exception.InvalidError):
        volume.remove_file("/r")  # a folder with files in it needs recursive=True
    volume.remove_file("/r/sub/step-1.pt")
    assert sorted(e.path for e in volume.listdir("/", recursive=True)) == ["r", "r/state.json", "r/sub"]
    volume.remove_file("r", recursive=True)
    assert not (committed / "r").exists() and committed.exists()
    with pytest.raises(FileNotFoundError):
        volume.remove_file("/r", recursive=True)


# ---- S20: a container imports only what its image installs (image_guard.py)

IMAGES_APP = '''
import importlib, subprocess, sys
import modal

app = modal.App("cellfeed-control-plane-images")
bare = modal.Image.debian_slim(python_version="3.11").add_local_python_source("cp_probe")
with_numpy = (
    modal.Image.debian_slim(python_version="3.11").pip_install("numpy>=1.26").add_local_python_source("cp_probe")
)


def _import(names):
    """Imports each module here and in a fresh Python this body starts (a container's every process
    runs under its image); their names, or the error."""
    out = [importlib.import_module(n).__name__ for n in names]
    for n in names:
        subprocess.run([sys.executable, "-c", f"import {n}"], check=True, capture_output=True)
    return out


@app.function(image=bare, timeout=600)
def imports_bare(names: list) -> list:
    return _import(names)


@app.function(image=with_numpy, timeout=600)
def imports_numpy(names: list) -> list:
    return _import(names)


@app.function(image=bare, timeout=600)
def child_imports(names: list) -> list:
    """The exit status of a fresh Python importing each (the body itself imports none of them)."""
    return [subprocess.run([sys.executable, "-c", f"import {n}"], capture_output=True).returncode for n in names]
'''


def test_a_container_imports_only_what_its_image_installs(plane, probe):
    """`bare` adds only `cp_probe`: numpy (installed on this machine) is not there, in the body or in a
    Python the body starts; an image that pip-installs numpy has it; the repository's packages are in
    neither (emulator S20: every plane enforces it, D11)."""
    (probe / "cp_probe" / "images.py").write_text(IMAGES_APP)
    got = run_client(
        plane,
        """
        import json
        from cp_probe.images import app, child_imports, imports_bare, imports_numpy
        out = {}
        def attempt(f, names):
            try:
                return f.remote(names)
            except Exception as e:
                return [type(e).__name__, str(e)]
        with app.run():
            out["bare_ok"] = attempt(imports_bare, ["json", "modal", "grpclib", "cp_probe.app"])
            out["bare_numpy"] = attempt(imports_bare, ["numpy"])
            out["numpy_ok"] = attempt(imports_numpy, ["numpy"])
            out["repo"] = [attempt(f, ["producers"]) for f in (imports_bare, imports_numpy)]
            out["child"] = attempt(child_imports, ["json", "numpy", "cp_probe.app"])
        print(json.dumps(out))
        """,
        cwd=probe,
    )
    assert got["bare_ok"] == ["json", "modal", "grpclib", "cp_probe.app"]
    assert got["bare_numpy"] == ["ModuleNotFoundError", "No module named 'numpy'"]
    assert got["numpy_ok"] == ["numpy"]
    assert got["repo"] == [["ModuleNotFoundError", "No module named 'producers'"]] * 2
    assert got["child"] == [0, 1, 0]  # a Python the body starts runs under the image too
    refusals = "".join(
        (plane.servicer.containers.folder_for(c["attempts"][0]["task"]) / "image_refusals.txt").read_text()
        for c in plane.call_list("imports_bare")
        if (plane.servicer.containers.folder_for(c["attempts"][0]["task"]) / "image_refusals.txt").exists()
    )
    assert "numpy: not in the image" in refusals and "producers: not in the image" in refusals


def test_an_image_allows_its_packages_dependencies_and_modal():  # emulator S20's rule
    from cellfeed_testing.modal_control_plane.image_guard import SITE, allowed_modules

    spec = importlib_site(SITE)
    allow = allowed_modules(("torch==2.13.0",))["allow"]
    guard = spec.ImageGuard(allow, ["trainer"], "t")
    allowed = ("torch", "sympy", "networkx", "filelock", "modal", "grpclib", "google.protobuf", "trainer.x", "json")
    for ok in allowed:
        assert guard.permits(ok), ok
    for refused in ("lance", "pyarrow", "polars", "zstandard", "producers", "cellfeed_testing.object_store"):
        assert not guard.permits(refused), refused
    assert allowed_modules(("numpy==0.0.1",))["other_versions"]


def importlib_site(path: Path):
    """image_site.py as a module of its own (not as a sitecustomize: it installs nothing)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cellfeed_image_site", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gets_cancelled_at_any_point_leave_their_queue_answering():
    """Blocked gets whose handlers are cancelled (grpclib cancels one when its client's connection is
    lost: a container killed mid-get) at any point of their wait, timeouts expiring around them and a
    put waking them all, leave the queue's later puts and gets answering at once. With an
    `asyncio.Condition` under them (Python 3.11) this hung: a wait cancelled twice kept the lock for
    good, and a queue of the two-node campaign stopped answering for 7 minutes (store.Changed). The
    scenario runs on a thread of its own: a loop that hangs cannot time itself out."""
    import asyncio
    import random
    import threading

    from modal_proto import api_pb2

    from cellfeed_testing.modal_control_plane.store import Store

    async def scenario(rng: random.Random) -> list[bytes]:
        store = Store()
        oid = store.get_or_create("queue", "q", "main", api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING)
        for _ in range(5):
            timeouts = [rng.choice([0.0005, 0.001, 0.002, 5.0]) for _ in range(12)]
            gets = [asyncio.ensure_future(store.queue_get(oid, b"p%d" % i, 1, t)) for i, t in enumerate(timeouts)]
            await asyncio.sleep(rng.choice([0, 0.0005, 0.001]))
            await store.queue_put(oid, b"other", [b"y"], 0)  # wakes every get (none is for it)
            for _ in range(rng.randrange(6)):
                await asyncio.sleep(0)
            await asyncio.sleep(rng.choice([0, 0.0005, 0.001, 0.002]))
            for g in gets:  # most cancelled now, on whatever turn of their wait they are
                if rng.random() < 0.7:
                    g.cancel()
            for _ in range(rng.randrange(4)):
                await asyncio.sleep(0)
            for g in gets:
                g.cancel()
            for g in gets:
                with contextlib.suppress(asyncio.CancelledError):
                    await g
        await store.queue_put(oid, b"", [b"x"], 0)
        return await store.queue_get(oid, b"", 1, 5)

    got = []
    worker = threading.Thread(target=lambda: got.append(asyncio.run(scenario(random.Random(0)))), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the queue stopped answering after its gets were cancelled"
    assert got == [[b"x"]]
