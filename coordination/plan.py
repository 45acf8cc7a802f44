"""Epoch plans: which cells each work unit reads and emits (sampling), as a pure function of
(dataset geometry, sampling settings, seed, epoch, subset).

Strategies (see docs/DESIGN.md):
- `sequential`: scanner chunks of `unit_cells` cells in storage order, fragment by fragment.
- `mixture`: one scanner per fragment; each unit is one round in which `n_scanners` scanners,
  drawn at random among those not exhausted, each contribute their next chunk.
- `block`: blocks of `block_size` consecutive selected cells in a Feistel-permuted order,
  `fetch_factor * batch_size` cells' worth of blocks per unit, ranges sorted before reading.
- `random`: `block` with block_size 1.

Scanner chunks never cross a fragment, so a cell whose rows straddle a fragment edge is a
*boundary cell*: each unit holding a piece of it stitches it through the map. Block units read
whole cells wherever they lie, so they have no boundary cells.

Every plan, this one-dataset `EpochPlan` and the corpus's `coordination.corpus.CorpusPlan`, is a
`Plan`: numbered units (`Unit`), each part of which names the source its cells come from, so a
producer reads and tokenizes any unit the same way.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np

from coordination.arrays import merge_ranges
from coordination.audit import cell_hashes
from coordination.errors import CellfeedError
from coordination.feistel import FeistelPermutation
from coordination.routing import cell_rank, unit_rank
from coordination.seeds import plan_key

STRATEGIES = ("sequential", "mixture", "block", "random")
HASH_CHUNK = 1 << 23  # positions hashed at a time when a plan computes its expected hashes


# --------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class DatasetGeometry:
    """What a plan needs to know about a dataset: row offsets of cells and fragments."""

    fingerprint: str
    cell_row_start: np.ndarray = field(repr=False)  # int64[n_cells + 1]
    fragment_row_start: np.ndarray = field(repr=False)  # int64[n_fragments + 1]

    @classmethod
    def of(cls, dataset) -> "DatasetGeometry":
        return cls(dataset.fingerprint, dataset.cell_row_start, dataset.fragment_row_start)

    @property
    def n_cells(self) -> int:
        return len(self.cell_row_start) - 1


@dataclass(frozen=True)
class Sampling:
    strategy: str = "block"
    unit_cells: int = 1024  # sequential / mixture: cells per scanner chunk
    n_scanners: int = 8  # mixture
    block_size: int = 64  # block: 64 consecutive cells cost ~1.5x a sequential read, 16 cost ~3x
    fetch_factor: int = 64  # block: batches' worth of blocks per unit (64 blocks from all over)
    batch_size: int = 64  # block: the batch the fetch factor counts in
    # units are made smaller (never larger) so an epoch has at least this many when it has the
    # cells: every producer and every rank gets work on a small dataset too
    min_units: int = 64

    def validate(self) -> "Sampling":
        if self.strategy not in STRATEGIES:
            raise CellfeedError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        for name in ("unit_cells", "n_scanners", "block_size", "fetch_factor", "batch_size", "min_units"):
            if int(getattr(self, name)) < 1:
                raise CellfeedError(f"{name} must be >= 1, got {getattr(self, name)}")
        return self

    @property
    def effective_block_size(self) -> int:
        return 1 if self.strategy == "random" else self.block_size


NO_ROWS = np.zeros((0, 2), dtype=np.int64)
NO_CELLS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class UnitPart:
    """The cells of one source that a unit emits whole, and the rows it reads of that source."""

    source: int  # the source's index in the campaign (0: a one-dataset campaign's dataset)
    cells: np.ndarray  # int64 local cell ids, sorted
    ranges: np.ndarray  # int64[k, 2], sorted, disjoint: the rows to read (pieces' rows too, below)


@dataclass
class Unit:
    """One work unit: per source it draws from, a part. A one-dataset scanner unit may also hold
    pieces of boundary cells, in its one part's rows: `pieces[i]` is the cell of which it holds
    piece `piece_index[i]` of `piece_count[i]` (numbered in row order), on global rows
    `piece_rows[i]`; it stitches them through the epoch's map."""

    epoch: int
    id: int
    parts: list[UnitPart]
    pieces: np.ndarray = field(default_factory=lambda: NO_CELLS)
    piece_index: np.ndarray = field(default_factory=lambda: NO_CELLS)
    piece_count: np.ndarray = field(default_factory=lambda: NO_CELLS)
    piece_rows: np.ndarray = field(default_factory=lambda: NO_ROWS)

    @property
    def n_cells(self) -> int:
        """Cells emitted whole (boundary pieces not counted)."""
        return sum(len(p.cells) for p in self.parts)

    @property
    def n_rows(self) -> int:
        return int(sum((p.ranges[:, 1] - p.ranges[:, 0]).sum() for p in self.parts))


class Plan(Protocol):
    """What the campaign's setup, the driver, the audit and the producers need of an epoch's plan."""

    epoch: int
    n_units: int
    unit_cell_counts: np.ndarray  # int64[n_units]: cells each unit emits whole
    boundary_cells: np.ndarray  # cells stitched from pieces (a one-dataset scanner plan's only)
    boundary_piece_counts: np.ndarray
    boundary_piece_units: np.ndarray

    @property
    def plan_id(self) -> str: ...  # identifies the plan's inputs: items carry it to reject foreign data

    @property
    def n_cells(self) -> int: ...

    def unit(self, u: int) -> Unit: ...

    def cells_per_rank(self, world_size: int) -> np.ndarray: ...

    def cell_hash_per_rank(self, world_size: int) -> list[int]: ...


def shrunk(per_unit: int, n: int, sampling: "Sampling") -> int:
    """`per_unit`, made smaller where needed so that n things fill at least `min_units` units:
    every producer and every rank gets work on a small dataset too. The one rule for unit sizes
    and block sizes."""
    return max(1, min(per_unit, n // sampling.min_units))


def block_order(n_blocks: int, key: int, slots: np.ndarray | None = None) -> np.ndarray:
    """The blocks at `slots` (default: every slot) of the Feistel order of `n_blocks` blocks keyed by
    `key`: the order of `block` and `random` plans, one-dataset and corpus alike (O(1) memory)."""
    return FeistelPermutation(n_blocks, key)(np.arange(n_blocks) if slots is None else slots)


def cell_ids_within(ids, n_cells: int) -> np.ndarray:
    """Cell ids as a sorted set, refused in one line when one lies outside 0..n_cells-1: the one
    check of a cell id list, for user input (`producers.selection`) and plans alike."""
    ids = np.unique(np.asarray(ids, dtype=np.int64))
    if len(ids) and (ids[0] < 0 or ids[-1] >= n_cells):
        raise CellfeedError(f"cell ids must lie in 0..{n_cells - 1}, got {int(ids[0] if ids[0] < 0 else ids[-1])}")
    return ids


# ------------------------------------------------------------------------------------------ plan


class EpochPlan:
    """The work units of one epoch. Units are built on demand (`unit(i)`); counts are cheap."""

    def __init__(
        self, geometry: DatasetGeometry, sampling: Sampling, seed: int, epoch: int, subset: np.ndarray | None = None
    ):
        self.geometry = geometry
        self.sampling = sampling.validate()
        self.seed, self.epoch = int(seed), int(epoch)
        n = geometry.n_cells
        self.subset = None  # None: every cell (no 8-bytes-a-cell id array at Tahoe scale)
        if subset is not None:
            self.subset = cell_ids_within(subset, n)
        if self.n_cells == 0:
            raise CellfeedError("the cell subset selects no cells; check the filter or id list")
        if sampling.strategy in ("block", "random"):
            self._plan_blocks()
        else:
            self._plan_scanners()

    # ---- identity

    @cached_property
    def plan_id(self) -> str:
        """Identifies (dataset, sampling, seed, epoch, subset): items carry it to reject foreign data."""
        h = hashlib.blake2b(digest_size=8)
        h.update(json.dumps([self.geometry.fingerprint, asdict(self.sampling), self.seed, self.epoch]).encode())
        h.update(b"all" if self.subset is None else self.subset.tobytes())
        return h.hexdigest()

    # ---- block / random

    def _plan_blocks(self) -> None:
        s = self.sampling
        n_sel = self.n_cells
        # blocks too shrink on a dataset with fewer than min_units blocks' worth of cells
        self.block_size = bs = shrunk(s.effective_block_size, n_sel, s)
        self.n_blocks = -(-n_sel // bs)
        self.blocks_per_unit = shrunk(max(1, -(-s.fetch_factor * s.batch_size // bs)), self.n_blocks, s)
        self.block_order = block_order(self.n_blocks, plan_key(self.seed, self.epoch, "blocks"))
        self.n_units = -(-self.n_blocks // self.blocks_per_unit)
        sizes = np.full(self.n_blocks, bs, dtype=np.int64)
        sizes[-1] = n_sel - bs * (self.n_blocks - 1)
        unit_of_slot = np.arange(self.n_blocks) // self.blocks_per_unit
        self.unit_cell_counts = np.bincount(
            unit_of_slot, weights=sizes[self.block_order], minlength=self.n_units
        ).astype(np.int64)
        self.boundary_cells = np.zeros(0, dtype=np.int64)
        self.boundary_piece_counts = np.zeros(0, dtype=np.int64)
        self.boundary_piece_units = np.zeros(0, dtype=np.int64)

    def _block_unit(self, u: int) -> Unit:
        bs = self.block_size
        blocks = np.sort(self.block_order[u * self.blocks_per_unit : (u + 1) * self.blocks_per_unit])
        idx = (blocks[:, None] * bs + np.arange(bs)[None, :]).ravel()
        cells = self.cells_at(idx[idx < self.n_cells])
        starts = self.geometry.cell_row_start
        return Unit(self.epoch, u, [UnitPart(0, cells, merge_ranges(starts[cells], starts[cells + 1]))])

    # ---- sequential / mixture

    def _plan_scanners(self) -> None:
        """Chunks of `unit_cells` consecutive selected cells within a fragment. A fragment's
        cells are a contiguous range of the selection, and cells cut by a fragment edge lie only
        at the edges, so the plan holds per-fragment, per-chunk and per-straddler arrays, never
        one per cell (a 100M-cell atlas plans in its row index alone)."""
        starts, frag = self.geometry.cell_row_start, self.geometry.fragment_row_start
        n_frags = max(1, len(frag) - 1)
        sel_starts, sel_ends = self._selected_rows()
        n_sel = self.n_cells
        # the selection positions of each fragment's cells: [lo, hi); an empty cell lives where it starts
        lo = np.minimum(
            np.searchsorted(sel_ends, frag[:n_frags], side="right"),
            np.searchsorted(sel_starts, frag[:n_frags], side="left"),
        )
        hi = np.append(np.searchsorted(sel_starts, frag[1:n_frags], side="left"), n_sel)
        lo[0] = 0
        # straddlers: selected cells cut by an inner fragment edge, each once
        edges = frag[1:n_frags]
        inside = np.searchsorted(starts, edges, side="right") - 1  # the cell holding each edge's row
        cut = (starts[inside] < edges) & (starts[inside + 1] > edges)
        straddlers = np.unique(inside[cut])
        if self.subset is not None:
            straddlers = straddlers[np.isin(straddlers, self.subset)]
        first = np.searchsorted(frag, starts[straddlers], side="right") - 1
        last = np.searchsorted(frag, starts[straddlers + 1] - 1, side="right") - 1
        # chunks: runs of unit_cells positions within a fragment (a mixture unit holds several)
        group = min(self.sampling.n_scanners, n_frags) if self.sampling.strategy == "mixture" else 1
        k = max(1, shrunk(self.sampling.unit_cells * group, n_sel, self.sampling) // group)
        chunks = [(f, a, min(a + k, int(hi[f]))) for f in range(n_frags) for a in range(int(lo[f]), int(hi[f]), k)]
        if self.sampling.strategy == "sequential":
            self._unit_chunks = [[c] for c in chunks]
        else:
            self._unit_chunks = self._mixture_rounds(chunks, n_frags)
        self.n_units = len(self._unit_chunks)
        # each straddler's pieces: in which unit is each? all in one unit = whole for that unit
        chunk_f = np.array([c[0] for c in chunks], dtype=np.int64).reshape(-1)
        chunk_a = np.array([c[1] for c in chunks], dtype=np.int64).reshape(-1)
        unit_of_chunk = {}
        for u, group_chunks in enumerate(self._unit_chunks):
            for c in group_chunks:
                unit_of_chunk[c] = u
        chunk_unit = np.array([unit_of_chunk[c] for c in chunks], dtype=np.int64)
        order = np.lexsort((chunk_a, chunk_f))  # chunks are already in (fragment, start) order
        position = self._positions(straddlers)
        span = last - first + 1
        piece_frag = np.repeat(first, span) + (np.arange(span.sum()) - np.repeat(np.cumsum(span) - span, span))
        piece_pos = np.repeat(position, span)
        # the chunk of (fragment, position): the last chunk of that fragment starting at or before it
        keys = chunk_f[order] * (n_sel + 1) + chunk_a[order]
        piece_chunk = order[np.searchsorted(keys, piece_frag * (n_sel + 1) + piece_pos, side="right") - 1]
        piece_unit = chunk_unit[piece_chunk].reshape(-1)
        owner = np.full(len(straddlers), -1, dtype=np.int64)
        if len(straddlers):
            starts_of = np.cumsum(span) - span
            same = np.minimum.reduceat(piece_unit, starts_of) == np.maximum.reduceat(piece_unit, starts_of)
            owner[same] = piece_unit[starts_of[same]]
        self._straddlers, self._straddler_first, self._straddler_span = straddlers, first, span
        self._straddler_owner = owner
        self._chunks, self._chunk_unit, self._piece_unit = chunks, chunk_unit, piece_unit
        # whole cells per unit: every position of its chunks, less straddler pieces, plus straddlers whole in it
        sizes = np.array([b - a for _, a, b in chunks], dtype=np.int64).reshape(-1)
        counts = np.bincount(chunk_unit, weights=sizes, minlength=self.n_units)
        counts -= np.bincount(piece_unit, minlength=self.n_units)
        counts += np.bincount(owner[owner >= 0], minlength=self.n_units)
        self.unit_cell_counts = counts.astype(np.int64)
        self.boundary_cells = straddlers[owner < 0]
        self.boundary_piece_counts = span[owner < 0]
        self.boundary_piece_units = piece_unit[np.repeat(owner < 0, span)]  # pieces in order, cell by cell

    def _selected_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """First row and end row of each selected cell (views, without a subset)."""
        starts = self.geometry.cell_row_start
        if self.subset is None:
            return starts[:-1], starts[1:]
        return starts[self.subset], starts[self.subset + 1]

    def _positions(self, cells: np.ndarray) -> np.ndarray:
        """Positions in the selection of selected cells."""
        return cells if self.subset is None else np.searchsorted(self.subset, cells)

    def _mixture_rounds(self, chunks, n_frags) -> list[list[tuple[int, int, int]]]:
        per_frag: list[list] = [[] for _ in range(n_frags)]
        for c in chunks:
            per_frag[c[0]].append(c)
        cursor = np.zeros(n_frags, dtype=np.int64)
        remaining = np.array([len(p) for p in per_frag])
        rng = np.random.default_rng(plan_key(self.seed, self.epoch, "scanners"))
        rounds = []
        while remaining.sum():
            active = np.flatnonzero(remaining)
            chosen = rng.choice(active, size=min(self.sampling.n_scanners, len(active)), replace=False)
            rounds.append([per_frag[f][cursor[f]] for f in sorted(chosen)])
            cursor[chosen] += 1
            remaining[chosen] -= 1
        return rounds

    def scanner_positions(self) -> np.ndarray:
        """Selection positions in the order this scanner plan's units take them (a cell cut by a
        fragment edge, in two chunks, at its first): a corpus's `mixture` pass order."""
        order = np.concatenate([np.arange(a, b) for rnd in self._unit_chunks for _, a, b in rnd])
        _, first = np.unique(order, return_index=True)
        return order[np.sort(first)]

    def _scanner_unit(self, u: int) -> Unit:
        starts, frag = self.geometry.cell_row_start, self.geometry.fragment_row_start
        groups = [(f, self.cells_at(np.arange(a, b))) for f, a, b in self._unit_chunks[u]]
        cells = np.concatenate([c for _, c in groups])
        f = np.concatenate([np.full(len(c), fr, dtype=np.int64) for fr, c in groups])
        lo = np.maximum(starts[cells], frag[f])
        hi = np.minimum(starts[cells + 1], frag[f + 1])
        k = np.searchsorted(self._straddlers, cells)
        k = np.minimum(k, max(len(self._straddlers) - 1, 0))
        straddling = (self._straddlers[k] == cells) if len(self._straddlers) else np.zeros(len(cells), dtype=bool)
        whole = ~straddling
        whole[straddling] = self._straddler_owner[k[straddling]] == u
        piece = ~whole
        kp = k[piece]
        return Unit(
            self.epoch,
            u,
            [UnitPart(0, np.unique(cells[whole]), merge_ranges(lo, hi))],
            cells[piece],
            f[piece] - self._straddler_first[kp],
            self._straddler_span[kp],
            np.stack([lo[piece], hi[piece]], axis=1),
        )

    # ---- queries

    def unit(self, u: int) -> Unit:
        if not 0 <= u < self.n_units:
            raise IndexError(f"unit {u} out of range 0..{self.n_units - 1}")
        return self._block_unit(u) if self.sampling.strategy in ("block", "random") else self._scanner_unit(u)

    def units(self):
        return (self.unit(u) for u in range(self.n_units))

    @property
    def n_cells(self) -> int:
        return self.geometry.n_cells if self.subset is None else len(self.subset)

    @property
    def selected(self) -> np.ndarray:
        """The selected cell ids, sorted (built on demand when the plan covers every cell)."""
        return np.arange(self.geometry.n_cells, dtype=np.int64) if self.subset is None else self.subset

    def cells_at(self, positions: np.ndarray) -> np.ndarray:
        """Cell ids at positions of the selection."""
        return positions.astype(np.int64) if self.subset is None else self.subset[positions]

    def cells_per_rank(self, world_size: int) -> np.ndarray:
        """Cells each rank receives: unit u's cells go to u mod W, a stitched cell c to c mod W."""
        units = np.bincount(
            unit_rank(np.arange(self.n_units), world_size), weights=self.unit_cell_counts, minlength=world_size
        )
        stitched = np.bincount(cell_rank(self.boundary_cells, world_size), minlength=world_size)
        return (units + stitched).astype(np.int64)

    def cell_hash_per_rank(self, world_size: int) -> list[int]:
        """`cells_hash` of the cells each rank receives in this epoch (what each rank checks its
        trained cells against at the epoch's end). Streams over the selection in chunks, from
        per-unit ranges of selection positions: seconds and bounded memory for 100M cells."""
        if self.sampling.strategy in ("block", "random"):
            bs, n = self.block_size, self.n_cells
            blocks = np.arange(self.n_blocks, dtype=np.int64)
            slot = np.empty(self.n_blocks, dtype=np.int64)
            slot[self.block_order] = blocks  # where each block sits in the shuffled order
            sums = self._position_sums(blocks * bs, np.minimum((blocks + 1) * bs, n))
            ranks = unit_rank(slot // self.blocks_per_unit, world_size)
            add, take = [], []  # no pieces: every block cell is whole
        else:
            chunks = np.array(self._chunks, dtype=np.int64).reshape(-1, 3)
            sums = self._position_sums(chunks[:, 1], chunks[:, 2])
            ranks = unit_rank(self._chunk_unit, world_size)
            pieces = np.repeat(self._straddlers, self._straddler_span)
            owned = self._straddler_owner >= 0
            take = [(pieces, unit_rank(self._piece_unit, world_size))]  # a chunk counts a piece's cell once: not whole
            add = [
                (self._straddlers[owned], unit_rank(self._straddler_owner[owned], world_size)),
                (self.boundary_cells, cell_rank(self.boundary_cells, world_size)),
            ]  # whole in one unit / stitched
        out = np.zeros(world_size, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for r in range(world_size):
                out[r] = sums[ranks == r].sum(dtype=np.uint64)
                for cells, rank in add:
                    out[r] += cell_hashes(cells[rank == r]).sum(dtype=np.uint64)
                for cells, rank in take:
                    out[r] -= cell_hashes(cells[rank == r]).sum(dtype=np.uint64)
        return [int(x) for x in out]

    def _position_sums(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """For each [start, stop) of selection positions, the sum of its cells' hashes (mod 2**64),
        from prefix sums taken only at the segment edges while streaming over the selection."""
        points = np.unique(np.concatenate([starts, stops, [0]]))
        prefix = np.zeros(len(points), dtype=np.uint64)  # prefix[i]: hashes of positions < points[i]
        carry = np.uint64(0)
        with np.errstate(over="ignore"):
            for lo in range(0, self.n_cells, HASH_CHUNK):
                hi = min(self.n_cells, lo + HASH_CHUNK)
                running = np.cumsum(cell_hashes(self.cells_at(np.arange(lo, hi))), dtype=np.uint64)
                a, b = np.searchsorted(points, [lo + 1, hi + 1])  # points p with lo < p <= hi
                prefix[a:b] = carry + running[points[a:b] - lo - 1]
                carry = carry + running[-1]
            return prefix[np.searchsorted(points, stops)] - prefix[np.searchsorted(points, starts)]
