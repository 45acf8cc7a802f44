"""The trainer as it runs: 2 real rank processes (gloo DDP on CPU, tiny preset) fed by producers
through the local queue server. Loss goes down, ranks stay in sync, the step count matches the
plan, and a run SIGKILLed mid-epoch resumes so that every cell is trained on exactly once."""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from coordination.errors import CellfeedError
from coordination.local_backend import ServerProcess
from coordination.local_client import LocalMap, LocalQueue
from coordination.plan import Sampling
from coordination.queues import MemoryMap, MemoryQueue
from coordination.routing import stop_key
from coordination.summary import PlanSummary, publish_summary
from coordination.vocab import CLS, EOS
from producers.config import ProducerConfig
from producers.held_out import produce_held_out
from producers.producer import Producer
from tests.conftest import synth_once, wait_for
from trainer.config import TrainConfig
from trainer.launch import launch
from trainer.model import CellTransformer, ModelConfig, mask_positions, masked_loss, train_flops
from trainer.ranks import wait_all
from trainer.stream import Batch

WORLD = 2
BATCH = 32


@pytest.fixture(scope="session")  # data only: built once per session (`built_once`), whatever order tests run in
def atlas(tmp_path_factory):
    """3,000 cells in 14 plates, as `small_synth`, over 2,000 genes, not 62,710: the tiny model's
    embedding (its optimizer step, each step's all-reduce and every checkpoint) is then 30x
    smaller, and what these tests check (which cells each rank trains, across kills and resumes)
    is the same."""
    from producers.synth import SynthSpec

    spec = SynthSpec(n_cells=3000, n_genes=2000, seed=7)
    return synth_once(tmp_path_factory, "trainer-atlas", spec, rows_per_fragment=250_000)


class Campaign:
    """Server + published plans + producer threads, as the local campaign sets them up."""

    def __init__(
        self,
        ds,
        run: str,
        epochs: int,
        producers: int = 2,
        subset_filter=None,
        held_out=None,
        sampling: Sampling = Sampling("block", block_size=8, fetch_factor=2, batch_size=BATCH),
        corpus: str | None = None,
        world: int = WORLD,
        mixtures: str | None = None,
        balance=None,
    ):
        self.server = ServerProcess()
        self.run, self.world, self.epochs = run, world, epochs
        self.ds, self.sampling, self.corpus = ds, sampling, corpus
        config = ProducerConfig(
            dataset="" if corpus else ds.uri,
            corpus=corpus,
            mixtures=mixtures,
            run=run,
            world_size=world,
            max_genes=24,
            cells_per_item=40,
            sampling=sampling,
            idle_timeout_s=300,
            subset_filter=subset_filter,
            balance=balance,
        )
        first = Producer(
            config,
            LocalQueue(self.server.address, self.server.token),
            LocalMap(self.server.address, token=self.server.token),
            dataset=ds,
        )
        self.vocab_size = first.vocab.size  # the model's embedding: the campaign's vocabulary, as the setup gives it
        self.plans = [first.plan(e) for e in range(epochs)]
        if held_out is not None:
            produce_held_out(first, held_out)
        self.summaries = [PlanSummary.of(first.plan(e), world) for e in range(epochs)]
        for s in self.summaries:  # (balanced: the class mix each epoch's audit checks, as the setup publishes it)
            s.class_mix = first.class_mix(s.epoch)
            publish_summary(first.store, run, s)
        self.producers = [
            Producer(
                config,
                LocalQueue(self.server.address, self.server.token),
                LocalMap(self.server.address, token=self.server.token),
                dataset=ds,
            )
            for _ in range(producers)
        ]
        self.threads = [threading.Thread(target=p.run, daemon=True) for p in self.producers]
        for t in self.threads:
            t.start()

    def train_config(self, tmp: Path, **changes) -> TrainConfig:
        base = dict(
            run=self.run,
            backend={"kind": "local", **self.server.where},
            vocab_size=self.vocab_size,
            preset="tiny",
            batch_size=BATCH,
            lr=3e-3,
            warmup_steps=5,
            epochs=self.epochs,
            seed=3,
            checkpoint_dir=str(tmp / "ckpt"),
            checkpoint_every=10,
            log_path=str(tmp / "steps.jsonl"),
            cells_log=str(tmp / "cells"),
            progress_bar=False,
            no_data_timeout_s=120,
        )
        return TrainConfig(**{**base, **changes})

    def close(self) -> None:
        if self.server is None:
            return
        LocalMap(self.server.address, token=self.server.token).put(stop_key(self.run), "stop")
        for p in self.producers:  # at once, not at their next look at the stop key (a heartbeat away)
            p.stop()
        for t in self.threads:
            t.join(timeout=30)
        self.server.close()
        self.server = None


def read_cells(prefix: Path, max_step: int | None = None, world: int = WORLD, only_rank: int | None = None) -> Counter:
    out = Counter()
    for rank in range(world) if only_rank is None else [only_rank]:
        path = Path(f"{prefix}.rank{rank}.jsonl")
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            if max_step is None or row["step"] < max_step:
                out.update(row["cells"])
    return out


def train_through(campaign: Campaign, tmp: Path, **changes) -> list[dict]:
    """The campaign trained through on its ranks (its config with `changes`), then closed: each rank's summary."""
    try:
        cfg = campaign.train_config(tmp, **changes)
        codes = wait_all(launch(cfg, campaign.world, tmp, summary_path=str(tmp / "summary")), timeout=600)
    finally:
        campaign.close()
    assert codes == [0] * campaign.world
    return [json.loads(Path(f"{tmp}/summary.rank{r}").read_text()) for r in range(campaign.world)]


def test_two_rank_ddp_trains_in_sync_on_every_cell_once(atlas, tmp_path):
    plates = np.array(atlas.obs(["plate"]).column(0).to_pylist())
    train_cells = np.flatnonzero(plates != "plate14")
    held_out = np.flatnonzero(plates == "plate14")[:96]
    campaign = Campaign(atlas, "ddp", epochs=1, subset_filter="plate != 'plate14'", held_out=held_out)
    summaries = train_through(campaign, tmp_path, eval_every=15, eval_cells=96)
    steps = campaign.summaries[0].steps(BATCH)
    assert summaries[0]["steps"] == summaries[1]["steps"] == steps  # the step count the plan implies
    assert summaries[0]["final_params_checksum"] == summaries[1]["final_params_checksum"]  # ranks in sync
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]  # step rows (evaluation rows carry eval_* only)
    assert len(rows) == steps and all(r["cells_per_s"] > 0 and r["mfu"] is None for r in rows)
    first, last = sum(r["loss"] for r in rows[:5]) / 5, sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 0.3, (first, last)
    assert read_cells(tmp_path / "cells") == Counter(train_cells.tolist())  # the train split, exactly once
    assert (tmp_path / "ckpt" / "latest").exists()
    evals = summaries[0]["eval"]  # held-out masked-bin loss/accuracy at the start and every 15 steps
    assert [e["step"] for e in evals] == [0] + list(range(15, steps + 1, 15))
    assert all(e["eval_loss"] < evals[0]["eval_loss"] - 1.0 for e in evals[1:])  # far better than untrained
    assert all(e["eval_accuracy"] > 0.5 for e in evals[1:])  # far above chance (1 in 50 bins)


def test_two_ranks_with_a_token_budget_end_the_epoch_together_when_neither_has_a_cell_left(atlas, tmp_path):
    """--tokens-per-batch: a batch is the drawn cells that fit the budget (here 4 of the atlas's
    25-token cells, under the cap of 32), so no rank knows its step count ahead; the ranks' unequal
    shares end on the step after which neither has a cell left (the all-reduced flag: the one with
    fewer cells yields an empty batch meanwhile), in sync, every cell once, the audit exact. Two
    batches a step (`grad_accum`): the flag is read at a step's end, so no step is left half or empty."""
    plates = np.array(atlas.obs(["plate"]).column(0).to_pylist())
    cells = np.flatnonzero(plates < "plate05")
    campaign = Campaign(atlas, "budget", epochs=1, subset_filter="plate < 'plate05'")
    summaries = train_through(campaign, tmp_path, tokens_per_batch=100, grad_accum=2, checkpoint_every=1000)
    shares = campaign.summaries[0].cells_per_rank
    batches = -(-max(shares) // 4)  # 4 cells of 25 tokens a batch (CLS + 24 genes), not BATCH
    assert -(-min(shares) // 4) < batches  # the rank with fewer cells runs out a batch or more before the other
    steps = -(-batches // 2)
    assert summaries[0]["steps"] == summaries[1]["steps"] == steps
    assert summaries[0]["final_params_checksum"] == summaries[1]["final_params_checksum"]  # ranks in sync
    assert summaries[0]["complete"] and summaries[0]["audits"][0]["audited"]  # (a failed audit raises)
    assert read_cells(tmp_path / "cells") == Counter(cells.tolist())  # every cell once
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    per_step = [r["cells"] for r in rows if "loss" in r]  # both ranks' cells of each step's two batches
    full = min(shares) // 8
    assert per_step[:full] == [2 * 4 * WORLD] * full and sum(per_step) == len(cells) and len(per_step) == steps


def test_a_token_budget_campaign_killed_mid_epoch_resumes_and_trains_every_cell_once(atlas, tmp_path):
    """Under --tokens-per-batch both ranks SIGKILLed after their checkpoint at step 20, resumed: the
    runs together train every cell once (the checkpoint and the audit count cells, not steps)."""
    cells = np.flatnonzero(np.array(atlas.obs(["plate"]).column(0).to_pylist()) < "plate05")
    campaign = Campaign(atlas, "budget-resume", epochs=1, subset_filter="plate < 'plate05'")
    before, after, summary = kill_mid_epoch_and_resume(campaign, tmp_path, tokens_per_batch=100)
    assert before + after == Counter(cells.tolist())
    assert summary["complete"] and summary["audits"][0]["audited"]


# (resumed on 3 ranks: the curriculum test below kills this corpus's campaign on 2 ranks in epoch 0
# and resumes it on 3, and checks epoch 0 as this test does: the planned multiset, the quotas, the audit)
@pytest.mark.parametrize("ranks", [2])
def test_a_corpus_killed_mid_epoch_and_resumed_trains_every_planned_cell_as_planned(corpus, tmp_path, ranks):
    """A three-source corpus (sources repeated within the epoch and sources continued across
    epochs), both ranks killed mid-epoch, resumed on 2: the two runs together train the planned
    multiset exactly, each source its quota."""
    from coordination.corpus import source_of

    path, offsets, quotas = corpus
    campaign = Campaign(None, "corpus", epochs=1, corpus=path)
    plan = campaign.plans[0]
    planned = Counter(
        np.concatenate(
            [plan.unit_cells(u, s) + offsets[s] for u in range(plan.n_units) for s in range(len(offsets))]
        ).tolist()
    )
    assert max(planned.values()) == 2  # a small source's cells come twice in this epoch
    elsewhere = None if ranks == WORLD else (lambda: Campaign(None, "corpus", epochs=1, corpus=path, world=ranks))
    before, after, summary = kill_mid_epoch_and_resume(campaign, tmp_path, resume_on=elsewhere)
    trained = before + after
    assert trained == planned  # each planned cell as often as planned: no loss, no duplicate
    per_source = np.bincount(source_of(list(trained.elements()), offsets), minlength=len(offsets))
    assert per_source.tolist() == list(quotas)
    (audit,) = summary["audits"]
    assert audit["audited"] and audit["cells"] == sum(quotas) and audit["missing"] == 0


def test_a_corpus_resumed_on_three_ranks_with_a_new_mixture_trains_each_epoch_as_planned(corpus, tmp_path):
    """Curriculum: a corpus campaign of 2 epochs on 2 ranks, killed in epoch 0, resumed on 3 with
    other weights (0.2 / 0.3 / 0.5) from epoch 1: epoch 0 finishes under its plan, epoch 1 trains
    the new quotas, each source's stream continuing where epoch 0 left it."""
    from benchmarks.chaos import trained_per_epoch
    from coordination.corpus import source_of
    from coordination.corpus_file import CorpusSpec, Mixtures, SourceSpec

    path, offsets, quotas = corpus
    old = CorpusSpec.read(path)
    new = CorpusSpec(
        tuple(SourceSpec(**{**s.__dict__, "weight": w}) for s, w in zip(old.sources, (0.2, 0.3, 0.5))),
        old.vocabulary,
        old.gene_column,
        old.epoch_cells,
    )
    mixtures = Mixtures([(0, old)]).changed(new, 1)
    (tmp_path / "mixtures.json").write_text(mixtures.to_json())
    before_change = Campaign(None, "curriculum", epochs=2, corpus=path)
    plan0 = before_change.plans[0]

    def after_change():
        return Campaign(None, "curriculum", epochs=2, corpus=path, world=3, mixtures=str(tmp_path / "mixtures.json"))

    before, after, summary = kill_mid_epoch_and_resume(before_change, tmp_path, resume_on=after_change)
    planner = Campaign(
        None, "planner", epochs=2, corpus=path, world=3, mixtures=str(tmp_path / "mixtures.json"), producers=0
    )
    plans = planner.plans
    planner.close()
    assert plans[0].plan_id == plan0.plan_id  # epoch 0 kept its plan
    by_epoch = trained_per_epoch(tmp_path / "b")
    for epoch, plan in enumerate(plans):
        planned = Counter(
            np.concatenate([plan.unit_cells(u, s) + offsets[s] for u in range(plan.n_units) for s in range(3)]).tolist()
        )
        trained = by_epoch.get(epoch, Counter()) + (before if epoch == 0 else Counter())
        assert trained == planned, epoch
        per_source = np.bincount(source_of(list(trained.elements()), offsets), minlength=3).tolist()
        assert per_source == ([1440, 720, 240] if epoch == 0 else [480, 720, 1200])
    pbmc = [c - offsets[2] for c in plans[1].unit_cells(0, 2)]
    assert plans[1].starts[2] == 240 and len(pbmc) > 0  # pbmc's stream went on from 240
    assert [a["epoch"] for a in summary["audits"]] == [0, 1]
    assert all(a["audited"] and a["cells"] == 2400 and a["missing"] == 0 for a in summary["audits"])


def kill_mid_epoch_and_resume(
    campaign: Campaign, tmp_path: Path, resume_on=None, kill_again_after: int | None = None, **changes
) -> tuple[Counter, Counter, dict]:
    """SIGKILL every rank after their checkpoint at step 20 (run "a"), resume (run "b"): (cells
    trained before the checkpoint, cells trained by the resumed run, its summary). `resume_on`: a
    campaign to resume on instead -- another number of ranks, set up afresh as a re-run does (a
    new queue, plans published for its ranks, producers routing to them). `kill_again_after`:
    run "b" is killed too, after its next checkpoint that many steps on, and resumed once more on
    one rank (run "c"); the middle counter then holds run b's cells up to that checkpoint. `changes`:
    to every run's config."""

    def crash_after(cfg, world, folder, at_step) -> int:
        procs = launch(cfg, world, folder)
        latest = Path(cfg.checkpoint_dir) / "latest"
        wait_for(
            lambda: (
                (latest.exists() and latest.read_text().strip() >= f"step-{at_step:08d}")
                or any(p.poll() is not None for p in procs)
            ),
            f"a checkpoint at step {at_step}",
            timeout=300,
        )
        assert all(p.poll() is None for p in procs), f"a rank ended before its checkpoint at step {at_step}"
        for p in procs:  # the ranks this test launched
            p.kill()  # SIGKILL, a real crash: no clean-up, no final checkpoint
        for p in procs:
            p.wait()
        return int(latest.read_text().strip().split("-")[1])

    try:
        # a mixing buffer far smaller than the epoch (as at scale), so units complete before the crash
        first = campaign.train_config(
            tmp_path / "a", cells_log=str(tmp_path / "a" / "cells"), buffer_cells=160, **changes
        )
        planned = sum(campaign.summaries[0].cells_per_rank)
        committed = crash_after(first, campaign.world, tmp_path / "a", 20)
        if resume_on is not None:
            campaign.close()
            campaign = resume_on()
        second = campaign.train_config(
            tmp_path / "b",
            checkpoint_dir=first.checkpoint_dir,
            resume=True,
            cells_log=str(tmp_path / "b" / "cells"),
            buffer_cells=160,
            **changes,
        )
        again = None
        if kill_again_after is None:
            codes = wait_all(
                launch(second, campaign.world, tmp_path / "b", summary_path=str(tmp_path / "b" / "summary")),
                timeout=600,
            )
        else:
            again = crash_after(second, campaign.world, tmp_path / "b", committed + kill_again_after)
            campaign.close()
            campaign = Campaign(
                None if campaign.corpus else campaign.ds,
                campaign.run,
                epochs=1,
                producers=1,
                sampling=campaign.sampling,
                corpus=campaign.corpus,
                world=1,
            )
            third = campaign.train_config(
                tmp_path / "c",
                checkpoint_dir=first.checkpoint_dir,
                resume=True,
                cells_log=str(tmp_path / "c" / "cells"),
                buffer_cells=160,
                **changes,
            )
            codes = wait_all(
                launch(third, 1, tmp_path / "c", summary_path=str(tmp_path / "c" / "summary")), timeout=600
            )
    finally:
        campaign.close()
    assert codes == [0] * campaign.world
    before = read_cells(tmp_path / "a" / "cells", max_step=committed)  # what the checkpoint holds
    after = read_cells(tmp_path / "b" / "cells", max_step=again, world=second_world(tmp_path))
    assert 0 < sum(before.values()) < planned and sum(after.values()) > 0  # (the crash was mid-epoch)
    return before, after, json.loads((tmp_path / ("b" if again is None else "c") / "summary.rank0").read_text())


def second_world(tmp_path: Path) -> int:
    """How many ranks run "b" had (the cells logs it left)."""
    return len(list((tmp_path / "b").glob("cells.rank*.jsonl")))


SAMPLINGS = {
    "block": Sampling("block", block_size=8, fetch_factor=2, batch_size=BATCH),
    "sequential": Sampling("sequential", unit_cells=60),
    "mixture": Sampling("mixture", unit_cells=60, n_scanners=3),
    "random": Sampling("random", fetch_factor=2, batch_size=BATCH),
}
# A resume sees a strategy only through its plan's shape (`PlanSummary`: each unit's whole cells,
# the boundary cells and the units holding their pieces): block and random units hold whole cells
# only, sequential and mixture units also pieces of boundary cells. One strategy of each shape runs
# the whole elastic campaign below; every strategy's plan goes through the same resume arithmetic
# in test_every_strategys_plan_resumes_on_any_number_of_ranks (in-process, cell by cell).
WHOLE_CELLS_ONLY, WITH_BOUNDARY_CELLS = ("block", "random"), ("sequential", "mixture")


@pytest.mark.parametrize("strategy", ["block", "sequential"])  # one of each plan shape (above)
def test_killed_on_two_ranks_resumed_on_three_killed_again_resumed_on_one_trains_every_cell_once(
    atlas, tmp_path, strategy
):
    """Elastic, both ways in one epoch: 2 ranks SIGKILLed mid-epoch, resumed on 3 (each re-run set
    up afresh: a new queue, plans published for its ranks, producers routing to them), those 3
    SIGKILLed after their next checkpoint, resumed on 1 (the producers: 2, 3, 1). The epoch's untrained cells are
    re-planned over the new ranks each time; every cell is trained once across the three runs;
    units trained through are not produced again (with sequential units, those holding a piece of
    a boundary cell not trained yet are); the audit covers the epoch across all three. (The same
    number of ranks: the corpus test below, on 2.)"""
    sampling = SAMPLINGS[strategy]

    def on(world):  # with as many producers as ranks: the producer count changes too (2, 3, then 1)
        return lambda: Campaign(atlas, "elastic", epochs=1, sampling=sampling, world=world, producers=world)

    campaign = Campaign(atlas, "elastic", epochs=1, sampling=sampling)
    before, middle, _ = kill_mid_epoch_and_resume(campaign, tmp_path, resume_on=on(3), kill_again_after=10)
    per_rank = [sum(read_cells(tmp_path / "b" / "cells", world=3, only_rank=r).values()) for r in range(3)]
    assert min(per_rank) > 0  # all three ranks trained part of the rest
    last = json.loads((tmp_path / "c" / "summary.rank0").read_text())
    after = read_cells(tmp_path / "c" / "cells", world=1)
    assert before + middle + after == Counter(range(atlas.n_cells))  # no loss, no duplicate
    assert 0 < last["resume_skipped_units"] < campaign.summaries[0].n_units
    if sampling.strategy == "sequential":  # units holding a piece of an untrained boundary cell were made again
        assert len(campaign.summaries[0].boundary_cells) > 0
    (audit,) = last["audits"]
    assert audit["audited"] and audit["cells"] == atlas.n_cells and audit["missing"] == 0
    assert "across the resume" in audit["line"]


@pytest.mark.parametrize("strategy", list(SAMPLINGS))
def test_every_strategys_plan_resumes_on_any_number_of_ranks(atlas, strategy):
    """What a resume computes from a checkpoint, for each strategy's plan of the elastic test's
    atlas, checked cell by cell against the plan's work units: 2 ranks trained their first units
    through, half of one more and some boundary cells; resumed on 1, 2 or 3 ranks, each rank is
    given exactly the untrained cells routed to it (`cells_left_per_rank`), and the units not
    produced again (`units_to_skip`) are those trained through, less every unit holding a piece of
    a boundary cell not trained yet, so that every untrained cell is produced again."""
    from coordination.routing import cell_rank, unit_rank

    producer = Producer(
        ProducerConfig(
            dataset=atlas.uri,
            run="shapes",
            world_size=WORLD,
            max_genes=24,
            cells_per_item=40,
            sampling=SAMPLINGS[strategy],
        ),
        MemoryQueue(),
        MemoryMap(),
        dataset=atlas,
    )
    plan = producer.plan(0)
    summary = PlanSummary.of(plan, WORLD)
    units = list(plan.units())
    boundary = sorted(set(np.concatenate([u.pieces for u in units]).tolist()))
    assert boundary == sorted(summary.boundary_cells)
    assert bool(boundary) == (strategy in WITH_BOUNDARY_CELLS)  # the shapes the elastic campaign runs one of each
    # the plan partitions the atlas: each cell whole in exactly one unit, or a boundary cell in pieces
    assert Counter(np.concatenate([u.parts[0].cells for u in units]).tolist() + boundary) == Counter(
        range(atlas.n_cells)
    )
    holders = {c: {u.id for u in units if c in set(u.pieces.tolist())} for c in boundary}

    # the checkpoint: each rank trained its first units (u mod 2, in order) through, then half of one more
    done, unit_trained = set(), {}
    for rank in range(WORLD):
        mine = [u for u in units if unit_rank(u.id, WORLD) == rank]
        through = len(mine) * 2 // 5
        for u in mine[:through]:
            done.add(u.id)
            unit_trained[u.id] = u.n_cells
        unit_trained[mine[through].id] = mine[through].n_cells // 2
    # boundary cells stitched (every piece's unit done): every other one trained, the rest still in a buffer
    # (or not stitched yet: a piece's unit not done)
    ready = [c for c in boundary if holders[c] <= done]
    trained_stitched = set(ready[::2])
    untrained_boundary = set(boundary) - trained_stitched
    assert 0 < len(done) < plan.n_units

    for world in (1, 2, 3):
        expected = [0] * world
        for u in units:
            expected[unit_rank(u.id, world)] += u.n_cells - unit_trained.get(u.id, 0)
        for c in untrained_boundary:
            expected[cell_rank(c, world)] += 1
        left = summary.cells_left_per_rank(world, unit_trained, trained_stitched)
        assert left == expected, world
        assert sum(left) == atlas.n_cells - sum(unit_trained.values()) - len(trained_stitched)
    assert summary.cells_left_per_rank(WORLD, {}, set()) == summary.cells_per_rank  # (nothing trained: the plan)

    skipped = summary.units_to_skip(done, trained_stitched)
    remade = {u for c in untrained_boundary for u in holders[c]}
    assert skipped == done - remade
    if strategy in WITH_BOUNDARY_CELLS:
        assert done & remade  # some units trained through are made again for a boundary cell's pieces
    else:
        assert skipped == done
    produced_again = {u.id for u in units} - skipped
    assert all(u.id in produced_again for u in units if unit_trained.get(u.id, 0) < u.n_cells)
    assert all(holders[c] <= produced_again for c in untrained_boundary)


def test_model_presets_masking_and_flops():
    assert abs(CellTransformer(ModelConfig.preset("scgpt", 62_714)).n_params() / 1e6 - 51.1) < 0.5
    mask = torch.tensor([[True] * 10 + [False] * 6, [True] * 16])
    tokens = torch.randint(4, 100, (2, 16))
    tokens[:, 0] = CLS
    chosen = mask_positions(tokens, mask, 0.4, torch.Generator().manual_seed(0))
    assert not chosen[:, 0].any() and not (chosen & ~mask).any()
    assert chosen.sum(dim=1).tolist() == [round(9 * 0.4), round(15 * 0.4)]
    # a layout without specials (geneformer-v1): every real position may be masked; EOS never is
    bare = torch.randint(4, 100, (2, 16))
    bare[1, 15] = EOS
    chosen = mask_positions(bare, mask, 0.4, torch.Generator().manual_seed(0))
    assert not (chosen & ~mask).any() and not chosen[1, 15]
    assert chosen.sum(dim=1).tolist() == [round(10 * 0.4), round(15 * 0.4)]
    model = CellTransformer(ModelConfig.preset("tiny", 100, n_bins=11))
    batch = Batch(tokens, mask, torch.randint(1, 11, (2, 16)), None, torch.arange(2))
    loss_sum, n, correct = masked_loss(model, batch, 0.4, torch.Generator().manual_seed(0), 11)
    assert n == 10 and loss_sum.item() > 0 and 0 <= correct <= n
    c = ModelConfig.preset("scgpt", 62_714)
    lengths = torch.tensor([1025.0, 1025.0])
    expected = 6 * 12 * (4 * 512**2 + 2 * 512 * 512) * 2050 + 6 * 512 * 51 * 800 + 12 * 12 * 512 * 2 * 1025**2
    assert train_flops(c, lengths, 800) == pytest.approx(expected)


def hidden_batch(objective: str, empty_cell: bool = False) -> tuple[ModelConfig, Batch]:
    """A padded batch of 3 cells for the tiny preset: scGPT's layout (CLS, bins) or Geneformer V1's
    (genes only), optionally with an empty cell (V1 has no token at all for one)."""
    c = ModelConfig.preset("tiny", 100, n_bins=11, objective=objective)
    lengths = torch.tensor([16, 11, 0 if empty_cell else 5])
    mask = torch.arange(16)[None, :] < lengths[:, None]
    tokens = torch.randint(4, 100, (3, 16)).masked_fill(~mask, 0)
    values = None
    if objective == "bins":
        tokens[:, 0] = CLS
        values = torch.randint(1, 11, (3, 16)).masked_fill(~mask, 0)
        values[:, 0] = 0
    return c, Batch(tokens, mask, values, None, torch.arange(3), lengths=lengths)


@pytest.mark.parametrize("objective", ["bins", "genes"])
def test_the_loss_is_the_cross_entropy_at_the_hidden_positions_only(objective):
    """`masked_loss` predicts at a fixed number of positions per cell (hidden first, then filler
    weighed 0): its sum equals the cross-entropy over exactly the hidden positions, computed apart
    from the model's logits at every position; an empty cell changes nothing and nothing is NaN."""
    torch.manual_seed(0)
    for empty in (False, True):
        c, batch = hidden_batch(objective, empty_cell=empty and objective == "genes")
        model = CellTransformer(c)
        loss_sum, n, correct = masked_loss(model, batch, 0.4, torch.Generator().manual_seed(3), 11, c)
        masked = mask_positions(batch.tokens, batch.attention_mask, 0.4, torch.Generator().manual_seed(3))
        every = torch.arange(16).expand(3, 16)
        if objective == "bins":
            logits = model(batch.tokens, batch.values.masked_fill(masked, 11), batch.attention_mask, every)
            truth = batch.values
        else:
            logits = model(batch.tokens.masked_fill(masked, c.mask_token), None, batch.attention_mask, every)
            truth = batch.tokens
        expected = torch.nn.functional.cross_entropy(logits[masked], truth[masked], reduction="sum")
        assert int(n) == int(masked.sum()) > 0 and torch.isfinite(loss_sum)
        assert loss_sum.item() == pytest.approx(expected.item(), rel=1e-5)
        assert int(correct) == int((logits[masked].argmax(-1) == truth[masked]).sum())
        loss_sum.backward()  # every parameter gets a gradient (DDP requires it)
        assert all(p.grad is not None for p in model.parameters())


def test_the_forward_compiles_to_one_graph_with_or_without_padding():
    """No graph break: the padding decision is the host's (`Batch.padded`, from the collate's
    lengths), and the head runs at a fixed number of positions, so no shape depends on the data.
    (Before: 3 graphs, 2 breaks: `bool(attention_mask.all())`, a `.item()`, and the boolean gather
    of the hidden positions, a `nonzero`.)"""
    c, batch = hidden_batch("bins")
    model = CellTransformer(c)
    positions = torch.arange(7).expand(3, 7)
    for padded in (True, False):
        explained = torch._dynamo.explain(model)(batch.tokens, batch.values, batch.attention_mask, positions, padded)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert batch.padded and not Batch(batch.tokens, batch.attention_mask, None, None, batch.cell_ids,
                                      lengths=torch.full((3,), 16)).padded  # fmt: skip


@pytest.mark.parametrize("preset", ["tiny", "scgpt", "base", "large"])
def test_the_flop_formula_is_what_torch_counts_and_leaves_padding_out(preset):
    """`train_flops` against torch's own FLOP counter (`torch.utils.flop_counter`) over a forward
    and backward of each preset and objective, on the meta device (shapes only: the large preset
    needs no memory; there attention decomposes into the matmuls the counter counts, where CPU's
    fused attention kernel is not counted at all). Unpadded, they are equal; padded, torch counts
    the padding's work too and the formula, over real lengths, does not; packed, likewise for the
    attention between cells that the mask discards."""
    from torch.utils.flop_counter import FlopCounterMode

    for objective in ("bins", "genes"):
        c = ModelConfig.preset(preset, 200, n_bins=11, objective=objective)
        with torch.device("meta"):
            model = CellTransformer(c)
            tokens = torch.randint(4, 200, (2, 24))
            bins = torch.randint(1, 11, (2, 24)) if objective == "bins" else None
            positions = torch.arange(10).expand(2, 10)
            mask = torch.ones(2, 24, dtype=torch.bool)
        with FlopCounterMode(display=False) as counted:
            model(tokens, bins, mask, positions, False).float().sum().backward()
        assert train_flops(c, torch.full((2,), 24.0), 20) == counted.get_total_flops(), (preset, objective)
        assert train_flops(c, torch.tensor([24.0, 9.0]), 20) < counted.get_total_flops()  # 15 padded slots
        # packed (cells of 10, 8 and 6 tokens in row 0, 24 in row 1): torch counts each row's whole
        # width and all its pairs (a dense mask); the formula only each cell's own tokens and pairs
        with torch.device("meta"):
            segments = torch.tensor([[0] * 10 + [1] * 8 + [2] * 6, [3] * 24])
        with FlopCounterMode(display=False) as counted:
            model(tokens, bins, mask, positions, False, segments).float().sum().backward()
        assert train_flops(c, torch.full((2,), 24.0), 20) == counted.get_total_flops()
        assert train_flops(c, torch.tensor([10.0, 8.0, 6.0, 24.0]), 20) < counted.get_total_flops()


def test_packing_places_every_cell_whole_best_fit_within_its_row():
    from trainer.packing import MAX_CELLS_PER_ROW, PADDING_SPAN, pack_rows, segments_of, spans_of

    lengths = np.array([6, 5, 4, 3, 2, 0])
    row, start, n_rows = pack_rows(lengths, 10)
    assert n_rows == 2 and row.tolist() == [0, 1, 0, 1, 1, 0]  # 6+4 and 5+3+2 (longest first, fullest row)
    segments = segments_of(lengths, row, start, n_rows, 10)
    assert [int((segments == c).sum()) for c in range(6)] == lengths.tolist()  # each cell whole, nowhere else
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = rng.integers(0, 65, size=rng.integers(1, 200))
        row, start, n_rows = pack_rows(lengths, 64)
        segments = segments_of(lengths, row, start, n_rows, 64)
        assert [int((segments == c).sum()) for c in range(len(lengths))] == lengths.tolist()
        assert ((start + lengths) <= 64).all() and np.bincount(row).max() <= MAX_CELLS_PER_ROW
        used, cells = np.bincount(row, weights=lengths, minlength=n_rows), np.bincount(row, minlength=n_rows)
        # best fit never opens a row while one could take the cell: of rows that could still take a
        # cell, at most one is half full or less (a second one's first cell would have fit the first)
        assert int(((used <= 32) & (cells < MAX_CELLS_PER_ROW)).sum()) <= 1
        # varlen's spans: the flattened rows cut wherever the cell changes, at every row's end, and
        # each row's padding tail in pieces of at most PADDING_SPAN
        bounds, longest = spans_of(lengths, row, start, n_rows, 64)
        flat = segments.ravel()
        cuts = np.flatnonzero(flat[1:] != flat[:-1]) + 1
        tails = [r * 64 + int((segments[r] >= 0).sum()) + np.arange(0, 64, PADDING_SPAN) for r in range(n_rows)]
        expected = np.union1d(np.concatenate([[0, flat.size], cuts, *tails]), np.arange(n_rows + 1) * 64)
        expected = expected[expected <= flat.size]
        assert bounds.dtype == np.int32 and bounds.tolist() == expected.tolist() and longest == np.diff(expected).max()
    # padded rows of 400 (a row per cell, the longest cut to the width): tails in pieces of 128 at most
    bounds, longest = spans_of(np.array([300, 0, 10, 400]), np.arange(4), np.zeros(4, np.int64), 4, 400)
    assert bounds.tolist() == [0, 300, 400, 528, 656, 784, 800, 810, 938, 1066, 1194, 1200, 1600] and longest == 400
    assert pack_rows(np.zeros(3, np.int64), 64)[2] == 1  # every cell empty: one row, all padding
    with pytest.raises(CellfeedError, match="a cell of 65 tokens does not fit a row of 64"):
        pack_rows(np.array([65]), 64)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # (CPU: the reference form)
@pytest.mark.parametrize("objective", ["bins", "genes"])
def test_a_packed_batch_gives_each_cell_the_logits_and_loss_it_has_unpacked(objective):
    """The same cells collated padded (a row each) and packed (rows of 48 tokens): every real
    position's logits agree (fp32, 1e-5), and so do the loss, the hidden count and the correct
    predictions at the same hidden positions, for scGPT's layout (CLS, bins) and Geneformer V1's
    (genes only, an empty cell among them); FlexAttention's block mask gives the dense mask's logits.
    Masking a packed batch hides round(0.4 x genes), at least 1, of each cell, as unpacked."""
    from types import SimpleNamespace

    from trainer.model import loss_at
    from trainer.stream import collate

    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    bins = objective == "bins"
    lengths = [17, 3, 30, 9, 1, 24, 12] + ([] if bins else [0])
    cells = []
    for c, n in enumerate(lengths):
        tokens = rng.integers(4, 100, size=n)
        values = rng.integers(1, 11, size=n)
        if bins and n:
            tokens[0], values[0] = CLS, 0
        cells.append(SimpleNamespace(offsets=np.array([0, n]), tokens=tokens, values=values if bins else None,
                                     labels=None, cell_ids=np.array([c])))  # fmt: skip
    chosen = [(cell, 0) for cell in cells]
    flat, packed = collate(chosen, None, False), collate(chosen, None, False, tokens_per_row=48)
    assert packed.tokens.shape[0] < flat.tokens.shape[0] and packed.tokens.shape[1] == 48 and packed.size == len(cells)
    c = ModelConfig.preset("tiny", 100, n_bins=11, objective=objective)
    model = CellTransformer(c)
    hidden = mask_positions(flat.tokens, flat.attention_mask, 0.4, torch.Generator().manual_seed(2), c.special_tokens)
    where = [(packed.segments == i).nonzero() for i in range(len(cells))]  # (row, column) of each cell's tokens
    moved = torch.zeros_like(packed.attention_mask)
    for i, at in enumerate(where):
        moved[at[:, 0], at[:, 1]] = hidden[i, : len(at)]

    def logits(batch, masked):
        every = torch.arange(batch.tokens.shape[1]).expand(batch.tokens.shape[0], -1)
        tokens = batch.tokens if bins else batch.tokens.masked_fill(masked, c.mask_token)
        values = batch.values.masked_fill(masked, 11) if bins else None
        return model(tokens, values, batch.attention_mask, every, True, batch.segments, batch.spans)

    flat_logits, packed_logits = logits(flat, hidden), logits(packed, moved)
    for i, at in enumerate(where):
        torch.testing.assert_close(packed_logits[at[:, 0], at[:, 1]], flat_logits[i, : len(at)], rtol=1e-5, atol=1e-5)
    dense = model
    model = CellTransformer(replace(c, packed_attention="flex"))  # FlexAttention's block mask: the same logits
    model.load_state_dict(dense.state_dict())
    with torch.no_grad():  # (FlexAttention has no backward on CPU: forward only here)
        torch.testing.assert_close(logits(packed, moved)[packed.attention_mask], packed_logits[packed.attention_mask])
    from trainer.model import attention_on

    cpu = torch.device("cpu")
    assert attention_on("auto", cpu) == "dense" and attention_on("varlen", cpu) == "varlen"
    with pytest.raises(ValueError, match="packed_attention 'sparse': choose auto or one of dense, flex, varlen"):
        attention_on("sparse", cpu)
    with pytest.raises(ValueError, match="attention dropout is the dense path's only"):
        CellTransformer(replace(c, packed_attention="varlen", dropout=0.1))  # (varlen's kernel takes none)
    model = CellTransformer(replace(c, packed_attention="varlen"))  # each cell a sequence: the same logits,
    model.load_state_dict(dense.state_dict())  # packed, and padded (a row's padding is a sequence of its own)
    torch.testing.assert_close(logits(packed, moved)[packed.attention_mask], packed_logits[packed.attention_mask])
    torch.testing.assert_close(logits(flat, hidden)[flat.attention_mask], flat_logits[flat.attention_mask])
    model = dense
    a, b = loss_at(model, flat, hidden, 11, c, 0.4), loss_at(model, packed, moved, 11, c, 0.4)
    assert b[0].item() == pytest.approx(a[0].item(), rel=1e-5) and (int(b[1]), int(b[2])) == (int(a[1]), int(a[2]))
    chosen_packed = mask_positions(packed.tokens, packed.attention_mask, 0.4, torch.Generator().manual_seed(5),
                                   c.special_tokens, packed.segments)  # fmt: skip
    for i, (n, at) in enumerate(zip(lengths, where)):
        genes = n - (1 if bins and n else 0)
        expected = min(genes, max(1, round(genes * 0.4)))
        assert int(chosen_packed[at[:, 0], at[:, 1]].sum()) == expected, i
    positions = torch.arange(9).expand(packed.tokens.shape[0], 9)
    explained = torch._dynamo.explain(model)(packed.tokens, packed.values, packed.attention_mask, positions, True,
                                             packed.segments)  # fmt: skip
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    if not bins:  # 20 empty cells and one of 3 tokens in a row of 4: more cells than positions
        few = [(SimpleNamespace(offsets=np.array([0, 0]), tokens=np.zeros(0, np.int64), values=None, labels=None,
                                cell_ids=np.array([c])), 0) for c in range(20)]  # fmt: skip
        few.append((cells[1], 0))
        small = collate(few, None, False, tokens_per_row=4)
        assert small.tokens.shape == (1, 4) and small.size == 21
        loss_sum, n, _ = masked_loss(model, small, 0.4, torch.Generator().manual_seed(0), 11, c)
        assert int(n) == 1 and torch.isfinite(loss_sum)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's varlen kernel runs on CUDA only")
def test_on_cuda_varlen_attention_trains_packed_cells_as_the_dense_mask_does():
    """On a GPU, under bf16 autocast: flash attention's varlen kernel gives packed cells the logits
    and the gradients the dense per-cell mask gives them (bf16's tolerance)."""
    from types import SimpleNamespace

    from trainer.stream import collate

    torch.manual_seed(0)
    rng = np.random.default_rng(3)
    cells = [
        SimpleNamespace(offsets=np.array([0, n]), tokens=rng.integers(4, 100, size=n),
                        values=rng.integers(1, 11, size=n), labels=None, cell_ids=np.array([c]))
        for c, n in enumerate(rng.integers(0, 300, 40))
    ]  # fmt: skip
    batch = collate([(cell, 0) for cell in cells], None, False, tokens_per_row=512).to(torch.device("cuda"))
    every = torch.arange(512, device="cuda").expand(batch.tokens.shape[0], -1)
    c = ModelConfig.preset("tiny", 100, n_bins=11)
    out = {}
    for attention in ("dense", "varlen"):
        torch.manual_seed(0)
        model = CellTransformer(replace(c, packed_attention=attention)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(batch.tokens, batch.values, batch.attention_mask, every, True, batch.segments, batch.spans)
        logits = logits.float()[batch.attention_mask]
        logits.square().mean().backward()
        out[attention] = logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(out["varlen"][0], out["dense"][0], rtol=2e-2, atol=2e-2)
    assert torch.nn.functional.cosine_similarity(out["varlen"][1], out["dense"][1], dim=0) > 0.999


@pytest.fixture
def single_rank(monkeypatch):
    """This process as rank 0 of a world of 1 (torch.distributed reads these)."""
    from coordination.net import free_port

    for name, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("batch, max_steps", [(16, 5), (24, None)], ids=["5-steps", "epoch-of-125-batches"])
def test_gradient_accumulation_counts_every_batch_of_a_step(atlas, tmp_path, single_rank, batch, max_steps):
    """One rank in this process: with grad_accum 2, each logged step holds two batches' cells. An epoch
    of an odd number of batches (3,000 cells in 125 of 24) ends on a whole step, its last batch with an
    empty one: every cell is in a logged step (a half step left its batch's gradients to no step)."""
    import torch.distributed as dist

    from coordination.queues import MemoryMap, MemoryQueue
    from coordination.routing import TASKS_PARTITION, encode_task
    from trainer.train import train

    queue, store = MemoryQueue(), MemoryMap()
    config = ProducerConfig(
        dataset=atlas.uri,
        run="accum",
        world_size=1,
        max_genes=16,
        idle_timeout_s=0.2,
        sampling=Sampling("block", block_size=8, fetch_factor=4, batch_size=16),
    )
    producer = Producer(config, queue, store, dataset=atlas)
    publish_summary(store, "accum", PlanSummary.of(producer.plan(0), 1))
    queue.put_many([encode_task(0, u) for u in range(producer.plan(0).n_units)], partition=TASKS_PARTITION)
    producer.run()
    cfg = TrainConfig(
        run="accum",
        backend={"kind": "memory"},
        vocab_size=producer.vocab.size,
        batch_size=batch,
        grad_accum=2,
        max_steps=max_steps,
        run_driver=False,
        progress_bar=False,
        log_path=str(tmp_path / "steps.jsonl"),
    )
    try:
        summary = train(cfg, queue=queue, store=store)
    finally:
        dist.destroy_process_group()
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    cells = [r["cells"] for r in rows if "loss" in r]  # (step rows; the audit's has none)
    if max_steps:
        assert summary["steps"] == 5 and cells == [32] * 5
    else:
        assert summary["complete"] and summary["steps"] == 63  # ceil(125 / 2)
        assert cells == [48] * 62 + [24] and sum(cells) == atlas.n_cells


def test_checkpoints_keep_the_last_k_and_the_best(tmp_path):
    from trainer import checkpoint

    losses = {1: 5.0, 2: 1.0, 3: 3.0, 4: None, 5: 2.5}  # step -> held-out loss when it was written (4: none yet)
    for step, loss in losses.items():
        checkpoint.save(
            tmp_path,
            step,
            0,
            0,
            1,
            checkpoint.RankProgress(),
            lambda: {"w": torch.zeros(1)},
            lambda text: [text],
            lambda: None,
            keep=2,
            eval_loss=loss,
        )
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000004", "step-00000005"]
    assert checkpoint.latest(tmp_path).step == 5 and checkpoint.load(tmp_path, torch.device("cpu")).step == 5
    assert checkpoint.prune(tmp_path, keep=1) == ["step-00000004"]  # the best (2) stays with the last


def test_a_resume_passes_over_a_latest_checkpoint_that_is_not_whole(tmp_path):
    """A Volume commit that copies file by file beside the ranks can carry `latest` naming a checkpoint whose
    files it did not copy (seen: `latest` -> step-00000024, an empty folder). A resume continues from the
    newest whole one and says so; with none whole it is refused in one line, never started from scratch."""
    from trainer import checkpoint

    two = lambda text: [text, text]  # noqa: E731  (two ranks' progress)
    for step in (4, 8, 12):
        progress = checkpoint.RankProgress(trained=step)
        checkpoint.save(tmp_path, step, 0, 0, 2, progress, lambda: {"w": torch.zeros(1)}, two, lambda: None, keep=3)
    cpu = torch.device("cpu")
    assert (checkpoint.latest(tmp_path).step, checkpoint.latest(tmp_path).passed_over) == (12, "")
    (tmp_path / "step-00000012" / "state.pt").unlink()  # the newest: no state
    (tmp_path / "step-00000008" / "progress-rank1.json").unlink()  # the next: a rank's progress missing
    latest = checkpoint.latest(tmp_path)
    assert (latest.step, latest.trained) == (4, [4, 4])
    assert latest.passed_over == "the latest checkpoint, step-00000012, is incomplete: resuming from step-00000004"
    assert checkpoint.load(tmp_path, cpu).step == 4 and [r.trained for r in checkpoint.load(tmp_path, cpu).ranks] == [
        4,
        4,
    ]
    (tmp_path / "step-00000004" / "meta.json").unlink()
    with pytest.raises(CellfeedError, match="step-00000012, is incomplete and no earlier one is whole"):
        checkpoint.load(tmp_path, cpu)


@pytest.mark.parametrize("tamper", [False, True])
def test_end_of_epoch_audit_passes_exactly_or_fails_loudly(atlas, tmp_path, single_rank, tamper):
    """A whole epoch ends with the count and cell-id hash check; cells other than the plan's
    (here: a plan whose hash was changed) fail the run with one line naming the rank."""
    import torch.distributed as dist

    from coordination.queues import MemoryMap, MemoryQueue
    from coordination.routing import TASKS_PARTITION, encode_task, epoch_map_name
    from trainer.train import train

    queue, store = MemoryQueue(), MemoryMap()
    config = ProducerConfig(
        dataset=atlas.uri,
        run="audit",
        world_size=1,
        max_genes=16,
        idle_timeout_s=0.2,
        sampling=Sampling("sequential", unit_cells=100),
    )
    producer = Producer(config, queue, store, dataset=atlas)
    plan = producer.plan(0)
    summary = PlanSummary.of(plan, 1)
    assert len(plan.boundary_cells) > 0  # stitched cells are audited too
    if tamper:
        summary.cell_hash_per_rank = [(summary.cell_hash_per_rank[0] + 1) % 2**64]
    publish_summary(store, "audit", summary)
    store.named(epoch_map_name(0), create=True)  # what the driver does first: the epoch's stitching map
    queue.put_many([encode_task(0, u) for u in range(plan.n_units)], partition=TASKS_PARTITION)
    producer.run()
    cfg = TrainConfig(
        run="audit",
        backend={"kind": "memory"},
        vocab_size=producer.vocab.size,
        batch_size=64,
        epochs=1,
        run_driver=False,
        progress_bar=False,
        no_data_timeout_s=20,
    )
    try:
        if tamper:
            with pytest.raises(
                CellfeedError,
                match="epoch 0 failed its exactly-once audit: rank 0 trained the "
                "planned number of cells, but not the planned cells",
            ):
                train(cfg, queue=queue, store=store)
        else:
            result = train(cfg, queue=queue, store=store)
            (audit,) = result["audits"]
            assert audit["audited"] and audit["cells"] == atlas.n_cells
            assert audit["line"].startswith(f"epoch 0: {atlas.n_cells:,} cells trained, 0 missing, 0 duplicated")
    finally:
        dist.destroy_process_group()


def test_a_resume_under_another_gene_vocabulary_is_refused_in_one_line():
    """A checkpoint records its vocabulary's fingerprint (in its config): token ids of another
    vocabulary mean other genes, so such a resume stops before loading a weight."""
    from dataclasses import asdict

    from trainer.checkpoint import Checkpoint, RankProgress
    from trainer.resume import check_resume

    cfg = TrainConfig(run="v", backend={"kind": "memory"}, vocab_size=100, vocab_fingerprint="aaaa")
    saved = Checkpoint(
        10,
        0,
        {"config": json.dumps(asdict(TrainConfig(**{**asdict(cfg), "vocab_fingerprint": "bbbb"})))},
        [RankProgress()],
    )
    with pytest.raises(
        CellfeedError,
        match=r"^--resume: the checkpoint at step 10 was trained on another gene "
        r"vocabulary \(bbbb, this campaign's aaaa\)",
    ) as err:
        check_resume(saved, cfg, model=None, store=None)
    assert "\n" not in str(err.value)


def test_a_checkpoint_of_an_unfused_optimizer_resumes_fused_and_steps_the_same():
    """A checkpoint written by an unfused AdamW (before it was fused on CPU) resumes into this run's
    fused one: torch's `load_state_dict` would take the saved groups' `fused=False`, so the run would
    go on unfused. The resumed step equals the unfused optimizer's own next step."""
    import copy

    from trainer.resume import load_optimizer

    torch.manual_seed(0)
    weights = torch.randn(64, 8)
    grads = [torch.randn(64, 8) for _ in range(3)]

    def stepped(optimizer, param, gs):
        for g in gs:
            param.grad = g.clone()
            optimizer.step()

    old = torch.nn.Parameter(weights.clone())
    unfused = torch.optim.AdamW([old], lr=1e-2, fused=False)
    stepped(unfused, old, grads[:2])
    saved = copy.deepcopy(unfused.state_dict())  # (as read from a file: no tensor shared with `unfused`)

    new = torch.nn.Parameter(old.detach().clone())
    fused = torch.optim.AdamW([new], lr=1e-2, fused=True)
    load_optimizer(fused, saved)
    assert fused.param_groups[0]["fused"] is True and saved["param_groups"][0]["fused"] is False
    assert fused.state[new]["step"].dtype == torch.float32 and fused.state[new]["step"].item() == 2
    stepped(fused, new, grads[2:])
    stepped(unfused, old, grads[2:])
    assert torch.allclose(new, old, rtol=0, atol=1e-6), (new - old).abs().max()


@pytest.mark.token_pass_free
def test_a_held_out_set_that_cannot_be_put_back_is_one_error_not_a_hang():
    """The trainer pops the held-out set and puts it back for a later attempt; a partition still full
    after the data timeout (someone else's items in the room it made) is an error naming it, not a
    wait for ever (the put had no timeout)."""
    from coordination.arrays import CellRows
    from coordination.queues import Full
    from coordination.routing import EVAL_PARTITION, run_tag
    from coordination.wire import pack_items
    from trainer.evaluation import load_held_out

    rows = CellRows(
        np.arange(4), np.arange(0, 25, 5, dtype=np.int64), np.arange(20, dtype=np.uint32), np.ones(20, np.float32)
    )
    cfg = TrainConfig(
        run="held", backend={"kind": "memory"}, vocab_size=64, eval_cells=4, no_data_timeout_s=3, pad_to=8
    )

    class FullAfterItsPops(MemoryQueue):  # (a queue whose eval partition is refilled by another as it is emptied)
        def put_many(self, values, block=True, timeout=None, *, partition=None):
            assert partition == EVAL_PARTITION and timeout == cfg.no_data_timeout_s  # (a bounded wait)
            raise Full

    queue = FullAfterItsPops()
    MemoryQueue.put_many(queue, pack_items(rows, epoch=0, key_id=0, run_tag=run_tag("held")), partition=EVAL_PARTITION)
    with pytest.raises(
        CellfeedError, match=r"^the held-out set could not be put back in 3s: its partition stayed full$"
    ):
        load_held_out(queue, cfg, torch.device("cpu"))
