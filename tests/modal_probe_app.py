"""A tiny Modal app the emulator tests spawn (tests/test_modal_emulator.py)."""

import time

import modal

app = modal.App("cellfeed-probe")


@app.function(retries=3, timeout=600)
def adds(a: int, b: int) -> int:
    if a < 0:
        raise ValueError("no negatives")
    return a + b


@app.function(timeout=600)
def sleeps(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@app.function(timeout=600)
def counts_attempts(path: str) -> int:
    """Notes each start and each interrupt (a preemption's SIGINT) in `path`; returns the starts."""
    with open(path, "a") as f:
        f.write("start\n")
    try:
        if "interrupted" not in open(path).read():  # the first attempt waits to be preempted
            time.sleep(60)
    except KeyboardInterrupt:
        with open(path, "a") as f:
            f.write("interrupted\n")
        raise
    return sum(1 for line in open(path) if line.strip() == "start")
