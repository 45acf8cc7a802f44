"""The exact versions of every package the Modal images list: one place, used by the images and CI.
(Their dependencies are not pinned here: pip resolves them when an image is built.)

Why: `app/modal_app.py` builds its images with `pip install`, and Modal rebuilds an image when its
definition changes (or on `force_build`). With lower bounds only, a rebuild months later installs
whatever is newest then: versions no test has run. Pinned here, the images install exactly what the
test suite ran, and CI (`.ci/run`) and the README's set-up install the same versions through a
constraints file this module prints:

    python -m app.pins > c.txt && pip install -c c.txt -e ".[test]"

How to move a pin: install the new version locally (`pip install NAME==NEW`), run the whole suite
(`python -m pytest`), then edit `PINS` below. `tests/test_pins.py` checks that every pin satisfies
pyproject.toml's bound, that both images are built from these pins, and that the installed versions
are the pinned ones.

Standard library only: this module is imported in both images (through `app.modal_app`) and on a
laptop with nothing installed.
"""

from __future__ import annotations

import sys

# name (as pip spells it) -> exact version. torch: the local CPU build is 2.13.0+cpu; the pin has no
# local label, so `torch==2.13.0` accepts it here and the CUDA build in the trainer image.
PINS: dict[str, str] = {
    "anndata": "0.12.19",
    "boto3": "1.44.8",
    "h5py": "3.16.0",
    "matplotlib": "3.11.2",
    "numba": "0.68.1",
    "numpy": "2.4.6",
    "pandas": "2.3.3",
    "polars": "2.1.0",
    "pyarrow": "26.0.1",
    "pylance": "14.0.2",
    "scipy": "1.17.1",
    "tensorboard": "2.21.0",
    "torch": "2.13.0",
    "tqdm": "4.70.1",
    "zstandard": "0.25.0",
}


def pinned(*names: str) -> tuple[str, ...]:
    """`"name==version"` for each of `names`, in that order; an unpinned name is a KeyError."""
    missing = [n for n in names if n not in PINS]
    if missing:
        raise KeyError(f"not pinned in app/pins.py: {', '.join(missing)} (add an exact version to PINS)")
    return tuple(f"{n}=={PINS[n]}" for n in names)


def constraints() -> str:
    """A pip constraints file (`pip install -c FILE ...`): one `name==version` per line."""
    return "".join(f"{line}\n" for line in pinned(*sorted(PINS)))


if __name__ == "__main__":
    sys.stdout.write(constraints())
