"""The epoch plan of a corpus: several datasets ("sources", `coordination.corpus_file.CorpusSpec`)
trained together in set proportions.

Epoch semantics (docs/DESIGN.md, "Corpus epochs"), all a pure function of (seed, epoch):
- an epoch has a size (default: every selected cell of every source); each source gives exactly
  its quota, weight x size, rounded by largest remainder so the quotas add up to the size;
- each source is an endless *stream* of passes over its selected cells; pass k is the source's
  cells in the strategy's order for key (seed, source, k). Epoch e takes the source's next quota
  from its stream: a source larger than its quota continues where the last epoch stopped (every
  cell once before any twice), a smaller one runs whole passes and then part of a fresh one;
- units cut every source's share of the epoch into the same fractions, so each unit holds every
  source in proportion and batches mix them by weight. A unit's share never crosses a pass
  boundary (the boundary is a cut too), so a unit never holds one cell twice.

A source's pass order by strategy: `block` / `random` — blocks of consecutive selected cells in a
Feistel order (O(1) memory; a short last block comes last); `sequential` — storage order;
`mixture` — scanner chunks in the rounds `coordination.plan` draws (held as one position array, 8
bytes a cell). Units read whole cells
wherever they lie: a corpus has no boundary cells to stitch.

Cell ids are global: source s's cell c is `offsets[s] + c` (offsets: cumulative dataset sizes),
so items, the audit and resume work unchanged; `source_of` maps them back.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from functools import cached_property

import numpy as np

from coordination.arrays import bridge_gaps, merge_ranges
from coordination.audit import cell_hashes
from coordination.errors import CellfeedError
from coordination.plan import HASH_CHUNK, DatasetGeometry, EpochPlan, Sampling, Unit, UnitPart, block_order, shrunk
from coordination.routing import unit_rank
from coordination.seeds import derive_key

# ---------------------------------------------------------------------------------- the plan

WINDOW_UNITS = 32  # units whose cells of a source are computed at once (`CorpusPlan.unit_cells`)
# rows a balanced unit reads rather than make another read call (~0.5 ms locally, a GET on S3: about
# 40 cells' rows, 0.4 ms to read here): classes sub-sampled within a region are read with their gaps
BRIDGE_ROWS = 1 << 16


@dataclass(frozen=True)
class CorpusSource:
    """What a corpus plan knows of one source: its geometry, its selected cells (None: all) and
    where its cell ids start among the corpus's."""

    geometry: DatasetGeometry
    selection: np.ndarray | None = field(default=None, repr=False)
    offset: int = 0
    stream: tuple = ()  # what keys its passes (default: ("corpus", its index)); a balanced stratum's own
    group: object = field(default=None, repr=False)  # balanced: scattered classes read by region (`ScatteredGroup`)

    @property
    def n_selected(self) -> int:
        return self.geometry.n_cells if self.selection is None else len(self.selection)


class SourcePass:
    """Pass `k` of a source: its selected positions in the strategy's order; `positions(a, b)`
    gives those at stream offsets [a, b) of the pass."""

    def __init__(self, source: CorpusSource, sampling: Sampling, seed: int, index: int, k: int):
        n = source.n_selected
        self.n = n
        stream = source.stream or ("corpus", index)
        strategy = sampling.strategy
        self.block, self.chunks = None, None
        if strategy in ("block", "random"):
            # a corpus source's blocks shrink as a small dataset's do; a balanced stratum's keep their size
            # (the plan's units are many whatever a class's size: its blocks are reads, not work to share)
            bs = sampling.effective_block_size
            self.block = max(1, min(bs, n)) if source.stream else shrunk(bs, n, sampling)
            self.full = n // self.block
            self.key = derive_key(seed, *stream, k, "blocks")
        elif strategy == "mixture":  # the scanner rounds of a one-source plan with this pass's key
            plan = EpochPlan(source.geometry, sampling, derive_key(seed, *stream, k), 0, source.selection)
            self.chunks = plan.scanner_positions()  # 8 bytes a selected cell: mixture's order is not O(1)

    def positions(self, a: int, b: int) -> np.ndarray:
        """Selection positions at offsets [a, b) of this pass, in stream order."""
        offsets = np.arange(a, b, dtype=np.int64)
        if self.block is not None:  # full blocks in Feistel order, then the short tail as it is
            bs = self.block
            inside = offsets < self.full * bs
            out = offsets.copy()
            if inside.any():  # one Feistel evaluation per block, not per cell
                o = offsets[inside]
                first = int(o[0]) // bs
                blocks = block_order(self.full, self.key, np.arange(first, int(o[-1]) // bs + 1))
                out[inside] = blocks[o // bs - first] * bs + o % bs
            return out
        if self.chunks is not None:
            return self.chunks[a:b]
        return offsets


class CorpusPlan:
    """The units of one corpus epoch (see the module's text): a `coordination.plan.Plan` whose
    units have a part per source they draw from, and no boundary cells.

    A balanced epoch (`coordination.balance`) is a corpus plan over strata (one class of one
    source each): `part_sources` names each stratum's campaign source, so a unit has one part per
    campaign source (its strata's cells merged), and units are the even cuts alone: a stratum's
    share may span passes of a small class (that unit then holds some of its cells twice)."""

    def __init__(
        self,
        sources: list[CorpusSource],
        quotas_: np.ndarray,
        sampling: Sampling,
        seed: int,
        epoch: int,
        starts: np.ndarray | None = None,
        *,
        part_sources: np.ndarray | None = None,
        balance: tuple | None = None,
    ):
        self.sources, self.sampling = sources, sampling.validate()
        self.quotas = np.asarray(quotas_, dtype=np.int64)
        self.seed, self.epoch = int(seed), int(epoch)
        self.part_sources = None if part_sources is None else np.asarray(part_sources, dtype=np.int64)
        self.balance = balance
        # where each source's stream stands at this epoch's start: epoch x quota, unless the mixture
        # changed at an earlier epoch (`Mixtures.starts`)
        self.starts = self.epoch * self.quotas if starts is None else np.asarray(starts, dtype=np.int64)
        for s, src in enumerate(sources):
            if src.n_selected == 0 and self.quotas[s] > 0:
                raise CellfeedError(f"corpus source {s} selects no cells but has a quota of {self.quotas[s]:,}")
        s = self.sampling
        per_unit = (
            s.fetch_factor * s.batch_size
            if s.strategy in ("block", "random")
            else s.unit_cells * (s.n_scanners if s.strategy == "mixture" else 1)
        )
        total = int(self.quotas.sum())
        n = max(1, min(total, max(-(-total // per_unit), s.min_units)))
        if self.part_sources is not None:  # strata: the even cuts only
            self.cuts = None
            self.n_units = n
        else:  # cut fractions: the even unit cuts, and each source's pass boundaries inside this epoch
            cuts = {Fraction(u, n) for u in range(n + 1)}
            for q, start, src in zip(self.quotas.tolist(), self.starts.tolist(), sources):
                if q == 0:
                    continue
                first_pass = -(-start // src.n_selected) * src.n_selected  # the first pass boundary >= start
                cuts.update(Fraction(b - start, q) for b in range(first_pass, start + q, src.n_selected) if b > start)
            self.cuts = sorted(cuts)
            self.n_units = len(self.cuts) - 1
        self.boundary_cells = self.boundary_piece_counts = self.boundary_piece_units = np.zeros(0, dtype=np.int64)
        self._passes: dict[tuple[int, int], SourcePass] = {}
        self._bounds: dict[int, np.ndarray] = {}
        self._windows: dict[tuple[int, int], np.ndarray] = {}  # (source, window) -> its cells (`unit_cells`)

    # ---- identity and counts

    @cached_property
    def plan_id(self) -> str:
        h = hashlib.blake2b(digest_size=8)
        inputs = [[s.geometry.fingerprint, s.offset] for s in self.sources] + [
            self.quotas.tolist(),
            self.starts.tolist(),
            asdict(self.sampling),
            self.seed,
            self.epoch,
        ]
        if self.balance is not None:  # (a corpus's ids stay what they were)
            inputs += [list(self.balance), [list(s.stream) for s in self.sources], self.part_sources.tolist()]
        h.update(json.dumps(inputs).encode())
        for s in self.sources:
            h.update(b"all" if s.selection is None else s.selection.tobytes())
        return h.hexdigest()

    @property
    def n_cells(self) -> int:
        return int(self.quotas.sum())

    def bounds(self, s: int) -> np.ndarray:
        """int64[n_units + 1]: source s's stream offsets where each unit's share starts (and the last ends)."""
        if s not in self._bounds:
            q, start = int(self.quotas[s]), int(self.starts[s])
            if self.cuts is None:  # each stratum's rounding in its own phase: no unit is short of all at once
                n = self.n_units
                phase = s * n // len(self.sources)
                self._bounds[s] = start + (np.arange(n + 1, dtype=np.int64) * q + phase) // n
            else:
                self._bounds[s] = np.array([start + math.floor(c * q) for c in self.cuts], dtype=np.int64)
        return self._bounds[s]

    def _share(self, u: int, s: int) -> tuple[int, int]:
        """Source s's stream offsets of unit u: [a, b)."""
        b = self.bounds(s)
        return int(b[u]), int(b[u + 1])

    @cached_property
    def unit_source_counts(self) -> np.ndarray:
        """int64[n_units, n_sources]: cells of each source in each unit."""
        out = np.zeros((self.n_units, len(self.sources)), dtype=np.int64)
        for s in range(len(self.sources)):
            out[:, s] = np.diff(self.bounds(s))
        return out

    @property
    def unit_cell_counts(self) -> np.ndarray:
        return self.unit_source_counts.sum(axis=1)

    def cells_per_rank(self, world_size: int) -> np.ndarray:
        return np.bincount(
            unit_rank(np.arange(self.n_units), world_size), weights=self.unit_cell_counts, minlength=world_size
        ).astype(np.int64)

    # ---- units

    def _pass(self, s: int, k: int) -> SourcePass:
        if (s, k) not in self._passes:
            if len(self._passes) > 64:
                self._passes.clear()
            self._passes[(s, k)] = SourcePass(self.sources[s], self.sampling, self.seed, s, k)
        return self._passes[(s, k)]

    def stream_cells(self, s: int, a: int, b: int) -> np.ndarray:
        """Local cell ids at offsets [a, b) of source s's stream, pass after pass."""
        src = self.sources[s]
        if src.group is not None:  # (its own stream each epoch, from 0)
            return src.group.stream(a, b)
        n, out = src.n_selected, []
        while a < b:
            k = a // n
            stop = min(b, (k + 1) * n)
            positions = self._pass(s, k).positions(a - k * n, stop - k * n)
            out.append(positions if src.selection is None else src.selection[positions].astype(np.int64))
            a = stop
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def unit_cells(self, u: int, s: int) -> np.ndarray:
        """Local cell ids of source s in unit u, in stream order (a corpus's share lies in one pass: distinct).
        Computed a window of WINDOW_UNITS units at a time: a balanced plan's units draw a little from
        each of many strata, and one stream call per stratum and unit would cost more than the unit's
        tokenizing (the producer takes units in order, so the next one's cells are mostly at hand)."""
        w = u // WINDOW_UNITS
        window = self._windows.get((s, w))
        if window is None:
            bounds = self.bounds(s)
            window = self.stream_cells(
                s, int(bounds[w * WINDOW_UNITS]), int(bounds[min(self.n_units, (w + 1) * WINDOW_UNITS)])
            )
            if len(self._windows) >= 4 * len(self.sources):
                self._windows.clear()
            self._windows[(s, w)] = window
        base = int(self.bounds(s)[w * WINDOW_UNITS])
        a, b = self._share(u, s)
        return window[a - base : b - base]

    def unit(self, u: int) -> Unit:
        if not 0 <= u < self.n_units:
            raise IndexError(f"unit {u} out of range 0..{self.n_units - 1}")
        owner = np.arange(len(self.sources)) if self.part_sources is None else self.part_sources
        parts = []
        for campaign_source in np.unique(owner).tolist():
            mine = np.flatnonzero(owner == campaign_source)
            cells = np.sort(np.concatenate([self.unit_cells(u, int(s)) for s in mine]))
            if len(cells):
                starts = self.sources[int(mine[0])].geometry.cell_row_start
                ranges = merge_ranges(starts[cells], starts[cells + 1])
                if self.part_sources is not None:  # balanced: a region's or a run's neighbours read in one go
                    ranges = bridge_gaps(ranges, BRIDGE_ROWS)
                parts.append(UnitPart(campaign_source, cells, ranges))
        return Unit(self.epoch, u, parts)

    def units(self):
        return (self.unit(u) for u in range(self.n_units))

    def cell_hash_per_rank(self, world_size: int) -> list[int]:
        """`cells_hash` of the global cell ids each rank receives (a cell planned twice counts twice):
        per source, its epoch's stream hashed in chunks, summed between the units' share bounds."""
        out = np.zeros(world_size, dtype=np.uint64)
        ranks = unit_rank(np.arange(self.n_units), world_size)
        with np.errstate(over="ignore"):
            for s, src in enumerate(self.sources):
                bounds = self.bounds(s)
                prefix = np.zeros(len(bounds), dtype=np.uint64)  # hashes of the stream before each bound
                carry = np.uint64(0)
                for lo in range(int(bounds[0]), int(bounds[-1]), HASH_CHUNK):
                    hi = min(int(bounds[-1]), lo + HASH_CHUNK)
                    running = np.cumsum(cell_hashes(self.stream_cells(s, lo, hi) + src.offset), dtype=np.uint64)
                    a, b = np.searchsorted(bounds, [lo + 1, hi + 1])  # bounds p with lo < p <= hi
                    prefix[a:b] = carry + running[bounds[a:b] - lo - 1]
                    carry = carry + running[-1]
                sums = prefix[1:] - prefix[:-1]
                for r in range(world_size):
                    out[r] += sums[ranks == r].sum(dtype=np.uint64)
        return [int(x) for x in out]


def source_of(cell_ids, offsets) -> np.ndarray:
    """The source index of global cell ids (`offsets`: each source's first id, ascending)."""
    return np.searchsorted(np.asarray(offsets, dtype=np.int64), np.asarray(cell_ids, dtype=np.int64), side="right") - 1
