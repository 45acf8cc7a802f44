"""Which cells a campaign trains on: obs filters and id lists over a dataset, the held-out split
taken out, and per-cell labels from an obs column."""

from __future__ import annotations

import numpy as np

from coordination.errors import CellfeedError
from coordination.plan import cell_ids_within
from producers.dataset import Dataset
from producers.storage import error_text


def select_cells(
    ds: Dataset,
    subset_filter: str | None = None,
    subset_ids=None,
    exclude_filter: str | None = None,
    *,
    option: str = "--subset-filter",
) -> np.ndarray | None:
    """The selected cell ids (None = all cells): an obs filter and/or an id list, less the cells
    that `exclude_filter` matches (a held-out split is never trained on). `option` names the
    filter in errors."""
    if subset_filter is None and subset_ids is None and exclude_filter is None:
        return None
    selected = np.arange(ds.n_cells, dtype=np.int64)
    if subset_filter is not None:
        selected = filter_cells(ds, subset_filter, option)
    if subset_ids is not None:
        selected = np.intersect1d(selected, cell_ids_within(subset_ids, ds.n_cells))
    if exclude_filter is not None:
        selected = np.setdiff1d(selected, filter_cells(ds, exclude_filter, "--eval-filter"), assume_unique=True)
    if len(selected) == 0:
        what = f"{option} {subset_filter!r}" if subset_filter is not None else "the cell subset"
        extra = f" once the --eval-filter {exclude_filter!r} cells are held out" if exclude_filter is not None else ""
        raise CellfeedError(
            f"{what} selects no cells{extra}; check the filter (`cellfeed inspect DATASET` lists "
            "the obs columns and their values)"
        )
    return selected


def filter_cells(ds: Dataset, expression: str, option: str) -> np.ndarray:
    """Sorted ids of the cells whose obs match a Lance SQL filter; `option` names it in errors."""
    try:
        table = ds.cells.to_table(columns=["cell_integer_id"], filter=expression)
    except Exception as exc:  # noqa: BLE001 - Lance reports filter syntax/column errors
        text = error_text(exc)
        hint = "" if "Valid fields" in text else f" (obs columns: {', '.join(ds.obs_columns)})"
        raise CellfeedError(f"bad {option} {expression!r}: {text}{hint}") from None
    return np.sort(table.column(0).to_numpy().astype(np.int64))


def label_codes(ds: Dataset, column: str) -> tuple[np.ndarray, list[str]]:
    """Per-cell int32 codes of an obs column, and the label names they index."""
    import pyarrow.compute as pc

    encoded = pc.dictionary_encode(ds.obs([column]).column(0)).combine_chunks()
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int32), encoded.dictionary.to_pylist()


def class_codes(ds: Dataset, column: str, selection: np.ndarray | None, source: str) -> tuple[np.ndarray, list[str]]:
    """Balanced sampling's classes in one source: per selected cell (`selection`, None: all) an int
    code, and the class names the codes index (the column's values among those cells, as text).
    Refused in one line, before any producer starts: a column the dataset lacks, selected cells
    with no value, and a class the column declares (an h5ad categorical's categories) that no
    cell of the dataset carries: its quota could never be filled."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if column not in ds.obs_columns:
        raise CellfeedError(
            f"--balance-by {column!r}: source {source!r} ({ds.uri}) has no obs column {column!r}; its obs "
            f"columns: {', '.join(ds.obs_columns)}"
        )
    values = ds.obs([column]).column(0)
    declared = ((ds.config.get("metadata") or {}).get("categories") or {}).get("obs", {}).get(column)
    if declared:
        empty = sorted(set(map(str, declared)) - set(map(str, pc.unique(values).to_pylist())))
        if empty:
            shown = ", ".join(repr(c) for c in empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
            raise CellfeedError(
                f"--balance-by {column!r}: class {shown} of source {source!r} has no cells (the column declares "
                f"{len(declared)} classes, {len(empty)} of which no cell carries), so no epoch could fill its "
                "quota: drop the unused categories before converting (pandas: "
                f"adata.obs[{column!r}] = adata.obs[{column!r}].cat.remove_unused_categories())"
            )
    if selection is not None:
        values = values.take(selection)
    if values.null_count:
        raise CellfeedError(
            f"--balance-by {column!r}: {values.null_count:,} training cells of source {source!r} have no "
            f'{column}: leave them out with --subset-filter "{column} IS NOT NULL" (in a corpus: the '
            "source's subset_filter), or fill them in"
        )
    if not pa.types.is_string(values.type):
        values = values.cast(pa.string())  # numbers, booleans, categoricals: classes by their text
    encoded = pc.dictionary_encode(values).combine_chunks()
    return encoded.indices.to_numpy(zero_copy_only=False), [str(v) for v in encoded.dictionary.to_pylist()]
