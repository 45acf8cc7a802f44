"""The token pass compiled once for a test session, for the types the suite's datasets have, where the
session's campaigns look for it: this checkout's own numba cache (local campaigns' producers load
it from there) and the Modal test world's lasting kernels Volume, in the folders of the campaigns
named (producers/kernel_cache.py: a folder per run).

    python -m cellfeed_testing.token_pass VOLUME_FOLDER RUN [RUN ...]

Compiling is ~8 CPU-s a variant on this machine. Without this, every campaign started before a first
one had cached the pass compiled it again: the suite's first Modal tests run together, each setup
compiling into an empty Volume, and local campaigns' producers started together each compiling too.
The pass is the same code either way (numba checks the cache against its source's content hash).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

# the pass's argument types that the suite's datasets give it: gene ids of 2 bytes (4 only past 65,535
# genes), values as counts or floats (`producers.token_kernel.kernel_tokens` compiles at most 4 variants;
# a test that needs one of the other 2 compiles it itself)
GENE_TYPES, VALUE_TYPES = (np.uint16,), (np.uint16, np.float32)


def compile_variants() -> list[Path]:
    """Tokenize a two-gene cell of each pair of types (compiled, or loaded from this process's cache);
    the cache's files of the pass: its index and the variants it lists."""
    from coordination.arrays import CellRows
    from producers import token_kernel

    for genes in GENE_TYPES:
        for values in VALUE_TYPES:
            rows = CellRows(np.array([0]), np.array([0, 2]), np.array([1, 2], genes), np.array([3, 4], values))
            if token_kernel.kernel_tokens(rows, None, mode="scgpt", max_genes=4, token_dtype=np.uint32) is None:
                raise RuntimeError(f"the token pass declined {genes.__name__} genes and {values.__name__} values")
    index = token_kernel._tokenize._cache._cache_file  # (numba's: numba/core/caching.py, IndexDataCacheFile)
    folder = Path(index._cache_path)  # (in-tree by default: producers/__pycache__)
    return [folder / index._index_name] + sorted(folder / name for name in index._load_index().values())


def main(volume: str, runs: list[str]) -> None:
    from producers.kernel_cache import mark_seedable

    files = compile_variants()
    for run in runs:  # what `cache_kernels_in(volume, run)` looks in, as setup's commit would leave it
        target = Path(volume) / run / "producers"
        if not target.exists():
            staging = target.with_name(".producers.tmp")
            staging.mkdir(parents=True, exist_ok=True)
            for f in files:
                shutil.copy2(f, staging / f.name)
            staging.rename(target)
            mark_seedable(volume, run)  # (as its setup does: a later run's folder may start as a copy of it)
    print(f"token pass: {len(files)} cache files, in {len(runs)} run folders of {volume}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
