"""Shared fixtures: a real S3-compatible server on 127.0.0.1 (SeaweedFS), h5ad builders, and small
synthetic datasets."""

from __future__ import annotations

import contextlib
import gc
import os

# One OpenMP thread per process, read when torch (and numpy's BLAS) load, so set before either:
# the suite runs one xdist worker per core, and each test's own processes (a campaign's queue
# server, producers, benchmarks) share those cores. torch's default (a thread per core) in every
# worker and subprocess oversubscribes them, and OpenMP's spinning threads then make a tiny
# model's step 10-40x slower on a busy 2-core machine. (The launcher already starts its ranks
# with OMP_NUM_THREADS=1: trainer/launch.py.) A thread count changes no result a test checks.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import shutil
import signal
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

# A suite started in the background of a non-interactive shell (`pytest &`) inherits SIGINT ignored (POSIX
# shells ignore it for such jobs), and so would every process a test starts: a Ctrl-C or a preemption sent
# to a campaign would be lost, and its test fail. Handled here, the processes tests start get its default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

TEST_DATA = Path(__file__).resolve().parent / "data"
PBMC = TEST_DATA / "pbmc68k_reduced.h5ad"  # real data, with its provenance in tests/data/README.md


def wait_for(condition, what: str, timeout: float = 120.0):
    """Poll `condition` until it holds and return its value. The timeout only bounds a broken run
    (the event is the check); it is generous for a busy 2-core machine."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="session", autouse=True)
def shared_rank_server(tmp_path_factory):
    """One rank server for every campaign this test process launches, in it or in the processes it
    starts (`CELLFEED_RANK_SERVER`, trainer/launch.py): torch is imported once per xdist worker, not
    once per campaign (~3 CPU-s each, ~40 campaigns). A test that looks for the ranks below its
    campaign's process starts it with `cellfeed_testing.procs.own_rank_server()`; Modal containers never
    see it (the control plane's containers are other machines)."""
    import subprocess
    import sys

    from trainer.launch import RANK_SERVER_ENV

    path = tmp_path_factory.mktemp("ranks") / "server.sock"
    server = subprocess.Popen(
        [sys.executable, "-m", "trainer.launch", "--listen", str(path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().startswith("rank server listening"), "the shared rank server did not start"
        os.environ[RANK_SERVER_ENV] = str(path)
        yield path
    finally:
        os.environ.pop(RANK_SERVER_ENV, None)
        server.kill()
        server.wait(timeout=30)


@contextlib.contextmanager
def fresh_import(module: str):
    """`module` imported anew (with whatever `modal` this process has now) and forgotten after, so
    other tests see their own import of it."""
    import importlib
    import sys

    saved = sys.modules.pop(module, None)
    try:
        yield importlib.import_module(module)
    finally:
        sys.modules.pop(module, None)
        if saved is not None:
            sys.modules[module] = saved


@pytest.fixture(scope="session")
def seaweed():
    """A real S3-compatible server (SeaweedFS) on 127.0.0.1 for the session; every request is
    authenticated."""
    from cellfeed_testing.object_store import SeaweedServer

    server = SeaweedServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def s3_endpoint(seaweed):
    return seaweed.endpoint


@pytest.fixture
def s3(seaweed, monkeypatch):
    """S3 settings in the environment (as a user sets them) and a fresh bucket; yields the bucket name."""
    for name, value in seaweed.settings.items():
        monkeypatch.setenv(name, value)
    bucket = f"cellfeed-{os.urandom(4).hex()}"
    seaweed.client().create_bucket(Bucket=bucket)
    return bucket


def random_counts(n_cells: int, n_genes: int, seed: int, density: float = 0.1, floats: bool = False) -> sp.csr_matrix:
    """A random sparse matrix with a few empty cells and values that need uint16 or float32."""
    rng = np.random.default_rng(seed)
    x = sp.random(n_cells, n_genes, density=density, format="csr", random_state=rng, dtype=np.float64)
    x.data = rng.random(len(x.data)) * 10 if floats else np.ceil(x.data * 300)
    x = x.tolil()
    x[3, :] = 0  # an empty cell
    x = x.tocsr()
    x.eliminate_zeros()
    return x.astype(np.float32)


def write_h5ad(path: Path, x, *, genes: list[str] | None = None, obs_extra: dict | None = None, layer=None) -> Path:
    """Write an AnnData with `x` as X (CSR, CSC or dense as given) and categorical obs columns."""
    import anndata as ad
    import pandas as pd

    n_cells, n_genes = x.shape
    rng = np.random.default_rng(n_cells)
    obs = pd.DataFrame(
        {
            "plate": pd.Categorical(rng.choice(["p1", "p2", "p3"], size=n_cells), categories=["p3", "p1", "p2"]),
            "score": rng.random(n_cells).astype(np.float32),
            **(obs_extra or {}),
        },
        index=[f"c{i}" for i in range(n_cells)],
    )
    var = pd.DataFrame(
        {"chrom": pd.Categorical(rng.choice(["1", "X"], size=n_genes))},
        index=genes or [f"g{j}" for j in range(n_genes)],
    )
    with warnings.catch_warnings():  # duplicate gene names are written on purpose by some tests
        warnings.simplefilter("ignore")
        adata = ad.AnnData(X=x, obs=obs, var=var)
        if layer is not None:
            adata.layers[layer[0]] = layer[1]
        adata.write_h5ad(path)
    return path


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder `name` of this test session, filled by `build(folder)` once for the whole session:
    the first xdist worker to ask builds it while the others wait, then every worker reads it. For
    data tests only read (as a session fixture's data already is within a worker): each worker built
    its own copy before, 4 copies of every atlas on 2 cores."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # (the workers' basetemps' parent)
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released as the file closes)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # (a build that failed in another worker)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


def synth_once(tmp_path_factory, name: str, spec, rows_per_fragment: int):
    """A synthetic atlas (`producers.synth.SynthSpec`) built once for the session (`built_once`), opened."""
    from producers.dataset import open_dataset
    from producers.synth import synthesize

    def build(folder: Path) -> None:
        synthesize(str(folder / "atlas"), spec, rows_per_fragment=rows_per_fragment, progress=False)

    return open_dataset(str(built_once(tmp_path_factory, name, build) / "atlas"))


# the runs whose folders of the kernels Volume the session starts with (tests/test_modal_campaign.py's
# RUN and its expiring setup's, benchmarks/modal_chaos.py's): their campaigns load the pass from the start
KERNEL_RUNS = ("mcp", "expiry", "chaos")


@pytest.fixture(scope="session")
def token_pass_job(tmp_path_factory) -> Callable[[], Path]:
    """The token pass compiled once for the session (`built_once`, `cellfeed_testing/token_pass.py`):
    into this checkout's numba cache, which local campaigns' producers load, and into the kernels
    Volume's KERNEL_RUNS folders. Without it the campaigns that start together at the session's start
    each compiled it (~8 CPU-s a variant), and every Modal test's setup compiled again until a first
    plane had stopped. It runs on a thread of this worker from the worker's first test on, so that a
    test marked `token_pass_free` runs beside the compile (~16 s on a busy machine) instead of waiting
    for it; the value is a wait for it, which raises the compile's error."""
    import subprocess
    import sys
    import threading

    def build(volume: Path) -> None:
        out = subprocess.run(
            [sys.executable, "-m", "cellfeed_testing.token_pass", str(volume), *KERNEL_RUNS],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if out.returncode != 0:
            raise RuntimeError(f"compiling the token pass failed:\n{out.stderr[-3000:]}")

    done: dict = {}

    def job() -> None:
        try:
            done["volume"] = built_once(tmp_path_factory, "kernels-volume", build)
        except BaseException as exc:  # (raised by every wait for it)
            done["error"] = exc

    tmp_path_factory.getbasetemp()  # (made here, on the main thread, before the job uses it)
    thread = threading.Thread(target=job, name="token pass", daemon=True)
    thread.start()

    def wait() -> Path:
        thread.join(timeout=0 if "error" in done else 900)
        if "volume" not in done:
            done.setdefault("error", TimeoutError("the token pass did not compile in 900 s"))
            raise RuntimeError("the session's token pass did not compile") from done["error"]
        return done["volume"]

    return wait


@pytest.fixture(autouse=True)
def token_pass_compiled(request, token_pass_job) -> Path | None:
    """Every test starts with the token pass compiled (`token_pass_job`), but one marked
    `token_pass_free`: nothing it runs tokenizes, so it need not wait."""
    return None if request.node.get_closest_marker("token_pass_free") else token_pass_job()


@pytest.fixture(scope="session")
def kernel_volume(token_pass_job) -> dict[str, Path]:
    """The Modal campaigns' `cellfeed-kernels` Volume, lasting across the test session's control planes
    as a workspace's named Volume lasts across runs (`ControlPlane(lasting_volumes=...)`, V9). The
    session starts it with KERNEL_RUNS' folders compiled (`token_pass_job`); another run's folder starts
    as a copy of one of them (`producers/kernel_cache.py:_seed`), and a variant it lacks is compiled
    there (published when the first plane to stop with it does).
    The test that checks a setup compiles into an empty Volume does not take it."""
    return {"cellfeed-kernels": token_pass_job()}


@pytest.fixture(scope="session")
def small_synth(tmp_path_factory):
    """A 3,000-cell synthetic atlas with small fragments (many straddling cells)."""
    from producers.synth import SynthSpec

    return synth_once(tmp_path_factory, "small-synth", SynthSpec(n_cells=3000, seed=7), rows_per_fragment=250_000)


@pytest.fixture(scope="session")
def pbmc_raw(tmp_path_factory):
    """The real PBMC file's raw.X (log-normalised, gene symbols) as a dataset, with the AnnData."""
    import anndata as ad

    from producers.convert import convert

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adata = ad.read_h5ad(PBMC)
    from producers.dataset import open_dataset

    def build(folder: Path) -> None:
        convert([str(PBMC)], str(folder / "raw"), layer="raw.X", rows_per_fragment=20_000, progress=False)

    return open_dataset(str(built_once(tmp_path_factory, "pbmc", build) / "raw")), adata


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, pbmc_raw):
    """A three-source corpus file: a synthetic atlas (1,200 cells, Ensembl-like ids), a second
    (500 cells) whose genes overlap the first's by ~70% and are stored in another order, and the
    real PBMC file (700 cells, gene symbols); weights 0.6 / 0.3 / 0.1 over the default epoch of
    2,400 cells: quotas 1,440 / 720 / 240, so the two synthetic sources repeat within an epoch and
    PBMC continues across epochs. Returns (path, each source's first global cell id, quotas)."""
    from producers.synth import SynthSpec, synthesize

    pbmc, _ = pbmc_raw

    def build(root: Path) -> None:
        first = synthesize(
            str(root / "atlas_a"),
            SynthSpec(n_cells=1200, n_genes=800, n_plates=3, seed=11),
            rows_per_fragment=200_000,
            progress=False,
        )
        ids = [str(g) for g in first.var(["gene_id"]).column(0).to_pylist()]
        rng = np.random.default_rng(12)
        shared = list(rng.choice(ids, size=560, replace=False))  # 70% of the first atlas's genes
        second_ids = list(rng.permutation(shared + [f"ENSG9{g:010d}" for g in range(240)]))  # + new ones, reordered
        synthesize(
            str(root / "atlas_b"),
            SynthSpec(n_cells=500, n_genes=800, n_plates=2, seed=13),
            rows_per_fragment=100_000,
            progress=False,
            gene_ids=second_ids,
        )
        path = root / "corpus.toml"
        path.write_text(f'''# three atlases over one vocabulary built from their genes
[[source]]
name = "atlas_a"
dataset = "atlas_a"
weight = 0.6

[[source]]
name = "atlas_b"
dataset = "atlas_b"
weight = 0.3

[[source]]
name = "pbmc"
dataset = "{pbmc.uri}"
weight = 0.1
''')

    path = built_once(tmp_path_factory, "corpus", build) / "corpus.toml"
    return str(path), [0, 1200, 1700], (1440, 720, 240)


# ------------------------------------------------------------------ the order tests are handed out in

# The suite's longest tests (each tens of seconds on 2 busy cores: whole campaigns, benchmarks), as
# "module::test" (every parametrization of it), longest first. They are handed out first and one
# at a time (below), so that the workers finish together instead of one of them starting a
# 40-second campaign while the other is idle. Only the order changes: every test still runs, in
# its own tmp_path, with its own processes. A name missing from the suite is ignored.
SLOW_FIRST = [
    "test_benchmarks.py::test_convert",  # (first: it needs no token pass, so it runs while that compiles)
    "test_modal_campaign.py::test_two_nodes_preempted_then_a_node_lost_then_resumed_on_one_node_train_every_cell_once",
    "test_modal_campaign.py::test_status_and_stop_from_the_laptop_then_the_readmes_resume_finishes_the_campaign",
    "test_modal_campaign.py::test_modal_run_whole_path_balanced_preempted_in_its_first_minute_and_again_in_its_second_epoch",
    "test_first_run.py::test_a_first_run_trains_every_cell_once_and_deletes_what_it_made",
    "test_modal_campaign.py::test_a_producer_that_keeps_failing_stops_the_run_in_one_line_and_its_printed_command_resumes_it",
    "test_modal_laptop.py::test_a_detached_campaign_longer_than_a_call_continues_in_new_calls_after_the_laptop_is_gone",
    "test_benchmarks.py::test_modal_chaos",
    "test_ops.py::test_the_readmes_stop_and_resume_then_status_report_and_tensorboard",
    "test_benchmarks.py::test_object_store",
    "test_benchmarks.py::test_corpus",
    "test_modal_campaign.py::test_a_campaign_through_the_planes_own_run_command_trains_every_cell_once",
    "test_readme.py::test_the_corpus_example_trains",
    "test_benchmarks.py::test_randomness",
    "test_local_campaign.py::test_ctrl_c_stops_every_child_once_gracefully_twice_at_once",
    "test_nodes.py::test_two_nodes_train_an_epoch_once_and_a_node_lost_mid_epoch_resumes_on_one_node_exactly",
    "test_local_campaign.py::test_a_trainer_killed_on_three_ranks_resumes_on_one_from_the_default_workdir",
    "test_benchmarks.py::test_chaos",
    "test_modal_laptop.py::test_ctrl_c_on_modal_run_stops_the_campaigns_calls_and_says_how_to_resume",
    "test_local_campaign.py::test_a_killed_producer_is_restarted_and_every_epoch_is_still_exact",
    "test_corpus.py::test_cellfeed_local_trains_a_corpus_as_planned_per_source_in_every_epoch",
    "test_app.py::test_cellfeed_local_end_to_end_logging_to_wandb_offline",
    "test_benchmarks.py::test_coordination",
    "test_benchmarks.py::test_balance",
    "test_bad_input.py::test_a_resume_onto_other_data_is_refused_and_trains_nothing",
    "test_benchmarks.py::test_producer",
    "test_benchmarks.py::test_local_scaling",
    "test_readme.py::test_the_balanced_example_trains_every_class_at_its_quota",
    "test_readme.py::test_the_set_up_runs_the_main_job",
    "test_local_campaign.py::test_every_tokenizer_trains_with_a_held_out_split_and_steps_beyond_an_epoch",
]


def pytest_collection_modifyitems(config, items):
    """The SLOW_FIRST tests first, in its order; every other test after them, in collection order."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    key = lambda item: rank.get(f"{item.path.name}::{item.originalname}", len(rank))  # noqa: E731
    items.sort(key=key)  # (stable: the rest keep their order)


def pytest_configure(config):
    """Under pytest-xdist, hand tests out one at a time (`--maxschedchunk 1`) instead of in chunks
    of a quarter of each worker's share, which gave a worker several of the longest tests at once.
    An explicit --maxschedchunk on the command line wins."""
    config.addinivalue_line("markers", "token_pass_free: nothing the test runs tokenizes (conftest.py: token_pass_job)")
    # a worker holds torch, Lance, modal and the control plane for the whole session: young objects are collected
    # ~14x less often (every 10,000 allocations, not 700), and what the collection imported is frozen (below), as a
    # Modal container freezes its imports (app/modal_app.py)
    gc.set_threshold(10_000, 10, 10)
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "maxschedchunk", "absent") is None:
        config.option.maxschedchunk = 1
    if not hasattr(config, "workerinput"):  # (the controller, before it starts any worker)
        compile_checkout()


def compile_checkout() -> None:
    """The checkout's modules compiled to bytecode once, before any test. Where PYTHONDONTWRITEBYTECODE
    is set (this machine), Python never writes the `__pycache__` it would read, so each of the ~700
    processes the suite starts (campaigns' producers, ranks' servers, benchmarks, command lines)
    compiled every module of ours it imported from source again: ~35 ms a producer process, here.
    `compileall` writes the files that Python's import then checks against each source's mtime and
    size, and reads; a source changed since is compiled from source as before."""
    import compileall

    root = Path(__file__).resolve().parents[1]
    for package in ("coordination", "producers", "trainer", "app", "deploy", "cellfeed_testing", "benchmarks"):
        compileall.compile_dir(root / package, quiet=1)


def pytest_collection_finish(session):
    """The cyclic GC stops walking the objects the collection made (every module imported): each full
    collection walked them again, ~10% of a worker's CPU (2.9 CPU-s against 1.0 on trainer, corpus and
    producer tests)."""
    gc.freeze()


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): two workers per core, not one. A test here spends about half
    its wall time waiting, not computing: processes starting, a campaign's timers, Modal's 25 ms a
    call injected by the control plane (measured per test with getrusage: CPU over wall 0.44-0.54 for
    the Modal campaigns on an idle 2-core machine). With one worker per core the cores idle through
    those waits; every test still runs alone in its own tmp_path with its own processes."""
    import os

    return 2 * (os.cpu_count() or 1)
