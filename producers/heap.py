"""One heap, freed memory kept: how a process that converts allocates (Linux/glibc; elsewhere nothing).

A conversion's slice allocates and frees the same ~100 MB chunk of arrays, chunk after chunk. By
default each is a fresh mmap whose pages the kernel zeroes again (page faults: a third of a worker's
CPU, measured as system time). And the chunks are made on Lance's reader thread: a thread with an
arena of its own (heaps of 64 MiB) maps anything larger afresh, whatever the threshold. Measured on
300k cells with two workers: ~2 CPU-s more page zeroing, and each worker at 2.5x the peak memory.

Importing this module makes large arrays come from the heap, keeps freed heap, and lets threads
started from then on share the main heap. It only holds for threads started after it, and importing
Lance starts one, so it is imported before Lance: first in the workers' forkserver
(`producers.CONVERT_WORKER_MODULES`), and first in the modules that convert (`producers/slices.py`,
`producers/convert.py`: a one-worker conversion runs its slices in the caller's process). A process
whose threads already run when it is imported keeps the arenas they made: a Modal container, where
modal's client starts first, gets `MALLOC_ARENA_MAX=1` from its image's ENV instead
(`app/modal_app.py:convert_image`; glibc reads it at process start). A process's memory stays at its
largest chunk's, which bounds it anyway.
"""

from __future__ import annotations

from coordination.net import M_ARENA_MAX, keep_freed_memory, mallopt


def _tune() -> None:
    keep_freed_memory(1 << 30)  # a chunk's arrays (~100 MB) from the heap; freed heap kept
    mallopt(M_ARENA_MAX, 1)  # threads started from now on share the main heap


_tune()  # on import, once a process (see the docstring)
