"""A synthetic, Tahoe-like atlas: plates of unequal size stored in order, each with its own
expression shift, heavy-tailed gene popularity and integer counts.

It exists to make the ordering problem real in tests and benchmarks: streaming it in storage
order yields batches from one plate at a time, and a classifier can tell plates apart.

Labels that do not depend on the plate carry signal of their own, so a model trained on some
plates can be judged on another (downstream parity in `benchmarks/randomness.py`):
- `cell_line`: every plate pools all 50 lines, in proportions of its own (a Dirichlet draw, as
  drugs thin some lines more than others); each line expresses a few marker genes of its own a
  little (`marker_fraction` of its draws), on every plate.
- `dose`: a stress programme shared by all drugs, drawn more the higher the dose.
`drug` stays plate-specific (as in Tahoe, a plate holds a subset of the drugs), so it is not
such a label.

For balanced sampling (`--balance-by`), `tissue` is a skewed class column: 50 tissues whose sizes
follow Zipf's law (tissue k holds a share proportional to 1/k), stored as runs of cells (samples
of one tissue each, in a shuffled order), as an atlas ordered by experiment stores them.

Generation is chunked (CHUNK_CELLS cells at a time, each chunk seeded by (seed, chunk index)),
so memory is bounded by a chunk and the output depends only on the seed and the sizes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from coordination.errors import CellfeedError
from producers.dataset import Dataset
from producers.writer import ROWS_PER_FRAGMENT, DatasetWriter

VERSION = 3  # raised whenever a spec yields other data than before (2: cell-line and dose signal; 3: tissue)
CHUNK_CELLS = 4096
URN_SIZE = 1 << 22  # a gene "urn" per plate: drawing uniformly from it samples gene popularity
N_CELL_LINES = 50
N_DRUGS = 380
DOSES_UM = (0.05, 0.5, 5.0)
PLATE_SMALLEST, PLATE_LARGEST = 0.047, 0.104  # Tahoe-100M's plates span 4.7%..10.4% of cells
LINE_DIRICHLET = 2.0  # spread of cell-line proportions between plates (smaller: more uneven)
MARKERS_PER_LINE = 24
DOSE_GENES = 24
DOSE_FRACTION = (0.0, 0.002, 0.004)  # of a cell's draws, from the dose programme, per dose
N_TISSUES = 50
TISSUE_RUNS = 400  # samples (runs of one tissue) in the atlas ...
TISSUE_RUN_CELLS = 256  # ... of at least this many cells (a real sample holds thousands), a tissue's last one shorter


@dataclass(frozen=True)
class SynthSpec:
    n_cells: int
    n_genes: int = 62_710
    n_plates: int = 14
    seed: int = 0
    median_nnz: int = 1500
    min_nnz: int = 500
    max_nnz: int = 3000
    near_empty_fraction: float = 0.002
    marker_fraction: float = 0.005  # of a cell's draws, from its line's markers: ~12 of ~2,400 draws

    def validate(self) -> None:
        if self.n_cells < 1:
            raise CellfeedError(f"--cells must be >= 1, got {self.n_cells}")
        if not 1 <= self.n_plates <= self.n_cells:
            raise CellfeedError(f"--plates must be between 1 and the number of cells, got {self.n_plates}")
        if self.n_genes < 16:
            raise CellfeedError(f"--genes must be >= 16, got {self.n_genes}")
        if not 0.0 <= self.marker_fraction < 1.0:
            raise CellfeedError(f"marker_fraction must be in [0, 1), got {self.marker_fraction}")
        if self.n_genes > np.iinfo(np.int32).max:
            raise CellfeedError(f"--genes must be < 2^31, got {self.n_genes}")


def plate_sizes(n_cells: int, n_plates: int) -> np.ndarray:
    """Cells per plate: unequal, from ~4.7% to ~10.4% of the atlas for 14 plates (as in Tahoe).

    Fractions follow smallest + (largest - smallest) * (i / (P - 1)) ** k with k chosen so the
    14-plate fractions sum to 1; other plate counts keep the same shape, renormalised.
    """
    if n_plates == 1:
        return np.array([n_cells])
    x = np.linspace(0.0, 1.0, 14)
    lo, hi = 0.1, 10.0
    for _ in range(60):  # bisection on k: sum of the 14 fractions == 1
        k = (lo + hi) / 2
        s = np.sum(PLATE_SMALLEST + (PLATE_LARGEST - PLATE_SMALLEST) * x**k)
        lo, hi = (k, hi) if s > 1 else (lo, k)
    frac = PLATE_SMALLEST + (PLATE_LARGEST - PLATE_SMALLEST) * np.linspace(0.0, 1.0, n_plates) ** k
    frac = np.random.default_rng(12345).permutation(frac / frac.sum())
    sizes = np.floor(frac * n_cells).astype(np.int64)
    remainder = n_cells - sizes.sum()
    sizes[np.argsort(-(frac * n_cells - sizes))[:remainder]] += 1  # largest remainders
    return sizes


class _Model:
    """Per-plate gene urns and depth factors, built once from the seed."""

    def __init__(self, spec: SynthSpec):
        rng = np.random.default_rng([spec.seed, 0xA71A5])
        g = spec.n_genes
        # heavy-tailed popularity (Zipf-like), genes in random order
        base = rng.permutation(1.0 / np.arange(1, g + 1) ** 0.9)
        self.urns = []
        for _ in range(spec.n_plates):
            w = base.copy()
            shifted = rng.choice(g, size=max(1, g // 8), replace=False)  # plate-specific programme
            w[shifted] *= np.exp(rng.normal(0.0, 1.5, size=len(shifted)))
            counts = np.floor(w / w.sum() * URN_SIZE).astype(np.int64)
            self.urns.append(np.repeat(np.arange(g, dtype=np.int32), counts))
        self.plate_drugs = [
            np.sort(rng.choice(N_DRUGS, size=max(1, N_DRUGS // spec.n_plates + 1), replace=False))
            for _ in range(spec.n_plates)
        ]
        self.depth = np.exp(rng.normal(0.0, 0.12, size=spec.n_plates))  # plate sequencing depth
        self.line_mix = rng.dirichlet(np.full(N_CELL_LINES, LINE_DIRICHLET), size=spec.n_plates)
        n_signal = N_CELL_LINES * MARKERS_PER_LINE + DOSE_GENES  # distinct genes where there are enough
        signal = rng.choice(g, size=n_signal, replace=g < n_signal)
        self.markers = signal[: N_CELL_LINES * MARKERS_PER_LINE].reshape(N_CELL_LINES, MARKERS_PER_LINE)
        self.dose_genes = signal[N_CELL_LINES * MARKERS_PER_LINE :]
        # draws with replacement collide on popular genes: tabulate expected distinct genes per
        # number of draws, E[distinct | d] = sum_g 1 - (1 - p_g)^d, to draw as many as a cell needs
        self.draw_grid = np.unique(np.geomspace(1, 40 * spec.max_nnz, 96).astype(np.int64))
        self.distinct = []
        for urn in self.urns:
            p = np.bincount(urn, minlength=g) / len(urn)
            log_q = np.log1p(-p[p > 0])
            self.distinct.append(np.array([np.sum(-np.expm1(d * log_q)) for d in self.draw_grid]))

    def draws_for(self, plate: int, nnz: np.ndarray) -> np.ndarray:
        """Draws needed so that a cell of `plate` expects `nnz` distinct genes."""
        return np.ceil(np.interp(nnz, self.distinct[plate], self.draw_grid)).astype(np.int64)


def tissue_sizes(n_cells: int) -> np.ndarray:
    """Cells per tissue: Zipf's law over N_TISSUES tissues (shares proportional to 1/k), rounded by
    largest remainder, every tissue at least one cell where there are enough cells."""
    exact = (1.0 / np.arange(1, N_TISSUES + 1)) / (1.0 / np.arange(1, N_TISSUES + 1)).sum() * n_cells
    sizes = np.floor(exact).astype(np.int64)
    sizes[np.argsort(-(exact - sizes), kind="stable")[: n_cells - int(sizes.sum())]] += 1
    if n_cells >= N_TISSUES:
        while (sizes == 0).any():  # a few cells from the largest to the empty
            sizes[np.argmax(sizes)] -= 1
            sizes[np.flatnonzero(sizes == 0)[0]] += 1
    return sizes


def tissue_layout(spec: SynthSpec) -> np.ndarray:
    """Each cell's tissue in storage order: every tissue cut into runs (samples), the runs shuffled."""
    rng = np.random.default_rng([spec.seed, 1_000_003])  # its own stream: the other columns are unchanged
    sizes = tissue_sizes(spec.n_cells)
    run_cells = max(TISSUE_RUN_CELLS, spec.n_cells // TISSUE_RUNS)
    runs = [(t, min(run_cells, n - a)) for t, n in enumerate(sizes.tolist()) for a in range(0, n, run_cells)]
    order = rng.permutation(len(runs))
    return np.repeat([runs[i][0] for i in order], [runs[i][1] for i in order]).astype(np.int16)


def expressed_genes(spec: SynthSpec, rng: np.random.Generator, depth: np.ndarray) -> np.ndarray:
    """Each cell's count of expressed genes, for cells of sequencing depth `depth` (a factor per
    cell): log-normal around the median, clipped, and a few near-empty cells (as QC lets through).
    `benchmarks/train_step.py --lengths atlas` draws its cell lengths here too."""
    nnz = np.exp(rng.normal(np.log(spec.median_nnz), 0.38, size=len(depth))) * depth
    nnz = np.clip(nnz, spec.min_nnz, spec.max_nnz).astype(np.int64)
    near_empty = rng.random(len(depth)) < spec.near_empty_fraction
    nnz[near_empty] = rng.integers(1, 20, size=int(near_empty.sum()))
    return nnz


def _chunk(
    spec: SynthSpec,
    model: _Model,
    plate_of: np.ndarray,
    start: int,
    stop: int,
    chunk_index: int,
    tissue_of: np.ndarray | None = None,
):
    """Cells [start, stop): obs table and CSR (indptr, genes, values), sorted by gene per cell."""
    rng = np.random.default_rng([spec.seed, chunk_index])
    n = stop - start
    plates = plate_of[start:stop]
    nnz = expressed_genes(spec, rng, model.depth[plates])
    # at most half the genes: a small vocabulary stays sparse, and no cell asks its urn for nearly
    # every gene (the draws that takes grow without bound: 600 cells of 800 genes took 6 s, not 0.1)
    nnz = np.minimum(nnz, max(1, spec.n_genes // 2))
    lines = np.empty(n, dtype=np.int64)
    for p in np.unique(plates):
        lines[plates == p] = rng.choice(N_CELL_LINES, size=int((plates == p).sum()), p=model.line_mix[p])
    doses = rng.integers(0, len(DOSES_UM), size=n)
    # draw genes with replacement from the plate's urn; repeats merge into counts
    draws = np.empty(n, dtype=np.int64)
    for p in np.unique(plates):
        draws[plates == p] = model.draws_for(p, nnz[plates == p])
    cell_of_draw = np.repeat(np.arange(n, dtype=np.int64), draws)
    genes = np.empty(len(cell_of_draw), dtype=np.int64)
    pos = 0
    for p in np.unique(plates):  # plates are contiguous in storage: at most a couple per chunk
        sel = plates == p
        k = int(draws[sel].sum())
        urn = model.urns[p]
        genes[pos : pos + k] = urn[rng.integers(0, len(urn), size=k)]
        pos += k
    # and a few more from the cell line's markers and the dose programme (near-empty cells too)
    n_marker = rng.binomial(draws, spec.marker_fraction)
    n_dose = rng.binomial(draws, np.asarray(DOSE_FRACTION)[doses])
    marker_cell = np.repeat(np.arange(n, dtype=np.int64), n_marker)
    dose_cell = np.repeat(np.arange(n, dtype=np.int64), n_dose)
    cell_of_draw = np.concatenate([cell_of_draw, marker_cell, dose_cell])
    genes = np.concatenate(
        [
            genes,
            model.markers[lines[marker_cell], rng.integers(0, MARKERS_PER_LINE, size=len(marker_cell))],
            model.dose_genes[rng.integers(0, DOSE_GENES, size=len(dose_cell))],
        ]
    )
    indptr, genes, values = _merged(cell_of_draw, genes, spec.n_genes, n, rng)

    ids = np.arange(start, stop)
    drug_pick = rng.integers(0, 1 << 30, size=n)
    drugs = np.empty(n, dtype=np.int64)
    for p in np.unique(plates):
        sel = plates == p
        choices = model.plate_drugs[p]
        drugs[sel] = choices[drug_pick[sel] % len(choices)]
    obs = pa.table(
        {
            "cell_id": pa.array([f"cell_{i:09d}" for i in ids]),
            "plate": pa.array([f"plate{p + 1:02d}" for p in plates]),
            "cell_line": pa.array([f"CVCL_{c:04d}" for c in lines]),
            "drug": pa.array([f"drug_{d:03d}" for d in drugs]),
            "dose": pa.array(np.asarray(DOSES_UM)[doses], type=pa.float32()),
            "tissue": pa.array([f"tissue_{t:02d}" for t in tissue_of[start:stop]]),
        }
    )
    return obs, indptr, genes, values


def _merged(cell_of_draw: np.ndarray, genes: np.ndarray, n_genes: int, n: int, rng):
    """A gene drawn k times for a cell is one entry of count k x a geometric draw (CSR, sorted by gene)."""
    key = cell_of_draw * n_genes + genes
    key.sort()
    first = np.empty(len(key), dtype=bool)
    first[0] = True
    np.not_equal(key[1:], key[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    multiplicity = np.diff(np.append(starts, len(key)))
    key = key[starts]
    cell = key // n_genes
    genes = key - cell * n_genes
    values = np.minimum(multiplicity * rng.geometric(0.55, size=len(key)), 65_535).astype(np.uint16)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(cell, minlength=n), out=indptr[1:])
    return indptr, genes, values


def iter_chunks(spec: SynthSpec):
    """The atlas as (obs, indptr, genes, values) chunks of CHUNK_CELLS cells, in storage order."""
    spec.validate()
    model = _Model(spec)
    plate_of = np.repeat(np.arange(spec.n_plates), plate_sizes(spec.n_cells, spec.n_plates))
    tissue_of = tissue_layout(spec)
    for index, start in enumerate(range(0, spec.n_cells, CHUNK_CELLS)):
        yield _chunk(spec, model, plate_of, start, min(start + CHUNK_CELLS, spec.n_cells), index, tissue_of)


def gene_table(spec: SynthSpec, gene_ids=None) -> pa.Table:
    """var: Ensembl-like ids ENSG00000000000.., or `gene_ids` (another atlas's gene set and order)."""
    ids = [f"ENSG{g:011d}" for g in range(spec.n_genes)] if gene_ids is None else [str(g) for g in gene_ids]
    if len(ids) != spec.n_genes or len(set(ids)) != len(ids):
        raise CellfeedError(f"gene_ids must be {spec.n_genes:,} distinct identifiers, got {len(ids):,}")
    return pa.table({"gene_id": pa.array(ids)})


def synthesize(
    out: str,
    spec: SynthSpec,
    *,
    rows_per_fragment: int = ROWS_PER_FRAGMENT,
    overwrite: bool = False,
    progress: bool = True,
    settings=None,
    gene_ids=None,
) -> Dataset:
    """Write a synthetic atlas to `out` (local path or s3://); returns the opened dataset.
    `gene_ids`: the var identifiers of its genes (default ENSG00000000000..)."""
    spec.validate()
    var = gene_table(spec, gene_ids)
    writer = DatasetWriter(
        out,
        n_genes=spec.n_genes,
        value_type=pa.uint16(),
        rows_per_fragment=rows_per_fragment,
        overwrite=overwrite,
        settings=settings,
    )
    # disable=None: a bar on a terminal only, quiet in logs (tqdm's own test)
    with (
        writer,
        tqdm(total=spec.n_cells, unit="cell", unit_scale=True, desc="synth", disable=None if progress else True) as bar,
    ):
        for obs, indptr, genes, values in iter_chunks(spec):
            writer.append(obs, indptr, genes, values)
            bar.update(obs.num_rows)
        sizes = plate_sizes(spec.n_cells, spec.n_plates).tolist()
        meta = {"synthetic": {"version": VERSION, "seed": spec.seed, "n_plates": spec.n_plates, "plate_sizes": sizes}}
        return writer.commit(var, meta)


def cached_atlas(n_cells: int, seed: int = 0) -> str:
    """The path of a synthetic atlas in the temp dir, for benchmarks: made once per (cells, seed,
    VERSION), so an atlas of an older generator is never reused."""
    path = os.path.join(tempfile.gettempdir(), f"cellfeed-bench-atlas-{n_cells}-s{seed}-v{VERSION}")
    if not os.path.exists(os.path.join(path, "config.json")):
        # built beside it and renamed into place: two processes asking at once never see half an atlas
        staging = tempfile.mkdtemp(prefix=os.path.basename(path) + ".building-", dir=os.path.dirname(path))
        synthesize(os.path.join(staging, "atlas"), SynthSpec(n_cells=n_cells, seed=seed), progress=False)
        try:
            os.rename(os.path.join(staging, "atlas"), path)
        except OSError:  # another process got there first: its atlas is the same
            pass
        shutil.rmtree(staging, ignore_errors=True)
    return path
