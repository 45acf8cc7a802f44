"""Sockets on this machine: a free port for local servers, DDP rendezvous and test servers."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
