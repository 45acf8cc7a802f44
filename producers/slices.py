"""A conversion's unit of work (`producers/convert.py` plans, runs and commits them): the plan every
worker gets as JSON, and what a worker does with one slice of it -- scan its values, or write its rows
as uncommitted Lance fragments with a record of them in the staging area. Both run the same in this
process, a local worker process or a Modal container."""

from __future__ import annotations

import producers.heap  # noqa: F401  (first, before Lance starts a thread: its docstring)

# isort: split
import io
import json
import resource
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
from lance.fragment import write_fragments

from producers.dataset import LANCE_FILE_VERSION, TABLES, expression_schema
from producers.h5ad import Matrix
from producers.storage import Location, S3Settings, location
from producers.writer import ContentHash

RECORDS = "_convert"  # the staging area's slice records (removed at the commit)
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
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # this worker's, so far
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
