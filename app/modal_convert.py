"""Conversion on Modal, one container per slice (`app/modal_app.py`'s `convert` and `convert_slice`):

    modal volume put cellfeed-inputs plate1.h5ad plate2.h5ad              # the inputs, once
    modal run app/modal_app.py::convert --inputs plate1.h5ad,plate2.h5ad --out s3://bucket/atlas

The call `convert` is the coordinator: it plans the conversion over the inputs on the
`cellfeed-inputs` Volume (refusing a bad input before any slice starts), runs every slice's scan,
then every slice's write, each as a call of `convert_slice` (all at once: Modal scales the
containers; a failed slice is retried by Modal, `SLICE_RETRIES` times), and commits once to the output
on object storage (credentials from the app's S3 Secret). Nothing is readable at the output before
the commit, and the same command again reuses every slice already written (`producers/convert.py`).
"""

from __future__ import annotations

import os

INPUTS = "/inputs"  # where both functions mount the inputs Volume
INPUTS_VOLUME = "cellfeed-inputs"
SLICE_RETRIES = 3  # Modal's retries of a slice's call (`convert_slice`)


def inputs_mount() -> str:
    """The inputs Volume's folder in this container: INPUTS on Modal; a Modal emulator's container is
    told the host folder standing for it ($CELLFEED_INPUTS_MOUNT), read at call time."""
    return os.environ.get("CELLFEED_INPUTS_MOUNT", INPUTS)


def convert_body(
    inputs: str, out: str, layer: str, overwrite: bool, worker, slice_cells=None, block_cells=None
) -> dict:
    """(the coordinator's container) Convert the Volume's `inputs` (comma-separated names) into `out`,
    each slice a call of `worker`; slices of `slice_cells` (default: ~128 MB of output), a whole
    number of content-hash blocks of `block_cells` (producers/writer.py)."""
    from producers.convert import convert

    root = inputs_mount()
    names = [n.strip() for n in inputs.split(",") if n.strip()]
    paths = [os.path.join(root, n[len(INPUTS) + 1 :] if n.startswith(INPUTS + "/") else n) for n in names]
    sizes = {"slice_cells": slice_cells} | ({"block_cells": block_cells} if block_cells else {})
    run = modal_runner(worker, root)
    ds = convert(paths, out, layer=layer, overwrite=overwrite, progress="lines", runner=run, **sizes)
    print(f"wrote {ds.uri}: {ds.n_cells:,} cells x {ds.n_genes:,} genes, {ds.n_rows:,} non-zeros", flush=True)
    return {"uri": ds.uri, "cells": ds.n_cells, "rows": ds.n_rows, "content": ds.config["metadata"]["content_sha256"]}


def modal_runner(worker, root: str):
    """`producers.slices.run_slices`' contract, on Modal: one call of `worker` per slice, all spawned
    at once, their results gathered in order (each call waited for with Modal's transient errors
    retried: app/modal_calls.py)."""
    from app.modal_calls import result, spawn
    from producers.storage import S3Settings

    def run(task, plan, indexes, args, workers, on_done):
        plan_json = plan.to_json()
        args = [a for a in args if not isinstance(a, S3Settings)]  # a container's credentials: the app's Secret
        calls = {i: spawn(worker, task.__name__, plan_json, i, list(args), root) for i in indexes}
        results = {}
        for i, call in calls.items():
            results[i] = result(call)
            on_done(i, results[i])
        return results

    return run


def slice_body(task: str, plan_json: str, index: int, args: list, root: str):
    """(a slice's container) `task` (scan_slice or write_slice) of slice `index`: the plan's inputs,
    named under the coordinator's mount `root`, read from this container's."""
    from producers import slices

    here = inputs_mount()
    if here != root:  # (on Modal both are INPUTS; an emulator gives each container a folder of its own)
        plan = slices.ConvertPlan.from_json(plan_json)
        plan.inputs = [here + p[len(root) :] if p.startswith(root + "/") else p for p in plan.inputs]
        plan_json = plan.to_json()
    return {"scan_slice": slices.scan_slice, "write_slice": slices.write_slice}[task](plan_json, index, *args)
