"""The `cellfeed` command line. User errors print one line and exit 2; bugs keep their traceback."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from coordination.errors import CellfeedError

ROWS_PER_FRAGMENT = 1 << 22


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def cmd_synth(args) -> int:
    from producers.synth import SynthSpec, synthesize

    spec = SynthSpec(n_cells=args.cells, n_genes=args.genes, n_plates=args.plates, seed=args.seed)
    ds = synthesize(args.out, spec, rows_per_fragment=args.rows_per_fragment, overwrite=args.overwrite,
                    progress=not args.quiet)
    print(f"wrote {ds.uri}: {ds.n_cells:,} cells x {ds.n_genes:,} genes, {ds.n_rows:,} non-zeros, "
          f"{len(ds.fragments)} fragments")
    return 0


def cmd_convert(args) -> int:
    from producers.convert import convert

    *inputs, out = args.paths
    if not inputs:
        raise CellfeedError("usage: cellfeed convert IN.h5ad [IN2.h5ad ...] OUT")
    ds = convert(inputs, out, layer=args.layer, rows_per_fragment=args.rows_per_fragment,
                 chunk_cells=args.chunk_cells, allow_negative=args.allow_negative, overwrite=args.overwrite,
                 progress=not args.quiet)
    print(f"wrote {ds.uri}: {ds.n_cells:,} cells x {ds.n_genes:,} genes, {ds.n_rows:,} non-zeros "
          f"({ds.value_type}), {len(ds.fragments)} fragments")
    return 0


def cmd_inspect(args) -> int:
    from producers.dataset import open_dataset

    ds = open_dataset(args.dataset)
    print(describe(ds, n_values=args.values))
    return 0


def cmd_stats(args) -> int:
    from producers.dataset import open_dataset
    from producers.gene_stats import compute_nonzero_medians, store_gene_stats

    ds = open_dataset(args.dataset)
    medians = compute_nonzero_medians(ds, progress=not args.quiet)
    store_gene_stats(ds, medians)
    expressed = medians > 0
    print(f"stored non-zero medians of {int(expressed.sum()):,} expressed genes (of {ds.n_genes:,}) in "
          f"{ds.uri}/gene_stats.lance; median of medians {float(np.median(medians[expressed])) if expressed.any() else 0:.2f}")
    return 0


def cmd_local(args) -> int:
    from pathlib import Path

    from app.config import CampaignConfig
    from app.local import default_dataset, print_summary, run_local

    workdir = Path(args.workdir)
    dataset = args.dataset or default_dataset(workdir, args.cells, args.seed)
    fields = {k: v for k, v in vars(args).items() if k in CampaignConfig.__dataclass_fields__ and v is not None}
    cfg = CampaignConfig(**{**fields, "dataset": dataset})
    summary = run_local(cfg, workdir, quiet=args.quiet)
    print_summary(summary, workdir / cfg.run)
    return 0


def describe(ds, n_values: int = 3) -> str:
    """A human-readable summary of a dataset."""
    straddling = ds.straddling_cells()
    sizes = [f.row_end - f.row_start for f in ds.fragments]
    lines = [
        f"dataset     {ds.uri}",
        f"format      SLAF {ds.config.get('format_version', '?')}",
        f"cells       {ds.n_cells:,}",
        f"genes       {ds.n_genes:,}",
        f"non-zeros   {ds.n_rows:,} ({ds.n_rows / max(1, ds.n_cells):,.0f} per cell, values {ds.value_type})",
        f"fragments   {len(sizes)} (rows per fragment: min {min(sizes, default=0):,}, max {max(sizes, default=0):,})",
        f"straddling  {len(straddling):,} cells cut by a fragment boundary",
        "obs columns:",
    ]
    head = ds.cells.head(max(n_values, 1)).to_pydict()
    for name in ds.obs_columns:
        field = ds.cells.schema.field(name)
        shown = ", ".join(repr(v) for v in head[name][:n_values])
        lines.append(f"  {name:<20} {str(field.type):<10} {shown}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cellfeed",
        description="Feed single-cell data (SLAF-layout Lance datasets, local or S3) to GPU training.",
        epilog="S3 addresses (s3://bucket/prefix) use AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY and AWS_REGION from the environment.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("synth", help="write a synthetic Tahoe-like atlas (plates stored in order)")
    p.add_argument("out", help="output dataset: a local path or s3://bucket/prefix")
    p.add_argument("--cells", type=_positive_int, required=True, help="number of cells")
    p.add_argument("--genes", type=_positive_int, default=62_710, help="number of genes (default: 62710, as Tahoe)")
    p.add_argument("--plates", type=_positive_int, default=14, help="number of plates (default: 14)")
    p.add_argument("--seed", type=int, default=0, help="random seed; same seed, same dataset (default: 0)")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("convert", help="convert h5ad file(s) with the same genes into one dataset")
    p.add_argument("paths", nargs="+", metavar="PATH", help="IN.h5ad [IN2.h5ad ...] OUT")
    p.add_argument("--layer", default="X", help="matrix to store: X (default), raw.X, or a layer name")
    p.add_argument("--chunk-cells", type=_positive_int, default=8192, help="cells read per chunk (default: 8192)")
    p.add_argument("--allow-negative", action="store_true",
                   help="store a matrix with negative values (e.g. scaled data) as float32 instead of refusing")
    p.set_defaults(func=cmd_convert)

    for p in (sub.choices["synth"], sub.choices["convert"]):
        p.add_argument("--rows-per-fragment", type=_positive_int, default=ROWS_PER_FRAGMENT,
                       help=f"expression rows per Lance fragment (default: {ROWS_PER_FRAGMENT:,}); "
                       "cells straddle fragment boundaries as in compacted datasets")
        p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at the output")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser("stats", help="compute and store per-gene non-zero medians (the geneformer tokenizer needs them)")
    p.add_argument("dataset", help="a local path or s3://bucket/prefix")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("local", help="run a whole pretraining campaign on this machine (processes, DDP on CPU)",
                       description="Producers as processes, the local queue server, DDP over gloo on CPU. "
                       "With no --dataset, a small synthetic atlas is written first.")
    p.add_argument("--dataset", help="a dataset (local path or s3://); default: synthesize --cells cells")
    p.add_argument("--cells", type=_positive_int, default=4000, help="cells to synthesize without --dataset (4000)")
    p.add_argument("--producers", type=_positive_int, default=2, help="producer processes (2)")
    p.add_argument("--gpus", type=_positive_int, default=2, help="trainer ranks; CPU processes here (2)")
    p.add_argument("--steps", type=_positive_int, help="optimizer steps (default: the epochs through)")
    p.add_argument("--epochs", type=_positive_int, default=1, help="epochs (1)")
    p.add_argument("--batch-size", type=_positive_int, default=32, help="cells per rank per step (32)")
    p.add_argument("--max-genes", type=_positive_int, default=256, help="genes per cell (256)")
    p.add_argument("--preset", default="tiny", help="model preset: tiny (default), scgpt, base, large")
    p.add_argument("--tokenizer", default="scgpt", help="scgpt (default) or geneformer")
    p.add_argument("--strategy", default="block", help="sequential, mixture, block (default) or random")
    p.add_argument("--subset-filter", help="training split as an obs filter, e.g. \"plate != 'plate14'\"")
    p.add_argument("--eval-filter", help="held-out split to evaluate on, e.g. \"plate = 'plate14'\"")
    p.add_argument("--eval-every", type=_positive_int, default=20, help="evaluate every N steps (20)")
    p.add_argument("--checkpoint-every", type=_positive_int, default=50, help="checkpoint every N steps (50)")
    p.add_argument("--run", help="run name (default: a timestamp); --resume continues it")
    p.add_argument("--resume", action="store_true", help="continue the run from its latest checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="runs", help="where runs, logs and checkpoints go (runs/)")
    p.add_argument("--quiet", action="store_true", help="no live status line")
    p.set_defaults(func=cmd_local, lr=3e-3, warmup_steps=10)

    p = sub.add_parser("inspect", help="summarise a dataset: shape, fragments, straddling cells, obs columns")
    p.add_argument("dataset", help="a local path or s3://bucket/prefix")
    p.add_argument("--values", type=int, default=3, help="example values per obs column (default: 3)")
    p.set_defaults(func=cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CellfeedError as exc:
        print(f"cellfeed: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cellfeed: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
