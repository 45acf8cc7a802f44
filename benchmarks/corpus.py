"""Pretraining on a corpus: three sources over one gene vocabulary, weights 0.6 / 0.3 / 0.1, two
epochs through the real pipeline (`cellfeed local --corpus`: queue server, producer processes,
DDP ranks on gloo), and the pieces around it:

- a synthetic Tahoe-like atlas (Ensembl-like ids), a second synthetic atlas whose gene set
  overlaps the first's by 70% and is stored in another order, and the real PBMC file (700 cells,
  gene symbols, log-normalised floats); the vocabulary is built from the three (their union);
- per epoch, cells planned and trained per source (from `--audit-cells`), and each batch's source
  shares (mean and sd per source beside the binomial expectation of a batch drawn by weight);
- tokens: a sample of every source's cells tokenized by the producer against an independent
  per-cell computation of scGPT's rule (vocabulary lookup by identifier, genes outside dropped,
  value descending / token ascending, bins by the cell's quantiles): cells that differ;
- producer throughput on the corpus against one source of the same epoch size (the first atlas,
  same strategy, units of the default 64 x 240 cells, under the corpus's vocabulary: only the
  mixing differs), in one run, alternating, units processed in-process; and that source under
  the corpus's vocabulary against under its own (a vocabulary past 65,536 ids has wider tokens);
- setup at scale: the plan summary of a 3-source geometry of 100M + 49M + 1M cells (no data), in
  a fresh process: seconds and peak RSS.

    python benchmarks/corpus.py            # 40k + 20k-cell atlases (62,710 genes) + PBMC
    python benchmarks/corpus.py --quick    # 8k + 4k cells, within 2 minutes on 2 cores
    python benchmarks/corpus.py --tiny     # 1.2k + 600 cells x 2,000 genes, no 150M probe (the test suite's)

Ends with one JSON line of the figures. Exits 1 (one line on stderr) when the campaign did not
finish, an epoch trained other cells than planned, or a figure is missing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._checks import check_figures, fail, machine, run_probe  # noqa: E402
from benchmarks.chaos import trained_per_epoch  # noqa: E402
from coordination.corpus import source_of  # noqa: E402
from coordination.plan import Sampling  # noqa: E402
from coordination.queues import MemoryMap, MemoryQueue  # noqa: E402
from coordination.routing import EVAL_PARTITION  # noqa: E402
from coordination.wire import unpack_item  # noqa: E402

WEIGHTS = (0.6, 0.3, 0.1)
PBMC = ROOT / "tests" / "data" / "pbmc68k_reduced.h5ad"
OVERLAP = 0.7
MAX_GENES, N_BINS, BATCH = 64, 51, 64


def build_sources(root: Path, n_a: int, n_b: int, n_genes: int) -> list[Path]:
    """The two synthetic atlases (the second: 70% of the first's genes and new ones, reordered) and
    PBMC's raw.X, written once under `root`."""
    from producers.convert import convert
    from producers.synth import SynthSpec, synthesize

    a, b, pbmc = root / "atlas_a", root / "atlas_b", root / "pbmc"
    root.mkdir(parents=True, exist_ok=True)
    if not (a / "config.json").exists():
        synthesize(
            str(a),
            SynthSpec(n_cells=n_a, n_genes=n_genes, seed=21),
            rows_per_fragment=1 << 20,
            progress=False,
            overwrite=True,
        )
    if not (b / "config.json").exists():
        rng = np.random.default_rng(22)
        ids = [f"ENSG{g:011d}" for g in range(n_genes)]
        shared = list(rng.choice(ids, size=round(OVERLAP * n_genes), replace=False))
        new = [f"ENSG9{g:010d}" for g in range(n_genes - len(shared))]
        synthesize(
            str(b),
            SynthSpec(n_cells=n_b, n_genes=n_genes, seed=23),
            rows_per_fragment=1 << 20,
            progress=False,
            overwrite=True,
            gene_ids=list(rng.permutation(shared + new)),
        )
    if not (pbmc / "config.json").exists():
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            convert([str(PBMC)], str(pbmc), layer="raw.X", progress=False, overwrite=True)
    return [a, b, pbmc]


def corpus_file(path: Path, sources: list[Path], epoch_cells: int | None = None) -> Path:
    lines = [f"epoch_cells = {epoch_cells}"] if epoch_cells else []
    for src, w in zip(sources, WEIGHTS):
        lines += ["", "[[source]]", f'name = "{src.name}"', f'dataset = "{src}"', f"weight = {w}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def campaign(corpus: Path, work: Path, epochs: int, timeout_s: float) -> tuple[dict, float, str]:
    """The real local campaign: (trained cells per epoch, wall seconds, stdout)."""
    t = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "local",
            "--corpus",
            str(corpus),
            "--workdir",
            str(work),
            "--run",
            "corpus",
            "--epochs",
            str(epochs),
            "--max-genes",
            str(MAX_GENES),
            "--batch-size",
            str(BATCH),
            "--audit-cells",
            "--quiet",
            "--eval-every",
            "1000000",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if out.returncode != 0:
        print(out.stdout[-3000:] + out.stderr[-3000:], file=sys.stderr)
        fail(f"the corpus campaign failed (exit {out.returncode})")
    return trained_per_epoch(work / "corpus"), time.perf_counter() - t, out.stdout


def batch_shares(run_dir: Path, offsets: list[int]) -> np.ndarray:
    """[batches, sources]: each full batch's share of cells from each source."""
    rows = []
    for log in sorted(run_dir.glob("cells.rank*.jsonl")):
        for line in log.read_text().splitlines():
            cells = json.loads(line)["cells"]
            if len(cells) == BATCH:  # a rank's last, partial batches say nothing about mixing
                rows.append(np.bincount(source_of(cells, offsets), minlength=len(offsets)) / BATCH)
    return np.array(rows)


def reference_scgpt(genes: list[str], vocab, values: np.ndarray, ids: list[str]) -> tuple[list[int], list[int]]:
    """scGPT's rule for one cell, written out: the identifiers' vocabulary ids, genes outside
    dropped, bins by np.quantile/np.digitize over the kept values (ties at the midpoint), genes
    by value descending then token ascending, the first MAX_GENES after CLS."""
    kept = [(float(v), vocab.ids[g]) for g, v in zip(genes, values) if g in vocab.ids]
    if not kept:
        return [vocab.special("cls")], [0]
    vals = np.array([v for v, _ in kept], dtype=np.float32)
    edges = np.quantile(vals, np.linspace(0, 1, N_BINS - 1))
    bins = np.ceil((np.digitize(vals, edges) + np.digitize(vals, edges, right=True)) / 2).astype(int)
    by_token = dict(zip((t for _, t in kept), bins.tolist()))
    ranked = sorted(kept, key=lambda vt: (-vt[0], vt[1]))[:MAX_GENES]
    return [vocab.special("cls")] + [t for _, t in ranked], [0] + [by_token[t] for _, t in ranked]


def token_mismatches(corpus: Path, per_source: int) -> tuple[int, int]:
    """(cells that differ from the reference, cells compared): `per_source` cells of each source
    through the producer (its held-out path: the same mapping, tokenizer and packing)."""
    from producers.config import ProducerConfig
    from producers.held_out import produce_held_out
    from producers.producer import Producer

    producer = Producer(
        ProducerConfig(dataset="", corpus=str(corpus), run="tokens", max_genes=MAX_GENES, threads=1),
        MemoryQueue(),
        MemoryMap(),
    )
    rng = np.random.default_rng(0)
    chosen = np.concatenate(
        [
            s.offset + np.sort(rng.choice(s.ds.n_cells, size=min(per_source, s.ds.n_cells), replace=False))
            for s in producer.sources
        ]
    )
    queue = MemoryQueue()
    producer.queue = producer.courier.queue = queue
    produce_held_out(producer, chosen)
    got = {}
    for data in queue.get_many(10**6, block=False, partition=EVAL_PARTITION):
        item = unpack_item(data)
        for i, cell in enumerate(item.cell_ids.tolist()):
            a, b = item.offsets[i], item.offsets[i + 1]
            got[cell] = (item.tokens[a:b].tolist(), item.values[a:b].tolist())
    differ = 0
    for s in producer.sources:
        mine = chosen[(chosen >= s.offset) & (chosen < s.offset + s.ds.n_cells)] - s.offset
        cells = s.ds.read_cells(mine)
        for i, c in enumerate(mine.tolist()):
            rows = slice(cells.offsets[i], cells.offsets[i + 1])
            expected = reference_scgpt(
                [s.identifiers[g] for g in cells.ids[rows]], producer.vocab, cells.values[rows], s.identifiers
            )
            differ += got.get(c + s.offset) != expected
    return int(differ), len(chosen)


def producer_rate(
    corpus: Path | None, dataset: Path | None, min_cells: int, vocabulary: Path | None = None
) -> tuple[float, float]:
    """(cells/s, non-zeros/s) of one producer (2 tokenizing threads) processing units in-process,
    epoch after epoch, until `min_cells`: the work a producer process does, its rows read first
    (not timed: the same reads either way) and its items dropped."""
    from producers.config import ProducerConfig
    from producers.producer import Producer

    # units as a campaign's default (64 batches of 240 cells), not shrunk for a small atlas (min_units):
    # a unit's fixed costs weigh as they do at scale
    sampling = Sampling("block", batch_size=240, min_units=1)
    config = ProducerConfig(
        dataset=str(dataset or ""),
        corpus=str(corpus) if corpus else None,
        run="rate",
        max_genes=MAX_GENES,
        threads=2,
        sampling=sampling,
        vocabulary=str(vocabulary) if vocabulary else None,
    )
    producer = Producer(config, MemoryQueue(), MemoryMap())
    cells = rows = 0
    seconds = 0.0
    epoch = 0
    while cells < min_cells:
        for u in range(producer.plan(epoch).n_units):
            taken = producer.read(epoch, u)  # (unit, its cells per part, its pieces)
            unit = taken[0]
            t = time.perf_counter()
            producer.process(epoch, u, taken)
            seconds += time.perf_counter() - t
            producer.queue = producer.courier.queue = MemoryQueue()  # drop the items
            cells += unit.n_cells
            rows += sum(len(part.ids) for part in taken[1])
            if cells >= min_cells:
                break
        epoch += 1
    return cells / seconds, rows / seconds


def setup_probe() -> dict:
    """The setup's plan summary of a 100M + 49M + 1M-cell corpus geometry, in a fresh process."""
    code = f"""
import json, resource, sys, time
sys.path.insert(0, {str(ROOT)!r})
from benchmarks._checks import peak_rss_mb
t = time.perf_counter()
from benchmarks.coordination import tahoe_geometry
from coordination.corpus_file import quotas
from coordination.corpus import CorpusPlan, CorpusSource
from coordination.plan import Sampling
from coordination.summary import PlanSummary
sizes = (100_000_000, 49_000_000, 1_000_000)
sources, offset = [], 0
for i, n in enumerate(sizes):
    sources.append(CorpusSource(tahoe_geometry(n, seed=i), None, offset))
    offset += n
plan = CorpusPlan(sources, quotas({list(WEIGHTS)}, sum(sizes)), Sampling("block", batch_size=240), seed=0, epoch=1)
summary = PlanSummary.of(plan, 8)
assert sum(summary.cells_per_rank) == sum(sizes)
print(json.dumps({{"seconds": time.perf_counter() - t, "units": plan.n_units,
                  "rss_mb": peak_rss_mb()}}))
"""
    return run_probe(code, "the 150M-cell setup probe", timeout_s=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8k + 4k-cell atlases: within 2 minutes on 2 cores")
    parser.add_argument("--tiny", action="store_true", help="1.2k + 600 cells x 2,000 genes, no 150M probe (tests)")
    parser.add_argument("--epochs", type=int, default=2, help="campaign epochs")
    args = parser.parse_args()
    n_a, n_b, n_genes = (
        (1200, 600, 2000) if args.tiny else (8000, 4000, 62_710) if args.quick else (40_000, 20_000, 62_710)
    )
    work = Path(tempfile.mkdtemp(prefix="cellfeed-corpus-"))
    # the atlases are kept between runs (in the temp dir), but for the tiny run's (the test suite's)
    cache = (
        work / "sources" if args.tiny else Path(tempfile.gettempdir()) / f"cellfeed-bench-corpus-{n_a}-{n_b}-{n_genes}"
    )
    t0 = time.perf_counter()
    try:
        sources = build_sources(cache, n_a, n_b, n_genes)
        corpus = corpus_file(work / "corpus.toml", sources)
        from producers.config import ProducerConfig
        from producers.producer import Producer
        from producers.sources import coverage

        planner = Producer(
            ProducerConfig(dataset="", corpus=str(corpus), run="corpus", world_size=2), MemoryQueue(), MemoryMap()
        )
        offsets = [s.offset for s in planner.sources]
        names = [s.spec.name for s in planner.sources]
        vocab_coverage = {
            c.source: {"genes": c.genes, "genes_matched": c.genes_matched, "nonzeros_kept": round(c.nonzeros_kept, 4)}
            for c in map(coverage, planner.sources)
        }
        planned = [planner.plan(e).quotas.tolist() for e in range(args.epochs)]
        planned_cells = [
            Counter(
                np.concatenate(
                    [
                        planner.plan(e).unit_cells(u, s) + offsets[s]
                        for u in range(planner.plan(e).n_units)
                        for s in range(3)
                    ]
                ).tolist()
            )
            for e in range(args.epochs)
        ]

        trained, wall_s, stdout = campaign(corpus, work / "run", args.epochs, timeout_s=600)
        per_source_trained, off = [], 0
        for e in range(args.epochs):
            got = trained.get(e, Counter())
            per_source_trained.append(np.bincount(source_of(list(got.elements()), offsets), minlength=3).tolist())
            off += sum(((planned_cells[e] - got) + (got - planned_cells[e])).values())
        shares = batch_shares(work / "run" / "corpus", offsets)
        binomial_sd = [float(np.sqrt(w * (1 - w) / BATCH)) for w in WEIGHTS]
        share = {
            n: {
                "weight": w,
                "mean": round(float(shares[:, i].mean()), 4),
                "sd": round(float(shares[:, i].std()), 4),
                "binomial_sd": round(binomial_sd[i], 4),
            }
            for i, (n, w) in enumerate(zip(names, WEIGHTS))
        }

        differ, compared = token_mismatches(corpus, 60 if args.tiny else 200)

        same_size = corpus_file(work / "same-size.toml", sources, epoch_cells=n_a)  # one epoch as large as atlas_a's
        vocab_file = work / "corpus-vocab.json"  # the one source under the corpus's vocabulary: only mixing differs
        vocab_file.write_text(json.dumps(planner.vocab.ids))
        budget = 2_000 if args.tiny else 16_000 if args.quick else 40_000
        ratios = []
        for _ in range(1 if args.tiny else 3 if args.quick else 5):  # alternating triples, the median reported
            own = producer_rate(None, sources[0], budget)
            single = producer_rate(None, sources[0], budget, vocab_file)
            mixed = producer_rate(same_size, None, budget)
            ratios.append((mixed[0] / single[0], mixed[1] / single[1], single, mixed, single[0] / own[0]))
        ratios.sort(key=lambda r: r[0])
        cells_ratio, rows_ratio, single, mixed, vocab_ratio = ratios[len(ratios) // 2]

        probe = None if args.tiny else setup_probe()
    finally:
        if args.tiny:
            shutil.rmtree(work, ignore_errors=True)
    figures = {
        "machine": machine(),
        "sources": {n: s for n, s in zip(names, (n_a, n_b, 700))},
        "epochs": args.epochs,
        "per_source_planned": planned,
        "per_source_trained": per_source_trained,
        "cells_off_plan": off,
        "source_share_per_batch": share,
        "batches": len(shares),
        "token_mismatches": differ,
        "cells_compared": compared,
        "vocab_coverage": vocab_coverage,
        "vocab_genes": planner.vocab.n_genes,
        "throughput_vs_single_source": round(cells_ratio, 3),  # cells/s: what the trainer receives
        "throughput_nonzeros_vs_single_source": round(rows_ratio, 3),  # work: PBMC's cells are smaller
        "single_source_corpus_vocab_vs_own_vocab": round(vocab_ratio, 3),  # token ids past 16 bits cost this
        "single_source_cells_s": round(single[0]),
        "corpus_cells_s": round(mixed[0]),
        "campaign_wall_s": round(wall_s, 1),
        "setup_s_corpus_150m": None if probe is None else round(probe["seconds"], 1),
        "setup_rss_mb_corpus_150m": None if probe is None else round(probe["rss_mb"]),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    sources = zip(figures["sources"].items(), WEIGHTS)
    print(
        f"corpus of {', '.join(f'{n} ({c:,} cells, weight {w})' for (n, c), w in sources)}"
        f"; vocabulary {planner.vocab.n_genes:,} genes"
    )
    for e in range(args.epochs):
        print(f"  epoch {e}: planned {planned[e]}, trained {per_source_trained[e]}")
    for n, s in share.items():
        print(
            f"  {n:<8} share per batch {s['mean']:.3f} ± {s['sd']:.3f} (weight {s['weight']}, binomial sd "
            f"{s['binomial_sd']:.3f}) over {len(shares)} batches of {BATCH}"
        )
    print(f"  tokens: {differ} of {compared} sampled cells differ from the reference")
    print(
        f"  producer throughput, corpus / one source of the same epoch size and vocabulary: {cells_ratio:.3f} in "
        f"cells/s, {rows_ratio:.3f} in non-zeros/s (median of {len(ratios)}); that one source under the corpus's "
        f"{planner.vocab.size:,}-token vocabulary / under its own: {vocab_ratio:.3f}"
    )
    if probe:
        print(f"  setup at 100M + 49M + 1M cells: {probe['seconds']:.1f} s, {probe['rss_mb']:,.0f} MB RSS")
    print(json.dumps(figures))
    if off:
        fail(f"{off} cells trained off the plan")
    if differ:
        fail(f"{differ} sampled cells' tokens differ from the reference")
    check_figures(figures, allow_none=("setup_s_corpus_150m", "setup_rss_mb_corpus_150m") if args.tiny else ())


if __name__ == "__main__":
    main()
