"""Per-gene statistics stored with a dataset: Geneformer's gene medians, computed exactly, out of core.

Geneformer's rank value encoding divides each gene's depth-normalised count by that gene's
non-zero median over the corpus. A value here is `x / n_counts * 10,000` (float64), `x` a count
and `n_counts` the cell's total count over all its genes; a gene's median is NumPy's median of
its values in the cells where it is non-zero (the mean of the two middle values for an even
count). Genes never expressed get 0.

Exact without holding the values: positive float64s order like their bit patterns read as
uint64, so each median is a radix selection over those bits. A first pass histograms the
exponent per gene (64 buckets), each further pass 8 more bits inside the bucket that holds the
middle rank, until few enough candidates remain (`collect_limit`) to gather them in one last
pass and select exactly. Memory: a (genes x 256) histogram per middle rank; Tahoe-100M
(2e11 non-zeros) needs about three passes. Results go to `gene_stats.lance`, listed in
config.json.
"""

from __future__ import annotations

import json

import lance
import numpy as np
import pyarrow as pa
from tqdm import tqdm

from coordination.arrays import offsets_of
from coordination.errors import CellfeedError
from coordination.vocab import inside
from producers.dataset import LANCE_FILE_VERSION, Dataset

TABLE = "gene_stats.lance"
COLUMN = "normalized_nonzero_median"  # older stats (raw-count medians) lack it and are not used
TARGET_SUM = 10_000.0
CHUNK_ROWS = 1 << 22
COLLECT_LIMIT = 1 << 24  # candidate values gathered in the final pass (8 bytes each)
# first pass: the sign+exponent bits (>> 52); values lie in [10,000 / 2^55, 10,000] (counts < 2^24
# in at most 2^31 genes), i.e. exponents -42..13, inside this 64-bucket window
EXPONENT_BASE = int(np.float64(2.0**-48).view(np.uint64)) >> 52
EXPONENT_BUCKETS = 64


def normalized_values(ds: Dataset, chunk_rows: int = CHUNK_ROWS, progress: bool = False, desc: str = ""):
    """(gene ids, x / n_counts * 10,000) of whole cells, chunk by chunk in storage order."""
    starts = ds.cell_row_start
    bounds = np.searchsorted(starts, np.arange(0, ds.n_rows, chunk_rows), side="right") - 1
    bounds = np.unique(np.r_[bounds, ds.n_cells])  # cell boundaries near every chunk_rows rows
    # disable=None: a bar on a terminal only, quiet in logs (tqdm's own test)
    with tqdm(
        total=ds.n_rows,
        desc=desc,
        unit="row",
        unit_scale=True,
        disable=None if progress else True,
    ) as bar:
        for c0, c1 in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            block = ds.read_rows(int(starts[c0]), int(starts[c1]))
            counts = np.diff(starts[c0 : c1 + 1])
            values = block.value.astype(np.float64)
            has_rows = counts > 0
            totals = np.zeros(len(counts))
            totals[has_rows] = np.add.reduceat(values, offsets_of(counts)[:-1][has_rows])
            yield block.gene.astype(np.int64), values / np.repeat(totals, counts) * TARGET_SUM
            bar.update(len(values))


def compute_gene_medians(
    ds: Dataset | list,
    progress: bool = True,
    collect_limit: int = COLLECT_LIMIT,
    chunk_rows: int = CHUNK_ROWS,
    n_out: int | None = None,
) -> np.ndarray:
    """Each gene's non-zero median of depth-normalised counts (Geneformer's), exactly. `ds`: one
    dataset (medians per gene id), or a corpus as [(dataset, its `GeneVocab.lookup_array`)] (medians per
    token id, `n_out` of them, over every source's cells; a cell is normalised by its whole total)."""
    parts = ds if isinstance(ds, list) else [(ds, None)]
    for one, _ in parts:
        if not one.is_counts:
            raise CellfeedError(
                f"gene medians are for integer counts; {one.uri} stores float values "
                "(convert a counts matrix, e.g. `cellfeed convert IN.h5ad OUT --layer raw.X`)"
            )
    g = n_out if n_out is not None else parts[0][0].n_genes

    def chunks(desc):
        for one, tokens in parts:
            for genes, values in normalized_values(one, chunk_rows, progress, desc):
                if tokens is None:
                    yield genes, values
                else:
                    mapped = tokens[genes]
                    known = inside(mapped)
                    yield mapped[known].astype(np.int64), values[known]

    # pass 1: exponents (no prefix yet), one histogram serves both middle ranks
    hist = np.zeros(g * EXPONENT_BUCKETS, dtype=np.int64)
    for genes, values in chunks("gene medians: exponents"):
        digit = (values.view(np.uint64) >> np.uint64(52)).astype(np.int64) - EXPONENT_BASE
        if len(digit) and (digit.min() < 0 or digit.max() >= EXPONENT_BUCKETS):
            raise CellfeedError("a normalised value lies outside the expected range; is the dataset corrupt?")
        hist += np.bincount(genes * EXPONENT_BUCKETS + digit, minlength=len(hist))
    hist = hist.reshape(g, EXPONENT_BUCKETS)
    n = hist.sum(axis=1)
    expressed = n > 0
    ranks = [np.maximum(n - 1, 0) // 2, n // 2]  # 0-based ranks of the two middle values
    prefixes, in_bucket = [], []
    for t in range(2):  # choose each target's exponent bucket
        bucket, ranks[t], count = _select(hist, ranks[t])
        prefixes.append((bucket + EXPONENT_BASE).astype(np.uint64))
        in_bucket.append(count)
    shift = 52  # bits below the known prefix

    # refine 8 bits at a time while too many candidates remain (and bits remain)
    while shift > 0 and sum(int(c[expressed].sum()) for c in in_bucket) > collect_limit:
        width = min(8, shift)
        shift -= width
        hists = [np.zeros(g << width, dtype=np.int64) for _ in range(2)]
        for genes, values in chunks(f"gene medians: bits {shift + width}..{shift}"):
            keys = values.view(np.uint64)
            digit = ((keys >> np.uint64(shift)) & np.uint64((1 << width) - 1)).astype(np.int64)
            for t in range(2):
                hit = (keys >> np.uint64(shift + width)) == prefixes[t][genes]
                hists[t] += np.bincount((genes[hit] << width) + digit[hit], minlength=len(hists[t]))
        for t in range(2):
            bucket, ranks[t], in_bucket[t] = _select(hists[t].reshape(g, 1 << width), ranks[t])
            prefixes[t] = (prefixes[t] << np.uint64(width)) | bucket.astype(np.uint64)

    if shift == 0:  # every bit is known: the prefixes are the values
        middle = [p.view(np.float64) for p in prefixes]
    else:  # gather the candidates and select exactly
        middle = _select_exactly(chunks("gene medians: select"), prefixes, ranks, shift, expressed)
    return np.where(expressed, (middle[0] + middle[1]) / 2, 0.0)


def _select_exactly(chunks, prefixes: list, ranks: list, shift: int, expressed: np.ndarray) -> list[np.ndarray]:
    """The two middle values of each gene: its candidates (values whose top bits are its prefix) gathered
    in one pass over `chunks`, sorted, and the middle ranks picked."""
    g = len(expressed)
    found = [([], []) for _ in range(2)]
    for genes, values in chunks:
        keys = values.view(np.uint64)
        for t in range(2):
            hit = (keys >> np.uint64(shift)) == prefixes[t][genes]
            found[t][0].append(genes[hit])
            found[t][1].append(values[hit])
    middle = []
    for t in range(2):
        genes, values = np.concatenate(found[t][0]), np.concatenate(found[t][1])
        order = np.lexsort((values, genes))
        first = np.searchsorted(genes[order], np.arange(g))
        picked = np.zeros(g)
        picked[expressed] = values[order][first[expressed] + ranks[t][expressed]]
        middle.append(picked)
    return middle


def _select(hist: np.ndarray, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per gene (row): the bucket holding the value of 0-based `rank`, the rank inside that
    bucket, and the bucket's count."""
    cum = np.cumsum(hist, axis=1)
    bucket = np.minimum((cum <= rank[:, None]).sum(axis=1), hist.shape[1] - 1)
    below = np.where(bucket > 0, cum[np.arange(len(rank)), bucket - 1], 0)
    return bucket, rank - below, hist[np.arange(len(rank)), bucket]


def store_gene_stats(ds: Dataset, medians: np.ndarray) -> None:
    table = pa.table(
        {
            "gene_integer_id": pa.array(np.arange(ds.n_genes), type=pa.int32()),
            COLUMN: pa.array(medians, type=pa.float64()),
        }
    )
    options = dict(storage_options=ds.location.lance_options(), data_storage_version=LANCE_FILE_VERSION)
    try:  # "create" first: "overwrite" of a table that does not exist yet logs a warning from Lance
        lance.write_dataset(table, ds.location.join(TABLE), mode="create", **options)
    except (OSError, ValueError):  # it exists: replace it
        lance.write_dataset(table, ds.location.join(TABLE), mode="overwrite", **options)
    config = dict(ds.config)
    config["tables"] = dict(config["tables"], gene_stats=TABLE)
    ds.location.write_bytes("config.json", json.dumps(config, indent=2).encode())
    ds.config = config


def load_gene_medians(ds: Dataset) -> np.ndarray | None:
    """The stored medians, or None when `cellfeed stats` has not been run on this dataset (or ran
    before the medians were of normalised counts)."""
    name = ds.config.get("tables", {}).get("gene_stats")
    if not name:
        return None
    table = lance.dataset(ds.location.join(name), storage_options=ds.location.lance_options()).to_table()
    if COLUMN not in table.column_names:
        return None
    medians = np.zeros(ds.n_genes)
    medians[table.column("gene_integer_id").to_numpy()] = table.column(COLUMN).to_numpy()
    return medians
