"""Who sends what where: queue partitions, task messages, lease/done keys and item routing.

Items of unit u go to rank u mod W; a stitched cell c to rank c mod W, so every duplicate of an
item reaches the rank that already dropped (or will drop) it by key.
"""

from __future__ import annotations

import json

from coordination.plan import derive_key

TASKS_PARTITION = "tasks"
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


def lease_key(run: str, epoch: int, unit: int) -> str:
    return f"{run}/lease/e{epoch}/u{unit}"


def done_key(run: str, epoch: int, unit: int) -> str:
    return f"{run}/done/e{epoch}/u{unit}"


def stop_key(run: str) -> str:
    return f"{run}/stop"


def producer_report_key(run: str, producer: str) -> str:
    """Where a producer publishes its running totals (read by the local campaign's monitor)."""
    return f"{run}/producer/{producer}"
