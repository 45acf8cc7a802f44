"""A campaign on several nodes (`--nodes K`): Modal runs `train` as a clustered function of K
containers started together (`modal.clustered(size=K)`; each gets its rank and every container's
address from `modal.experimental.get_cluster_info()`). Container 0 is the campaign's `train` as on
one node (setup check, producers, the driver in its rank 0, the status, hand-overs) and publishes
where its DDP world meets, with the ranks' config, in the run's Dict; every other container starts
its node's ranks there (`node_body`) and ends with them. One DDP world of K x --gpus ranks.

What Modal's client source says (modal 1.6.4, `_partial_function.py:808-845`, `_cluster.py`): an
input is broadcast to every container of the cluster and rank 0's output is the call's. What it
does not say (the server decides): what becomes of the cluster when one container fails or is
preempted. The emulator (its S27) and this design take a cluster as one unit: a preemption
interrupts every container (each node's ranks checkpoint together: the request rides on the
step's all-reduce) and the input runs again on a new cluster; a container lost outright fails the
attempt, which `train` (no retries) reports with the command that resumes, on any node count."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

RENDEZVOUS_S = 600.0  # how long a node waits for container 0 to say where the world meets (its setup included)


def rendezvous_key(run: str, cluster_id: str) -> str:
    return f"{run}/rendezvous/{cluster_id}"


def cluster():
    """This container's cluster context (rank, every container's address), or None on one node."""
    import modal.experimental

    return modal.experimental.get_cluster_info()


def meet(store, run: str, here, train_cfg) -> tuple[str, int]:
    """(container 0) Where the world meets: this container's address and a free port, published with
    the ranks' config for the other containers."""
    from coordination.net import free_port

    master = (here.container_ips[0], free_port(here.container_ips[0]))  # (an IPv6 address on Modal)
    store.put(rendezvous_key(run, here.cluster_id), json.dumps({"master": master, "train": asdict(train_cfg)}))
    return master


def node_body(config: dict, here, gpus: int, nodes: int, commit, save_s: float) -> dict:
    """(containers 1..K-1) Start this node's ranks at container 0's meeting point, wait for them;
    on a preemption (SIGINT: every process of the container has it, the ranks too) let them
    checkpoint for `save_s`. The Volume is committed at the end either way (`commit`): this node's
    ranks wrote their part of each checkpoint there."""
    import tempfile
    from pathlib import Path

    from app.config import CampaignConfig
    from coordination.backends import connect
    from coordination.errors import CellfeedError
    from trainer.config import TrainConfig
    from trainer.launch import launch
    from trainer.ranks import checkpoint_and_stop, wait_all

    cfg = CampaignConfig(**config)
    _, store = connect(cfg.backend_spec("modal"))
    deadline, found = time.monotonic() + RENDEZVOUS_S, None
    while found is None and time.monotonic() < deadline:
        found = store.get(rendezvous_key(cfg.run, here.cluster_id))
        time.sleep(0 if found else 1.0)
    if found is None:
        raise CellfeedError(f"node {here.rank}: container 0 published no meeting point in {RENDEZVOUS_S:.0f}s")
    meeting = json.loads(found)
    workdir = Path(tempfile.gettempdir()) / "cellfeed" / cfg.run
    ranks = launch(
        TrainConfig(**meeting["train"]), gpus, workdir, node=here.rank, nodes=nodes, master=tuple(meeting["master"])
    )
    try:
        codes = wait_all(ranks, timeout=24 * 3600)
    except KeyboardInterrupt:  # preempted with the whole cluster
        checkpoint_and_stop(ranks, timeout=save_s)
        commit()
        raise
    commit()
    if any(codes):
        raise CellfeedError(f"node {here.rank}: its ranks exited {codes}")
    return {"node": here.rank, "codes": codes}
