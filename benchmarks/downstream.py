"""Downstream parity: does a model trained on one epoch of a strategy's stream do as well as one
trained on truly random batches? As scDataset and annbatch report it: a linear classifier of
plate-independent labels (cell line, dose), trained on every plate but one, macro-F1 on the
held-out plate. `benchmarks/randomness.py` runs it for each strategy and seed, on the batches
whose shuffling it scores.

Everything goes through the real pipeline (plan → producer → queue → consumer stream with its
mixing buffer): `pipeline_epoch` is that pipeline on one machine, and the probe reads the scGPT
tokens the trainer would (gene tokens weighted by their expression bins), not the counts.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from coordination.driver import Driver
from coordination.latency import remote
from coordination.plan import Sampling
from coordination.queues import MemoryMap, MemoryQueue
from coordination.routing import stop_key
from coordination.summary import PlanSummary, publish_summary
from coordination.vocab import GENE_OFFSET, PAD
from producers.config import ProducerConfig
from producers.held_out import produce_held_out
from producers.producer import Producer
from producers.selection import filter_cells, label_codes
from trainer.config import TrainConfig
from trainer.evaluation import load_held_out
from trainer.stream import Batch, ConsumerStream

LABELS = ("cell_line", "dose")  # plate-independent in the synthetic atlas (producers/synth.py)
MAX_GENES = 4096  # more than any synthetic cell expresses: the probe sees every expressed gene
PROBE_LR = 1e-3  # Adam's default: a constant step, so what the stream shows last weighs more
EVAL_POINTS = 8  # held-out macro-F1 this many times over the epoch (the convergence curve)


@contextmanager
def pipeline_epoch(
    ds,
    sampling: Sampling,
    *,
    seed: int = 0,
    batch_size: int = 64,
    buffer_cells: int = 4096,
    latency_ms: float = 0.0,
    max_genes: int = 8,
    held_out_filter: str | None = None,
    balance=None,
):
    """One epoch through producer, queue and consumer stream, on one machine (threads, in-memory
    queue with `latency_ms` per call): yields (the epoch's batches, the held-out batches). Cells
    that `held_out_filter` matches are never trained on (the campaign's --eval-filter); they are
    tokenized once into the evaluation partition, as the campaign does. `balance`: balanced
    sampling (`coordination.balance.Balance`)."""
    queue, store = remote(MemoryQueue(max_items=10**9, max_bytes=1 << 62), MemoryMap(), latency_ms)
    run = "quality"
    config = ProducerConfig(
        dataset=ds.uri,
        run=run,
        seed=seed,
        sampling=sampling,
        tokenizer="scgpt",
        max_genes=max_genes,
        exclude_filter=held_out_filter,
        world_size=1,
        idle_timeout_s=600,
        balance=balance,
    )
    producer = Producer(config, queue, store, dataset=ds)
    summary = PlanSummary.of(producer.plan(0), 1)
    publish_summary(store, run, summary)
    held = []
    if held_out_filter is not None:
        held_cells = filter_cells(ds, held_out_filter, "--eval-filter")
        produce_held_out(producer, held_cells)
        n_held = len(held_cells)
        held = load_held_out(
            queue,
            TrainConfig(
                run=run,
                backend={"kind": "memory"},
                vocab_size=ds.n_genes + GENE_OFFSET,
                batch_size=512,
                eval_cells=n_held,
                no_data_timeout_s=120,
            ),
            torch.device("cpu"),
        )
    driver = Driver(queue, store, run, poll_s=0.05)
    driver.start([0])
    worker = threading.Thread(target=producer.run, daemon=True)
    worker.start()
    # a short poll: the queue is in this process (a poll costs nothing), and closing waits one poll out
    stream = ConsumerStream(
        queue, rank=0, world_size=1, run=run, batch_size=batch_size, buffer_cells=buffer_cells, poll_s=0.1
    )
    try:
        yield stream.epoch(0, summary.cells_per_rank), held
    finally:
        stream.close()
        store.put(stop_key(run), "stop")
        producer.stop()  # at once (this process's own), not when it next looks at the key
        driver.stop()
        worker.join(timeout=30)


class LinearProbe(torch.nn.Module):
    """Softmax regression on a cell's tokens, a head per label: each gene token adds its weight
    row scaled by its expression bin; a cell's bins are scaled to a root mean square of 1, so a
    feature is O(1) whatever the cell's depth."""

    def __init__(self, vocab: int, n_classes: list[int]):
        super().__init__()
        self.n_classes = n_classes
        self.bag = torch.nn.EmbeddingBag(vocab, sum(n_classes), mode="sum", padding_idx=PAD)
        torch.nn.init.zeros_(self.bag.weight)
        self.bias = torch.nn.Parameter(torch.zeros(sum(n_classes)))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        weights = batch.values.float()  # bins; 0 under CLS and PAD
        genes = batch.values.count_nonzero(dim=1).clamp_min(1).float()
        weights = weights * (genes.sqrt() / weights.norm(dim=1).clamp_min(1e-6)).unsqueeze(1)
        return (self.bag(batch.tokens, per_sample_weights=weights) + self.bias).split(self.n_classes, dim=1)


@dataclass
class ProbeRun:
    """One strategy, one seed: held-out macro-F1 per label at the end, and along the way."""

    f1: dict
    curve: list = field(default_factory=list)  # (cells seen, {label: macro-F1})
    cells: int = 0


def macro_f1(probe: LinearProbe, held: list[Batch], codes: dict[str, np.ndarray]) -> dict[str, float]:
    """The probe's macro-F1 per label on the held-out batches (every class weighs the same)."""
    from sklearn.metrics import f1_score

    with torch.no_grad():
        predicted = [torch.cat(p).numpy() for p in zip(*(tuple(h.argmax(1) for h in probe(b)) for b in held))]
    ids = torch.cat([b.cell_ids for b in held]).numpy()
    return {label: float(f1_score(codes[label][ids], guess, average="macro")) for label, guess in zip(codes, predicted)}


def train_probe(
    batches,
    held: list[Batch],
    codes: dict[str, np.ndarray],
    n_classes: list[int],
    vocab: int,
    planned_cells: int,
    eval_points: int = EVAL_POINTS,
) -> ProbeRun:
    """One pass of Adam over `batches` (an epoch of the stream); macro-F1 on `held` at `eval_points`
    evenly spaced numbers of cells seen, the last at the end.
    The probe starts at zero: runs differ only by the order of the stream."""
    probe = LinearProbe(vocab, n_classes)
    optimizer = torch.optim.Adam(probe.parameters(), lr=PROBE_LR)
    loss_of = torch.nn.CrossEntropyLoss()
    marks = [planned_cells * (k + 1) // eval_points for k in range(eval_points - 1)]
    run = ProbeRun(f1={})
    for batch in batches:
        ids = batch.cell_ids.numpy()
        loss = sum(
            loss_of(logits, torch.from_numpy(codes[label][ids]).long()) for logits, label in zip(probe(batch), codes)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.cells += batch.size
        while marks and run.cells >= marks[0]:
            run.curve.append((run.cells, macro_f1(probe, held, codes)))
            marks.pop(0)
    run.f1 = macro_f1(probe, held, codes)
    run.curve.append((run.cells, run.f1))
    return run


def parity_codes(ds) -> tuple[dict[str, np.ndarray], list[int], int]:
    """The probe's targets: per-cell codes of each label in LABELS, the class counts, the vocab."""
    codes, n_classes = {}, []
    for label in LABELS:
        codes[label], names = label_codes(ds, label)
        n_classes.append(len(names))
    return codes, n_classes, ds.n_genes + GENE_OFFSET  # the built vocabulary of one dataset
