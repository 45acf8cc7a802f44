"""The emulated `modal` objects cellfeed uses, installed over the real package's names
(`install()`): `modal.Queue`, `modal.Dict`, `modal.App` (its `function` and `local_entrypoint`),
`modal.Function`/`FunctionCall`, `modal.Volume`, `modal.Image` (a recipe recorder over modal's own,
S20), `modal.Secret` (S22). Everything else — `modal.exception`, `modal.Retries` — stays modal's own.
Each behaviour names its semantic point (S1...) from README.md, which says where in modal 1.6.4 it
comes from.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import json
import os
import queue as stdlib_queue
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cellfeed_testing.modal_emulator.limits import (
    CLIENT_BASE_DELAY_S,
    CLIENT_MAX_DELAY_S,
    CLIENT_RETRIES,
    FULL,
    INVALID,
    MAX_TIMEOUT_S,
    NOT_FOUND,
    OK,
    TOO_LARGE,
    TRANSIENT,
)
from coordination.local_backend import decode_value, encode_value, recv_frame, send_frame

GET_REQUEST_S = 50.0  # S10: one blocking QueueGet waits at most 50 s server-side; the client loops
POLL_REQUEST_S = 50.0


@dataclass(frozen=True)
class Retry:
    """S21: how modal's client retries a transient error of one RPC (modal/_utils/grpc_utils.py:499-509):
    `retries` more attempts (None: no limit), the delay doubling from 0.1 s to `max_delay_s`."""

    retries: int | None = CLIENT_RETRIES
    max_delay_s: float = CLIENT_MAX_DELAY_S


DEFAULT_RETRY, NO_RETRY = Retry(), Retry(retries=0)


class _Transient(Exception):
    """A transient error of one attempt (injected, S21): retried as modal's client retries."""


class _Connection:
    """One socket per thread to the emulator's server (address from $MODAL_EMULATOR)."""

    def __init__(self):
        self._local = threading.local()

    def call(self, header: dict, values: list[bytes] = (), wait_s: float = 0.0, retry: Retry = DEFAULT_RETRY):
        """One RPC with modal's retries of transient errors (S21); once they are spent, the caller gets
        `modal.exception.ServiceError`, as from UNAVAILABLE (modal/_grpc_client.py:27-44)."""
        import modal.exception

        delay, attempt = CLIENT_BASE_DELAY_S, 0
        while True:
            try:
                return self._once(header, values, wait_s)
            except _Transient as exc:
                if retry.retries is not None and attempt >= retry.retries:
                    raise modal.exception.ServiceError(str(exc)) from None
                attempt += 1
                time.sleep(delay)
                delay = min(delay * 2, retry.max_delay_s)

    def _once(self, header: dict, values: list[bytes] = (), wait_s: float = 0.0):
        import modal.exception

        address = os.environ.get("MODAL_EMULATOR")
        if not address:
            raise modal.exception.ConnectionError("MODAL_EMULATOR is not set: no emulator to talk to")
        socks = self._local.__dict__.setdefault("socks", {})  # per thread, per emulator
        sock = socks.get(address)
        if sock is None:
            host, port = address.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks[address] = sock
        sock.settimeout(wait_s + 30)
        try:
            send_frame(sock, 0, header, values)
            code, reply, out = recv_frame(sock)
        except OSError as exc:
            socks.pop(address, None)
            sock.close()
            raise modal.exception.ConnectionError(f"lost the Modal emulator: {exc}") from None
        except BaseException:  # interrupted (a signal's exception) mid-call: its reply would be read by the next
            socks.pop(address, None)
            sock.close()
            raise
        if code == OK:
            return reply, out
        message = reply.get("message", "")
        if code == NOT_FOUND:
            raise modal.exception.NotFoundError(message)
        if code == INVALID:
            raise modal.exception.InvalidError(message)
        if code == FULL:
            raise modal.exception.ResourceExhaustedError(message)
        if code == TOO_LARGE:
            raise _RequestTooLarge(message)
        if code == TRANSIENT:
            raise _Transient(message)
        raise modal.exception.InternalError(message)


class _RequestTooLarge(Exception):
    """What the client sees of an HTTP 413 (`modal/queue.py`: "status = '413'" in the error)."""


_conn = _Connection()


def _serialized_size(value) -> int:
    """Bytes as Modal sends the value: its own serializer (cloudpickle), S6."""
    from modal._serialization import serialize

    return len(serialize(value))


class _Objects:
    def __init__(self, kind: str):
        self.kind = kind

    def delete(
        self, name: str, *, allow_missing: bool = False, environment_name: str | None = None, client=None
    ) -> None:
        _conn.call({"op": "delete", "kind": self.kind, "name": name, "allow_missing": allow_missing})


class _Named:
    """A handle made by `from_name`: lazy, hydrated on first use to one object id, kept (S1)."""

    _kind = ""

    def __init__(self, name: str, create_if_missing: bool):
        self._name, self._create, self._object_id = name, create_if_missing, None
        self._lock = threading.Lock()

    @classmethod
    def from_name(cls, name: str, *, environment_name: str | None = None, create_if_missing: bool = False, client=None):
        import re

        import modal.exception

        if not re.fullmatch(r"[A-Za-z0-9._-]{1,63}", name):  # S1: checked at construction, offline
            raise modal.exception.InvalidError(f"Invalid {cls.__name__} name: {name!r}")
        return cls(name, create_if_missing)

    @property
    def object_id(self) -> str:
        with self._lock:
            if self._object_id is None:
                reply, _ = _conn.call({"op": "lookup", "kind": self._kind, "name": self._name, "create": self._create})
                self._object_id = reply["id"]
            return self._object_id

    def hydrate(self, client=None):
        self.object_id
        return self


class Queue(_Named):
    _kind = "queue"
    objects = _Objects("queue")

    @staticmethod
    def validate_partition_key(partition: str | None) -> str:
        import modal.exception

        if partition is not None:
            key = partition.encode()
            if not 0 < len(key) <= 64:
                raise modal.exception.InvalidError("Queue partition key must be between 1 and 64 bytes.")
            return partition
        return ""

    def _put(self, values: list, partition: str | None, retry: Retry):
        sizes = [_serialized_size(v) for v in values]
        return _conn.call(
            {"op": "q.put", "id": self.object_id, "partition": self.validate_partition_key(partition), "sizes": sizes},
            [bytes(v) for v in values],
            retry=retry,
        )

    def put_many(
        self,
        vs: list,
        block: bool = True,
        timeout: float | None = None,
        *,
        partition: str | None = None,
        partition_ttl: int = 24 * 3600,
    ) -> None:
        """S5: blocking puts retry RESOURCE_EXHAUSTED with Modal's backoff (0.1 s, doubling, at most 30 s)
        and give up when the next try could not finish 2 s before the deadline — so a put with a
        timeout under ~2.1 s raises queue.Full at once; every retry re-sends the whole request.
        S21: a blocking put retries transient errors the same way (`max_retries=None`: without a
        timeout, for ever; at its timeout, `modal.exception.TimeoutError`); a non-blocking one
        retries them as every call does, then raises `ServiceError`."""
        import modal.exception

        vs = list(vs)
        for v in vs:
            if not isinstance(v, (bytes, bytearray)):
                raise TypeError("the emulator carries bytes values only (all cellfeed puts)")
        method = "put_many" if len(vs) > 1 else "put"
        t0, delay, retries = time.time(), 0.1, 0
        deadline = None if (timeout is None or not block) else t0 + timeout
        while True:
            try:
                self._put(vs, partition, NO_RETRY if block else DEFAULT_RETRY)
                return
            except _Transient as exc:  # (block=True only) S21: queue.py:687-702, retried with the put's own backoff
                if deadline is not None and (time.time() >= deadline or time.time() + delay + 2.0 >= deadline):
                    raise modal.exception.TimeoutError(
                        f"Queue.put could not complete within the provided timeout of {timeout} seconds"
                    ) from exc
                time.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            except (_RequestTooLarge, modal.exception.ResourceExhaustedError) as exc:
                too_large = isinstance(exc, _RequestTooLarge)  # S9: HTTP 413 reaches grpclib as UNKNOWN: retried
                if not block:  # the default Retry: RESOURCE_EXHAUSTED at once, UNKNOWN after 3 retries
                    if not too_large:
                        raise stdlib_queue.Full(str(exc)) from None
                    if retries >= 3:
                        raise modal.exception.RequestSizeError(f"Queue.{method} request is too large") from None
                elif deadline is not None and (time.time() >= deadline or time.time() + delay + 2.0 >= deadline):
                    if too_large:
                        raise modal.exception.TimeoutError(
                            f"Queue.put could not complete within the provided timeout of {timeout} seconds"
                        ) from exc
                    raise stdlib_queue.Full(str(exc)) from None
                time.sleep(delay)
                retries += 1
                delay = min(delay * 2, 30.0 if block else 1.0)

    def put(
        self,
        v,
        block: bool = True,
        timeout: float | None = None,
        *,
        partition: str | None = None,
        partition_ttl: int = 24 * 3600,
    ) -> None:
        self.put_many([v], block, timeout, partition=partition, partition_ttl=partition_ttl)

    def get_many(
        self, n_values: int, block: bool = True, timeout: float | None = None, *, partition: str | None = None
    ) -> list:
        """S10: blocking returns at least one item, or raises queue.Empty after `timeout`;
        non-blocking returns [] when empty."""
        key = self.validate_partition_key(partition)
        if not block:
            return _conn.call({"op": "q.get", "id": self.object_id, "partition": key, "n": n_values, "wait_s": 0})[1]
        deadline = None if timeout is None else time.time() + timeout
        while True:
            wait = GET_REQUEST_S if deadline is None else max(0.0, min(GET_REQUEST_S, deadline - time.time()))
            values = _conn.call(
                {"op": "q.get", "id": self.object_id, "partition": key, "n": n_values, "wait_s": wait}, wait_s=wait
            )[1]
            if values:
                return values
            if deadline is not None and time.time() > deadline:
                raise stdlib_queue.Empty()

    def get(self, block: bool = True, timeout: float | None = None, *, partition: str | None = None):
        values = self.get_many(1, block, timeout, partition=partition)
        return values[0] if values else None

    def len(self, *, partition: str | None = None, total: bool = False) -> int:
        return _conn.call(
            {"op": "q.len", "id": self.object_id, "partition": self.validate_partition_key(partition), "total": total}
        )[0]["len"]

    def clear(self, *, partition: str | None = None, all: bool = False) -> None:
        _conn.call(
            {"op": "q.clear", "id": self.object_id, "partition": self.validate_partition_key(partition), "all": all}
        )


_NO_DEFAULT = object()


class Dict(_Named):
    """S11: put/get/pop/contains/keys on one object id; values over 1 MiB refused."""

    _kind = "dict"
    objects = _Objects("dict")

    def _op(self, what: str, key=None, value=_NO_DEFAULT, skip=False, retry: Retry = DEFAULT_RETRY):
        values = [] if value is _NO_DEFAULT else [encode_value(value)]
        reply, out = _conn.call(
            {"op": "d", "id": self.object_id, "what": what, "key": key, "skip": skip}, values, retry=retry
        )
        return decode_value(out[0]) if reply.get("bytes") else reply.get("value")

    def put(self, key, value, *, skip_if_exists: bool = False) -> bool:
        return bool(self._op("put", key, value, skip_if_exists))

    def get(self, key, default=None):
        found = self._op("get", key)
        return default if found is None else found

    def contains(self, key) -> bool:
        return bool(self._op("contains", key))

    __contains__ = contains

    def pop(self, key, default=_NO_DEFAULT):
        import modal.exception

        try:
            return self._op("pop", key)
        except modal.exception.NotFoundError as exc:
            if "KeyError" not in str(exc):
                raise
            if default is not _NO_DEFAULT:
                return default
            raise KeyError(f"{key} not in dict {self.object_id}") from None

    def keys(self):
        """An iterator, as Modal's (S11): a deleted dict raises when it is first advanced. A streaming
        RPC: no retry of transient errors (S21, dict.py:620, _grpc_client.py:184-197)."""
        yield from self._op("keys", retry=NO_RETRY)

    def len(self) -> int:
        return len(list(self.keys()))


class Volume:
    """A folder of the emulator's (S19): `commit` is counted; `hydrate` and `remove_file` (S23) act
    on the folder ($CELLFEED_CHECKPOINT_MOUNT: the emulator has one Volume, always there)."""

    commits = 0

    def __init__(self, name: str):
        self.name = name

    @classmethod
    def from_name(
        cls,
        name: str,
        *,
        environment_name: str | None = None,
        create_if_missing: bool = False,
        version=None,
        create_options=None,
        client=None,
    ):
        return cls(name)

    def commit(self) -> None:
        """S28: a commit reloads the Volume after it (unless the server says skip_reload), and a
        reload fails while the container has a file of the Volume open: modal raises RuntimeError,
        not retried (modal/volume.py:889-917, and its docstring at 503)."""
        Volume.commits += 1
        self.reload()

    def reload(self) -> None:
        from cellfeed_testing.modal_emulator.server import _descendants  # (what a container may import)

        root = str(_volume_folder().resolve())
        open_files = []
        for pid in [os.getpid(), *_descendants(os.getpid())]:  # the container's processes
            for fd in Path(f"/proc/{pid}/fd").glob("*"):
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith(root + "/"):
                    open_files.append(target[len(root) :])
        if open_files:
            raise RuntimeError(f"Volume reload failed: there are open files on the volume: {sorted(open_files)[:3]}")

    def hydrate(self, client=None) -> "Volume":
        _volume_folder()
        return self

    def remove_file(self, path: str, recursive: bool = False) -> None:
        """S23: a missing path is `FileNotFoundError` (modal maps the server's NOT_FOUND so); a
        directory with something in it needs `recursive=True` (server-side: `InvalidError` here)."""
        import shutil

        import modal.exception

        root = _volume_folder().resolve()
        target = (root / path.lstrip("/")).resolve()
        if root not in target.parents:  # (the emulator's own guard: its folder is on this machine's disk)
            raise modal.exception.InvalidError(f"{path!r}: the emulator removes paths inside the Volume only")
        if not target.exists():
            raise FileNotFoundError(f"{path} not found in Volume {self.name}")
        if target.is_dir() and not recursive and any(target.iterdir()):
            raise modal.exception.InvalidError(f"{path} is a directory: pass recursive=True to remove it")
        shutil.rmtree(target) if target.is_dir() else target.unlink()

    def read_file(self, path: str):
        """S26: the file's bytes, as a generator (modal's `read_file` is an async generator, wrapped
        sync: nothing happens until it is first advanced); a missing file is `FileNotFoundError`
        (the client's mapping of NOT_FOUND)."""
        import modal.exception

        root = _volume_folder().resolve()
        target = (root / path.lstrip("/")).resolve()
        if root not in target.parents:
            raise modal.exception.InvalidError(f"{path!r}: the emulator reads paths inside the Volume only")
        if not target.is_file():
            raise FileNotFoundError(f"{path} not found in Volume {self.name}")
        yield target.read_bytes()


def _volume_folder():
    """The emulator's Volume folder (S19, S23), as its containers and the test's processes see it."""
    from pathlib import Path

    import modal.exception

    folder = os.environ.get("CELLFEED_CHECKPOINT_MOUNT")
    if not folder or not Path(folder).is_dir():
        raise modal.exception.NotFoundError("the emulator's Volume folder ($CELLFEED_CHECKPOINT_MOUNT) is not here")
    return Path(folder)


def _raise_remote(error: dict):
    """S13: the remote exception, re-raised as its own type where it can be rebuilt."""
    import modal.exception

    module, _, name = error["type"].rpartition(".")
    remote = None
    try:
        cls = getattr(importlib.import_module(module or "builtins"), name)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            remote = cls(error["message"])
    except (ImportError, AttributeError, TypeError):
        pass
    if remote is not None:  # (raised here, not in the try: an ImportError of the body's must not be caught above)
        raise remote
    raise modal.exception.RemoteError(f"{error['type']}: {error['message']}")


class FunctionCall:
    def __init__(self, object_id: str):
        self.object_id = object_id

    @classmethod
    def from_id(cls, function_call_id: str, client=None) -> "FunctionCall":
        return cls(function_call_id)

    def hydrate(self, client=None) -> "FunctionCall":
        """modal's `from_id` handle is lazy until hydrated (its `object_id` raises before); this one never is."""
        return self

    def get(self, timeout: float | None = None, *, index: int = 0):
        """S13: the result; the remote error re-raised; FunctionTimeoutError when the function
        ran past its timeout; builtin `TimeoutError` while it is still running after `timeout`."""
        import modal.exception

        deadline = None if timeout is None else time.time() + timeout
        while True:
            wait = POLL_REQUEST_S if deadline is None else max(0.0, min(POLL_REQUEST_S, deadline - time.time()))
            reply, _ = _conn.call({"op": "f.poll", "id": self.object_id, "wait_s": wait}, wait_s=wait)
            status = reply["status"]
            if status == "success":
                return reply["result"]
            if status == "timeout":
                raise modal.exception.FunctionTimeoutError(reply["error"]["message"])
            if status == "cancelled":  # S13: a cancelled input's output is TERMINATED, with no data
                raise modal.exception.RemoteError("Input was cancelled")
            if status == "failure":
                _raise_remote(reply["error"])
            if deadline is not None and time.time() >= deadline:
                raise builtins.TimeoutError()

    def cancel(self, terminate_containers: bool = False) -> None:
        _conn.call({"op": "f.cancel", "id": self.object_id})


class Image:
    """S20: an image as far as it decides what a container can import: the packages its
    `pip_install` lists and the local Python packages it adds. Each step is also taken on modal's
    own `Image` (lazy, offline), so what modal refuses is refused here; a step the emulator does not
    model is an AttributeError, not a silent pass."""

    def __init__(self, real, pip: tuple = (), sources: tuple = (), steps: tuple = ()):
        self.real, self.pip, self.sources, self.steps = real, pip, sources, steps

    @classmethod
    def debian_slim(cls, python_version: str | None = None, force_build: bool = False) -> "Image":
        real = _originals["Image"].debian_slim(python_version=python_version, force_build=force_build)
        return cls(real, steps=(f"debian_slim({python_version or ''})",))

    def pip_install(self, *packages, **options) -> "Image":
        flat = tuple(p for group in packages for p in ([group] if isinstance(group, str) else group))
        return Image(
            self.real.pip_install(*packages, **options),
            self.pip + flat,
            self.sources,
            self.steps + (f"pip_install({', '.join(flat)})",),
        )

    uv_pip_install = pip_install

    def add_local_python_source(self, *modules: str, **options) -> "Image":
        return Image(
            self.real.add_local_python_source(*modules, **options),
            self.pip,
            self.sources + modules,
            self.steps + (f"add_local_python_source({', '.join(modules)})",),
        )

    def env(self, variables: dict) -> "Image":
        return Image(self.real.env(variables), self.pip, self.sources, self.steps + ("env(...)",))

    def spec(self) -> dict:
        return {"pip": list(self.pip), "sources": list(self.sources), "label": ".".join(self.steps)}


@dataclass
class _Spec:
    timeout: float
    retries: int
    gpu: str | None
    volumes: dict
    cpu: float | None
    memory: int | None
    image: Image | None = None
    cluster_size: int = 0  # S27: `@modal.clustered(size=N)`: N containers run each input


def clustered(size: int, broadcast: bool = True, rdma: bool = False):
    """S27: `@modal.clustered(size=N, rdma=...)`, applied below `@app.function`: every input runs in N
    containers started together (rank 0's output is the call's); `size` must be a positive int
    (_partial_function.py:808-845)."""
    import modal.exception

    if not isinstance(size, int) or size < 1:
        raise modal.exception.InvalidError("cluster size must be a positive integer")

    def wrap(raw_f):
        raw_f.__modal_cluster_size__ = size
        return raw_f

    return wrap


@dataclass
class ClusterInfo:
    """S27: what `modal.experimental.get_cluster_info()` returns in a cluster's container
    (_cluster.py:19-27): this container's rank and every container's address, by rank."""

    rank: int
    cluster_id: str
    container_ips: list
    container_ipv4_ips: list
    fabric_ids: list


def get_cluster_info() -> ClusterInfo:
    """S27: this container's cluster context; outside a cluster, modal raises InvalidError (_cluster.py:33-40)."""
    import modal.exception

    found = os.environ.get("MODAL_EMULATOR_CLUSTER")
    if not found:
        raise modal.exception.InvalidError(
            "Cluster context is not initialized. This function is only available in a clustered function."
        )
    c = json.loads(found)
    return ClusterInfo(c["rank"], c["cluster_id"], c["ips"], c["ips"], [])


class Function:
    """An `@app.function`: `.remote` / `.spawn` run its body in a new process (S13-S16)."""

    def __init__(self, raw_f, spec: _Spec):
        self.raw_f, self.spec = raw_f, spec
        self.tag = raw_f.__name__  # (a modal.Function has no __name__: code that read one failed on Modal)

    def __repr__(self) -> str:  # as modal's: `Function(TAG)` (modal/_functions.py:1219)
        return f"Function({self.tag})"

    def get_raw_f(self):
        return self.raw_f

    def with_options(
        self,
        *,
        gpu: str | None = None,
        cpu: float | None = None,
        memory: int | None = None,
        timeout: int | None = None,
        retries: int | None = None,
        **others,
    ) -> "Function":
        """S25: only the options given change; the rest stay the function's (its cpu and memory
        included: modal sends unset resources as 0 and keeps the base's, _function_variants.py)."""
        import modal.exception

        if others:
            raise modal.exception.InvalidError(f"the emulator does not model with_options({', '.join(others)})")
        changed = dict(vars(self.spec))
        for name, value in (("gpu", gpu), ("cpu", cpu), ("memory", memory), ("timeout", timeout), ("retries", retries)):
            if value:
                changed[name] = float(value) if name == "timeout" else value
        return Function(self.raw_f, _Spec(**changed))

    def spawn(self, *args, **kwargs) -> FunctionCall:
        import modal.exception

        try:
            payload = json.loads(json.dumps({"args": list(args), "kwargs": kwargs}))
        except TypeError as exc:
            raise modal.exception.InvalidError(f"the emulator passes JSON arguments only: {exc}") from None
        reply, _ = _conn.call(
            {
                "op": "f.spawn",
                "app_file": self.raw_f.__module__,
                "function": self.tag,
                "args": payload,
                "timeout": self.spec.timeout,
                "retries": self.spec.retries,
                "gpu": self.spec.gpu,
                "cpu": self.spec.cpu,
                "memory": self.spec.memory,
                "image": self.spec.image.spec() if self.spec.image is not None else None,
                "cluster_size": self.spec.cluster_size,
            }
        )
        return FunctionCall(reply["id"])

    def remote(self, *args, **kwargs):
        return self.spawn(*args, **kwargs).get()

    def local(self, *args, **kwargs):
        return self.raw_f(*args, **kwargs)


class _EntrypointInfo:
    def __init__(self, raw_f):
        self.raw_f = raw_f


class LocalEntrypoint:
    """S18: `app.local_entrypoint()` keeps the function as `.info.raw_f`; calling it calls it."""

    def __init__(self, raw_f):
        self.info = _EntrypointInfo(raw_f)

    def __call__(self, *args, **kwargs):
        return self.info.raw_f(*args, **kwargs)


class App:
    def __init__(self, name: str | None = None, **kwargs):
        self.name = name
        self.registered_functions: dict[str, Function] = {}
        self.registered_entrypoints: dict[str, LocalEntrypoint] = {}

    def function(
        self,
        *,
        image=None,
        secrets=(),
        gpu=None,
        volumes=None,
        timeout: int = 300,
        retries=None,
        cpu=None,
        memory=None,
        **others,
    ):
        import modal.exception

        if timeout > MAX_TIMEOUT_S:  # S13: Modal refuses a timeout over 24 h (server-side, at deploy)
            raise modal.exception.InvalidError("timeout must be at most 24 hours")
        n_retries = getattr(retries, "max_retries", retries) or 0

        def wrap(raw_f) -> Function:
            if image is not None and not isinstance(image, Image):
                raise modal.exception.InvalidError(
                    f"{raw_f.__name__}: image= must be an emulated modal.Image "
                    "(build it after the emulator is installed)"
                )
            size = getattr(raw_f, "__modal_cluster_size__", 0)
            spec = _Spec(float(timeout), int(n_retries), gpu, dict(volumes or {}), cpu, memory, image, size)
            fn = Function(raw_f, spec)
            self.registered_functions[raw_f.__name__] = fn
            return fn

        return wrap

    def local_entrypoint(self, *, name: str | None = None):
        def wrap(raw_f) -> LocalEntrypoint:
            entry = LocalEntrypoint(raw_f)
            self.registered_entrypoints[name or raw_f.__name__] = entry
            return entry

        return wrap

    @contextlib.contextmanager
    def run(
        self,
        *,
        name: str | None = None,
        client=None,
        detach: bool = False,
        interactive: bool = False,
        environment_name: str | None = None,
    ):
        """S24: what a script wraps its calls in (`with app.run(): ...`). Nothing to start here: the
        app's functions are reachable already; an app already running is refused, as modal does."""
        import modal.exception

        if getattr(self, "_running", False):
            raise modal.exception.InvalidError("App is already running and can't be started again.")
        self._running = True
        try:
            yield self
        finally:
            self._running = False


class Secret:
    """S22: a named Secret: `from_name` is lazy (no call); `hydrate()` looks the name up and raises
    `NotFoundError` for one the emulator does not hold (`ModalEmulator(secrets=...)`). Its variables
    reach the containers through the emulator's environment."""

    def __init__(self, name: str):
        self.name, self.object_id = name, None

    @classmethod
    def from_name(
        cls, name: str, *, environment_name: str | None = None, required_keys: list[str] = [], client=None
    ) -> "Secret":
        return cls(name)

    def hydrate(self, client=None) -> "Secret":
        if self.object_id is None:
            self.object_id = _conn.call({"op": "secret.lookup", "name": self.name})[0]["id"]
        return self


def current_function_call_id() -> str | None:
    """S13: in a container, the id of the call whose input it runs (modal/_runtime/execution_context.py:60);
    None elsewhere."""
    return os.environ.get("MODAL_EMULATOR_CALL")


_EMULATED = {
    "current_function_call_id": current_function_call_id,
    "Queue": Queue,
    "Dict": Dict,
    "App": App,
    "Function": Function,
    "FunctionCall": FunctionCall,
    "Volume": Volume,
    "Image": Image,
    "Secret": Secret,
    "clustered": clustered,
}
_originals: dict = {}


def install() -> None:
    """Put the emulated objects where `import modal` finds them (this process only)."""
    import modal
    import modal.experimental

    for name, obj in _EMULATED.items():
        _originals.setdefault(name, getattr(modal, name))
        setattr(modal, name, obj)
    _originals.setdefault("experimental.get_cluster_info", modal.experimental.get_cluster_info)
    modal.experimental.get_cluster_info = get_cluster_info


def uninstall() -> None:
    """Give `modal` its own objects back (a test process that goes on with the real client)."""
    import modal
    import modal.experimental

    for name, obj in _originals.items():
        if name.startswith("experimental."):
            setattr(modal.experimental, name.split(".", 1)[1], obj)
        else:
            setattr(modal, name, obj)
    _originals.clear()
