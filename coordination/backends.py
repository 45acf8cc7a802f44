"""Connect to a run's queue and map from a small, JSON-able spec (what processes are given)."""

from __future__ import annotations

from coordination.errors import CellfeedError


def connect(spec: dict):
    """(queue, map) for {"kind": "local", "address": "host:port"} or {"kind": "modal", "run": id}.
    A spec with "latency_ms" > 0 costs every call that long (± 40%) more: Modal's round trips on
    one machine, or on the Modal emulator."""
    from coordination.latency import remote

    kind = spec.get("kind")
    if kind == "local":
        from coordination.local_backend import LocalMap, LocalQueue

        return remote(LocalQueue(spec["address"]), LocalMap(spec["address"]), spec.get("latency_ms", 0.0))
    if kind == "modal":
        from coordination.modal_backend import run_backends

        return remote(*run_backends(spec["run"], spec.get("environment")), spec.get("latency_ms", 0.0))
    raise CellfeedError(f"unknown backend {kind!r}: use 'local' or 'modal' (the memory backend lives in one process)")
