"""h5ad → dataset conversion, in row chunks with bounded memory (AnnData backed mode).

Two passes over the matrix: the first validates values (finite, non-negative) and decides the
stored type (uint16 when every value is an integer count that fits, float32 otherwise, never
clipped); the second writes. For sparse inputs the first pass reads only the `data` array.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import scipy.sparse as sp
from tqdm import tqdm

from coordination.errors import CellfeedError
from producers.dataset import Dataset
from producers.writer import DatasetWriter

FLOAT32_EXACT_INT = 1 << 24
RESERVED_OBS = ("cell_integer_id", "cell_start_index")


@dataclass
class _Source:
    path: str
    adata: object
    matrix: object  # backed: h5py.Dataset (dense) or anndata's sparse dataset
    var: pd.DataFrame
    gene_order: np.ndarray | None = None  # maps this file's gene index -> output gene index

    @property
    def n_obs(self) -> int:
        return self.matrix.shape[0]

    def rows(self, start: int, stop: int) -> sp.csr_matrix:
        """Rows [start, stop) as canonical CSR in output gene order (sorted, no explicit zeros)."""
        block = self.matrix[start:stop]
        x = sp.csr_matrix(block) if not sp.issparse(block) else block.tocsr()
        x.eliminate_zeros()
        if self.gene_order is not None:
            x = sp.csr_matrix((x.data, self.gene_order[x.indices], x.indptr), shape=x.shape)
        x.sort_indices()
        return x

    def data_chunks(self, chunk_rows: int):
        """The stored values, chunk by chunk (only `data` for sparse matrices)."""
        group = getattr(self.matrix, "group", None)
        if group is not None and "data" in group:
            data = group["data"]
            step = 1 << 23
            for i in range(0, data.shape[0], step):
                yield data[i : i + step], i
        else:
            for start in range(0, self.n_obs, chunk_rows):
                yield np.asarray(self.matrix[start : start + chunk_rows]), start


def _open_source(path: str, layer: str) -> _Source:
    import anndata as ad

    if not os.path.exists(path):
        raise CellfeedError(f"input {path} does not exist")
    if os.path.isdir(path) or not h5py.is_hdf5(path):
        raise CellfeedError(f"input {path} is not an h5ad file (not HDF5); convert .h5ad files only")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            adata = ad.read_h5ad(path, backed="r")
    except Exception as exc:  # noqa: BLE001
        raise CellfeedError(f"cannot read {path} as AnnData ({type(exc).__name__}: {str(exc)[:200]})") from None
    layers = list(adata.layers.keys()) if adata.layers is not None else []
    available = ["X"] + (["raw.X"] if adata.raw is not None else []) + layers
    if layer == "X":
        matrix, var = adata.X, adata.var
    elif layer == "raw.X":
        if adata.raw is None:
            raise CellfeedError(f"{path} has no raw.X; available matrices: {', '.join(available)}")
        matrix, var = adata.raw.X, adata.raw.var
    elif layer in layers:
        matrix, var = adata.layers[layer], adata.var
    else:
        raise CellfeedError(f"{path} has no layer {layer!r}; available matrices: {', '.join(available)}")
    if matrix is None or len(getattr(matrix, "shape", ())) != 2:
        raise CellfeedError(f"{path}: matrix {layer} is missing or not 2-D")
    if matrix.shape[1] == 0 or len(var) != matrix.shape[1]:
        raise CellfeedError(f"{path}: matrix {layer} has no genes (var has {len(var)} rows)")
    names = var.index.astype(str)
    if names.has_duplicates:
        dup = names[names.duplicated()][0]
        raise CellfeedError(
            f"{path}: gene id {dup!r} appears more than once; make gene ids unique (anndata's var_names_make_unique)"
        )
    return _Source(path, adata, matrix, var)


def _align_genes(sources: list[_Source]) -> None:
    """All inputs must have the same genes; a different order is mapped to the first file's."""
    ref = sources[0].var.index.astype(str)
    for src in sources[1:]:
        names = src.var.index.astype(str)
        if names.equals(ref):
            continue
        missing, extra = ref.difference(names), names.difference(ref)
        if len(missing) or len(extra):
            example = list(missing[:3]) or list(extra[:3])
            raise CellfeedError(
                f"genes of {src.path} do not match {sources[0].path}: {len(missing)} missing, {len(extra)} extra "
                f"(e.g. {example}); convert them separately or subset them to the same genes"
            )
        src.gene_order = ref.get_indexer(names).astype(np.int64)


def _choose_value_type(sources: list[_Source], chunk_rows: int, allow_negative: bool, progress: bool) -> pa.DataType:
    integral, vmax = True, 0.0
    total = sum(s.n_obs for s in sources)
    # disable=None: a bar on a terminal only, quiet in logs (tqdm's own test)
    with tqdm(
        total=len(sources), desc="check values", unit="file", disable=None if progress and total >= 1 else True
    ) as bar:
        for src in sources:
            for values, where in src.data_chunks(chunk_rows):
                if values.size == 0:
                    continue
                if np.issubdtype(values.dtype, np.floating):
                    if not np.isfinite(values).all():
                        raise CellfeedError(
                            f"{src.path}: matrix holds NaN or infinite values (near entry {where}); "
                            "clean the input first"
                        )
                    if integral:
                        integral = bool(np.all(values == np.floor(values)))
                lo = values.min()
                if lo < 0 and not allow_negative:
                    raise CellfeedError(
                        f"{src.path}: matrix holds negative values (min {float(lo):.3g}), so it is not counts; "
                        "choose the counts matrix (--layer raw.X or a layer name) or pass --allow-negative to "
                        "store floats"
                    )
                vmax = max(vmax, float(values.max()))
            bar.update(1)
    if integral and vmax <= np.iinfo(np.uint16).max:
        return pa.uint16()
    if integral and vmax > FLOAT32_EXACT_INT:
        raise CellfeedError(
            f"counts up to {vmax:.0f} exceed what float32 stores exactly ({FLOAT32_EXACT_INT}); "
            "refusing to lose precision"
        )
    return pa.float32()


def _arrow_frame(df: pd.DataFrame, id_column: str, ids) -> tuple[pa.Table, dict[str, list[str]]]:
    """A pandas obs/var frame as Arrow with its id column first (categoricals as strings), plus
    the categories in order. An `id_column` already in the frame is kept (as SLAF does)."""
    if id_column not in df.columns:
        df = df.assign(**{id_column: np.asarray(ids).astype(str)})
    df = df[[id_column] + [c for c in df.columns if c != id_column]]
    columns, categories = {}, {}
    for name in df.columns:
        col = df[name]
        if isinstance(col.dtype, pd.CategoricalDtype):
            categories[str(name)] = [str(c) for c in col.cat.categories]
            columns[str(name)] = pa.array(col.astype(object).where(col.notna(), None).astype(object), type=pa.string())
        else:
            try:
                columns[str(name)] = pa.array(col.to_numpy())
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                columns[str(name)] = pa.array(col.astype(str).to_numpy(), type=pa.string())
    return pa.table(columns), categories


def _obs_frame(sources: list[_Source]) -> tuple[pa.Table, dict[str, list[str]]]:
    frames = []
    for src in sources:
        obs = src.adata.obs.drop(columns=[c for c in RESERVED_OBS if c in src.adata.obs.columns])
        frames.append(obs if "cell_id" in obs.columns else obs.assign(cell_id=src.adata.obs_names.astype(str)))
    obs = pd.concat(frames, axis=0, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
    return _arrow_frame(obs, "cell_id", obs["cell_id"])


def convert(
    inputs: list[str],
    out: str,
    *,
    layer: str = "X",
    rows_per_fragment: int = 1 << 22,
    chunk_cells: int = 8192,
    allow_negative: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    settings=None,
) -> Dataset:
    """Convert one or more h5ad files (same genes) into one dataset at `out`."""
    if not inputs:
        raise CellfeedError("give at least one .h5ad input")
    if chunk_cells < 1:
        raise CellfeedError(f"chunk size must be >= 1, got {chunk_cells}")
    sources = [_open_source(str(p), layer) for p in inputs]
    _align_genes(sources)
    value_type = _choose_value_type(sources, chunk_cells, allow_negative, progress)
    obs, obs_categories = _obs_frame(sources)
    var, var_categories = _arrow_frame(sources[0].var, "gene_id", sources[0].var.index)
    n_genes = sources[0].matrix.shape[1]
    total = sum(s.n_obs for s in sources)
    writer = DatasetWriter(
        out,
        n_genes=n_genes,
        value_type=value_type,
        rows_per_fragment=rows_per_fragment,
        overwrite=overwrite,
        settings=settings,
    )
    np_type = value_type.to_pandas_dtype()
    with (
        writer,
        tqdm(total=total, desc="convert", unit="cell", unit_scale=True, disable=None if progress else True) as bar,
    ):
        offset = 0
        for src in sources:
            for start in range(0, src.n_obs, chunk_cells):
                stop = min(start + chunk_cells, src.n_obs)
                x = src.rows(start, stop)
                writer.append(obs.slice(offset + start, stop - start), x.indptr, x.indices, x.data.astype(np_type))
                bar.update(stop - start)
            offset += src.n_obs
        meta = {
            "source": {"files": [os.path.basename(s.path) for s in sources], "layer": layer},
            "categories": {"obs": obs_categories, "var": var_categories},
        }
        return writer.commit(var, meta)
