"""One heap, freed memory kept: how a process that converts allocates (Linux/glibc; elsewhere nothing).

A conversion's slice allocates and frees the same ~100 MB chunk of arrays, chunk after chunk. By
default each is a fresh mmap whose pages the kernel zeroes again (page faults: a third of a worker's
CPU, measured as system time). And the chunks are made on Lance's reader thread: a thread with an
arena of its own (heaps of 64 MiB) maps anything larger afresh, whatever the threshold. Measured on
300k cells with two workers: ~2 CPU-s more page zeroing and twice the peak memory per worker.

`keep_freed_memory()` makes large arrays come from the heap, keeps freed heap, and lets threads
started from then on share the main heap. It must run before the process starts threads, so the
conversion's workers get it from their forkserver, which imports this module first
(`producers.CONVERT_WORKER_MODULES`); importing it tunes the process. A process's memory stays at its
largest chunk's, which bounds it anyway.
"""

from __future__ import annotations

import sys

_TUNED = False


def keep_freed_memory() -> None:
    """(once a process) Tune glibc's malloc as the module docstring says."""
    global _TUNED
    if _TUNED or not sys.platform.startswith("linux"):
        return
    _TUNED = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: allocations up to 1 GiB from the heap
        libc.mallopt(-1, 1 << 31)  # M_TRIM_THRESHOLD: keep up to 2 GiB of freed heap
        libc.mallopt(-8, 1)  # M_ARENA_MAX: threads started from now on share the main heap
    except (OSError, AttributeError):  # another libc: its defaults
        pass


keep_freed_memory()  # on import: the forkserver's first preload (see the docstring)
