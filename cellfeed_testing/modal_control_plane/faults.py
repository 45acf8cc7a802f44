"""Faults where Modal's network has them: a layer around the servicer's handlers (README, "Faults").

The layer wraps each handler of `Servicer.__mapping__()` (grpclib's `Handler` tuples) that carries a
Queue, Dict, spawn, call or Volume request from a client (the laptop, or a function's body in a
container); the semantic files (objects.py, calls.py, volumes.py) stay as they are. A container's
own traffic with the plane (hello, heartbeats, inputs, outputs, logs) is never faulted. Every rule
fires on an EVENT: the (after+1)-th request matching it, counted from when the rule was added; no
rule looks at the clock.

- `grpc_burst`: from the (after+1)-th matching request, each matching request fails, unapplied,
  with `status` (UNAVAILABLE by default), for `calls` requests. A request the client retries is a
  new matching request: Modal's client makes 4 attempts (`Retry()`: `max_retries=3`, 0.1/0.2/0.4 s
  apart: modal/_utils/grpc_utils.py:207, 499-509, 742, 771-772) on the statuses of
  `RETRYABLE_GRPC_STATUS_CODES` (grpc_utils.py:199-205, 740), so `calls` > 4 on one caller reaches
  it as `ServiceError` (UNAVAILABLE, DEADLINE_EXCEEDED, UNKNOWN, CANCELLED) or `InternalError`
  (INTERNAL) (modal/_grpc_client.py:27-44). RESOURCE_EXHAUSTED is retried only by the calls that
  add it (a blocking put, queue.py:687-695; `spawn_map`; a container's outputs): elsewhere it is
  `ResourceExhaustedError` at once.
- `lost_reply`: the (after+1)-th matching request that takes something (a QueueGet that returns
  items, a DictPop that finds its key, a FunctionGetOutputs that returns the output; a FunctionMap,
  or any other request, always) is APPLIED, and its reply is never sent: the server resets the HTTP/2
  stream (RST_STREAM, grpclib's `Stream.cancel`), which is what the client sees when the connection
  carrying a reply is lost: no message and no status. grpclib raises `StreamTerminatedError`, which
  Modal's client retries like a retryable status (grpc_utils.py:676-683) with the SAME
  `x-idempotency-key` and the next `x-retry-attempt` (grpc_utils.py:638, 651-656); after its last
  attempt it raises the `StreamTerminatedError` itself (grpc_utils.py:596: not a modal exception).
  The plane, like the semantic files, does not deduplicate on the key: nothing in the client shows
  that Modal's server does, and the client keeps no reply, so the retry is a new request (a get
  takes the NEXT items; a spawn makes a second call). `calls` replies are lost (default 1): the
  client's retries of a lost reply are matching requests too, so `calls` > 4 reaches the caller.
- `latency`: each matching request waits `delay_s` before it is applied (its reply comes that much
  later), for `calls` requests.
- `connection_reset`: the (after+1)-th matching request's connection is aborted (a TCP RST) before
  it is applied, for `calls` requests (default 1): it and every other request in flight on that
  connection (a container's own too) end with no reply and no status: grpclib's client fails each
  with `StreamTerminatedError("Connection lost")` (grpclib/protocol.py:477-479, 564, 741-742), which
  Modal's client retries (grpc_utils.py:676-683) on a new connection (grpclib's Channel connects
  again once its connection is lost: grpclib/client.py:66-75, 736-741).

Targets and what narrows them: `queue` (QueueGet/Put/Len/Clear/GetOrCreate/GetById/Delete/Heartbeat;
`op` get, put, len, clear, lookup, delete, heartbeat; `partition`: partition keys starting with it),
`dict` (`op` get, put, pop, contains, len, keys, clear, lookup, delete, heartbeat), `spawn`
(FunctionMap), `call` (FunctionGetOutputs, `op` get; FunctionCallCancel, `op` cancel), `volume`
(`op` commit, reload, read, list, remove); `function`: for spawn and call, the function's name as
defined (`train`, `produce`).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import asdict, dataclass, field

from grpclib.const import Handler, Status
from grpclib.exceptions import GRPCError
from modal_proto import api_pb2

from cellfeed_testing.modal_control_plane.containers import TASK_HEADER

KINDS = ("grpc_burst", "lost_reply", "latency", "connection_reset")
DROP_WAIT_S = 10.0  # a dropped connection's handler is cancelled within a loop turn (grpclib's connection_lost)
# the statuses modal's client retries (grpc_utils.py:199-205), and RESOURCE_EXHAUSTED (retried where added)
STATUSES = ("UNAVAILABLE", "INTERNAL", "DEADLINE_EXCEEDED", "UNKNOWN", "CANCELLED", "RESOURCE_EXHAUSTED")
RPCS = {
    "queue": {
        "QueueGet": "get",
        "QueuePut": "put",
        "QueueLen": "len",
        "QueueClear": "clear",
        "QueueGetOrCreate": "lookup",
        "QueueGetById": "lookup",
        "QueueDelete": "delete",
        "QueueHeartbeat": "heartbeat",
    },
    "dict": {
        "DictGet": "get",
        "DictUpdate": "put",
        "DictPop": "pop",
        "DictContains": "contains",
        "DictLen": "len",
        "DictContents": "keys",
        "DictClear": "clear",
        "DictGetOrCreate": "lookup",
        "DictGetById": "lookup",
        "DictDelete": "delete",
        "DictHeartbeat": "heartbeat",
    },
    "spawn": {"FunctionMap": "spawn"},
    "call": {"FunctionGetOutputs": "get", "FunctionCallCancel": "cancel"},
    "volume": {
        "VolumeCommit": "commit",
        "VolumeReload": "reload",
        "VolumeGetFile2": "read",
        "VolumeListFiles": "list",
        "VolumeListFiles2": "list",
        "VolumeRemoveFile": "remove",
        "VolumeRemoveFile2": "remove",
    },
}
TARGET_OF = {rpc: (target, op) for target, rpcs in RPCS.items() for rpc, op in rpcs.items()}
EVENTS_KEPT = 50  # a rule keeps its first hits' details (which request, from where)


@dataclass
class Rule:
    kind: str
    target: str
    after: int = 0
    calls: int | None = None
    status: str = "UNAVAILABLE"
    partition: str | None = None
    op: str | None = None
    function: str | None = None
    delay_s: float = 0.0
    # what it did
    seen: int = 0  # matching requests since it was added (the client's retries included)
    hits: int = 0  # requests failed, replies lost, or requests delayed
    items_lost: int = 0  # lost_reply: queue items, dict entries, calls made, outputs, in replies never sent
    done: bool = False
    keys_hit: int = 0  # distinct x-idempotency-keys among the hits: the client calls it touched
    retries_seen: int = 0  # later requests carrying a hit's key: the client's own retries of a touched call
    recovered: int = 0  # touched client calls whose retry was later answered (the rest reached the caller)
    calls_made: list = field(default_factory=list)  # lost_reply on spawn: the call ids the client never learnt
    events: list = field(default_factory=list)  # [{rpc, from, attempt, key, items}] of its first hits

    def validate(self) -> "Rule":
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r}: one of {KINDS}")
        if self.target not in RPCS:
            raise ValueError(f"fault target {self.target!r}: one of {tuple(RPCS)}")
        ops = set(RPCS[self.target].values())
        if self.op is not None and self.op not in ops:
            raise ValueError(f"op {self.op!r} of {self.target}: one of {sorted(ops)}")
        if self.partition is not None and self.target != "queue":
            raise ValueError("partition= narrows queue requests only")
        if self.function is not None and self.target not in ("spawn", "call"):
            raise ValueError("function= narrows spawn and call requests only")
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r}: one Modal's client retries, {STATUSES}")
        if self.kind in ("lost_reply", "connection_reset"):
            self.calls = 1 if self.calls is None else self.calls
        elif self.calls is None:
            raise ValueError(f"a {self.kind} needs calls= (how many requests it lasts)")
        if self.calls < 1 or self.after < 0:
            raise ValueError("calls >= 1 and after >= 0")
        if self.kind == "latency" and self.delay_s <= 0:
            raise ValueError("a latency needs delay_s > 0")
        return self


def _took(reply) -> int:
    """What a reply hands over, for a lost reply (0: nothing was taken, the rule waits for the next)."""
    if isinstance(reply, api_pb2.QueueGetResponse):
        return len(reply.values)
    if isinstance(reply, api_pb2.DictPopResponse):
        return int(reply.found)
    if isinstance(reply, api_pb2.FunctionGetOutputsResponse):
        return len(reply.outputs)
    return 1  # a FunctionMap made its call; any other request was applied


class Faults:
    """The rules and the wrapped handlers. `function_name(function_id)` names a FunctionMap's
    function; `call_function(call_id)` a call's (both read the servicer's tables on its loop)."""

    def __init__(self, function_name=lambda fid: None, call_function=lambda cid: None) -> None:
        self.rules: list[Rule] = []
        self.lock = threading.Lock()  # rules are added and read from other threads
        self._function_name, self._call_function = function_name, call_function
        self._touched: dict[str, list[Rule]] = {}  # an idempotency key hit -> the rules that hit it

    def add(self, kind: str, target: str, **spec) -> int:
        rule = Rule(kind, target, **spec).validate()
        with self.lock:
            self.rules.append(rule)
            return len(self.rules) - 1

    def describe(self) -> list[dict]:
        with self.lock:
            return [asdict(r) for r in self.rules]

    def wrap(self, mapping: dict) -> dict:
        """`Servicer.__mapping__()` with the handlers of faultable RPCs wrapped."""
        out = {}
        for path, handler in mapping.items():
            rpc = path.rsplit("/", 1)[-1]
            if rpc in TARGET_OF:
                handler = Handler(self._wrapped(rpc, handler.func), *handler[1:])
            out[path] = handler
        return out

    def _wrapped(self, rpc: str, func):
        async def handler(stream) -> None:
            faulted = _FaultedStream(stream, self, rpc)
            await func(faulted)
            if faulted.lost:
                await stream.cancel()  # RST_STREAM: the reply never comes, nor a status

        handler.__name__ = handler.__qualname__ = rpc
        return handler

    # ---- on the plane's loop, for each request

    def _describe_request(self, rpc: str, req) -> tuple[str, str, str | None, str | None]:
        target, op = TARGET_OF[rpc]
        partition = req.partition_key.decode(errors="replace") if hasattr(req, "partition_key") else None
        function = None
        if rpc == "FunctionMap":
            function = self._function_name(req.function_id)
        elif target == "call":
            function = self._call_function(req.function_call_id)
        return target, op, partition, function

    def before(self, rpc: str, req, metadata) -> tuple[Rule | None, float, Rule | None]:
        """(the burst failing this request, the delay before it is applied, a lost-reply rule armed for it)."""
        target, op, partition, function = self._describe_request(rpc, req)
        key = (metadata or {}).get("x-idempotency-key")
        fail, delay, lose = None, 0.0, None
        with self.lock:
            touched = self._touched.get(key, []) if key else []
            for rule in touched:
                rule.retries_seen += 1
            for rule in self.rules:
                if rule.done or rule.target != target or (rule.op is not None and rule.op != op):
                    continue
                if rule.partition is not None and not (partition or "").startswith(rule.partition):
                    continue
                if rule.function is not None and rule.function != function:
                    continue
                rule.seen += 1
                if rule.seen <= rule.after:
                    continue
                if rule.kind == "lost_reply":
                    lose = lose or rule
                elif rule.kind == "latency":
                    delay = max(delay, rule.delay_s)
                    self._hit(rule, rpc, metadata, 0)
                elif fail is None:
                    fail = rule
                    self._hit(rule, rpc, metadata, 0)
        return fail, delay, lose

    def answered(self, key: str | None) -> None:
        """A request went through unfaulted: a touched client call it retries has recovered."""
        if not key:
            return
        with self.lock:
            for rule in self._touched.pop(key, []):
                if rule.kind != "latency":
                    rule.recovered += 1

    def lost(self, rule: Rule, rpc: str, reply, metadata) -> bool:
        """After an armed request was applied: is this reply lost? Only one that took something is."""
        items = _took(reply)
        if not items:
            return False
        with self.lock:
            if rule.done:
                return False
            rule.items_lost += items
            if isinstance(reply, api_pb2.FunctionMapResponse):
                rule.calls_made.append(reply.function_call_id)
            self._hit(rule, rpc, metadata, items)
            return True

    def _hit(self, rule: Rule, rpc: str, metadata, items: int) -> None:
        metadata = metadata or {}
        rule.hits += 1
        rule.done = rule.hits >= rule.calls
        key = metadata.get("x-idempotency-key")
        if key and rule not in self._touched.get(key, []):  # (a call another rule touched counts for this one too)
            rule.keys_hit += 1
            self._touched.setdefault(key, []).append(rule)
        if len(rule.events) < EVENTS_KEPT:
            rule.events.append(
                {
                    "rpc": rpc,
                    "from": metadata.get(TASK_HEADER) or "client",  # (a container's requests carry its task id)
                    "attempt": int(metadata.get("x-retry-attempt") or 0),
                    "key": (key or "")[:8],
                    "items": items,
                }
            )


class _FaultedStream:
    """The handler's view of its stream: the request goes through the rules as it is received; a
    reply to be lost is kept back (and, for a server stream, what would follow it)."""

    def __init__(self, stream, faults: Faults, rpc: str) -> None:
        self._stream, self._faults, self._rpc = stream, faults, rpc
        self._lose: Rule | None = None
        self.lost = False

    def __getattr__(self, name):
        return getattr(self._stream, name)

    @property
    def _metadata(self):
        return self._stream.metadata or {}

    async def recv_message(self):
        req = await self._stream.recv_message()
        fail, delay, self._lose = self._faults.before(self._rpc, req, self._metadata)
        if delay:
            await asyncio.sleep(delay)
        if fail is not None and fail.kind == "connection_reset":
            # the TCP connection carrying this request aborts (RST), unapplied: every stream on it ends
            # with no reply, and grpclib's connection_lost cancels their handlers, this one's included
            # (grpclib/protocol.py:741, server.py:534-544)
            self._stream._stream._transport.abort()
            await asyncio.sleep(DROP_WAIT_S)
        if fail is not None:
            raise GRPCError(Status[fail.status], f"injected: {fail.kind} on {fail.target} ({self._rpc})")
        return req

    async def send_message(self, message) -> None:
        if self.lost:
            return
        if self._lose is not None and self._faults.lost(self._lose, self._rpc, message, self._metadata):
            self.lost = True
            return
        self._faults.answered(self._metadata.get("x-idempotency-key"))
        await self._stream.send_message(message)


class FaultLayer:
    """What the grpclib `Server` serves: the servicer's handlers, those of faultable RPCs wrapped by
    `faults` (grpclib reads a service's handlers from its `__mapping__()`: grpclib/server.py:602)."""

    def __init__(self, servicer, faults: Faults) -> None:
        self.servicer, self.faults = servicer, faults

    def __mapping__(self) -> dict:
        return self.faults.wrap(self.servicer.__mapping__())


def faults_for(servicer) -> Faults:
    """A `Faults` that names functions from `servicer`'s tables (FunctionMap's function id, a call's)."""

    def function_name(function_id: str) -> str | None:
        fn = servicer.functions.get(function_id)
        return fn.definition.function_name if fn is not None else None

    def call_function(call_id: str) -> str | None:
        call = servicer.calls.get(call_id)
        return function_name(call.function_id) if call is not None else None

    return Faults(function_name, call_function)
