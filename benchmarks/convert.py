"""Conversion and synthesis throughput: cells/s and peak RSS, with 1 and 2 workers, to local disk
and to object storage behind a latency proxy.

    python benchmarks/convert.py            # 1M cells (needs ~25 GB free disk, several minutes)
    python benchmarks/convert.py --quick    # 300k cells (~4 GB of h5ad), a few minutes
    python benchmarks/convert.py --tiny     # 500 cells: seconds (the test suite's)

Builds a CSR h5ad of synthetic Tahoe-like cells (median ~1,500 non-zeros, 62,710 genes), then
converts it with K = 1 and K = 2 workers (`producers/convert.py`: slices converted apart, committed
once), to local disk and to SeaweedFS through a proxy adding 100+-20 ms to every response, and
times `cellfeed synth` of the same size. Each run is a process of its own: its coordinator's peak
RSS is its own, and each worker reports its own (with K = 2 the coordinator is one of them). The K = 2
datasets must equal K = 1's (content hash, cells, rows). Prints a table, each K's phases (imports,
plan, scan, write, commit) and, last, one JSON line with `speedup_2_workers` (K = 2's cells/s over
K = 1's, local disk, same input, same run) and `steady_speedup_2_workers` (the same once every worker
is writing: the machine's ceiling for the first, which the start both pay alike keeps below). Exits 1
(one line on stderr) when a step failed or a dataset does not hold every cell.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._checks import check_figures, fail, machine, peak_rss_mb  # noqa: E402


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


def convert_child(inp: str, out: str, workers: int) -> None:
    """(a child process) One conversion; prints its figures as JSON: the coordinator's own seconds
    (planning and the commit, which grow with the cell count but not with the workers), each phase's
    seconds (imports, plan, scan, write, commit: where K = 2 gains and where it does not), its peak
    RSS, and the largest peak RSS a worker reported."""
    start = time.perf_counter()
    from coordination.net import one_blas_thread

    one_blas_thread()  # as `cellfeed convert` does (app/cli.py), before its own imports
    if workers > 1:
        from coordination.net import forkserver
        from producers import CONVERT_WORKER_MODULES

        forkserver(CONVERT_WORKER_MODULES)
    import producers.convert as conv

    peaks, own, done = [], {}, []  # each slice's result carries its worker's peak RSS so far

    def on_slice(result: dict) -> None:
        peaks.append(result["peak_rss_mb"])
        done.append((time.perf_counter(), result["cells"]))

    def timed_step(name, fn):
        def step(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                own[name] = time.perf_counter() - t

        return step

    conv.plan_conversion = timed_step("plan", conv.plan_conversion)
    conv.commit = timed_step("commit", conv.commit)
    run_slices = conv.run_slices  # the scan's and the write's slices, each phase timed whole
    conv.run_slices = lambda task, *a, **kw: timed_step(task.__name__.split("_")[0], run_slices)(task, *a, **kw)
    own["imports"] = time.perf_counter() - start
    ds = conv.convert([inp], out, workers=workers, progress=False, on_slice=on_slice)
    # the steady rate: the cells of every slice after the first K to finish (each worker's first, as the
    # workers start together), over the time since: the workers side by side, without the start (imports,
    # plan, the scan, and the first slice a process writes)
    steady = None
    if len(done) > workers:
        steady = sum(c for _, c in done[workers:]) / (done[-1][0] - done[workers - 1][0])
    print(
        json.dumps(
            {
                "cells": ds.n_cells,
                "rows": ds.n_rows,
                "content": ds.config["metadata"]["content_sha256"],
                "coordinator_s": own["plan"] + own["commit"],
                "phases": {k: round(own[k], 2) for k in ("imports", "plan", "scan", "write", "commit")},
                "coordinator_rss_mb": peak_rss_mb(),
                "worker_rss_mb": max(peaks),
                "steady_cells_per_s": steady,
            }
        ),
        flush=True,
    )
    os._exit(0)  # as `cellfeed convert` ends (app/cli.py:console): not timing anndata's teardown


def warm(path: Path) -> None:
    """Read the input once, so every timed run finds it in the page cache (this VM reclaims cold pages:
    a run that reads from disk would time the disk)."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def converted(inp: Path, out: str, workers: int, env: dict | None = None) -> dict:
    """A conversion in a process of its own, timed end to end (interpreter start and imports
    included: what a user waits for): its figures."""
    if "://" not in out:  # (an S3 output goes to a fresh bucket prefix)
        shutil.rmtree(out, ignore_errors=True)
    warm(inp)
    # the earlier runs' ~1.4 GB of written pages flushed now: their writeback (kernel threads, the
    # disk) landed in whichever run came next, K = 2's 8.6-11.3 s against 8.6-8.9 s synced
    os.sync()
    cmd = [sys.executable, __file__, "--convert-child", str(inp), out, "--workers", str(workers)]
    t = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t
    if run.returncode != 0:
        print(run.stderr[-2000:], file=sys.stderr)
        fail(f"converting with {workers} workers to {out} failed (exit {run.returncode})")
    return {"seconds": seconds, **json.loads(run.stdout.strip().splitlines()[-1])}


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
    parser.add_argument("--quick", action="store_true", help="300k cells, a few minutes")
    parser.add_argument("--tiny", action="store_true", help="500 cells: seconds (the test suite's)")
    parser.add_argument(
        "--cells", type=int, default=None, help="cells (default 1,000,000; 300,000 with --quick; 500 with --tiny)"
    )
    parser.add_argument("--genes", type=int, default=62_710)
    parser.add_argument(
        "--latency-ms", type=float, default=None, help="the proxy's added latency (default 100; 10 with --tiny)"
    )
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp dir, removed after)")
    parser.add_argument("--write-h5ad", metavar="PATH", help=argparse.SUPPRESS)  # internal: child step
    parser.add_argument("--convert-child", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)  # internal
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_h5ad:
        print(write_h5ad(Path(args.write_h5ad), args.cells, args.genes, seed=1))
        return
    if args.convert_child:
        convert_child(*args.convert_child, args.workers)
        return
    n_cells = args.cells or (500 if args.tiny else 300_000 if args.quick else 1_000_000)
    args.latency_ms = args.latency_ms if args.latency_ms is not None else 10.0 if args.tiny else 100.0
    n_s3, n_synth = max(100, n_cells // 5), n_cells if not args.quick else 20_000  # (synth: ~3k cells/s here)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="cellfeed-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "app.cli"]
    h5 = work / "in.h5ad"
    try:
        # every step runs in its own process: Linux carries a parent's peak RSS into a forked child
        t0 = time.perf_counter()
        written = subprocess.run(
            [sys.executable, __file__, "--write-h5ad", str(h5), "--cells", str(n_cells), "--genes", str(args.genes)],
            capture_output=True,
            text=True,
        )
        if written.returncode != 0:
            print(written.stderr[-2000:], file=sys.stderr)
            fail(f"writing the input h5ad failed (exit {written.returncode})")
        nnz = int(written.stdout.split()[-1])
        h5_seconds, h5_gb = time.perf_counter() - t0, h5.stat().st_size / 1e9
        runs, rounds = {}, []
        # K = 1, 2, 2, 1: each K's best of two (this VM's noise: tens of %). The second round in reverse: a
        # drift through the run falls on both alike, and K = 2 runs once after itself -- right after K = 1 it
        # took 5.8-6.4 s where after K = 2 it took 5.1-5.5 s (one loop, 300k cells), while K = 1 took the
        # same after either (8.9-9.3 s)
        for order in ((1, 2), (2, 1))[: 1 if args.tiny else 2]:
            rounds.append({k: converted(h5, str(work / f"local{k}"), k) for k in order})
            for k, run in rounds[-1].items():
                runs[k] = min(runs.get(k, run), run, key=lambda r: r["seconds"])
        small = work / "small.h5ad"  # object storage: a fifth of the cells (a run there is several times slower)
        written = subprocess.run(
            [sys.executable, __file__, "--write-h5ad", str(small), "--cells", str(n_s3), "--genes", str(args.genes)],
            capture_output=True,
            text=True,
        )
        if written.returncode != 0:
            fail(f"writing the object-storage input failed (exit {written.returncode}): {written.stderr[-500:]}")
        from cellfeed_testing.object_store import SeaweedServer

        with SeaweedServer() as server:  # (one store, a bucket each: a start is 3-8 s here)
            s3 = s3_runs(small, args.latency_ms, server)
            fan_out = modal_fan_out(small, n_s3, work / "plane", server, slices=2 if args.tiny else 8)
        synth_s, synth_rss = timed(
            cli + ["synth", str(work / "synth"), "--cells", str(n_synth), "--genes", str(args.genes), "--quiet"]
        )
        from producers.dataset import open_dataset

        synth = open_dataset(str(work / "synth"))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    small_nnz = int(written.stdout.split()[-1])
    for k, run in [(k, r) for rnd in rounds for k, r in rnd.items()]:  # each made the whole dataset, the same one
        if (run["cells"], run["rows"], run["content"]) != (n_cells, nnz, runs[1]["content"]):
            fail(
                f"the conversion with {k} worker(s) holds {run['cells']:,} cells and {run['rows']:,} non-zeros "
                f"(content {run['content'][:12]}), not {n_cells:,} and {nnz:,} (content {runs[1]['content'][:12]})"
            )
    if (s3["s3_1"]["rows"], s3["s3_2"]["content"]) != (small_nnz, s3["s3_1"]["content"]) or s3["s3_2"]["cells"] != n_s3:
        fail(f"the conversions to object storage differ or miss cells: {s3}")
    if (fan_out["cells"], fan_out["rows"], fan_out["content"]) != (n_s3, small_nnz, fan_out["local_content"]):
        fail(f"the Modal fan-out's dataset differs from a local conversion's of the same input: {fan_out}")
    if synth.n_cells != n_synth:
        fail(f"synth dataset holds {synth.n_cells:,} cells, not {n_synth:,}")
    rate = {k: n_cells / run["seconds"] for k, run in runs.items()} | {k: n_s3 / r["seconds"] for k, r in s3.items()}
    # one worker's own rate: its cells over the time not spent in the coordinator's planning and commit
    per_worker = n_cells / (runs[1]["seconds"] - runs[1]["coordinator_s"])
    coordinator_per_cell = runs[1]["coordinator_s"] / n_cells
    figures = {
        "cells": n_cells,
        "nonzeros": nnz,
        "h5ad_gb": round(h5_gb, 2),
        "convert_cells_per_s": round(rate[1]),
        "convert_2_workers_cells_per_s": round(rate[2]),
        "speedup_2_workers": round(rate[2] / rate[1], 2),
        "convert_seconds_rounds": [[round(r[k]["seconds"], 1) for k in (1, 2)] for r in rounds],
        "worker_cells_per_s": round(per_worker),
        "coordinator_s_per_million_cells": round(coordinator_per_cell * 1e6, 2),
        "phase_seconds": {f"{k}_workers": runs[k]["phases"] for k in (1, 2)},  # each K's best run
        "write_phase_speedup_2_workers": round(runs[1]["phases"]["write"] / runs[2]["phases"]["write"], 2),
        # the ceiling of `speedup_2_workers` on this machine: K = 2 over K = 1 once every worker is writing
        # (None: too few slices, as in --tiny); the whole run's ratio is below it by the start both K pay alike
        "steady_speedup_2_workers": (
            round(runs[2]["steady_cells_per_s"] / runs[1]["steady_cells_per_s"], 2)
            if runs[1]["steady_cells_per_s"] and runs[2]["steady_cells_per_s"]
            else None
        ),
        "convert_worker_peak_rss_mb": round(max(r["worker_rss_mb"] for r in runs.values())),
        "convert_coordinator_peak_rss_mb": round(max(r["coordinator_rss_mb"] for r in runs.values())),
        "s3_cells": n_s3,
        f"s3_{args.latency_ms:.0f}ms_cells_per_s": round(rate["s3_1"]),
        f"s3_{args.latency_ms:.0f}ms_2_workers_cells_per_s": round(rate["s3_2"]),
        "modal_slices": fan_out["slices"],
        "modal_calls": fan_out["calls"],
        "modal_retried_attempts": fan_out["retried"],
        "modal_fan_out_s": round(fan_out["seconds"], 1),
        "synth_cells": n_synth,
        "synth_cells_per_s": round(n_synth / synth_s),
        "synth_peak_rss_mb": round(synth_rss),
        "machine": machine(),
    }
    print(
        f"\n{n_cells:,} cells, {nnz:,} non-zeros ({nnz / n_cells:,.0f}/cell); h5ad {h5_gb:.2f} GB "
        f"written in {h5_seconds:.0f}s; machine: {figures['machine']}"
    )
    print(f"{'step':<40}{'seconds':>9}{'cells/s':>10}{'worker MB':>11}{'coord. MB':>11}")
    for name, run in {**runs, **s3}.items():
        where = "local disk, best of 2" if isinstance(name, int) else f"S3 +{args.latency_ms:.0f} ms, {n_s3:,} cells"
        label = f"convert, {str(name)[-1]} worker(s), {where}"
        print(
            f"{label:<40}{run['seconds']:>9.1f}{rate[name]:>10,.0f}"
            f"{run['worker_rss_mb']:>11,.0f}{run['coordinator_rss_mb']:>11,.0f}"
        )
    print(
        f"{'Modal test world, %d slices' % fan_out['slices']:<40}"
        f"{fan_out['seconds']:>9.1f}{n_s3 / fan_out['seconds']:>10,.0f}   ({fan_out['calls']} slice calls, "
        f"{fan_out['retried']} retried; local processes, not Modal's machines)"
    )
    print(f"{f'synth, {n_synth:,} cells':<40}{synth_s:>9.1f}{n_synth / synth_s:>10,.0f}{'':>11}{synth_rss:>11,.0f}")
    print(
        f"K = 2 over K = 1 (local disk): {figures['speedup_2_workers']:.2f}x (rounds, seconds K=1, K=2: "
        f"{figures['convert_seconds_rounds']}); one worker {per_worker:,.0f} cells/s; the coordinator "
        f"{coordinator_per_cell * 1e6:.2f} s per million cells"
    )
    if figures["steady_speedup_2_workers"] is not None:
        print(
            f"K = 2 over K = 1 once both write (cells/s after each worker's first slice): "
            f"{figures['steady_speedup_2_workers']:.2f}x, the ceiling of the whole run's on this machine"
        )
    for k in (1, 2):
        print(f"phases, {k} worker(s), seconds: " + ", ".join(f"{n} {v}" for n, v in runs[k]["phases"].items()))
    print(json.dumps(figures))
    check_figures(figures, allow_none=("steady_speedup_2_workers",) if args.tiny else ())  # (tiny: one slice)


def modal_fan_out(h5: Path, n_cells: int, root: Path, server, slices: int = 8) -> dict:
    """`modal run app/modal_app.py::convert` (modal's own CLI and client) against the local Modal
    control plane (cellfeed_testing/modal_control_plane: containers are processes here, not Modal's
    machines): the input on the inputs Volume, the output to SeaweedFS through the app's Secret,
    `slices` slices (a container a call), the first slice call's first attempt failing (Modal's retry
    runs it again). `server`: the SeaweedFS it writes to (its own bucket)."""
    import math

    from benchmarks.modal_chaos import SECRET, client_env
    from cellfeed_testing.modal_control_plane import ControlPlane
    from producers.convert import convert
    from producers.dataset import open_dataset
    from producers.storage import S3Settings
    from producers.writer import CONTENT_BLOCK_CELLS

    block = CONTENT_BLOCK_CELLS if n_cells >= slices * CONTENT_BLOCK_CELLS else math.ceil(n_cells / slices)
    slice_cells = block * math.ceil(n_cells / slices / block)
    server.client().create_bucket(Bucket="fan-out")
    mounts = {"/inputs": "CELLFEED_INPUTS_MOUNT"}
    with ControlPlane(root, secrets={SECRET: server.settings}, mount_env=mounts) as plane:
        shutil.copy(h5, plane.volume_folder("cellfeed-inputs") / h5.name)  # (`modal volume put`)
        plane.fail("convert_slice", 1)
        cmd = [sys.executable, "-m", "modal", "run", "app/modal_app.py::convert", "--inputs", h5.name]
        cmd += ["--out", "s3://fan-out/atlas", "--slice-cells", str(slice_cells), "--block-cells", str(block)]
        t = time.perf_counter()
        run = subprocess.run(cmd, cwd=ROOT, env=client_env(plane), capture_output=True, text=True, timeout=1200)
        seconds = time.perf_counter() - t
        calls = plane.history("convert_slice")
    if run.returncode != 0:
        print(run.stdout[-2000:], run.stderr[-3000:], file=sys.stderr)
        fail(f"the Modal fan-out failed (exit {run.returncode})")
    ds = open_dataset("s3://fan-out/atlas", S3Settings.from_env(server.settings))
    local = convert([str(h5)], str(root / "local"), slice_cells=slice_cells, block_cells=block, progress=False)
    done = sum(c["status"] == "success" for c in calls)
    n_slices = math.ceil(n_cells / slice_cells)
    if done != len(calls) or len(calls) != 2 * n_slices:
        fail(f"the Modal fan-out made {len(calls)} slice calls ({done} succeeded), not {2 * n_slices}")
    return {
        "seconds": seconds,
        "slices": n_slices,
        "calls": len(calls),
        "retried": sum(len(c["attempts"]) - 1 for c in calls),
        "cells": ds.n_cells,
        "rows": ds.n_rows,
        "content": ds.config["metadata"]["content_sha256"],
        "local_content": local.config["metadata"]["content_sha256"],  # the same blocks, converted here
    }


def s3_runs(h5: Path, latency_ms: float, server) -> dict:
    """K = 1 and K = 2 into SeaweedFS (`server`, a bucket of their own) through the latency proxy (the
    store and proxy on this machine)."""
    from benchmarks.object_store import ProxyProcess

    server.client().create_bucket(Bucket="bench")
    proxy = ProxyProcess(server.endpoint, None, latency_ms=latency_ms, jitter_ms=latency_ms / 5)
    try:
        env = {**os.environ, **server.settings, "AWS_ENDPOINT_URL": proxy.endpoint}
        return {f"s3_{k}": converted(h5, f"s3://bench/k{k}", k, env) for k in (1, 2)}
    finally:
        proxy.close()


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
