"""Start one training process per rank on this machine (what torchrun does, minus elasticity):
real processes, so a test can SIGKILL them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from trainer.config import STOP_SIGNAL, TrainConfig
from coordination.net import free_port


def launch(cfg: TrainConfig, world_size: int, workdir: str | os.PathLike, summary_path: str | None = None,
           env: dict | None = None, log_ranks: bool = False) -> list[subprocess.Popen]:
    """Popen one `python -m trainer.train` per rank; the caller waits (or kills). With
    `log_ranks`, ranks other than 0 write their output to WORKDIR/rank<r>.log."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "train_config.json"
    config_path.write_text(json.dumps(asdict(cfg)))
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = dict(os.environ, **(env or {}), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "trainer.train", "--config", str(config_path)]
        if summary_path:
            cmd += ["--summary", str(summary_path)]
        out = open(workdir / f"rank{rank}.log", "w") if (log_ranks and rank > 0) else None
        # in a session of their own: a terminal's Ctrl-C reaches the launcher, which stops them (no orphans,
        # no tracebacks from every rank)
        # STOP_SIGNAL is held (blocked) in the child from its start until its handler is set: a stop
        # asked while it still imports torch waits, instead of killing it (a child inherits the
        # starting thread's signal mask; no preexec_fn, which would fork a process holding Lance)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {STOP_SIGNAL})
        try:
            procs.append(subprocess.Popen(cmd, env=rank_env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                          start_new_session=True))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit codes; if one rank fails the others are stopped (DDP would hang waiting for it)."""
    import time

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
            codes = [p.wait() for p in procs]
            break
        time.sleep(0.1)
    return codes


def ask_to_stop(procs: list[subprocess.Popen]) -> None:
    """Ask every running rank to checkpoint after its current step and exit (`trainer.config.STOP_SIGNAL`)."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(STOP_SIGNAL)
            except ProcessLookupError:
                pass


def checkpoint_and_stop(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """`ask_to_stop`, wait up to `timeout` seconds, then kill what is left. Exit codes (None: it
    had to be killed)."""
    import time

    ask_to_stop(procs)
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return codes
