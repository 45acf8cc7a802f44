"""Connect to a run's queue and map from a small, JSON-able spec (what processes are given)."""

from __future__ import annotations

from dataclasses import dataclass

from coordination.errors import CellfeedError
from coordination.modal_backend import RETRY_S


@dataclass(frozen=True)
class BackendSpec:
    """Where a run's queue and map are: `local` (the queue server at `address`) or `modal`
    (`cellfeed-<run>`); `memory` names the in-process shim (tests pass the objects themselves).
    Every call costs `latency_ms` (± 40%) more: Modal's round trips on one machine, or on the
    Modal emulator. Crosses process and Modal boundaries as a dict (`dataclasses.asdict`)."""

    kind: str
    run: str = ""
    address: str = ""
    token_file: str = ""  # local: the file holding the queue server's token (the path, never the token)
    latency_ms: float = 0.0
    environment: str | None = None
    retry_s: float = RETRY_S  # modal: how long a call retries transient network errors

    @classmethod
    def of(cls, spec: "BackendSpec | dict") -> "BackendSpec":
        return spec if isinstance(spec, cls) else cls(**spec)


def connect(spec: BackendSpec | dict):
    """(queue, map) of a `BackendSpec` (or its dict)."""
    from coordination.latency import remote

    spec = BackendSpec.of(spec)
    if spec.kind == "local":
        from coordination.local_backend import read_token
        from coordination.local_client import LocalMap, LocalQueue

        token = read_token(spec.token_file) if spec.token_file else None
        return remote(LocalQueue(spec.address, token), LocalMap(spec.address, token=token), spec.latency_ms)
    if spec.kind == "modal":
        from coordination.modal_backend import run_backends

        return remote(*run_backends(spec.run, spec.environment, spec.retry_s), spec.latency_ms)
    raise CellfeedError(
        f"unknown backend {spec.kind!r}: use 'local' or 'modal' (the memory backend lives in one process)"
    )
