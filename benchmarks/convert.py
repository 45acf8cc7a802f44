"""Conversion and synthesis throughput: cells/s and peak RSS.

    python benchmarks/convert.py            # 1M cells (needs ~25 GB free disk, several minutes)
    python benchmarks/convert.py --quick    # 20k cells, under a minute
    python benchmarks/convert.py --tiny     # 500 cells: seconds (the test suite's)

Builds a CSR h5ad of synthetic Tahoe-like cells (median ~1,500 non-zeros, 62,710 genes),
then times `cellfeed convert` on it and `cellfeed synth` of the same size, each in its own
process so peak RSS is that process's own. Prints a table and, last, one JSON line. Exits 1 (one
line on stderr) when a step failed or its dataset does not hold every cell.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._checks import check_figures, fail  # noqa: E402


def write_h5ad(path: Path, n_cells: int, n_genes: int, seed: int) -> int:
    """A CSR h5ad written chunk by chunk (anndata's append), float32 counts like public atlases."""
    import anndata as ad
    import h5py
    import pandas as pd
    import scipy.sparse as sp

    from producers.synth import SynthSpec, iter_chunks

    spec = SynthSpec(n_cells=n_cells, n_genes=n_genes, seed=seed)
    obs_parts, nnz = [], 0
    with h5py.File(path, "w") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        matrix = None
        for obs, indptr, genes, values in iter_chunks(spec):
            chunk = sp.csr_matrix(
                (values.astype("float32"), genes.astype("int32"), indptr), shape=(obs.num_rows, n_genes)
            )
            if matrix is None:
                ad.io.write_elem(f, "X", chunk)
                matrix = ad.io.sparse_dataset(f["X"])
            else:
                matrix.append(chunk)
            nnz += chunk.nnz
            obs_parts.append(obs.to_pandas())
        obs = pd.concat(obs_parts, ignore_index=True).set_index("cell_id")
        for col in ("plate", "cell_line", "drug"):
            obs[col] = obs[col].astype("category")
        ad.io.write_elem(f, "obs", obs)
        ad.io.write_elem(f, "var", pd.DataFrame(index=[f"ENSG{g:011d}" for g in range(n_genes)]))
        f.attrs["encoding-type"] = "anndata"
        f.attrs["encoding-version"] = "0.1.0"
    return nnz


def timed(cmd: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of a child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        fail(f"step failed (exit {os.waitstatus_to_exitcode(status)}): {' '.join(cmd)}")
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20k cells, done within a minute")
    parser.add_argument("--tiny", action="store_true", help="500 cells: seconds (the test suite's)")
    parser.add_argument(
        "--cells", type=int, default=None, help="cells (default 1,000,000; 20,000 with --quick; 500 with --tiny)"
    )
    parser.add_argument("--genes", type=int, default=62_710)
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp dir, removed after)")
    parser.add_argument("--write-h5ad", metavar="PATH", help=argparse.SUPPRESS)  # internal: child step
    args = parser.parse_args()
    if args.write_h5ad:
        print(write_h5ad(Path(args.write_h5ad), args.cells, args.genes, seed=1))
        return
    n_cells = args.cells or (500 if args.tiny else 20_000 if args.quick else 1_000_000)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="cellfeed-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "app.cli"]
    try:
        # every step runs in its own process: Linux carries a parent's peak RSS into a forked child
        t0 = time.perf_counter()
        written = subprocess.run(
            [
                sys.executable,
                __file__,
                "--write-h5ad",
                str(work / "in.h5ad"),
                "--cells",
                str(n_cells),
                "--genes",
                str(args.genes),
            ],
            capture_output=True,
            text=True,
        )
        if written.returncode != 0:
            print(written.stderr[-2000:], file=sys.stderr)
            fail(f"writing the input h5ad failed (exit {written.returncode})")
        nnz = int(written.stdout.split()[-1])
        h5_seconds = time.perf_counter() - t0
        h5_gb = (work / "in.h5ad").stat().st_size / 1e9
        conv_s, conv_rss = timed(cli + ["convert", str(work / "in.h5ad"), str(work / "converted"), "--quiet"])
        synth_s, synth_rss = timed(
            cli + ["synth", str(work / "synth"), "--cells", str(n_cells), "--genes", str(args.genes), "--quiet"]
        )
        from producers.dataset import open_dataset

        for name in ("converted", "synth"):  # each step made the whole dataset
            ds = open_dataset(str(work / name))
            if ds.n_cells != n_cells or (name == "converted" and ds.n_rows != nnz):
                fail(
                    f"{name} dataset holds {ds.n_cells:,} cells and {ds.n_rows:,} non-zeros, not {n_cells:,} cells"
                    + (f" and {nnz:,} non-zeros" if name == "converted" else "")
                )
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    figures = {
        "cells": n_cells,
        "nonzeros": nnz,
        "h5ad_gb": round(h5_gb, 2),
        "convert_cells_per_s": round(n_cells / conv_s),
        "convert_peak_rss_mb": round(conv_rss),
        "synth_cells_per_s": round(n_cells / synth_s),
        "synth_peak_rss_mb": round(synth_rss),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    print(
        f"\n{n_cells:,} cells, {nnz:,} non-zeros ({nnz / n_cells:,.0f}/cell); h5ad {h5_gb:.2f} GB "
        f"written in {h5_seconds:.0f}s; machine: {figures['machine']}"
    )
    print(f"{'step':<10}{'seconds':>10}{'cells/s':>12}{'rows/s':>14}{'peak RSS MB':>14}")
    for name, secs, rss in (("convert", conv_s, conv_rss), ("synth", synth_s, synth_rss)):
        print(f"{name:<10}{secs:>10.1f}{n_cells / secs:>12,.0f}{nnz / secs:>14,.0f}{rss:>14,.0f}")
    print(json.dumps(figures))
    check_figures(figures)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
