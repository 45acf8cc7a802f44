"""The wire format of a queue item: bytes only, no pickle.

    header (48 bytes, little-endian)                  payload (zstd frame)
    magic "CFDI" | version u16 | flags u16            cell_ids   u32[n]
    run tag u64 | epoch u32 | key id u64 | seq u32    lengths    u32[n]   tokens per cell
    items in this unit u32                            tokens     u16|u32[n_tokens]
    n_cells u32 | n_tokens u32
    token dtype u8 | value dtype u8 | 2 reserved      values     u8|u16|f32[n_tokens]  (optional)
    payload bytes u32 | crc32 of payload u32          labels     i32[n]                (optional)

`key id` is the unit id, or the cell id when flags has STITCHED; "items in this unit" lets a
consumer tell when it holds all of a unit (resume skips such units). The item key —
(epoch, unit, seq) or (epoch, "cell", cell id) — is what consumers deduplicate on. An item never
exceeds 1 MiB: `pack_items` splits cells over as many items as needed.
"""

from __future__ import annotations

import struct
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import zstandard

from coordination.arrays import CellRows
from coordination.errors import CellfeedError
from coordination.queues import MAX_ITEM_BYTES

MAGIC = b"CFDI"
VERSION = 1
STITCHED, HAS_VALUES, HAS_LABELS = 1, 2, 4
HEADER = struct.Struct("<4sHHQIQIIIIBBxxII")
# dtype codes in item headers and stitching pieces (one numbering for every byte format cellfeed writes)
DTYPES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    3: np.dtype(np.uint32),
    4: np.dtype(np.float32),
    5: np.dtype(np.int32),
}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
_SEQ_OFFSET = 28  # seq and item count: the only header fields filled in after packing
ZSTD_LEVEL = 3
_local = threading.local()


class ItemError(CellfeedError):
    """A queue item that is truncated, corrupt, from another format version, run or epoch."""


@dataclass
class Item:
    epoch: int
    key_id: int  # unit id, or cell id when stitched
    seq: int
    stitched: bool
    run_tag: int
    n_items: int  # items of this unit in all (1 for a stitched cell)
    cell_ids: np.ndarray
    offsets: np.ndarray  # int64[n + 1]
    tokens: np.ndarray
    values: np.ndarray | None = None
    labels: np.ndarray | None = None

    @property
    def key(self) -> tuple:
        return (self.epoch, "cell", self.key_id, 0) if self.stitched else (self.epoch, "unit", self.key_id, self.seq)

    @property
    def n_cells(self) -> int:
        return len(self.cell_ids)


def _compressor():
    if not hasattr(_local, "c"):
        _local.c = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        _local.d = zstandard.ZstdDecompressor()
    return _local.c, _local.d


def pack_item(item: Item) -> bytes:
    """An item's bytes (`unpack_item` gives it back)."""
    cells = CellRows(item.cell_ids, item.offsets, item.tokens, item.values)
    return _packed(cells, item.labels, item.stitched, item.run_tag, item.epoch, item.key_id, item.seq, item.n_items)


def _packed(
    cells: CellRows,
    labels: np.ndarray | None,
    stitched: bool,
    run_tag: int,
    epoch: int,
    key_id: int,
    seq: int = 0,
    n_items: int = 0,
) -> bytes:
    """The header and compressed payload of tokenized cells (`ids`: tokens)."""
    n = cells.n_cells
    lengths = np.diff(cells.offsets).astype(np.uint32)
    tokens = np.ascontiguousarray(cells.ids)
    parts = [np.asarray(cells.cell_ids, dtype=np.uint32).tobytes(), lengths.tobytes(), tokens.tobytes()]
    flags = STITCHED if stitched else 0
    value_code = 0
    if cells.values is not None:
        flags |= HAS_VALUES
        value_code = DTYPE_CODES[cells.values.dtype]
        parts.append(np.ascontiguousarray(cells.values).tobytes())
    if labels is not None:
        flags |= HAS_LABELS
        parts.append(np.asarray(labels, dtype=np.int32).tobytes())
    payload = _compressor()[0].compress(b"".join(parts))
    header = HEADER.pack(
        MAGIC,
        VERSION,
        flags,
        run_tag,
        epoch,
        key_id,
        seq,
        n_items,
        n,
        len(tokens),
        DTYPE_CODES[tokens.dtype],
        value_code,
        len(payload),
        zlib.crc32(payload),
    )
    return header + payload


def unpack_item(data: bytes, run_tag: int | None = None, epoch: int | None = None) -> Item:
    """Verify and decode an item; raises `ItemError` naming what is wrong."""
    if len(data) < HEADER.size:
        raise ItemError(f"truncated item: {len(data)} bytes, shorter than the {HEADER.size}-byte header")
    (
        magic,
        version,
        flags,
        tag,
        item_epoch,
        key_id,
        seq,
        n_items,
        n,
        n_tokens,
        token_code,
        value_code,
        payload_len,
        crc,
    ) = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ItemError(f"not a cellfeed item (magic {magic!r})")
    if version != VERSION:
        raise ItemError(f"item format version {version}, this reader understands {VERSION}; upgrade the reader")
    if run_tag is not None and tag != run_tag:
        raise ItemError(f"item from another run (tag {tag:016x}, expected {run_tag:016x})")
    if epoch is not None and item_epoch != epoch:
        raise ItemError(f"item from epoch {item_epoch}, expected epoch {epoch}")
    payload = memoryview(data)[HEADER.size :]
    if len(payload) != payload_len:
        raise ItemError(f"truncated item: payload has {len(payload)} of {payload_len} bytes")
    if zlib.crc32(payload) != crc:
        raise ItemError("corrupt item: checksum mismatch")
    if token_code not in DTYPES or (flags & HAS_VALUES and value_code not in DTYPES):
        raise ItemError("corrupt item: unknown dtype code")
    try:
        raw = _compressor()[1].decompress(payload)
    except zstandard.ZstdError as exc:
        raise ItemError(f"corrupt item: {exc}") from None
    token_dtype = DTYPES[token_code]
    value_dtype = DTYPES[value_code] if flags & HAS_VALUES else None
    expected = (
        8 * n
        + n_tokens * token_dtype.itemsize
        + (n_tokens * value_dtype.itemsize if value_dtype else 0)
        + (4 * n if flags & HAS_LABELS else 0)
    )
    if len(raw) != expected:
        raise ItemError(f"corrupt item: payload holds {len(raw)} bytes, header implies {expected}")
    buf, pos = np.frombuffer(raw, dtype=np.uint8), 0

    def take(dtype, count):
        nonlocal pos
        arr = buf[pos : pos + count * np.dtype(dtype).itemsize].view(dtype)
        pos += count * np.dtype(dtype).itemsize
        return arr

    cell_ids = take(np.uint32, n).astype(np.int64)
    lengths = take(np.uint32, n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] != n_tokens:
        raise ItemError("corrupt item: cell lengths do not add up to the token count")
    tokens = take(token_dtype, n_tokens)
    values = take(value_dtype, n_tokens) if value_dtype else None
    labels = take(np.int32, n) if flags & HAS_LABELS else None
    return Item(
        item_epoch, key_id, seq, bool(flags & STITCHED), tag, n_items, cell_ids, offsets, tokens, values, labels
    )


def pack_cells(
    tokens: CellRows,
    *,
    epoch: int,
    key_id: int,
    run_tag: int,
    stitched: bool = False,
    labels: np.ndarray | None = None,
    cells_per_item: int = 128,
) -> list[bytearray]:
    """Pack tokenized cells (`ids`: tokens; `labels`: one per cell) into items of at most
    `cells_per_item` cells and 1 MiB, in order, not yet numbered (`number_items` does that once a
    unit's items are all packed). A run of cells over 1 MiB is halved until its items fit."""
    packed: list[bytearray] = []
    todo = [(lo, min(lo + cells_per_item, tokens.n_cells)) for lo in range(0, tokens.n_cells, cells_per_item)]
    todo.reverse()  # (a stack: the next run of cells on top)
    while todo:
        lo, hi = todo.pop()
        data = _packed(
            tokens.slice(lo, hi), None if labels is None else labels[lo:hi], stitched, run_tag, epoch, key_id
        )
        if len(data) <= MAX_ITEM_BYTES:
            packed.append(bytearray(data))
        elif hi - lo > 1:
            todo += [((lo + hi) // 2, hi), (lo, (lo + hi) // 2)]
        else:
            raise ItemError(f"one cell packs to {len(data):,} bytes, over the 1 MiB item limit")
    return packed


def number_items(packed: list[bytearray]) -> list[bytes]:
    """Number a unit's packed items 0, 1, ... in order and record their count (header only)."""
    for seq, data in enumerate(packed):
        struct.pack_into("<II", data, _SEQ_OFFSET, seq, len(packed))
    return [bytes(d) for d in packed]


def pack_items(
    tokens: CellRows,
    *,
    epoch: int,
    key_id: int,
    run_tag: int,
    stitched: bool = False,
    labels: np.ndarray | None = None,
    cells_per_item: int = 128,
) -> list[bytes]:
    """Pack and number tokenized cells (`ids`: tokens): deterministic."""
    return number_items(
        pack_cells(
            tokens,
            epoch=epoch,
            key_id=key_id,
            run_tag=run_tag,
            stitched=stitched,
            labels=labels,
            cells_per_item=cells_per_item,
        )
    )
