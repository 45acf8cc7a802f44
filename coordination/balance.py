"""Balanced sampling by an obs column (`--balance-by COLUMN --balance-power ALPHA`): each class of
the column gets an exact quota of every epoch, and its cells are drawn without replacement across
epochs while it has cells not yet seen.

Semantics (docs/DESIGN.md, "Balanced epochs"), all a pure function of (seed, epoch):
- a *stratum* is the selected cells of one class in one source; each is an endless stream of passes
  over its cells (pass k in the strategy's order for key (seed, source, class, k)), exactly as a
  corpus source is (`coordination.corpus`). Epoch e takes a stratum's next quota from its stream:
  a class larger than its quota is sub-sampled fairly over the epochs (every cell once before any
  twice), a smaller one repeats, each of its cells once per pass;
- quotas compose with a corpus's weights in one way: the weights give each source its cells per
  epoch (as without balancing), and each source's cells are shared among its classes in proportion
  to count**(1 - ALPHA) (ALPHA 0: as the data is; 1: every class equal; 0.5: the square root), by
  largest remainder (ties to the class first by name). One dataset is a corpus of one source whose
  quota is its selected cells;
- the epoch's plan is a `CorpusPlan` over the strata: every unit holds every stratum in proportion,
  so each rank's batches carry the same mix, and a resume on any number of ranks re-plans as a
  corpus does. A unit reads each source once (its strata's cells merged, ranges sorted).

Numbers of classes are kept small enough for 16-bit codes (a stable radix sort groups 100M cells in
about a second); a column with more values than that is not a class column.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coordination.arrays import ragged_arange
from coordination.corpus import CorpusPlan, CorpusSource, SourcePass
from coordination.corpus_file import quotas
from coordination.errors import CellfeedError
from coordination.plan import Sampling, block_order
from coordination.seeds import derive_key

MAX_CLASSES = 1 << 16
DEFAULT_POWER = 0.5  # a square-root temperature: rare classes are seen more, a 10-cell class is not repeated 10^5 times


@dataclass(frozen=True)
class Balance:
    """The balancing settings: the obs column whose values are the classes, and ALPHA."""

    column: str
    power: float = DEFAULT_POWER

    def validate(self) -> "Balance":
        if not self.column:
            raise CellfeedError("--balance-by needs an obs column name (`cellfeed inspect DATASET` lists them)")
        if not 0.0 <= float(self.power) <= 1.0:
            raise CellfeedError(
                f"--balance-power must lie in 0..1 (0: as the data is, 1: every class equal), got {self.power}"
            )
        return self


def class_quotas(counts, power: float, size: int) -> np.ndarray:
    """Cells per class in an epoch of `size` cells: shares proportional to count**(1 - power)
    (power 0: as the data is, 1: equal), rounded by largest remainder (they add up to `size`; ties
    go to the earlier class). A class with no cells gets none."""
    counts = np.asarray(counts, dtype=np.float64)
    weights = np.where(counts > 0, counts ** (1.0 - float(power)), 0.0)
    return quotas(weights, size)


GROUP_CHUNK = 1 << 23  # cells grouped at a time: bounded memory beside the result
# a class stored in at least SCATTERED_RUNS runs of fewer than RUN_CELLS cells on average is *scattered*
# (a cell type within every sample): it is read region by region (`ScatteredGroup`), not class by class
RUN_CELLS, SCATTERED_RUNS = 16, 64


class ScatteredGroup:
    """One source's scattered classes (a cell type within every sample) as one stream an epoch,
    read region by region: every storage region (`block_size` consecutive cells; storage order for
    `sequential`, else a Feistel order keyed by the epoch) once, each giving its scattered cells as
    many times as their classes' streams take them this epoch. Reads are the plain plan's blocks;
    each class's cells come exactly as its stream says (quota, passes, without replacement), and a
    class spread over every region is spread over every unit.

    `cells`: the classes' cells, sorted; `keys`, `quotas`, `starts`: each class's stream."""

    def __init__(
        self, classes: list[np.ndarray], keys: list[tuple], quotas_, starts, sampling: Sampling, seed, epoch, geometry
    ):
        # the union of the classes' (sorted) cells, sorted: through a mask, O(cells), not a sort
        mask = np.zeros(max(int(c[-1]) for c in classes) + 1, dtype=bool)
        for c in classes:
            mask[c] = True
        self.cells = np.flatnonzero(mask).astype(classes[0].dtype)  # (int32 where the strata's are)
        del mask
        self.region = max(1, sampling.effective_block_size)
        self._inputs = (classes, keys, np.asarray(quotas_), np.asarray(starts), sampling, int(seed), int(epoch))
        self.geometry = geometry
        self._built = None

    def _build(self):
        """Each cell's count this epoch, and the stream's regions in order with their prefix counts."""
        classes, keys, quotas_, starts, sampling, seed, epoch = self._inputs
        times = np.zeros(len(self.cells), dtype=np.int32)
        index = np.zeros(int(self.cells[-1]) + 1, dtype=np.int32 if len(self.cells) < 2**31 else np.int64)
        index[self.cells] = np.arange(len(self.cells))  # a cell's place in `cells` (a lookup, not a search)
        for cells, key, q, a in zip(classes, keys, quotas_.tolist(), starts.tolist()):
            at, n, b = index[cells], len(cells), a + q
            while a < b:  # pass by pass: whole passes give every cell once, a part the pass's first ones
                k = a // n
                lo, hi = a - k * n, min(b, (k + 1) * n) - k * n
                if lo == 0 and hi == n:
                    times[at] += 1
                else:
                    # (a stratum's pass: its blocks in a Feistel order, `coordination.corpus`)
                    order = SourcePass(CorpusSource(self.geometry, cells, 0, key), sampling, seed, 0, k)
                    times[at[order.positions(lo, hi)]] += 1
                a = k * n + hi
        del index
        n_regions = int(self.cells[-1]) // self.region + 1  # (cells sorted: each region's are a slice)
        order = (
            np.arange(n_regions)
            if sampling.strategy == "sequential"
            else block_order(n_regions, derive_key(seed, epoch, "regions"))
        )
        first = np.searchsorted(self.cells, np.arange(n_regions + 1, dtype=np.int64) * self.region)  # its first cell
        counts = np.add.reduceat(times, first[:-1], dtype=np.int64)  # (an empty region reads its neighbour's: 0)
        counts[first[:-1] == first[1:]] = 0
        counts = counts[order]
        self._built = (times, order, first, np.concatenate([[0], np.cumsum(counts)]))
        return self._built

    def stream(self, a: int, b: int) -> np.ndarray:
        """Local cell ids at offsets [a, b) of this epoch's stream (a cell taken twice, twice)."""
        times, order, first, prefix = self._built or self._build()
        if a >= b:
            return np.zeros(0, dtype=np.int64)
        i0, i1 = np.searchsorted(prefix, [a, b], side="right") - 1
        regions = order[i0 : min(i1, len(order) - 1) + 1]
        at = ragged_arange(first[regions], first[regions + 1])
        cells = np.repeat(self.cells[at], times[at])
        return cells[a - prefix[i0] : b - prefix[i0]].astype(np.int64)


def group_by_class(codes: np.ndarray, n_classes: int, selected: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The selected cells' ids grouped by class, each class's in id order, and where each class's
    run starts (int64[n_classes + 1]). A counting sort in chunks (a stable radix sort of each
    chunk's 16-bit codes): 100M cells take about 5 s and the result's memory, int32 ids where they
    fit (0.4 GB for 100M cells, not 0.8)."""
    bounds = np.zeros(n_classes + 1, dtype=np.int64)
    np.cumsum(np.bincount(codes, minlength=n_classes), out=bounds[1:])
    largest = len(codes) - 1 if selected is None else (int(selected[-1]) if len(selected) else 0)
    out = np.empty(len(codes), dtype=np.int32 if largest < np.iinfo(np.int32).max else np.int64)
    fill = bounds[:-1].copy()
    for lo in range(0, len(codes), GROUP_CHUNK):
        chunk = codes[lo : lo + GROUP_CHUNK].astype(np.uint16)
        order = np.argsort(chunk, kind="stable")
        ids = order + lo if selected is None else np.asarray(selected)[order + lo]
        counts = np.bincount(chunk, minlength=n_classes)
        at = 0
        for k in np.flatnonzero(counts).tolist():
            n = int(counts[k])
            out[fill[k] : fill[k] + n] = ids[at : at + n]
            fill[k] += n
            at += n
    return out, bounds


@dataclass
class Strata:
    """A campaign's strata: per (source, class with selected cells), the source-local cell ids of
    that class (sorted) and where the source's global ids start. `classes`: the class names of all
    sources, sorted; strata are ordered by source, then class."""

    balance: Balance
    classes: list[str]
    source: np.ndarray  # int64[n_strata]: the campaign source of each stratum
    klass: np.ndarray  # int64[n_strata]: its class (an index into `classes`)
    cells: list[np.ndarray] = field(repr=False)  # per stratum: local cell ids (int32 where they fit), sorted
    offsets: list[int] = field(repr=False)  # per campaign source: its first global cell id
    geometries: list = field(repr=False)  # per campaign source: its `DatasetGeometry`
    scattered: np.ndarray = field(default=None, repr=False)  # bool[n_strata]: read by region (RUN_CELLS)

    @classmethod
    def build(cls, balance: Balance, per_source: list[tuple], offsets: list[int], geometries: list) -> "Strata":
        """`per_source`: for each campaign source, (selected local ids or None for all, int codes of
        those cells, the class names the codes index)."""
        names = sorted({n for _, _, source_names in per_source for n in source_names})
        index = {n: i for i, n in enumerate(names)}
        source, klass, cells, scattered = [], [], [], []
        for s, (selected, codes, source_names) in enumerate(per_source):
            codes = np.asarray(codes)
            if len(source_names) > MAX_CLASSES:
                raise CellfeedError(
                    f"--balance-by {balance.column}: {len(source_names):,} distinct values, more than "
                    f"{MAX_CLASSES:,}; balance by a column of classes (cell type, tissue, donor, assay)"
                )
            ids, bounds = group_by_class(codes, len(source_names), selected)
            # how each class lies in storage: its cells per run of consecutive selected cells of it
            first = np.concatenate([[0], np.flatnonzero(codes[1:] != codes[:-1]) + 1]) if len(codes) else []
            runs = np.bincount(np.asarray(codes)[first], minlength=len(source_names))
            spread = (np.diff(bounds) < RUN_CELLS * np.maximum(1, runs)) & (runs >= SCATTERED_RUNS)
            by_name = sorted(range(len(source_names)), key=lambda c: source_names[c])
            for c in by_name:
                if bounds[c + 1] > bounds[c]:
                    source.append(s)
                    klass.append(index[source_names[c]])
                    cells.append(ids[bounds[c] : bounds[c + 1]])
                    scattered.append(bool(spread[c]))
        return cls(
            balance,
            names,
            np.array(source, dtype=np.int64),
            np.array(klass, dtype=np.int64),
            cells,
            list(offsets),
            list(geometries),
            np.array(scattered, dtype=bool),
        )

    @property
    def counts(self) -> np.ndarray:
        return np.array([len(c) for c in self.cells], dtype=np.int64)

    def quotas(self, source_quotas) -> np.ndarray:
        """Cells per stratum in an epoch whose sources have `source_quotas` cells."""
        out = np.zeros(len(self.cells), dtype=np.int64)
        counts = self.counts
        for s, q in enumerate(np.asarray(source_quotas, dtype=np.int64).tolist()):
            mine = np.flatnonzero(self.source == s)
            if len(mine):
                out[mine] = class_quotas(counts[mine], self.balance.power, q)
        return out

    def class_totals(self, per_stratum) -> np.ndarray:
        """Per class (of `classes`): the sum of a per-stratum count."""
        return np.bincount(self.klass, weights=np.asarray(per_stratum), minlength=len(self.classes)).astype(np.int64)

    def plan(self, source_quotas_by_epoch, sampling: Sampling, seed: int, epoch: int) -> CorpusPlan:
        """Epoch `epoch`'s plan; `source_quotas_by_epoch(e)`: each campaign source's cells in epoch e
        (a corpus's mixture may change at a resume; the strata's streams continue)."""
        q = self.quotas(source_quotas_by_epoch(epoch))
        starts = np.zeros(len(self.cells), dtype=np.int64)
        for e in range(epoch):  # each stratum's stream stands where the epochs before left it
            starts += self.quotas(source_quotas_by_epoch(e))
        column = self.balance.column
        keys = [("balance", column, int(s), self.classes[k]) for s, k in zip(self.source.tolist(), self.klass.tolist())]
        runs = np.flatnonzero(~self.scattered)
        sources = [
            CorpusSource(self.geometries[self.source[i]], self.cells[i], self.offsets[self.source[i]], keys[i])
            for i in runs
        ]
        quotas, stream_starts, owners = q[runs].tolist(), starts[runs].tolist(), self.source[runs].tolist()
        for s in np.unique(self.source[self.scattered]).tolist():  # each source's scattered classes: one group
            mine = np.flatnonzero(self.scattered & (self.source == s))
            group = ScatteredGroup(
                [self.cells[i] for i in mine],
                [keys[i] for i in mine],
                q[mine],
                starts[mine],
                sampling,
                seed,
                epoch,
                self.geometries[s],
            )
            sources.append(
                CorpusSource(
                    self.geometries[s], group.cells, self.offsets[s], ("balance", column, s, "scattered"), group
                )
            )
            quotas.append(int(q[mine].sum()))
            stream_starts.append(0)
            owners.append(s)
        return CorpusPlan(
            sources,
            np.array(quotas, dtype=np.int64),
            sampling,
            seed,
            epoch,
            np.array(stream_starts, dtype=np.int64),
            part_sources=np.array(owners, dtype=np.int64),
            balance=(column, float(self.balance.power)),
        )

    def labels(self, n_cells: int) -> np.ndarray:
        """Each global cell id's class (-1: not selected): what items carry as labels, so the
        trainer counts the classes it trains."""
        out = np.full(n_cells, -1, dtype=np.int16 if len(self.classes) < 1 << 15 else np.int32)
        for s, k, cells in zip(self.source.tolist(), self.klass.tolist(), self.cells):
            out[cells + self.offsets[s]] = k
        return out

    def class_mix(self, source_quotas) -> list[list]:
        """[[class, cells planned], ...] of an epoch whose sources have `source_quotas` cells, in class order."""
        return [[n, int(c)] for n, c in zip(self.classes, self.class_totals(self.quotas(source_quotas)))]
