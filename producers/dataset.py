"""SLAF-layout datasets: open one (local or S3) and read row ranges (`producers/writer.py` writes one).

Layout (SLAF 0.5, see docs/DESIGN.md): `config.json`, `expression.lance` (one row per non-zero,
cell-major), `cells.lance` (obs + `cell_start_index`), `genes.lance` (var). Fragments of
`expression.lance` are cut by row count, so a cell may straddle two fragments.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

from coordination.arrays import CellRows, merge_ranges, offsets_of, ragged_arange, rows_of_spans
from coordination.errors import CellfeedError
from producers.storage import (
    REMOTE_READS_MAX,
    REMOTE_READS_START,
    UNREACHABLE,
    LocalLocation,
    Location,
    ReadSlots,
    S3Settings,
    StorageUnavailable,
    error_text,
    location,
)

FORMAT_VERSION = "0.5"
TABLES = {"expression": "expression.lance", "cells": "cells.lance", "genes": "genes.lance"}
EXPRESSION_COLUMNS = ("cell_integer_id", "gene_integer_id", "value")
LANCE_FILE_VERSION = "2.2"  # what SLAF 0.5 pins
MAX_UINT16_GENES = 65_535
SPOT_CELLS = 64  # cells whose offsets `Dataset.verify` checks against the expression table, evenly + at random
TAKE_BELOW_MEAN_ROWS = 5_000  # mean rows per range under which one `take` beats per-range slices
SLICE_ROWS = 1 << 18  # longer ranges are read as several slices, decoded (and fetched) in parallel
LOCAL_READ_THREADS = 4  # slices read at once from disk: CPU work (object storage: `Dataset.read_slots`)


def gene_id_type(n_genes: int) -> pa.DataType:
    return pa.uint16() if n_genes <= MAX_UINT16_GENES else pa.int32()


def expression_schema(n_genes: int, value_type: pa.DataType) -> pa.Schema:
    return pa.schema(
        [("cell_integer_id", pa.uint32()), ("gene_integer_id", gene_id_type(n_genes)), ("value", value_type)]
    )


@dataclass(frozen=True)
class Fragment:
    """One Lance fragment of expression.lance and the global rows [row_start, row_end) it holds."""

    id: int
    row_start: int
    row_end: int


@dataclass
class RowBlock:
    """Expression rows as parallel NumPy arrays, in storage order. `cell` is None when the reader
    did not ask for it (a producer knows each cell's rows from the cell index)."""

    cell: np.ndarray | None
    gene: np.ndarray
    value: np.ndarray

    def __len__(self) -> int:
        return len(self.gene)


class DatasetDamaged(CellfeedError):
    """The dataset's files disagree with each other (metadata, offsets, fragments): training on it
    would train wrong rows as cells. Not retried: converting it again is the fix."""

    def __init__(self, message: str):
        super().__init__(f"{message}. The dataset is damaged: convert it again (or copy it whole)")


def _open_lance(uri: str, options: dict | None, what: str) -> lance.LanceDataset:
    try:
        return lance.dataset(uri, storage_options=options)
    except Exception as exc:  # noqa: BLE001 - one clear line for the user
        raise CellfeedError(f"cannot open the {what} table at {uri}: {error_text(exc)}") from None


class Dataset:
    """An opened dataset: shape, fragments, the cell→row index, obs/var, and row reads."""

    def __init__(self, loc: Location, config: dict):
        self.location = loc
        self.uri = loc.uri
        self.config = config
        tables = config.get("tables") or {}
        missing = [t for t in TABLES if t not in tables]
        if missing:
            raise CellfeedError(
                f"{self.uri}/config.json lists no {', '.join(missing)} table; the dataset is incomplete"
            )
        opts = loc.lance_options()
        self.expression = _open_lance(loc.join(tables["expression"]), opts, "expression")
        self.cells = _open_lance(loc.join(tables["cells"]), opts, "cells")
        self.genes = _open_lance(loc.join(tables["genes"]), opts, "genes")
        names = set(self.expression.schema.names)
        if not set(EXPRESSION_COLUMNS) <= names:
            raise CellfeedError(
                f"{tables['expression']} at {self.uri} has columns {sorted(names)}; expected {list(EXPRESSION_COLUMNS)}"
            )
        cell_rows = self.cells.count_rows()
        if "n_cells" in config and int(config["n_cells"]) != cell_rows:
            raise DatasetDamaged(
                f"{self.uri}/config.json says {int(config['n_cells']):,} cells, but "
                f"{tables['cells']} holds {cell_rows:,}: the metadata does not match the data"
            )
        self.n_cells = cell_rows
        self.n_genes = int(config.get("n_genes", self.genes.count_rows()))
        self.n_rows = self.expression.count_rows()
        self.value_type = self.expression.schema.field("value").type
        # object storage: its slice reads in flight, paced by the reader (`ReadSlots.pace`); local disk: a fixed pool
        self.read_slots = None if isinstance(loc, LocalLocation) else ReadSlots(REMOTE_READS_START)

    def verify(self, spot_cells: int = SPOT_CELLS) -> "Dataset":
        """The cheap checks at open, in time proportional to the metadata (not the data): every
        expression fragment's files exist (local storage); the cell offsets are monotone, start at
        0 and stay within the expression table, whose rows they share out exactly; and for
        `spot_cells` cells, evenly spread and seeded-random, the first and last expression rows the
        offsets give them do belong to them (their `cell_integer_id`: one `take` of 2 rows a
        cell). Raises `DatasetDamaged` naming the file and the fault. `cellfeed inspect --check`
        reads everything instead (`check_all`)."""
        self._check_fragment_files()
        try:
            starts = self.cell_row_start
        except Exception as exc:  # noqa: BLE001 - one line naming the table
            raise self._read_error(exc, f"{TABLES['cells']}'s cell_start_index") from None
        steps = np.diff(starts)
        if len(starts) > 1 and (starts[0] != 0 or (steps < 0).any()):
            bad = 0 if starts[0] != 0 else int(np.flatnonzero(steps < 0)[0])
            raise DatasetDamaged(
                f"{self.uri}/{TABLES['cells']}: cell_start_index is not increasing from 0 (at cell "
                f"{bad:,}: {int(starts[bad]):,}, then {int(starts[bad + 1]):,})"
            )
        if len(starts) > 1 and starts[-2] > self.n_rows:
            raise DatasetDamaged(
                f"{self.uri}/{TABLES['cells']}: cell_start_index points past the expression table's "
                f"{self.n_rows:,} rows (cell {self.n_cells - 1:,} starts at {int(starts[-2]):,})"
            )
        with_rows = np.flatnonzero(steps > 0)
        if len(with_rows) and spot_cells:
            even = with_rows[np.linspace(0, len(with_rows) - 1, min(spot_cells, len(with_rows))).astype(np.int64)]
            rng = np.random.default_rng(len(with_rows))
            chosen = np.unique(
                np.concatenate([even, rng.choice(with_rows, min(spot_cells, len(with_rows)), replace=False)])
            )
            rows = np.stack([starts[chosen], starts[chosen + 1] - 1], axis=1).reshape(-1)
            try:
                owners = self.expression.take(rows, columns=["cell_integer_id"]).column(0).to_numpy()
            except Exception as exc:  # noqa: BLE001 - a truncated or unreachable fragment: one line
                raise self._read_error(exc, "checking a sample of cells' rows") from None
            wrong = np.flatnonzero(owners != np.repeat(chosen, 2))
            if len(wrong):
                cell, row = int(np.repeat(chosen, 2)[wrong[0]]), int(rows[wrong[0]])
                raise DatasetDamaged(
                    f"{self.uri}: {TABLES['cells']}'s cell_start_index disagrees with {TABLES['expression']}: cell "
                    f"{cell:,} is given row {row:,}, which belongs to cell {int(owners[wrong[0]]):,} (checked "
                    f"{len(chosen):,} cells; `cellfeed inspect --check` reads them all)"
                )
        return self

    def _check_fragment_files(self) -> None:
        """(local storage) every data file the expression table's manifest lists exists."""
        if not isinstance(self.location, LocalLocation):
            return  # on object storage a missing object fails its first read, naming it
        root = Path(self.location.join(self.config["tables"]["expression"])) / "data"
        for frag in self._lance_fragments:
            for data in frag.data_files():
                if not (root / data.path).exists():
                    raise DatasetDamaged(
                        f"{self.uri}: expression fragment {frag.fragment_id}'s file {root / data.path} is missing"
                    )

    def check_all(self, progress=None) -> int:
        """`cellfeed inspect --check`: read every expression fragment whole and check that each of
        its rows belongs to the cell the offsets give it, and that the fragments hold the manifest's
        rows. Returns the rows checked; raises `DatasetDamaged` at the first fault."""
        self.verify(spot_cells=0)
        starts = self.cell_row_start
        checked = 0
        for frag in self._lance_fragments:
            try:
                ids = (
                    pa.concat_arrays([b.column(0) for b in frag.to_batches(columns=["cell_integer_id"])]).to_numpy(
                        zero_copy_only=False
                    )
                    if frag.count_rows()
                    else np.zeros(0, np.int64)
                )
            except Exception as exc:  # noqa: BLE001 - a damaged file: one line
                raise DatasetDamaged(
                    f"{self.uri}: expression fragment {frag.fragment_id} cannot be read ({error_text(exc)})"
                ) from None
            first = checked
            want = np.searchsorted(starts, np.arange(first, first + len(ids)), side="right") - 1
            wrong = np.flatnonzero(ids != want)
            if len(wrong):
                row = first + int(wrong[0])
                raise DatasetDamaged(
                    f"{self.uri}: expression row {row:,} (fragment {frag.fragment_id}) belongs to "
                    f"cell {int(ids[wrong[0]]):,}, but cell_start_index gives it to cell "
                    f"{int(want[wrong[0]]):,}"
                )
            checked += len(ids)
            if progress is not None:
                progress(checked, self.n_rows)
        if checked != self.n_rows:
            raise DatasetDamaged(
                f"{self.uri}: the expression fragments hold {checked:,} rows, the manifest {self.n_rows:,}"
            )
        return checked

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_cells, self.n_genes)

    @property
    def is_counts(self) -> bool:
        """True when values are integer counts (what rank-based tokenizers need)."""
        return pa.types.is_integer(self.value_type)

    @cached_property
    def _lance_fragments(self) -> list:
        return self.expression.get_fragments()

    @cached_property
    def fragments(self) -> list[Fragment]:
        out, start = [], 0
        for frag in self._lance_fragments:
            n = frag.count_rows()
            out.append(Fragment(frag.fragment_id, start, start + n))
            start += n
        return out

    @cached_property
    def fragment_row_start(self) -> np.ndarray:
        """int64[n_fragments + 1]: fragment f holds expression rows [start[f], start[f + 1])."""
        if not self.fragments:
            return np.array([0, self.n_rows], dtype=np.int64)
        return np.array([f.row_start for f in self.fragments] + [self.n_rows], dtype=np.int64)

    @cached_property
    def cell_row_start(self) -> np.ndarray:
        """int64[n_cells + 1]: cell c owns expression rows [start[c], start[c + 1])."""
        if "cell_start_index" in self.cells.schema.names:
            starts = self.cells.to_table(columns=["cell_start_index"]).column(0).to_numpy()
            offsets = np.empty(len(starts) + 1, dtype=np.int64)
            offsets[:-1] = starts
        else:  # datasets without the index (older SLAF): count rows per cell once
            counts = np.zeros(self.n_cells, dtype=np.int64)
            for batch in self.expression.to_batches(columns=["cell_integer_id"], batch_size=1 << 20):
                counts += np.bincount(batch.column(0).to_numpy(), minlength=self.n_cells)
            offsets = np.zeros(self.n_cells + 1, dtype=np.int64)
            np.cumsum(counts, out=offsets[1:])
        offsets[-1] = self.n_rows
        return offsets

    @property
    def obs_columns(self) -> list[str]:
        return [c for c in self.cells.schema.names if c not in ("cell_start_index",)]

    def obs(self, columns: list[str] | None = None) -> pa.Table:
        if columns:
            unknown = [c for c in columns if c not in self.cells.schema.names]
            if unknown:
                raise CellfeedError(f"unknown obs column(s) {unknown}; available: {self.obs_columns}")
        return self.cells.to_table(columns=columns)

    def var(self, columns: list[str] | None = None) -> pa.Table:
        return self.genes.to_table(columns=columns)

    def close(self) -> None:
        """End the read threads, if any were started (a later read starts them again)."""
        pool = self.__dict__.pop("_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)

    @cached_property
    def _pool(self) -> ThreadPoolExecutor:
        threads = LOCAL_READ_THREADS if self.read_slots is None else REMOTE_READS_MAX  # (remote: the slots limit them)
        return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cellfeed-read")

    @staticmethod
    def _block(table: pa.Table) -> RowBlock:
        cell = table.column("cell_integer_id").to_numpy() if "cell_integer_id" in table.column_names else None
        return RowBlock(cell, table.column("gene_integer_id").to_numpy(), table.column("value").to_numpy())

    def _read_piece(self, piece: tuple[int, int, int], columns: list[str]) -> pa.Table:
        frag, offset, limit = piece
        slot = contextlib.nullcontext() if self.read_slots is None else self.read_slots.read(limit)
        with slot:
            try:
                # in one batch, not Lance's default of 8,192 rows: a block's 104k rows were 13 batches,
                # each decoded, handed over and concatenated on its own (a producer's cells per CPU-second
                # +10-21%, measured interleaved: benchmarks/README.md, "One producer")
                scan = self._lance_fragments[frag].scanner(
                    columns=columns, offset=offset, limit=limit, batch_size=max(1, limit)
                )
                return scan.to_table()
            except Exception as exc:  # noqa: BLE001 - one line naming the dataset and fragment
                raise self._read_error(exc, f"fragment {self.fragments[frag].id}") from None

    def _read_error(self, exc: Exception, where: str) -> CellfeedError:
        text = error_text(exc)
        if UNREACHABLE.search(text) and not isinstance(self.location, LocalLocation):  # (a local file is no store)
            return StorageUnavailable(f"cannot reach the rows of {self.uri} ({where}): {text}; is the object store up?")
        return CellfeedError(
            f"cannot read rows of {self.uri} ({where}): {text}; the dataset is damaged or was "
            "changed while in use: write it again (`cellfeed convert`/`synth`) or restore it"
        )

    def read_rows(self, start: int, stop: int) -> RowBlock:
        """Expression rows [start, stop) in storage order."""
        return self.read_row_ranges(np.array([[start, stop]]))

    def read_row_ranges(self, ranges: np.ndarray, with_cell_ids: bool = True) -> RowBlock:
        """Rows of many [start, stop) ranges at once, concatenated in the order given (`_read_ranges`).
        Without `with_cell_ids` the cell column is not read (a third less to fetch and decode)."""
        return self._block(self._read_ranges(ranges, EXPRESSION_COLUMNS if with_cell_ids else EXPRESSION_COLUMNS[1:]))

    def read_cells(self, cell_ids: np.ndarray, ranges: np.ndarray | None = None, spans=None) -> CellRows:
        """Cells' rows as `CellRows`, in the order given: cell i's are rows `spans[i]` ([start, stop)
        of the expression table; default: all of its rows; a boundary cell's piece is a span of its
        rows), read in one go through `ranges` (sorted, disjoint [start, stop) ranges holding every
        span, as a unit's part reads; default: the spans merged). Where the spans lie end to end in
        what is read (a unit's cells and pieces in storage order), the container holds the arrays
        read, with no copy; else each cell's rows are copied out (`rows_of_spans`)."""
        cell_ids = np.asarray(cell_ids, dtype=np.int64)
        if spans is None:
            starts = self.cell_row_start
            spans = np.stack([starts[cell_ids], starts[cell_ids + 1]], axis=1)
        spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        if ranges is None:
            ranges = merge_ranges(spans[:, 0], spans[:, 1])
        ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        table = self._read_ranges(ranges, EXPRESSION_COLUMNS[1:])
        genes, values = table.column("gene_integer_id").to_numpy(), table.column("value").to_numpy()
        counts = spans[:, 1] - spans[:, 0]
        end_to_end = len(genes) == counts.sum() and bool(np.all(spans[1:, 0] >= spans[:-1, 1]))
        if not end_to_end:
            genes, values = rows_of_spans(ranges, spans, genes, values)
        return CellRows(cell_ids, offsets_of(counts), genes, values)

    def _read_ranges(self, ranges: np.ndarray, columns) -> pa.Table:
        """Rows of many [start, stop) ranges at once, concatenated in the order given.

        Each range is cut at fragment edges and read as contiguous slices of fragments on a pool of
        threads (Lance releases the GIL): several times faster than a row `take` for ranges of a
        few cells or more. On object storage as many are in flight as the reader's pace needs
        (`read_slots`). On local disk many tiny ranges (single cells) go through one `take`, which
        beats paying a slice's fixed cost per range."""
        ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        bounds = self.fragment_row_start
        pieces = []
        for start, stop in ranges.tolist():
            if not 0 <= start <= stop <= self.n_rows:
                raise IndexError(f"row range [{start}, {stop}) outside 0..{self.n_rows}")
            f = int(np.searchsorted(bounds, start, side="right")) - 1
            while start < stop:
                end = min(stop, int(bounds[f + 1]), start + SLICE_ROWS)
                pieces.append((f, start - int(bounds[f]), end - start))
                start = end
                f += end == int(bounds[f + 1])
        columns = list(columns)
        local = isinstance(self.location, LocalLocation)  # remote: Lance's take sends its GETs a few at a time
        if local and len(pieces) > 1 and sum(p[2] for p in pieces) < TAKE_BELOW_MEAN_ROWS * len(pieces):
            try:
                return self.expression.take(ragged_arange(ranges[:, 0], ranges[:, 1]), columns=columns)
            except Exception as exc:  # noqa: BLE001
                raise self._read_error(exc, f"{len(ranges)} row ranges") from None
        if not pieces:
            return expression_schema(self.n_genes, self.value_type).empty_table().select(columns)
        if len(pieces) == 1:
            return self._read_piece(pieces[0], columns)
        return pa.concat_tables(self._pool.map(lambda piece: self._read_piece(piece, columns), pieces))

    def straddling_cells(self) -> np.ndarray:
        """Ids of cells whose rows are cut by a fragment boundary."""
        bounds = self.fragment_row_start[1:-1]
        starts = self.cell_row_start
        cell = np.searchsorted(starts, bounds, side="right") - 1
        cut = (starts[cell] < bounds) & (starts[np.minimum(cell + 1, self.n_cells)] > bounds)
        return np.unique(cell[cut])

    @cached_property
    def identity(self) -> str:
        """What a checkpoint records of the data it was trained on (a resume onto other data is
        refused): the cell count and a content fingerprint -- the one `convert`/`synth` wrote
        (every cell's row count, genes and values), else one of the shape and the cell offsets.
        Where the dataset lives is not part of it (the epoch plan's id, checked inside an epoch, has it)."""
        content = self.config.get("metadata", {}).get("content_sha256")
        if content is None:
            h = hashlib.sha256(json.dumps([self.n_cells, self.n_genes, self.n_rows]).encode())
            h.update(np.ascontiguousarray(self.cell_row_start).tobytes())
            content = h.hexdigest()
        return f"{self.n_cells:,} cells, content {content[:12]}"

    @cached_property
    def fingerprint(self) -> str:
        """Identifies this exact dataset content (epoch plans are functions of it)."""
        desc = {
            "uri": self.uri,
            "shape": [self.n_cells, self.n_genes, self.n_rows],
            "versions": [self.expression.version, self.cells.version, self.genes.version],
            "fragments": [[f.id, f.row_start, f.row_end] for f in self.fragments],
        }
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


def open_dataset(uri: str | os.PathLike, settings: S3Settings | None = None, verify: bool = True) -> Dataset:
    """Open a dataset (ours or written by `slaf convert`) at a local path or s3://bucket/prefix,
    checked cheaply (`Dataset.verify`) unless `verify` is False."""
    loc = location(uri, settings)
    if isinstance(loc, LocalLocation) and not loc.exists():
        raise CellfeedError(f"no dataset at {loc.uri}: the path does not exist")
    loc.check_reachable()
    try:
        raw = loc.read_bytes("config.json")
    except (FileNotFoundError, NotADirectoryError):
        raise CellfeedError(
            f"{loc.uri} is not a dataset: config.json is missing (write one with `cellfeed convert` or "
            "`cellfeed synth`)"
        ) from None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CellfeedError(f"{loc.uri}/config.json is not valid JSON ({exc.msg}); the dataset is damaged") from None
    if not isinstance(config, dict):
        raise CellfeedError(f"{loc.uri}/config.json is not a JSON object; the dataset is damaged")
    dataset = Dataset(loc, config)
    return dataset.verify() if verify else dataset
