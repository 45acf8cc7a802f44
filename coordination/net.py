"""Processes and sockets on this machine: a free port for local servers, DDP rendezvous and test
servers; a child that dies with the process that started it; a long-lived process's set-up kept
out of the cyclic GC, and its freed memory kept for reuse."""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import threading

PARENT_GONE_EXIT = 3  # a child that ended because its parent had


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on `host` (an IPv4 or IPv6 address: a Modal cluster's containers have IPv6 ones),
    below the kernel's ephemeral range. The port is free now and bound later by its server; a port
    the kernel handed out (`bind(0)`) could meanwhile be given to any process's outgoing connection,
    and DDP's rendezvous then failed with EADDRINUSE (two Modal test campaigns at once did)."""
    import random

    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # (Linux's default)
    for port in random.sample(range(low // 2, low), 64) if low > 2048 else ():
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    with socket.socket(family) as s:  # (no range below the ephemeral one: the kernel's choice)
        s.bind((host, 0))
        return s.getsockname()[1]


def forkserver(preload: list[str] | tuple[str, ...]):
    """A multiprocessing context whose workers fork from a clean process (no threads, no open files)
    that imported `preload` once; started now (idempotent), so its imports run beside the caller's."""
    import multiprocessing
    import multiprocessing.forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    multiprocessing.forkserver.ensure_running()
    return ctx


def die_with_parent() -> None:
    """(in a child, Linux) Be SIGKILLed when the parent dies (`PR_SET_PDEATHSIG`), so a parent
    killed outright leaves nothing behind. The caller checks `os.getppid()` afterwards if the
    parent may already have died."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def exit_when_parent_goes() -> None:
    """(in a child started with `stdin=subprocess.PIPE`) End this process at once when the pipe's
    other end closes: the parent exited, however it ended (SIGKILL included). Works from any
    thread of the parent and on any platform, unlike `die_with_parent`."""

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(1 << 16):
                pass
        except (OSError, ValueError):
            pass
        os._exit(PARENT_GONE_EXIT)

    threading.Thread(target=watch, daemon=True, name="cellfeed-parent-watch").start()


def freeze_setup() -> None:
    """Called by a producer process once it is set up (its modules imported, its `Producer` made), before
    `run`: what exists by then lives as long as the producer, so it leaves the cyclic GC, whose every full
    collection walked it again (Lance's, numba's, pyarrow's and Polars' modules; a Modal container's freeze
    at import comes before them). Timed with `gc.callbacks` over scGPT-1024 block units in the benchmark's
    process (`benchmarks/producer.py` freezes as here): collections took 0.84 ms per 1,000 cells, 0.06 ms
    frozen, of a producer's ~28 ms. Garbage made later is collected as ever; garbage made before is
    collected first. A cycle it holds now is never collected: a process that goes on to other work (a Modal
    container given another input) calls `gc.unfreeze()` when its producer is done."""
    gc.collect()
    gc.freeze()


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's <malloc.h>


def one_blas_thread() -> None:
    """(in a process, before anything imports NumPy) NumPy's OpenBLAS starts a thread per core as NumPy
    loads, and each spins for ~0.1 CPU-s doing nothing (measured here: 0.10 CPU-s on its one extra thread,
    beside NumPy's own 0.07); a conversion's three processes paid it three times. No cellfeed process
    multiplies matrices with NumPy (the trainer's are torch's), so OpenBLAS gets one thread; the
    process's children inherit it. A value already set wins."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def keep_freed_memory(largest: int = 64 << 20) -> None:
    """(Linux, glibc; elsewhere nothing) From now on, allocations up to `largest` bytes come from the heap (a
    thread's own arena still maps those past half its 64 MiB), and up to 2 GiB of freed heap is kept. A
    process that allocates and frees arrays of a few MB, over and over (a producer's chunks and units; a
    conversion's chunks, ~100 MB: it passes 1 GiB), otherwise gets each from a fresh mmap or a heap just
    trimmed, and the kernel zeroes its pages again. A producer's cells per CPU-second rose 1.03-1.06x
    (scGPT-1024 block, median of 6 runs, three pairs of processes: `benchmarks/README.md`, "One producer").
    Its memory stays at its peak; an allocation past `largest` (a 100M-cell dataset's cell index) is still
    mapped apart and given back when freed."""
    mallopt(M_MMAP_THRESHOLD, largest)  # allocations up to `largest` from the heap
    mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)  # keep up to 2 GiB of freed heap


def mallopt(param: int, value: int) -> None:
    """glibc's `mallopt(param, value)` for this process, from now on (Linux, glibc; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt(param, value)
    except (OSError, AttributeError):  # another libc: its defaults
        pass
