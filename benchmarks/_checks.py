"""What every benchmark does at its two ends, so that none can rot into printing a table that
looks fine: its optional packages (the `bench` extra) are checked before any work starts, and a
run that did not finish its work, or lacks a figure it reports (None, NaN, infinite), exits 1
with one line on stderr that says what is missing. Not a benchmark: the others import it.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

BENCH_EXTRA = 'pip install -e ".[bench]"'
PIP_NAMES = {"sklearn": "scikit-learn"}  # import name -> the package pip installs


def script() -> str:
    return f"benchmarks/{Path(sys.argv[0]).name}"


def png_path(given: str | None, name: str, tiny: bool) -> str:
    """Where a benchmark draws `name`.png: `given` (its `--png`), else a temp dir with `--tiny` (the
    tests'), else `runs/bench/` (git-ignored): the PNGs in benchmarks/ are the figures of record,
    redrawn only when asked for (`--png benchmarks/NAME.png`)."""
    if given:
        path = Path(given)
    else:
        folder = tempfile.mkdtemp(prefix=f"cellfeed-{name}-") if tiny else Path(__file__).parents[1] / "runs" / "bench"
        path = Path(folder) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path)


def fail(message: str) -> NoReturn:
    """One line on stderr naming the benchmark and what is missing; exit status 1."""
    print(f"{script()}: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def require(packages: dict[str, str], hint: str = "") -> None:
    """Before any work: each import name in `packages` (-> what it is needed for) is installed,
    else fail naming the packages and the extra that brings them (`hint`: another way out)."""
    missing = [(name, why) for name, why in packages.items() if importlib.util.find_spec(name) is None]
    if missing:
        names = " and ".join(f"{PIP_NAMES.get(n, n)} (for {why})" for n, why in missing)
        fail(f"needs {names}: {BENCH_EXTRA}{hint}")


def missing_figures(figures: dict, allow_none: tuple[str, ...] = (), prefix: str = "") -> list[str]:
    """Keys (dotted when nested) of the figures that are None, NaN or infinite; `allow_none`:
    keys that may be None by design (a figure that does not apply to this run)."""
    out = []
    for key, value in figures.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += missing_figures(value, allow_none, f"{name}.")
        elif value is None:
            if name not in allow_none:
                out.append(name)
        elif isinstance(value, float) and not math.isfinite(value):
            out.append(name)
    return out


def check_figures(figures: dict, allow_none: tuple[str, ...] = ()) -> None:
    """Fail when a figure that will be (or was) printed is missing."""
    missing = missing_figures(figures, allow_none)
    if missing:
        fail(f"figures missing (None, NaN or infinite): {', '.join(missing)}")


VECTOR_FLAGS = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("sve", "SVE"), ("asimd", "NEON"))  # widest first


def machine() -> str:
    """The machine a figure was measured on, named the same way by every benchmark: architecture,
    cores, the CPU's model and its widest vector instructions, e.g. "x86_64, 2 cores, AMD EPYC,
    AVX-512". The last two decide figures too: NumPy's sort runs AVX-512 code where the CPU has it,
    and the same commit's vectorised token stage measured 0.112 s per 1,000 cells on an earlier
    session's machine and 0.034 s on this one."""
    import os
    import platform

    model, simd = "", ""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not simd:
                    flags = set(line.split(":", 1)[1].split())
                    simd = next((name for flag, name in VECTOR_FLAGS if flag in flags), "")
    except OSError:  # (not Linux: what the platform module knows)
        model = platform.processor()
    return ", ".join(part for part in (platform.machine(), f"{os.cpu_count()} cores", model, simd) if part)


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB: Linux's VmHWM, which starts afresh in a process
    a benchmark spawns (getrusage's ru_maxrss survives exec: a probe started by a large parent
    would report the parent's peak)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_probe(code: str, what: str, timeout_s: float = 900) -> dict:
    """Run `code` (Python) in a fresh process -- its seconds and memory are its own -- and return
    the JSON object its last line prints (empty when it prints none); fail, naming `what`, when
    it exits non-zero."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        fail(f"{what} failed (exit {out.returncode})")
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}
