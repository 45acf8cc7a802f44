"""A corpus: several datasets ("sources") trained together in set proportions, and its epoch plan.

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
import math
import json
import tomllib
from dataclasses import asdict, dataclass, field, fields
from fractions import Fraction
from functools import cached_property
from pathlib import Path

import numpy as np

from coordination.audit import cell_hashes
from coordination.errors import CellfeedError
from coordination.feistel import FeistelPermutation
from coordination.plan import DatasetGeometry, EpochPlan, Sampling, _merge_ranges
from coordination.routing import unit_rank
from coordination.seeds import derive_key

# ------------------------------------------------------------------------------------ the file


@dataclass(frozen=True)
class SourceSpec:
    """One `[[source]]` of a corpus file."""

    name: str
    dataset: str
    weight: float = 1.0
    subset_filter: str | None = None  # training cells of this source (Lance SQL on its obs)
    eval_filter: str | None = None  # held-out cells of this source: never trained on
    gene_column: str | None = None  # the var column naming genes in the vocabulary (default: the corpus's)


@dataclass(frozen=True)
class CorpusSpec:
    """A corpus file (TOML):

        vocabulary = "scgpt_vocab.json"   # optional: a vocabulary file (default: built from the sources)
        gene_column = "gene_id"           # optional: the var column naming genes (default gene_id)
        epoch_cells = 1_000_000           # optional: cells per epoch (default: all selected cells)

        [[source]]
        name = "tahoe"
        dataset = "s3://bucket/tahoe"
        weight = 0.6
        subset_filter = "plate != 'plate14'"   # optional, as --subset-filter
    """

    sources: tuple[SourceSpec, ...]
    vocabulary: str | None = None
    gene_column: str = "gene_id"
    epoch_cells: int | None = None
    path: str = ""

    @classmethod
    def read(cls, path: str | Path) -> "CorpusSpec":
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise CellfeedError(f"cannot read corpus file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise CellfeedError(f"corpus file {path}: not valid TOML ({exc})") from None
        known = {f.name for f in fields(cls)} - {"sources", "path"} | {"source"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CellfeedError(f"corpus file {path}: unknown setting {unknown[0]!r} (known: {', '.join(sorted(known))})")
        allowed = {f.name for f in fields(SourceSpec)}
        sources = []
        for i, s in enumerate(data.get("source", [])):
            bad = sorted(set(s) - allowed)
            if bad or "dataset" not in s:
                what = f"unknown setting {bad[0]!r}" if bad else "no dataset"
                raise CellfeedError(f"corpus file {path}: [[source]] {i + 1} has {what} "
                                    f"(a source has {', '.join(sorted(allowed))})")
            s = dict(s)
            s.setdefault("name", Path(str(s["dataset"]).rstrip("/")).name or f"source{i}")
            sources.append(SourceSpec(**s))
        vocab = data.get("vocabulary")
        if vocab is not None and not Path(vocab).is_absolute():
            vocab = str(path.parent / vocab)  # relative to the corpus file
        sources = [s if "://" in s.dataset or Path(s.dataset).is_absolute()
                   else SourceSpec(**{**asdict(s), "dataset": str(path.parent / s.dataset)}) for s in sources]
        return cls(tuple(sources), vocab, data.get("gene_column", "gene_id"), data.get("epoch_cells"),
                   str(path)).validate()

    def validate(self) -> "CorpusSpec":
        where = f"corpus {self.path}" if self.path else "corpus"
        if not self.sources:
            raise CellfeedError(f"{where}: no [[source]]; give each dataset with its weight")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise CellfeedError(f"{where}: two sources are named {sorted(n for n in names if names.count(n) > 1)[0]!r}")
        for s in self.sources:
            if not isinstance(s.weight, (int, float)) or not s.weight > 0:
                raise CellfeedError(f"{where}: source {s.name!r} has weight {s.weight!r}; weights must be > 0")
        if self.epoch_cells is not None and (not isinstance(self.epoch_cells, int) or self.epoch_cells < 1):
            raise CellfeedError(f"{where}: epoch_cells must be a whole number >= 1, got {self.epoch_cells!r}")
        return self

    @classmethod
    def single(cls, dataset: str, subset_filter=None, eval_filter=None, gene_column: str = "gene_id",
               vocabulary: str | None = None) -> "CorpusSpec":
        """A one-dataset campaign as a corpus of one source."""
        return cls((SourceSpec(Path(dataset.rstrip("/")).name or "dataset", dataset, 1.0, subset_filter,
                               eval_filter),), vocabulary, gene_column)

    def to_toml(self, vocabulary: bool = True) -> str:
        """The file again (paths as resolved: absolute or s3://); `vocabulary`: with its line."""
        q = json.dumps  # a JSON string is a TOML basic string
        lines = [f"gene_column = {q(self.gene_column)}"]
        if vocabulary and self.vocabulary:
            lines.append(f"vocabulary = {q(self.vocabulary)}")
        if self.epoch_cells:
            lines.append(f"epoch_cells = {self.epoch_cells}")
        for s in self.sources:
            lines += ["", "[[source]]"] + [f"{f.name} = {q(getattr(s, f.name))}" for f in fields(SourceSpec)
                                           if getattr(s, f.name) is not None]
        return "\n".join(lines) + "\n"

    def gene_column_of(self, source: SourceSpec) -> str:
        return source.gene_column or self.gene_column


def quotas(weights, size: int) -> np.ndarray:
    """Cells per source per epoch: weight shares of `size` by largest remainder (they add up to
    `size`; ties go to the earlier source)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * size
    out = np.floor(exact).astype(np.int64)
    short = size - int(out.sum())
    out[np.argsort(-(exact - out), kind="stable")[:short]] += 1
    return out


# ------------------------------------------------------------------------------ mixtures


class Mixtures:
    """A run's corpus over its epochs: the corpus file it started with, and each change made at a
    resume with the epoch it applies from (`[(from_epoch, CorpusSpec)]`, the first from 0). The
    sources are the union of all (by name, in order of first appearance: global cell ids stay put);
    a source absent from an epoch's mixture gives it no cells, and each source's stream continues
    where it stopped (a source dropped and added back too)."""

    def __init__(self, history: list[tuple[int, CorpusSpec]]):
        self.history = sorted(history, key=lambda h: h[0])
        names, union = set(), []
        for _, spec in self.history:
            union += [s for s in spec.sources if s.name not in names]
            names |= {s.name for s in spec.sources}
        self.union = CorpusSpec(tuple(union), self.history[0][1].vocabulary, self.history[0][1].gene_column)

    def spec_at(self, epoch: int) -> CorpusSpec:
        return [spec for start, spec in self.history if start <= epoch][-1]

    def quotas_at(self, epoch: int, selected: dict[str, int]) -> np.ndarray:
        """Cells per union source in `epoch` (`selected`: each source's selected cells)."""
        spec = self.spec_at(epoch)
        size = spec.epoch_cells or sum(selected[s.name] for s in spec.sources)
        mine = dict(zip((s.name for s in spec.sources), quotas([s.weight for s in spec.sources], size)))
        return np.array([mine.get(s.name, 0) for s in self.union.sources], dtype=np.int64)

    def starts(self, epoch: int, selected: dict[str, int]) -> np.ndarray:
        """Each union source's stream position at `epoch`'s start: the quotas of the epochs before."""
        out = np.zeros(len(self.union.sources), dtype=np.int64)
        bounds = [start for start, _ in self.history] + [epoch]
        for a, b in zip(bounds[:-1], bounds[1:]):
            if a < epoch:
                out += (min(b, epoch) - a) * self.quotas_at(a, selected)
        return out

    def to_json(self) -> str:
        return json.dumps([[start, spec.to_toml()] for start, spec in self.history])

    @classmethod
    def from_json(cls, text: str, where: str = "") -> "Mixtures":
        history = []
        for start, toml in json.loads(text):
            data = tomllib.loads(toml)
            sources = tuple(SourceSpec(**s) for s in data.get("source", []))
            history.append((int(start), CorpusSpec(sources, data.get("vocabulary"), data.get("gene_column", "gene_id"),
                                                   data.get("epoch_cells"), where).validate()))
        return cls(history)

    def changed(self, new: CorpusSpec, from_epoch: int) -> "Mixtures":
        """These mixtures with `new` applying from `from_epoch` (a change not applied yet is
        replaced); refused in one line when it would change what an epoch already planned reads:
        a source kept by name must keep its dataset and filters (its stream continues), and the
        vocabulary and gene column stay the run's."""
        last = self.history[-1][1]
        if (new.vocabulary, new.gene_column) != (last.vocabulary, last.gene_column):
            raise CellfeedError("the corpus's vocabulary and gene_column are the run's own (its tokens mean those "
                                "genes): keep them, or start a new --run")
        known = {s.name: s for s in self.union.sources}
        for s in new.sources:
            old = known.get(s.name)
            if old is not None and (old.dataset, old.subset_filter, old.eval_filter, old.gene_column) != \
                    (s.dataset, s.subset_filter, s.eval_filter, s.gene_column):
                raise CellfeedError(f"source {s.name!r} changed its dataset or filters: its stream of cells continues "
                                    "across epochs, so a source keeps them; give the changed one a new name")
        return Mixtures([h for h in self.history if h[0] < from_epoch] + [(from_epoch, new)])


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
        if strategy in ("block", "random"):
            bs = max(1, min(sampling.effective_block_size, n // sampling.min_units))
            self.block, self.full = bs, n // bs
            self.perm = FeistelPermutation(self.full, derive_key(seed, "corpus", index, k, "blocks")) \
                if self.full else None
            self.chunks = None
        elif strategy == "sequential":
            self.block, self.perm, self.chunks = None, None, None
        else:  # mixture: the scanner rounds of a one-source plan with this pass's key, chunk by chunk
            plan = EpochPlan(source.geometry, sampling, derive_key(seed, "corpus", index, k), 0, source.selection)
            order = np.concatenate([np.arange(a, b) for rnd in plan._unit_chunks for _, a, b in rnd])
            _, first = np.unique(order, return_index=True)  # a cell cut by a fragment edge is in two chunks
            self.block, self.perm = None, None
            self.chunks = order[np.sort(first)]  # 8 bytes a selected cell: mixture's order is not O(1)

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
                blocks = self.perm(np.arange(first, int(o[-1]) // bs + 1))
                out[inside] = blocks[o // bs - first] * bs + o % bs
            return out
        if self.chunks is not None:
            return self.chunks[a:b]
        return offsets


@dataclass
class CorpusUnit:
    """A corpus unit: per source it draws from, the local cell ids (sorted) and their row ranges."""

    epoch: int
    id: int
    parts: list  # [(source index, cells int64 sorted, ranges int64[k, 2])]

    @property
    def n_cells(self) -> int:
        return sum(len(c) for _, c, _ in self.parts)


class CorpusPlan:
    """The units of one corpus epoch (see the module's text). Quacks as `EpochPlan` where the
    summary, the driver and the producers need it: `n_units`, `n_cells`, `unit(u)`,
    `cells_per_rank`, `cell_hash_per_rank`, `plan_id`, and no boundary cells."""

    def __init__(self, sources: list[CorpusSource], quotas_: np.ndarray, sampling: Sampling, seed: int,
                 epoch: int, starts: np.ndarray | None = None):
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
        per_unit = s.fetch_factor * s.batch_size if s.strategy in ("block", "random") else \
            s.unit_cells * (s.n_scanners if s.strategy == "mixture" else 1)
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
        h.update(json.dumps([[s.geometry.fingerprint, s.offset] for s in self.sources] +
                            [self.quotas.tolist(), self.starts.tolist(), asdict(self.sampling), self.seed,
                             self.epoch]).encode())
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
        return np.bincount(unit_rank(np.arange(self.n_units), world_size), weights=self.unit_cell_counts,
                           minlength=world_size).astype(np.int64)

    def source_cells(self) -> np.ndarray:
        """Cells planned per source in this epoch (its quota)."""
        return self.quotas.copy()

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

    def unit(self, u: int) -> CorpusUnit:
        if not 0 <= u < self.n_units:
            raise IndexError(f"unit {u} out of range 0..{self.n_units - 1}")
        parts = []
        for s, src in enumerate(self.sources):
            cells = np.sort(self.unit_cells(u, s))
            if len(cells):
                starts = src.geometry.cell_row_start
                parts.append((s, cells, _merge_ranges(starts[cells], starts[cells + 1])))
        return CorpusUnit(self.epoch, u, parts)

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
    return np.searchsorted(np.asarray(offsets, dtype=np.int64), np.asarray(cell_ids, dtype=np.int64),
                           side="right") - 1
