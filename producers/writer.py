"""Writing a SLAF-layout dataset chunk by chunk, visible only once whole (`convert` and `synth` use it).

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
    error_text,
    expression_schema,
    gene_id_type,
    open_dataset,
)
from producers.storage import LocalLocation, Location, S3Settings, location


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
        rows_per_fragment: int = 1 << 22,
        overwrite: bool = False,
        settings: S3Settings | None = None,
    ):
        if rows_per_fragment < 1:
            raise CellfeedError(f"rows per fragment must be >= 1, got {rows_per_fragment}")
        self.final = location(uri, settings)
        self.final.check_reachable(for_write=True)
        if self.final.exists() and not overwrite:
            raise CellfeedError(f"{self.final.uri} already exists; choose another path or pass --overwrite")
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
        # of every cell's row count, genes and values, each in order and as stored (`Dataset.identity`):
        # the same data gives the same hash however it is cut into appends
        self._content = [hashlib.sha256() for _ in range(3)]
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
        stored = (
            counts.astype(np.int64),
            np.asarray(genes).astype(schema.field(1).type.to_pandas_dtype(), copy=False),
            np.asarray(values).astype(schema.field(2).type.to_pandas_dtype(), copy=False),
        )
        for h, part in zip(self._content, stored):
            h.update(np.ascontiguousarray(part).tobytes())
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
        var = var.append_column("gene_integer_id", pa.array(np.arange(self.n_genes), type=gene_id_type(self.n_genes)))
        lance.write_dataset(
            var,
            self.staging.join(TABLES["genes"]),
            storage_options=self.staging.lance_options(),
            data_storage_version=LANCE_FILE_VERSION,
        )
        config = {
            "format_version": FORMAT_VERSION,
            "array_shape": [self.n_cells, self.n_genes],
            "n_cells": self.n_cells,
            "n_genes": self.n_genes,
            "tables": dict(TABLES),
            "metadata": {
                "expression_count": self.n_rows,
                "density": self.n_rows / max(1, self.n_cells * self.n_genes),
                "value_type": str(self.value_type),
                "rows_per_fragment": self.rows_per_fragment,
                "writer": "cellfeed",
                "content_sha256": hashlib.sha256("".join(h.hexdigest() for h in self._content).encode()).hexdigest(),
                **(metadata or {}),
            },
        }
        self.staging.write_bytes("config.json", json.dumps(config, indent=2).encode())
        if isinstance(self.final, LocalLocation):
            self._move_into_place()
        self._done = True
        return open_dataset(self.final.uri, getattr(self.final, "settings", None))

    def _move_into_place(self) -> None:
        final = self.final.path
        trash = None
        if final.exists():
            trash = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(final, trash)
        os.rename(self.staging.path, final)
        if trash is not None:
            LocalLocation(trash).delete()

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
