"""h5ad inputs: opening and checking them (the planner: matrices and genes, not obs), and reading a
range of one file's rows (a conversion worker, with h5py alone: a slice reads rows, never obs)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import scipy.sparse as sp

from coordination.errors import CellfeedError

RESERVED_OBS = ("cell_integer_id", "cell_start_index")


def matrix_key(file: h5py.File, layer: str) -> str:
    """Where AnnData stores a matrix in the file: X, raw.X (`raw/X`; `raw.X` in files before
    anndata 0.7) or a layer."""
    if layer == "raw.X":
        return "raw/X" if "raw/X" in file else "raw.X"
    return "X" if layer == "X" else f"layers/{layer}"


class Matrix:
    """One input's matrix, row ranges in the output's gene order (`gene_order` maps this file's
    gene index to the output's; None: the same order)."""

    def __init__(self, path: str, layer: str, gene_order: np.ndarray | None = None):
        self.path = path
        self._file = h5py.File(path, "r")
        elem = self._file[matrix_key(self._file, layer)]
        sparse = isinstance(elem, h5py.Group)
        self.csr = sparse and _sparse_format(elem) == "csr"
        if self.csr:  # a row range is a slice of each of its arrays: h5py alone (anndata's import: ~0.3 s a worker)
            self.group, self.matrix = elem, None
            self.n_genes = int(_attr(elem, "shape", "h5sparse_shape")[1])
        else:  # CSC or dense: AnnData's backed reader, which reads only what is sliced
            import anndata as ad

            self.group, self.matrix = None, ad.io.sparse_dataset(elem) if sparse else elem
        self.gene_order = gene_order

    def close(self) -> None:
        self._file.close()

    def rows(self, start: int, stop: int) -> sp.csr_matrix:
        """Rows [start, stop) as canonical CSR in output gene order (sorted, no explicit zeros)."""
        if self.csr:
            indptr = self.group["indptr"][start : stop + 1]
            lo, hi = int(indptr[0]), int(indptr[-1])
            arrays = (self.group["data"][lo:hi], self.group["indices"][lo:hi], indptr - lo)
            x = sp.csr_matrix(arrays, shape=(stop - start, self.n_genes))
        else:
            block = self.matrix[start:stop]
            x = sp.csr_matrix(block) if not sp.issparse(block) else block.tocsr()
        if not x.data.all():  # (a read of the values: removing rewrites the values and indices, ~2% of a slice)
            x.eliminate_zeros()
        if self.gene_order is not None:
            x = sp.csr_matrix((x.data, self.gene_order[x.indices], x.indptr), shape=x.shape)
        x.sort_indices()
        return x

    def values(self, start: int, stop: int, chunk_rows: int):
        """The stored values of rows [start, stop), chunk by chunk, with the row each chunk starts
        at (CSR: only its `data`, no indices)."""
        if self.csr:
            indptr, data = self.group["indptr"], self.group["data"]
            for lo in range(start, stop, chunk_rows):
                hi = min(lo + chunk_rows, stop)
                yield data[int(indptr[lo]) : int(indptr[hi])], lo
        else:
            for lo in range(start, stop, chunk_rows):
                block = self.matrix[lo : min(lo + chunk_rows, stop)]
                yield (block.data if sp.issparse(block) else np.asarray(block).ravel()), lo


def _attr(group: h5py.Group, *names: str):
    """The first of `names` among the group's attributes, bytes decoded (older writers store bytes)."""
    value = next(group.attrs[n] for n in names if n in group.attrs)
    return value.decode() if isinstance(value, bytes) else value


def _sparse_format(group: h5py.Group) -> str:
    """The matrix's format, "csr" or "csc", as anndata reads it (`h5sparse_format` before anndata 0.7)."""
    return str(_attr(group, "h5sparse_format", "encoding-type")).replace("_matrix", "")


@dataclass
class Source:
    """An input as the planner sees it: its matrix and genes, and its obs to read when the commit
    needs them (`read_obs`: every cell's; not at planning, where 100M cells' obs would take minutes)."""

    path: str
    read_obs: Callable[[], pd.DataFrame]
    matrix: object
    var: pd.DataFrame
    gene_order: np.ndarray | None = None

    @property
    def n_obs(self) -> int:
        return self.matrix.shape[0]

    def nnz(self) -> int:
        """Stored entries (explicit zeros included): an estimate of its rows' count."""
        group = getattr(self.matrix, "group", None)
        return int(group["data"].shape[0]) if group is not None else self.n_obs * self.matrix.shape[1]


def open_source(path: str, layer: str) -> Source:
    """Open an input and check what can be checked without reading its matrix."""
    import anndata as ad

    if not os.path.exists(path):
        raise CellfeedError(f"input {path} does not exist")
    if os.path.isdir(path) or not h5py.is_hdf5(path):
        raise CellfeedError(f"input {path} is not an h5ad file (not HDF5); convert .h5ad files only")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            adata = _without_obs(path)
            if adata is None:  # a file from before anndata 0.8's encoding: its backed mode reads it, obs and all
                adata = ad.read_h5ad(path, backed="r")
                read_obs = partial(getattr, adata, "obs")
            else:
                read_obs = adata.read_obs
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
    group = getattr(matrix, "group", None)
    if group is not None:  # CSR or CSC: the last offset is the number of values stored
        stored, claimed = group["data"].shape[0], int(group["indptr"][-1])
        if stored != claimed or group["indices"].shape[0] != claimed:
            raise CellfeedError(
                f"{path}: matrix {layer} is truncated ({stored:,} values stored, {claimed:,} indexed); "
                "copy or export the file again"
            )
    names = var.index.astype(str)
    if names.has_duplicates:
        dup = names[names.duplicated()][0]
        raise CellfeedError(
            f"{path}: gene id {dup!r} appears more than once; make gene ids unique (anndata's var_names_make_unique)"
        )
    return Source(path, read_obs, matrix, var)


def _without_obs(path: str):
    """The file as AnnData's backed mode opens it (X, raw, layers, var), with obs read only when
    `read_obs()` is called; None for a file without anndata's encoding attributes (before 0.8)."""
    import anndata as ad

    file = h5py.File(path, "r")
    if file.attrs.get("encoding-type") != "anndata":
        file.close()
        return None

    def matrix(key: str):
        elem = file[key]
        return ad.io.sparse_dataset(elem) if isinstance(elem, h5py.Group) else elem

    raw = "raw" in file and "X" in file["raw"]
    return SimpleNamespace(
        X=matrix("X") if "X" in file else None,
        var=ad.io.read_elem(file["var"]),
        layers={name: matrix(f"layers/{name}") for name in file["layers"]} if "layers" in file else {},
        raw=SimpleNamespace(X=matrix("raw/X"), var=ad.io.read_elem(file["raw/var"])) if raw else None,
        read_obs=lambda: ad.io.read_elem(file["obs"]),
    )


def align_genes(sources: list[Source]) -> None:
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


def arrow_frame(df: pd.DataFrame, id_column: str, ids) -> tuple[pa.Table, dict[str, list[str]]]:
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


def obs_frame(sources: list[Source]) -> tuple[pa.Table, dict[str, list[str]]]:
    """Every input's obs, concatenated in order, as Arrow (cell_id from obs_names where absent)."""
    frames = []
    for src in sources:
        try:
            obs = src.read_obs()
        except Exception as exc:  # noqa: BLE001 - one line naming the file (the written slices are kept)
            raise CellfeedError(f"cannot read the obs of {src.path} ({type(exc).__name__}: {str(exc)[:200]})") from None
        obs = obs.drop(columns=[c for c in RESERVED_OBS if c in obs.columns])
        frames.append(obs if "cell_id" in obs.columns else obs.assign(cell_id=obs.index.astype(str)))
    obs = pd.concat(frames, axis=0, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
    return arrow_frame(obs, "cell_id", obs["cell_id"])
