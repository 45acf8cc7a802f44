"""The `sitecustomize` of a container whose image is enforced (image_guard.py, README D3/S20): copied
into the container's /root, first on its PYTHONPATH, so every Python process of the container runs it at
start-up (the entrypoint's and every Python it starts: torchrun's ranks, multiprocessing's children).

On Modal a function's body runs in the image its `@app.function(image=...)` names: the packages its
`pip_install` lists with what pip installs beside them, modal's client with its dependencies, the
standard library, and the local sources the image adds (`add_local_python_source`: here, what the plane
put in /root). A body importing anything else fails at that import. This process wraps each finder on
`sys.meta_path` so that it finds nothing else: to the import system (and to `importlib.util.find_spec`
probes for optional modules) such a module is simply not installed, as in the real container. Each name
refused is noted (once a process) in the container folder's `image_refusals.txt`.

Standard library only: this runs before anything else of the container.
"""

import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
SPEC_NAME = "cellfeed_image_guard.json"  # written beside this file by the plane: {"allow", "label"}
REFUSALS = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "image_refusals.txt")  # <container>/fs/root/..
# Python's own start-up (site, .pth files, an editable install's finder) is not the image's to give
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


class ImageGuard:
    def __init__(self, allow, sources, label):
        self.allow, self.sources, self.label = set(allow), set(sources), label
        self.refused = set()

    def permits(self, fullname):
        top = fullname.partition(".")[0]
        return (
            top in self.allow
            or top in self.sources
            or top in sys.stdlib_module_names
            or top == "modal"
            or top.startswith(_START_UP)
        )

    def note(self, fullname):
        top = fullname.partition(".")[0]
        if top in self.refused:
            return
        self.refused.add(top)
        try:
            with open(REFUSALS, "a") as f:
                f.write(f"{os.getpid()} {top}: not in {self.label}\n")
        except OSError:
            pass


class _Guarded:
    """A meta-path finder that finds nothing the image lacks."""

    def __init__(self, inner, guard):
        self.inner, self.guard = inner, guard

    def find_spec(self, fullname, path=None, target=None):
        if not self.guard.permits(fullname):
            self.guard.note(fullname)
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(fullname, path, target) if find is not None else None

    def invalidate_caches(self):
        if hasattr(self.inner, "invalidate_caches"):
            self.inner.invalidate_caches()

    def find_distributions(self, *args, **kwargs):
        """Installed distributions' metadata (`importlib.metadata.version`, which anndata calls as it
        imports), as the inner finder gives it: without this, the wrapped finders gave none, and an
        image's own packages had no version. (Metadata of a distribution outside the image stays
        visible: the guard is on imports, what a body uses.)"""
        find = getattr(self.inner, "find_distributions", None)
        return find(*args, **kwargs) if find is not None else iter(())


def local_sources(folder):
    """The top-level modules the image adds: what is in /root (packages and modules), this file aside."""
    out = set()
    for name in os.listdir(folder):
        if name.endswith(".py"):
            out.add(name[:-3])
        elif os.path.isdir(os.path.join(folder, name)) and name.isidentifier():
            out.add(name)
    return out - {"sitecustomize"}


def install():
    with open(os.path.join(_HERE, SPEC_NAME)) as f:
        spec = json.load(f)
    guard = ImageGuard(spec["allow"], local_sources(_HERE), spec["label"])
    sys.meta_path[:] = [_Guarded(f, guard) for f in sys.meta_path]
    for name in [m for m in sys.modules if not guard.permits(m)]:
        del sys.modules[name]  # imported before the guard (a .pth's doing): a later import must look again
    return guard


def _chain():
    """Run the next `sitecustomize` on the path whose folder's has not run yet (the i6pn resolver's
    chains the same way, through the same set: two that each skipped only their own folder ran each
    other until Python's recursion limit)."""
    import importlib.machinery
    import importlib.util

    seen = sys.__dict__.setdefault("_cellfeed_site_dirs", set())
    seen.add(_HERE)
    rest = [p for p in sys.path if p and os.path.abspath(p) not in seen]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if __name__ == "sitecustomize":  # (the container's start-up; imported as a module elsewhere it does nothing)
    GUARD = install()
    _chain()
