"""A corpus file (TOML): the sources a campaign trains on together, with their weights and
filters (`CorpusSpec`); each source's cells per epoch (`quotas`); and a run's corpus over its
epochs as it changes at resumes (`Mixtures`). The epoch plan over a corpus is
`coordination.corpus.CorpusPlan`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import tomllib

from coordination.errors import CellfeedError

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
            raise CellfeedError(
                f"corpus file {path}: unknown setting {unknown[0]!r} (known: {', '.join(sorted(known))})"
            )
        allowed = {f.name for f in fields(SourceSpec)}
        sources = []
        for i, s in enumerate(data.get("source", [])):
            bad = sorted(set(s) - allowed)
            if bad or "dataset" not in s:
                what = f"unknown setting {bad[0]!r}" if bad else "no dataset"
                raise CellfeedError(
                    f"corpus file {path}: [[source]] {i + 1} has {what} (a source has {', '.join(sorted(allowed))})"
                )
            s = dict(s)
            s.setdefault("name", Path(str(s["dataset"]).rstrip("/")).name or f"source{i}")
            sources.append(SourceSpec(**s))
        vocab = data.get("vocabulary")
        if vocab is not None and not Path(vocab).is_absolute():
            vocab = str(path.parent / vocab)  # relative to the corpus file
        sources = [
            s
            if "://" in s.dataset or Path(s.dataset).is_absolute()
            else SourceSpec(**{**asdict(s), "dataset": str(path.parent / s.dataset)})
            for s in sources
        ]
        return cls(
            tuple(sources), vocab, data.get("gene_column", "gene_id"), data.get("epoch_cells"), str(path)
        ).validate()

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
    def single(
        cls,
        dataset: str,
        subset_filter=None,
        eval_filter=None,
        gene_column: str = "gene_id",
        vocabulary: str | None = None,
    ) -> "CorpusSpec":
        """A one-dataset campaign as a corpus of one source."""
        return cls(
            (SourceSpec(Path(dataset.rstrip("/")).name or "dataset", dataset, 1.0, subset_filter, eval_filter),),
            vocabulary,
            gene_column,
        )

    def to_toml(self, vocabulary: bool = True) -> str:
        """The file again (paths as resolved: absolute or s3://); `vocabulary`: with its line."""
        q = json.dumps  # a JSON string is a TOML basic string
        lines = [f"gene_column = {q(self.gene_column)}"]
        if vocabulary and self.vocabulary:
            lines.append(f"vocabulary = {q(self.vocabulary)}")
        if self.epoch_cells:
            lines.append(f"epoch_cells = {self.epoch_cells}")
        for s in self.sources:
            lines += ["", "[[source]]"] + [
                f"{f.name} = {q(getattr(s, f.name))}" for f in fields(SourceSpec) if getattr(s, f.name) is not None
            ]
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
            history.append(
                (
                    int(start),
                    CorpusSpec(
                        sources,
                        data.get("vocabulary"),
                        data.get("gene_column", "gene_id"),
                        data.get("epoch_cells"),
                        where,
                    ).validate(),
                )
            )
        return cls(history)

    def changed(self, new: CorpusSpec, from_epoch: int) -> "Mixtures":
        """These mixtures with `new` applying from `from_epoch` (a change not applied yet is
        replaced); refused in one line when it would change what an epoch already planned reads:
        a source kept by name must keep its dataset and filters (its stream continues), and the
        vocabulary and gene column stay the run's."""
        last = self.history[-1][1]
        if (new.vocabulary, new.gene_column) != (last.vocabulary, last.gene_column):
            raise CellfeedError(
                "the corpus's vocabulary and gene_column are the run's own (its tokens mean those "
                "genes): keep them, or start a new --run"
            )
        known = {s.name: s for s in self.union.sources}
        for s in new.sources:
            old = known.get(s.name)
            if old is not None and (old.dataset, old.subset_filter, old.eval_filter, old.gene_column) != (
                s.dataset,
                s.subset_filter,
                s.eval_filter,
                s.gene_column,
            ):
                raise CellfeedError(
                    f"source {s.name!r} changed its dataset or filters: its stream of cells continues "
                    "across epochs, so a source keeps them; give the changed one a new name"
                )
        return Mixtures([h for h in self.history if h[0] < from_epoch] + [(from_epoch, new)])
