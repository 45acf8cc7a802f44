"""S21: a network that fails, as Modal's does, injected into the emulator's server.

Modal's client sends every RPC through `_retry_transient_errors` (modal/_utils/grpc_utils.py:499-509,
632-772): 4 attempts, 0.1 / 0.2 / 0.4 s apart, on UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, UNKNOWN,
CANCELLED, a stream reset or an OSError; then the caller gets `modal.exception.ServiceError` (or
`InternalError`, `ConnectionError`: `_grpc_client.py:27-44`, grpc_utils.py:577-596). A retry carries
the same `x-idempotency-key`, but nothing in the client shows that the server deduplicates on it and
the client keeps no replies (grpc_utils.py:638, 651-656): a retried `QueueGet` whose first reply was
lost returns the *next* items. The emulator takes that worst reading.

Rules (each fires on events: the matching calls counted from when the rule was added):

- `transport`: a burst. From the (after+1)-th matching call, every matching call fails without
  being applied, for `calls` calls or `seconds` on the emulated clock (whichever ends first).
  The client's own retries are matching calls too, so a burst longer than ~0.7 s reaches the caller.
- `lost_reply`: the (after+1)-th matching call that takes something (a queue get that returns items,
  a dict pop that finds its key; any call for other ops) is applied, and its reply is lost. The
  client retries as Modal's does: the retry is a new call (so the items are gone and the caller sees
  the next ones), unless `surface`: then the client's retries fail too and the caller gets the error.
- `spike`: matching calls are answered `delay_s` late, for `calls` calls or `seconds`.

Targets: `queue` (lookups, put, get, len, clear, delete of queues; `partition` narrows to partitions
starting with it, `op` to put, get, len or clear), `dict` (`op` narrows: put, get, pop, contains, keys), `spawn`, `call`
(FunctionCall.get's polls and cancel). The control plane (a test's describe, preempt, advance; a
container fetching its input and reporting its result) never fails.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

KINDS = ("transport", "lost_reply", "spike")
TARGETS = ("queue", "dict", "spawn", "call")


@dataclass
class Rule:
    kind: str
    target: str
    after: int = 0
    calls: int | None = None
    seconds: float | None = None
    delay_s: float = 0.0
    partition: str | None = None
    op: str | None = None
    surface: bool = False
    # state
    seen: int = 0  # matching calls so far
    started: float | None = None  # emulated time the rule fired
    hits: int = 0  # calls failed, replies lost, or calls delayed
    items_lost: int = 0
    done: bool = False

    def validate(self) -> "Rule":
        if self.kind not in KINDS or self.target not in TARGETS:
            raise ValueError(f"fault kind {self.kind!r} / target {self.target!r}: kinds {KINDS}, targets {TARGETS}")
        if self.kind != "lost_reply" and self.calls is None and self.seconds is None:
            raise ValueError(f"a {self.kind} needs calls= or seconds= (how long it lasts)")
        return self


def target_of(h: dict) -> tuple[str | None, str | None, str | None]:
    """(target, partition, dict op) of a request header; target None: never faulted."""
    kind = h.get("op")
    if kind in ("q.put", "q.get", "q.len", "q.clear"):
        return "queue", h.get("partition") or "", kind[2:]
    if kind == "d":
        return "dict", None, h.get("what")
    if kind in ("lookup", "delete"):
        return h.get("kind"), None, kind
    if kind == "f.spawn":
        return "spawn", None, None
    if kind in ("f.poll", "f.cancel"):
        return "call", None, None
    return None, None, None


class Faults:
    def __init__(self, clock):
        self.clock = clock
        self.rules: list[Rule] = []
        self.lock = threading.Lock()

    def add(self, spec: dict) -> int:
        rule = Rule(**spec).validate()
        with self.lock:
            self.rules.append(rule)
            return len(self.rules) - 1

    def _matches(self, rule: Rule, target, partition, op) -> bool:
        if rule.done or rule.target != target:
            return False
        if rule.partition is not None and not (partition or "").startswith(rule.partition):
            return False
        return rule.op is None or rule.op == op

    def _active(self, rule: Rule) -> bool:
        """A burst or spike that has fired: still on? (ends after `calls` hits or `seconds`)."""
        if rule.calls is not None and rule.hits >= rule.calls:
            rule.done = True
        elif rule.seconds is not None and self.clock.now() - rule.started >= rule.seconds:
            rule.done = True
        return not rule.done

    def before(self, h: dict) -> tuple[str | None, float, Rule | None]:
        """Before a request is applied: ("fail" | None, seconds to wait first, a lost-reply rule
        armed for this call)."""
        target, partition, op = target_of(h)
        if target is None:
            return None, 0.0, None
        fail, delay, lose = None, 0.0, None
        with self.lock:
            for rule in self.rules:
                if not self._matches(rule, target, partition, op):
                    continue
                rule.seen += 1
                if rule.seen <= rule.after:
                    continue
                if rule.kind == "lost_reply":
                    lose = lose or rule
                    continue
                if rule.started is None:
                    rule.started = self.clock.now()
                if not self._active(rule):
                    continue
                rule.hits += 1
                if rule.kind == "transport":
                    fail = "fail"
                else:
                    delay = max(delay, rule.delay_s)
        return fail, delay, lose

    def lost(self, rule: Rule, h: dict, n_values: int, found: bool) -> bool:
        """After a call armed with a lost-reply rule was applied: is its reply lost? Only a call that
        took something counts (a get that returned nothing lost nothing)."""
        took = n_values > 0 if h.get("op") == "q.get" else found
        if not took:
            return False
        with self.lock:
            if rule.done:
                return False
            rule.hits += 1
            rule.items_lost += n_values if h.get("op") == "q.get" else 1
            rule.started = rule.started if rule.started is not None else self.clock.now()
            rule.done = rule.hits >= (rule.calls or 1)
            return True

    def describe(self) -> list[dict]:
        with self.lock:
            return [asdict(r) for r in self.rules]
