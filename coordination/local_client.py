"""The `local` backend's clients: `LocalQueue` and `LocalMap` reach the queue server
(`coordination.local_backend`, which also defines the frames) over TCP, one connection per thread,
each wait bounded, the run's token sent first."""

from __future__ import annotations

import socket
import threading

from coordination.errors import CellfeedError
from coordination.local_backend import (
    CONNECT_TIMEOUT_S,
    EMPTY,
    FULL,
    GONE,
    MISSING,
    OK,
    REPLY_MARGIN_S,
    REQUEST_TOO_LARGE,
    TOO_LARGE,
    Op,
    decode_value,
    encode_value,
    recv_frame,
    send_frame,
)
from coordination.queues import Empty, Full, ItemTooLarge, MapGone, RequestTooLarge


class _Client:
    """One connection per thread to the server; every wait is bounded."""

    def __init__(self, address: str, token: str | None = None):
        self.address, self.token = address, token
        host, port = address.rsplit(":", 1)
        self._target = (host, int(port))
        self._local = threading.local()

    def _sock(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            try:
                sock = socket.create_connection(self._target, timeout=CONNECT_TIMEOUT_S)
            except OSError:
                raise CellfeedError(
                    f"the local queue server at {self.address} is unreachable (has the campaign stopped?)"
                ) from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.token is not None:
                sock.settimeout(CONNECT_TIMEOUT_S)
                try:
                    send_frame(sock, Op.AUTH, {"token": self.token})
                    code, reply, _ = recv_frame(sock)
                except (OSError, ConnectionError):
                    sock.close()
                    raise CellfeedError(f"the local queue server at {self.address} closed the connection") from None
                if code != OK:
                    sock.close()
                    raise CellfeedError(f"the local queue server at {self.address}: {reply.get('message')}")
            self._local.sock = sock
        return sock

    def call(self, op: Op, header: dict, values: list[bytes] = (), wait_s: float | None = 0.0):
        sock = self._sock()
        sock.settimeout(None if wait_s is None else wait_s + REPLY_MARGIN_S)
        try:
            send_frame(sock, op, header, values)
            code, reply, out = recv_frame(sock)
        except (OSError, ConnectionError):
            self._local.sock = None
            sock.close()
            raise CellfeedError(f"lost the local queue server at {self.address} (has the campaign stopped?)") from None
        if code == OK:
            return reply, out
        if code == FULL:
            raise Full(reply.get("message", "partition full"))
        if code == EMPTY:
            raise Empty()
        if code == TOO_LARGE:
            raise ItemTooLarge(reply["message"])
        if code == REQUEST_TOO_LARGE:
            raise RequestTooLarge(reply["message"])
        if code == MISSING:
            raise KeyError(header.get("key"))
        if code == GONE:
            raise MapGone(reply["message"])
        raise CellfeedError(f"local queue server error: {reply.get('message')}")


class LocalQueue:
    """`Queue` over the local server."""

    def __init__(self, address: str, token: str | None = None):
        self.client = _Client(address, token)

    def put_many(self, values, block=True, timeout=None, *, partition=None) -> None:
        values = list(values)
        for v in values:
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise TypeError(f"queue items are bytes (no pickle on the data path), got {type(v).__name__}")
        self.client.call(
            Op.PUT_MANY,
            {"block": block, "timeout": timeout, "partition": partition},
            values,
            wait_s=timeout if block else 0.0,
        )

    def put(self, value, block=True, timeout=None, *, partition=None) -> None:
        self.put_many([value], block, timeout, partition=partition)

    def get_many(self, n_values, block=True, timeout=None, *, partition=None) -> list[bytes]:
        header = {"n": n_values, "block": block, "timeout": timeout, "partition": partition}
        return self.client.call(Op.GET_MANY, header, wait_s=timeout if block else 0.0)[1]

    def get(self, block=True, timeout=None, *, partition=None):
        values = self.get_many(1, block, timeout, partition=partition)
        return values[0] if values else None

    def len(self, *, partition=None, total=False) -> int:
        return self.client.call(Op.LEN, {"partition": partition, "total": total})[0]["len"]


class LocalMap:
    """`Map` over the local server (`name`: one of its named maps, None: the run's map)."""

    def __init__(self, address: str, name: str | None = None, client: _Client | None = None, token: str | None = None):
        self.client = client or _Client(address, token)
        self.name = name

    def _call(self, op: Op, header: dict, values: list[bytes] = ()):
        return self.client.call(op, {**header, "map": self.name}, values)

    def put(self, key, value, *, skip_if_exists=False) -> bool:
        header = {"key": key, "skip_if_exists": skip_if_exists}
        return self._call(Op.MAP_PUT, header, [encode_value(value)])[0]["stored"]

    def get(self, key, default=None):
        reply, values = self._call(Op.MAP_GET, {"key": key})
        return decode_value(values[0]) if reply["found"] else default

    def pop(self, key, *default):
        try:
            return decode_value(self._call(Op.MAP_POP, {"key": key})[1][0])
        except KeyError:
            if default:
                return default[0]
            raise

    def __contains__(self, key) -> bool:
        return self.get(key) is not None

    def keys(self) -> list[str]:
        return self._call(Op.MAP_KEYS, {})[0]["keys"]

    def __len__(self) -> int:
        return len(self.keys())

    def named(self, name: str, create: bool = False) -> "LocalMap":
        if create:
            self.client.call(Op.CREATE_MAP, {"map": name})
        return LocalMap(self.client.address, name, self.client)

    def drop(self, name: str) -> None:
        self.client.call(Op.DROP_MAP, {"map": name})
