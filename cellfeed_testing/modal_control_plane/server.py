"""The servicer: modal_proto's `ModalClientBase`, one mixin per concept, every other RPC UNIMPLEMENTED.

`ModalClientBase` (modal_proto/api_grpc.py:20) declares each RPC as an abstract method whose body is
`pass`: a handler that returns without a reply would end the stream with status OK and no message,
which the client reads as a protocol error, not as "this server lacks it". So every RPC no mixin
implements is replaced here by one that answers `UNIMPLEMENTED` naming itself (the client raises
`modal.exception.UnimplementedError` with that text: `_grpc_client.py:27-44`).
"""

from __future__ import annotations

import abc
import logging

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from modal_proto.api_grpc import ModalClientBase

from cellfeed_testing.modal_control_plane.objects import ObjectRPCs
from cellfeed_testing.modal_control_plane.store import Store

log = logging.getLogger("cellfeed.modal_control_plane")


def _unimplemented(name: str):
    async def handler(self, stream) -> None:
        log.warning("UNIMPLEMENTED RPC %s", name)
        self.unimplemented_calls.append(name)
        raise GRPCError(Status.UNIMPLEMENTED, f"{name} is not implemented by cellfeed's Modal control plane")

    handler.__name__ = handler.__qualname__ = name
    return handler


def fill_unimplemented(cls: type) -> type:
    """Give `cls` a handler answering UNIMPLEMENTED for each RPC it does not define, so it is concrete."""
    for name in sorted(ModalClientBase.__abstractmethods__):
        if getattr(cls, name) is getattr(ModalClientBase, name):
            setattr(cls, name, _unimplemented(name))
    abc.update_abstractmethods(cls)
    return cls


@fill_unimplemented
class Servicer(ObjectRPCs, ModalClientBase):
    """All the control plane's RPCs. State lives in `store` (and, later mixins, their own managers)."""

    def __init__(self, store: Store | None = None) -> None:
        self.store = store or Store()
        self.unimplemented_calls: list[str] = []  # what a client asked that we lack: tests show it

    async def shutdown(self) -> None:
        """Called once as the plane stops, before the server closes."""
