"""Containers: local process trees running modal's own container entrypoint, one per attempt of an input.

A container is `python -m modal._container_entrypoint` (the real one, unmodified) in a session of its
own, with the environment it reads (modal/_container_entrypoint.py:469-480; config.py:126-131):

- `MODAL_IS_REMOTE=1`: the client takes the container's identity, no token (client.py:350-370);
- `MODAL_CONTAINER_ARGUMENTS_PATH`: a serialized `api_pb2.ContainerArguments` (task, function, app
  layout) written here;
- `MODAL_TASK_ID`, `MODAL_SERVER_URL` (this plane);
- `MODAL_OVERRIDE_HEADERS=x-cellfeed-task-id:<task>`: a container's RPCs carry no task id of their
  own (Modal's worker knows which container a connection is), so each container's client adds this
  header to every request (client.py:86-88, config.py:426) and the plane knows who is asking.

Its files: each mount the function names (`add_local_python_source` and friends) is written out under
the container's folder, at its remote path (`/root/...` -> `<folder>/fs/root/...`); Python starts in
`<folder>/fs/root` with it first on `PYTHONPATH`, as Modal's `/root`.

Every container is started by the plane, watched by one task (its exit, its timeout) and, when it ends
or the plane stops, killed with everything it started (its process group, and the processes below it
found in /proc before any is signalled).
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from modal_proto import api_pb2

from cellfeed_testing.procs import own_rank_server

log = logging.getLogger("cellfeed.modal_control_plane")
TASK_HEADER = "x-cellfeed-task-id"
STOP_GRACE_S = 5.0  # SIGINT, then this long, then SIGKILL (when the plane or an app stops)
EXIT_WAIT_S = 10.0  # how long a killed process may take to be reaped
# K3: Modal's containers are told their cloud (`MODAL_CLOUD_PROVIDER`; a clustered container's client reads
# it, modal/_cluster.py:167-175, and fails without it). The plane runs on no cloud: the proto's own "none".
CLOUD_PROVIDER = "CLOUD_PROVIDER_UNSPECIFIED"
I6PN_HOST = "i6pn.modal.local"  # K2: the name a clustered container's client resolves to its own IPv6 address
I6PN_ADDRESS = "::1"  # every container of this plane is on this host: its IPv6 loopback
FAULT_MODULE = "cellfeed_control_plane_fault"  # K6: imported instead of the app's module by an attempt made to fail
# K2: this machine's resolver knows no `i6pn.modal.local` (Modal's container DNS does); a clustered
# container's Python resolves it through this shim, first on its PYTHONPATH, which answers that one name
# with the IPv6 loopback and passes every other to the real getaddrinfo, then runs any sitecustomize after it
RESOLVER = f"""\
import socket as _socket

_real_getaddrinfo = _socket.getaddrinfo


def _getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
    if host in ({I6PN_HOST!r}, {I6PN_HOST!r}.encode()):
        if family not in (0, _socket.AF_INET6):
            raise _socket.gaierror(_socket.EAI_ADDRFAMILY, "{I6PN_HOST} has only an IPv6 address")
        return _real_getaddrinfo({I6PN_ADDRESS!r}, port, _socket.AF_INET6, type, proto, flags)
    return _real_getaddrinfo(host, port, family, type, proto, flags)


_socket.getaddrinfo = _getaddrinfo

import importlib.machinery as _machinery
import importlib.util as _util
import os as _os
import sys as _sys

# the folders whose sitecustomize has run are skipped, this one's and the image guard's (which chains the
# same way): two that each skipped only their own folder ran each other until Python's recursion limit
_seen = _sys.__dict__.setdefault("_cellfeed_site_dirs", set())
_seen.add(_os.path.dirname(_os.path.abspath(__file__)))
_rest = [p for p in _sys.path if p and _os.path.abspath(p) not in _seen]
_spec = _machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
"""


def descendants(pid: int) -> list[int]:
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


@dataclass
class Container:
    task_id: str
    call: object  # calls.Call: the input this container runs
    attempt: int
    folder: Path
    proc: asyncio.subprocess.Process | None = None
    input_given: bool = False
    output_sent: bool = False
    task_result: api_pb2.GenericResult | None = None
    cancel_input_ids: list[str] = field(default_factory=list)  # handed out by the next heartbeat
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int | None = None
    killed_why: str = ""
    retry_count: int = 0  # the retries its call had spent when it started (FunctionGetInputsItem.retry_count)
    volumes: dict = field(default_factory=dict)  # volume id -> [view folder, its files at last sync, read only]
    cluster: object = None  # clusters.Cluster: the attempt's containers, when its function is clustered (K1)
    rank: int = 0  # its rank in that cluster
    interrupted: int = 0  # how many of its processes the (one) stop with a grace sent SIGINT to (C17)
    started_at: float = 0.0
    ended_at: float = 0.0


def _tree(pid: int) -> list[int]:
    return [pid, *descendants(pid)]


def _signal_tree(pids: list[int], pgid: int, sig: int) -> None:
    """`sig` once to every process of the container: to its group (which also reaches a process started
    since `pids` was listed), then to each of `pids` outside that group (one that made its own session).
    Twice would be a second SIGINT, raised inside the handler of the first, as Modal never does."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in pids:
        try:
            if os.getpgid(p) != pgid:
                os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Containers:
    """Starts, watches and stops containers. `on_exit(container)` is the calls' business."""

    def __init__(self, root: Path, server_url: callable, on_exit, on_output_line) -> None:
        self.root = root
        self._server_url = server_url
        self._on_exit = on_exit
        self._on_output_line = on_output_line
        self.by_task: dict[str, Container] = {}
        self._watchers: set[asyncio.Task] = set()
        self.started_pids: list[int] = []  # every container's main pid, for tests to check none remains
        self.timeout_scale = 1.0  # K5: a function's timeout runs this many times faster than the wall clock

    def of(self, stream) -> Container | None:
        task_id = stream.metadata.get(TASK_HEADER) if stream.metadata else None
        return self.by_task.get(task_id) if task_id else None

    def folder_for(self, task_id: str) -> Path:
        return self.root / "containers" / task_id

    def running(self) -> list[Container]:
        return [c for c in self.by_task.values() if not c.ended.is_set()]

    async def start(
        self,
        task_id: str,
        call,
        attempt: int,
        args: api_pb2.ContainerArguments,
        files: dict[str, Path],
        env: dict[str, str],
        timeout_s: float | None,
        volumes: dict | None = None,
    ) -> Container:
        folder = self.folder_for(task_id)
        fs_root = folder / "fs" / "root"
        fs_root.mkdir(parents=True, exist_ok=True)
        for remote, blob in files.items():  # a mount's files at their remote paths
            target = folder / "fs" / remote.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(blob, target)
        (folder / "tmp").mkdir()
        if attempt in getattr(call, "failing_attempts", ()):  # K6: this attempt fails before its body runs
            (fs_root / f"{FAULT_MODULE}.py").write_text('raise RuntimeError("injected fault")\n')
            args.function_def.module_name = FAULT_MODULE
        (folder / "container_arguments.bin").write_bytes(args.SerializeToString())
        # a container is another machine: no laptop's Modal settings, and no laptop's shared rank server
        base = {k: v for k, v in own_rank_server().items() if not k.startswith("MODAL_")}
        python_path = [str(fs_root)] + ([base["PYTHONPATH"]] if base.get("PYTHONPATH") else [])
        if args.function_def.i6pn_enabled or args.function_def._experimental_group_size:  # K2
            resolver = folder / "i6pn"
            resolver.mkdir()
            (resolver / "sitecustomize.py").write_text(RESOLVER)
            python_path.insert(0, str(resolver))
        if timeout_s is not None:  # K5
            timeout_s = timeout_s / self.timeout_scale
        child_env = {
            **base,
            **env,
            "MODAL_IS_REMOTE": "1",
            "MODAL_SERVER_URL": self._server_url(),
            "MODAL_TASK_ID": task_id,
            "MODAL_CONTAINER_ARGUMENTS_PATH": str(folder / "container_arguments.bin"),
            "MODAL_OVERRIDE_HEADERS": f"{TASK_HEADER}:{task_id}",
            "MODAL_CONFIG_PATH": str(folder / "no-modal.toml"),
            "MODAL_ENVIRONMENT": args.environment_name or "main",
            "MODAL_CLOUD_PROVIDER": CLOUD_PROVIDER,  # K3
            "PYTHONPATH": os.pathsep.join(python_path),
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(folder / "tmp"),
        }
        c = Container(
            task_id, call, attempt, folder, retry_count=call.retry_count, volumes=volumes or {}, started_at=time.time()
        )
        c.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "modal._container_entrypoint",
            cwd=fs_root,
            env=child_env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: the container's processes, killed together
        )
        self.by_task[task_id] = c
        self.started_pids.append(c.proc.pid)
        watcher = asyncio.create_task(self._watch(c, timeout_s), name=f"container {task_id}")
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return c

    async def _pump(self, c: Container, reader: asyncio.StreamReader, fd: int) -> None:
        # chunks, not lines: a progress bar rewrites its line with "\r" and never ends it, and a line past the
        # reader's 64 KiB limit would end the pump and then stall the container on a full pipe
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        with open(c.folder / ("stdout.log" if fd == api_pb2.FILE_DESCRIPTOR_STDOUT else "stderr.log"), "ab") as f:
            pending = ""  # a line not ended yet: sent once it ends (or grows past 64 KiB), as a line reader would
            while chunk := await reader.read(1 << 16):
                f.write(chunk)
                f.flush()
                pending += decoder.decode(chunk)
                cut = max(pending.rfind("\n"), pending.rfind("\r")) + 1
                if len(pending) > 1 << 16:
                    cut = len(pending)
                if cut:
                    await self._on_output_line(c, fd, pending[:cut])
                    pending = pending[cut:]
            if pending:
                await self._on_output_line(c, fd, pending)

    async def _watch(self, c: Container, timeout_s: float | None) -> None:
        pumps = [
            asyncio.create_task(self._pump(c, c.proc.stdout, api_pb2.FILE_DESCRIPTOR_STDOUT)),
            asyncio.create_task(self._pump(c, c.proc.stderr, api_pb2.FILE_DESCRIPTOR_STDERR)),
        ]
        try:
            await asyncio.wait_for(asyncio.shield(c.proc.wait()), timeout_s)
        except asyncio.TimeoutError:  # C13: a call's timeout is per attempt, server-side
            await self.kill(c, f"timeout after {timeout_s:.0f}s", grace_s=0)
        # the main process is gone: whatever it left in its process group goes with it
        _signal_tree([], c.proc.pid, signal.SIGKILL)
        await asyncio.wait(pumps, timeout=EXIT_WAIT_S)
        c.exit_code = c.proc.returncode
        c.ended_at = time.time()
        c.ended.set()
        await self._on_exit(c)

    async def kill(self, c: Container, why: str, grace_s: float = STOP_GRACE_S) -> None:
        """SIGINT to every process of the container, `grace_s`, then SIGKILL (emulator S15). A container
        is interrupted once: a second stop in its grace (a preemption, then its app stopped) waits with
        the first, and SIGKILLs at its own deadline, but sends no second SIGINT into the first's handler."""
        if c.proc is None or c.proc.returncode is not None:
            return
        c.killed_why = c.killed_why or why
        pids = _tree(c.proc.pid)
        if grace_s > 0:
            if not c.interrupted:
                c.interrupted = len(pids)
                _signal_tree(pids, c.proc.pid, signal.SIGINT)
            try:
                await asyncio.wait_for(asyncio.shield(c.proc.wait()), grace_s)
            except asyncio.TimeoutError:
                pass
        pids = sorted(set(pids) | set(_tree(c.proc.pid)))
        _signal_tree(pids, c.proc.pid, signal.SIGKILL)
        try:
            await asyncio.wait_for(asyncio.shield(c.proc.wait()), EXIT_WAIT_S)
        except asyncio.TimeoutError:
            log.error("container %s (pid %s) did not exit after SIGKILL", c.task_id, c.proc.pid)

    async def stop_app(self, app_id: str, why: str) -> None:
        await asyncio.gather(*(self.kill(c, why) for c in self.running() if c.call.app_id == app_id))

    async def shutdown(self) -> None:
        await asyncio.gather(*(self.kill(c, "the control plane stopped") for c in self.running()))
        if self._watchers:
            await asyncio.wait(list(self._watchers), timeout=EXIT_WAIT_S + STOP_GRACE_S)


def now() -> float:
    return time.time()
