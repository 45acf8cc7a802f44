"""A conversion's unit of work (`producers/convert.py` plans, runs and commits them): the plan every
worker gets as JSON, and what a worker does with one slice of it -- scan its values, or write its rows
as uncommitted Lance fragments with a record of them in the staging area. Both run the same in this
process, a local worker process or a Modal container; `run_slices` runs them here and in local worker
processes beside this one."""

from __future__ import annotations

import producers.heap  # noqa: F401  (first, before Lance starts a thread: its docstring)

# isort: split
import io
import json
import resource
import sys
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
from lance.fragment import write_fragments

from coordination.net import die_with_parent, forkserver
from producers import CONVERT_WORKER_MODULES
from producers.dataset import LANCE_FILE_VERSION, TABLES, expression_schema
from producers.h5ad import Matrix
from producers.storage import Location, S3Settings, location
from producers.writer import ContentHash

RECORDS = "_convert"  # the staging area's slice records (removed at the commit)
LOCAL_SLICE_WAIT_S = 300.0  # after a failure or an interrupt: for the slice on this process's thread to end
SCAN_CELLS = 512  # CSR rows a scan reads at once: ~0.8M values at 1,600 a cell, so its four passes stay in cache


@dataclass
class Slice:
    index: int
    first_cell: int  # the global id of its first cell
    pieces: list[tuple[int, int, int]]  # (input, first row, row after last) in order

    @property
    def n_cells(self) -> int:
        return sum(stop - start for _, start, stop in self.pieces)


@dataclass
class ConvertPlan:
    """Everything a slice's worker needs, and nothing it must compute again (JSON, a few KB)."""

    inputs: list[str]
    layer: str
    out: str
    staging: str
    file_cells: list[int]
    n_genes: int
    slice_cells: int
    block_cells: int
    rows_per_fragment: int
    chunk_cells: int
    key: str  # names the staging area: the same inputs and options give the same key
    gene_orders: dict[str, list[int]] = field(default_factory=dict)  # input -> output gene index, if reordered

    def slices(self) -> list[Slice]:
        bounds = np.concatenate([[0], np.cumsum(self.file_cells)]).tolist()
        out = []
        for first in range(0, bounds[-1], self.slice_cells):
            last = min(first + self.slice_cells, bounds[-1])
            pieces = [
                (f, max(first, bounds[f]) - bounds[f], min(last, bounds[f + 1]) - bounds[f])
                for f in range(len(self.file_cells))
                if max(first, bounds[f]) < min(last, bounds[f + 1])
            ]
            out.append(Slice(len(out), first, pieces))
        return out

    def matrix(self, f: int) -> Matrix:
        order = self.gene_orders.get(str(f))
        return Matrix(self.inputs[f], self.layer, None if order is None else np.asarray(order, dtype=np.int64))

    def staging_area(self, settings: S3Settings | None = None) -> Location:
        return location(self.staging, settings)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ConvertPlan":
        return cls(**json.loads(text))


# --- scan: the values' kind, over every slice, before any slice is written ---------------------------


def scan_slice(plan_json: str, index: int) -> list[dict]:
    """Per piece of the slice: are its values finite, integral, and their range."""
    plan = ConvertPlan.from_json(plan_json)
    out = []
    for f, start, stop in plan.slices()[index].pieces:
        m = plan.matrix(f)
        stats = {"file": f, "integral": True, "min": 0.0, "max": 0.0, "nonfinite_row": None}
        floor = np.empty(0, np.float64)
        try:
            # (a CSR row range is a slice of `data`; CSC and dense ones are read in the write's chunks)
            for values, row in m.values(start, stop, min(SCAN_CELLS, plan.chunk_cells) if m.csr else plan.chunk_cells):
                if values.size == 0:
                    continue
                lo, hi = float(values.min()), float(values.max())  # (a NaN or an infinity shows in one of them)
                if not (np.isfinite(lo) and np.isfinite(hi)):
                    stats["nonfinite_row"] = row
                    break
                if stats["integral"] and np.issubdtype(values.dtype, np.floating):
                    if floor.size < values.size or floor.dtype != values.dtype:
                        floor = np.empty(values.size, values.dtype)
                    stats["integral"] = bool(np.array_equal(values, np.floor(values, out=floor[: values.size])))
                stats["min"], stats["max"] = min(stats["min"], lo), max(stats["max"], hi)
        finally:
            m.close()
        out.append(stats)
    return out


# --- write: one slice's rows as uncommitted fragments, and its record --------------------------------


def write_slice(plan_json: str, index: int, value_type: str, settings: S3Settings | None = None) -> dict:
    """Write slice `index`'s expression rows as fragments (not committed) and record them; returns
    {"cells", "bytes", "peak_rss_mb"} for the progress bar. Memory is one chunk of cells, not the
    slice. `settings`: the coordinator's S3 settings (a local worker's environment may be older than
    them); None: this process's environment (a Modal container: the app's Secret)."""
    plan = ConvertPlan.from_json(plan_json)
    piece_of = plan.slices()[index]
    staging = plan.staging_area(settings)
    schema = expression_schema(plan.n_genes, pa.type_for_alias(value_type))
    gene_type, value_np = schema.field(1).type.to_pandas_dtype(), schema.field(2).type.to_pandas_dtype()
    content, counts = ContentHash(plan.block_cells), []

    def batches():
        cell = piece_of.first_cell
        for f, start, stop in piece_of.pieces:
            m = plan.matrix(f)
            try:
                for lo in range(start, stop, plan.chunk_cells):
                    x = m.rows(lo, min(lo + plan.chunk_cells, stop))
                    n, c = x.shape[0], np.diff(x.indptr).astype(np.int64)
                    genes, values = x.indices.astype(gene_type), x.data.astype(value_np)
                    content.update(c, genes, values)
                    counts.append(c)
                    ids = np.repeat(np.arange(cell, cell + n, dtype=np.uint32), c)
                    yield pa.RecordBatch.from_arrays([pa.array(ids), pa.array(genes), pa.array(values)], schema=schema)
                    cell += n
            finally:
                m.close()

    fragments = write_fragments(
        pa.RecordBatchReader.from_batches(schema, batches()),
        staging.join(TABLES["expression"]),
        schema=schema,
        mode="create",
        max_rows_per_file=plan.rows_per_fragment,
        data_storage_version=LANCE_FILE_VERSION,
        storage_options=staging.lance_options(),
    )
    counts = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    buf = io.BytesIO()
    np.save(buf, counts.astype(np.uint32), allow_pickle=False)
    staging.write_bytes(f"{RECORDS}/counts-{index:06d}.npy", buf.getvalue())
    record = {
        "key": plan.key,
        "cells": int(len(counts)),
        "rows": int(counts.sum()),
        "blocks": content.digests(),
        "fragments": [f.to_json() for f in fragments],
    }
    staging.write_bytes(f"{RECORDS}/slice-{index:06d}.json", json.dumps(record).encode())  # last: the slice is done
    return {
        "cells": record["cells"],
        "bytes": sum(d["file_size_bytes"] for f in record["fragments"] for d in f["files"]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # this process's, so far
    }


def slice_record(plan: ConvertPlan, staging: Location, index: int) -> dict | None:
    """A finished slice's record, if this plan wrote it and its files are all there."""
    try:
        record = json.loads(staging.read_bytes(f"{RECORDS}/slice-{index:06d}.json"))
    except (FileNotFoundError, ValueError):
        return None
    table = TABLES["expression"]
    files = [d["path"] for f in record["fragments"] for d in f["files"]]
    if record.get("key") != plan.key or not all(staging.exists(f"{table}/data/{p}") for p in files):
        return None
    return record


# --- where slices run: in this process, and in worker processes beside it -----------------------------


def run_slices(
    task, plan: ConvertPlan, indexes: list[int], args: tuple, workers: int, on_done, helpers=None
) -> dict[int, object]:
    """`task(plan_json, index, *args)` for each slice index, `workers` at a time: one in this process
    (on a thread: it has imported everything already and its heap is warm) and one in each of
    `workers - 1` worker processes (`helpers`, from `start_helpers`, kept by the caller for its next
    phase; else started here and stopped after); each takes the next slice as it finishes one.
    `on_done(index, result)` as each finishes. The first failure stops the rest: the worker processes
    are killed at once, and the slice this process is on is let finish (as one worker's is: Lance's
    write does not stop midway), which leaves its result in the staging area with theirs so far."""
    plan_json, results, todo = plan.to_json(), {}, iter(indexes)
    if workers <= 1 or len(indexes) <= 1:
        for i in indexes:
            results[i] = task(plan_json, i, *args)
            on_done(i, results[i])
        return results
    pool = helpers or start_helpers(min(workers, len(indexes)))
    pending = {}  # future -> (slice, whether it runs here)

    def hand_out(here: bool) -> None:
        i = next(todo, None)
        if i is None:
            return
        if not here:
            pending[pool.submit(task, plan_json, i, *args)] = (i, False)
            return
        future = Future()  # recorded before its thread starts: an interrupt from here on finds it
        pending[future] = (i, True)
        _start_on_a_thread(future, task, plan_json, i, *args)

    try:
        for here in [True] + [False] * (min(workers, len(indexes)) - 1):
            hand_out(here)
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)  # (FIRST_EXCEPTION waits for all or a failure)
            for future in done:
                i, here = pending.pop(future)
                results[i] = future.result()  # a worker's error, raised here
                on_done(i, results[i])
                hand_out(here)
    except BaseException as exc:
        stop_helpers(pool, kill=True)
        # this process's slice, let finish if it began (one that had not is cancelled: its thread then skips it)
        local = [f for f, (_, here) in pending.items() if here and not f.cancel() and not f.done()]
        if local and isinstance(exc, KeyboardInterrupt):  # (a slice on object storage can take seconds)
            print("convert: interrupted; this process's slice ends first (Ctrl-C again: leave it)", file=sys.stderr)
        wait(local, timeout=LOCAL_SLICE_WAIT_S)
        raise
    if helpers is None:
        stop_helpers(pool)
    return results


def start_helpers(workers: int) -> ProcessPoolExecutor | None:
    """The `workers - 1` worker processes a conversion's slices run in beside this process (None for
    one worker), started now from the workers' forkserver: each imports a slice's modules at once (its
    first task), beside whatever this process does next."""
    if workers <= 1:
        return None
    context = forkserver(CONVERT_WORKER_MODULES)  # (started already by `convert`)
    pool = ProcessPoolExecutor(workers - 1, mp_context=context, initializer=die_with_parent)
    for _ in range(workers - 1):  # (a process a task: each submit to a pool with no idle process starts one)
        pool.submit(_import_slice_modules)
    return pool


def _import_slice_modules() -> None:
    """(a worker's first task) Nothing to run: unpickling this function imports its module, and with it
    what a slice needs beyond the forkserver's preload."""


def stop_helpers(pool: ProcessPoolExecutor | None, kill: bool = False) -> None:
    """Wait for the helpers to end (they are idle), or `kill` them at once (a failure, an interrupt)."""
    if pool is None:
        return
    if kill:  # (no public way before Python 3.14; None once shut down)
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.kill()
    pool.shutdown(wait=not kill, cancel_futures=kill)


def _start_on_a_thread(future: Future, fn, *args) -> None:
    """`fn(*args)` on a daemon thread of its own, its outcome in `future`, unless `future` is cancelled
    first (a daemon: an exit waits for it only as long as `run_slices` does)."""

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # (raised where the result is taken)
                future.set_exception(exc)

    threading.Thread(target=run, name="slice", daemon=True).start()
