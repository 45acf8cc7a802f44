"""A local Modal control plane: a gRPC server speaking modal_proto's API to modal's own, unmodified client.

See README.md beside this file. The repository provides no module named `modal`: the laptop side and
the containers import the installed `modal` package.
"""

from cellfeed_testing.modal_control_plane.plane import ControlPlane

__all__ = ["ControlPlane"]
