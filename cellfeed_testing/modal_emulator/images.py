"""S20: what an emulated container can import — its image's, and nothing else.

On Modal a function's body runs in the image its `@app.function(image=...)` names: the packages
the image's `pip_install` lists, with what pip installs beside them (their dependencies), the
`modal` client and its dependencies (Modal puts its client in every image), the standard library,
and the local Python packages the image adds (`add_local_python_source`). A body that imports
anything else fails at that import. The emulator reproduces it:

- the server resolves an image's pip list into the top-level module names it provides
  (`allowed_modules`: the requirements' closure over this machine's installed distributions,
  markers evaluated, extras followed only where asked) once per image;
- every process of the container (the function's own and every Python process it starts:
  `boot/sitecustomize.py` runs in each) wraps each finder on `sys.meta_path` so that it finds
  nothing the image lacks (to the import system, and to `importlib.util.find_spec` probes for
  optional modules, such a module is not installed), and drops from `sys.modules` what the
  emulator's own runtime imported that the image lacks, so the body's import looks again.

The emulator's runtime (`cellfeed_testing.modal_emulator`) stays importable: it is the container
runtime, not the function's code. Nothing else of the repository is, unless the image adds it.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache

# Python's own start-up modules (site, .pth files, the editable install's finder) are not the image's to give
_START_UP = (
    "_distutils_hack",
    "__editable__",
    "_sysconfigdata",
    "__main__",
    "__mp_main__",
    "sitecustomize",
    "usercustomize",
    "_virtualenv",
)
RUNTIME = "cellfeed_testing.modal_emulator"
ENV_VAR = "MODAL_EMULATOR_IMAGE"


def _requirement_closure(requirements: list[str]) -> tuple[set[str], list[str]]:
    """(canonical names of every distribution pip would install for `requirements`, as this machine
    has them; the requirements this machine cannot resolve)."""
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
def _top_level_by_distribution() -> dict[str, set[str]]:
    from importlib import metadata

    from packaging.utils import canonicalize_name

    out: dict[str, set[str]] = {}
    for top, dists in metadata.packages_distributions().items():
        for d in dists:
            out.setdefault(canonicalize_name(d), set()).add(top)
    return out


def allowed_modules(pip: list[str]) -> dict:
    """The image's importable third-party top-level modules: `pip` and `modal`, with their
    dependencies. Also which of `pip` this machine lacks, and pins it has at another version."""
    from importlib import metadata

    from packaging.requirements import Requirement

    dists, missing = _requirement_closure(list(pip) + ["modal"])
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


class ImageGuard:
    """What the image provides; `install_guard` puts it in front of every meta-path finder."""

    def __init__(self, allow: list[str], sources: list[str], label: str):
        self.allow, self.sources, self.label = set(allow), set(sources), label
        self.refused: set[str] = set()

    def permits(self, fullname: str) -> bool:
        top = fullname.partition(".")[0]
        if top in self.allow or top in self.sources or top in sys.stdlib_module_names or top == "modal":
            return True
        if top.startswith(_START_UP):
            return True
        return fullname == "cellfeed_testing" or fullname == RUNTIME or fullname.startswith(RUNTIME + ".")

    def explain(self, exc: BaseException) -> str:
        """The message of an import error, saying so when the image is why."""
        name = getattr(exc, "name", None) or ""
        if isinstance(exc, ModuleNotFoundError) and name.partition(".")[0] in self.refused:
            return (
                f"{exc}: this function's image ({self.label}) does not install it (the Modal emulator runs "
                "each function under its image)"
            )
        return str(exc)


class _Guarded:
    """A meta-path finder that finds nothing the image lacks: to the import system (and to
    `importlib.util.find_spec`, which libraries use to probe for optional modules) such a module is
    simply not installed, as in the real container."""

    def __init__(self, inner, guard: ImageGuard):
        self.inner, self.guard = inner, guard

    def find_spec(self, fullname, path=None, target=None):
        if not self.guard.permits(fullname):
            self.guard.refused.add(fullname.partition(".")[0])
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(fullname, path, target) if find is not None else None

    def invalidate_caches(self) -> None:
        if hasattr(self.inner, "invalidate_caches"):
            self.inner.invalidate_caches()


GUARD: ImageGuard | None = None  # this process's, once installed


def install_guard(spec: dict) -> ImageGuard:
    """In a container's process: from here on it imports only what its image has."""
    global GUARD
    GUARD = ImageGuard(spec["allow"], spec["sources"], spec["label"])
    sys.meta_path[:] = [_Guarded(f, GUARD) for f in sys.meta_path]
    for name in [m for m in sys.modules if not GUARD.permits(m)]:
        del sys.modules[name]  # imported by the runtime before the guard: the body's import must look again
    return GUARD


def container_spec(image: dict | None) -> dict:
    """What a container of this image gets in `$MODAL_EMULATOR_IMAGE` (no image: Modal's default,
    debian_slim with the modal client only)."""
    image = image or {"pip": [], "sources": [], "label": "modal's default image"}
    resolved = allowed_modules(tuple(image["pip"]))
    return {
        "allow": resolved["allow"],
        "sources": list(image["sources"]),
        "label": image["label"],
        "missing": resolved["missing"],
        "other_versions": resolved["other_versions"],
    }


def from_environment() -> dict | None:
    import os

    data = os.environ.get(ENV_VAR)
    return json.loads(data) if data else None
