"""A campaign's sources opened for reading: each dataset of a corpus (or the one dataset), its
selected cells, where its global cell ids start, and its genes' token ids under the campaign's
vocabulary (a lookup array built once), with the coverage checks run at setup."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coordination.balance import Balance, Strata
from coordination.corpus import CorpusPlan, CorpusSource
from coordination.corpus_file import CorpusSpec, Mixtures, SourceSpec
from coordination.errors import CellfeedError
from coordination.plan import DatasetGeometry, EpochPlan, Plan, Sampling
from coordination.vocab import MIN_MATCHED_SHARE, GeneVocab, inside
from producers.dataset import Dataset, open_dataset
from producers.gene_stats import load_gene_medians
from producers.selection import class_codes, select_cells
from producers.tokenizers import make_tokenizer, needs_gene_medians

COVERAGE_SAMPLE_ROWS = 1 << 20  # non-zeros read to measure the share the vocabulary keeps


@dataclass
class Source:
    spec: SourceSpec
    ds: Dataset
    gene_column: str
    identifiers: list[str] = field(repr=False)
    selection: np.ndarray | None = field(default=None, repr=False)
    offset: int = 0
    gene_tokens: np.ndarray | None = field(default=None, repr=False)  # gene id -> token id (`lookup_array`)

    @property
    def n_selected(self) -> int:
        return self.ds.n_cells if self.selection is None else len(self.selection)

    def planned(self) -> CorpusSource:
        return CorpusSource(DatasetGeometry.of(self.ds), self.selection, self.offset)


def gene_identifiers(ds: Dataset, column: str, source: str) -> list[str]:
    columns = ds.var().column_names
    if column not in columns:
        raise CellfeedError(
            f"source {source!r} ({ds.uri}) has no gene column {column!r}; its var columns: "
            f"{', '.join(columns)} (choose one with gene_column)"
        )
    return [str(g) for g in ds.var([column]).column(0).to_pylist()]


def open_sources(
    spec: CorpusSpec, *, subset_ids=None, datasets: dict | None = None, verify: bool = True
) -> list[Source]:
    """Each source opened (checked at open unless not `verify`: `Dataset.verify`), its training
    cells selected (its held-out cells taken out), ids placed."""
    sources, offset = [], 0
    for s in spec.sources:
        ds = (datasets or {}).get(s.dataset) or open_dataset(s.dataset, verify=verify)
        column = spec.gene_column_of(s)
        selection = select_cells(ds, s.subset_filter, subset_ids if len(spec.sources) == 1 else None, s.eval_filter)
        sources.append(Source(s, ds, column, gene_identifiers(ds, column, s.name), selection, offset))
        offset += ds.n_cells
    return sources


def balance_strata(sources: list[Source], balance: Balance) -> Strata:
    """The campaign's strata for balanced sampling: each source's selected cells by class
    (`coordination.balance`); a missing column, a cell with no class or a class with no cells is
    refused here, at setup."""
    per_source = []
    for s in sources:
        codes, names = class_codes(s.ds, balance.column, s.selection, s.spec.name)
        per_source.append((s.selection, codes, names))
    return Strata.build(balance, per_source, [s.offset for s in sources], [DatasetGeometry.of(s.ds) for s in sources])


def source_quotas(sources: list[Source], mixtures: Mixtures | None, epoch: int) -> np.ndarray:
    """Each source's cells in `epoch`: its quota under the epoch's mixture (one dataset: its selected cells)."""
    if mixtures is None:
        return np.array([sources[0].n_selected], dtype=np.int64)
    return mixtures.quotas_at(epoch, {s.spec.name: s.n_selected for s in sources})


def epoch_plan(
    sources: list[Source],
    mixtures: Mixtures | None,
    sampling: Sampling,
    seed: int,
    epoch: int,
    strata: Strata | None = None,
) -> Plan:
    """Epoch `epoch`'s plan over the sources: a corpus's (each source its quota under the epoch's
    mixture), or one dataset's selected cells (which a scanner strategy cuts at fragment edges,
    stitching the cells cut there); balanced (`strata`), a corpus plan over the classes of each
    source."""
    if strata is not None:  # (ALPHA 0 too: stratified, every unit and rank carrying the data's own mix)
        return strata.plan(lambda e: source_quotas(sources, mixtures, e), sampling, seed, epoch)
    if mixtures is None:
        return EpochPlan(DatasetGeometry.of(sources[0].ds), sampling, seed, epoch, sources[0].selection)
    selected = {s.spec.name: s.n_selected for s in sources}
    return CorpusPlan(
        [s.planned() for s in sources],
        mixtures.quotas_at(epoch, selected),
        sampling,
        seed,
        epoch,
        mixtures.starts(epoch, selected),
    )


def campaign_tokenizer(
    sources: list[Source], vocab: GeneVocab, name: str, max_genes: int | None, gene_medians: str | None, params: dict
):
    """The campaign's tokenizer `name` over its vocabulary. Geneformer's normalises counts by each
    gene's median over the corpus: from the dataset's `cellfeed stats`, or the file `gene_medians`."""
    counts = all(s.ds.is_counts for s in sources)
    medians = None
    if needs_gene_medians(name) and counts:
        medians = token_medians(sources, vocab, gene_medians)
        if medians is None:
            fix = (
                f"run `cellfeed stats {sources[0].ds.uri}` once"
                if len(sources) == 1
                else "give Geneformer's median dictionary (gene_median_dictionary.pkl or JSON) with --gene-medians"
            )
            raise CellfeedError(f"--tokenizer {name} needs Geneformer's gene medians: {fix}")
    return make_tokenizer(name, vocab, max_genes=max_genes, values_are_counts=counts, gene_medians=medians, **params)


def campaign_vocab(spec: CorpusSpec, sources: list[Source]) -> GeneVocab:
    """The vocabulary file's, or the one built from the sources' identifiers."""
    return GeneVocab.read(spec.vocabulary) if spec.vocabulary else GeneVocab.build(s.identifiers for s in sources)


def attach_vocab(sources: list[Source], vocab: GeneVocab) -> None:
    for s in sources:
        s.gene_tokens = vocab.lookup_array(s.identifiers)


@dataclass(frozen=True)
class Coverage:
    source: str
    genes: int
    genes_matched: int
    nonzeros_kept: float  # share of a sample of non-zeros whose gene is in the vocabulary

    def line(self) -> str:
        return (
            f"{self.source}: {self.genes_matched:,} of {self.genes:,} genes in the vocabulary, "
            f"{self.nonzeros_kept:.1%} of non-zeros kept"
        )


def coverage(source: Source) -> Coverage:
    rows = source.ds.read_rows(0, min(source.ds.n_rows, COVERAGE_SAMPLE_ROWS))
    matched = inside(source.gene_tokens)
    kept = float(matched[rows.gene].mean()) if len(rows.gene) else float(matched.mean())
    return Coverage(source.spec.name, len(matched), int(matched.sum()), kept)


def check_coverage(sources: list[Source], vocab: GeneVocab, threshold: float = MIN_MATCHED_SHARE) -> list[Coverage]:
    """Each source's coverage; a source whose kept non-zeros fall under `threshold` fails in one
    line that shows an identifier from each side and the option to change."""
    out = []
    for s in sources:
        c = coverage(s)
        if c.nonzeros_kept < threshold:
            theirs = next((g for g, t in zip(s.identifiers, inside(s.gene_tokens)) if not t), "?")
            ours = next((g for g in vocab.ids if not g.startswith("<")), "?")
            others = [c for c in s.ds.var().column_names if c != s.gene_column]
            raise CellfeedError(
                f"source {s.spec.name!r}: only {c.nonzeros_kept:.1%} of its non-zeros ({c.genes_matched:,} of "
                f"{c.genes:,} genes) are in the vocabulary ({vocab.origin}) -- its {s.gene_column} reads like "
                f"{theirs!r}, the vocabulary like {ours!r}: name the var column that matches with gene_column"
                + (f" (its columns: {', '.join(others)})" if others else "")
            )
        out.append(c)
    return out


def token_medians(sources: list[Source], vocab: GeneVocab, median_file: str | None = None) -> np.ndarray | None:
    """Geneformer's gene medians indexed by token id: read from a median dictionary (identifier ->
    median, Geneformer's pickle or JSON), or a one-source campaign's `cellfeed stats` mapped
    through its genes' tokens. None when neither is there."""
    from coordination.vocab import read_mapping

    out = np.zeros(vocab.size)
    if median_file:
        mapping = read_mapping(median_file, "gene median dictionary")
        ids = vocab.lookup(list(mapping))
        vals = np.array([float(v) for v in mapping.values()])
        out[ids[ids >= 0]] = vals[ids >= 0]
        return out
    if len(sources) != 1:
        return None  # medians over a whole corpus: give Geneformer's median dictionary
    medians = load_gene_medians(sources[0].ds) if sources[0].ds.is_counts else None
    if medians is None:
        return None
    known = inside(sources[0].gene_tokens)
    out[sources[0].gene_tokens[known]] = medians[known]
    return out
