"""The campaign's setup step, shared by the local and Modal runs. It runs where the dataset can
be read (a producer image, not the GPU image): it publishes every epoch's plan summary into the
map (the trainer's driver and consumers need only those) and produces the held-out set once."""

from __future__ import annotations

from coordination.driver import PlanSummary, publish_summary
from producers.producer import Producer, select_cells


def prepare(cfg, queue, store) -> dict:
    """Publish plans and the held-out set; returns what the trainer needs to know."""
    producer = Producer(cfg.producer_config(), queue, store)
    summaries = [PlanSummary.of(producer.plan(epoch), cfg.gpus) for epoch in range(cfg.epochs)]
    for summary in summaries:
        publish_summary(store, cfg.run, summary)
    held_out = 0
    if cfg.eval_filter:
        cells = select_cells(producer.ds, cfg.eval_filter)[: cfg.eval_cells]
        held_out = producer.produce_held_out(cells)
    return {
        "n_genes": producer.ds.n_genes,
        "vocab_size": producer.ds.n_genes + 4,
        "cells_per_epoch": summaries[0].n_cells,
        "units_per_epoch": summaries[0].n_units,
        "steps_per_epoch": summaries[0].steps(cfg.batch_size) // cfg.grad_accum,
        "held_out_cells": held_out,
    }
