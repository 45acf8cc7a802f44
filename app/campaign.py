"""The campaign's setup step, shared by the local and Modal runs. It runs where the dataset can
be read (a producer image, not the GPU image): it publishes every epoch's plan summary into the
map (the trainer's driver and consumers need only those) and produces the held-out set once."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from coordination.errors import CellfeedError
from coordination.routing import EVAL_PARTITION, stop_key
from coordination.summary import PlanSummary, SetupFacts, optimizer_steps, publish_summary
from coordination.vocab import publish_vocab
from producers.held_out import compile_token_pass, produce_held_out
from producers.producer import Producer
from producers.selection import filter_cells
from producers.sources import check_coverage
from producers.tokenizers import layout

MAX_EPOCHS = 10_000  # a step budget needing more epochs than this is surely a mistake


def plan_epochs(cfg, producer: Producer) -> list[PlanSummary]:
    """Each epoch's plan summary: `--epochs` of them, or with only `--steps`, as many as the steps
    need (an epoch's step count depends on its plan); both given and too few epochs is an error.
    Counted in steps of --batch-size cells: a token budget's steps take at most that many, so an
    epoch holds at least as many of its steps, and the epochs planned are enough."""
    summaries, steps = [], 0
    while len(summaries) < (cfg.epochs or 1) or (cfg.epochs is None and cfg.steps and steps < cfg.steps):
        if len(summaries) == MAX_EPOCHS:
            raise CellfeedError(f"--steps {cfg.steps} needs more than {MAX_EPOCHS:,} epochs of this dataset")
        summaries.append(PlanSummary.of(producer.plan(len(summaries)), cfg.world_size))
        summaries[-1].class_mix = producer.class_mix(len(summaries) - 1)  # what each epoch's audit checks
        steps += optimizer_steps(summaries[-1:], cfg.batch_size, cfg.grad_accum)
    if cfg.steps and steps < cfg.steps:
        raise CellfeedError(
            f"--steps {cfg.steps} is more than --epochs {cfg.epochs} hold ({steps} steps of "
            f"{cfg.batch_size} cells per rank): raise --epochs, or leave it out to train as many "
            "epochs as the steps need"
        )
    return summaries


def cells_per_step(cfg, producer: Producer) -> int:
    """A batch's cells: --batch-size, or with --tokens-per-batch about as many as the budget holds of
    the sources' cells at their mean length (so the step counts shown are estimates; the trainer
    ends an epoch when its cells are trained, and the schedule counts cells). Each source's cells
    are read in chunks: its row offsets are all it needs, and at Tahoe's scale a copy is GBs."""
    if cfg.tokens_per_batch is None:
        return cfg.batch_size
    genes, tokens, cells = cfg.genes_per_cell, 0, 0
    for source in producer.sources:
        starts = source.ds.cell_row_start
        for lo in range(0, len(starts) - 1, 1 << 22):
            chunk = np.diff(starts[lo : lo + (1 << 22) + 1])
            tokens, cells = tokens + int(np.minimum(chunk, genes).sum()), cells + len(chunk)
    mean = tokens / max(1, cells) + layout(cfg.tokenizer).sequence_length(genes) - genes
    return int(min(cfg.batch_size, max(1, cfg.tokens_per_batch // max(1.0, mean))))


def prepare(cfg, queue, store, vocab_path=None, compile_pass=False) -> SetupFacts:
    """Publish the vocabulary, plans and the held-out set; returns what the trainer needs to know.
    Safe to run again on a run (a resume, or a campaign whose plans or held-out set expired):
    plans are the same, the held-out set is replaced, and a stop left by an earlier end is
    cleared. Every source's genes are checked against the vocabulary first (`check_coverage`);
    `vocab_path`: where to write the vocabulary (the run folder). `compile_pass`: compile the token
    pass here even with no held-out set (a Modal setup: the producers load what it compiled)."""
    producer = Producer(cfg.producer_config(), queue, store, verify=True)  # every source checked, once per campaign
    vocab = producer.vocab
    coverage = check_coverage(producer.sources, vocab)
    summaries = plan_epochs(cfg, producer)
    store.pop(stop_key(cfg.run), None)
    publish_vocab(store, cfg.run, vocab)
    if vocab_path is not None:
        Path(vocab_path).write_text(vocab.to_json())
    for summary in summaries:
        publish_summary(store, cfg.run, summary)
    held_out, held_out_items = 0, 0
    while queue.get_many(1000, block=False, partition=EVAL_PARTITION):  # an earlier copy: replaced, not doubled
        pass
    cells = held_out_cells(producer, cfg.eval_cells)
    if cells is not None:
        held_out, held_out_items = len(cells), produce_held_out(producer, cells)
    elif compile_pass:
        compile_token_pass(producer)
    quotas = producer.quotas if producer.quotas is not None else [summaries[0].n_cells]
    step_cells = cells_per_step(cfg, producer)
    facts = SetupFacts(
        n_genes=vocab.n_genes,
        vocab_size=vocab.size,
        pad_token=vocab.pad,
        mask_token=vocab.mask,
        special_tokens=vocab.special_ids,
        vocab_fingerprint=vocab.fingerprint,
        epochs=len(summaries),
        cells_per_epoch=summaries[0].n_cells,
        units_per_epoch=summaries[0].n_units,
        units_total=sum(s.n_units for s in summaries),
        steps_per_epoch=optimizer_steps(summaries[:1], step_cells, cfg.grad_accum),
        total_steps=cfg.steps or optimizer_steps(summaries, step_cells, cfg.grad_accum),
        steps_estimated=cfg.tokens_per_batch is not None and not cfg.steps,  # (--steps: that many, exactly)
        step_cells=step_cells,
        held_out_cells=held_out,
        held_out_items=held_out_items,
        sources=tuple((s.spec.name, int(q), c.line()) for s, q, c in zip(producer.sources, quotas, coverage)),
        data_id=data_identity(producer.sources),
        **balance_facts(cfg, producer, summaries[0]),
    )
    producer.close()  # (its read threads: none outlives the setup)
    return facts


def balance_facts(cfg, producer: Producer, first) -> dict:
    """The class mix a balanced campaign plans (epoch 0's), beside each class's cells in the data."""
    if producer.strata is None:
        return {}
    in_data = producer.strata.class_totals(producer.strata.counts)
    return {
        "balance": f"{cfg.balance_by}, ALPHA {cfg.balance_power:g}",
        "class_mix": tuple([name, n, int(d)] for (name, n), d in zip(first.class_mix, in_data)),
    }


def data_identity(sources) -> str:
    """The data a run trains on, for its checkpoints: one dataset's identity, or every source's."""
    if len(sources) == 1:
        return sources[0].ds.identity
    return "; ".join(f"{s.spec.name}: {s.ds.identity}" for s in sources)


def record_mixtures(cfg, run_dir: Path, resumed_epoch: int | None) -> str | None:
    """The run's corpus over its epochs, kept in RUN/mixtures.json (None: one dataset). A resume
    whose corpus file differs from the run's current mixture (weights, sources added or removed)
    changes it from the epoch after the one in progress, which finishes under its plan; one line
    says so. A change that would alter an epoch already planned is refused in one line
    (`Mixtures.changed`)."""
    from coordination.corpus_file import CorpusSpec, Mixtures

    if not cfg.corpus:
        return None
    path = Path(run_dir) / "mixtures.json"
    new = CorpusSpec.read(cfg.corpus)
    if resumed_epoch is not None and path.exists():
        mixtures = Mixtures.from_json(path.read_text(), str(path))
        if new.to_toml() != mixtures.history[-1][1].to_toml():
            mixtures = mixtures.changed(new, resumed_epoch + 1)
            print(
                f"the corpus changed: its new mixture applies from epoch {resumed_epoch + 1} "
                f"(epoch {resumed_epoch} finishes under its plan)",
                flush=True,
            )
    else:
        mixtures = Mixtures([(0, new)])
    path.write_text(mixtures.to_json())
    return str(path)


def held_out_cells(producer: Producer, n: int):
    """The held-out cells (global ids): the first that match each source's eval filter, `n` in
    all, split among the sources by weight; None when no source has one."""
    from coordination.corpus_file import quotas

    filtered = [s for s in producer.sources if s.spec.eval_filter]
    if not filtered:
        return None
    shares = quotas([s.spec.weight for s in filtered], n)
    cells = []
    for s, k in zip(filtered, shares):
        mine = filter_cells(s.ds, s.spec.eval_filter, "--eval-filter")
        if len(mine) == 0:
            raise CellfeedError(
                f"--eval-filter {s.spec.eval_filter!r} matches no cells of {s.spec.name}; check the "
                "filter (`cellfeed inspect DATASET` lists the obs columns and their values)"
            )
        cells.append(mine[:k] + s.offset)
    return np.concatenate(cells)
