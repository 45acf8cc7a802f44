"""Function calls: an input's life from `spawn`/`remote` to its output, and the container RPCs that carry it.

Laptop side: FunctionMap with the input pipelined (_functions.py:176-230: one input, so no
FunctionPutInputs follows), FunctionGetOutputs polled with a timeout (_functions.py:247-285),
FunctionCallCancel (_functions.py:2535), FunctionGetCallGraph (_functions.py:2514).
Container side (modal/_runtime/container_io_manager.py): ContainerHello (643), ContainerHeartbeat
(698; its reply carries cancellations), FunctionGetInputs (875), FunctionPutOutputs (970), TaskResult
(a failure before or outside an input: `_runtime/task_lifecycle_manager`), ContainerStop.

Each attempt of an input is one container (`single_use_containers`: the entrypoint returns after its
first input, container_io_manager.py:925-927). Retries are the server's: the plane tells the client
`sync_client_retries_enabled=False` (_functions.py:313-320), so `.remote()` and `.get()` just wait for
the final output, and the plane starts the next attempt (C14).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from google.protobuf.empty_pb2 import Empty
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from modal_proto import api_pb2

from cellfeed_testing.modal_control_plane.containers import Container

GenericResult = api_pb2.GenericResult
PREEMPTED = "preempted"
PREEMPT_GRACE_S = 30.0  # C17: Modal's preemption guide: SIGINT, about 30 s, then SIGKILL (emulator S15)
OUTPUTS_WAIT_MAX_S = 60.0  # one FunctionGetOutputs waits at most this long (the client asks 55 s: OUTPUTS_TIMEOUT)


@dataclass
class Call:
    call_id: str
    function_id: str
    app_id: str
    input_id: str
    input: api_pb2.FunctionInput
    invocation_type: int
    retries_left: int
    retry_delay_s: float
    attempt: int = 0  # the container running it now: 0 for the first, +1 for each retry or preemption
    retry_count: int = 0  # the retries spent (a preemption spends none: C17)
    output: api_pb2.FunctionGetOutputsItem | None = None
    cancelled: bool = False
    containers: list[Container] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcomes: dict[int, str] = field(default_factory=dict)  # attempt -> preempted, failure, timeout, success, ...
    failing_attempts: set[int] = field(default_factory=set)  # K6: attempts made to fail before their body runs


def _retry_policy(fn_def: api_pb2.Function) -> tuple[int, float]:
    """C14: `retries=N` is N more attempts after a failure or a timeout, `initial_delay_ms` apart (the
    client's `Retries` defaults: 1 s, coefficient 1: modal/retries.py:52-141)."""
    p = fn_def.retry_policy
    return p.retries, (p.initial_delay_ms or 1000) / 1000.0


class CallRPCs:
    """Mixed into the servicer, which provides `self.calls`, `self.containers`, `self.functions`, and
    `start_container(call)` (server.py: it knows mounts, secrets and volumes)."""

    calls: dict[str, Call]

    def _call(self, call_id: str) -> Call:
        call = self.calls.get(call_id)
        if call is None:
            raise GRPCError(Status.NOT_FOUND, f"Function call {call_id} not found")
        return call

    # ---- laptop side

    async def FunctionMap(self, stream) -> None:
        req: api_pb2.FunctionMapRequest = await stream.recv_message()
        fn = self.functions.get(req.function_id)
        if fn is None:
            raise GRPCError(Status.NOT_FOUND, f"Function {req.function_id} not found")
        if len(req.pipelined_inputs) != 1:
            raise GRPCError(Status.UNIMPLEMENTED, "FunctionMap without exactly one pipelined input (a .map)")
        item = req.pipelined_inputs[0]
        retries, delay = _retry_policy(fn.definition)
        call = Call(
            self.new_id("fc"),
            fn.function_id,
            fn.app_id,
            self.new_id("in"),
            item.input,
            req.function_call_invocation_type,
            retries,
            delay,
        )
        self.calls[call.call_id] = call
        if self.containers.of(stream) is None and call.app_id in self.apps:  # made by the app's client (D12)
            self.apps[call.app_id].client_calls.append(call.call_id)
        await self.start_attempt(call)
        await stream.send_message(
            api_pb2.FunctionMapResponse(
                function_call_id=call.call_id,
                pipelined_inputs=[api_pb2.FunctionPutInputsResponseItem(idx=0, input_id=call.input_id)],
                function_call_jwt=call.call_id,
                retry_policy=fn.definition.retry_policy,
                sync_client_retries_enabled=False,
                max_inputs_outstanding=1000,
            )
        )

    async def FunctionGetOutputs(self, stream) -> None:
        """The call's output once it has one; else, after `timeout`, none (the client polls again)."""
        req: api_pb2.FunctionGetOutputsRequest = await stream.recv_message()
        call = self._call(req.function_call_id)
        try:
            await asyncio.wait_for(call.done.wait(), max(0.0, min(req.timeout, OUTPUTS_WAIT_MAX_S)))
        except asyncio.TimeoutError:
            pass
        if call.output is None:
            await stream.send_message(api_pb2.FunctionGetOutputsResponse(num_unfinished_inputs=1))
        else:
            await stream.send_message(
                api_pb2.FunctionGetOutputsResponse(outputs=[call.output], num_unfinished_inputs=0, last_entry_id="1")
            )

    async def FunctionCallCancel(self, stream) -> None:
        # C13: the running input is cancelled through its container's next heartbeat (a sync body
        # gets InputCancellation: _container_entrypoint.py:255-260); with terminate_containers the
        # container is killed; either way the call ends TERMINATED and `.get()` raises
        req: api_pb2.FunctionCallCancelRequest = await stream.recv_message()
        call = self._call(req.function_call_id)
        if call.output is None:
            call.cancelled = True
            for c in call.containers:
                if not c.ended.is_set():
                    if req.terminate_containers:
                        await self.containers.kill(c, "its call was cancelled", grace_s=0)
                    else:
                        c.cancel_input_ids.append(call.input_id)
        await stream.send_message(Empty())

    async def FunctionGetCallGraph(self, stream) -> None:
        req: api_pb2.FunctionGetCallGraphRequest = await stream.recv_message()
        call = self._call(req.function_call_id)
        done = call.output is not None
        ok = done and call.output.result.status == GenericResult.GENERIC_STATUS_SUCCESS
        await stream.send_message(
            api_pb2.FunctionGetCallGraphResponse(
                function_calls=[
                    api_pb2.FunctionCallInfo(
                        function_call_id=call.call_id,
                        total_inputs=1,
                        succeeded_inputs=int(ok),
                        failed_inputs=int(done and not ok),
                        pending_inputs=int(not done),
                    )
                ]
            )
        )

    # ---- container side

    def _container(self, stream) -> Container:
        c = self.containers.of(stream)
        if c is None:
            raise GRPCError(Status.PERMISSION_DENIED, "a container RPC from no container of this plane")
        return c

    async def ContainerHello(self, stream) -> None:
        await stream.recv_message()
        self._container(stream)
        await stream.send_message(Empty())

    async def ContainerHeartbeat(self, stream) -> None:
        await stream.recv_message()
        c = self._container(stream)
        reply = api_pb2.ContainerHeartbeatResponse()
        if c.cancel_input_ids:
            reply.cancel_input_event.input_ids.extend(c.cancel_input_ids)
            c.cancel_input_ids.clear()
        await stream.send_message(reply)

    async def FunctionGetInputs(self, stream) -> None:
        await stream.recv_message()
        c = self._container(stream)
        call: Call = c.call
        if c.input_given or call.output is not None or call.cancelled:
            # one input a container: anything after it is the kill switch (container_io_manager.py:892-895)
            item = api_pb2.FunctionGetInputsItem(kill_switch=True)
        else:
            c.input_given = True
            item = api_pb2.FunctionGetInputsItem(
                input_id=call.input_id,
                input=call.input,
                function_call_id=call.call_id,
                function_call_invocation_type=call.invocation_type,
                retry_count=c.retry_count,
            )
        await stream.send_message(api_pb2.FunctionGetInputsResponse(inputs=[item]))

    async def FunctionPutOutputs(self, stream) -> None:
        req: api_pb2.FunctionPutOutputsRequest = await stream.recv_message()
        c = self._container(stream)
        for out in req.outputs:
            if out.input_id == c.call.input_id:
                c.output_sent = True
                if c.rank == 0:  # K1: rank 0's output is the call's
                    await self.attempt_ended(c, out.result, out.data_format)
                elif out.result.status != GenericResult.GENERIC_STATUS_SUCCESS:  # K1: the cluster fails with it
                    await self.cluster_failed(c, f"failed: {out.result.exception}".strip())
        await stream.send_message(Empty())

    async def TaskResult(self, stream) -> None:
        # a container reporting its own end; a failure outside any input (its import failed) is the
        # input's failure (function_utils.py:537-541: the server escalates it to the inputs)
        req: api_pb2.TaskResultRequest = await stream.recv_message()
        c = self._container(stream)
        c.task_result = req.result
        if not c.output_sent and req.result.status not in (0, GenericResult.GENERIC_STATUS_SUCCESS):
            c.output_sent = True
            if c.rank > 0:  # K1
                await self.cluster_failed(c, f"failed: {req.result.exception}".strip())
            else:
                await self.attempt_ended(c, req.result, api_pb2.DATA_FORMAT_PICKLE if req.result.data else 0)
        await stream.send_message(Empty())

    async def ContainerStop(self, stream) -> None:
        req: api_pb2.ContainerStopRequest = await stream.recv_message()
        c = self.containers.by_task.get(req.task_id)
        if c is not None:
            await self.containers.kill(c, "ContainerStop")
        await stream.send_message(api_pb2.ContainerStopResponse())

    # ---- an attempt's end, however it came

    async def container_exited(self, c: Container) -> None:
        """C12: a container that ends without an output fails its attempt, so `.get()` never waits forever."""
        call: Call = c.call
        app = self.apps.get(call.app_id)
        if c.killed_why == PREEMPTED and call.output is None and not call.cancelled and not (app and app.stopped):
            # C17: a preempted input runs again on a new container, not counted as a retry; a cluster's
            # once every container of the preempted attempt has ended (K1)
            c.output_sent = True
            members = self.attempt_members(call, c.attempt)
            if c.attempt == call.attempt and all(x.ended.is_set() for x in members):
                call.outcomes[c.attempt] = PREEMPTED
                call.attempt += 1
                await self.start_attempt(call)
            return
        if c.output_sent:
            return
        c.output_sent = True
        if c.rank > 0:  # K1: a container of a cluster ended without an output: the attempt fails with it
            why = f" ({c.killed_why})" if c.killed_why else ""
            await self.cluster_failed(c, f"exited with code {c.exit_code}{why}")
            return
        if c.killed_why.startswith("timeout"):
            result = GenericResult(status=GenericResult.GENERIC_STATUS_TIMEOUT, exception=f"Function {c.killed_why}")
        elif call.cancelled:
            result = GenericResult(status=GenericResult.GENERIC_STATUS_TERMINATED, exception="cancelled")
        else:
            why = c.killed_why or f"exited with code {c.exit_code}"
            result = GenericResult(
                status=GenericResult.GENERIC_STATUS_FAILURE,
                exception=f"container {c.task_id} {why} without an output for input {call.input_id}",
                exitcode=c.exit_code or 0,
            )
        await self.attempt_ended(c, result, 0)

    async def cluster_failed(self, c: Container, why: str) -> None:
        """K1: a container of rank > 0 failed: its cluster's attempt fails, naming it."""
        fn = self.functions.get(c.call.function_id)
        name = fn.definition.function_name if fn else "?"
        result = GenericResult(
            status=GenericResult.GENERIC_STATUS_FAILURE,
            exception=f"{name}: container {c.rank} of its cluster {why}",
            exitcode=c.exit_code or 0,
        )
        await self.attempt_ended(c, result, 0)

    async def attempt_ended(self, c: Container, result: GenericResult, data_format: int) -> None:
        call: Call = c.call
        if call.output is not None or c.attempt != call.attempt:
            return  # a late report of an attempt already settled
        status = result.status
        call.outcomes[c.attempt] = {
            GenericResult.GENERIC_STATUS_SUCCESS: "success",
            GenericResult.GENERIC_STATUS_TIMEOUT: "timeout",
            GenericResult.GENERIC_STATUS_TERMINATED: "cancelled",
        }.get(status, "failure")
        # K1: the rest of a cluster ends with its attempt: at once after a failure, with a grace after rank 0's output
        ok = status == GenericResult.GENERIC_STATUS_SUCCESS
        for x in self.attempt_members(call, c.attempt):
            if x is not c and not x.ended.is_set():
                x.output_sent = x.output_sent or not ok  # (its end is this attempt's, already settled)
                why, grace = ("its cluster's input ended", 5.0) if ok else ("its cluster failed", 0.0)
                asyncio.ensure_future(self.containers.kill(x, why, grace))
        retryable = status in (GenericResult.GENERIC_STATUS_FAILURE, GenericResult.GENERIC_STATUS_TIMEOUT)
        app = self.apps.get(call.app_id)
        if retryable and call.retries_left > 0 and not call.cancelled and not (app and app.stopped):
            call.retries_left -= 1
            call.retry_count += 1
            call.attempt += 1
            asyncio.get_running_loop().call_later(
                call.retry_delay_s, lambda: asyncio.ensure_future(self.start_attempt(call))
            )
            return
        call.output = api_pb2.FunctionGetOutputsItem(
            input_id=call.input_id,
            idx=0,
            result=result,
            data_format=data_format,
            retry_count=c.retry_count,
            task_id=c.task_id,
            output_created_at=time.time(),
        )
        call.done.set()

    async def preempt(self, call_id: str, grace_s: float = PREEMPT_GRACE_S) -> list[str]:
        """C17: preempt the containers running `call_id` now: SIGINT to every process of each (a sync
        body sees KeyboardInterrupt and reports nothing: _runtime/container_io_manager.py:988-994),
        `grace_s`, SIGKILL; the input then runs again on a new container. Returns their task ids."""
        call = self._call(call_id)
        running = [c for c in call.containers if not c.ended.is_set()]
        for c in running:
            c.killed_why = PREEMPTED
        await asyncio.gather(*(self.containers.kill(c, PREEMPTED, grace_s) for c in running))
        return [c.task_id for c in running]
