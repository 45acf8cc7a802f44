"""The code keeps one style: ruff's format and lint, as configured in pyproject.toml (line length 120)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_lint_passes():
    done = ruff("check", "--no-cache", ".")
    assert done.returncode == 0, f"ruff check found problems (fix: ruff check --fix .):\n{done.stdout[-4000:]}"


def test_ruff_format_is_applied():
    done = ruff("format", "--no-cache", "--check", ".")
    assert done.returncode == 0, f"files not in ruff's format (fix: ruff format .):\n{done.stdout[-4000:]}"
