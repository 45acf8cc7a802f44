"""Tokenizers: whole cells (`CellRows`) → ragged token sequences (`Tokens`), by name.

Token ids are shared by all tokenizers: PAD 0, CLS 1, SEP/EOS 2, MASK 3, gene g → g + 4.

- `scgpt`: [CLS] g1..gn, genes in rank order (value descending, gene ascending) or, with
  gene_selection="random", a seeded random subset; a parallel `values` stream holds each gene's
  expression bin (1..n_bins-1, by the cell's own quantiles, see `ranking.quantile_bins`), 0 under
  CLS.
- `geneformer`: rank value encoding: counts / cell total * 10,000 / the gene's non-zero median
  over the dataset, ranked descending (ties: lower gene id first); [CLS] g1..gn [EOS], at most
  `max_len` tokens in all. Needs integer counts and the medians.
- `raw`: the cell's non-zero genes in gene order with their raw values (float32), no ranking,
  at most `max_genes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coordination.errors import CellfeedError
from coordination.arrays import offsets_of
from producers.ranking import CellRows, quantile_bins, random_order, rank_order, truncate

PAD, CLS, EOS, MASK = 0, 1, 2, 3
GENE_OFFSET = 4


@dataclass
class Tokens:
    """Ragged token sequences of cells: cell i owns tokens[offsets[i]:offsets[i+1]]."""

    cell_ids: np.ndarray
    offsets: np.ndarray
    tokens: np.ndarray
    values: np.ndarray | None = None

    @property
    def n_cells(self) -> int:
        return len(self.cell_ids)


def _token_dtype(n_genes: int):
    return np.uint16 if n_genes + GENE_OFFSET <= np.iinfo(np.uint16).max else np.uint32


def _with_specials(rows: CellRows, n_genes: int, head: int | None, tail: int | None,
                   values: np.ndarray | None = None, value_fill=0) -> Tokens:
    """Gene tokens of each cell framed by optional head/tail tokens (values get `value_fill` there)."""
    counts = rows.counts
    extra = (head is not None) + (tail is not None)
    offsets = offsets_of(counts + extra)
    dtype = _token_dtype(n_genes)
    tokens = np.empty(offsets[-1], dtype=dtype)
    out_values = None if values is None else np.full(offsets[-1], value_fill, dtype=values.dtype)
    gene_pos = np.arange(len(rows.genes)) - np.repeat(rows.offsets[:-1], counts) \
        + np.repeat(offsets[:-1], counts) + (head is not None)
    tokens[gene_pos] = rows.genes.astype(dtype) + GENE_OFFSET
    if head is not None:
        tokens[offsets[:-1]] = head
    if tail is not None:
        tokens[offsets[1:] - 1] = tail
    if out_values is not None:
        out_values[gene_pos] = values
    return Tokens(rows.cell_ids, offsets, tokens, out_values)


class ScGPTTokenizer:
    name = "scgpt"
    needs_counts = False

    def __init__(self, n_genes: int, max_genes: int = 1024, n_bins: int = 51, gene_selection: str = "top",
                 seed: int = 0):
        if n_bins < 3:
            raise CellfeedError(f"n_bins must be >= 3, got {n_bins}")
        if gene_selection not in ("top", "random"):
            raise CellfeedError(f"gene_selection must be 'top' or 'random', got {gene_selection!r}")
        self.n_genes, self.max_genes, self.n_bins = n_genes, max_genes, n_bins
        self.gene_selection, self.seed = gene_selection, seed

    def __call__(self, rows: CellRows, rng: np.random.Generator | None = None) -> Tokens:
        ranked = rank_order(rows)  # full cells by value: quantiles need every non-zero
        if self.gene_selection == "top":
            chosen = truncate(ranked, self.max_genes)
            within = np.arange(len(chosen.genes)) - np.repeat(chosen.offsets[:-1], chosen.counts)
            positions = np.repeat(ranked.offsets[:-1], chosen.counts) + within
            bins = quantile_bins(ranked, self.n_bins, positions)
            return _with_specials(chosen, self.n_genes, CLS, None, bins)
        # random subset: bin every non-zero (bins depend on the whole cell), then pick at random
        bins = quantile_bins(ranked, self.n_bins, np.arange(len(ranked.genes)))
        with_bins = CellRows(ranked.cell_ids, ranked.offsets, ranked.genes, bins)
        chosen = truncate(random_order(with_bins, rng or np.random.default_rng(self.seed)), self.max_genes)
        return _with_specials(chosen, self.n_genes, CLS, None, chosen.values)


class GeneformerTokenizer:
    name = "geneformer"
    needs_counts = True

    def __init__(self, n_genes: int, gene_medians: np.ndarray | None, max_len: int = 2048):
        if gene_medians is None:
            raise CellfeedError(
                "the geneformer tokenizer needs each gene's non-zero median: run `cellfeed stats DATASET` once "
                "or supply gene_medians"
            )
        if max_len < 3:
            raise CellfeedError(f"geneformer max_len must be >= 3, got {max_len}")
        medians = np.asarray(gene_medians, dtype=np.float64)
        if medians.shape != (n_genes,):
            raise CellfeedError(f"gene_medians has shape {medians.shape}, expected ({n_genes},)")
        self.n_genes, self.max_len = n_genes, max_len
        self.medians = np.where(medians > 0, medians, 1.0)

    def __call__(self, rows: CellRows, rng=None) -> Tokens:
        totals = np.add.reduceat(rows.values.astype(np.float64), rows.offsets[:-1]) if len(rows.values) else \
            np.zeros(rows.n_cells)
        totals = np.where(rows.counts > 0, totals, 1.0)
        score = rows.values.astype(np.float64) / np.repeat(totals, rows.counts) * 10_000.0 / self.medians[rows.genes]
        chosen = truncate(rank_order(rows, score), self.max_len - 2)
        return _with_specials(chosen, self.n_genes, CLS, EOS)


class RawTokenizer:
    name = "raw"
    needs_counts = False

    def __init__(self, n_genes: int, max_genes: int = 1024):
        self.n_genes, self.max_genes = n_genes, max_genes

    def __call__(self, rows: CellRows, rng=None) -> Tokens:
        cell = rows.cell_of_row()
        ordered = rows.take(np.lexsort((rows.genes, cell)), rows.offsets)
        chosen = truncate(ordered, self.max_genes)
        return _with_specials(chosen, self.n_genes, None, None, chosen.values.astype(np.float32))


TOKENIZERS = {"scgpt": ScGPTTokenizer, "geneformer": GeneformerTokenizer, "raw": RawTokenizer}


def make_tokenizer(name: str, n_genes: int, *, max_genes: int = 1024, values_are_counts: bool = True,
                   gene_medians: np.ndarray | None = None, **params):
    """A tokenizer by name, validated before any work starts."""
    if name not in TOKENIZERS:
        raise CellfeedError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")
    if max_genes < 1:
        raise CellfeedError(f"max_genes must be >= 1, got {max_genes}")
    cls = TOKENIZERS[name]
    if cls.needs_counts and not values_are_counts:
        raise CellfeedError(
            f"the {name} tokenizer needs integer counts, but this dataset stores float values; "
            "convert the counts matrix (e.g. --layer raw.X or a counts layer) or use the scgpt/raw tokenizer"
        )
    if name == "geneformer":
        return cls(n_genes, gene_medians, max_len=params.pop("max_len", max_genes + 2))
    return cls(n_genes, max_genes=max_genes, **params)
