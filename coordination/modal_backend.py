"""The `modal` backend: `modal.Queue` / `modal.Dict` behind cellfeed's Queue and Map interfaces.

Deliberately thin. Modal already has the semantics the interfaces were shaped after (blocking
`get_many` returns at least one item or raises `queue.Empty`, non-blocking `get` returns None,
`queue.Full` on a full partition, `put(..., skip_if_exists=True)` returns False when the key
existed), so each method is one call. What it adds (each point checked with modal 1.6.4's own client
against the local control plane, cellfeed_testing/modal_control_plane/README.md):

- nothing touches Modal until first use (it imports and constructs offline);
- items are checked as bytes under Modal's 1 MiB, with a margin for its serialization, before
  they leave;
- a request Modal refuses as too large (HTTP 413: `RequestSizeError`, or, from a timed blocking
  put, a `modal.exception.TimeoutError` caused by it) is `RequestTooLarge`, never "full"; any
  other Modal `TimeoutError` is not a full partition either and propagates as it is;
- a named map's handle follows its name: Modal binds a handle to one object id, so when that
  object was deleted (a resumed epoch's map, dropped and created again), the name is opened
  again, and only a name that no longer exists is `MapGone`;
- run-scoped names, with clean-up at the end of a campaign;
- a network that fails: Modal's client retries a transient error for under a second, then raises it
  (`ServiceError`, `InternalError`, `ConnectionError`, a raw `StreamTerminatedError`: modal 1.6.4,
  `_utils/grpc_utils.py:499-509, 577-596`, `_grpc_client.py:27-44`). Every call here goes through
  `retrying`: backoff from 0.2 s (x1.5) to 10 s, for `retry_s` (default 15 minutes: a 10-minute outage
  passes), then `ModalUnreachable`. A retried call may have been applied already (a lost reply):
  a put then doubles its items (consumers drop duplicates by key), a get's items are gone (the
  consumer stream notices the cells missing and asks for their units again: `trainer/stream.py`),
  a put-if-absent finds its own value (stitching takes a slot holding its own id as its own);
- no credentials, or credentials Modal refuses (`AuthError`: raised by modal 1.6.4's client before
  it connects when it has no token, `client.py:_Client.from_env`, or for UNAUTHENTICATED): never
  retried, `ModalNoCredentials` at once, in one line saying what to do.
"""

from __future__ import annotations

import random
import sys
import time

from coordination.errors import CellfeedError
from coordination.queues import MapGone, RequestTooLarge, validate_item, validate_partition

RETRY_S = 900.0  # how long a call to Modal retries transient errors before giving up (the campaign's --modal-retry-s)
FIRST_DELAY_S, BACKOFF, MAX_DELAY_S = 0.2, 1.5, 10.0  # a blip costs under a second; an outage, one call per 10 s


class ModalUnreachable(CellfeedError):
    """Modal's network failed for longer than the retry window: the run stops, its state kept."""


class ModalNoCredentials(CellfeedError):
    """Modal's client has no credentials on this machine, or Modal refused them."""


def no_credentials(exc: BaseException) -> ModalNoCredentials:
    """A `modal.exception.AuthError` in one line: what is missing, what to do."""
    fix = "run `modal token new` or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"
    if not _token_configured():
        return ModalNoCredentials(f"no Modal credentials: {fix}")
    return ModalNoCredentials(f"Modal did not accept this machine's credentials ({_short(exc)}): {fix}")


def _token_configured() -> bool:
    """Whether modal's config (MODAL_TOKEN_ID and MODAL_TOKEN_SECRET, or ~/.modal.toml's profile) has a token."""
    from modal.config import config

    return bool(config.get("token_id") and config.get("token_secret"))


def transient_errors() -> tuple[type, ...]:
    """What Modal's client raises once its own retries of a network fault are spent, and a rate
    limit (RESOURCE_EXHAUSTED on a get or a Dict call; a full queue partition is the stdlib's
    `queue.Full`, which modal maps it to on a put: modal/queue.py:691-708)."""
    import modal.exception
    from grpclib.exceptions import StreamTerminatedError

    return (
        modal.exception.ServiceError,
        modal.exception.InternalError,
        modal.exception.ConnectionError,
        modal.exception.ResourceExhaustedError,
        StreamTerminatedError,
        _PutTimedOut,
        _StreamBroken,
    )


class _PutTimedOut(Exception):
    """A blocking put with a timeout whose retries of a transient error ran out (not a 413)."""


class _StreamBroken(Exception):
    """A server stream (`Dict.keys()`) cut while it was read: the connection's own OSError, which
    modal's client does not wrap."""


def retrying(call, what: str, retry_s: float = RETRY_S):
    """`call()`, retried on Modal's transient errors with jittered backoff for up to `retry_s`
    seconds from the first failure; one line when an outage starts and one when it ends. Missing
    or refused credentials are `ModalNoCredentials` at once."""
    from modal.exception import AuthError

    errors, first, delay = transient_errors(), None, FIRST_DELAY_S
    while True:
        try:
            result = call()
        except AuthError as exc:  # (no token, or a refused one: waiting does not bring one)
            raise no_credentials(exc) from None
        except errors as exc:
            now = time.monotonic()
            if first is None:
                first = now
                print(
                    f"Modal: {what} failed ({type(exc).__name__}: {_short(exc)}); retrying for up to "
                    f"{retry_s / 60:g} min",
                    file=sys.stderr,
                    flush=True,
                )
            if now - first >= retry_s:
                raise ModalUnreachable(
                    f"Modal: {what} kept failing for {retry_s / 60:g} min ({type(exc).__name__}: "
                    f"{_short(exc)}); the run's state is kept"
                ) from exc
            time.sleep(min(delay * random.uniform(0.5, 1.0), max(0.0, first + retry_s - now)))
            delay = min(delay * BACKOFF, MAX_DELAY_S)
            continue
        if first is not None:
            print(f"Modal: {what} works again after {time.monotonic() - first:.1f} s", file=sys.stderr, flush=True)
        return result


def _short(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def run_object_name(run: str) -> str:
    return f"cellfeed-{run}"


class ModalQueue:
    def __init__(
        self, name: str | None = None, *, queue=None, environment: str | None = None, retry_s: float = RETRY_S
    ):
        if name is None and queue is None:
            raise ValueError("give a queue name or a modal.Queue")
        self.name, self.environment, self._queue, self.retry_s = name, environment, queue, retry_s

    @property
    def queue(self):
        if self._queue is None:
            import modal

            self._queue = modal.Queue.from_name(self.name, create_if_missing=True, environment_name=self.environment)
        return self._queue

    def put_many(self, values, block=True, timeout=None, *, partition=None) -> None:
        values = list(values)
        for v in values:
            validate_item(v)
        validate_partition(partition)
        import modal.exception

        options = _blocking(block, timeout)

        def once():
            try:
                self.queue.put_many(values, partition=partition, **options)
            except modal.exception.RequestSizeError as exc:
                raise RequestTooLarge(f"{len(values)} items, {sum(map(len, values)):,} bytes: {exc}") from None
            except modal.exception.TimeoutError as exc:
                if _refused_as_too_large(exc):
                    raise RequestTooLarge(f"{len(values)} items, {sum(map(len, values)):,} bytes: {exc}") from None
                raise _PutTimedOut(str(exc)) from exc  # its retries of a network fault ran out: ours go on

        retrying(once, f"queue put ({partition or 'default partition'})", self.retry_s)

    def put(self, value, block=True, timeout=None, *, partition=None) -> None:
        self.put_many([value], block, timeout, partition=partition)

    def get_many(self, n_values, block=True, timeout=None, *, partition=None) -> list[bytes]:
        options = _blocking(block, timeout)
        return retrying(
            lambda: self.queue.get_many(n_values, partition=partition, **options),
            f"queue get ({partition or 'default partition'})",
            self.retry_s,
        )

    def get(self, block=True, timeout=None, *, partition=None):
        values = self.get_many(1, block, timeout, partition=partition)
        return values[0] if values else None

    def len(self, *, partition=None, total=False) -> int:
        return retrying(lambda: self.queue.len(partition=partition, total=total), "queue len", self.retry_s)


def _blocking(block: bool, timeout: float | None) -> dict:
    """A put's or get's blocking options as Modal wants them: it warns when a timeout comes with
    block=False."""
    return {"block": True, "timeout": timeout} if block else {"block": False}


def _refused_as_too_large(exc: BaseException) -> bool:
    """Whether a Modal error was, underneath, an HTTP 413 (modal/queue.py matches the same text)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if "status = '413'" in str(exc):
            return True
        exc = getattr(exc, "final_exception", None) or exc.__cause__ or exc.__context__
    return False


class ModalMap:
    def __init__(
        self,
        name: str | None = None,
        *,
        mapping=None,
        environment: str | None = None,
        create: bool = True,
        retry_s: float = RETRY_S,
    ):
        if name is None and mapping is None:
            raise ValueError("give a dict name or a modal.Dict")
        self.name, self.environment, self._dict, self.create = name, environment, mapping, create
        self.retry_s = retry_s

    @property
    def dict(self):
        if self._dict is None:
            import modal

            self._dict = modal.Dict.from_name(
                self.name, create_if_missing=self.create, environment_name=self.environment
            )
        return self._dict

    def _call(self, what: str, call):
        """`call()` (a call on `self.dict`), retried on Modal's transient errors; a deleted dict is
        looked up again by name once (see below)."""
        import modal.exception

        for reopen in (True, False):
            try:
                return retrying(call, f"dict {what}", self.retry_s)
            except modal.exception.NotFoundError as exc:
                # a handle binds to one object id: if that dict was deleted, this name may be a new one
                # (a resumed epoch's map); a name that is gone for good means its epoch is over
                if reopen and self.name is not None and not self.create and self._dict is not None:
                    self._dict = None
                    continue
                raise MapGone(f"modal.Dict {self.name} is gone: {exc}") from None

    def put(self, key, value, *, skip_if_exists=False) -> bool:
        return bool(self._call("put", lambda: self.dict.put(key, value, skip_if_exists=skip_if_exists)))

    def get(self, key, default=None):
        return self._call("get", lambda: self.dict.get(key, default))

    def pop(self, key, *default):
        return self._call("pop", lambda: self.dict.pop(key, *default))

    def __contains__(self, key) -> bool:
        return bool(self._call("contains", lambda: self.dict.contains(key)))

    def keys(self) -> list[str]:
        def read():
            try:
                return list(self.dict.keys())  # keys() is a lazy iterator: read it here, whole or again
            except OSError as exc:
                raise _StreamBroken(f"the keys stream broke: {exc}") from exc

        return self._call("keys", read)

    def named(self, name: str, create: bool = False) -> "ModalMap":
        """A modal.Dict of its own; created now (one call) with `create`, else never by us."""
        sibling = ModalMap(f"{self.name}-{name}", environment=self.environment, create=create, retry_s=self.retry_s)
        if create:
            sibling.put("created", 1)
        return sibling

    def drop(self, name: str) -> None:
        import modal

        retrying(
            lambda: modal.Dict.objects.delete(
                f"{self.name}-{name}", allow_missing=True, environment_name=self.environment
            ),
            "dict delete",
            self.retry_s,
        )


def run_backends(run: str, environment: str | None = None, retry_s: float = RETRY_S) -> tuple[ModalQueue, ModalMap]:
    """The run's queue and map, named `cellfeed-<run>` (created on first use)."""
    name = run_object_name(run)
    return (
        ModalQueue(name, environment=environment, retry_s=retry_s),
        ModalMap(name, environment=environment, retry_s=retry_s),
    )


def delete_run_backends(run: str, epochs: int = 0, environment: str | None = None, retry_s: float = RETRY_S) -> None:
    """Delete the run's queue and map, and any epoch map left by an interrupted epoch: only when the
    campaign is complete, or its user asks (never because of an error: a resume needs them)."""
    import modal

    from coordination.routing import epoch_map_name

    name = run_object_name(run)
    kinds = (
        [(modal.Queue, name)]
        + [(modal.Dict, f"{name}-{epoch_map_name(e)}") for e in range(epochs)]
        + [(modal.Dict, name)]
    )
    for kind, object_name in kinds:  # (a retry after a lost reply finds it gone: allow_missing)
        retrying(
            lambda: kind.objects.delete(object_name, allow_missing=True, environment_name=environment),
            f"delete {object_name}",
            retry_s,
        )
