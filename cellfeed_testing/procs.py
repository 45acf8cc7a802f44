"""A test's own processes, from /proc (Linux): what a campaign it started started in turn, and a
gate that holds that campaign's trainer ranks still while the test acts on it.

Nothing here looks machine-wide: every pid is found by walking down from a process the caller
started (`children` reads each of its threads' /proc/PID/task/TID/children).

    with ranks_held(proc.pid) as ranks:   # SIGSTOP every rank under the campaign
        ... ask for a stop ...
        wait_for(lambda: all(pending(r, STOP_SIGNAL) for r in ranks), ...)
    # SIGCONT on leaving: the ranks wake with the stop already theirs (`stop_asked_while_held`)

Held, a campaign cannot end; so a test that asks a stop of held ranks, and lets them go only once
the stop signal is pending in each of them, knows the stop lands before the campaign's end,
however fast the machine (an event, not a race against the campaign's speed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def own_rank_server(env=os.environ) -> dict:
    """`env` without the shared rank server (`trainer.launch.RANK_SERVER_ENV`): a campaign started
    with it forks its ranks below its own process, where `children`, `trainer_ranks` and
    `ranks_held` look (a shared server's ranks are its children, not the campaign's)."""
    from trainer.launch import RANK_SERVER_ENV

    return {k: v for k, v in env.items() if k != RANK_SERVER_ENV}


def children(pid: int) -> list[tuple[int, list[str]]]:
    """The processes `pid` started that are still there, with their command lines. A child's pid
    stays its own until `pid` reaps it."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids = [int(c) for c in task.read_text().split()]
        except OSError:  # the thread ended
            continue
        out += [(child, cmdline(child)) for child in pids]
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """Every process below `pid`."""
    out, todo = [], [child for child, _ in children(pid)]
    while todo:
        out.append(todo.pop())
        todo += [child for child, _ in children(out[-1])]
    return out


def trainer_ranks(pid: int) -> list[int]:
    """The trainer ranks below `pid`: the children of its rank server (`python -m trainer.launch`,
    which forks them: they keep its command line)."""
    servers = [p for p in descendants(pid) if cmdline(p)[1:3] == ["-m", "trainer.launch"]]
    return [child for server in servers for child, _ in children(server)]


def pending(pid: int, sig: int) -> bool:
    """Whether `sig` is pending for the process (sent, not yet delivered: e.g. while it is stopped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (sig - 1) & 1 for mask in masks)


def state(pid: int) -> str | None:
    """The process's state letter (R, S, T stopped, Z ...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@contextlib.contextmanager
def ranks_held(pid: int, expect: int | None = None):
    """SIGSTOP every trainer rank below `pid` (`expect`: how many there must be), yield their pids,
    SIGCONT them on leaving, whatever happened inside."""
    # /proc's children lists are read while the tree may change (a process of the container starting or
    # ending beside the ranks): the kernel can then skip an entry, so a count short of `expect` is looked
    # at again for a while before it is taken as the campaign's
    deadline = time.monotonic() + 10
    ranks = trainer_ranks(pid)
    while expect is not None and len(ranks) != expect and time.monotonic() < deadline:
        time.sleep(0.05)
        ranks = trainer_ranks(pid)
    if not ranks or (expect is not None and len(ranks) != expect):
        raise AssertionError(f"found trainer ranks {ranks} below process {pid}, expected {expect or 'some'}")
    try:
        for rank in ranks:
            os.kill(rank, signal.SIGSTOP)
        for rank in ranks:  # stopped (state T) before the caller acts
            deadline = time.monotonic() + 30
            while state(rank) not in ("T", "t", None):
                if time.monotonic() > deadline:
                    raise AssertionError(f"trainer rank {rank} was not stopped 30 s after SIGSTOP")
                time.sleep(0.01)
        yield ranks
    finally:
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, signal.SIGCONT)


def stop_asked_while_held(pid: int, expect: int, ask, wait_for, during=None, sig: int | None = None):
    """`ask()` (e.g. start `cellfeed stop`) while the trainer ranks below `pid` are held, after
    `during()` (what the test reads while they are held); the ranks are let go once the stop signal
    (`sig`: the trainer's own unless told, e.g. a preemption's SIGINT) is pending in each. Returns
    (`during()`'s value, `ask()`'s). `wait_for(condition, what, timeout)`: the test's own poll."""
    from trainer.config import STOP_SIGNAL

    sig = sig or STOP_SIGNAL
    with ranks_held(pid, expect) as ranks:
        seen = during() if during is not None else None
        asked = ask()
        wait_for(lambda: all(pending(r, sig) for r in ranks), f"signal {sig} in every rank", timeout=120)
    return seen, asked
