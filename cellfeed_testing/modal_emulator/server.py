"""The emulator's control plane: named Queues and Dicts by object id, function calls run as real
processes (retries, timeouts, preemption), one clock. One process; clients speak the local
backend's framing (`coordination.local_backend`: JSON header + raw values, no pickle).

The semantic points and the modal 1.6.4 file each comes from are listed in README.md beside this
file; the comments here name the point (S1, S2, ...) they implement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import signal
import socketserver
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from cellfeed_testing.modal_emulator.faults import Faults, target_of
from cellfeed_testing.modal_emulator.images import container_spec
from cellfeed_testing.modal_emulator.limits import (
    CLIENT_RETRIES,
    DICT_ENTRY_TTL_S,
    ERROR,
    FULL,
    INVALID,
    MAX_GPUS,
    MAX_ITEM_BYTES,
    MAX_PARTITION_BYTES,
    MAX_PARTITION_ITEMS,
    MAX_REQUEST_BYTES,
    NOT_FOUND,
    OK,
    PARTITION_TTL_S,
    TOO_LARGE,
    TRANSIENT,
)
from coordination.local_backend import serve_frames


class Clock:
    """Emulated time: real seconds times `speed`, plus whatever a test `advance`s."""

    def __init__(self, speed: float = 1.0):
        self.speed, self._t0, self._offset = speed, time.monotonic(), 0.0
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return (time.monotonic() - self._t0) * self.speed + self._offset

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._offset += seconds


class Rejected(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Partition:
    items: deque = field(default_factory=deque)
    bytes: int = 0
    last_put: float = 0.0


@dataclass
class QueueObject:
    partitions: dict = field(default_factory=dict)
    deleted: bool = False


@dataclass
class DictObject:
    entries: dict = field(default_factory=dict)  # key -> (value, last used)
    deleted: bool = False


@dataclass
class Call:
    """One function call (an input) and its attempts."""

    id: str
    app_file: str
    function: str
    args: list
    timeout_s: float
    retries: int
    gpu: str | None
    cpu: float | None = None
    memory: int | None = None
    image: dict | None = None  # S20: the container's import spec (images.container_spec)
    cluster_size: int = 0  # S27: a clustered function's containers per attempt (0: one, unclustered)
    status: str = "pending"  # pending, running, success, failure, cancelled, timeout
    attempts: list = field(default_factory=list)  # one dict per attempt: started, ended, outcome, pid
    result: object = None
    error: dict | None = None
    proc: subprocess.Popen | None = None
    preempt_requested: bool = False
    cancel_requested: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Emulated:
    """All state; every method runs under one lock but the long waits."""

    def __init__(
        self, root: Path, clock: Clock, grace_s: float, retry_delay_s: float, env: dict, secret_names: tuple = ()
    ):
        self.root, self.clock, self.grace_s, self.retry_delay_s = root, clock, grace_s, retry_delay_s
        self.env = env  # environment of every function container
        self.secret_names = set(secret_names)  # S22: the Secrets that exist (their variables are in `env`)
        self.lock = threading.Condition()
        self.names: dict[tuple[str, str], str] = {}  # (kind, name) -> object id
        self.queues: dict[str, QueueObject] = {}
        self.dicts: dict[str, DictObject] = {}
        self.calls: dict[str, Call] = {}
        self.faults: dict[str, int] = {}  # function -> attempts left to fail (S16: fault injection)
        self.stats: dict = {}  # per kind of partition ("rank-*" counted together): requests and bytes
        self.images: dict[str, dict] = {}  # an image's JSON -> its containers' import spec (S20)
        self.network = Faults(clock)  # S21: injected transport faults
        self._ids = itertools.count(1)

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids):06d}{secrets.token_hex(4)}"

    def secret(self, name: str) -> str:
        """S22: a Secret's id, or NOT_FOUND (modal's client raises `NotFoundError`)."""
        if name not in self.secret_names:
            raise Rejected(NOT_FOUND, f"Secret '{name}' not found")
        return "st-" + name

    # ---- names (S1, S2, S3)

    def lookup(self, kind: str, name: str, create: bool) -> str:
        with self.lock:
            oid = self.names.get((kind, name))
            if oid is None:
                if not create:
                    raise Rejected(NOT_FOUND, f"{kind.capitalize()} '{name}' not found")
                oid = self._new_id("qu" if kind == "queue" else "di")
                (self.queues if kind == "queue" else self.dicts)[oid] = (
                    QueueObject() if kind == "queue" else DictObject()
                )
                self.names[(kind, name)] = oid
            return oid

    def delete(self, kind: str, name: str, allow_missing: bool) -> None:
        with self.lock:
            oid = self.names.pop((kind, name), None)
            if oid is None:
                if allow_missing:
                    return
                raise Rejected(NOT_FOUND, f"{kind.capitalize()} '{name}' not found")
            (self.queues if kind == "queue" else self.dicts)[oid].deleted = True
            self.lock.notify_all()

    def _queue(self, oid: str) -> QueueObject:
        q = self.queues.get(oid)
        if q is None or q.deleted:
            raise Rejected(NOT_FOUND, f"Queue {oid} not found (deleted)")
        return q

    def _dict(self, oid: str) -> DictObject:
        d = self.dicts.get(oid)
        if d is None or d.deleted:
            raise Rejected(NOT_FOUND, f"Dict {oid} not found (deleted)")
        return d

    # ---- queues (S4-S10)

    def _partition(self, q: QueueObject, key: str) -> Partition:
        p = q.partitions.get(key)
        if p is not None and p.items and self.clock.now() - p.last_put > PARTITION_TTL_S:  # S8
            p = None
        if p is None:
            p = q.partitions[key] = Partition()
        return p

    def _count(self, key: str, what: str, n: int = 1) -> None:
        kind = "rank-*" if key.startswith("rank-") else key or "(default)"
        counts = self.stats.setdefault(kind, {})
        counts[what] = counts.get(what, 0) + n

    def put(self, oid: str, key: str, values: list[bytes], sizes: list[int]) -> None:
        with self.lock:
            request = sum(sizes)
            self._count(key, "put_requests")
            self._count(key, "put_bytes", request)
            q = self._queue(oid)
            if request > MAX_REQUEST_BYTES:  # S9
                self._count(key, "put_too_large")
                raise Rejected(TOO_LARGE, f"request of {request:,} bytes: status = '413'")
            for s in sizes:
                if s > MAX_ITEM_BYTES:  # S6
                    raise Rejected(INVALID, f"Queue item of {s:,} bytes (serialized) exceeds the 1 MiB limit")
            p = self._partition(q, key)
            if len(p.items) + len(values) > MAX_PARTITION_ITEMS or p.bytes + sum(sizes) > MAX_PARTITION_BYTES:
                self._count(key, "put_full")
                raise Rejected(FULL, "Queue partition is full (RESOURCE_EXHAUSTED)")  # S5
            p.items.extend(zip(values, sizes))
            p.bytes += sum(sizes)
            p.last_put = self.clock.now()
            self._count(key, "put_ok_bytes", request)
            self._count(key, "put_ok_items", len(values))
            self.lock.notify_all()

    def get(self, oid: str, key: str, n: int, wait_s: float) -> list[bytes]:
        deadline = time.monotonic() + wait_s
        with self.lock:
            self._count(key, "get_requests")
            while True:
                p = self._partition(self._queue(oid), key)
                if p.items:
                    out = [p.items.popleft() for _ in range(min(n, len(p.items)))]
                    p.bytes -= sum(s for _, s in out)
                    return [v for v, _ in out]
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self.lock.wait(min(left, 0.5))

    def qlen(self, oid: str, key: str | None, total: bool) -> int:
        with self.lock:
            self._count(key or "", "len_requests")
            q = self._queue(oid)
            if total:
                return sum(len(self._partition(q, k).items) for k in list(q.partitions))
            return len(self._partition(q, key or "").items)

    def clear(self, oid: str, key: str | None, everything: bool) -> None:
        with self.lock:
            q = self._queue(oid)
            if everything:
                q.partitions.clear()
            else:
                q.partitions.pop(key or "", None)

    # ---- dicts (S11, S12)

    def _entry(self, d: DictObject, key: str):
        found = d.entries.get(key)
        if found is not None and self.clock.now() - found[1] > DICT_ENTRY_TTL_S:  # S12
            del d.entries[key]
            found = None
        return found

    def dict_op(self, oid: str, op: str, key: str | None, value: bytes | None, skip: bool = False):
        with self.lock:
            d = self._dict(oid)
            now = self.clock.now()
            if op == "put":
                if value is not None and len(value) > MAX_ITEM_BYTES:
                    raise Rejected(INVALID, f"Dict value of {len(value):,} bytes exceeds the 1 MiB limit")
                if skip and self._entry(d, key) is not None:
                    return False
                d.entries[key] = (value, now)
                return True
            if op == "keys":
                return [k for k in list(d.entries) if self._entry(d, k) is not None]
            found = self._entry(d, key)
            if op == "pop":
                if found is None:
                    raise Rejected(NOT_FOUND, f"KeyError: {key}")
                del d.entries[key]
                return found[0]
            if found is not None:
                d.entries[key] = (found[0], now)  # a read is a use
            if op == "contains":
                return found is not None
            return None if found is None else found[0]  # get

    # ---- functions (S13-S18)

    def spawn(self, header: dict) -> str:
        gpu = header.get("gpu")
        if gpu and ":" in gpu and int(gpu.split(":")[1]) > MAX_GPUS:  # S17
            raise Rejected(INVALID, f"GPU count for {gpu} must be at most {MAX_GPUS}")
        key = json.dumps(header.get("image"), sort_keys=True)
        if key not in self.images:  # S20: resolved once per image (outside the lock: it reads package metadata)
            self.images[key] = container_spec(header.get("image"))
        with self.lock:
            call = Call(
                self._new_id("fc"),
                header["app_file"],
                header["function"],
                header["args"],
                float(header["timeout"]),
                int(header["retries"]),
                gpu,
                header.get("cpu"),
                header.get("memory"),
                self.images[key],
                int(header.get("cluster_size") or 0),
            )
            self.calls[call.id] = call
        threading.Thread(target=self._supervise, args=(call,), daemon=True, name=f"emu-{call.id}").start()
        return call.id

    def _supervise(self, call: Call) -> None:
        """Run attempts until one succeeds, retries are spent, or the call is cancelled (S14-S16)."""
        failures = 0
        while True:
            outcome = self._attempt(call)
            with self.lock:
                if outcome == "success" or call.cancel_requested:
                    call.status = "success" if outcome == "success" else "cancelled"
                elif outcome == "preempted":  # S15: the same input runs again, not counted as a retry
                    continue
                else:
                    failures += 1
                    if failures <= call.retries:  # S14: `retries=N` waits a fixed 1 s before each new attempt
                        call.status = "pending"
                        self.lock.wait(self.retry_delay_s)
                        if not call.cancel_requested:
                            continue
                        call.status = "cancelled"
                    else:
                        call.status = outcome  # "failure" or "timeout"
                call.done.set()
                self.lock.notify_all()
                return

    def _attempt(self, call: Call) -> str:
        """One attempt: one container, or a clustered function's `cluster_size` containers started
        together (S27). Rank 0's report is the attempt's; any container's failure fails the attempt
        and takes the others with it; a preemption interrupts every container of the cluster."""
        size = max(1, call.cluster_size)
        index = len(call.attempts)
        base = self.root / "containers" / f"{call.id}-{index}"
        fail = False
        with self.lock:
            if call.cancel_requested:
                return "cancelled"
            if self.faults.get(call.function, 0) > 0:
                self.faults[call.function] -= 1
                fail = True
            procs = []
            for rank in range(size):
                tmp = base if rank == 0 else base.with_name(f"{base.name}.node{rank}")
                (tmp / "tmp").mkdir(parents=True, exist_ok=True)
                env = dict(
                    self.env,
                    TMPDIR=str(tmp / "tmp"),
                    MODAL_EMULATOR_CALL=call.id,
                    MODAL_EMULATOR_ATTEMPT=str(index),
                    MODAL_EMULATOR_IMAGE=json.dumps(call.image),
                )
                if call.cluster_size:  # S27: every container reaches the others at its own address (here, this host)
                    cluster = {"rank": rank, "cluster_id": f"cl-{call.id}-{index}", "ips": ["::1"] * size}
                    env["MODAL_EMULATOR_CLUSTER"] = json.dumps(cluster)
                if fail:
                    env["MODAL_EMULATOR_FAIL"] = "injected fault"
                log = open(tmp / "output.log", "wb")
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "cellfeed_testing.modal_emulator.worker"],
                        env=env,
                        cwd=str(tmp),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
                log.close()
            proc = procs[0]
            attempt = {
                "started": self.clock.now(),
                "pid": proc.pid,
                "pids": [p.pid for p in procs],
                "outcome": None,
                "log": str(base / "output.log"),
            }
            call.attempts.append(attempt)
            call.proc, call.status, call.error = proc, "running", None
            self.lock.notify_all()
        outcome = None
        while outcome is None:
            try:
                code = proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                code = None
            others = [p.poll() for p in procs[1:]]
            with self.lock:
                if call.preempt_requested:  # S15: an interrupt, a grace period, then the container is gone
                    call.preempt_requested = False
                    attempt["preempted_at"] = self.clock.now()
                    every = [q for p in procs for q in [p.pid, *_descendants(p.pid)]]  # each container's every process
                    for pid in every:
                        _signal(pid, signal.SIGINT)
                    attempt["interrupted_processes"] = len(every)
                    outcome = "preempted"
                elif call.cancel_requested:  # S13: SIGUSR1 (InputCancellation in the body), then the container goes
                    for p in procs:
                        _signal(p.pid, signal.SIGUSR1)
                    outcome = "cancelled"
                elif code is None and self.clock.now() - attempt["started"] > call.timeout_s:  # S13
                    call.error = {
                        "type": "modal.exception.FunctionTimeoutError",
                        "message": f"Function {call.function} timed out after {call.timeout_s:.0f}s",
                    }
                    outcome = "timeout"
                elif any(c not in (None, 0) for c in others):  # S27: a container of the cluster failed or was lost
                    lost = next(r for r, c in enumerate(others, 1) if c not in (None, 0))
                    attempt["lost_container"] = lost
                    if call.error is None:
                        call.error = {
                            "type": "modal.exception.RemoteError",
                            "message": f"{call.function}: container {lost} of its cluster exited "
                            f"with code {others[lost - 1]}",
                        }
                    outcome = "failure"
                elif code is not None:
                    outcome = "success" if (code == 0 and attempt.get("reported") == "ok") else "failure"
        if outcome in ("preempted", "cancelled"):
            for p in procs:
                try:
                    p.wait(timeout=self.grace_s if outcome == "preempted" else min(5.0, self.grace_s))
                except subprocess.TimeoutExpired:
                    pass
        elif outcome == "success":  # rank 0 returned: the cluster's other containers end with the input
            for p in procs[1:]:
                try:
                    p.wait(timeout=min(5.0, self.grace_s))
                except subprocess.TimeoutExpired:
                    pass
        for p in procs:
            kill_tree(p.pid)
            p.wait()
        with self.lock:
            attempt["outcome"], attempt["ended"] = outcome, self.clock.now()
            if outcome == "failure" and call.error is None:
                call.error = {
                    "type": "modal.exception.RemoteError",
                    "message": f"{call.function}: its container exited with code {proc.returncode}",
                }
            self.lock.notify_all()
        return outcome

    def lose_container(self, call_id: str, rank: int) -> None:
        """A container of a running attempt is lost (its machine gone): SIGKILL, no grace (S27)."""
        with self.lock:
            call = self.calls[call_id]
            if call.status != "running":
                raise Rejected(INVALID, f"call {call_id} is {call.status}, not running")
            pid = call.attempts[-1]["pids"][rank]
        kill_tree(pid)

    def report(self, call_id: str, attempt: int, ok: bool, result, error: dict | None, rank: int = 0) -> None:
        with self.lock:
            call = self.calls[call_id]
            if attempt != len(call.attempts) - 1:
                return  # a report from an attempt already given up on
            if rank:  # S27: only rank 0's output is the call's; another container's error is kept if none is yet
                if not ok and call.error is None:
                    call.error = error
                return
            call.attempts[attempt]["reported"] = "ok" if ok else "error"
            if ok:
                call.result = result
            else:
                call.error = error

    def poll(self, call_id: str, wait_s: float) -> dict:
        call = self.calls.get(call_id)
        if call is None:
            raise Rejected(NOT_FOUND, f"FunctionCall {call_id} not found")
        call.done.wait(wait_s)
        with self.lock:
            return {
                "status": call.status,
                "result": call.result if call.status == "success" else None,
                "error": call.error,
            }

    def cancel(self, call_id: str) -> None:
        with self.lock:
            call = self.calls[call_id]
            if not call.done.is_set():
                call.cancel_requested = True
                self.lock.notify_all()

    def preempt(self, call_id: str) -> None:
        with self.lock:
            call = self.calls[call_id]
            if call.status != "running":
                raise Rejected(INVALID, f"call {call_id} is {call.status}, not running")
            call.preempt_requested = True

    def describe(self) -> dict:
        with self.lock:
            return {
                "calls": [
                    {
                        "id": c.id,
                        "function": c.function,
                        "status": c.status,
                        "gpu": c.gpu,
                        "cpu": c.cpu,
                        "memory": c.memory,
                        "image": c.image["label"],
                        "attempts": [{k: v for k, v in a.items()} for a in c.attempts],
                        "error": c.error,
                    }
                    for c in self.calls.values()
                ],
                "queues": sorted(name for (kind, name) in self.names if kind == "queue"),
                "dicts": sorted(name for (kind, name) in self.names if kind == "dict"),
                "stats": json.loads(json.dumps(self.stats)),
                "clock": self.clock.now(),
            }


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), collected before any is killed."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                out += kids
                todo += kids
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out


def kill_tree(pid: int) -> None:
    """A container going away: the function's process and everything it started."""
    for p in [pid, *_descendants(pid)]:
        _signal(p, signal.SIGKILL)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.failing_retries = 0  # S21: after a surfaced lost reply, the client's own retries fail too
        serve_frames(self.request, self.answer)

    def answer(self, op: int, h: dict, values: list[bytes]):
        w = self.server.world
        if self.failing_retries and target_of(h)[0] is not None:
            self.failing_retries -= 1
            return TRANSIENT, {"message": "UNAVAILABLE: connection lost (injected, after a lost reply)"}, []
        fail, delay, lose = w.network.before(h)  # S21
        if delay:
            time.sleep(delay)
        if fail:
            return TRANSIENT, {"message": "UNAVAILABLE: injected transport fault"}, []
        try:
            code, header, out = (OK, *self.dispatch(w, op, h, values))
        except Rejected as exc:
            return exc.code, {"message": str(exc)}, []
        except Exception as exc:  # noqa: BLE001 - the emulator's own codes (limits.py), not the local backend's
            return ERROR, {"message": f"{type(exc).__name__}: {exc}"}, []
        if lose is not None and w.network.lost(lose, h, len(out) if h.get("op") == "q.get" else 0, found=True):
            if lose.surface:
                self.failing_retries = CLIENT_RETRIES
            return TRANSIENT, {"message": "UNAVAILABLE: the reply was lost (injected; the call was applied)"}, []
        return code, header, out

    @staticmethod
    def dispatch(w: Emulated, op: int, h: dict, values: list[bytes]):
        kind = h.get("op")
        if kind == "lookup":
            return {"id": w.lookup(h["kind"], h["name"], h["create"])}, []
        if kind == "delete":
            w.delete(h["kind"], h["name"], h["allow_missing"])
            return {}, []
        if kind == "secret.lookup":
            return {"id": w.secret(h["name"])}, []
        if kind == "q.put":
            w.put(h["id"], h["partition"], values, h["sizes"])
            return {}, []
        if kind == "q.get":
            return {}, w.get(h["id"], h["partition"], h["n"], h["wait_s"])
        if kind == "q.len":
            return {"len": w.qlen(h["id"], h["partition"], h["total"])}, []
        if kind == "q.clear":
            w.clear(h["id"], h["partition"], h["all"])
            return {}, []
        if kind == "d":
            result = w.dict_op(h["id"], h["what"], h.get("key"), values[0] if values else None, h.get("skip", False))
            if isinstance(result, bytes):
                return {"bytes": True}, [result]
            return {"value": result}, []
        if kind == "f.spawn":
            return {"id": w.spawn(h)}, []
        if kind == "f.input":
            c = w.calls[h["id"]]
            return {"app_file": c.app_file, "function": c.function, "args": c.args}, []
        if kind == "f.report":
            w.report(h["id"], h["attempt"], h["ok"], h.get("result"), h.get("error"), h.get("rank", 0))
            return {}, []
        if kind == "f.poll":
            return w.poll(h["id"], h["wait_s"]), []
        if kind == "f.cancel":
            w.cancel(h["id"])
            return {}, []
        if kind == "f.preempt":
            w.preempt(h["id"])
            return {}, []
        if kind == "f.lose":
            w.lose_container(h["id"], h["rank"])
            return {}, []
        if kind == "f.fail":
            with w.lock:
                w.faults[h["function"]] = h["times"]
            return {}, []
        if kind == "fault.add":
            return {"index": w.network.add(h["rule"])}, []
        if kind == "fault.list":
            return {"rules": w.network.describe()}, []
        if kind == "clock.advance":
            w.clock.advance(h["seconds"])
            return {"now": w.clock.now()}, []
        if kind == "describe":
            return w.describe(), []
        if kind == "ping":
            return {"pong": True}, []
        raise Rejected(INVALID, f"unknown op {kind!r}")


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, world: Emulated):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.world = world


def main() -> None:
    parser = argparse.ArgumentParser(
        description="The Modal emulator's server (started by cellfeed_testing.modal_emulator)."
    )
    parser.add_argument("--root", required=True)
    parser.add_argument("--clock-speed", type=float, default=1.0)
    parser.add_argument("--grace-s", type=float, default=30.0)
    parser.add_argument("--retry-delay-s", type=float, default=1.0)
    parser.add_argument("--env-file", required=True, help="JSON: the environment of function containers")
    parser.add_argument("--secret", action="append", default=[], help="a Secret that exists (S22), by name")
    args = parser.parse_args()
    env = json.loads(Path(args.env_file).read_text())
    world = Emulated(
        Path(args.root), Clock(args.clock_speed), args.grace_s, args.retry_delay_s, env, secret_names=args.secret
    )
    server = Server(world)
    host, port = server.server_address[:2]
    world.env["MODAL_EMULATOR"] = f"{host}:{port}"
    print(f"listening {host}:{port}", flush=True)

    def shutdown(*_):  # take every container down with the server
        for call in list(world.calls.values()):
            if call.proc is not None and call.proc.poll() is None:
                kill_tree(call.proc.pid)
        os._exit(0)

    signal.signal(signal.SIGTERM, shutdown)
    try:
        server.serve_forever()
    finally:
        shutdown()


if __name__ == "__main__":
    main()
