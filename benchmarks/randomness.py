"""How random are the batches a trainer sees? Plate-label entropy of each batch, through the real
pipeline (plan → producer → items → consumer stream with its mixing buffer), for each sampling
strategy, against batches drawn truly at random from the same cells.

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
from trainer.stream import ConsumerStream  # noqa: E402

BATCH = 64
STRATEGIES = {
    "sequential": Sampling("sequential", unit_cells=1024),
    "mixture": Sampling("mixture", unit_cells=256, n_scanners=8),
    "block b=64 f=64": Sampling("block", block_size=64, fetch_factor=64, batch_size=BATCH),
    "block b=16 f=256": Sampling("block", block_size=16, fetch_factor=256, batch_size=BATCH),
    "random": Sampling("random", fetch_factor=16, batch_size=BATCH),
}


def entropy_bits(labels: np.ndarray) -> float:
    _, counts = np.unique(labels, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def batch_entropies(ds, sampling: Sampling, buffer_cells: int, latency_ms: float = 0.0) -> list[float]:
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
    out = [entropy_bits(b.labels.numpy()) for b in stream.epoch(0, summary.cells_per_rank) if b.size == BATCH]
    stream.close()
    store.put(stop_key(run), "stop")
    worker.join(timeout=30)
    return out


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
    true_random = [entropy_bits(plates[order[i:i + BATCH]]) for i in range(0, ds.n_cells - BATCH + 1, BATCH)]
    reference = float(np.mean(true_random))
    print(f"\n{ds.n_cells:,} cells in 14 plates stored in order; batch {BATCH}; consumer buffer {args.buffer} cells")
    print(f"{'strategy':<18}{'mean bits':>10}{'std':>7}{'of random':>11}")
    print(f"{'true random':<18}{reference:>10.3f}{np.std(true_random):>7.3f}{1.0:>11.1%}")
    figures = {"true_random_bits": round(reference, 4)}
    for name, sampling in STRATEGIES.items():
        values = batch_entropies(ds, sampling, args.buffer, args.rpc_latency_ms)
        mean = float(np.mean(values))
        print(f"{name:<18}{mean:>10.3f}{np.std(values):>7.3f}{mean / reference:>11.1%}")
        figures[f"{name.split()[0]}{'' if ' ' not in name else '_' + name.split()[1][2:]}_bits"] = round(mean, 4)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
