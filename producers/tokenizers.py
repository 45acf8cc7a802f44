"""Tokenizers: whole cells' rows (`CellRows`) → their token sequences (a `CellRows` too), by name, and their layouts.

A tokenizer takes a part's rows as read, the positions of the chunk's cells in them, and the
source's gene -> token lookup (`GeneVocab.lookup_array`): genes outside the vocabulary are dropped first, as scGPT and
Geneformer do, so ranking ties ("gene ascending") go by token id, the same in every source. A
tokenizer's `Layout` (defined once, here; the campaign config reads it too) says which special
tokens frame a cell (by role: "cls", "eos"), how many genes it keeps by default, and what rides
beside the tokens; the special tokens' ids come from the vocabulary (`coordination.vocab`):

| tokenizer       | a cell's tokens                         | default genes | values beside tokens |
|-----------------|-----------------------------------------|---------------|----------------------|
| `scgpt`         | CLS g1 .. gn                            | 1,024         | expression bins      |
| `geneformer-v1` | g1 .. gn            (Geneformer V1)     | 2,048         | none                 |
| `geneformer-v2` | CLS g1 .. gn EOS    (Geneformer V2)     | 4,094         | none                 |
| `raw`           | g1 .. gn in gene order                  | 1,024         | raw values (float32) |

`geneformer` is another name for `geneformer-v2`. An empty cell (no non-zero value) keeps only
its special tokens: CLS for scgpt, CLS EOS for V2, and no token at all for V1 and raw; it is still
delivered, trained on as a sequence with nothing to predict.

- `scgpt`: [CLS] g1..gn, genes in rank order (value descending, gene ascending) or, with
  gene_selection="random", a seeded random subset; a parallel `values` stream holds each gene's
  expression bin (1..n_bins-1, by the cell's own quantiles, see `quantile_bins`), 0 under CLS.
- `geneformer-v1` / `geneformer-v2` (alias `geneformer`): rank value encoding: counts / cell
  total (over all its genes, those outside the vocabulary included, as Geneformer's n_counts) *
  10,000 / the gene's non-zero median of those normalised values over the dataset (`gene_stats`,
  indexed by token id), ranked descending (ties: lower gene id first); V1 is g1..gn (2,048
  genes), V2 is [CLS] g1..gn [EOS] (4,094 genes). Needs integer counts and the medians.
- `raw`: the cell's non-zero genes in gene order with their raw values (float32), no ranking,
  at most `max_genes`.

Two paths give the same tokens: the compiled pass (`producers/token_kernel.py`, what runs), and
the vectorised one (`kernel = False`: `producers/ranking.py`, a NumPy pass per step over a chunk's
cells), which takes what the kernel declines and is what the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coordination.arrays import CellRows
from coordination.errors import CellfeedError
from coordination.vocab import GeneVocab
from producers.ranking import (
    _with_specials,
    gene_order,
    quantile_bins,
    random_order,
    rank_order,
    to_tokens,
    token_dtype,
    truncate,
)


@dataclass(frozen=True)
class Layout:
    name: str
    head: str | None  # the role of the token before the genes ("cls") or None
    tail: str | None  # the role of the token after the genes ("eos") or None
    default_genes: int
    values: str | None  # "bins", "raw" or None: what the `values` stream beside the tokens holds

    def sequence_length(self, max_genes: int) -> int:
        """The longest token sequence of a cell: the genes plus the special tokens around them."""
        return max_genes + (self.head is not None) + (self.tail is not None)

    @property
    def objective(self) -> str | None:
        """What masked modelling predicts: expression bins, gene ids, or None (not trainable here)."""
        return {"bins": "bins", None: "genes"}.get(self.values)


LAYOUTS = {
    "scgpt": Layout("scgpt", "cls", None, 1024, "bins"),
    "geneformer-v1": Layout("geneformer-v1", None, None, 2048, None),
    "geneformer-v2": Layout("geneformer-v2", "cls", "eos", 4094, None),
    "raw": Layout("raw", None, None, 1024, "raw"),
}
ALIASES = {"geneformer": "geneformer-v2"}
TOKENIZER_NAMES = tuple(LAYOUTS) + tuple(ALIASES)


def layout(tokenizer: str) -> Layout:
    """The layout of a tokenizer by name (aliases accepted)."""
    name = ALIASES.get(tokenizer, tokenizer)
    if name not in LAYOUTS:
        raise CellfeedError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZER_NAMES)}")
    return LAYOUTS[name]


class _Tokenizer:
    """`tokenizer(rows, rng, lookup, cells)`: the token rows of the cells at positions `cells` of
    `rows` (None: all), their genes mapped through `lookup` (None: the ids are tokens already)."""

    kernel = True  # False: the vectorised path (the reference the kernel is tested against)
    vocab_size: int

    def _compiled(self, rows: CellRows, lookup, cells, **params) -> CellRows | None:
        from producers.token_kernel import kernel_tokens  # (here: numba costs only processes that tokenize)

        return kernel_tokens(rows, lookup, cells=cells, token_dtype=token_dtype(self.vocab_size), **params)

    @staticmethod
    def _mapped(rows: CellRows, lookup: np.ndarray | None, cells: np.ndarray | None) -> CellRows:
        """The vectorised path's input: the cells at `cells`, their genes mapped."""
        rows = rows if cells is None else rows.select(cells)
        return rows if lookup is None else to_tokens(rows, lookup)


class ScGPTTokenizer(_Tokenizer):
    name = "scgpt"
    needs_counts = False

    def __init__(self, vocab: GeneVocab, max_genes: int, n_bins: int = 51, gene_selection: str = "top", seed: int = 0):
        if n_bins < 3:
            raise CellfeedError(f"n_bins must be >= 3, got {n_bins}")
        if gene_selection not in ("top", "random"):
            raise CellfeedError(f"gene_selection must be 'top' or 'random', got {gene_selection!r}")
        self.vocab_size, self.cls, self.max_genes, self.n_bins = vocab.size, vocab.special("cls"), max_genes, n_bins
        self.gene_selection, self.seed = gene_selection, seed

    def __call__(self, rows: CellRows, rng=None, lookup=None, cells=None) -> CellRows:
        top = self.gene_selection == "top"
        if self.kernel:
            out = self._compiled(
                rows,
                lookup,
                cells,
                mode="scgpt",
                max_genes=self.max_genes,
                head=self.cls if top else None,  # (a random subset is drawn from every ranked gene, below)
                truncate=top,
                n_bins=self.n_bins,  # (its bins as quantile_bins types them: uint8, or uint16 past 256)
            )
            if out is not None:
                return out if top else self._random_subset(out, rng)
        rows = self._mapped(rows, lookup, cells)
        ranked = rank_order(rows)  # full cells by value: quantiles need every non-zero
        if top:
            chosen = truncate(ranked, self.max_genes)
            within = np.arange(len(chosen.ids)) - np.repeat(chosen.offsets[:-1], chosen.counts)
            positions = np.repeat(ranked.offsets[:-1], chosen.counts) + within
            bins = quantile_bins(ranked, self.n_bins, positions)
            return _with_specials(chosen, self.vocab_size, self.cls, None, bins)
        # random subset: bin every non-zero (bins depend on the whole cell), then pick at random
        bins = quantile_bins(ranked, self.n_bins, np.arange(len(ranked.ids)))
        return self._random_subset(CellRows(ranked.cell_ids, ranked.offsets, ranked.ids, bins), rng)

    def _random_subset(self, with_bins: CellRows, rng: np.random.Generator | None) -> CellRows:
        """scGPT's random gene selection: of each cell's ranked, binned rows, a seeded random
        `max_genes`, then CLS."""
        chosen = truncate(random_order(with_bins, rng or np.random.default_rng(self.seed)), self.max_genes)
        return _with_specials(chosen, self.vocab_size, self.cls, None, chosen.values)


class GeneformerTokenizer(_Tokenizer):
    name = "geneformer"
    needs_counts = True

    def __init__(self, vocab: GeneVocab, gene_medians: np.ndarray | None, max_genes: int, layout: Layout):
        if gene_medians is None:
            raise CellfeedError(
                "the geneformer tokenizer needs each gene's non-zero median of normalised counts: "
                "run `cellfeed stats DATASET` once"
            )
        medians = np.asarray(gene_medians, dtype=np.float64)
        if medians.shape != (vocab.size,):
            raise CellfeedError(f"gene_medians has shape {medians.shape}, expected ({vocab.size},): one per token id")
        self.vocab_size, self.max_genes, self.layout = vocab.size, max_genes, layout
        self.head = None if layout.head is None else vocab.special(layout.head)
        self.tail = None if layout.tail is None else vocab.special(layout.tail)
        self.medians = np.where(medians > 0, medians, 1.0)

    def __call__(self, rows: CellRows, rng=None, lookup=None, cells=None) -> CellRows:
        if self.kernel:
            params = dict(max_genes=self.max_genes, head=self.head, tail=self.tail, medians=self.medians)
            out = self._compiled(rows, lookup, cells, mode="geneformer", **params)
            if out is not None:
                return out
        rows = self._mapped(rows, lookup, cells)
        if rows.totals is not None:  # the cells' whole counts: genes outside the vocabulary included
            totals = rows.totals.astype(np.float64)
        else:  # (not np.add.reduceat: it gives an empty cell its neighbour's value, or fails on a last one)
            totals = np.bincount(rows.cell_of_row(), weights=rows.values, minlength=rows.n_cells)
        totals = np.where(totals > 0, totals, 1.0)
        score = rows.values.astype(np.float64) / np.repeat(totals, rows.counts) * 10_000.0 / self.medians[rows.ids]
        chosen = truncate(rank_order(rows, score), self.max_genes)
        return _with_specials(chosen, self.vocab_size, self.head, self.tail)


class RawTokenizer(_Tokenizer):
    name = "raw"
    needs_counts = False

    def __init__(self, vocab: GeneVocab, max_genes: int):
        self.vocab_size, self.max_genes = vocab.size, max_genes

    def __call__(self, rows: CellRows, rng=None, lookup=None, cells=None) -> CellRows:
        if self.kernel:
            out = self._compiled(rows, lookup, cells, mode="raw", max_genes=self.max_genes)
            if out is not None:
                return out
        rows = self._mapped(rows, lookup, cells)
        chosen = truncate(gene_order(rows), self.max_genes)
        return _with_specials(chosen, self.vocab_size, None, None, chosen.values.astype(np.float32))


TOKENIZERS = {
    "scgpt": ScGPTTokenizer,
    "geneformer-v1": GeneformerTokenizer,
    "geneformer-v2": GeneformerTokenizer,
    "raw": RawTokenizer,
}


def needs_gene_medians(name: str) -> bool:
    return TOKENIZERS[layout(name).name] is GeneformerTokenizer


def make_tokenizer(
    name: str,
    vocab: GeneVocab,
    *,
    max_genes: int | None = None,
    values_are_counts: bool = True,
    gene_medians: np.ndarray | None = None,
    **params,
):
    """A tokenizer by name (see `LAYOUTS` for names and layouts) over a vocabulary,
    validated before any work starts. `max_genes` None: the layout's default length;
    `gene_medians`: geneformer's, one per token id."""
    spec = layout(name)
    max_genes = spec.default_genes if max_genes is None else max_genes
    if max_genes < 1:
        raise CellfeedError(f"max_genes must be >= 1, got {max_genes}")
    cls = TOKENIZERS[spec.name]
    if cls.needs_counts and not values_are_counts:
        raise CellfeedError(
            f"the {name} tokenizer needs integer counts, but this dataset stores float values: convert a counts "
            "matrix (`cellfeed convert IN.h5ad OUT --layer raw.X`, or a counts layer), or use --tokenizer scgpt"
        )
    if cls is GeneformerTokenizer:
        return cls(vocab, gene_medians, max_genes=max_genes, layout=spec)
    return cls(vocab, max_genes=max_genes, **params)
