"""The Modal images' exact versions (`app/pins.py`): within pyproject.toml's bounds, the only source
of both images' pip lists, and what this suite runs (CI installs them as constraints)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from app import pins

ROOT = Path(__file__).resolve().parents[1]
INSTALL = 'python -m app.pins > c.txt && pip install -c c.txt -e ".[test]"'


def image_requirements() -> dict[str, list[Requirement]]:
    import app.modal_app as m  # imports offline

    return {
        "PRODUCER_PIP": [Requirement(p) for p in m.PRODUCER_PIP],
        "TRAINER_PIP": [Requirement(p) for p in m.TRAINER_PIP],
    }


def public(version: str) -> Version:
    """The version without a local label (`2.13.0+cpu` -> `2.13.0`)."""
    return Version(Version(version).public)


def test_pins_satisfy_pyproject_bounds_and_cover_both_images():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = {canonicalize_name(r.name): r for r in map(Requirement, project["dependencies"])}
    pinned_names = {canonicalize_name(n) for n in pins.PINS}
    for name, version in pins.PINS.items():
        bound = bounds.get(canonicalize_name(name))
        if bound is not None:
            assert bound.specifier.contains(version, prereleases=True), (
                f"app/pins.py pins {name}=={version}, outside pyproject.toml's {bound}"
            )
    for image, reqs in image_requirements().items():
        unpinned = [str(r) for r in reqs if canonicalize_name(r.name) not in pinned_names]
        assert not unpinned, f"{image} lists packages app/pins.py does not pin: {unpinned}"


def test_images_install_exact_pins_built_from_pins_py():
    for image, reqs in image_requirements().items():
        for req in reqs:
            specs = list(req.specifier)
            assert len(specs) == 1 and specs[0].operator == "==", f"{image}: {req} is not an exact pin"
            assert str(req) == pins.pinned(req.name)[0], f"{image}: {req} is not app/pins.py's pin"
    assert pins.pinned("numpy", "torch") == (f"numpy=={pins.PINS['numpy']}", f"torch=={pins.PINS['torch']}")


def test_installed_versions_are_the_pins():
    """The suite runs what the images install (a local label such as torch's `+cpu` aside)."""
    wrong = []
    for name, version in pins.PINS.items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            wrong.append(f"{name}: not installed (pinned {version})")
            continue
        if public(have) != Version(version):
            wrong.append(f"{name}: installed {have}, pinned {version}")
    assert not wrong, (
        "installed versions differ from app/pins.py (the Modal images' pins): "
        + "; ".join(wrong)
        + f". Install with the constraints: {INSTALL}"
    )


def test_module_prints_constraints_matching_the_pins():
    """`python -m app.pins` with no site-packages (-S: the standard library only) prints a constraints file."""
    out = subprocess.run(
        [sys.executable, "-S", "-m", "app.pins"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    lines = out.splitlines()
    assert lines and all(lines), out
    reqs = [Requirement(line) for line in lines]
    assert all(not r.extras and r.marker is None and len(r.specifier) == 1 for r in reqs), out
    assert all(next(iter(r.specifier)).operator == "==" for r in reqs), out
    assert {r.name: next(iter(r.specifier)).version for r in reqs} == pins.PINS
