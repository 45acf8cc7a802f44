"""Every benchmark in benchmarks/ still runs: its `--tiny` mode (the same code path at the smallest
sensible scale, seconds each) exits 0 and ends with its JSON line, whose key figures are present
and finite. A benchmark that did not finish, or lacks a figure, exits 1 with one line on stderr
(benchmarks/_checks.py); one that needs an optional package says so before doing any work.
(`benchmarks/downstream.py` is the probe that randomness.py runs, not a benchmark of its own.)"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
from importlib.metadata import version as metadata_version
from pathlib import Path

import pytest

from benchmarks._checks import missing_figures

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # generous: a tiny run takes seconds, a busy 2-core machine several times that
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None  # the `bench` extra, not `test`


def run_benchmark(name: str, *args: str, code: str | None = None) -> subprocess.CompletedProcess:
    """`python benchmarks/<name>.py args` from the repository root (or `code` standing in for the
    interpreter's entry, with the same argv)."""
    command = (
        [sys.executable, f"benchmarks/{name}.py", *args]
        if code is None
        else [sys.executable, "-c", code, f"benchmarks/{name}.py", *args]
    )
    start = time.monotonic()
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    out.wall_s = time.monotonic() - start
    return out


def figures_of(out: subprocess.CompletedProcess) -> dict:
    """The benchmark's JSON line (its last line that is a JSON object), after a clean exit."""
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line in the output:\n{out.stdout[-3000:]}"
    return json.loads(lines[-1])


def finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def png_args(tmp_path: Path, name: str) -> list[str]:
    """Draw into tmp_path when matplotlib is here (never over the repository's figures), else --no-png."""
    return ["--png", str(tmp_path / f"{name}.png")] if HAVE_MATPLOTLIB else ["--no-png"]


def test_train_step(tmp_path):
    figures = figures_of(run_benchmark("train_step", "--tiny"))
    assert figures["steps"] == 6 and figures["preset"] == "tiny" and figures["batch"] == 8
    assert finite(figures["cells_per_s"], figures["median_step_ms"], figures["tokens_per_s"])
    assert 0 < figures["padding_fraction"] < 1 and figures["graph_breaks"] == 0  # cells of varied length
    # Geneformer's layout (tokens only, gene ids predicted), packed, profiled
    profile = tmp_path / "profile.txt"
    packed = figures_of(
        run_benchmark("train_step", "--tiny", "--packed", "--layout", "geneformer", "--profile", str(profile))
    )
    assert packed["tokens_per_row"] == 2 * 257 and packed["graph_breaks"] == 0 and packed["layout"] == "geneformer"
    assert packed["padding_fraction"] < figures["padding_fraction"]
    assert profile.read_text().startswith("no device kernels") and "aten::mm" in profile.read_text()
    assert figures["cells_per_s"] > 0
    assert figures["mfu"] is None or finite(figures["mfu"])  # n/a on a CPU


def test_gpu_campaign():
    """A whole local campaign (producer processes, the queue server, one rank) against the step
    alone; on this CPU, MFU is n/a and the run is the tiny preset's."""
    figures = figures_of(run_benchmark("gpu_campaign", "--tiny"))
    assert (figures["preset"], figures["steps"], figures["batch"]) == ("tiny", 12, 16)
    assert finite(figures["cells_per_s"], figures["step_alone_cells_per_s"], figures["campaign_vs_step"])
    assert figures["cells_per_s"] > 0 and figures["step_alone_cells_per_s"] > 0 and figures["step_median_ms"] > 0
    assert 0 <= figures["data_wait_median_ms"] <= figures["data_wait_max_ms"]
    assert 0 <= figures["padding_fraction"] < 1
    assert figures["mfu"] is None and figures["step_alone_mfu"] is None  # n/a on a CPU


@pytest.mark.token_pass_free
@pytest.mark.parametrize("compiled, packed", [(True, False), (False, True), (True, True)])
def test_the_gpu_campaigns_command_is_one_cellfeed_local_takes(tmp_path, compiled, packed):
    """Every mode of `benchmarks/gpu_campaign.py` gives `cellfeed local` flags it takes, with their values:
    `--compile` was passed to a command that refused it, and only a GPU run found it (d70d9be)."""
    from types import SimpleNamespace

    from app.cli import build_parser
    from benchmarks.gpu_campaign import campaign_command

    args = SimpleNamespace(
        preset="scgpt",
        batch=240,
        max_genes=1024,
        producers=8,
        steps=30,
        compile=compiled,
        tokens_per_row=8200 if packed else None,
        tokens_per_batch=160_000 if packed else None,
    )
    command = campaign_command(args, "/atlas", tmp_path)
    assert command[1:4] == ["-m", "app.cli", "local"]
    parsed = build_parser().parse_args(command[3:])  # (a flag it does not take: SystemExit, one line)
    assert (parsed.compile, parsed.tokens_per_row, parsed.tokens_per_batch, parsed.batch_size, parsed.steps) == (
        compiled,
        args.tokens_per_row,
        args.tokens_per_batch,
        240,
        30,
    )


def test_a_consumer_benchmark_whose_feeder_dies_ends_at_once_with_its_error():
    """The feeder thread's death (a put the queue refuses) ends the measurement within a poll,
    naming the error, instead of leaving the stream to wait out its 600 s for data."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import consumer
    from coordination.errors import CellfeedError
    from coordination.queues import MemoryQueue, RequestTooLarge

    class Refuses(MemoryQueue):
        def put_many(self, *args, **kwargs):
            raise RequestTooLarge("request of 8.2 MB: too large")

    start = time.monotonic()
    with pytest.raises(CellfeedError, match="the feeder thread died: RequestTooLarge: request of 8.2 MB"):
        consumer.consume(Refuses(), [bytes(64)], 10, 1, 4)
    assert time.monotonic() - start < 60  # (bounds a hang only; the stream would wait 600 s)


def test_consumer():
    figures = figures_of(run_benchmark("consumer", "--tiny"))
    for key in (
        "consumer_cells_per_s_batch64",
        "consumer_cells_per_s_batch240",
        "consumer_cells_per_s_batch64_local",
        "consumer_cells_per_s_batch240_local",
    ):
        assert finite(figures[key]) and figures[key] > 0, key
    assert finite(figures["round_trip_us_memory"], figures["round_trip_us_local"])


@pytest.mark.token_pass_free  # (conversion tokenizes nothing: it runs while the session compiles the pass)
def test_convert():
    """1 and 2 workers locally and to S3 behind the proxy, and the Modal fan-out (modal's own CLI on the
    control plane: 2 slices here, 8 with --quick; a scan and a write call each, a failed attempt
    retried): the benchmark exits non-zero unless every dataset holds every cell, the workers'
    datasets are the same, and the fan-out's content hash equals a local conversion's of the same
    input and blocks."""
    figures = figures_of(run_benchmark("convert", "--tiny"))
    assert figures["cells"] == 500 and figures["nonzeros"] > 500
    for key in ("convert_cells_per_s", "convert_2_workers_cells_per_s", "s3_10ms_cells_per_s", "synth_cells_per_s"):
        assert finite(figures[key]) and figures[key] > 0, key
    assert finite(figures["speedup_2_workers"], figures["convert_worker_peak_rss_mb"])
    assert figures["steady_speedup_2_workers"] is None  # (500 cells are one slice: no worker writes a second)
    for k in ("1_workers", "2_workers"):  # where a conversion's time goes, phase by phase
        phases = figures["phase_seconds"][k]
        assert list(phases) == ["imports", "plan", "scan", "write", "commit"] and finite(*phases.values()), k
    assert (figures["modal_slices"], figures["modal_calls"], figures["modal_retried_attempts"]) == (2, 4, 1)


def test_producer():
    figures = figures_of(run_benchmark("producer", "--tiny"))
    for key in (
        "scgpt_1024_sequential_cells_per_s",
        "scgpt_1024_block_cells_per_s",
        "scgpt_1024_random_cells_per_s",
        "geneformer_1024_block_cells_per_s",
        "raw_2048_block_cells_per_s",
        "floor_cells_per_s",
    ):
        assert finite(figures[key]) and figures[key] > 0, key
    assert finite(figures["pipeline_over_floor"]) and figures["scgpt_1024_block_bytes_per_cell"] > 0
    # a tiny run's fresh producer loads the compiled pass (the compile is a full run's figure)
    assert figures["first_unit_s_cold_cache"] is None and finite(figures["first_unit_s_warm_cache"])


def test_object_store():
    """Local disk, a real S3 server (SeaweedFS) and that server behind latency proxies (30 and 100 ms)."""
    figures = figures_of(run_benchmark("object_store", "--tiny"))
    for strategy in ("sequential", "mixture", "block", "block16", "random"):
        assert finite(figures["ratio_30ms"][strategy], figures["ratio_100ms"][strategy])
        for store in ("local", "s3", "s3_30ms", "s3_100ms"):
            assert finite(figures[f"{store}_{strategy}_cells_per_s"]) and figures[f"{store}_{strategy}_cells_per_s"] > 0
        assert finite(
            figures[f"s3_30ms_over_local_{strategy}"],
            figures[f"gets_per_1k_cells_{strategy}"],
            figures[f"read_amplification_{strategy}"],
        )
        for store in ("local", "s3_30ms", "s3_100ms"):  # the loop's waits for rows: a share of its steady time
            assert 0 <= figures[f"wait_share_{store}"][strategy] <= 1
        for store in ("s3_30ms", "s3_100ms"):  # slice reads in flight, as the producer paced them: reported
            assert isinstance(figures[f"reads_in_flight_{store}"][strategy], int)
    assert finite(figures["block_over_sequential_local"], figures["block16_over_sequential_local"])
    assert set(figures["startup_s"]) == {"local", "s3", "s3_30ms", "s3_100ms"} and figures["rounds"] == 1


def test_local_scaling(tmp_path):
    figures = figures_of(run_benchmark("local_scaling", "--tiny", *png_args(tmp_path, "scaling")))
    for key in (
        "local_cells_per_s_1_producer",
        "local_cells_per_s_2_producers",
        "local_steady_cells_per_s_1_producer",
        "local_steady_cells_per_s_2_producers",
    ):
        assert finite(figures[key]) and figures[key] > 0, key
    assert (tmp_path / "scaling.png").exists() == HAVE_MATPLOTLIB


def test_randomness(tmp_path):
    """The sampling sweep and the downstream probe (benchmarks/downstream.py) on the quick settings."""
    figures = figures_of(run_benchmark("randomness", "--tiny", *png_args(tmp_path, "randomness")))
    assert 0 < figures["true_random_plate_entropy"] <= math.log2(14)
    for setting in ("sequential", "random", "mixture_n8", "block_b16_f256", "block_b64_f240"):
        assert finite(figures[f"{setting}_plate_entropy"], figures[f"{setting}_index_score"])
        assert figures[f"{setting}_cells_per_s"] > 0
    for short in ("sequential", "random", "mixture", "block_b16_f256", "block"):  # macro-F1, two labels
        assert 0 <= figures[f"f1_{short}"] <= 1 and 0 <= figures[f"f1_dose_{short}"] <= 1, short
    assert finite(figures["mixture_vs_sequential_throughput"])
    if HAVE_MATPLOTLIB:
        assert (tmp_path / "randomness.png").exists() and (tmp_path / "randomness_convergence.png").exists()


def test_coordination():
    """The simulation at Modal's latency (a producer dies: its unit is re-issued after the lease),
    the full-partition phase on the local Modal control plane (modal's own client), the start-up and driver probes."""
    figures = figures_of(run_benchmark("coordination", "--tiny"))
    assert figures["finished"] and figures["cells"] == figures["expected_cells"] > 0
    assert figures["reissued"] >= 1 and finite(figures["reissue_s"])
    assert finite(
        figures["efficiency"],
        figures["calls_per_1k_cells"],
        figures["epoch_gap_s"],
        figures["driver_pass_s"],
        figures["first_batch_s"],
    )
    assert figures["full_partition"]["accepted_cells"] > 0
    assert finite(figures["full_partition_bytes_sent_per_delivered"], figures["full_partition_calls_per_1k_cells"])
    assert figures["startup_cells"] == 200_000
    # past one node: 64 ranks, every cell delivered, the figures issue 32 asks for
    assert figures["ranks_64"]["world"] == 64 and figures["ranks_64"]["cells"] == figures["ranks_64"]["expected_cells"]
    assert finite(
        figures["efficiency_64_ranks"],
        figures["calls_per_1k_cells_64_ranks"],
        figures["driver_cpu_s_per_1m_cells_64_ranks"],
    )
    assert finite(figures["setup_s_100m"], figures["producer_start_s_100m"], figures["driver_epoch_s_100m"])


def test_chaos():
    """A real local campaign at Modal's 25 ms a call, under a 2 s lease (`--lease-s 2`: the tiny
    run's 4 s halved, and with it how long its stall and pause last, each 2 s past the lease): a
    producer SIGKILLed, one SIGSTOPped past its lease (its unit issued again; it wakes and sends
    duplicates), the trainer SIGSTOPped past the lease (the queue fills, producers wait on
    backpressure and keep heartbeating): every epoch trains exactly its cells, and the run finishes
    by itself. (The tiny run has no calm run, so no overhead figure.)"""
    figures = figures_of(run_benchmark("chaos", "--tiny", "--lease-s", "2"))
    assert figures["completed"] and figures["faults_injected"] == 3 and figures["lease_s"] == 2
    assert figures["fault_kinds"] == {"kill": 1, "stall": 1, "pause": 1}
    assert (figures["cells_checked"], figures["cells_lost"], figures["cells_duplicated"]) == (2 * 400, 0, 0)
    assert figures["producer_restarts"] >= 1 and figures["units_reissued"] >= 1
    assert isinstance(figures["units_released"], int) and figures["units_released"] >= 0
    assert finite(figures["wall_s"]) and figures["overhead_ratio"] is None and figures["calm_wall_s"] is None


def test_modal_chaos(kernel_volume):
    """A whole campaign through modal's real `modal run` on the local control plane (its containers run
    modal's own entrypoint) through a failing network, each fault at the n-th matching request: bursts
    past modal's own retries on the queue, the Dict, the producers' spawn and the looks at a call's
    result; lost replies (applied, then no reply) of three queue gets, a Dict pop, train's spawn (a
    second train call: one trains) and setup's result; a latency spike; a producer's connection reset
    as it puts (its every call in flight ends unanswered); a producer preempted (SIGINT to every
    process of its container). Every cell trained exactly once (the ranks' cell logs, cell by
    cell), the lost items made again, the run's state never deleted before its end, and every container
    ran the installed modal."""
    figures = figures_of(run_benchmark("modal_chaos", "--tiny", "--kernels", str(kernel_volume["cellfeed-kernels"])))
    assert figures["completed"] and figures["faults_injected"] == 13
    assert figures["fault_kinds"] == {
        "grpc_burst": 4,
        "lost_reply_get": 3,
        "lost_reply_pop": 1,
        "lost_reply_spawn": 1,
        "lost_reply_result": 1,
        "latency": 1,
        "transport_reset": 1,
        "preempt_produce": 1,
    }
    assert (figures["cells_checked"], figures["cells_lost"], figures["cells_duplicated"]) == (600, 0, 0)
    assert figures["state_deleted_before_end"] == 0 and figures["units_redone"] >= 1  # the lost items, made again
    assert (figures["train_calls"], figures["trainers"]) == (2, 1)  # train's spawn made twice; one trainer
    assert figures["client_calls_failed_to_product"] >= 1  # a burst outlasted modal's own retries somewhere
    installed = importlib.util.find_spec("modal").origin
    assert figures["modal_client_file"] == installed and figures["modal_client_version"] == metadata_version("modal")
    assert finite(figures["wall_s"]) and figures["overhead_ratio"] is None


def test_corpus():
    """Three sources over one vocabulary through a real local campaign: each epoch trains every
    source's quota, batches mix them by weight, sampled tokens equal the reference."""
    figures = figures_of(run_benchmark("corpus", "--tiny"))
    assert figures["per_source_trained"] == figures["per_source_planned"] == [[1500, 750, 250]] * 2
    assert figures["cells_off_plan"] == 0 and figures["token_mismatches"] == 0 and figures["cells_compared"] == 180
    for name, weight in (("atlas_a", 0.6), ("atlas_b", 0.3), ("pbmc", 0.1)):
        share = figures["source_share_per_batch"][name]
        assert abs(share["mean"] - weight) < 0.02 and finite(share["sd"], share["binomial_sd"])
    assert figures["vocab_coverage"]["pbmc"]["nonzeros_kept"] == 1.0
    assert finite(
        figures["throughput_vs_single_source"],
        figures["throughput_nonzeros_vs_single_source"],
        figures["single_source_corpus_vocab_vs_own_vocab"],
    )
    assert figures["setup_s_corpus_150m"] is None  # the 150M-cell probe is not a tiny run's


def test_balance():
    """Balanced sampling's figures on 3k cells (ALPHA 1) and a 1M-cell plan: quotas exact, batches near binomial."""
    figures = figures_of(run_benchmark("balance", "--tiny"))
    assert figures["class_quota_error"] == {"1": 0} and figures["repeat_before_all_seen"] == {"1": 0}
    assert 0.5 < figures["batch_share_sd_vs_binomial"]["1"] < 1.5  # ~1.0 (a few dozen batches: noisy)
    assert figures["throughput_vs_unbalanced"]["1"] > 0 and figures["setup_cells"] == 1_000_000
    assert figures["setup_s"] > 0 and "setup_s_100m_50_classes" not in figures  # (not claimed at 1M)


def test_elastic():
    """A checkpoint of 8 ranks halfway through a 200k-cell epoch, resumed on 4 and on 16: the rest
    re-planned adds up (the benchmark checks it), with its seconds and the cells produced again."""
    figures = figures_of(run_benchmark("elastic", "--tiny"))
    for world in (4, 16):
        f = figures[f"to_{world}"]
        assert f["rest_cells"] == figures["cells"] - figures["trained_before"] > 0
        assert 0 < f["units_skipped"] < figures["units"] and f["cells_reproduced"] > 0
        assert finite(f["resume_to_first_step_s"], f["reproduced_per_trained"], f["rest_spread_cells"])


def test_a_simulation_that_does_not_finish_exits_1_in_one_line():
    """The coordination simulation cut off before its producer's unit is re-issued."""
    out = run_benchmark("coordination", "--tiny", "--max-seconds", "2")
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith("benchmarks/coordination.py: did not finish: the simulation delivered ")
    )


@pytest.mark.parametrize(
    "name, package, pip_name",
    [
        ("randomness", "matplotlib", "matplotlib"),
        ("randomness", "sklearn", "scikit-learn"),
        ("local_scaling", "matplotlib", "matplotlib"),
    ],
)
def test_a_missing_optional_package_fails_before_any_work(name, package, pip_name, tmp_path):
    """With the package hidden, the benchmark stops at once, in one line naming it and the extra
    (matplotlib: when a PNG was asked for; without `--png` the figures are printed and the PNG
    skipped, so the README's set-up runs them)."""
    hide = (
        f"import runpy, sys; sys.modules[{package!r}] = None; sys.argv = sys.argv[1:]; "
        f"runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    png = ["--png", str(tmp_path / "figure.png")] if package == "matplotlib" else []
    out = run_benchmark(name, "--tiny", *png, code=hide)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"benchmarks/{name}.py: needs {pip_name} (for ") and 'pip install -e ".[bench]"' in last
    assert out.stdout == ""  # nothing was computed
    if package == "matplotlib":
        assert "--no-png" in last


def test_missing_figures_are_found_nested_and_none_only_where_allowed():
    figures = {"a": 1.0, "b": float("nan"), "c": None, "d": {"e": float("inf"), "f": 2}, "g": "text", "h": None}
    assert missing_figures(figures, allow_none=("h",)) == ["b", "c", "d.e"]


def test_object_store_rounds_pool_into_a_median_rate_and_the_share_of_steady_time_spent_waiting():
    """A setting's rounds as `benchmarks/object_store.py` reports them: the median rate and fill, counts
    summed, and each round's first wait (its fill) left out of the waits and of the steady time."""
    from benchmarks.object_store import pooled

    def run(rate: float, seconds: float, waits: list[float]) -> dict:
        counts = dict(cells=100, rows=1_000, gets=10, bytes_read=4_000, server_cpu_s=0.5, reads_in_flight=64)
        return counts | dict(
            cells_per_s=rate, seconds=seconds, fill_s=waits[0], unit_read_s=[0.1] * 3, unit_wait_s=waits
        )

    r = pooled([run(30.0, 4.0, [1.0, 0.5, 0.0]), run(10.0, 3.0, [2.0, 0.25, 0.25]), run(20.0, 2.0, [0.5, 0.0, 0.0])])
    assert (r["cells_per_s"], r["fill_s"]) == (20.0, 1.0)  # medians, not means (20.0, 1.1667)
    assert (r["cells"], r["gets"], r["server_cpu_s"]) == (300, 30, 1.5)
    assert r["unit_wait_s"] == [0.5, 0.0, 0.25, 0.25, 0.0, 0.0] and len(r["unit_read_s"]) == 9
    assert r["wait_share"] == pytest.approx(1.0 / (3.0 + 1.0 + 1.5))  # waits 1.0 over steady 9.0 - 3.5 of fill
