"""The `local` backend: the queue and map of one machine, shared by processes through a small
TCP server built on the standard library.

Why this and not a broker: the server holds the very `MemoryQueue`/`MemoryMap` the tests use,
so local runs get exactly the semantics (blocking, timeouts, Modal's limits, put-if-absent)
that tests check, with nothing to install. Frames are bytes — no pickle anywhere:

    request   u32 length | u8 op | u32 header length | JSON header | values
    response  u32 length | u8 status | u32 header length | JSON header | values
    values    u32 count, then per value: u32 length | bytes

Map values are bytes, str or int (what cellfeed stores), tagged b"b", b"s" or b"i".

The server answers only the run's own processes: it makes a random token and writes it to a file
only its owner can read (`ServerProcess`: in the run's folder); each connection's first frame
must carry it (`Op.AUTH`), else the connection is refused with one line and closed. A process is
given the file's path, never the token (`BackendSpec.token_file`): nothing secret reaches a
config, a log or an error.
"""

from __future__ import annotations

import argparse
import enum
import hmac
import json
import os
import secrets
import select
import shutil
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from coordination.errors import CellfeedError
from coordination.queues import Empty, Full, ItemTooLarge, MapGone, MemoryMap, MemoryQueue, RequestTooLarge


class Op(enum.IntEnum):
    """A request's op: its frame's first byte (the numbers are the wire format)."""

    PUT_MANY = 1  # the queue
    GET_MANY = 2
    LEN = 3
    MAP_PUT = 4  # a map: the run's, or the named map the header's "map" names
    MAP_GET = 5
    MAP_POP = 6
    MAP_KEYS = 7
    PING = 8
    CREATE_MAP = 9  # the named map the header's "map" names
    DROP_MAP = 10
    AUTH = 11  # a connection's first request when the server has a token: {"token": ...}


OK, FULL, EMPTY, TOO_LARGE, MISSING, ERROR, GONE, REQUEST_TOO_LARGE = range(8)  # a response's status
MAX_AUTH_FRAME = 4096  # the hello's size at most (read before the caller is known)
START_TIMEOUT_S = 60.0  # the server says where it listens by now (it starts in well under a second)
REFUSED = (
    "refused: this queue server answers only its run's processes, which read its token from the "
    "run's folder (is this the right run, or its folder another user's?)"
)
_U32 = struct.Struct("<I")
CONNECT_TIMEOUT_S = 10.0
REPLY_MARGIN_S = 30.0  # how much longer than the server-side wait a client waits for the reply


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def send_frame(sock: socket.socket, code: int, header: dict, values: list[bytes] = ()) -> None:
    head = json.dumps(header).encode()
    parts = [bytes([code]), _U32.pack(len(head)), head, _U32.pack(len(values))]
    for v in values:
        parts += [_U32.pack(len(v)), bytes(v)]
    body = b"".join(parts)
    sock.sendall(_U32.pack(len(body)) + body)


def recv_frame(sock: socket.socket) -> tuple[int, dict, list[bytes]]:
    return _parse_frame(_recv_exact(sock, _U32.unpack(_recv_exact(sock, 4))[0]))


def _parse_frame(data: bytes) -> tuple[int, dict, list[bytes]]:
    body = memoryview(data)
    code, (head_len,) = body[0], _U32.unpack_from(body, 1)
    header = json.loads(bytes(body[5 : 5 + head_len]))
    pos = 5 + head_len
    (count,) = _U32.unpack_from(body, pos)
    pos += 4
    values = []
    for _ in range(count):
        (n,) = _U32.unpack_from(body, pos)
        values.append(bytes(body[pos + 4 : pos + 4 + n]))
        pos += 4 + n
    return code, header, values


def encode_value(value) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return b"b" + bytes(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"map values are bytes, str or int, got {type(value).__name__}")
    return (b"s" + value.encode()) if isinstance(value, str) else (b"i" + str(value).encode())


def decode_value(data: bytes):
    tag, rest = data[:1], data[1:]
    return rest if tag == b"b" else rest.decode() if tag == b"s" else int(rest)


# ----------------------------------------------------------------------------------------- server


def serve_frames(sock: socket.socket, answer) -> None:
    """Answer request frames on one connection until it closes: `answer(op, header, values)`
    returns the reply's (code, header, values); an error it raises is code ERROR."""
    while True:
        try:
            op, h, values = recv_frame(sock)
        except (ConnectionError, OSError):
            return
        try:
            code, header, out = answer(op, h, values)
        except Exception as exc:  # noqa: BLE001 - sent back to the caller
            code, header, out = ERROR, {"message": f"{type(exc).__name__}: {exc}"}, []
        try:
            send_frame(sock, code, header, out)
        except OSError:
            return


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        token = self.server.token
        if token is not None:  # the first frame proves the caller is one of the run's processes
            try:
                self.request.settimeout(CONNECT_TIMEOUT_S)  # (a caller that sends nothing holds no thread long)
                (size,) = _U32.unpack(_recv_exact(self.request, 4))
                if size > MAX_AUTH_FRAME:
                    return
                op, h, _ = _parse_frame(_recv_exact(self.request, size))
                self.request.settimeout(None)
            except Exception:  # noqa: BLE001 - anything else than the run's hello: the connection is closed
                return
            if op != Op.AUTH or not hmac.compare_digest(str(h.get("token", "")).encode(), token.encode()):
                try:
                    send_frame(self.request, ERROR, {"message": REFUSED})
                except OSError:
                    pass
                return
            send_frame(self.request, OK, {})
        serve_frames(self.request, self.answer)

    def answer(self, op: int, h: dict, values: list[bytes]):
        try:
            return self._dispatch(op, h, values, self.server.queue, self.server.store)
        except Full as exc:
            return FULL, {"message": str(exc)}, []
        except Empty:
            return EMPTY, {}, []
        except ItemTooLarge as exc:
            return TOO_LARGE, {"message": str(exc)}, []
        except RequestTooLarge as exc:
            return REQUEST_TOO_LARGE, {"message": str(exc)}, []
        except KeyError:
            return MISSING, {}, []
        except MapGone as exc:
            return GONE, {"message": str(exc)}, []

    @staticmethod
    def _dispatch(op, h, values, queue, store):
        if h.get("map") is not None:  # a named map: the MAP_ ops act on it, CREATE_MAP and DROP_MAP make and drop it
            if op == Op.CREATE_MAP:
                store.named(h["map"], create=True)
                return OK, {}, []
            if op == Op.DROP_MAP:
                store.drop(h["map"])
                return OK, {}, []
            store = store.named(h["map"])
        if op == Op.PUT_MANY:
            queue.put_many(values, h["block"], h["timeout"], partition=h["partition"])
            return OK, {}, []
        if op == Op.GET_MANY:
            return OK, {}, queue.get_many(h["n"], h["block"], h["timeout"], partition=h["partition"])
        if op == Op.LEN:
            return OK, {"len": queue.len(partition=h["partition"], total=h["total"])}, []
        if op == Op.MAP_PUT:
            return OK, {"stored": store.put(h["key"], decode_value(values[0]), skip_if_exists=h["skip_if_exists"])}, []
        if op == Op.MAP_GET:
            value = store.get(h["key"])
            return OK, {"found": value is not None}, [] if value is None else [encode_value(value)]
        if op == Op.MAP_POP:
            return OK, {}, [encode_value(store.pop(h["key"]))]
        if op == Op.MAP_KEYS:
            return OK, {"keys": store.keys()}, []
        if op == Op.PING:
            return OK, {"pong": True}, []
        raise ValueError(f"unknown op {op}")


class LocalServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        super().__init__((host, port), _Handler)
        self.queue, self.store = MemoryQueue(), MemoryMap()
        self.token = token  # None: any caller (a server inside one test process)

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def start_in_thread(self) -> "LocalServer":
        threading.Thread(target=self.serve_forever, daemon=True, name="cellfeed-local-server").start()
        return self


class ServerProcess:
    """The server in its own process (what the local campaign uses); stopped on `close`. It makes
    a token and writes it to `token_file` (created anew, readable by its owner only; by default in
    a private temporary folder); `where` is what a `BackendSpec` needs to reach it. It ends with
    this process, however this process ends: it watches the pipe on its stdin."""

    command = (sys.executable, "-m", "coordination.local_backend")

    def __init__(self, token_file: str | os.PathLike | None = None):
        self._own_folder = None
        if token_file is None:
            self._own_folder = tempfile.mkdtemp(prefix="cellfeed-server-")  # (mode 0700)
            token_file = Path(self._own_folder) / "token"
        self.token_file = str(Path(token_file).resolve())
        Path(self.token_file).unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [*self.command, "--token-file", self.token_file],
            start_new_session=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        # its first line says where it listens; a server alive but stuck before it is not waited on forever
        said, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline().strip() if said else ""
        if not line.startswith("listening "):
            self.proc.kill()
            self.proc.wait(timeout=10)
            if self._own_folder:
                shutil.rmtree(self._own_folder, ignore_errors=True)
            why = f"it said {line!r}" if line else "it exited" if said else f"nothing said in {START_TIMEOUT_S:g} s"
            raise CellfeedError(f"the local queue server did not start ({why})")
        self.address = line.split()[1]

    @property
    def token(self) -> str:
        """The token, for a client in this process (`LocalQueue(server.address, server.token)`)."""
        return read_token(self.token_file)

    @property
    def where(self) -> dict:
        """The `BackendSpec` fields that reach this server."""
        return {"address": self.address, "token_file": self.token_file}

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        Path(self.token_file).unlink(missing_ok=True)
        if self._own_folder is not None:
            shutil.rmtree(self._own_folder, ignore_errors=True)


def write_token(path: str) -> str:
    """A new random token in a new file only its owner can read (refusing a file that exists)."""
    token = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def read_token(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise CellfeedError(
            f"cannot read the queue server's token {path} ({exc.strerror}): is the campaign running, and this its user?"
        ) from None


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the local cellfeed queue/map server.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--token-file",
        help="write a new token here (owner-only) and answer only callers "
        "that send it; with it, the server ends when its stdin closes",
    )
    args = parser.parse_args()
    token = None
    if args.token_file:
        from coordination.net import exit_when_parent_goes

        token = write_token(args.token_file)
        exit_when_parent_goes()
    server = LocalServer(args.host, args.port, token)
    print(f"listening {server.address}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
