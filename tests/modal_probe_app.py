"""A tiny Modal app the emulator tests spawn (tests/test_modal_emulator.py). Its functions run
under `probe_image`, which adds only this package (S20): the standard library, modal and `tests`."""

import importlib
import time

import modal

app = modal.App("cellfeed-probe")
probe_image = modal.Image.debian_slim(python_version="3.11").add_local_python_source("tests")
# (a build step after add_local_python_source is refused by modal, _image.py:677: the packages first)
numpy_image = modal.Image.debian_slim(python_version="3.11").pip_install("numpy>=1.26").add_local_python_source("tests")


@app.function(image=probe_image, retries=3, timeout=600)
def adds(a: int, b: int) -> int:
    if a < 0:
        raise ValueError("no negatives")
    return a + b


@app.function(image=probe_image, timeout=600)
def sleeps(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@app.function(image=probe_image, timeout=600)
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


def _import(names: list[str]) -> list[str]:
    """Imports each module in this process and in a fresh Python it starts (a container's every
    process runs under its image); returns where each came from."""
    import subprocess
    import sys

    out = [importlib.import_module(n).__name__ for n in names]
    for n in names:
        subprocess.run([sys.executable, "-c", f"import {n}"], check=True, capture_output=True)
    return out


@app.function(image=probe_image, timeout=600)
def imports_bare(names: list[str]) -> list[str]:
    return _import(names)


@app.function(image=numpy_image, timeout=600)
def imports_numpy_image(names: list[str]) -> list[str]:
    return _import(names)
