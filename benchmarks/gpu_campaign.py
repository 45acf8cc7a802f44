"""A whole campaign on this machine's accelerator against the training step alone, in one run: is
the GPU ever left waiting for data?

1. `cellfeed local` on a synthetic atlas: real producer processes read, tokenize and pack it, the
   local queue server carries the items, and one trainer rank trains on CUDA when there is one
   (`trainer/train.py:init_distributed`); its step log gives cells/s, the data wait of each step,
   MFU and the padding computed.
2. `benchmarks/train_step.py` with the same preset, batch and cell length: the same training loop
   fed from an in-memory queue that is always full, the ceiling for (1).

    python benchmarks/gpu_campaign.py                # a GPU: scgpt, batch 240, 200k cells, 8 producers
    python benchmarks/gpu_campaign.py --compile      # the same with torch.compile in both
    python benchmarks/gpu_campaign.py --tokens-per-row 8200 --tokens-per-batch 246000   # packed, by tokens
    python benchmarks/gpu_campaign.py --tiny         # CPU: tiny preset, 3k cells, 12 steps (the tests')

Ends with one JSON line: the device, the campaign's cells/s, median step (ms), data wait per step
(median and max, ms), MFU and padding fraction, the same of the step alone (`step_alone_*`), and
`campaign_vs_step` (the campaign's cells/s over the step's alone). The data wait answers whether the
GPU waited; the step benchmark draws its cells' lengths as the atlas does (`--lengths atlas`), so
the ratio holds what else differs: the producers sharing the trainer's cores on a small machine, and
the real genes' tokens against random ones. Exits 1 (one line on stderr) when a run trained
fewer steps than asked or a figure is missing. MFU is n/a on a CPU (no bf16 peak: `trainer/metrics.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._checks import check_figures, fail  # noqa: E402

WARMUP_STEPS = 3  # the first steps (allocation, compilation, producers filling the queue) are not counted


def campaign_command(args, atlas: str, workdir: Path) -> list[str]:
    """The `cellfeed local` command line of the campaign (tests/test_benchmarks.py parses it with
    `cellfeed`'s own parser: `--compile` was once passed to a command that did not take it)."""
    command = [sys.executable, "-m", "app.cli", "local", "--dataset", atlas, "--workdir", str(workdir),
               "--run", "gpu", "--preset", args.preset, "--batch-size", str(args.batch),
               "--max-genes", str(args.max_genes), "--producers", str(args.producers), "--gpus", "1",
               "--steps", str(args.steps), "--warmup-steps", "2", "--checkpoint-every", str(10 * args.steps),
               "--quiet"]  # fmt: skip
    command += ["--compile"] if args.compile else []
    return command + packing(args)


def campaign(args, atlas: str, workdir: Path) -> dict:
    """`cellfeed local` on `atlas`: its step rows' medians past the warm-up."""
    command = campaign_command(args, atlas, workdir)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode != 0:
        fail(f"the campaign exited {done.returncode}: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in (workdir / "gpu" / "steps.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    if len(rows) < args.steps:
        fail(f"the campaign trained {len(rows)} of {args.steps} steps")
    counted = rows[WARMUP_STEPS:]
    mfu = [r["mfu"] for r in counted if r["mfu"] is not None]
    return {
        "cells_per_s": round(sum(r["cells"] for r in counted) / sum(r["step_s"] for r in counted), 1),
        "data_wait_median_ms": statistics.median(r["wait_ms"] for r in counted),
        "data_wait_max_ms": max(r["wait_ms"] for r in counted),
        "step_median_ms": round(statistics.median(r["step_s"] for r in counted) * 1000, 2),
        "mfu": statistics.median(mfu) if mfu else None,
        "padding_fraction": statistics.median(r["padding"] for r in counted),
    }


def packing(args) -> list[str]:
    """The same packing flags for both runs: rows of --tokens-per-row, batches of --tokens-per-batch."""
    flags = ["--tokens-per-row", str(args.tokens_per_row)] if args.tokens_per_row else []
    return flags + (["--tokens-per-batch", str(args.tokens_per_batch)] if args.tokens_per_batch else [])


def step_alone(args) -> dict:
    """`benchmarks/train_step.py` with the campaign's preset, batch and length, its cells as long as
    the atlas's (`--lengths atlas`: its plates' depth factors aside), so the two compute nearly the same
    work per cell (padding 2.6% against the campaign's 2.9% on an H200)."""
    command = [sys.executable, "benchmarks/train_step.py", "--quick", "--preset", args.preset, "--lengths", "atlas",
               "--batch", str(args.batch), "--max-genes", str(args.max_genes), "--steps", str(args.steps)]  # fmt: skip
    command += ["--compile"] if args.compile else []
    command += packing(args)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        fail(f"train_step.py exited {done.returncode}: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU: tiny preset, 3k cells, 12 steps (the test suite's)")
    parser.add_argument("--cells", type=int, default=None, help="atlas cells (default 200,000; 3,000 tiny)")
    parser.add_argument("--preset", default=None, help="model preset (default scgpt; tiny with --tiny)")
    parser.add_argument("--batch", type=int, default=None, help="cells per step (default 240; 16 tiny)")
    parser.add_argument("--max-genes", type=int, default=None, help="genes per cell (default 1024; 64 tiny)")
    parser.add_argument("--producers", type=int, default=None, help="producer processes (default 8; 1 tiny)")
    parser.add_argument("--steps", type=int, default=None, help="steps of each run (default 60; 12 tiny)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model in both runs")
    parser.add_argument("--tokens-per-row", type=int, default=None, help="both runs' batches packed in rows of N")
    parser.add_argument(
        "--tokens-per-batch", type=int, default=None, help="both runs' batches: the cells that fit N tokens (packed)"
    )
    parser.add_argument("--workdir", default=None, help="where the campaign writes (default: a temp dir)")
    args = parser.parse_args()
    args.cells = args.cells or (3_000 if args.tiny else 200_000)
    args.preset = args.preset or ("tiny" if args.tiny else "scgpt")
    args.batch = args.batch or (16 if args.tiny else 240)
    args.max_genes = args.max_genes or (64 if args.tiny else 1024)
    args.producers = args.producers or (1 if args.tiny else 8)
    args.steps = args.steps or (12 if args.tiny else 60)
    args.timeout_s = 600 if args.tiny else 3600
    if args.tokens_per_batch and not args.tokens_per_row:  # (a budget needs packed rows: two whole cells each)
        args.tokens_per_row = 2 * (args.max_genes + 1)
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than the {WARMUP_STEPS} warm-up steps, which are not counted")

    from producers.synth import cached_atlas

    atlas = cached_atlas(args.cells)
    with tempfile.TemporaryDirectory(prefix="cellfeed-gpu-campaign-") as tmp:
        ran = campaign(args, atlas, Path(args.workdir or tmp))
    alone = step_alone(args)
    figures = {  # the campaign's figures, then the step alone's (step_alone_*)
        "device": alone["device"],
        "preset": args.preset,
        "batch": args.batch,
        "max_genes": args.max_genes,
        "producers": args.producers,
        "steps": args.steps,
        "compile": args.compile,
        "tokens_per_row": args.tokens_per_row or 0,  # 0: a row per cell
        "tokens_per_batch": args.tokens_per_batch or 0,  # 0: --batch cells a batch
        **ran,
        "step_alone_cells_per_s": alone["cells_per_s"],
        "step_alone_median_ms": alone["median_step_ms"],
        "step_alone_mfu": alone["mfu"],
        "step_alone_padding_fraction": alone["padding_fraction"],
        "campaign_vs_step": round(ran["cells_per_s"] / alone["cells_per_s"], 3),
    }
    print(
        f"{figures['device']}: campaign {ran['cells_per_s']:,.0f} cells/s, step {ran['step_median_ms']} ms (data wait "
        f"median {ran['data_wait_median_ms']} ms, max {ran['data_wait_max_ms']} ms); the step alone "
        f"{alone['cells_per_s']:,.0f} cells/s, {alone['median_step_ms']} ms: {figures['campaign_vs_step']:.2f}x"
    )
    print(json.dumps(figures), flush=True)
    on_cpu = alone["mfu"] is None  # (no bf16 peak for a CPU: MFU is n/a by design)
    check_figures(figures, allow_none=("mfu", "step_alone_mfu") if on_cpu else ())


if __name__ == "__main__":
    main()
