"""A `train` call's work around its ranks, in the GPU container (`app/modal_app.py:train_body` tells the
story, and its docstring how a call ends): the ranks' config (`ranks_config`), the monitor that
publishes the campaign's status (`started_monitor`), the watch over the ranks and the producer calls
(`watch`), and the ways a campaign stops: a stop asked (`stopped`), its end (`end_campaign`), a real
failure (`stop_campaign`)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from app.config import CampaignConfig
from app.modal_calls import Fleet, release_claim
from app.resume import resume_command

STOP_GRACE_S = 60.0  # at the end: how long all producers together get to stop before being cancelled
NO_DATA_S = 600.0  # a rank with no data this long (past --modal-retry-s of retries) fails: are producers running?
FAILURE_SAVE_S = 10.0  # after a real failure: ranks still stepping checkpoint; starved ones (no step to end) are killed
FLEET_CHECK_S = 15.0  # how often `train` looks at its producer calls (soon after the start, then less often)
FIRST_FLEET_CHECK_S = 1.0  # a producer that cannot start (settings, credentials) is found within seconds
STATUS_EVERY_S = 5.0  # how often `train` publishes its status (2 Dict calls, a len per rank)
STOP_LOOK_S = 1.0  # how often `train` looks for a stop request (a Dict get): a stop lands within about this long


def ranks_config(cfg: CampaignConfig, facts):
    """The ranks' config (`trainer.config.TrainConfig`) and their step log. The step log is on the
    Volume, as a local run's in its folder: a resumed call appends to it, so the status and the report
    (the snapshot's audits) keep every epoch, not only this call's."""
    log, tb = Path(cfg.run_checkpoint_dir) / "steps.jsonl", f"{cfg.run_checkpoint_dir}/tb"
    if not cfg.resume:  # (a new campaign: no earlier run's steps)
        log.unlink(missing_ok=True)
    cells_log = {}
    if cfg.audit_cells:  # one file set per train call (a preempted call's steps past its checkpoint are re-trained)
        (Path(cfg.run_checkpoint_dir) / "cells").mkdir(parents=True, exist_ok=True)
        cells_log = {"cells_log": f"{cfg.run_checkpoint_dir}/cells/{time.time_ns()}"}
    # a rank (or the driver) waits out an outage inside the calls' retries: its no-data wait outlasts them
    no_data = {"no_data_timeout_s": max(NO_DATA_S, cfg.modal_retry_s + NO_DATA_S)}
    train_cfg = cfg.train_config(
        cfg.backend_spec("modal"),
        facts,
        log_path=str(log),
        tb_dir=tb,  # (on the Volume: TensorBoard and `cellfeed report` read it there)
        **cells_log,
        **no_data,
    )
    return train_cfg, log


def started_monitor(cfg: CampaignConfig, facts, queue, store, fleet: Fleet, train_cfg, log: Path, resume: str, step):
    """The campaign's monitor, its journal told this call started (or resumed, at `step`), and its
    first status published before any rank starts (`cellfeed status` answers from step 1)."""
    from app.journal import DictJournal
    from app.monitor import Monitor

    journal = DictJournal(store, cfg.run, folder=cfg.run_checkpoint_dir)  # (the Dict now, the Volume at the end)
    monitor = Monitor(
        cfg, facts, queue, store, journal, log, list(fleet.calls), resume, train_cfg.tb_dir, STATUS_EVERY_S,
        stop_every_s=STOP_LOOK_S,
    )  # fmt: skip
    monitor.journal.event("resumed" if cfg.resume else "started", step=step, ranks=cfg.world_size)
    monitor.look()
    return monitor


def watch(ranks, fleet: Fleet, deadline: float, monitor) -> None:
    """Until the ranks exit: a failed rank or producer raises; at `deadline`, or when a stop is asked
    (`monitor`), the ranks are asked to checkpoint and stop (at the deadline the call then hands
    over to a new one). The producer calls are looked at after 1 s, then at doubling gaps up to
    FLEET_CHECK_S: most failures come at the start."""
    from trainer.ranks import ask_to_stop

    asked, gap = False, FIRST_FLEET_CHECK_S
    next_look = time.monotonic() + gap
    while True:
        codes = [p.poll() for p in ranks]
        if any(c not in (None, 0) for c in codes):
            raise RuntimeError(f"trainer ranks exited {codes}; their output is in the function's logs")
        if all(c == 0 for c in codes):
            return
        monitor.look()  # (its status every STATUS_EVERY_S, and whether a stop was asked)
        if monitor.asked and not asked:
            print("a stop was asked (cellfeed stop): the ranks checkpoint and the campaign stops", flush=True)
            ask_to_stop(ranks)
            asked = True
        if not asked and time.monotonic() > deadline:
            print("this call's time is nearly up: the ranks checkpoint and a new call continues", flush=True)
            ask_to_stop(ranks)
            asked = True
        if time.monotonic() >= next_look:
            fleet.check()
            gap = min(2 * gap, FLEET_CHECK_S)
            next_look = time.monotonic() + gap
        time.sleep(0.5)


def stopped(cfg: CampaignConfig, fleet: Fleet, store, monitor, call_id: str, commit) -> None:
    """`cellfeed stop`, once the ranks have checkpointed: the campaign stops, its state kept (the
    producers are told to stop; the run's queue and dicts stay for --resume)."""
    from coordination.routing import stop_key

    monitor.final("stopped")
    store.put(stop_key(cfg.run), "stop")  # (the producers)
    fleet.stop(STOP_GRACE_S, cfg.modal_retry_s)
    commit()
    release_claim(store, cfg.run, call_id)


def end_campaign(cfg: CampaignConfig, fleet: Fleet, facts, store) -> None:
    """Only at the campaign's real end: stop the producers, delete the run's queue and dicts."""
    from coordination.modal_backend import delete_run_backends
    from coordination.routing import stop_key

    store.put(stop_key(cfg.run), "stop")
    fleet.stop(STOP_GRACE_S, cfg.modal_retry_s)
    delete_run_backends(cfg.run, facts.epochs, retry_s=cfg.modal_retry_s)


def stop_campaign(cfg: CampaignConfig, config: dict, ranks, fleet: Fleet, store, monitor, call_id: str, error) -> None:
    """After a real failure: the ranks still stepping checkpoint (a broken DDP is killed), the status
    says so, the producers are stopped (best effort: Modal's network may be what failed), the queue,
    plans and checkpoints are kept, the resume command is said, and the run's claim released."""
    from coordination.modal_backend import ModalUnreachable
    from coordination.routing import stop_key
    from trainer.ranks import checkpoint_and_stop

    checkpoint_and_stop(ranks, timeout=FAILURE_SAVE_S)  # healthy ranks save a checkpoint; a broken DDP is killed
    if not isinstance(error, ModalUnreachable):  # (Modal's network may be what failed)
        monitor.final("failed")
    if fleet is not None and not isinstance(error, ModalUnreachable):
        try:
            store.put(stop_key(cfg.run), "stop")  # (a resume's setup clears it)
            fleet.stop(STOP_GRACE_S, retry=60.0)
        except Exception as exc:  # noqa: BLE001 - the failure being reported matters more
            print(
                f"could not stop the producers ({type(exc).__name__}: {exc}); each stops after an idle hour", flush=True
            )
    print(
        f"the campaign stopped; its queue, plans and checkpoints are kept. Resume it with:\n  "
        f"{resume_command(CampaignConfig(**config))}",
        flush=True,
    )  # (the laptop's file paths, not this container's)
    with contextlib.suppress(Exception):  # (Modal's network may be what failed: the claim then goes stale)
        release_claim(store, cfg.run, call_id)
