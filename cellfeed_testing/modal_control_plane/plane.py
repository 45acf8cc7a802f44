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
import socket
import tempfile
import threading
from pathlib import Path

from grpclib.server import Server

from cellfeed_testing.modal_control_plane.server import Servicer

TOKEN_ID, TOKEN_SECRET = "ak-cellfeed-control-plane", "as-cellfeed-control-plane"
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
    ) -> None:
        """`secrets`: the named Secrets that exist ({name: {VAR: value}}). `mount_env`: for a Volume
        mount path, a variable its containers get naming the folder standing for it (volumes.py, V5)."""
        if transport not in ("tcp", "unix"):
            raise ValueError(f"transport is 'tcp' or 'unix', not {transport!r}")
        self._tmp = None if root is not None else tempfile.TemporaryDirectory(prefix="modal-control-plane-")
        self.root = Path(root if root is not None else self._tmp.name)
        self.root.mkdir(parents=True, exist_ok=True)
        self.transport = transport
        self.servicer = Servicer(self.root, secrets=secrets, mount_env=mount_env)
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

    def preempt(self, call_id: str, grace_s: float = 30.0) -> list[str]:
        """Preempt the containers running `call_id` (calls.py, C17); their task ids."""
        return self.call(self.servicer.preempt(call_id, grace_s), grace_s + STOP_TIMEOUT_S + 5)

    def call(self, coro, timeout: float = STOP_TIMEOUT_S):
        """Run `coro` on the plane's loop and wait for its result (tests inspect state through this)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> None:
        await self.servicer.start()
        self._server = Server([self.servicer])
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
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self.call(self._stop(), STOP_TIMEOUT_S + 5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STOP_TIMEOUT_S)
            if self.transport == "unix":
                import shutil

                shutil.rmtree(self._sock_dir, ignore_errors=True)
            if self._tmp is not None:
                self._tmp.cleanup()

    def __enter__(self) -> "ControlPlane":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
