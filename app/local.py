"""The local campaign: the whole system on one machine. A queue server process, producer
processes, the setup step, and one DDP trainer process per rank (gloo on CPU), with a live
status line (steps, cells/s, queue depth, producer rates, dataloader wait) and a final summary.

    cellfeed local                     # synthesizes a small atlas first
    cellfeed local --dataset PATH --producers 2 --gpus 2 --steps 100
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from app.campaign import prepare
from app.config import CampaignConfig
from coordination.backends import connect
from coordination.errors import CellfeedError
from coordination.local_backend import ServerProcess
from coordination.routing import TASKS_PARTITION, producers_key, rank_partition, stop_key
from trainer import checkpoint
from trainer.launch import launch, wait_all

STATUS_EVERY_S = 2.0
CHECK_EVERY_S = 0.5  # how often the ranks and producers are looked at
STOP_GRACE_S = 10.0  # how long producers together get to stop at the end before being killed
PRODUCER_RETRIES = 3  # as the Modal producer function's retries=3
RESTART_BACKOFF_S = 1.0
USER_ERROR_EXIT = 2  # a producer or rank that stopped on a CellfeedError (restarting it would not help)



def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"

def default_dataset(workdir: Path, cells: int, seed: int) -> str:
    """A small synthetic atlas (written once, reused by later runs in the same workdir)."""
    from producers.synth import SynthSpec, synthesize

    path = workdir / f"synth-{cells}-{seed}"
    if not (path / "config.json").exists():
        workdir.mkdir(parents=True, exist_ok=True)
        print(f"no --dataset given: synthesizing {cells:,} Tahoe-like cells into {path}")
        synthesize(str(path), SynthSpec(n_cells=cells, seed=seed), rows_per_fragment=1 << 20, overwrite=True)
    return str(path)


def _last_step(log: Path) -> dict | None:
    if not log.exists():
        return None
    rows = [json.loads(line) for line in log.read_text().splitlines()[-20:] if line.strip()]
    rows = [r for r in rows if "loss" in r]
    return rows[-1] if rows else None


IDLE_AFTER_S = 5.0  # a running producer with no unit finished for this long and no task queued is idle


def producer_states(reports: dict, names: list[str], procs: list[subprocess.Popen], tasks: int,
                    all_done: bool = False) -> list[str]:
    """Each producer's state: starting, working (with its rate), idle (nothing left to take), done
    (exited) or failed. `reports`: the producers' totals as the driver publishes them."""
    states = []
    for name, proc in zip(names, procs):
        code = proc.poll()
        r = reports.get(name)
        if code is not None:
            states.append("done" if code == 0 else f"failed ({code})")
        elif r is None:
            states.append("starting")
        elif tasks == 0 and (all_done or time.time() - r["heard"] > IDLE_AFTER_S):
            states.append("idle")
        else:
            states.append(f"working {r['cells'] / max(1e-9, r['busy_s']):,.0f} cells/s" if r.get("busy_s") else "working")
    return states


def status_line(cfg: CampaignConfig, queue, store, log: Path, started: float, total_steps: int,
                names: list[str], procs: list[subprocess.Popen], units_total: int) -> str:
    row = _last_step(log)
    tasks = queue.len(partition=TASKS_PARTITION)
    depth = [queue.len(partition=rank_partition(r)) for r in range(cfg.gpus)]
    reports = json.loads(store.get(producers_key(cfg.run)) or "{}")
    units = sum(r.get("units", 0) for r in reports.values())
    parts = [f"{time.monotonic() - started:5.0f}s"]
    if row:
        parts += [f"step {row['step']}/{total_steps}", f"loss {row['loss']:.3f}", f"{row['cells_per_s']:,.0f} cells/s",
                  f"wait {row['wait_ms']:.0f}ms"]
    else:
        parts += ["ranks starting (torch, DDP, first batch)"]
    parts += [f"units {units:,}/{units_total:,} done, {tasks:,} queued",
              f"queue {' '.join(f'r{r}:{d}' for r, d in enumerate(depth))} items"
              + (f", {row['ready_cells']:,} cells ready in the ranks" if row and "ready_cells" in row else ""),
              "producers " + ", ".join(producer_states(reports, names, procs, tasks, units >= units_total))]
    return " | ".join(parts)


def run_local(cfg: CampaignConfig, workdir: str | Path = "runs", quiet: bool = False,
              audit_cells: bool = False) -> dict:
    """Run a whole campaign locally; returns the trainer's summary (rank 0). With `audit_cells`,
    each rank writes the cell ids of every step to WORKDIR/RUN/cells.rank<r>.jsonl."""
    cfg.validate()
    place_checkpoints(cfg, workdir)
    if cfg.resume:
        print(describe_resume(cfg))
    workdir = Path(workdir) / cfg.run
    workdir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess()
    backend = cfg.backend_spec("local", address=server.address)
    queue, store = connect(backend)
    fleet, ranks = None, []
    try:
        facts = prepare(cfg, queue, store)
        total_steps = facts.total_steps
        print(f"campaign {cfg.run}: {facts.cells_per_epoch:,} cells/epoch in {plural(facts.units_per_epoch, 'unit')}, "
              f"{plural(cfg.producers, 'producer')}, {plural(cfg.gpus, 'rank')} (gloo, CPU), "
              f"{plural(total_steps, 'step')} of {cfg.batch_size} cells per rank over {plural(facts.epochs, 'epoch')}"
              + (f", {facts.held_out_cells:,} held-out cells" if facts.held_out_cells else ""), flush=True)
        config_path = workdir / "campaign.json"
        config_path.write_text(json.dumps(asdict(cfg)))
        fleet = ProducerFleet(config_path, server.address, cfg.producers, workdir)
        log = workdir / "steps.jsonl"
        log.unlink(missing_ok=True)
        changes = dict(log_path=str(log), progress_bar=False)
        if audit_cells:
            for old in workdir.glob("cells.rank*.jsonl"):
                old.unlink()
            changes["cells_log"] = str(workdir / "cells")
        train_cfg = cfg.train_config(backend, facts, **changes)
        ranks = launch(train_cfg, cfg.gpus, workdir, summary_path=str(workdir / "summary"), log_ranks=True)
        started = time.monotonic()
        printed = 0.0
        while any(p.poll() is None for p in ranks):
            if any(p.poll() not in (None, 0) for p in ranks):
                break
            fleet.check()  # a dead producer is restarted; its unit is re-issued by the driver
            row = _last_step(log)
            due = time.monotonic() - printed >= STATUS_EVERY_S
            if due and not quiet and not (row and row["step"] >= total_steps):  # rank 0 prints the final table
                print(status_line(cfg, queue, store, log, started, total_steps, fleet.names, fleet.procs,
                                  facts.units_total), flush=True)
                printed = time.monotonic()
            time.sleep(CHECK_EVERY_S)
        codes = wait_all(ranks, timeout=60)
        if codes != [0] * cfg.gpus:
            raise CellfeedError(f"the campaign failed: trainer ranks exited {codes}; rank logs are in {workdir}")
        summary = json.loads((workdir / "summary.rank0").read_text())
        reports = json.loads(store.get(producers_key(cfg.run)) or "{}")
        summary["producers"] = [reports.get(n, {}) for n in fleet.names]
        summary["producer_restarts"] = sum(fleet.restarts)
        return summary
    finally:  # whatever happened (Ctrl-C included): stop every child, leave nothing behind
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        try:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
            stop_campaign(store, cfg.run, fleet.procs if fleet else [], server)
        finally:
            signal.signal(signal.SIGINT, previous)


def place_checkpoints(cfg: CampaignConfig, workdir: str | Path) -> None:
    """A relative checkpoint folder lives in the workdir."""
    if not Path(cfg.checkpoint_dir).is_absolute():
        cfg.checkpoint_dir = str(Path(workdir) / cfg.checkpoint_dir)


def describe_resume(cfg: CampaignConfig) -> str:
    """What `--resume` continues from, in one line; an error when the run has no checkpoint."""
    directory = cfg.run_checkpoint_dir
    latest = checkpoint.latest(directory)
    if latest is None:
        raise CellfeedError(f"--resume: run {cfg.run!r} has no checkpoint in {directory}; leave out --resume to start "
                            "it, or name an existing run with --run")
    return (f"resuming run {cfg.run} from its checkpoint at step {latest.step:,} (epoch {latest.epoch}, "
            f"{sum(latest.trained):,} cells of that epoch already trained): {latest.folder}")


def start_producer(config_path: Path, address: str, name: str) -> subprocess.Popen:
    """A producer process for the campaign config at `config_path`."""
    return subprocess.Popen([sys.executable, "-m", "app.local", "--produce", str(config_path), "--address", address,
                             "--name", name], start_new_session=True)  # a terminal's Ctrl-C reaches only the campaign


def start_producers(config_path: Path, address: str, n: int) -> list[subprocess.Popen]:
    """n producer processes (`producer-0`, ...)."""
    return [start_producer(config_path, address, f"producer-{i}") for i in range(n)]


class ProducerFleet:
    """The local producers, restarted when one dies, as Modal retries a producer call (`retries`
    times each, after RESTART_BACKOFF_S, doubling). Nothing is lost meanwhile: the driver re-issues
    the dead producer's unit once it falls silent, and consumers drop any duplicate."""

    def __init__(self, config_path: Path, address: str, n: int, workdir: Path, retries: int = PRODUCER_RETRIES):
        self.config_path, self.address, self.workdir, self.retries = config_path, address, workdir, retries
        self.names = [f"producer-{i}" for i in range(n)]
        self.procs = [start_producer(config_path, address, name) for name in self.names]
        self.restarts = [0] * n
        self._due: list[float | None] = [None] * n  # when a dead producer is started again

    def check(self) -> None:
        """Restart the producers that died; raise once one has died more than `retries` times."""
        now = time.monotonic()
        for i, (name, proc) in enumerate(zip(self.names, self.procs)):
            code = proc.poll()
            if code in (None, 0):
                continue
            if code == USER_ERROR_EXIT:  # a damaged or changed dataset does not mend on a restart
                raise CellfeedError(f"{name} stopped on the error above; the campaign stops (checkpoints are in "
                                    f"{self.workdir.parent})")
            if self.restarts[i] >= self.retries:
                raise CellfeedError(f"{name} died {self.restarts[i] + 1} times (last exit code {code}); the campaign "
                                    f"stops (its output is above; checkpoints are in {self.workdir.parent})")
            if self._due[i] is None:
                wait = RESTART_BACKOFF_S * 2 ** self.restarts[i]
                self._due[i] = now + wait
                print(f"{name} exited with code {code}: restarting it in {wait:.0f}s "
                      f"({self.restarts[i] + 1} of {self.retries} restarts)", flush=True)
            elif now >= self._due[i]:
                self.procs[i] = start_producer(self.config_path, self.address, name)
                self.restarts[i] += 1
                self._due[i] = None


def stop_campaign(store, run: str, producers: list[subprocess.Popen], server: ServerProcess) -> None:
    """Signal the producers to stop, give them a moment to finish, then stop the queue server."""
    try:
        store.put(stop_key(run), "stop")
    except CellfeedError:
        pass  # the server is already gone
    deadline = time.monotonic() + STOP_GRACE_S  # one deadline for all (they notice the stop within seconds)
    for p in producers:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    server.close()


def print_summary(summary: dict, workdir: Path, objective: str = "bins") -> None:
    produced = sum(p.get("cells", 0) for p in summary["producers"])
    busy = sum(p.get("busy_s", 0) for p in summary["producers"])
    print(f"\nproducers: {produced:,} cells in {busy:.1f} busy seconds "
          f"({produced / max(busy, 1e-9):,.0f} cells/s per busy producer)")
    print(f"trainer: {summary['steps']} steps, loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
          f"{summary['cells_per_s']:,.0f} cells/s, median step {summary['median_step_s'] * 1000:.1f} ms, "
          f"median dataloader wait {summary['median_wait_ms']:.1f} ms")
    for e in summary.get("eval", []):
        print(f"  held-out at step {e['step']}: masked-{objective[:-1]} accuracy {e['eval_accuracy']:.3f}, loss {e['eval_loss']:.3f}")
    audits = summary.get("audits", [])
    if audits:  # each epoch's own line was printed as it ended
        checked = [a for a in audits if a["audited"]]
        print(f"exactly-once audit: {len(checked)} of {plural(len(audits), 'complete epoch')} checked, "
              f"{sum(a['cells'] for a in checked):,} cells trained, {sum(a['missing'] for a in checked)} missing, "
              f"{sum(a['duplicated'] for a in checked)} duplicated")
    print(f"step log: {workdir}/steps.jsonl")


def _produce_main(config_path: str, address: str, name: str) -> None:
    from producers.dataset import StorageUnavailable
    from producers.producer import Producer

    cfg = CampaignConfig(**json.loads(Path(config_path).read_text()))
    queue, store = connect(cfg.backend_spec("local", address=address))
    try:
        Producer(cfg.producer_config(), queue, store, name=name).run()
    except CellfeedError as exc:  # one line; bad data or settings exit with a code that says "do not retry"
        print(f"cellfeed: error: {name}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1 if isinstance(exc, StorageUnavailable) else USER_ERROR_EXIT)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="A local campaign's producer process (started by `cellfeed local`).")
    parser.add_argument("--produce", required=True, help="campaign config JSON")
    parser.add_argument("--address", required=True, help="the local queue server")
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    try:
        _produce_main(args.produce, args.address, args.name)
    except CellfeedError as exc:
        print(f"cellfeed producer: error: {exc}", file=sys.stderr)
        sys.exit(2)
