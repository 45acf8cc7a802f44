"""The `modal` backend: `modal.Queue` / `modal.Dict` behind cellfeed's Queue and Map interfaces.

Deliberately thin. Modal already has the semantics the interfaces were shaped after (blocking
`get_many` returns at least one item or raises `queue.Empty`, non-blocking `get` returns None,
`queue.Full` on a full partition, `put(..., skip_if_exists=True)` returns False when the key
existed), so each method is one call. What it adds (each point checked against modal 1.6.4 on
the emulator, cellfeed_testing/modal_emulator/README.md):

- nothing touches Modal until first use (it imports and constructs offline);
- items are checked as bytes under Modal's 1 MiB, with a margin for its serialization, before
  they leave;
- a request Modal refuses as too large (HTTP 413: `RequestSizeError`, or, from a timed blocking
  put, a `modal.exception.TimeoutError` caused by it) is `RequestTooLarge`, never "full"; any
  other Modal `TimeoutError` is not a full partition either and propagates as it is;
- a named map's handle follows its name: Modal binds a handle to one object id, so when that
  object was deleted (a resumed epoch's map, dropped and created again), the name is opened
  again, and only a name that no longer exists is `MapGone`;
- run-scoped names, with clean-up at the end of a campaign.
"""

from __future__ import annotations

from coordination.queues import MapGone, RequestTooLarge, validate_item, validate_partition


def run_object_name(run: str) -> str:
    return f"cellfeed-{run}"


class ModalQueue:
    def __init__(self, name: str | None = None, *, queue=None, environment: str | None = None):
        if name is None and queue is None:
            raise ValueError("give a queue name or a modal.Queue")
        self.name, self.environment, self._queue = name, environment, queue

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

        try:
            if block:
                self.queue.put_many(values, block=True, timeout=timeout, partition=partition)
            else:  # Modal warns when a timeout comes with a non-blocking put
                self.queue.put_many(values, block=False, partition=partition)
        except modal.exception.RequestSizeError as exc:
            raise RequestTooLarge(f"{len(values)} items, {sum(map(len, values)):,} bytes: {exc}") from None
        except modal.exception.TimeoutError as exc:
            if _refused_as_too_large(exc):
                raise RequestTooLarge(f"{len(values)} items, {sum(map(len, values)):,} bytes: {exc}") from None
            raise

    def put(self, value, block=True, timeout=None, *, partition=None) -> None:
        self.put_many([value], block, timeout, partition=partition)

    def get_many(self, n_values, block=True, timeout=None, *, partition=None) -> list[bytes]:
        if not block:  # Modal warns when a timeout comes with a non-blocking get
            return self.queue.get_many(n_values, block=False, partition=partition)
        return self.queue.get_many(n_values, block=True, timeout=timeout, partition=partition)

    def get(self, block=True, timeout=None, *, partition=None):
        if not block:
            return self.queue.get(block=False, partition=partition)
        return self.queue.get(block=True, timeout=timeout, partition=partition)

    def len(self, *, partition=None, total=False) -> int:
        return self.queue.len(partition=partition, total=total)


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
    def __init__(self, name: str | None = None, *, mapping=None, environment: str | None = None,
                 create: bool = True):
        if name is None and mapping is None:
            raise ValueError("give a dict name or a modal.Dict")
        self.name, self.environment, self._dict, self.create = name, environment, mapping, create

    @property
    def dict(self):
        if self._dict is None:
            import modal

            self._dict = modal.Dict.from_name(self.name, create_if_missing=self.create,
                                              environment_name=self.environment)
        return self._dict

    def _call(self, method: str, *args, **kwargs):
        import modal.exception

        for reopen in (True, False):
            try:
                result = getattr(self.dict, method)(*args, **kwargs)
                return list(result) if method == "keys" else result  # keys() is a lazy iterator: read it here
            except modal.exception.NotFoundError as exc:
                # a handle binds to one object id: if that dict was deleted, this name may be a new one
                # (a resumed epoch's map); a name that is gone for good means its epoch is over
                if reopen and self.name is not None and not self.create and self._dict is not None:
                    self._dict = None
                    continue
                raise MapGone(f"modal.Dict {self.name} is gone: {exc}") from None

    def put(self, key, value, *, skip_if_exists=False) -> bool:
        return bool(self._call("put", key, value, skip_if_exists=skip_if_exists))

    def get(self, key, default=None):
        return self._call("get", key, default)

    def pop(self, key, *default):
        return self._call("pop", key, *default)

    def __contains__(self, key) -> bool:
        return bool(self._call("contains", key))

    def keys(self) -> list[str]:
        return self._call("keys")

    def named(self, name: str, create: bool = False) -> "ModalMap":
        """A modal.Dict of its own; created now (one call) with `create`, else never by us."""
        sibling = ModalMap(f"{self.name}-{name}", environment=self.environment, create=create)
        if create:
            sibling.put("created", 1)
        return sibling

    def drop(self, name: str) -> None:
        import modal

        modal.Dict.objects.delete(f"{self.name}-{name}", allow_missing=True, environment_name=self.environment)


def run_backends(run: str, environment: str | None = None) -> tuple[ModalQueue, ModalMap]:
    """The run's queue and map, named `cellfeed-<run>` (created on first use)."""
    name = run_object_name(run)
    return ModalQueue(name, environment=environment), ModalMap(name, environment=environment)


def delete_run_backends(run: str, epochs: int = 0, environment: str | None = None) -> None:
    """Delete the run's queue and map, and any epoch map left by an interrupted epoch, at the end."""
    import modal

    from coordination.routing import epoch_map_name

    name = run_object_name(run)
    modal.Queue.objects.delete(name, allow_missing=True, environment_name=environment)
    for epoch in range(epochs):
        modal.Dict.objects.delete(f"{name}-{epoch_map_name(epoch)}", allow_missing=True, environment_name=environment)
    modal.Dict.objects.delete(name, allow_missing=True, environment_name=environment)
