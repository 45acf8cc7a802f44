"""The in-memory queue/map shim keeps Modal's semantics; items round-trip and reject bad bytes;
stitching emits every boundary cell exactly once under any interleaving."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from coordination.arrays import CellRows
from coordination.queues import MAX_ITEM_BYTES, Empty, Full, ItemTooLarge, MapGone, MemoryMap, MemoryQueue
from coordination.wire import Item, ItemError, pack_item, pack_items, unpack_item
from producers.stitch import arrival_key, offer_piece

# ----------------------------------------------------------------------------------- queue / map


def test_get_many_blocks_until_an_item_arrives_and_returns_at_least_one():
    q = MemoryQueue()
    threading.Timer(0.2, lambda: q.put_many([b"a", b"b"], partition="p")).start()
    start = time.monotonic()
    got = q.get_many(10, block=True, timeout=5, partition="p")
    assert got == [b"a", b"b"] and time.monotonic() - start >= 0.15


def test_timeouts_and_non_blocking_calls():
    q = MemoryQueue()
    with pytest.raises(Empty):
        q.get_many(1, timeout=0.1, partition="p")
    assert q.get_many(5, block=False, partition="p") == [] and q.get(block=False, partition="p") is None
    q.put(b"x")  # default partition is separate from "p"
    assert q.len(partition="p") == 0 and q.len() == 1 and q.len(total=True) == 1
    assert q.get_many(3, partition=None) == [b"x"]


def test_full_partition_blocks_then_raises_or_admits():
    q = MemoryQueue(max_items=3)
    q.put_many([b"1", b"2", b"3"], partition="p")
    with pytest.raises(Full):
        q.put_many([b"4"], block=False, partition="p")
    with pytest.raises(Full):
        q.put_many([b"4"], timeout=0.1, partition="p")
    q.put_many([b"4"], partition="other")  # other partitions are independent
    threading.Timer(0.2, lambda: q.get_many(1, partition="p")).start()
    q.put_many([b"4"], timeout=5, partition="p")  # admitted once a slot frees
    assert q.get_many(10, partition="p") == [b"2", b"3", b"4"]


def test_partition_byte_limit_and_item_limits():
    q = MemoryQueue(max_bytes=3 * MAX_ITEM_BYTES)
    big = b"x" * MAX_ITEM_BYTES
    q.put_many([big, big, big], partition="p")
    with pytest.raises(Full):
        q.put_many([b"y"], block=False, partition="p")
    with pytest.raises(ItemTooLarge):
        q.put_many([b"z" * (MAX_ITEM_BYTES + 1)], partition="q")
    with pytest.raises(TypeError):
        q.put_many([{"pickled": "objects"}], partition="q")
    with pytest.raises(ValueError):
        q.put_many([b"a"], partition="x" * 65)
    with pytest.raises(ValueError):
        q.put_many([b"a"], partition="")


def test_map_put_if_absent_get_pop():
    m = MemoryMap()
    assert m.put("k", 1, skip_if_exists=True) is True
    assert m.put("k", 2, skip_if_exists=True) is False and m.get("k") == 1
    assert m.put("k", 3) is True and m.get("k") == 3
    assert m.pop("k") == 3 and m.get("k") is None and m.get("k", "d") == "d"
    with pytest.raises(KeyError):
        m.pop("k")
    assert m.pop("k", None) is None


# ------------------------------------------------------------------------------------------ wire


def make_item(stitched=False, values=True, labels=True, n=5):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 30, size=n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(0, 60_000, size=offsets[-1]).astype(np.uint16)
    return Item(
        3,
        17,
        2,
        stitched,
        0xABCDEF,
        4,
        np.arange(100, 100 + n),
        offsets,
        tokens,
        rng.integers(0, 51, size=offsets[-1]).astype(np.uint8) if values else None,
        np.arange(n, dtype=np.int32) if labels else None,
    )


@pytest.mark.parametrize("stitched", [False, True])
@pytest.mark.parametrize("values", [False, True])
@pytest.mark.parametrize("labels", [False, True])
def test_item_round_trip(stitched, values, labels):
    item = make_item(stitched, values, labels)
    back = unpack_item(pack_item(item), run_tag=0xABCDEF, epoch=3)
    for name in ("epoch", "key_id", "seq", "stitched", "run_tag", "n_items"):
        assert getattr(back, name) == getattr(item, name)
    for name in ("cell_ids", "offsets", "tokens", "values", "labels"):
        a, b = getattr(item, name), getattr(back, name)
        assert (a is None and b is None) or np.array_equal(a, b)
    assert back.key == ((3, "cell", 17, 0) if stitched else (3, "unit", 17, 2))


def test_bad_items_are_named():
    data = pack_item(make_item())
    with pytest.raises(ItemError, match="truncated"):
        unpack_item(data[:10])
    with pytest.raises(ItemError, match="truncated"):
        unpack_item(data[:-3])
    corrupt = bytearray(data)
    corrupt[-5] ^= 0xFF
    with pytest.raises(ItemError, match="checksum"):
        unpack_item(bytes(corrupt))
    with pytest.raises(ItemError, match="not a cellfeed item"):
        unpack_item(b"PK\x03\x04" + data[4:])
    future = bytearray(data)
    future[4] = 9
    with pytest.raises(ItemError, match="version 9"):
        unpack_item(bytes(future))
    with pytest.raises(ItemError, match="another run"):
        unpack_item(data, run_tag=1)
    with pytest.raises(ItemError, match="epoch 3, expected epoch 4"):
        unpack_item(data, epoch=4)


def test_pack_items_splits_to_stay_under_one_mebibyte():
    rng = np.random.default_rng(1)
    n, per_cell = 300, 2048
    offsets = np.arange(0, (n + 1) * per_cell, per_cell, dtype=np.int64)
    tokens = CellRows(
        np.arange(n),
        offsets,
        rng.integers(0, 2**32 - 1, size=n * per_cell, dtype=np.uint32),
        rng.random(n * per_cell).astype(np.float32),
    )  # incompressible: ~16 KiB per cell
    items = pack_items(tokens, epoch=0, key_id=5, run_tag=1, cells_per_item=300)
    assert len(items) > 1 and all(len(b) <= MAX_ITEM_BYTES for b in items)
    decoded = [unpack_item(b) for b in items]
    assert [d.seq for d in decoded] == list(range(len(items))) and {d.n_items for d in decoded} == {len(items)}
    np.testing.assert_array_equal(np.concatenate([d.cell_ids for d in decoded]), np.arange(n))
    np.testing.assert_array_equal(np.concatenate([d.tokens for d in decoded]), tokens.ids)
    assert pack_items(tokens, epoch=0, key_id=5, run_tag=1, cells_per_item=300) == items  # deterministic


# ------------------------------------------------------------------------------------- stitching


def test_concurrent_stitching_emits_each_cell_exactly_once():
    rng = np.random.default_rng(7)
    store = MemoryMap()
    for trial in range(300):
        epoch_map = store.named(f"e{trial}", create=True)  # the driver creates each epoch's map
        n_cells = 12
        cells = {}
        holders = []  # (unit, cell, index, count, genes, values)
        for c in range(n_cells):
            count = int(rng.integers(2, 5))
            genes = np.sort(rng.choice(5000, size=int(rng.integers(count, 40)), replace=False)).astype(np.uint16)
            values = rng.integers(1, 100, size=len(genes)).astype(np.uint16)
            cells[c] = (genes, values)
            cuts = np.sort(rng.choice(np.arange(1, len(genes)), size=count - 1, replace=False))
            for i, (a, b) in enumerate(zip(np.r_[0, cuts], np.r_[cuts, len(genes)])):
                holders.append((f"{c}.{i}", c, i, count, genes[a:b], values[a:b]))
        # some holders run twice (a unit produced twice by two producers)
        holders += [h for h in holders if rng.random() < 0.15]
        random.Random(trial).shuffle(holders)
        emitted, lock = [], threading.Lock()

        def hold(h):
            time.sleep(random.random() * 0.002)
            out = offer_piece(epoch_map, trial, h[0], h[1], h[2], h[3], h[4], h[5])
            if out is not None:
                with lock:
                    emitted.append((h[1], out))

        threads = [threading.Thread(target=hold, args=(h,)) for h in holders]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        distinct = {c for c, _ in emitted}
        assert distinct == set(cells)  # every cell emitted
        # each cell is emitted once per run of the unit holding its last arrival slot: exactly once,
        # unless that unit ran twice (consumers drop the duplicate by key)
        for c in cells:
            count = len({h[2] for h in holders if h[1] == c})
            last_owner = epoch_map.get(arrival_key(c, count - 1))
            runs_of_owner = sum(1 for h in holders if h[0] == last_owner)
            emits = sum(1 for e, _ in emitted if e == c)
            assert 1 <= emits <= runs_of_owner and (runs_of_owner > 1 or emits == 1), (c, count)
        for c, (genes, values) in emitted:
            np.testing.assert_array_equal(genes, cells[c][0])
            np.testing.assert_array_equal(values, cells[c][1])
        store.drop(f"e{trial}")  # the epoch is complete: its whole map goes in one call
        with pytest.raises(MapGone):  # a late duplicate finds it gone instead of re-creating it
            offer_piece(store.named(f"e{trial}"), trial, *holders[0])
        with pytest.raises(MapGone):
            epoch_map.get(arrival_key(0, 0))
        assert f"e{trial}" not in store._registry
