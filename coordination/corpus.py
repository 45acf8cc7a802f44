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

from coordination.arrays import merge_ranges
from coordination.audit import cell_hashes
from coordination.errors import CellfeedError
from coordination.plan import DatasetGeometry, EpochPlan, Sampling, Unit, UnitPart, block_order, shrunk
from coordination.routing import unit_rank
from coordination.seeds import derive_key

# ---------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class CorpusSource:
    """What a corpus plan knows of one source: its geometry, its selected cells (None: all) and
    where its cell ids start among the corpus's."""

    geometry: DatasetGeometry
    selection: np.ndarray | None = field(default=None, repr=False)
    offset: int = 0

    @property
    def n_selected(self) -> int:
        return self.geometry.n_cells if self.selection is None else len(self.selection)


class _Pass:
    """Pass `k` of a source: its selected positions in the strategy's order; `positions(a, b)`
    gives those at stream offsets [a, b) of the pass."""

    def __init__(self, source: CorpusSource, sampling: Sampling, seed: int, index: int, k: int):
        n = source.n_selected
        self.n = n
        strategy = sampling.strategy
        self.block, self.chunks = None, None
        if strategy in ("block", "random"):
            self.block = shrunk(sampling.effective_block_size, n, sampling)
            self.full = n // self.block
            self.key = derive_key(seed, "corpus", index, k, "blocks")
        elif strategy == "mixture":  # the scanner rounds of a one-source plan with this pass's key
            plan = EpochPlan(source.geometry, sampling, derive_key(seed, "corpus", index, k), 0, source.selection)
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
    units have a part per source they draw from, and no boundary cells."""

    def __init__(
        self,
        sources: list[CorpusSource],
        quotas_: np.ndarray,
        sampling: Sampling,
        seed: int,
        epoch: int,
        starts: np.ndarray | None = None,
    ):
        self.sources, self.sampling = sources, sampling.validate()
        self.quotas = np.asarray(quotas_, dtype=np.int64)
        self.seed, self.epoch = int(seed), int(epoch)
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
        # cut fractions: the even unit cuts, and each source's pass boundaries inside this epoch
        cuts = {Fraction(u, n) for u in range(n + 1)}
        for q, start, src in zip(self.quotas.tolist(), self.starts.tolist(), sources):
            if q == 0:
                continue
            first_pass = -(-start // src.n_selected) * src.n_selected  # the first pass boundary >= start
            cuts.update(Fraction(b - start, q) for b in range(first_pass, start + q, src.n_selected) if b > start)
        self.cuts = sorted(cuts)
        self.n_units = len(self.cuts) - 1
        self.boundary_cells = self.boundary_piece_counts = self.boundary_piece_units = np.zeros(0, dtype=np.int64)
        self._passes: dict[tuple[int, int], _Pass] = {}

    # ---- identity and counts

    @cached_property
    def plan_id(self) -> str:
        h = hashlib.blake2b(digest_size=8)
        h.update(
            json.dumps(
                [[s.geometry.fingerprint, s.offset] for s in self.sources]
                + [self.quotas.tolist(), self.starts.tolist(), asdict(self.sampling), self.seed, self.epoch]
            ).encode()
        )
        for s in self.sources:
            h.update(b"all" if s.selection is None else s.selection.tobytes())
        return h.hexdigest()

    @property
    def n_cells(self) -> int:
        return int(self.quotas.sum())

    def _share(self, u: int, s: int) -> tuple[int, int]:
        """Source s's stream offsets of unit u: [a, b)."""
        q, start = int(self.quotas[s]), int(self.starts[s])
        lo, hi = self.cuts[u], self.cuts[u + 1]
        return start + math.floor(lo * q), start + math.floor(hi * q)

    @cached_property
    def unit_source_counts(self) -> np.ndarray:
        """int64[n_units, n_sources]: cells of each source in each unit."""
        out = np.zeros((self.n_units, len(self.sources)), dtype=np.int64)
        for u in range(self.n_units):
            for s in range(len(self.sources)):
                a, b = self._share(u, s)
                out[u, s] = b - a
        return out

    @property
    def unit_cell_counts(self) -> np.ndarray:
        return self.unit_source_counts.sum(axis=1)

    def cells_per_rank(self, world_size: int) -> np.ndarray:
        return np.bincount(
            unit_rank(np.arange(self.n_units), world_size), weights=self.unit_cell_counts, minlength=world_size
        ).astype(np.int64)

    # ---- units

    def _pass(self, s: int, k: int) -> _Pass:
        if (s, k) not in self._passes:
            if len(self._passes) > 64:
                self._passes.clear()
            self._passes[(s, k)] = _Pass(self.sources[s], self.sampling, self.seed, s, k)
        return self._passes[(s, k)]

    def unit_cells(self, u: int, s: int) -> np.ndarray:
        """Local cell ids of source s in unit u, in stream order (within one pass: distinct)."""
        a, b = self._share(u, s)
        if a == b:
            return np.zeros(0, dtype=np.int64)
        src = self.sources[s]
        n = src.n_selected
        k = a // n  # a share never crosses a pass boundary
        positions = self._pass(s, k).positions(a - k * n, b - k * n)
        return positions if src.selection is None else src.selection[positions]

    def unit(self, u: int) -> Unit:
        if not 0 <= u < self.n_units:
            raise IndexError(f"unit {u} out of range 0..{self.n_units - 1}")
        parts = []
        for s, src in enumerate(self.sources):
            cells = np.sort(self.unit_cells(u, s))
            if len(cells):
                starts = src.geometry.cell_row_start
                parts.append(UnitPart(s, cells, merge_ranges(starts[cells], starts[cells + 1])))
        return Unit(self.epoch, u, parts)

    def units(self):
        return (self.unit(u) for u in range(self.n_units))

    def cell_hash_per_rank(self, world_size: int) -> list[int]:
        """`cells_hash` of the global cell ids each rank receives (a cell planned twice counts twice)."""
        out = np.zeros(world_size, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for u in range(self.n_units):
                r = unit_rank(u, world_size)
                for s, src in enumerate(self.sources):
                    out[r] += cell_hashes(self.unit_cells(u, s) + src.offset).sum(dtype=np.uint64)
        return [int(x) for x in out]


def source_of(cell_ids, offsets) -> np.ndarray:
    """The source index of global cell ids (`offsets`: each source's first id, ascending)."""
    return np.searchsorted(np.asarray(offsets, dtype=np.int64), np.asarray(cell_ids, dtype=np.int64), side="right") - 1
