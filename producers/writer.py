"""Writing a SLAF-layout dataset chunk by chunk, visible only once whole (`synth` streams through
`DatasetWriter`; `convert` writes slices apart and commits them with `finish_dataset`).

The layout's names (tables, schema, format version) live with the reader, `producers/dataset.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import uuid

import lance
import numpy as np
import pyarrow as pa

from coordination.errors import CellfeedError
from producers.dataset import (
    FORMAT_VERSION,
    LANCE_FILE_VERSION,
    TABLES,
    Dataset,
    expression_schema,
    gene_id_type,
    open_dataset,
)
from producers.storage import LocalLocation, Location, S3Settings, error_text, location

ROWS_PER_FRAGMENT = 1 << 22  # expression rows per Lance fragment, unless asked otherwise
CONTENT_BLOCK_CELLS = 4096  # cells per block of the content hash (recorded with it: `content_block_cells`)


class ContentHash:
    """`metadata.content_sha256`, what a checkpoint ties itself to: of every cell's row count, genes
    and values as stored, in blocks of `block_cells` cells (a block's digest hashes one sha256 of
    each of the three), and the dataset's hash is the sha256 of its blocks' digests in order. The
    same cells give the same hash however they were cut: into appends, or into slices converted
    apart (a slice starts at a block boundary, so it hashes its own blocks)."""

    def __init__(self, block_cells: int = CONTENT_BLOCK_CELLS):
        if block_cells < 1:
            raise ValueError(f"block_cells must be >= 1, got {block_cells}")
        self.block_cells = block_cells
        self.blocks: list[str] = []
        self._parts = [hashlib.sha256() for _ in range(3)]
        self._in_block = 0

    def update(self, counts: np.ndarray, genes: np.ndarray, values: np.ndarray) -> None:
        """Add cells: their row counts, and their genes and values as stored, in order."""
        counts = np.asarray(counts, dtype=np.int64)
        ends = np.concatenate([[0], np.cumsum(counts)])
        first = 0
        while first < len(counts):
            take = min(len(counts) - first, self.block_cells - self._in_block)
            lo, hi = ends[first], ends[first + take]
            for h, part in zip(self._parts, (counts[first : first + take], genes[lo:hi], values[lo:hi])):
                h.update(np.ascontiguousarray(part))  # (the buffer itself: no copy)
            self._in_block += take
            first += take
            if self._in_block == self.block_cells:
                self._close_block()

    def _close_block(self) -> None:
        self.blocks.append(hashlib.sha256("".join(h.hexdigest() for h in self._parts).encode()).hexdigest())
        self._parts = [hashlib.sha256() for _ in range(3)]
        self._in_block = 0

    def digests(self) -> list[str]:
        """Every block's digest; a last, partial block is closed (only a dataset's last cells end one)."""
        if self._in_block:
            self._close_block()
        return list(self.blocks)

    @staticmethod
    def combine(digests: list[str]) -> str:
        return hashlib.sha256("".join(digests).encode()).hexdigest()


class _LanceStream:
    """Feeds record batches to `lance.write_dataset` running in a thread: any size, bounded memory."""

    def __init__(self, uri: str, schema: pa.Schema, options: dict | None, rows_per_fragment: int):
        self.schema = schema
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self._error: BaseException | None = None
        kwargs = dict(
            schema=schema,
            mode="create",
            max_rows_per_file=rows_per_fragment,
            storage_options=options,
            data_storage_version=LANCE_FILE_VERSION,
        )
        self._thread = threading.Thread(target=self._run, args=(uri, kwargs), daemon=True)
        self._thread.start()

    def _batches(self):
        while (batch := self._queue.get()) is not None:
            yield batch

    def _run(self, uri, kwargs):
        try:
            reader = pa.RecordBatchReader.from_batches(self.schema, self._batches())
            lance.write_dataset(reader, uri, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self._error = exc
            while self._queue.get() is not None:  # unblock the producer side
                pass

    def put(self, batch: pa.RecordBatch | None) -> None:
        while True:
            if self._error is not None:
                raise CellfeedError(f"writing a Lance table failed: {error_text(self._error)}")
            try:
                self._queue.put(batch, timeout=1.0)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    raise CellfeedError("the Lance writer stopped unexpectedly") from None

    def close(self) -> None:
        self.put(None)
        self._thread.join()
        if self._error is not None:
            raise CellfeedError(f"writing a Lance table failed: {error_text(self._error)}")


def output_exists(uri: str) -> CellfeedError:
    """The one refusal of an output already there (the writer's and the converter's)."""
    return CellfeedError(f"{uri} already exists; choose another path or pass --overwrite")


class DatasetWriter:
    """Writes a dataset chunk by chunk and makes it visible only on `commit`.

    Locally it writes into a hidden sibling folder and renames it into place; on S3 (no rename)
    it writes config.json last, so a dataset without config.json is never taken as valid, and
    `abort` deletes what was written.
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        n_genes: int,
        value_type: pa.DataType,
        rows_per_fragment: int = ROWS_PER_FRAGMENT,
        overwrite: bool = False,
        settings: S3Settings | None = None,
    ):
        if rows_per_fragment < 1:
            raise CellfeedError(f"rows per fragment must be >= 1, got {rows_per_fragment}")
        self.final = location(uri, settings)
        self.final.check_reachable(for_write=True)
        if self.final.exists() and not overwrite:
            raise output_exists(self.final.uri)
        if isinstance(self.final, LocalLocation):
            parent, name = self.final.path.parent, self.final.path.name
            self.staging: Location = LocalLocation(parent / f".{name}.partial-{uuid.uuid4().hex[:8]}")
            try:
                self.staging.path.mkdir()
            except OSError as exc:
                raise CellfeedError(
                    f"cannot write {self.final.uri} ({exc.strerror}): choose an output path in a "
                    "folder you can write to"
                ) from None
        else:
            if overwrite:
                self.final.delete()
            self.staging = self.final
        self.n_genes = n_genes
        self.value_type = value_type
        self.rows_per_fragment = rows_per_fragment
        self.n_cells = 0
        self.n_rows = 0
        self._content = ContentHash()
        self._expression: _LanceStream | None = None
        self._cells: _LanceStream | None = None
        self._done = False

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._done:
            self.abort()

    def append(self, obs: pa.Table, indptr: np.ndarray, genes: np.ndarray, values: np.ndarray) -> None:
        """Append cells: `obs` rows, and their non-zeros as CSR (`indptr`, sorted `genes`, `values`)."""
        n = obs.num_rows
        if len(indptr) != n + 1:
            raise ValueError("indptr must have one entry more than obs rows")
        counts = np.diff(indptr).astype(np.int64)
        cell_ids = np.arange(self.n_cells, self.n_cells + n, dtype=np.uint32)
        starts = self.n_rows + np.asarray(indptr[:-1], dtype=np.int64) - int(indptr[0])
        obs = obs.append_column("cell_integer_id", pa.array(cell_ids)).append_column(
            "cell_start_index", pa.array(starts, type=pa.int64())
        )
        if self._cells is None:
            opts = self.staging.lance_options()
            schema = expression_schema(self.n_genes, self.value_type)
            self._expression = _LanceStream(
                self.staging.join(TABLES["expression"]), schema, opts, self.rows_per_fragment
            )
            self._cells = _LanceStream(self.staging.join(TABLES["cells"]), obs.schema, opts, 1 << 24)
        for batch in obs.cast(self._cells.schema).to_batches():
            self._cells.put(batch)
        schema = self._expression.schema
        self._expression.put(
            pa.RecordBatch.from_arrays(
                [
                    pa.array(np.repeat(cell_ids, counts), type=pa.uint32()),
                    pa.array(np.asarray(genes).astype(schema.field(1).type.to_pandas_dtype(), copy=False)),
                    pa.array(np.asarray(values).astype(schema.field(2).type.to_pandas_dtype(), copy=False)),
                ],
                schema=schema,
            )
        )
        self._content.update(
            counts,
            np.asarray(genes).astype(schema.field(1).type.to_pandas_dtype(), copy=False),
            np.asarray(values).astype(schema.field(2).type.to_pandas_dtype(), copy=False),
        )
        self.n_cells += n
        self.n_rows += int(counts.sum())

    def commit(self, var: pa.Table, metadata: dict | None = None) -> Dataset:
        """Finish the tables, write genes.lance and config.json, and make the dataset visible."""
        if self._cells is None:
            raise CellfeedError("no cells were written; the input holds no cells")
        if var.num_rows != self.n_genes:
            raise ValueError(f"var has {var.num_rows} rows, expected {self.n_genes}")
        self._expression.close()
        self._cells.close()
        dataset = finish_dataset(
            self.final,
            self.staging,
            var,
            value_type=self.value_type,
            n_cells=self.n_cells,
            n_rows=self.n_rows,
            rows_per_fragment=self.rows_per_fragment,
            content=self._content,
            metadata=metadata,
        )
        self._done = True
        return dataset

    def abort(self) -> None:
        """Remove everything written so far; never leaves a dataset that looks valid."""
        if self._done:
            return
        for stream in (self._expression, self._cells):
            if stream is not None and stream._thread.is_alive():
                try:
                    stream.close()
                except CellfeedError:
                    pass
        self.staging.delete()
        self._done = True


def finish_dataset(
    final: Location,
    staging: Location,
    var: pa.Table,
    *,
    value_type: pa.DataType,
    n_cells: int,
    n_rows: int,
    rows_per_fragment: int,
    content: ContentHash,
    metadata: dict | None = None,
    published=None,
) -> Dataset:
    """With the cells and expression tables committed in `staging`: write genes.lance and, last,
    config.json, and move the dataset into place (locally a rename; on S3 `staging` is `final`,
    and config.json, written last, is what makes it a dataset). `published()` is called the moment
    it is out."""
    n_genes = var.num_rows
    var = var.append_column("gene_integer_id", pa.array(np.arange(n_genes), type=gene_id_type(n_genes)))
    location(staging.join(TABLES["genes"]), getattr(staging, "settings", None)).delete()  # (an interrupted commit's)
    lance.write_dataset(
        var,
        staging.join(TABLES["genes"]),
        storage_options=staging.lance_options(),
        data_storage_version=LANCE_FILE_VERSION,
    )
    digests = content.digests()
    config = {
        "format_version": FORMAT_VERSION,
        "array_shape": [n_cells, n_genes],
        "n_cells": n_cells,
        "n_genes": n_genes,
        "tables": dict(TABLES),
        "metadata": {
            "expression_count": n_rows,
            "density": n_rows / max(1, n_cells * n_genes),
            "value_type": str(value_type),
            "rows_per_fragment": rows_per_fragment,
            "writer": "cellfeed",
            "content_sha256": ContentHash.combine(digests),
            "content_block_cells": content.block_cells,
            **(metadata or {}),
        },
    }
    staging.write_bytes("config.json", json.dumps(config, indent=2).encode())
    settings = getattr(final, "settings", None)
    published = published or (lambda: None)
    if not (isinstance(final, LocalLocation) and staging.uri != final.uri):
        published()
        return open_dataset(final.uri, settings)
    open_dataset(staging.uri)  # checked before it is published, and the rename is the last step
    _move_into_place(staging, final, published)
    return open_dataset(final.uri, settings, verify=False)


def _move_into_place(staging: LocalLocation, final: LocalLocation, published) -> None:
    trash = None
    if final.path.exists():
        trash = final.path.with_name(f".{final.path.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final.path, trash)
    os.rename(staging.path, final.path)
    published()
    if trash is not None:
        LocalLocation(trash).delete()
