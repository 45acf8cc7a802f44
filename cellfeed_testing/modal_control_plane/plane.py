"""`ControlPlane`: the gRPC server on its own event loop in a thread, and the environment a client needs.

A client finds the server through `MODAL_SERVER_URL` (read at call time, modal/config.py:380, 471):
`http://127.0.0.1:PORT` or `unix:///path` (modal/_utils/grpc_utils.py:384-395). With
`MODAL_TOKEN_ID`/`MODAL_TOKEN_SECRET` set the client opens without any RPC (`Client.from_env`,
modal/client.py:394-421: no ClientHello; `hello()` is only `modal token`'s and `Client.verify`'s).
`MODAL_CONFIG_PATH` points at a file that does not exist, so a developer's `~/.modal.toml` (its
profile, its token, its server) never reaches the plane's clients (config.py:123).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

from grpclib.server import Server
from modal_proto import api_pb2

from cellfeed_testing.modal_control_plane.faults import FaultLayer, faults_for
from cellfeed_testing.modal_control_plane.server import Servicer
from cellfeed_testing.modal_control_plane.volumes import publish_once

TOKEN_ID, TOKEN_SECRET = "ak-cellfeed-control-plane", "as-cellfeed-control-plane"
GenericResult = api_pb2.GenericResult
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


class ControlPlane:
    """`with ControlPlane() as plane: subprocess.run(cmd, env={**os.environ, **plane.env})`."""

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        transport: str = "tcp",
        secrets: dict[str, dict[str, str]] | None = None,
        mount_env: dict[str, str] | None = None,
        images: bool = True,
        client_gone_s: float | None = None,
        lasting_volumes: dict[str, Path] | None = None,
    ) -> None:
        """`secrets`: the named Secrets that exist ({name: {VAR: value}}). `mount_env`: for a Volume
        mount path, a variable its containers get naming the folder standing for it (volumes.py, V5).
        `images`: a container imports only what its function's image installs (S20, image_guard.py),
        as on Modal; False lets containers import whatever this machine has. `client_gone_s`: how long an
        app's client may go unheard before it is taken as gone (D12; server.CLIENT_GONE_S by default).
        `lasting_volumes`: named Volumes that outlive this plane, as a workspace's do across runs (V9:
        {name: host folder}); each starts with its folder's files, and the first plane to stop with
        a top-level entry in one publishes it there, whole (later planes leave it as it is)."""
        if transport not in ("tcp", "unix"):
            raise ValueError(f"transport is 'tcp' or 'unix', not {transport!r}")
        self._tmp = None if root is not None else tempfile.TemporaryDirectory(prefix="modal-control-plane-")
        self.root = Path(root if root is not None else self._tmp.name)
        self.root.mkdir(parents=True, exist_ok=True)
        self.transport = transport
        self.servicer = Servicer(self.root, secrets=secrets, mount_env=mount_env)
        if client_gone_s is not None:
            self.servicer.client_gone_s = client_gone_s
        self.network = faults_for(self.servicer)  # injected network faults (faults.py): fault(), faults()
        if images:
            from cellfeed_testing.modal_control_plane.image_guard import enforce_images

            enforce_images(self)
        self.lasting_volumes = {name: Path(folder) for name, folder in (lasting_volumes or {}).items()}
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="modal-control-plane", daemon=True)
        self._server: Server | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a laptop-side `modal` process needs in its environment to use this plane."""
        return {
            "MODAL_SERVER_URL": self.url,
            "MODAL_TOKEN_ID": TOKEN_ID,
            "MODAL_TOKEN_SECRET": TOKEN_SECRET,
            "MODAL_CONFIG_PATH": str(self.root / "no-modal.toml"),
        }

    def calls(self, function_name: str) -> list:
        """The calls of the function named so (oldest first): `calls.Call`, read-only for tests."""
        names = {fid: f.definition.function_name for fid, f in self.servicer.functions.items()}
        return [c for c in list(self.servicer.calls.values()) if names.get(c.function_id) == function_name]

    # ---- what a test or a benchmark looks at (plain data, read on the plane's loop)

    def describe(self) -> dict:
        """{"calls": [{id, function, status, attempts: [{task, pid, ended, exit_code, killed}], error}],
        "queues": [names], "dicts": [names], "clock": server seconds}. A call's status is `running`
        until it has its final output, then `success`, `failure`, `timeout` or `cancelled`."""
        return self.call(self._describe())

    def dict_value(self, name: str, key):
        """What `modal.Dict.from_name(name).get(key)` would return (None: no such entry), read in the
        plane: a test that waits on an entry starts no process and makes no call for each look."""
        from modal._serialization import deserialize, serialize

        value = self.call(self._dict_peek(name, serialize(key)))
        return None if value is None else deserialize(value, None)

    async def _dict_peek(self, name: str, key: bytes) -> bytes | None:
        return self.servicer.store.dict_peek(name, key)

    def call_list(self, function: str | None = None) -> list[dict]:
        """`describe()["calls"]`, of one function (its name as defined: `train`, `produce`, ...) or all."""
        return [c for c in self.describe()["calls"] if function is None or c["function"] == function]

    @property
    def volume_dir(self) -> Path:
        """The committed folder of the campaign's checkpoints Volume (what a new container would see)."""
        return self.volume_folder("cellfeed-checkpoints")  # app/modal_app.py's VOLUME_NAME

    def volume_folder(self, name: str) -> Path:
        """The committed folder of the Volume named `name` (made empty now if it does not exist yet)."""
        return self.call(self._volume_folder(name))

    def container_log(self, task_id: str) -> str:
        """A container's stdout and stderr as it wrote them (its folder's logs)."""
        folder = self.servicer.containers.folder_for(task_id)
        return "".join(
            (folder / name).read_text(errors="replace")
            for name in ("stdout.log", "stderr.log")
            if (folder / name).exists()
        )

    async def _volume_folder(self, name: str) -> Path:
        s = self.servicer
        volume_id = s.volume_names.get(("main", name))
        v = s.volumes[volume_id] if volume_id else s.create_volume(name)
        return v.committed

    async def _describe(self) -> dict:
        s = self.servicer
        names = {fid: f.definition.function_name for fid, f in s.functions.items()}
        status = {
            GenericResult.GENERIC_STATUS_SUCCESS: "success",
            GenericResult.GENERIC_STATUS_TIMEOUT: "timeout",
            GenericResult.GENERIC_STATUS_TERMINATED: "cancelled",
        }
        calls = []
        for c in list(s.calls.values()):
            result = c.output.result if c.output is not None else None
            calls.append(
                {
                    "id": c.call_id,
                    "function": names.get(c.function_id, "?"),
                    "status": "running" if result is None else status.get(result.status, "failure"),
                    "attempts": [
                        {
                            "task": k.task_id,
                            "pid": k.proc.pid if k.proc else None,
                            "ended": k.ended.is_set(),
                            "exit_code": k.exit_code,
                            "killed": k.killed_why,
                        }
                        for k in c.containers
                    ],
                    "error": result.exception if result is not None else "",
                }
            )
        named = list(s.store.names)
        return {
            "calls": calls,
            "queues": sorted(name for kind, _, name in named if kind == "queue"),
            "dicts": sorted(name for kind, _, name in named if kind == "dict"),
            "clock": s.store.clock.now(),
        }

    def preempt(self, call_id: str, grace_s: float = 30.0) -> list[str]:
        """Preempt the containers running `call_id` (calls.py, C17); their task ids."""
        return self.call(self.servicer.preempt(call_id, grace_s), grace_s + STOP_TIMEOUT_S + 5)

    # ---- clusters, injected failures, time (README K1-K6)

    def lose_container(self, call_id: str, rank: int) -> str:
        """K4: the container of `rank` in the call's running (clustered) attempt is lost: SIGKILL, no
        grace; the attempt fails with its cluster. Its task id."""
        return self.call(self.servicer.lose_container(call_id, rank))

    def fail(self, function: str, times: int) -> None:
        """K6: the next `times` attempts of `function` (its name as defined) fail before its body runs."""

        async def set_failures() -> None:
            self.servicer.failures[function] = times

        self.call(set_failures())

    def scale_timeouts(self, factor: float) -> None:
        """K5: from now on a container's function timeout runs `factor` times faster than the wall clock
        (`timeout=86400` with factor 480 ends an attempt still running after 180 s, as TIMEOUT)."""

        async def set_scale() -> None:
            self.servicer.containers.timeout_scale = float(factor)

        self.call(set_scale())

    def advance(self, seconds: float) -> float:
        """Move the server's clock on (C7, C10: queue partitions and Dict entries expire on it); its time."""

        async def move() -> float:
            self.servicer.store.clock.advance(seconds)
            return self.servicer.store.clock.now()

        return self.call(move())

    def volume_view(self, task_id: str, name: str = "cellfeed-checkpoints") -> Path | None:
        """A container's own view of the Volume named `name` (V2: what it wrote, committed or not), or
        None if it does not mount it."""

        async def view() -> Path | None:
            s = self.servicer
            volume_id = s.volume_names.get(("main", name))
            c = s.containers.by_task.get(task_id)
            entry = c.volumes.get(volume_id) if c is not None and volume_id else None
            return entry[0] if entry else None

        return self.call(view())

    def history(self, function: str | None = None) -> list[dict]:
        """Each call of `function` (or all), oldest first, with what `describe` lacks: {id, function,
        status, error, gpu ("H100:1"), cpu, memory (MiB), timeout_s, cluster_size, attempts: [{outcome
        (preempted, failure, timeout, cancelled, success, or running), cluster_ips (by rank; [] when not
        clustered), containers: [{task, pid, rank, exit_code, killed, interrupted_processes}]}]}."""
        return self.call(self.servicer.history(function))

    # ---- network faults (faults.py; README "Faults")

    def fault(self, kind: str, target: str, **rule) -> int:
        """A network fault, fired on events: `kind` grpc_burst | lost_reply | latency, `target` queue |
        dict | spawn | call | volume; `after` (matching requests let through first), `calls`, `status`
        (a burst's), `partition` (queue), `op`, `function` (spawn, call), `delay_s` (latency). Its index."""
        return self.network.add(kind, target, **rule)

    def faults(self) -> list[dict]:
        """Each rule as added, with what it did: seen, hits, items_lost, done, keys_hit, retries_seen,
        recovered, calls_made, events."""
        return self.network.describe()

    def call(self, coro, timeout: float = STOP_TIMEOUT_S):
        """Run `coro` on the plane's loop and wait for its result (tests inspect state through this)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> None:
        await self.servicer.start()
        self._server = Server([FaultLayer(self.servicer, self.network)])  # (no rule: every request as it is)
        if self.transport == "unix":
            # AF_UNIX paths are limited to ~107 bytes: a short directory of our own, not `root`
            self._sock_dir = tempfile.mkdtemp(prefix="mcp-")
            path = os.path.join(self._sock_dir, "modal.sock")
            await self._server.start(path=path)
            self.url = f"unix://{path}"
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            await self._server.start(sock=sock)
            self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.servicer.url = self.url  # what its containers are given

    async def _stop(self) -> None:
        await self.servicer.shutdown()
        if self._server is not None:
            self._server.close()
            await asyncio.wait_for(self._server.wait_closed(), STOP_TIMEOUT_S)
        # what is left (a client's request still being served, a log pump) ends here, not with the loop
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        if others:
            await asyncio.wait(others, timeout=STOP_TIMEOUT_S)

    def start(self) -> "ControlPlane":
        self._thread.start()
        self.call(self._start(), START_TIMEOUT_S)
        for name, folder in self.lasting_volumes.items():  # V9: what earlier runs committed
            if folder.is_dir():
                shutil.copytree(
                    folder, self.volume_folder(name), dirs_exist_ok=True, ignore=shutil.ignore_patterns(".*.tmp")
                )
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self.call(self._stop(), STOP_TIMEOUT_S + 5)
            for name, folder in self.lasting_volumes.items():  # V9: for the next runs (once, whole)
                committed = self.servicer.volume_names.get(("main", name))
                if committed is not None:
                    publish_once(self.servicer.volumes[committed].committed, folder)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STOP_TIMEOUT_S)
            if self.transport == "unix":
                shutil.rmtree(self._sock_dir, ignore_errors=True)
            if self._tmp is not None:
                self._tmp.cleanup()

    def __enter__(self) -> "ControlPlane":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
