"""The launcher's hold on its ranks (`trainer/launch.py` starts them): wait for them all, stopping
the rest when one fails; ask them to checkpoint and stop; kill what does not, and reap it within
a bound."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from trainer.config import STOP_SIGNAL

if TYPE_CHECKING:
    from trainer.launch import Rank


KILL_WAIT_S = 30.0  # a SIGKILLed rank's exit is reported by now, unless it is stuck in the kernel (a hung driver call)


def reap(p: Rank, deadline: float | None = None) -> int:
    """A killed rank's exit code, waited on until `deadline` (default KILL_WAIT_S from now; one deadline for
    all of a launcher's ranks, not KILL_WAIT_S each): a rank stuck in the kernel is said on stderr and
    counted as killed (-SIGKILL), so a preemption's save window is not spent waiting for it."""
    deadline = time.monotonic() + KILL_WAIT_S if deadline is None else deadline
    try:
        return p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"rank pid {p.pid}: killed, its exit not reported in {KILL_WAIT_S:.0f} s; going on", file=sys.stderr)
        return -int(signal.SIGKILL)


def wait_all(procs: list[Rank], timeout: float) -> list[int]:
    """Exit codes; if one rank fails the others are stopped (DDP would hang waiting for it)."""
    deadline = time.monotonic() + timeout
    codes = [None] * len(procs)
    while None in codes:
        for i, p in enumerate(procs):
            if codes[i] is None:
                codes[i] = p.poll()
        if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            until = time.monotonic() + KILL_WAIT_S
            codes = [reap(p, until) for p in procs]
            break
        time.sleep(0.1)
    return codes


def ask_to_stop(procs: list[Rank]) -> None:
    """Ask every running rank to checkpoint after its current step and exit (`trainer.config.STOP_SIGNAL`)."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(STOP_SIGNAL)
            except ProcessLookupError:
                pass


def checkpoint_and_stop(procs: list[Rank], timeout: float) -> list[int | None]:
    """`ask_to_stop`, wait up to `timeout` seconds, then kill what is left. Exit codes (None: it
    had to be killed)."""
    ask_to_stop(procs)
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
    until = time.monotonic() + KILL_WAIT_S
    for p in procs:
        if p.poll() is None:
            reap(p, until)
    return codes
