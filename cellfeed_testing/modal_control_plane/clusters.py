"""Clustered functions (`@modal.clustered(size=K)`): each attempt of an input is K containers started together.

What the client does (modal 1.6.4): `@modal.clustered(size=K, rdma=...)` sets the function's
`_experimental_group_size` to K and `i6pn_enabled` (`_functions.py:1113`, `app.py:1039`); a `with_options`
variant keeps both (the server merges: D9). A container of such a function, once its user code is
imported and before it asks for an input, resolves `i6pn.modal.local` to its own IPv6 address and calls
`TaskClusterHello(task_id, container_ip)`; the reply's `cluster_id`, `cluster_rank` and `container_ips`
(by rank) are what `modal.experimental.get_cluster_info()` then answers (`_container_entrypoint.py:
449-451`, `_cluster.py:146-189`, `experimental/__init__.py:71-72`). The input is broadcast to every
container and rank 0's output is the call's (`_partial_function.py:808-845`, the docstring).

What the client does not say (the server decides), taken as the emulator's S27 took it: a cluster is one
unit. Its containers start together; a hello waits for every container's; a preemption interrupts every
container and the input runs again on a new cluster once all have ended (not counted as a retry, C17); a
container of rank > 0 that fails (a failure output, an exit without an output, killed) fails the attempt,
and the others are killed at once; the function's retries then apply to the cluster as to one container.
When rank 0's output settles the call, the other containers still running end with it (SIGINT, a grace,
SIGKILL). README rows K1-K4.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from modal_proto import api_pb2

from cellfeed_testing.modal_control_plane.containers import I6PN_ADDRESS, Container

HELLO_WAIT_S = 600.0  # K1: how long a container's TaskClusterHello waits for the rest of its cluster


@dataclass
class Cluster:
    cluster_id: str
    size: int
    attempt: int
    members: list[Container] = field(default_factory=list)  # by rank
    ips: dict[int, str] = field(default_factory=dict)  # rank -> the address its hello gave
    all_here: asyncio.Event = field(default_factory=asyncio.Event)


def cluster_size(fn_def: api_pb2.Function) -> int:
    """K1: the containers an attempt of this function runs in (1 for a function not clustered)."""
    return max(1, fn_def._experimental_group_size)


class ClusterRPCs:
    """Mixed into the servicer: `start_attempt(call)` starts one attempt of a call (its one container, or
    its cluster's), and the containers' `TaskClusterHello`."""

    @property
    def failures(self) -> dict[str, int]:
        """K6: function name -> how many of its next attempts are made to fail (`ControlPlane.fail`)."""
        return self.__dict__.setdefault("_failures", {})

    async def start_attempt(self, call) -> None:
        """One attempt of `call`: K6's injected failure decided for the attempt as a whole, then its
        container, or its cluster's K containers, ranks in start order (K1)."""
        fn = self.functions[call.function_id]
        name = fn.definition.function_name
        if self.failures.get(name, 0) > 0:  # K6: the next attempts of this function fail before their body
            self.failures[name] -= 1
            call.failing_attempts.add(call.attempt)
        size = cluster_size(fn.definition)
        if size == 1:
            await self.start_container(call)
            return
        cluster = Cluster(self.new_id("cu"), size, call.attempt)
        for rank in range(size):
            c = await self.start_container(call)
            c.cluster, c.rank = cluster, rank  # (before the container can ask: no await since it started)
            cluster.members.append(c)

    async def TaskClusterHello(self, stream) -> None:
        """K1/K2: the container's rank and every container's address by rank, once all have said hello."""
        req: api_pb2.TaskClusterHelloRequest = await stream.recv_message()
        c = self._container(stream)
        cluster: Cluster | None = c.cluster
        if cluster is None:
            raise GRPCError(Status.FAILED_PRECONDITION, f"container {c.task_id} is not part of a cluster")
        cluster.ips[c.rank] = req.container_ip or I6PN_ADDRESS
        if len(cluster.ips) == cluster.size:
            cluster.all_here.set()
        try:
            await asyncio.wait_for(cluster.all_here.wait(), HELLO_WAIT_S)
        except asyncio.TimeoutError:
            raise GRPCError(
                Status.FAILED_PRECONDITION,
                f"cluster {cluster.cluster_id}: {cluster.size - len(cluster.ips)} containers never said hello",
            ) from None
        await stream.send_message(
            api_pb2.TaskClusterHelloResponse(
                cluster_id=cluster.cluster_id,
                cluster_rank=c.rank,
                container_ips=[cluster.ips[r] for r in range(cluster.size)],
                container_ipv4_ips=["127.0.0.1"] * cluster.size,
            )
        )

    def attempt_members(self, call, attempt: int) -> list[Container]:
        return [x for x in call.containers if x.attempt == attempt]

    async def lose_container(self, call_id: str, rank: int) -> str:
        """K4: the container of `rank` in the call's running attempt is lost (its host gone): SIGKILL to
        its every process, no grace. Returns its task id."""
        call = self._call(call_id)
        members = [x for x in self.attempt_members(call, call.attempt) if not x.ended.is_set()]
        found = [x for x in members if x.rank == rank]
        if call.output is not None or not found:
            raise ValueError(f"call {call_id} has no running container of rank {rank}")
        await self.containers.kill(found[0], "lost", grace_s=0)
        return found[0].task_id

    async def history(self, function: str | None = None) -> list[dict]:
        """`ControlPlane.history`: every call's resources and its attempts, each with its containers."""
        out = []
        for call in list(self.calls.values()):
            fn = self.functions.get(call.function_id)
            d = fn.definition if fn else api_pb2.Function()
            if function is not None and d.function_name != function:
                continue
            r, result = d.resources, call.output.result if call.output is not None else None
            status = "running" if result is None else call.outcomes.get(call.attempt, "failure")
            attempts = []
            for attempt in range(call.attempt + 1):
                members = sorted(self.attempt_members(call, attempt), key=lambda x: x.rank)
                if not members:
                    continue
                cluster = members[0].cluster
                attempts.append(
                    {
                        "outcome": call.outcomes.get(attempt, "running"),
                        # K2: the addresses the cluster's hellos gave, by rank (what `container_ips` answered)
                        "cluster_ips": [cluster.ips.get(r, "") for r in range(cluster.size)] if cluster else [],
                        "containers": [
                            {
                                "task": x.task_id,
                                "pid": x.proc.pid if x.proc else None,
                                "rank": x.rank,
                                "exit_code": x.exit_code,
                                "killed": x.killed_why,
                                "interrupted_processes": x.interrupted,
                            }
                            for x in members
                        ],
                    }
                )
            out.append(
                {
                    "id": call.call_id,
                    "function": d.function_name,
                    "status": status,
                    "error": result.exception if result is not None else "",
                    "gpu": f"{r.gpu_config.gpu_type}:{r.gpu_config.count}" if r.gpu_config.count else "",
                    "cpu": r.milli_cpu / 1000,
                    "memory": r.memory_mb,
                    "timeout_s": d.timeout_secs,
                    "cluster_size": cluster_size(d),
                    "attempts": attempts,
                }
            )
        return out
