"""S20 on the plane: a container imports only what its function's image installs (README D3 keeps the
recipe; this enforces it), modal and the standard library.

    plane = ControlPlane(...).start()
    enforce_images(plane)        # containers started from now on run under their image

What an image provides is worked out here, once per recipe, from this machine's installed distributions
(the rule the Modal emulator had, its S20): the requirements its `pip_install`
layers name (`Image.pip_packages`, apps.py) and `modal`, closed over their dependencies (markers
evaluated, extras followed only where asked), as top-level module names. The container gets that list
in `/root/cellfeed_image_guard.json` and `image_site.py` as `/root/sitecustomize.py`: /root is first on
its PYTHONPATH (containers.py, C15), so every Python process of the container installs the guard before
anything else; its local sources are whatever the plane put in /root. A refused import is the plain
`ModuleNotFoundError` a real container raises; the container folder's `image_refusals.txt` names it.

`modal` itself, its dependencies and the standard library are always there (Modal puts its client in
every image). The rest of this repository is not, unless the image adds it (`add_local_python_source`).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

SITE = Path(__file__).with_name("image_site.py")  # the container's sitecustomize
SPEC_NAME = "cellfeed_image_guard.json"  # image_site.SPEC_NAME: what it reads beside itself


def _requirement_closure(requirements: tuple[str, ...]) -> tuple[set[str], list[str]]:
    """(canonical names of every distribution pip would install for `requirements`, as this machine has
    them; the requirements this machine cannot resolve)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found, missing, seen = set(), [], set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            missing.append(str(req))
            continue
        found.add(key[0])
        for line in dist.requires or ():
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in (req.extras or {""})):
                todo.append(dep)
    return found, missing


@lru_cache(maxsize=None)
def _top_level_by_distribution() -> dict[str, frozenset[str]]:
    from importlib import metadata

    from packaging.utils import canonicalize_name

    out: dict[str, set[str]] = {}
    for top, dists in metadata.packages_distributions().items():
        for d in dists:
            out.setdefault(canonicalize_name(d), set()).add(top)
    return {k: frozenset(v) for k, v in out.items()}


@lru_cache(maxsize=None)
def allowed_modules(pip: tuple[str, ...]) -> dict:
    """The image's importable third-party top-level modules: `pip` and `modal`, with their dependencies.
    Also which of `pip` this machine lacks, and pins it has at another version."""
    from importlib import metadata

    from packaging.requirements import Requirement

    dists, missing = _requirement_closure(tuple(pip) + ("modal",))
    tops = _top_level_by_distribution()
    allow = sorted({t for d in dists for t in tops.get(d, {d.replace("-", "_")})})
    other_versions = []
    for line in pip:
        req = Requirement(line)
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            other_versions.append(f"{line} (this machine: {have})")
    return {"allow": allow, "missing": missing, "other_versions": other_versions}


def requirements(pip: list[str]) -> list[str]:
    """The requirement specifiers among what the recipe's `pip install` lines name (apps.py keeps every
    word: modal's own base layers install `-r /modal_requirements.txt`, modal's client's requirements,
    which every image has anyway)."""
    from packaging.requirements import InvalidRequirement, Requirement

    out = []
    for word in pip:
        try:
            Requirement(word)
        except InvalidRequirement:
            continue
        out.append(word)
    return out


def image_spec(image_id: str, pip: list[str]) -> dict:
    """What a container of this image is given: its allowed modules and a label naming the image."""
    pip = requirements(pip)
    label = f"the image {image_id or '(modal default)'} (pip_install: {', '.join(pip) or 'nothing'})"
    return {"label": label, **allowed_modules(tuple(pip))}


def _blob(blobs_dir: Path, data: bytes) -> Path:
    """A file of the plane's content store (as mounts keep theirs: by sha256)."""
    path = blobs_dir / hashlib.sha256(data).hexdigest()
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return path


def enforce_images(plane) -> None:
    """From now on each container `plane` starts runs under its function's image (S20)."""
    servicer = plane.servicer
    files_of = servicer.container_files  # (server.py: a function's files, remote path -> stored content)

    def container_files(fn_def) -> dict[str, Path]:
        files = dict(files_of(fn_def))
        image = servicer.images.get(fn_def.image_id)
        spec = image_spec(fn_def.image_id, list(image.pip_packages) if image else [])
        files["/root/sitecustomize.py"] = _blob(servicer.blobs_dir, SITE.read_bytes())
        files[f"/root/{SPEC_NAME}"] = _blob(servicer.blobs_dir, json.dumps(spec).encode())
        return files

    servicer.container_files = container_files
