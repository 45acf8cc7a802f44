"""The servicer: modal_proto's `ModalClientBase`, one mixin per concept, every other RPC UNIMPLEMENTED.

`ModalClientBase` (modal_proto/api_grpc.py:20) declares each RPC as an abstract method whose body is
`pass`: a handler that returns without a reply would end the stream with status OK and no message,
which the client reads as a protocol error, not as "this server lacks it". So every RPC no mixin
implements is replaced here by one that answers `UNIMPLEMENTED` naming itself (the client raises
`modal.exception.UnimplementedError` with that text: `_grpc_client.py:27-44`).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import tempfile
from pathlib import Path

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from modal_proto import api_pb2
from modal_proto.api_grpc import ModalClientBase

from cellfeed_testing.modal_control_plane.apps import AppRPCs
from cellfeed_testing.modal_control_plane.calls import Call, CallRPCs
from cellfeed_testing.modal_control_plane.clusters import ClusterRPCs
from cellfeed_testing.modal_control_plane.containers import Container, Containers
from cellfeed_testing.modal_control_plane.objects import ObjectRPCs
from cellfeed_testing.modal_control_plane.secrets import SecretRPCs
from cellfeed_testing.modal_control_plane.store import Store
from cellfeed_testing.modal_control_plane.volumes import BlockServer, VolumeRPCs

log = logging.getLogger("cellfeed.modal_control_plane")
# D12: Modal does not document when a client that stopped heartbeating (every 15 s: modal/config.py:414,
# runner.py:64-69) is taken as gone; we take four missed heartbeats
CLIENT_GONE_S = 60.0
BACKGROUND_COMMIT_S = 5.0  # V8: Modal's Volumes guide: "every few seconds" while a function runs


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
class Servicer(ObjectRPCs, AppRPCs, CallRPCs, ClusterRPCs, VolumeRPCs, SecretRPCs, ModalClientBase):
    """All the control plane's RPCs. Queue and Dict state lives in `store`; apps, images, mounts,
    functions and calls in the tables below; processes in `containers`."""

    def __init__(
        self,
        root: Path | None = None,
        store: Store | None = None,
        secrets: dict[str, dict[str, str]] | None = None,
        mount_env: dict[str, str] | None = None,
    ) -> None:
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="modal-control-plane-"))
        self.store = store or Store()
        self.url = ""  # set by the plane once it listens: containers are given it
        self.unimplemented_calls: list[str] = []  # what a client asked that we lack: tests show it
        self.apps, self.images, self.mounts, self.functions, self.calls = {}, {}, {}, {}, {}
        self.blobs_dir = self.root / "blobs"
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        self.containers = Containers(self.root, lambda: self.url, self.container_exited, self._container_output)
        self.volumes, self.volume_names = {}, {}
        self.block_server = BlockServer(self.volumes)
        self.mount_env = dict(mount_env or {})  # a Volume's mount path -> a variable naming its view (V5)
        self.secrets, self.secret_names = {}, {}
        self._background: set[asyncio.Task] = set()  # V8's committers, one a container with a Volume; D12's watch
        self.client_gone_s = CLIENT_GONE_S
        for name, variables in (secrets or {}).items():
            self.add_secret(name, variables)

    async def start(self) -> None:
        """Called once on the plane's loop before it listens."""
        await self.block_server.start()
        self._background.add(asyncio.create_task(self.watch_clients(self.client_gone_s), name="clients"))

    async def _container_output(self, c: Container, fd: int, line: str) -> None:
        batch = api_pb2.TaskLogsBatch(
            task_id=c.task_id,
            function_id=c.call.function_id,
            input_id=c.call.input_id,
            items=[api_pb2.TaskLogs(data=line, file_descriptor=fd, timestamp=__import__("time").time())],
        )
        await self.add_log(c.call.app_id, batch)

    def _layout(self, app_id: str, fn_def: api_pb2.Function) -> api_pb2.AppLayout:
        """The app's objects as a container sees them (_container_entrypoint.py:366-393): its functions
        with their handle metadata, and every object the function depends on."""
        app = self.apps[app_id]
        layout = api_pb2.AppLayout(function_ids=app.functions)
        seen = set()
        for fid in app.functions.values():
            if fid in self.functions:
                layout.objects.append(
                    api_pb2.Object(object_id=fid, function_handle_metadata=self.handle_metadata(self.functions[fid]))
                )
                seen.add(fid)
        for dep in fn_def.object_dependencies:
            if dep.object_id not in seen:
                layout.objects.append(self.object_for_layout(dep.object_id))
                seen.add(dep.object_id)
        return layout

    def object_for_layout(self, object_id: str) -> api_pb2.Object:
        if object_id in self.functions:
            return api_pb2.Object(
                object_id=object_id, function_handle_metadata=self.handle_metadata(self.functions[object_id])
            )
        if object_id in self.volumes:
            return api_pb2.Object(object_id=object_id, volume_metadata=self._volume_metadata(self.volumes[object_id]))
        if object_id in self.mounts:
            return api_pb2.Object(object_id=object_id, mount_handle_metadata=api_pb2.MountHandleMetadata())
        return api_pb2.Object(object_id=object_id)

    def container_files(self, fn_def: api_pb2.Function) -> dict[str, Path]:
        files = {}
        mount_ids = list(fn_def.mount_ids)
        for mount_id in mount_ids:
            mount = self.mounts.get(mount_id)
            for remote, sha in mount.files.items() if mount else ():
                files[remote] = self.blobs_dir / sha
        return files

    async def start_container(self, call: Call) -> Container:
        """A new container running the real entrypoint for `call` (its attempt's one, or one of its
        cluster's: clusters.py starts attempts)."""
        fn = self.functions[call.function_id]
        fn_def = api_pb2.Function()
        fn_def.CopyFrom(fn.definition)
        fn_def.single_use_containers = True  # one input, then the entrypoint returns (see calls.py)
        task_id = self.new_id("ta")
        args = api_pb2.ContainerArguments(
            task_id=task_id,
            function_id=fn.function_id,
            app_id=fn.app_id,
            function_def=fn_def,
            environment_name="main",
            app_layout=self._layout(fn.app_id, fn_def),
            serialized_params=fn.serialized_params,
        )
        timeout_s = float(fn_def.timeout_secs) if fn_def.timeout_secs else None
        image = self.images.get(fn_def.image_id)
        # the image's ENV, then its Secrets': a variable set when a container starts beats the image's
        env = {**(image.env if image else {}), **self.secret_env(fn_def)}
        volumes, volume_env = self.mount_volumes(self.containers.folder_for(task_id), fn_def)
        env.update(volume_env)
        c = await self.containers.start(
            task_id, call, call.attempt, args, self.container_files(fn_def), env, timeout_s, volumes
        )
        call.containers.append(c)
        if any(vm.allow_background_commits for vm in fn_def.volume_mounts):
            task = asyncio.create_task(self._background_commits(c), name=f"background commits {task_id}")
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return c

    async def _background_commits(self, c: Container) -> None:
        """V8: while a container runs, what it wrote to a Volume mounted with background commits (every
        mount the client makes: volume.py:480) is committed every BACKGROUND_COMMIT_S; a container
        killed without a grace loses only what it wrote since the last one."""
        while not c.ended.is_set():
            try:
                await asyncio.wait_for(c.ended.wait(), BACKGROUND_COMMIT_S)
            except asyncio.TimeoutError:
                for volume_id, entry in list(c.volumes.items()):
                    if volume_id in self.volumes and not self.volumes[volume_id].deleted:
                        try:
                            self.commit_view(volume_id, entry)
                        except OSError as exc:  # this pass is lost, said; the next one (or the exit's) commits
                            log.error("background commit of %s for %s failed: %s", volume_id, c.task_id, exc)

    async def shutdown(self) -> None:
        """Called once as the plane stops, before the server closes: every container goes."""
        await self.containers.shutdown()
        await self.block_server.stop()
