"""Who sends what where: queue partitions, task and event messages, map keys, item routing.

Items of unit u go to rank u mod W; a stitched cell c to rank c mod W, so every duplicate of an
item reaches the rank that already dropped (or will drop) it by key.

Partitions of the run's queue: `tasks` (driver -> producers: one unit each), `events`
(producers -> driver: units done, units held, running totals; ranks -> driver: units whose items
never arrived, to produce again), `rank-{r}` (items for rank r),
`eval` (the held-out set). Keys of the run's map: each epoch's plan summary, the stop signal,
the producers' totals (published by the driver). Each epoch's stitching state lives in a named
map of its own, `e{epoch}`, dropped whole when the epoch is complete.
"""

from __future__ import annotations

import json

from coordination.seeds import derive_key

TASKS_PARTITION = "tasks"
EVENTS_PARTITION = "events"
EVAL_PARTITION = "eval"  # a fixed held-out set, produced once and read by trainer rank 0


def rank_partition(rank: int) -> str:
    return f"rank-{rank}"


def unit_rank(unit: int, world_size: int) -> int:
    return unit % world_size


def cell_rank(cell: int, world_size: int) -> int:
    return cell % world_size


def run_tag(run: str) -> int:
    """A 64-bit tag of the run id, carried by every item so a consumer rejects another run's data."""
    return derive_key("run", run)


def encode_task(epoch: int, unit: int) -> bytes:
    return json.dumps({"epoch": epoch, "unit": unit}).encode()


def decode_task(data: bytes) -> tuple[int, int]:
    task = json.loads(data)
    return int(task["epoch"]), int(task["unit"])


def encode_event(
    producer: str, *, done=(), held=(), totals: dict | None = None, redo=(), released=(), started: bool = False
) -> bytes:
    """A producer's event: units it finished (`done`) and holds now (`held`), as (epoch, unit)
    pairs, and optionally its running totals. Every event is also a heartbeat. A producer that is
    going away (preempted, failed) names the units it will not finish (`released`): they are issued
    again at once instead of when their lease runs out. A producer's first event says it `started`:
    a process that takes a name an earlier one had (a producer restarted after dying, Modal's retry
    of its call) tells the driver that the earlier one's units are lost. A consumer rank's event
    (`producer` "rank-<r>") asks for units again (`redo`): their items never reached it."""
    return json.dumps(
        {
            "p": producer,
            "done": [list(u) for u in done],
            "held": [list(u) for u in held],
            "totals": totals,
            "redo": [list(u) for u in redo],
            "released": [list(u) for u in released],
            "started": started,
        }
    ).encode()


def decode_event(data: bytes) -> dict:
    event = json.loads(data)
    event["done"] = [tuple(u) for u in event["done"]]
    event["held"] = [tuple(u) for u in event["held"]]
    event["redo"] = [tuple(u) for u in event.get("redo", ())]
    event["released"] = [tuple(u) for u in event.get("released", ())]
    event["started"] = bool(event.get("started"))
    return event


def epoch_map_name(epoch: int) -> str:
    """The named map holding one epoch's stitching state."""
    return f"e{epoch}"


def summary_key(run: str, epoch: int) -> str:
    """Where the setup publishes an epoch's `PlanSummary`."""
    return f"{run}/plan/e{epoch}"


def stop_key(run: str) -> str:
    """Set when the campaign is over (or stopping): the producers stop."""
    return f"{run}/stop"


def stop_asked_key(run: str) -> str:
    """Set by `cellfeed stop RUN --modal`: the trainer checkpoints, then the campaign stops (kept for --resume)."""
    return f"{run}/stop-asked"


def state_key(run: str) -> str:
    """The campaign's latest status snapshot (`app.status.snapshot`), refreshed every few seconds by `train`."""
    return f"{run}/state"


def trainer_key(run: str) -> str:
    """The id of the run's train call: one trainer a run (`app.modal_calls.claim_run`)."""
    return f"{run}/trainer"


def fleet_key(run: str) -> str:
    """The ids of the run's producer function calls (a re-run of `train` reuses them)."""
    return f"{run}/fleet"


def produced_key(run: str) -> str:
    """Per epoch, the units the driver has seen done (a resumed driver does not issue them again)."""
    return f"{run}/produced"


def producers_key(run: str) -> str:
    """Every producer's running totals and when it was last heard (the driver publishes them)."""
    return f"{run}/producers"


def vocab_key(run: str) -> str:
    """Where the setup publishes the campaign's gene vocabulary."""
    return f"{run}/vocab"
