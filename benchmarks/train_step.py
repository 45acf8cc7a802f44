"""Training step time, cells/s, MFU and dataloader wait for a model preset and batch size, on
the training loop itself (`trainer.train.train`), fed by a consumer stream from an in-memory
queue that a feeder thread keeps full of scGPT items (random genes, 1024 per cell).

    python benchmarks/train_step.py --quick                      # CPU: tiny preset, batch 16
    python benchmarks/train_step.py --preset scgpt --batch 240   # on an H100/H200
    python benchmarks/train_step.py --preset scgpt --batch 240 --full-length   # every cell 1,025 tokens
    python benchmarks/train_step.py --preset scgpt --batch 240 --packed --tokens-per-row 8200   # packed rows
    python benchmarks/train_step.py --preset scgpt --batch 480 --tokens-per-batch 246000   # batches by tokens
    python benchmarks/train_step.py --layout geneformer --lengths atlas --max-genes 2048 --batch 64
    python benchmarks/train_step.py --tiny                       # the test suite's: 6 steps, batch 8, 256 genes

Cells are of varied length by default (a quarter to all of max-genes + 1 tokens, as real cells vary),
so a padded batch computes padding (`padding_fraction`); `--packed` lays them in rows instead. On
CUDA, attention over padded or packed rows is flash attention's varlen kernel by default
(`--attention`; `dense`: the SDPA mask it replaced).
Ends with one JSON line: device, preset, cells_per_s, mfu, padding_fraction, graph_breaks (of the
model's forward, `torch._dynamo.explain`), dataloader_wait_ms_median, ... Exits 1
(one line on stderr) when it trained fewer steps than asked or a figure is missing (MFU on a GPU
with no bf16 peak in trainer/metrics.py: on a CPU it is n/a by design).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

gc.disable()  # imported as the rank server imports for its ranks (trainer/launch.py:serve): GC off, then frozen
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401 - (the optimizer imports it: the server had it before a rank's first step)

from benchmarks._checks import check_figures, fail  # noqa: E402
from coordination.arrays import CellRows  # noqa: E402
from coordination.latency import remote  # noqa: E402
from coordination.net import free_port  # noqa: E402
from coordination.queues import Full, MemoryMap, MemoryQueue  # noqa: E402
from coordination.routing import rank_partition, run_tag  # noqa: E402
from coordination.summary import PlanSummary, publish_summary  # noqa: E402
from coordination.wire import pack_items  # noqa: E402
from producers.synth import SynthSpec, expressed_genes  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.train import train  # noqa: E402

gc.freeze()
gc.enable()

N_GENES = 62_710
OBJECTIVE = {"scgpt": "bins", "geneformer": "genes"}  # what each layout's model predicts
MASK_RATIO = {"scgpt": 0.4, "geneformer": 0.15}  # the published models' masking


def random_items(
    n_cells: int, max_genes: int, epoch: int, seed: int, lengths: str = "full", values: bool = True
) -> list[bytes]:
    """Items of random genes, CLS first: scGPT's (`values`: a bin under every token) or Geneformer's
    layout (tokens only). `lengths`: "full", every cell max_genes + 1 tokens; "uniform", each cell's
    drawn uniformly from a quarter of that to all of it; "atlas", the synthetic atlas's expressed genes
    per cell (`producers.synth.expressed_genes`: median 1,500) up to max_genes. Real cells vary: a
    Tahoe cell's median is ~1,100 expressed genes, so at 2,048 about half of a padded batch is padding."""
    rng = np.random.default_rng(seed)
    length = max_genes + 1
    if lengths == "atlas":
        sizes = np.minimum(expressed_genes(SynthSpec(n_cells), rng, np.ones(n_cells)), max_genes) + 1
    elif lengths == "uniform":
        sizes = rng.integers(length // 4, length + 1, size=n_cells)
    else:
        sizes = np.full(n_cells, length)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    tokens = rng.integers(4, N_GENES + 4, size=int(offsets[-1])).astype(np.uint16)
    bins = rng.integers(1, 51, size=int(offsets[-1])).astype(np.uint8)
    tokens[offsets[:-1]], bins[offsets[:-1]] = 1, 0  # CLS, bin 0 under it
    cells = CellRows(np.arange(n_cells, dtype=np.int64), offsets, tokens, bins if values else None)
    return pack_items(cells, epoch=epoch, key_id=seed, run_tag=run_tag("bench"), cells_per_item=64)


def graph_breaks(preset: str, args) -> int:
    """torch.compile's graph breaks in the model's forward, on a batch of 2 cells collated as the run's
    (padded or packed), on the CPU (`torch._dynamo.explain`: the count does not depend on the device
    or the batch's size)."""
    from coordination.wire import unpack_item
    from trainer.model import CellTransformer, ModelConfig, mask_positions, predicted_positions
    from trainer.stream import collate

    item = unpack_item(random_items(4, args.max_genes, 0, 0, args.lengths, args.layout == "scgpt")[0])
    batch = collate([(item, 0), (item, 1)], args.max_genes + 1, False, tokens_per_row=args.tokens_per_row)
    # (on the CPU: the dense mask; varlen's and flex's kernels are CUDA's)
    model = CellTransformer(ModelConfig.preset(preset, N_GENES + 4, objective=OBJECTIVE[args.layout]))
    ratio = MASK_RATIO[args.layout]
    masked = mask_positions(batch.tokens, batch.attention_mask, ratio, torch.Generator(), segments=batch.segments)
    positions, _ = predicted_positions(masked, ratio, batch.segments is not None)  # (as the trainer's loss has it)
    explained = torch._dynamo.explain(model)(
        batch.tokens, batch.values, batch.attention_mask, positions, batch.padded, batch.segments
    )
    return explained.graph_break_count


def attention_kernels(first: str):
    """scaled_dot_product_attention's kernels with `first` tried first, the others after it (a mask
    rules flash out, and cuDNN's kernel does not take every shape)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if first == "auto":
        return contextlib.nullcontext()
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}.get(
        first, SDPBackend.EFFICIENT_ATTENTION
    )
    return sdpa_kernel([chosen] + [b for b in order if b != chosen] + [SDPBackend.MATH], set_priority=True)


@contextlib.contextmanager
def profiled(path: str | None):
    """torch.profiler over the run; to `path`, its table of kernels by device time, after the share of
    time the device was busy over the second half of the kernels' timeline (past compilation and
    warm-up): a GPU that waits on the host shows there."""
    if path is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield
    kernels = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if str(e.device_type).endswith("CUDA")
    )
    busy = "no device kernels"
    if kernels:
        since = (kernels[0][0] + max(end for _, end in kernels)) / 2
        union, reach = 0.0, since
        for start, end in kernels:
            start = max(start, reach)
            if end > start:
                union, reach = union + end - start, end
        window = reach - since
        share = union / max(window, 1)
        busy = f"device busy {share:.1%} of the second half of the kernels' timeline ({window / 1e6:.2f} s)"
    with open(path, "w") as f:
        f.write(busy + "\n")
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        f.write(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--tiny", action="store_true", help="6 steps of the tiny preset, batch 8, 256 genes: seconds (the test suite's)"
    )
    parser.add_argument("--preset", default=None, help="tiny (CPU default) or scgpt (GPU default), base, large")
    parser.add_argument("--batch", type=int, default=None, help="cells per step (CPU 16, GPU 240)")
    parser.add_argument(
        "--rpc-latency-ms",
        type=float,
        default=0.0,
        help="every queue/map call costs this many ms (± 40%%), as a round trip to Modal (default: 0)",
    )
    parser.add_argument("--max-genes", type=int, default=None, help="genes per cell (default 1024; 256 tiny)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument(
        "--full-length",
        action="store_true",
        help="every cell max-genes + 1 tokens (the H200 figures' items); default: cells of a quarter to all of it",
    )
    parser.add_argument("--packed", action="store_true", help="pack each batch's cells into rows (--tokens-per-row)")
    parser.add_argument(
        "--tokens-per-row", type=int, default=None, help="packed rows of N tokens (default with --packed: 2 cells)"
    )
    parser.add_argument(
        "--tokens-per-batch",
        type=int,
        default=None,
        help="a batch: the drawn cells that fit N tokens (at most --batch), packed (--tokens-per-row, implied)",
    )
    parser.add_argument(
        "--attention",
        choices=("auto", "dense", "varlen", "flex"),
        default="auto",
        help="attention over padded or packed rows (TrainConfig.packed_attention): a mask through SDPA (dense), "
        "flash attention's varlen kernel (varlen, CUDA), FlexAttention's block mask (flex: packed, CUDA); "
        "auto: varlen on CUDA, dense elsewhere",
    )
    parser.add_argument(
        "--layout",
        choices=("scgpt", "geneformer"),
        default="scgpt",
        help="scgpt: a bin under every token, the model predicts masked bins (40%%); geneformer: tokens only, "
        "it predicts masked gene ids (15%%) over the whole vocabulary",
    )
    parser.add_argument(
        "--lengths",
        choices=("uniform", "atlas"),
        default="uniform",
        help="cells' lengths when not --full-length: uniform from a quarter of max-genes + 1 to all of it, or the "
        "synthetic atlas's (median 1,500 expressed genes, up to max-genes)",
    )
    parser.add_argument(
        "--sdpa",
        choices=("auto", "cudnn", "flash", "efficient"),
        default="auto",
        help="the attention kernel scaled_dot_product_attention tries first (falling back where it cannot run)",
    )
    parser.add_argument("--profile", metavar="FILE", help="write torch.profiler's table of the run's kernels to FILE")
    args = parser.parse_args()
    args.lengths = "full" if args.full_length else args.lengths
    args.ragged = args.lengths != "full"
    cuda = torch.cuda.is_available()
    preset = args.preset or ("tiny" if args.tiny or not cuda else "scgpt")
    batch = args.batch or (8 if args.tiny else 240 if cuda else 16)
    steps = args.steps or (6 if args.tiny else 12 if args.quick else 40)
    args.max_genes = args.max_genes or (256 if args.tiny else 1024)
    if args.attention in ("flex", "varlen") and not cuda:
        parser.error(f"--attention {args.attention} trains on CUDA only (no backward, or no kernel, on CPU)")
    from trainer.model import attention_on

    attention = attention_on(args.attention, torch.device("cuda", 0) if cuda else torch.device("cpu"))
    args.packed = args.packed or args.attention == "flex" or args.tokens_per_batch is not None
    if args.packed or args.tokens_per_row:
        args.tokens_per_row = args.tokens_per_row or 2 * (args.max_genes + 1)
    if args.tokens_per_row is not None and args.tokens_per_row < args.max_genes + 1:
        parser.error(f"--tokens-per-row {args.tokens_per_row} must hold a whole cell: at least {args.max_genes + 1}")
    if args.tokens_per_batch is not None and args.tokens_per_batch < args.max_genes + 1:
        parser.error(f"--tokens-per-batch {args.tokens_per_batch}: a batch must hold a cell, {args.max_genes + 1}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))  # (a fixed port collides with another run's)
    queue, store = remote(MemoryQueue(), MemoryMap(), args.rpc_latency_ms)
    n_cells = steps * batch
    publish_summary(store, "bench", PlanSummary(0, "bench", 1, n_cells, 1, [n_cells]))
    stop = threading.Event()

    def feed():  # keeps the partition topped up, like a producer fleet that keeps up
        seed = 0
        while not stop.is_set() and seed * 64 < n_cells:
            for item in random_items(min(256, n_cells - seed * 64), args.max_genes, 0, seed, *layout):
                while not stop.is_set():
                    try:
                        queue.put_many([item], timeout=0.5, partition=rank_partition(0))
                        break
                    except Full:
                        continue
                seed += 1

    layout = (args.lengths, args.layout == "scgpt")
    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    cfg = TrainConfig(
        run="bench",
        backend={"kind": "memory"},
        vocab_size=N_GENES + 4,
        preset=preset,
        objective=OBJECTIVE[args.layout],
        mask_ratio=MASK_RATIO[args.layout],
        batch_size=batch,
        warmup_steps=3,
        max_steps=steps,
        run_driver=False,
        compile=args.compile,
        pad_to=args.max_genes + 1,
        tokens_per_row=args.tokens_per_row,
        tokens_per_batch=args.tokens_per_batch,
        packed_attention=attention,
        buffer_cells=4 * batch,
        progress_bar=not (args.quick or args.tiny),
    )
    with attention_kernels(args.sdpa), profiled(args.profile):
        summary = train(cfg, queue=queue, store=store)
    stop.set()
    if summary["steps"] < steps:
        fail(f"trained {summary['steps']} of {steps} steps")
    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({os.cpu_count()} cores)"
    mfu = summary.get("median_mfu")
    figures = {
        "device": device,
        "preset": preset,
        "params_m": round(summary["params"] / 1e6, 1),
        "batch": batch,
        "max_genes": args.max_genes,
        "steps": summary["steps"],
        "median_step_ms": round(summary["median_step_s"] * 1e3, 2),
        "cells_per_s": round(summary["cells_per_s"], 1),
        "tokens_per_s": round(summary["tokens_per_s"]),
        "padding_fraction": round(summary["padding"], 4),  # of the positions computed (0: every cell full length)
        "layout": args.layout,
        "lengths": args.lengths,
        "ragged": args.ragged,
        "tokens_per_row": args.tokens_per_row or 0,  # 0: a row per cell
        "tokens_per_batch": args.tokens_per_batch or 0,  # 0: --batch cells a batch
        "packed_attention": attention,
        "graph_breaks": graph_breaks(preset, args),
        "mfu": None if mfu is None else round(mfu, 4),
        "dataloader_wait_ms_median": summary["median_wait_ms"],
        "peak_mem_mb": summary["peak_mem_mb"],
        "compile": args.compile,
        "sdpa": args.sdpa,
    }
    print(f"\n{device}: {preset} ({figures['params_m']}M params), batch {batch} x {args.max_genes + 1} tokens")
    print(
        f"median step {figures['median_step_ms']} ms, {figures['cells_per_s']:,} cells/s, "
        f"MFU {'n/a (no bf16 peak for this device)' if mfu is None else f'{mfu:.1%}'}, "
        f"dataloader wait median {figures['dataloader_wait_ms_median']} ms"
    )
    print(json.dumps(figures))
    check_figures(figures, allow_none=() if cuda else ("mfu",))  # no bf16 peak for a CPU: MFU is n/a


if __name__ == "__main__":
    main()
