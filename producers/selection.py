"""Which cells a campaign trains on: obs filters and id lists over a dataset, the held-out split
taken out, and per-cell labels from an obs column."""

from __future__ import annotations

import numpy as np

from coordination.errors import CellfeedError
from coordination.plan import cell_ids_within
from producers.dataset import Dataset, error_text


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
