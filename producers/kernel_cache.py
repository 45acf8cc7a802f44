"""Where the compiled token pass is kept: one folder for every copy of the code, so a producer
container loads it (~0.3 s) instead of compiling it (~7.6 s a variant, one core of this machine).

numba caches a compiled function in a folder named for the *path* of its source (the SHA1 of the
source's directory: numba/core/caching.py:141-156) and stamps the cache with the SHA256 of the
source's *content* (caching.py:183-191). Every Modal container gets the code anew, and the test
world's containers each at a path of their own; numba's own locator then finds nothing another
container compiled. `SharedCacheLocator` keeps the path out of the folder's name; the content
stamp still decides whether a cache is valid, so a changed kernel is compiled again, never loaded.
It is numba's documented hook for this (`NUMBA_CACHE_LOCATOR_CLASSES`, read with `NUMBA_CACHE_DIR`).

On Modal the folder is a Volume (`app/modal_app.py`: `cellfeed-kernels` at /kernels, mounted by
setup and the producers): the setup compiles (`app/campaign.py:prepare`), marks its folder seedable
and commits, so the producers it is followed by, every producer started after a preemption, and
every later run's setup (its folder a copy of the newest seedable one: `_seed`) load.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

from numba.core import caching, config

# numba's own locators after ours: a folder ours cannot use falls back to numba's default choice
LOCATORS = f"{__name__}.SharedCacheLocator,InTreeCacheLocator,UserWideCacheLocator"


class SharedCacheLocator(caching.UserProvidedCacheLocator):
    """$NUMBA_CACHE_DIR/<the source's package folder>: the same folder for every copy of the code."""

    def __init__(self, py_func, py_file):
        super().__init__(py_func, py_file)
        package = os.path.basename(os.path.dirname(os.path.abspath(py_file)))
        self._cache_path = os.path.join(config.CACHE_DIR, package)


def cache_kernels_in(folder: str, run: str = "") -> bool:
    """From now on in this process, compiled kernels are kept in `folder`, in the campaign `run`'s
    own folder there (if `folder` exists: False otherwise, and numba's default stands). Call it
    before the token pass is first imported. Per run: a Volume's commits are last-writer-wins per
    file, and numba numbers a function's compiled variants in its index (`_tokenize-233.py311.N.nbc`),
    so two campaigns compiling new variants into one folder at once could leave one's index beside
    the other's code, which numba would load without checking its types. A run's folder starts as a
    copy of another run's (`_seed`), so a Volume's first campaign compiles and the later ones load."""
    if not os.path.isdir(folder):
        return False
    if run:
        _seed(folder, run)
    folder = os.path.join(folder, run)
    os.makedirs(folder, exist_ok=True)
    os.environ["NUMBA_CACHE_DIR"] = folder
    os.environ["NUMBA_CACHE_LOCATOR_CLASSES"] = LOCATORS
    config.reload_config()  # (numba read its settings when it was imported)
    return True


SEEDABLE = ".seedable"  # in a run's folder: its setup compiled there and nothing compiled after (`mark_seedable`)


def mark_seedable(folder: str, run: str) -> None:
    """(a setup, after compiling, before its commit) The run's folder may seed later runs' (`_seed`): written
    after its index, so a producer that compiles another variant there later makes its index newer than this."""
    here = os.path.join(folder, run)
    if os.path.isdir(here):
        with open(os.path.join(here, SEEDABLE), "w"):
            pass


def _seed(folder: str, run: str) -> None:
    """A run folder that does not exist yet is made as a whole copy of the newest run folder a setup
    marked seedable and no producer compiled into since (its indexes no newer than the mark): producers
    compiling into one folder at once can leave an index beside another's code, which must not spread.
    numba still checks each variant against its source's content, so a changed kernel is compiled again,
    into this run's folder only. The copy is made aside and renamed into place: a reader never sees half."""
    here = os.path.join(folder, run)
    if os.path.exists(here):
        return
    for stale in glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(run)}.*")):  # (a copy cut short)
        shutil.rmtree(stale, ignore_errors=True)
    whole = []
    for mark in glob.glob(os.path.join(glob.escape(folder), "*", SEEDABLE)):
        try:
            marked, source = os.path.getmtime(mark), os.path.dirname(mark)
            indexes = [os.path.getmtime(i) for i in glob.glob(os.path.join(glob.escape(source), "*", "*.nbi"))]
        except OSError:  # (changing as we look: not this one)
            continue
        if indexes and max(indexes) <= marked:
            whole.append((marked, source))
    if not whole:
        return
    staging = tempfile.mkdtemp(prefix=f".{run}.", dir=folder)  # (a dot folder: never taken for a run's)
    try:
        shutil.copytree(max(whole)[1], staging, dirs_exist_ok=True)
        os.remove(os.path.join(staging, SEEDABLE))  # (this run's setup marks its own)
        os.rename(staging, here)
    except OSError as exc:  # the run's folder made meanwhile by another of its processes (theirs stands), or not
        shutil.rmtree(staging, ignore_errors=True)
        if not os.path.isdir(here):
            print(f"kernels: {run} starts with no compiled token pass (copying one failed: {exc})", flush=True)
