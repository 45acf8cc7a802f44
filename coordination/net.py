"""Processes and sockets on this machine: a free port for local servers, DDP rendezvous and test
servers; a child that dies with the process that started it."""

from __future__ import annotations

import signal
import socket
import sys


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """(in a child, Linux) Be SIGKILLed when the parent dies (`PR_SET_PDEATHSIG`), so a parent
    killed outright leaves nothing behind. The caller checks `os.getppid()` afterwards if the
    parent may already have died."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
