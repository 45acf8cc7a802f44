"""How random are the batches a trainer sees, and does it matter downstream? Through the real
pipeline (plan → producer → items → consumer stream with its mixing buffer), for each sampling
strategy:

- the plate-label entropy of each batch (mean ± sd, beside batches drawn truly at random from
  the same cells, and beside scDataset's bounds for block sampling) and the index score (mean
  |i - j| over pairs of a batch's cells, i and j their positions in storage: 0 sequential,
  1 uniform random); `cellfeed_testing/sampling_quality.py` defines them;
- downstream parity (sequential, random, the defaults and scDataset's b=16 f=256): a linear
  probe of cell line and dose trained for one epoch on the stream, macro-F1 on a held-out plate,
  two seeds, and its convergence (`benchmarks/downstream.py`);
- each setting's producer throughput (`benchmarks/producer.py`'s loop, local disk).

    python benchmarks/randomness.py            # 200k-cell atlas (14 plates), batch 64, 20 settings
    python benchmarks/randomness.py --quick    # 15k-cell atlas, the 5 parity settings, one seed (a minute)
    (the PNGs go to runs/bench/, git-ignored; --png benchmarks/randomness.png redraws the README's)
    python benchmarks/randomness.py --tiny     # as --quick on 1k cells x 3k genes, the PNGs in a temp dir (tests)

Every epoch holds out plate14 (the probe's test plate), so batches come from 13 plates stored in
order: sequential batches see one plate (entropy ~0 bits), truly random batches of 64 most of
them. Draws two PNGs (score vs throughput; macro-F1 vs cells seen) with matplotlib, the `bench`
extra (`pip install -e ".[bench]"`): without it, one line says no PNGs are drawn and the figures
still come (an explicit `--png` needs it, checked before any work; `--no-png` does without). Ends
with one JSON line. Needs scikit-learn for macro-F1 (the `test` and `bench` extras). Exits 1 (one
line on stderr) when a figure is missing.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._checks import BENCH_EXTRA, check_figures, machine, png_path, require, script  # noqa: E402
from benchmarks.downstream import (  # noqa: E402
    EVAL_POINTS,
    LABELS,
    MAX_GENES,
    ProbeRun,
    parity_codes,
    pipeline_epoch,
    train_probe,
)
from benchmarks.producer import run_config  # noqa: E402
from cellfeed_testing.sampling_quality import block_entropy_bounds, entropy_bits, index_score  # noqa: E402
from coordination.plan import Sampling  # noqa: E402
from producers.dataset import open_dataset  # noqa: E402
from producers.selection import label_codes, select_cells  # noqa: E402
from producers.synth import SynthSpec, cached_atlas, synthesize  # noqa: E402

BATCH = 64
HELD_OUT = "plate = 'plate14'"  # the campaign's --eval-filter: never trained on; the probe's test set
# the campaign's defaults: mixture n_scanners 8; block units of 240 blocks of 64 cells (fetch factor 64
# at its batch of 240, the same units as fetch factor 240 at this benchmark's batch of 64)
DEFAULTS = {"block": "block b=64 f=240", "mixture": "mixture n=8"}
PARITY = ("sequential", "random", DEFAULTS["mixture"], "block b=16 f=256", DEFAULTS["block"])
SEEDS = (0, 1)


def settings(quick: bool) -> dict[str, Sampling]:
    """The sweep: sequential, random, mixture over n_scanners, block over block size x fetch factor
    (quick: the parity settings). Units as large as on a Tahoe-scale atlas (min_units=1); the
    quick atlas is smaller than one block unit, so there units shrink to give at least 4."""
    units = 4 if quick else 1
    out = {
        "sequential": Sampling("sequential", unit_cells=1024, min_units=units),
        "random": Sampling("random", fetch_factor=16, batch_size=BATCH, min_units=units),
    }
    for n in (8,) if quick else (1, 2, 4, 8, 16):
        out[f"mixture n={n}"] = Sampling("mixture", unit_cells=256, n_scanners=n, min_units=units)
    grid = [(16, 256), (64, 240)] if quick else [(b, f) for b in (4, 16, 64, 256) for f in (16, 64, 256)] + [(64, 240)]
    for b, f in grid:
        out[f"block b={b} f={f}"] = Sampling("block", block_size=b, fetch_factor=f, batch_size=BATCH, min_units=units)
    return out


def key_of(name: str) -> str:
    """JSON key of a setting: "block b=16 f=256" -> "block_b16_f256"."""
    return name.replace(" b=", "_b").replace(" f=", "_f").replace(" n=", "_n")


def run_epoch(
    ds, sampling: Sampling, seed: int, probe: bool, plates: np.ndarray, trained: np.ndarray, args
) -> tuple[list, list, ProbeRun | None]:
    """One epoch of the pipeline: per full batch, plate entropy (bits, `plates` codes) and index
    score (positions among the `trained` cells); with `probe`, the linear probe trained on the
    same batches."""
    entropies, scores = [], []

    def scored(batches):
        for b in batches:
            if b.size == BATCH:
                ids = b.cell_ids.numpy()
                entropies.append(entropy_bits(plates[ids]))
                scores.append(index_score(np.searchsorted(trained, ids), len(trained)))
            yield b

    with pipeline_epoch(
        ds,
        sampling,
        seed=seed,
        batch_size=BATCH,
        buffer_cells=args.buffer,
        latency_ms=args.rpc_latency_ms,
        max_genes=MAX_GENES if probe else 8,
        held_out_filter=HELD_OUT,
    ) as (batches, held):
        if probe:
            return (
                entropies,
                scores,
                train_probe(
                    scored(batches), held, *parity_codes(ds), len(trained), eval_points=4 if args.quick else EVAL_POINTS
                ),
            )
        for _ in scored(batches):
            pass
    return entropies, scores, None


def throughput_ratio(ds, a: Sampling, b: Sampling, budget: int, repeats: int = 3) -> float:
    """Producer cells/s of `a` over `b`: the median of `repeats` back-to-back pairs, so that drifts
    of the machine's speed (±15% between settings measured minutes apart) cancel."""
    speed = lambda s: run_config(ds, "scgpt", 1024, s, budget, min_units=2)["cells_per_s"]  # noqa: E731
    return float(np.median([speed(a) / speed(b) for _ in range(repeats)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="a 15k-cell atlas, the 5 parity settings, one seed (a minute)"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="as --quick on an atlas of 1k cells and 3k genes (the probe's steps cost its vocabulary), "
        "one throughput pair, a 512-cell buffer, the PNGs in a temp dir (the test suite's)",
    )
    parser.add_argument(
        "--rpc-latency-ms",
        type=float,
        default=0.0,
        help="every queue/map call costs this many ms (± 40%%), as a round trip to Modal (default: 0)",
    )
    parser.add_argument(
        "--buffer",
        type=int,
        default=None,
        help="consumer mixing buffer in cells (4096; 512 tiny: less than the tiny atlas)",
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help="cells per setting for the throughput (default 40,000; 2,000 quick; 500 tiny)",
    )
    parser.add_argument(
        "--png",
        default=None,
        help="where to draw score vs throughput (default runs/bench/randomness.png, git-ignored; --tiny: a "
        "temp dir); the convergence plot goes beside it (randomness_convergence.png)",
    )
    parser.add_argument("--no-png", action="store_true", help="no PNGs (and no need for matplotlib)")
    args = parser.parse_args()
    require({"sklearn": "the probe's macro-F1"})
    if not args.no_png and args.png is None and importlib.util.find_spec("matplotlib") is None:
        # the README's set-up installs the `test` extra, not `bench`: the figures are the point, the PNGs a bonus
        print(f"{script()}: no PNGs: matplotlib is not installed ({BENCH_EXTRA} draws them)", file=sys.stderr)
        args.no_png = True
    if not args.no_png:
        require({"matplotlib": "the PNGs"}, hint=", or --no-png")
        args.png = png_path(args.png, "randomness", args.tiny)
    args.quick = args.quick or args.tiny  # the quick sweep, smaller
    args.buffer = args.buffer or (512 if args.tiny else 4096)
    n_cells = 1_000 if args.tiny else 15_000 if args.quick else 200_000
    budget = args.budget or (500 if args.tiny else 2_000 if args.quick else 40_000)
    seeds = SEEDS[:1] if args.quick else SEEDS
    if args.tiny:  # 3,000 genes: each step of the probe costs its whole vocabulary
        work = tempfile.mkdtemp(prefix="cellfeed-randomness-")
        atexit.register(shutil.rmtree, work, True)
        ds = synthesize(str(Path(work) / "atlas"), SynthSpec(n_cells=n_cells, n_genes=3000, seed=0), progress=False)
    else:
        ds = open_dataset(cached_atlas(n_cells))
    plates = label_codes(ds, "plate")[0]
    trained = select_cells(ds, exclude_filter=HELD_OUT)  # the cells a producer streams
    order = np.random.default_rng(0).permutation(len(trained))
    batches = [order[i : i + BATCH] for i in range(0, len(order) - BATCH + 1, BATCH)]  # positions in `trained`
    true_random = [entropy_bits(plates[trained[b]]) for b in batches]
    true_scores = [index_score(b, len(trained)) for b in batches]
    reference = float(np.mean(true_random))
    proportions = np.bincount(plates[trained])
    rows, probes = {}, {}
    start = time.perf_counter()
    for name, sampling in settings(args.quick).items():
        entropies, scores, probe = run_epoch(ds, sampling, seeds[0], name in PARITY, plates, trained, args)
        if probe is not None:
            probes[name] = [probe] + [
                run_epoch(ds, sampling, seed, True, plates, trained, args)[2] for seed in seeds[1:]
            ]
        speed = run_config(ds, "scgpt", 1024, sampling, budget, min_units=2)["cells_per_s"]
        rows[name] = (float(np.mean(entropies)), float(np.std(entropies)), float(np.mean(scores)), speed, sampling)
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    print(
        f"\n{len(trained):,} cells in {len(proportions[proportions > 0])} plates stored in order (plate14 held out); "
        f"batch {BATCH}; consumer buffer {args.buffer} cells; throughput: one producer, scGPT 1024, local disk, "
        f"{machine()}"
    )
    print(
        f"{'setting':<20}{'plate bits':>11}{'sd':>7}{'- random':>9}{'index':>7}{'cells/s':>9}"
        "   block bounds before mixing (bits)"
    )
    print(f"{'true random':<20}{reference:>11.3f}{np.std(true_random):>7.3f}{0.0:>+9.3f}{np.mean(true_scores):>7.3f}")
    figures = {
        "true_random_plate_entropy": round(reference, 4),
        "true_random_index_score": round(float(np.mean(true_scores)), 4),
    }
    for name, (mean, sd, score, speed, sampling) in rows.items():
        bounds = ""
        if sampling.strategy == "block":
            lower, upper = block_entropy_bounds(proportions, sampling.block_size, BATCH)
            bounds = f"   {max(0.0, lower):.3f} .. {upper:.3f}"
        print(f"{name:<20}{mean:>11.3f}{sd:>7.3f}{mean - reference:>+9.3f}{score:>7.3f}{speed:>9,.0f}{bounds}")
        figures[f"{key_of(name)}_plate_entropy"] = round(mean, 4)
        figures[f"{key_of(name)}_index_score"] = round(score, 4)
        figures[f"{key_of(name)}_cells_per_s"] = round(speed)
    figures["mixture_index_score"] = figures[f"{key_of(DEFAULTS['mixture'])}_index_score"]
    figures["mixture_vs_sequential_throughput"] = round(
        throughput_ratio(ds, rows[DEFAULTS["mixture"]][4], rows["sequential"][4], budget, 1 if args.tiny else 3), 3
    )
    print(
        f"{DEFAULTS['mixture']} / sequential producer throughput, median of {1 if args.tiny else 3} back-to-back "
        f"pairs: {figures['mixture_vs_sequential_throughput']:.3f}"
    )
    for name in ("block b=16 f=256", DEFAULTS["block"]):
        figures[f"{key_of(name)}_minus_random_bits"] = round(rows[name][0] - reference, 4)

    print(
        f"\ndownstream parity: linear probe on scGPT tokens ({MAX_GENES} genes), one epoch, macro-F1 on the "
        f"held-out plate (chance: 1/{len(np.unique(label_codes(ds, LABELS[0])[0]))} cell lines, 1/3 doses); "
        f"seeds {', '.join(map(str, seeds))}"
    )
    print(f"{'setting':<20}" + "".join(f"{label + ' F1':>26}" for label in LABELS))
    for name, runs in probes.items():
        cells = ""
        for label in LABELS:
            f1 = [r.f1[label] for r in runs]
            cells += f"{np.mean(f1):>10.3f} ({', '.join(f'{x:.3f}' for x in f1)})"
            suffix = "" if label == LABELS[0] else f"_{label}"
            short = "block" if name == DEFAULTS["block"] else "mixture" if name == DEFAULTS["mixture"] else key_of(name)
            figures[f"f1{suffix}_{short}"] = round(float(np.mean(f1)), 4)
        print(f"{name:<20}{cells}")
    expected = {
        f"f1{'' if label == LABELS[0] else '_' + label}_{short}"
        for label in LABELS
        for short in ("block", "mixture") + tuple(key_of(n) for n in PARITY if n not in DEFAULTS.values())
    }
    figures.update({key: None for key in sorted(expected - figures.keys())})  # (shown missing, then failed)
    if not args.no_png:
        draw(rows, reference, args.png)
        convergence_png = str(Path(args.png).with_name(Path(args.png).stem + "_convergence.png"))
        draw_convergence(probes, convergence_png)
        print(f"score vs throughput: {args.png}; macro-F1 vs cells seen: {convergence_png}")
    print(json.dumps(figures))
    check_figures(figures)


def draw(rows: dict, reference: float, png: str) -> None:
    """Index score and plate-entropy gap to true random against producer throughput, a point per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, (mean, _, score, speed, sampling) in rows.items():
        color = {"sequential": "tab:red", "random": "tab:gray", "mixture": "tab:orange"}.get(
            sampling.strategy, "tab:blue"
        )
        for ax, y in zip(axes, (score, mean - reference)):
            ax.scatter(speed, y, color=color)
            ax.annotate(name, (speed, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes[0].set(
        xlabel="producer cells/s (scGPT 1024, one process)",
        ylabel="index score (random = 1)",
        title="Index score vs throughput",
    )
    axes[1].set(
        xlabel="producer cells/s (scGPT 1024, one process)",
        ylabel="plate entropy - true random (bits)",
        title="Plate entropy gap vs throughput",
    )
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def draw_convergence(probes: dict, png: str) -> None:
    """Held-out macro-F1 against cells seen, per label: a line per parity setting (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LABELS), figsize=(6 * len(LABELS), 4.5))
    for name, runs in probes.items():
        cells = [c for c, _ in runs[0].curve]
        for ax, label in zip(axes, LABELS):
            f1 = np.mean([[f[label] for _, f in r.curve] for r in runs], axis=0)
            ax.plot(cells, f1, marker="o", markersize=3, label=name)
    n_seeds = len(next(iter(probes.values())))
    for ax, label in zip(axes, LABELS):
        ax.set(
            xlabel="cells seen",
            ylabel=f"{label} macro-F1, held-out plate",
            title=f"{label}: one epoch, mean of {n_seeds} seed{'s' if n_seeds > 1 else ''}",
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
