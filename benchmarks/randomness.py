"""How random are the batches a trainer sees? Through the real pipeline (plan → producer → items →
consumer stream with its mixing buffer), for each sampling strategy: the plate-label entropy of
each batch (mean ± sd, beside batches drawn truly at random from the same cells, and beside
scDataset's bounds for block sampling) and the index score (mean |id_i - id_j| within a batch:
0 sequential, 1 uniform random); `trainer/sampling_quality.py` defines them.

    python benchmarks/randomness.py            # 200k-cell atlas (14 plates), batch 64
    python benchmarks/randomness.py --quick    # 20k-cell atlas

Storage is ordered by plate, so sequential batches see one plate (entropy ~0 bits) and a truly
random batch of 64 sees most of 14 plates (~3.6 bits). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
STRATEGIES = {
    "sequential": Sampling("sequential", unit_cells=1024),
    "mixture": Sampling("mixture", unit_cells=256, n_scanners=8),
    "block b=64 f=64": Sampling("block", block_size=64, fetch_factor=64, batch_size=BATCH),
    "block b=16 f=256": Sampling("block", block_size=16, fetch_factor=256, batch_size=BATCH),
    "random": Sampling("random", fetch_factor=16, batch_size=BATCH),
}


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
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rpc-latency-ms", type=float, default=0.0,
                        help="every queue/map call costs this many ms (± 40%%), as a round trip to Modal (default: 0)")
    parser.add_argument("--buffer", type=int, default=4096, help="consumer mixing buffer in cells (4096)")
    args = parser.parse_args()
    n_cells = 20_000 if args.quick else 200_000
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
    print(f"\n{ds.n_cells:,} cells in {len(proportions)} plates stored in order; batch {BATCH}; consumer buffer "
          f"{args.buffer} cells")
    print(f"{'strategy':<18}{'plate bits':>11}{'sd':>7}{'- random':>9}{'index':>7}   block bounds (bits)")
    print(f"{'true random':<18}{reference:>11.3f}{np.std(true_random):>7.3f}{0.0:>+9.3f}{np.mean(true_scores):>7.3f}")
    figures = {"true_random_plate_entropy": round(reference, 4),
               "true_random_index_score": round(float(np.mean(true_scores)), 4)}
    for name, sampling in STRATEGIES.items():
        entropies, scores = batch_scores(ds, sampling, args.buffer, args.rpc_latency_ms)
        mean = float(np.mean(entropies))
        bounds = ""
        if sampling.strategy == "block":
            lower, upper = block_entropy_bounds(proportions, sampling.block_size, BATCH)
            bounds = f"   {max(0.0, lower):.3f} .. {upper:.3f} (without the consumer's mixing)"
        print(f"{name:<18}{mean:>11.3f}{np.std(entropies):>7.3f}{mean - reference:>+9.3f}{np.mean(scores):>7.3f}{bounds}")
        key = name.replace("block b=", "block_b").replace(" f=", "_f")
        figures[f"{key}_plate_entropy"] = round(mean, 4)
        figures[f"{key}_index_score"] = round(float(np.mean(scores)), 4)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
