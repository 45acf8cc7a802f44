"""Boundary stitching through the map with put-if-absent (docs/DESIGN.md, "Boundary stitching").

The map is the epoch's own (`routing.epoch_map_name`), so the keys need no run or epoch.
Each holder of a piece of cell c (P pieces) first writes its piece under
`c{c}/piece{i}`, then claims the first free arrival slot `c{c}/arrival{j}` with
`put(..., skip_if_exists=True)`, writing its holder id ("<unit>.<piece>": a unit may hold two
pieces of one cell). A slot already holding its own holder id is its own (a re-run). Whoever
holds slot P-1 reads all pieces and emits the cell: every piece is written before its holder
claims a slot, so the last claimer finds them all. Keys are never removed by the emitter: the
driver drops the epoch's whole map when the epoch is complete, and a late duplicate then finds
it gone (`MapGone`) instead of starting a new round.
"""

from __future__ import annotations

import struct

import numpy as np

from coordination.errors import CellfeedError
from coordination.queues import Map
from coordination.wire import DTYPE_CODES, DTYPES

_PIECE = struct.Struct("<4sBBxxI")  # magic, gene dtype code, value dtype code (coordination.wire's), n rows


def piece_key(cell: int, index: int) -> str:
    return f"c{cell}/piece{index}"


def arrival_key(cell: int, slot: int) -> str:
    return f"c{cell}/arrival{slot}"


def encode_piece(genes: np.ndarray, values: np.ndarray) -> bytes:
    genes, values = np.ascontiguousarray(genes), np.ascontiguousarray(values)
    return (
        _PIECE.pack(b"CFDP", DTYPE_CODES[genes.dtype], DTYPE_CODES[values.dtype], len(genes))
        + genes.tobytes()
        + values.tobytes()
    )


def decode_piece(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    magic, gcode, vcode, n = _PIECE.unpack_from(data)
    if magic != b"CFDP" or gcode not in DTYPES or vcode not in DTYPES:
        raise CellfeedError("corrupt boundary piece in the map")
    g, v = DTYPES[gcode], DTYPES[vcode]
    body = memoryview(data)[_PIECE.size :]
    if len(body) != n * (g.itemsize + v.itemsize):
        raise CellfeedError("truncated boundary piece in the map")
    return (
        np.frombuffer(body[: n * g.itemsize], dtype=g).copy(),
        np.frombuffer(body[n * g.itemsize :], dtype=v).copy(),
    )


def offer_piece(
    store: Map, epoch: int, holder: str, cell: int, index: int, count: int, genes: np.ndarray, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """Contribute piece `index` of `count` to the epoch's map `store`; returns the whole cell's
    (genes, values) if this holder must emit it, else None. Raises `MapGone` after the epoch."""
    store.put(piece_key(cell, index), encode_piece(genes, values))
    for slot in range(count):
        key = arrival_key(cell, slot)
        if store.put(key, holder, skip_if_exists=True) or store.get(key) == holder:
            break
    else:
        raise CellfeedError(
            f"cell {cell} of epoch {epoch}: all {count} arrival slots are held by other holders; "
            "the epoch plan and the map disagree (two runs sharing one run id?)"
        )
    if slot != count - 1:
        return None
    pieces = [store.get(piece_key(cell, i)) for i in range(count)]
    missing = [i for i, p in enumerate(pieces) if p is None]
    if missing:
        raise CellfeedError(f"cell {cell} of epoch {epoch}: pieces {missing} missing at the last arrival")
    decoded = [decode_piece(p) for p in pieces]
    return np.concatenate([g for g, _ in decoded]), np.concatenate([v for _, v in decoded])
