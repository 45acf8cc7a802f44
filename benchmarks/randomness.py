"""How random are the batches a trainer sees? Through the real pipeline (plan → producer → items →
consumer stream with its mixing buffer), for each sampling strategy: the plate-label entropy of
each batch (mean ± sd, beside batches drawn truly at random from the same cells, and beside
scDataset's bounds for block sampling) and the index score (mean |id_i - id_j| within a batch:
0 sequential, 1 uniform random); `trainer/sampling_quality.py` defines them.

    python benchmarks/randomness.py            # 200k-cell atlas (14 plates), batch 64, 19 settings
    python benchmarks/randomness.py --quick    # 20k-cell atlas, 7 settings

Also each setting's producer throughput (`benchmarks/producer.py`'s loop, local disk), and a PNG
of score against throughput, a point per setting.

Storage is ordered by plate, so sequential batches see one plate (entropy ~0 bits) and a truly
random batch of 64 sees most of 14 plates (~3.6 bits). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.producer import run_config  # noqa: E402
from coordination.driver import Driver  # noqa: E402
from coordination.plan import PlanSummary, Sampling, publish_summary  # noqa: E402
from coordination.latency import remote  # noqa: E402
from coordination.queues import MemoryMap, MemoryQueue  # noqa: E402
from coordination.routing import stop_key  # noqa: E402
from producers.dataset import open_dataset  # noqa: E402
from producers.producer import Producer, ProducerConfig, label_codes  # noqa: E402
from producers.synth import SynthSpec, synthesize  # noqa: E402
from trainer.sampling_quality import block_entropy_bounds, entropy_bits, index_score  # noqa: E402
from trainer.stream import ConsumerStream  # noqa: E402

BATCH = 64


def settings(quick: bool) -> dict[str, Sampling]:
    """The sweep: sequential, random, mixture over n_scanners, block over block size x fetch factor.
    Units as large as on a Tahoe-scale atlas (min_units=1)."""
    out = {"sequential": Sampling("sequential", unit_cells=1024, min_units=1),
           "random": Sampling("random", fetch_factor=16, batch_size=BATCH, min_units=1)}
    for n in ((2, 8) if quick else (1, 2, 4, 8, 16)):
        out[f"mixture n={n}"] = Sampling("mixture", unit_cells=256, n_scanners=n, min_units=1)
    grid = ((16, 256), (64, 64), (256, 16)) if quick else \
        [(b, f) for b in (4, 16, 64, 256) for f in (16, 64, 256)]
    for b, f in grid:
        out[f"block b={b} f={f}"] = Sampling("block", block_size=b, fetch_factor=f, batch_size=BATCH, min_units=1)
    return out


def key_of(name: str) -> str:
    """JSON key of a setting: "block b=16 f=256" -> "block_b16_f256"."""
    return name.replace(" b=", "_b").replace(" f=", "_f").replace(" n=", "_n")


def batch_scores(ds, sampling: Sampling, buffer_cells: int, latency_ms: float = 0.0) -> tuple[list, list]:
    """Per full batch of the epoch: plate entropy (bits) and index score."""
    queue, store = remote(MemoryQueue(max_items=10**9, max_bytes=1 << 62), MemoryMap(), latency_ms)
    run = "randomness"
    config = ProducerConfig(dataset=ds.uri, run=run, sampling=sampling, max_genes=8, label_column="plate",
                            world_size=1, idle_timeout_s=600)
    producer = Producer(config, queue, store, dataset=ds)
    summary = PlanSummary.of(producer.plan(0), 1)
    publish_summary(store, run, summary)
    driver = Driver(queue, store, run, poll_s=0.05)
    driver.start([0])
    worker = threading.Thread(target=producer.run, daemon=True)
    worker.start()
    stream = ConsumerStream(queue, rank=0, world_size=1, run=run, batch_size=BATCH, buffer_cells=buffer_cells)
    entropies, scores = [], []
    for b in stream.epoch(0, summary.cells_per_rank):
        if b.size == BATCH:
            entropies.append(entropy_bits(b.labels.numpy()))
            scores.append(index_score(b.cell_ids.numpy(), ds.n_cells))
    stream.close()
    store.put(stop_key(run), "stop")
    worker.join(timeout=30)
    return entropies, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 20k-cell atlas and 7 settings (a minute or two)")
    parser.add_argument("--rpc-latency-ms", type=float, default=0.0,
                        help="every queue/map call costs this many ms (± 40%%), as a round trip to Modal (default: 0)")
    parser.add_argument("--buffer", type=int, default=4096, help="consumer mixing buffer in cells (4096)")
    parser.add_argument("--budget", type=int, default=None,
                        help="cells per setting for the throughput (default 40,000; 8,000 quick)")
    parser.add_argument("--png", default=str(ROOT / "benchmarks" / "randomness.png"),
                        help="where to draw score vs throughput (default benchmarks/randomness.png)")
    args = parser.parse_args()
    n_cells = 20_000 if args.quick else 200_000
    budget = args.budget or (8_000 if args.quick else 40_000)
    path = os.path.join(tempfile.gettempdir(), f"cellfeed-bench-atlas-{n_cells}")
    if not os.path.exists(os.path.join(path, "config.json")):
        synthesize(path, SynthSpec(n_cells=n_cells, seed=0), overwrite=True)
    ds = open_dataset(path)
    plates = label_codes(ds, "plate")[0]
    rng = np.random.default_rng(0)
    order = rng.permutation(ds.n_cells)
    batches = [order[i:i + BATCH] for i in range(0, ds.n_cells - BATCH + 1, BATCH)]
    true_random = [entropy_bits(plates[b]) for b in batches]
    true_scores = [index_score(b, ds.n_cells) for b in batches]
    reference = float(np.mean(true_random))
    proportions = np.bincount(plates)
    rows = {}
    for name, sampling in settings(args.quick).items():
        entropies, scores = batch_scores(ds, sampling, args.buffer, args.rpc_latency_ms)
        speed = run_config(ds, "scgpt", 1024, sampling, budget, min_units=2)["cells_per_s"]
        rows[name] = (float(np.mean(entropies)), float(np.std(entropies)), float(np.mean(scores)), speed, sampling)

    print(f"\n{ds.n_cells:,} cells in {len(proportions)} plates stored in order; batch {BATCH}; consumer buffer "
          f"{args.buffer} cells; throughput: one producer, scGPT 1024, local disk, {platform.machine()}, "
          f"{os.cpu_count()} cores")
    print(f"{'setting':<20}{'plate bits':>11}{'sd':>7}{'- random':>9}{'index':>7}{'cells/s':>9}"
          "   block bounds before mixing (bits)")
    print(f"{'true random':<20}{reference:>11.3f}{np.std(true_random):>7.3f}{0.0:>+9.3f}{np.mean(true_scores):>7.3f}")
    figures = {"true_random_plate_entropy": round(reference, 4),
               "true_random_index_score": round(float(np.mean(true_scores)), 4)}
    for name, (mean, sd, score, speed, sampling) in rows.items():
        bounds = ""
        if sampling.strategy == "block":
            lower, upper = block_entropy_bounds(proportions, sampling.block_size, BATCH)
            bounds = f"   {max(0.0, lower):.3f} .. {upper:.3f}"
        print(f"{name:<20}{mean:>11.3f}{sd:>7.3f}{mean - reference:>+9.3f}{score:>7.3f}{speed:>9,.0f}{bounds}")
        figures[f"{key_of(name)}_plate_entropy"] = round(mean, 4)
        figures[f"{key_of(name)}_index_score"] = round(score, 4)
        figures[f"{key_of(name)}_cells_per_s"] = round(speed)
    default_mixture = "mixture n=8"
    figures["mixture_index_score"] = figures[f"{key_of(default_mixture)}_index_score"]
    figures["mixture_vs_sequential_throughput"] = round(rows[default_mixture][3] / rows["sequential"][3], 3)
    figures["block_b16_f256_minus_random_bits"] = round(rows["block b=16 f=256"][0] - reference, 4)
    figures["block_b64_f64_minus_random_bits"] = round(rows["block b=64 f=64"][0] - reference, 4)
    draw(rows, reference, args.png)
    print(f"score vs throughput: {args.png}")
    print(json.dumps(figures))


def draw(rows: dict, reference: float, png: str) -> None:
    """Index score and plate-entropy gap to true random against producer throughput, a point per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, (mean, _, score, speed, sampling) in rows.items():
        color = {"sequential": "tab:red", "random": "tab:gray", "mixture": "tab:orange"}.get(sampling.strategy, "tab:blue")
        for ax, y in zip(axes, (score, mean - reference)):
            ax.scatter(speed, y, color=color)
            ax.annotate(name, (speed, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes[0].set(xlabel="producer cells/s (scGPT 1024, one process)", ylabel="index score (random = 1)",
                title="Index score vs throughput")
    axes[1].set(xlabel="producer cells/s (scGPT 1024, one process)", ylabel="plate entropy - true random (bits)",
                title="Plate entropy gap vs throughput")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
