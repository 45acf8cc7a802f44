"""Per-gene statistics stored with a dataset: the non-zero median each gene reaches (what
Geneformer's rank value encoding divides by), computed once in one streaming pass.

Counts are histogrammed per gene (values up to HIST_MAX exactly, larger ones in an overflow
bin); the rare gene whose median falls in the overflow bin gets an exact second pass.
Results go to `gene_stats.lance` beside the other tables, listed in config.json.
"""

from __future__ import annotations

import json

import lance
import numpy as np
import pyarrow as pa
from tqdm import tqdm

from coordination.errors import CellfeedError
from producers.dataset import LANCE_FILE_VERSION, Dataset

HIST_MAX = 255
TABLE = "gene_stats.lance"


def _median_from_hist(hist: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Median per gene from value histograms (NumPy's: the mean of the two middle values)."""
    cum = np.cumsum(hist, axis=1)
    lower_rank = (counts - 1) // 2  # 0-based ranks of the two middle values
    upper_rank = counts // 2
    lower = (cum <= lower_rank[:, None]).sum(axis=1)
    upper = (cum <= upper_rank[:, None]).sum(axis=1)
    overflow = (upper >= HIST_MAX + 1) | (lower >= HIST_MAX + 1)
    return (lower + upper) / 2.0, overflow


def compute_nonzero_medians(ds: Dataset, batch_rows: int = 1 << 22, progress: bool = True) -> np.ndarray:
    if not ds.is_counts:
        raise CellfeedError("gene medians are for integer counts; this dataset stores float values")
    g = ds.n_genes
    hist = np.zeros(g * (HIST_MAX + 2), dtype=np.int64)
    with tqdm(total=ds.n_rows, desc="gene stats", unit="row", unit_scale=True, disable=not progress) as bar:
        for batch in ds.expression.to_batches(columns=["gene_integer_id", "value"], batch_size=batch_rows):
            genes = batch.column(0).to_numpy().astype(np.int64)
            values = np.minimum(batch.column(1).to_numpy(), HIST_MAX + 1).astype(np.int64)
            hist += np.bincount(genes * (HIST_MAX + 2) + values, minlength=len(hist))
            bar.update(batch.num_rows)
    hist = hist.reshape(g, HIST_MAX + 2)
    counts = hist.sum(axis=1)
    medians, overflow = _median_from_hist(hist, counts)
    overflow &= counts > 0
    if overflow.any():  # exact pass for the few genes whose median is above HIST_MAX
        wanted = np.flatnonzero(overflow)
        collected = {int(x): [] for x in wanted}
        for batch in ds.expression.to_batches(columns=["gene_integer_id", "value"], batch_size=batch_rows):
            genes = batch.column(0).to_numpy()
            values = batch.column(1).to_numpy()
            hit = np.isin(genes, wanted)
            for gene, value in zip(genes[hit].tolist(), values[hit].tolist()):
                collected[gene].append(value)
        for gene, values in collected.items():
            medians[gene] = float(np.median(values))
    medians[counts == 0] = 0.0
    return medians


def store_gene_stats(ds: Dataset, medians: np.ndarray) -> None:
    table = pa.table({"gene_integer_id": pa.array(np.arange(ds.n_genes), type=pa.int32()),
                      "nonzero_median": pa.array(medians, type=pa.float64())})
    lance.write_dataset(table, ds.location.join(TABLE), mode="overwrite",
                        storage_options=ds.location.lance_options(), data_storage_version=LANCE_FILE_VERSION)
    config = dict(ds.config)
    config["tables"] = dict(config["tables"], gene_stats=TABLE)
    ds.location.write_bytes("config.json", json.dumps(config, indent=2).encode())
    ds.config = config


def load_gene_medians(ds: Dataset) -> np.ndarray | None:
    """The stored medians, or None when `cellfeed stats` has not been run on this dataset."""
    name = ds.config.get("tables", {}).get("gene_stats")
    if not name:
        return None
    table = lance.dataset(ds.location.join(name), storage_options=ds.location.lance_options()).to_table()
    medians = np.zeros(ds.n_genes)
    medians[table.column("gene_integer_id").to_numpy()] = table.column("nonzero_median").to_numpy()
    return medians
