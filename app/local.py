"""The local campaign: the whole system on one machine. A queue server process, producer
processes, the setup step, and one DDP trainer process per rank (gloo on CPU), with a live
status line (steps, cells/s, queue depth, producer rates, dataloader wait) and a final summary.

    cellfeed local                     # synthesizes a small atlas first
    cellfeed local --dataset PATH --producers 2 --gpus 2 --steps 100
"""

from __future__ import annotations

import json
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
from coordination.routing import TASKS_PARTITION, producer_report_key, rank_partition, stop_key
from trainer.launch import launch, wait_all

STATUS_EVERY_S = 2.0


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


def status_line(cfg: CampaignConfig, queue, store, log: Path, started: float, total_steps: int,
                producers: list[str]) -> str:
    row = _last_step(log)
    depth = [queue.len(partition=rank_partition(r)) for r in range(cfg.gpus)]
    rates = []
    for name in producers:
        report = store.get(producer_report_key(cfg.run, name))
        if report:
            r = json.loads(report)
            rates.append(r["cells"] / max(1e-9, r["busy_s"]) if r["busy_s"] else 0.0)
    parts = [f"{time.monotonic() - started:6.0f}s"]
    if row:
        parts += [f"step {row['step']}/{total_steps}", f"loss {row['loss']:.3f}", f"{row['cells_per_s']:,.0f} cells/s",
                  f"wait {row['wait_ms']:.0f}ms"]
    else:
        parts += ["starting"]
    parts += [f"queue {'+'.join(map(str, depth))} items (tasks {queue.len(partition=TASKS_PARTITION)})",
              f"producers {' '.join(f'{r:,.0f}' for r in rates) or '-'} cells/s busy"]
    return " | ".join(parts)


def run_local(cfg: CampaignConfig, workdir: str | Path = "runs", quiet: bool = False) -> dict:
    """Run a whole campaign locally; returns the trainer's summary (rank 0)."""
    cfg.validate()
    workdir = Path(workdir) / cfg.run
    workdir.mkdir(parents=True, exist_ok=True)
    if not Path(cfg.checkpoint_dir).is_absolute():
        cfg.checkpoint_dir = str(workdir.parent / cfg.checkpoint_dir)
    server = ServerProcess()
    backend = {"kind": "local", "address": server.address}
    queue, store = connect(backend)
    producers: list[subprocess.Popen] = []
    try:
        facts = prepare(cfg, queue, store)
        total_steps = cfg.steps or facts["steps_per_epoch"] * cfg.epochs
        print(f"campaign {cfg.run}: {facts['cells_per_epoch']:,} cells/epoch in {facts['units_per_epoch']} units, "
              f"{cfg.producers} producers, {cfg.gpus} ranks (gloo, CPU), {total_steps} steps of {cfg.batch_size}"
              + (f", {facts['held_out_cells']} held-out cells" if facts["held_out_cells"] else ""))
        config_path = workdir / "campaign.json"
        config_path.write_text(json.dumps(asdict(cfg)))
        producers = start_producers(config_path, server.address, cfg.producers)
        log = workdir / "steps.jsonl"
        log.unlink(missing_ok=True)
        train_cfg = cfg.train_config(backend, facts, log_path=str(log), progress_bar=False)
        ranks = launch(train_cfg, cfg.gpus, workdir, summary_path=str(workdir / "summary"), log_ranks=True)
        started = time.monotonic()
        names = [f"producer-{i}" for i in range(cfg.producers)]
        while any(p.poll() is None for p in ranks):
            if any(p.poll() not in (None, 0) for p in ranks + producers):
                break
            if not quiet:
                print(status_line(cfg, queue, store, log, started, total_steps, names), flush=True)
            time.sleep(STATUS_EVERY_S)
        codes = wait_all(ranks, timeout=60)
        failed = [p for p in producers if p.poll() not in (None, 0)]
        if codes != [0] * cfg.gpus or failed:
            raise CellfeedError(f"the campaign failed: trainer ranks exited {codes}, "
                                f"{len(failed)} producer(s) failed; rank logs are in {workdir}")
        summary = json.loads((workdir / "summary.rank0").read_text())
        summary["producers"] = [json.loads(store.get(producer_report_key(cfg.run, n)) or "{}") for n in names]
        return summary
    finally:
        stop_campaign(store, cfg.run, producers, server)


def start_producers(config_path: Path, address: str, n: int) -> list[subprocess.Popen]:
    """n producer processes (`producer-0`, ...) for the campaign config at `config_path`."""
    return [subprocess.Popen([sys.executable, "-m", "app.local", "--produce", str(config_path), "--address", address,
                              "--name", f"producer-{i}"]) for i in range(n)]


def stop_campaign(store, run: str, producers: list[subprocess.Popen], server: ServerProcess) -> None:
    """Signal the producers to stop, give them a moment to finish, then stop the queue server."""
    try:
        store.put(stop_key(run), "stop")
    except CellfeedError:
        pass  # the server is already gone
    for p in producers:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
    server.close()


def print_summary(summary: dict, workdir: Path) -> None:
    produced = sum(p.get("cells", 0) for p in summary["producers"])
    busy = sum(p.get("busy_s", 0) for p in summary["producers"])
    print(f"\nproducers: {produced:,} cells in {busy:.1f} busy seconds "
          f"({produced / max(busy, 1e-9):,.0f} cells/s per busy producer)")
    print(f"trainer: {summary['steps']} steps, loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
          f"{summary['cells_per_s']:,.0f} cells/s, median step {summary['median_step_s'] * 1000:.1f} ms, "
          f"median dataloader wait {summary['median_wait_ms']:.1f} ms")
    for e in summary.get("eval", []):
        print(f"  held-out at step {e['step']}: masked-bin accuracy {e['eval_accuracy']:.3f}, loss {e['eval_loss']:.3f}")
    print(f"step log: {workdir}/steps.jsonl")


def _produce_main(config_path: str, address: str, name: str) -> None:
    from producers.producer import Producer

    cfg = CampaignConfig(**json.loads(Path(config_path).read_text()))
    queue, store = connect({"kind": "local", "address": address})
    Producer(cfg.producer_config(), queue, store, name=name).run()


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
