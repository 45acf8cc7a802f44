"""Calls to Modal functions from inside the app: spawn one and wait for its result, see how a call
stands (`call_state`), hold a preemption's SIGINT over a step that must not be cut in two
(`interrupt_held`), and the run's producer calls (`Fleet`). Every call retries Modal's transient
errors for the campaign's `--modal-retry-s` (`coordination.modal_backend.retrying`)."""

from __future__ import annotations

import contextlib
import json
import signal
import time

import modal

from app.config import CampaignConfig
from coordination.errors import CellfeedError
from coordination.modal_backend import RETRY_S, retrying, transient_errors

PRODUCER_RETRIES = 3  # the producer function's retries (`app.modal_app.produce`)


def spawn(function, *args, retry: float = RETRY_S):
    """`function.spawn(*args)`, retried on Modal's transient errors."""
    return retrying(lambda: function.spawn(*args), f"spawning {function!r}", retry)  # (a Function has no __name__)


class CallFailed(Exception):
    """A Modal call ended in an error: its function's own exception, or Modal's word for the call's end
    (`RemoteError`, `FunctionTimeoutError`, ...), as modal's client raised it here (`__cause__`)."""

    def __init__(self, cause: BaseException) -> None:
        last = (str(cause).strip().splitlines() or [""])[-1]
        super().__init__(f"{type(cause).__name__}: {last}")


def result(call, retry: float = RETRY_S):
    """The call's result (waiting for it); its error is raised as `CallFailed`, transient errors retried."""
    from coordination.modal_backend import ModalUnreachable

    try:
        return retrying(call.get, f"waiting for {call.object_id}", retry)
    except ModalUnreachable:  # (this machine lost Modal: not the call's end)
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the call raised: its end, said by the caller in one line
        raise CallFailed(exc) from exc


def call_by_id(call_id: str):
    """`modal.FunctionCall.from_id(call_id)`, hydrated: modal 1.6's `from_id` is lazy, and the handle's
    `object_id` raises AttributeError until it is (its loader makes no RPC: modal/_functions.py:2566-2576)."""
    call = modal.FunctionCall.from_id(call_id)
    call.hydrate()
    return call


def claim_holder(store, run: str) -> str | None:
    """The id of the call that holds the run's claim (`claim_run`), if one does."""
    from coordination.routing import trainer_key

    held = json.loads(store.get(trainer_key(run)) or "null")
    return held["call"] if held is not None else None


def running_trainer(store, run: str, retry: float = RETRY_S) -> str | None:
    """The id of the call that holds the run's claim if Modal still runs it, else None."""
    holder = claim_holder(store, run)
    if holder is not None and call_state(call_by_id(holder), retry)[0] == "running":
        return holder
    return None


def claim_run(store, run: str, call_id: str, retry: float = RETRY_S) -> str | None:
    """(a train call, as it starts) Make this call the run's one trainer; returns the id of another
    call that already is and is still running, else None. A spawn whose reply was lost and was made
    again (a new idempotency key) starts a second `train` of the run: that one must not train. The
    same call run again (a preemption) keeps its claim. A claim whose call has ended (failed, killed
    with its cluster) is taken over by one call only: the first to put-if-absent a key naming the
    ended call wins, so two new calls that both find it ended cannot both train."""
    from coordination.routing import trainer_key

    key, mine = trainer_key(run), json.dumps({"call": call_id})
    if store.put(key, mine, skip_if_exists=True):
        return None
    holder = claim_holder(store, run)
    if holder is None or holder == call_id:  # (released meanwhile; or this call again: a preempted input)
        store.put(key, mine)
        return None
    if call_state(call_by_id(holder), retry)[0] == "running":
        return holder
    after = f"{key}/after/{holder}"
    if store.put(after, call_id, skip_if_exists=True) or store.get(after) == call_id:
        store.put(key, mine)
        return None
    return store.get(after)  # (another new call took it over)


def release_claim(store, run: str, call_id: str) -> None:
    """(the trainer, as its call ends for good: stopped, failed, handed over) The run has no trainer now."""
    from coordination.routing import trainer_key

    if claim_holder(store, run) == call_id:
        store.pop(trainer_key(run), None)


@contextlib.contextmanager
def interrupt_held():
    """A SIGINT (Modal's preemption) that arrives inside the block is raised when it ends."""
    got = []
    previous = signal.signal(signal.SIGINT, lambda *_: got.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if got:
            raise KeyboardInterrupt


class Fleet:
    """The run's producer calls (of `produce`, the app's producer function), by name
    (`producer-<i>`), their ids kept in the run's map: those of an earlier call of this run still
    running are reused, never doubled; a producer that ended (its hours, or an idle hour) is
    replaced; one that failed all Modal's retries ends the run."""

    def __init__(self, cfg: CampaignConfig, config: dict, store, produce):
        from coordination.routing import fleet_key

        self.cfg, self.config, self.store, self.key = cfg, config, store, fleet_key(cfg.run)
        self.produce = produce  # the app's producer function
        known = json.loads(store.get(self.key) or "{}")
        if "calls" not in known:  # (an entry written before the world size was kept: the run's own)
            known = {"calls": known, "world_size": cfg.world_size}
        ids, world = known["calls"], known["world_size"]
        self.calls = {}
        for i in range(cfg.producers):
            name = f"producer-{i}"
            call = call_by_id(ids[name]) if name in ids else None
            if call is not None and call_state(call, cfg.modal_retry_s)[0] == "running":
                self.calls[name] = call
        if self.calls and world != cfg.world_size:  # they route items to another number of ranks: replaced
            print(
                f"the {len(self.calls)} producers still running were started for {world} ranks: cancelling them",
                flush=True,
            )
            for call in self.calls.values():
                retrying(call.cancel, f"cancelling {call.object_id}", cfg.modal_retry_s)
            self.calls = {}
        if self.calls:
            print(f"reusing the {len(self.calls)} producers still running from an earlier call of this run", flush=True)
        for i in range(cfg.producers):
            if f"producer-{i}" not in self.calls:
                self._spawn(f"producer-{i}")

    def _spawn(self, name: str) -> None:
        with interrupt_held():  # spawned and recorded, or neither: a re-run must not spawn it twice
            self.calls[name] = spawn(self.produce, self.config, name, retry=self.cfg.modal_retry_s)
            calls = {n: c.object_id for n, c in self.calls.items()}
            self.store.put(self.key, json.dumps({"calls": calls, "world_size": self.cfg.world_size}))

    def check(self) -> None:
        for name, call in list(self.calls.items()):
            state, error = call_state(call, self.cfg.modal_retry_s)
            if state == "failed":
                last_line = (str(error).strip().splitlines() or [""])[-1]
                raise CellfeedError(
                    f"{name} failed {1 + PRODUCER_RETRIES} times, Modal's retries spent "
                    f"({type(error).__name__}: {last_line}); the run stops: mend the cause, "
                    "then run again with --resume"
                )
            if state == "ended":
                print(f"{name} ended: a new call takes its place", flush=True)
                self._spawn(name)

    def stop(self, deadline_s: float, retry: float = RETRY_S) -> None:
        """One deadline for all to return (they read the stop key), then cancel the rest."""
        deadline = time.monotonic() + deadline_s
        transient = transient_errors()

        def stop_one(call):
            try:
                call.get(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:  # still running past the deadline (builtin TimeoutError: modal/_functions.py)
                call.cancel()
            except transient:
                raise  # retried
            except Exception:  # noqa: BLE001 - it failed: nothing to stop
                pass

        for call in self.calls.values():
            retrying(lambda: stop_one(call), f"stopping {call.object_id}", retry)


def call_state(call, retry: float = RETRY_S) -> tuple[str, BaseException | None]:
    """("running" | "ended" | "failed", its error) of a function call, without waiting. Modal
    raises the builtin TimeoutError while a call runs (not modal.exception.TimeoutError, whose
    subclasses FunctionTimeoutError and OutputExpiredError mean it is over). A transient network
    error says nothing of the call: it is retried (for `retry` seconds), never taken for a failure."""
    transient = transient_errors()

    def look():
        try:
            call.get(timeout=0)
        except TimeoutError:
            return "running", None
        except transient:
            raise
        except Exception as exc:  # noqa: BLE001 - its error, Modal's retries spent
            return "failed", exc
        return "ended", None

    return retrying(look, f"looking at {call.object_id}", retry)
