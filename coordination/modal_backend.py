"""The `modal` backend: `modal.Queue` / `modal.Dict` behind cellfeed's Queue and Map interfaces.

Deliberately thin. Modal already has the semantics the interfaces were shaped after (blocking
`get_many` returns at least one item or raises `queue.Empty`, non-blocking `get` returns None,
`queue.Full` on a full partition, `put(..., skip_if_exists=True)` returns False when the key
existed), so each method is one call. What it adds: nothing touches Modal until first use (it
imports and constructs offline), items are checked as bytes of at most 1 MiB before they leave,
and run-scoped names with clean-up at the end of a campaign.
"""

from __future__ import annotations

from coordination.queues import Full, MapGone, validate_item, validate_partition


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
            self.queue.put_many(values, block=block, timeout=timeout, partition=partition)
        except modal.exception.TimeoutError as exc:  # a timed put that ran out (not only a full partition)
            raise Full(str(exc)) from None

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

        try:
            return getattr(self.dict, method)(*args, **kwargs)
        except modal.exception.NotFoundError as exc:  # a named map that was dropped: its epoch is over
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
        return list(self._call("keys"))

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
