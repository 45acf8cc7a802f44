"""h5ad → dataset conversion as units of work: planned once, converted slice by slice, committed once.

    plan     (one process)  open every input, check its structure and genes (a bad input is refused
                            here, in one line, before any work), cut the cells into slices of whole
                            content-hash blocks (about SLICE_BYTES of output each); obs is not read
                            here but on a thread beside the write, for the commit
    scan     (per slice)    its values' range and kind; then, for the whole dataset: refuse NaN,
                            negatives, counts float32 cannot hold, and choose uint16 or float32
    write    (per slice)    its rows as uncommitted fragments of the expression table
                            (`lance.fragment.write_fragments`), its cells' row counts and its
                            content-hash blocks: a record in the staging area
    commit   (one process)  every slice's fragments, in slice order, in one
                            `LanceDataset.commit(..., LanceOperation.Overwrite(schema, fragments))`
                            (which numbers them afresh); the cells table (obs, each cell's first
                            row); genes; config.json last (`producers/writer.py:finish_dataset`)

A slice's work is `scan_slice` and `write_slice`, functions of the plan (JSON) and the slice's
number: they run in this process (`workers=1`), in this process and `workers - 1` local worker
processes beside it (the same ones for both steps), or in Modal containers (`app/modal_convert.py`).
A slice never splits a cell, and every slice but the last holds whole content-hash blocks, so 1
worker or 64, in any order of completion, write the same tables and the same `content_sha256`.
Nothing is readable at the output until the commit: locally the staging folder
(`.OUT.partial-<plan>`) is renamed into place; on S3 config.json, written last, makes it a
dataset. An interrupted conversion keeps its staging area: the same command again reuses every
slice that finished.
"""

from __future__ import annotations

import producers.heap  # noqa: F401  (first, before Lance starts a thread: its docstring)

# isort: split
import hashlib
import io
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import lance
import numpy as np
import pyarrow as pa
from lance.fragment import FragmentMetadata
from tqdm import tqdm

from coordination.errors import CellfeedError
from coordination.net import forkserver
from producers import CONVERT_WORKER_MODULES
from producers.dataset import LANCE_FILE_VERSION, TABLES, Dataset, expression_schema
from producers.h5ad import align_genes, arrow_frame, obs_frame, open_source
from producers.slices import (
    RECORDS,
    ConvertPlan,
    run_slices,
    scan_slice,
    slice_record,
    start_helpers,
    stop_helpers,
    write_slice,
)
from producers.storage import LocalLocation, Location, S3Settings, location
from producers.writer import CONTENT_BLOCK_CELLS, ROWS_PER_FRAGMENT, ContentHash, finish_dataset, output_exists

FLOAT32_EXACT_INT = 1 << 24
RECORD_READS = 16  # slice records read at once (the commit; a rerun's look for finished slices)
CHUNK_CELLS = 8192  # cells a worker holds at once (`--chunk-cells`)
SLICE_BYTES = 128 << 20  # output per slice (~8 bytes a non-zero as stored: cell id, gene, value)


# --- plan -------------------------------------------------------------------------------------------


def plan_conversion(
    inputs: list[str],
    out: str,
    *,
    layer: str = "X",
    rows_per_fragment: int = ROWS_PER_FRAGMENT,
    chunk_cells: int = CHUNK_CELLS,
    slice_cells: int | None = None,
    block_cells: int = CONTENT_BLOCK_CELLS,
    overwrite: bool = False,
    settings: S3Settings | None = None,
):
    """The plan, the opened inputs (for obs and var) and the output's `Location`; every check that
    needs no matrix values is made here."""
    if not inputs:
        raise CellfeedError("give at least one .h5ad input")
    for name, value in (("chunk size", chunk_cells), ("rows per fragment", rows_per_fragment)):
        if value < 1:
            raise CellfeedError(f"{name} must be >= 1, got {value}")
    sources = [open_source(str(p), layer) for p in inputs]
    align_genes(sources)
    total = sum(s.n_obs for s in sources)
    if total == 0:
        raise CellfeedError("no cells were written; the input holds no cells")
    if slice_cells is None:
        bytes_per_cell = 8 * sum(s.nnz() for s in sources) / total
        slice_cells = block_cells * max(1, int(SLICE_BYTES // max(1.0, block_cells * bytes_per_cell)))
    if slice_cells < 1 or slice_cells % block_cells:
        raise CellfeedError(f"cells per slice must be a positive multiple of {block_cells:,}, got {slice_cells:,}")
    final = location(out, settings)
    final.check_reachable(for_write=True)
    paths = [os.path.abspath(s.path) for s in sources]
    facts = [layer, rows_per_fragment, slice_cells, block_cells, final.uri]
    for p in paths:
        st = os.stat(p)
        facts.append([p, st.st_size, st.st_mtime_ns])
    key = hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]
    staging = _staging_for(final, key, overwrite)
    plan = ConvertPlan(
        inputs=paths,
        layer=layer,
        out=final.uri,
        staging=staging.uri,
        file_cells=[s.n_obs for s in sources],
        n_genes=int(sources[0].matrix.shape[1]),
        slice_cells=slice_cells,
        block_cells=block_cells,
        rows_per_fragment=rows_per_fragment,
        chunk_cells=chunk_cells,
        key=key,
        gene_orders={str(i): s.gene_order.tolist() for i, s in enumerate(sources) if s.gene_order is not None},
    )
    return plan, sources, final


def _staging_for(final: Location, key: str, overwrite: bool) -> Location:
    """Where the slices go until the commit. Locally a hidden sibling named by the plan, renamed
    into place at the end; on S3 (no rename) the output itself, a dataset only once config.json is
    written, with the plan's key recorded so a rerun knows its own unfinished work."""
    if isinstance(final, LocalLocation):
        if final.exists() and not overwrite:
            raise output_exists(final.uri)
        return LocalLocation(final.path.parent / f".{final.path.name}.partial-{key}")
    ours = final.exists(f"{RECORDS}/{key}")
    if final.exists("config.json") and not overwrite:
        raise output_exists(final.uri)
    if final.exists() and not ours and not overwrite:
        raise CellfeedError(
            f"{final.uri} holds files but no dataset (another conversion's unfinished work?); "
            "choose another path or pass --overwrite to replace them"
        )
    return final


def choose_value_type(plan: ConvertPlan, scans: list[list[dict]], allow_negative: bool) -> pa.DataType:
    """uint16 when every value is an integer count that fits, float32 otherwise, never clipped."""
    pieces = [p for scan in scans for p in scan]
    for p in pieces:
        if p["nonfinite_row"] is not None:
            raise CellfeedError(
                f"{plan.inputs[p['file']]}: matrix holds NaN or infinite values (near cell {p['nonfinite_row']}); "
                "clean the input first"
            )
    low = min(pieces, key=lambda p: p["min"])
    if low["min"] < 0 and not allow_negative:
        raise CellfeedError(
            f"{plan.inputs[low['file']]}: matrix holds negative values (min {low['min']:.3g}), so it is not counts; "
            "choose the counts matrix (--layer raw.X or a layer name) or pass --allow-negative to store floats"
        )
    integral, vmax = all(p["integral"] for p in pieces), max(p["max"] for p in pieces)
    if integral and vmax <= np.iinfo(np.uint16).max:
        return pa.uint16()
    if integral and vmax > FLOAT32_EXACT_INT:
        raise CellfeedError(
            f"counts up to {vmax:.0f} exceed what float32 stores exactly ({FLOAT32_EXACT_INT}); "
            "refusing to lose precision"
        )
    return pa.float32()


# --- commit: every slice in one operation ------------------------------------------------------------


def commit(
    plan: ConvertPlan, sources, final: Location, value_type: pa.DataType, layer: str, obs, published=None
) -> Dataset:
    """Commit every slice's fragments and the cells table (`obs`: `obs_frame(sources)`), then finish the
    dataset (config.json last; `published()` the moment it is out)."""
    settings = getattr(final, "settings", None)
    staging = plan.staging_area(settings)
    records = records_of(plan, staging)
    if any(r is None for r in records):
        raise CellfeedError(f"{sum(r is None for r in records)} slices have no record; run the conversion again")
    schema = expression_schema(plan.n_genes, value_type)
    fragments = [FragmentMetadata.from_json(json.dumps(f)) for r in records for f in r["fragments"]]
    expression = lance.LanceDataset.commit(
        staging.join(TABLES["expression"]),
        lance.LanceOperation.Overwrite(schema, fragments),
        storage_options=staging.lance_options(),
    )

    def read(i: int) -> bytes:  # slice i's cell row counts, as saved (.npy)
        return staging.read_bytes(f"{RECORDS}/counts-{i:06d}.npy")

    with ThreadPoolExecutor(RECORD_READS) as pool:  # read side by side (object storage), then parsed in turn:
        saved = list(pool.map(read, range(len(records))))
    # (np.load parses each header with ast, whose state CPython 3.11 shares between threads: two at once
    # failed once in the suite, "AST constructor recursion depth mismatch", as python/cpython#106905 reports)
    counts = np.concatenate([np.load(io.BytesIO(b), allow_pickle=False) for b in saved]).astype(np.int64)
    obs, obs_categories = obs
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    cells = obs.append_column("cell_integer_id", pa.array(np.arange(len(counts), dtype=np.uint32))).append_column(
        "cell_start_index", pa.array(starts, type=pa.int64())
    )
    location(staging.join(TABLES["cells"]), settings).delete()  # (what an interrupted commit began)
    lance.write_dataset(
        cells,
        staging.join(TABLES["cells"]),
        max_rows_per_file=1 << 24,
        storage_options=staging.lance_options(),
        data_storage_version=LANCE_FILE_VERSION,
    )
    _remove_unreferenced(staging, expression)
    var, var_categories = arrow_frame(sources[0].var, "gene_id", sources[0].var.index)
    content = ContentHash(plan.block_cells)
    content.blocks = [d for r in records for d in r["blocks"]]
    dataset = finish_dataset(
        final,
        staging,
        var,
        value_type=value_type,
        n_cells=int(len(counts)),
        n_rows=int(counts.sum()),
        rows_per_fragment=plan.rows_per_fragment,
        content=content,
        metadata={
            "source": {"files": [os.path.basename(p) for p in plan.inputs], "layer": layer},
            "categories": {"obs": obs_categories, "var": var_categories},
        },
        published=published,
    )
    location(final.join(RECORDS), settings).delete()  # last: until the dataset is out, a rerun needs them
    return dataset


def records_of(plan: ConvertPlan, staging: Location) -> list[dict | None]:
    """Every slice's record (None: not written yet): one look when there are none (a first run), else
    read side by side (on S3 a read is a round trip: thousands of slices, one at a time, take minutes)."""
    if not staging.exists(RECORDS):
        return [None] * len(plan.slices())
    with ThreadPoolExecutor(RECORD_READS) as pool:
        return list(pool.map(lambda s: slice_record(plan, staging, s.index), plan.slices()))


def _remove_unreferenced(staging: Location, expression) -> None:
    """Fragment files of slices an interrupted run left half-written (local staging; on S3 they stay,
    unreferenced, until the prefix is deleted)."""
    if not isinstance(staging, LocalLocation):
        return
    keep = {d.path for f in expression.get_fragments() for d in f.metadata.files}
    folder = staging.path / TABLES["expression"] / "data"
    for name in os.listdir(folder) if folder.is_dir() else ():
        if name not in keep:
            os.remove(folder / name)


def convert(
    inputs: list[str],
    out: str,
    *,
    layer: str = "X",
    rows_per_fragment: int = ROWS_PER_FRAGMENT,
    chunk_cells: int = CHUNK_CELLS,
    allow_negative: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    settings: S3Settings | None = None,
    workers: int = 1,
    slice_cells: int | None = None,
    block_cells: int = CONTENT_BLOCK_CELLS,
    on_slice=None,
    runner=None,
    on_published=None,
) -> Dataset:
    """Convert one or more h5ad files (same genes) into one dataset at `out`, `workers` slices at a
    time; `on_slice(result)` as each slice is written (its cells, bytes and worker's peak RSS).
    `runner` runs the slices elsewhere (`run_slices`' signature; Modal's: app/modal_convert.py);
    `progress`: a bar on a terminal (True), none (False), or a line per slice ("lines");
    `on_published()`: called the moment the dataset is out (the command stops taking Ctrl-C there)."""
    if workers > 1 and runner is None:  # its imports run beside the planning (the CLI starts it sooner still)
        forkserver(CONVERT_WORKER_MODULES)
    plan, sources, final = plan_conversion(
        inputs,
        out,
        layer=layer,
        rows_per_fragment=rows_per_fragment,
        chunk_cells=chunk_cells,
        slice_cells=slice_cells,
        block_cells=block_cells,
        overwrite=overwrite,
        settings=settings,
    )
    slices = plan.slices()
    total = sum(plan.file_cells)
    # every cell's obs is the commit's alone: read beside the write, not before it (100M cells: minutes of
    # this process's time), nor beside the scan, whose small reads waited on it for the GIL (DESIGN)
    obs_reader = ThreadPoolExecutor(1, thread_name_prefix="obs")
    helpers = None  # the worker processes, started once the plan has checked every input: they scan and write
    try:
        helpers = start_helpers(min(workers, len(slices))) if runner is None else None
        run = runner or partial(run_slices, helpers=helpers)
        bar = _bar(progress, total, "check values")
        with bar:
            scans = run(
                scan_slice, plan, [s.index for s in slices], (), workers, lambda i, r: bar.update(slices[i].n_cells)
            )
        value_type = choose_value_type(plan, [scans[s.index] for s in slices], allow_negative)
        obs = obs_reader.submit(obs_frame, sources)
        staging, records = _open_staging(plan, final, overwrite)
        todo = [i for i, record in enumerate(records) if record is None]
        bar, written = _bar(progress, total, "convert"), [0]

        def done(i, result):
            if on_slice is not None:
                on_slice(result)
            written[0] += result["bytes"]
            bar.set_postfix_str(f"{written[0] / 2**20:,.1f} MiB written", refresh=False)
            bar.update(result["cells"])

        try:
            with bar:
                if len(todo) < len(slices):  # finished by an earlier run
                    bar.update(total - sum(slices[i].n_cells for i in todo))
                run(write_slice, plan, todo, (str(value_type), getattr(final, "settings", None)), workers, done)
        except KeyboardInterrupt:
            left = sum(r is None for r in records_of(plan, staging))
            print(
                f"convert: interrupted with {left} of {len(slices)} slices to write; the finished ones are kept in "
                f"{staging.uri}: run the same command again to finish (or delete it)",
                file=sys.stderr,
            )
            raise
    finally:
        obs_reader.shutdown(wait=False, cancel_futures=True)
        stop_helpers(helpers)  # (idle by now, or killed by a failure in `run_slices`)
    return commit(plan, sources, final, value_type, layer, obs.result(), on_published)


def _open_staging(plan: ConvertPlan, final: Location, overwrite: bool) -> tuple[Location, list[dict | None]]:
    """The staging area, ready for slices, and the records of the slices an earlier run finished."""
    settings = getattr(final, "settings", None)
    staging = plan.staging_area(settings)
    records = records_of(plan, staging)
    if any(r is None for r in records):
        # a commit that was cut short left the expression table's manifest: its slices are redone, so
        # their fragments must not be written into a committed table (the files stay, for the records)
        location(staging.join(f"{TABLES['expression']}/_versions"), getattr(final, "settings", None)).delete()
    if isinstance(staging, LocalLocation):
        (staging.path / RECORDS).mkdir(parents=True, exist_ok=True)
    else:
        if overwrite and not staging.exists(f"{RECORDS}/{plan.key}"):
            staging.delete()  # an older dataset or another conversion's unfinished work
        staging.write_bytes(f"{RECORDS}/{plan.key}", b"")  # marks the prefix as this plan's work
    return staging, records


def _bar(progress: bool | str, total: int, desc: str):
    if progress == "lines":
        return _Lines(total, desc)
    # disable=None: a bar on a terminal only, quiet in logs (tqdm's own test)
    return tqdm(total=total, desc=desc, unit="cell", unit_scale=True, disable=None if progress else True)


class _Lines:
    """The bar for a log (a Modal container has no terminal): a line, in tqdm's words, per slice done."""

    def __init__(self, total: int, desc: str):
        self.n, self.total, self.desc, self.postfix, self.start = 0, total, desc, None, time.monotonic()

    def update(self, n: int) -> None:
        self.n += n
        elapsed = time.monotonic() - self.start
        line = tqdm.format_meter(self.n, self.total, elapsed, prefix=self.desc, unit="cell", unit_scale=True)
        print(line + (f", {self.postfix}" if self.postfix else ""), flush=True)

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        self.postfix = text

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass
