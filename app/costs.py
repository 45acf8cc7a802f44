"""Modal's prices and what each of the app's functions asks for, in one place (below `app/` and
`deploy/`: `app/modal_app.py` declares its functions with these asks, `app/report.py` and
`deploy.first_run` price a run with them). Modal bills per second; these are its published list prices
as of 2026 (check modal.com/pricing before budgeting). deploy/README.md's "Costs per hour" table is
computed from here (tests/test_first_run.py checks that it is).
"""

from __future__ import annotations

H100_PER_GPU_HOUR = 3.95  # $ per H100 per hour
CPU_PER_CORE_HOUR = 0.047  # $ per physical core per hour (Modal's cpu=1 is one physical core)
MEMORY_PER_GIB_HOUR = 0.008  # $ per GiB of memory per hour

# what each function's decorator asks for (app/modal_app.py)
SETUP_CPU, SETUP_MEMORY_MB = 2.0, 8192  # many epochs' plans
PRODUCER_CPU, PRODUCER_MEMORY_MB = 4.0, 16_384
# a conversion's slice is one process (one core, measured) holding one chunk of cells; the coordinator
# holds every cell's obs row (~100 bytes a cell: ~10 GB at 100M cells)
CONVERT_CPU, CONVERT_MEMORY_MB = 1.0, 4096
CONVERT_COORDINATOR_CPU, CONVERT_COORDINATOR_MEMORY_MB = 2.0, 32_768
# 8 ranks pop, verify and decompress items and collate batches on the CPU (Modal's default is 0.125 core)
TRAINER_CPU, TRAINER_MEMORY_MB = 32.0, 131_072


def per_hour(gpus: int = 0, cpu: float = 0.0, memory_gib: float = 0.0) -> float:
    """$/hour of one container with `gpus` H100s, `cpu` physical cores and `memory_gib` GiB."""
    return gpus * H100_PER_GPU_HOUR + cpu * CPU_PER_CORE_HOUR + memory_gib * MEMORY_PER_GIB_HOUR


def functions_per_hour(gpus: int) -> dict[str, float]:
    """$/hour of each of the app's functions: `train` on `gpus` H100s (with its cores and memory), one
    `produce` container, `setup`."""
    return {
        "train": per_hour(gpus, TRAINER_CPU, TRAINER_MEMORY_MB / 1024),
        "produce": per_hour(0, PRODUCER_CPU, PRODUCER_MEMORY_MB / 1024),
        "setup": per_hour(0, SETUP_CPU, SETUP_MEMORY_MB / 1024),
    }
