"""What `modal run` defines before any input runs: the app, its environment, images, mounts and functions.

The RPCs and where the client sends them: AppCreate (runner.py:95-110), EnvironmentGetOrCreate (the
environment's `image_builder_version` settles how images are described: _image.py:349-384),
ImageGetOrCreate (_image.py:836-870: a reply with a result status counts as "already built", so
nothing is built and no ImageJoinStreaming follows), MountBatchedCheckExistence / MountPutFile /
MountGetOrCreate (mount.py:526-537, 645-715), FunctionPrecreate / FunctionCreate (_functions.py:989,
1131-1210: `function_data.ranked_functions` only for a list of GPUs), AppPublish (runner.py:309),
AppHeartbeat (runner.py:64-69), AppGetLogs (_logs_manager.py:183-193), AppClientDisconnect
(runner.py:343) and AppStop.
"""

from __future__ import annotations

import asyncio
import hashlib
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.empty_pb2 import Empty
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from modal_proto import api_pb2

from cellfeed_testing.modal_control_plane.limits import MAX_GPUS
from cellfeed_testing.modal_control_plane.store import Changed

# D7: inline payload sizes advertised in every function's handle metadata. Modal's client uploads an
# argument or result larger than this as a blob (BlobCreate, then an HTTP PUT to a signed URL:
# function_utils.py:588-642, container_io_manager.py:60-81); the plane serves no blob URLs yet, so it
# advertises modal's own synchronous limit (2 MiB, blob_utils.MAX_OBJECT_SIZE_BYTES) for async calls too.
INLINE_OBJECT_BYTES = 2 * 1024 * 1024
IMAGE_BUILDER_VERSION = "2024.10"  # D2: one the pinned client knows (_image.py:75); it changes no behaviour here


@dataclass
class Image:
    """D3: the recipe, kept for the import guard a container will get (emulator S20): nothing is built."""

    image_id: str
    definition: api_pb2.Image
    pip_packages: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # D3: its layers' ENV, which its containers start with


@dataclass
class Mount:
    mount_id: str
    files: dict[str, str]  # remote path -> sha256 of its content (the content is in the blob store)


@dataclass
class FunctionDef:
    function_id: str
    app_id: str
    definition: api_pb2.Function  # for a ranked (GPU list) function, its rank 0
    serialized_params: bytes = b""  # a bound variant's (a class's parameters): given to its containers


def _check_gpus(definition: api_pb2.Function | api_pb2.Resources) -> None:
    """D10: at most 8 GPUs a container (Modal's GPU guide; the client parses any count: emulator S17)."""
    resources = definition if isinstance(definition, api_pb2.Resources) else definition.resources
    if resources.gpu_config.count > MAX_GPUS:
        gpu = resources.gpu_config.gpu_type or "GPU"
        raise GRPCError(
            Status.INVALID_ARGUMENT, f"{gpu}:{resources.gpu_config.count}: a container has at most {MAX_GPUS} GPUs"
        )


@dataclass
class App:
    app_id: str
    description: str
    state: int
    functions: dict[str, str] = field(default_factory=dict)  # tag -> function id (AppPublish)
    stopped: bool = False
    logs: list[api_pb2.TaskLogsBatch] = field(default_factory=list)  # entry_id = index + 1
    changed: Changed = field(default_factory=Changed)  # a new log or the app stopped
    heard_at: float = field(default_factory=time.monotonic)  # its client's last AppCreate or AppHeartbeat (D12)
    client_gone: bool = False
    client_calls: list[str] = field(default_factory=list)  # the calls its client made (not its containers), in order


def _pip_packages(image: api_pb2.Image) -> list[str]:
    """The requirements a `pip_install` layer names, from its Dockerfile command (_image.py:1280-1286)."""
    out = []
    for cmd in image.dockerfile_commands:
        if "pip install" in cmd:
            words = cmd.split("pip install", 1)[1].split()
            out += [w.strip("'\"") for w in words if not w.startswith("-") and not w.startswith("$")]
    return out


def _image_env(image: api_pb2.Image) -> dict[str, str]:
    """The variables a layer's `ENV` commands set: `Image.env` writes `ENV KEY=<shlex-quoted value>`, one
    command a variable (_image.py:3046-3048)."""
    env = {}
    for cmd in image.dockerfile_commands:
        if cmd.startswith("ENV "):
            for word in shlex.split(cmd[4:]):
                key, _, value = word.partition("=")
                env[key] = value
    return env


class AppRPCs:
    """Mixed into the servicer: `self.apps`, `self.images`, `self.mounts`, `self.functions`, `self.blobs_dir`."""

    apps: dict[str, App]
    images: dict[str, Image]
    mounts: dict[str, Mount]
    functions: dict[str, FunctionDef]
    blobs_dir: Path

    def new_id(self, prefix: str) -> str:
        return self.store.new_id(prefix)

    def _app(self, app_id: str) -> App:
        app = self.apps.get(app_id)
        if app is None:
            raise GRPCError(Status.NOT_FOUND, f"App {app_id} not found")
        return app

    # ---- the app

    async def AppCreate(self, stream) -> None:
        req: api_pb2.AppCreateRequest = await stream.recv_message()
        app = App(self.new_id("ap"), req.description, req.app_state or api_pb2.APP_STATE_EPHEMERAL)
        self.apps[app.app_id] = app
        await stream.send_message(api_pb2.AppCreateResponse(app_id=app.app_id, app_page_url=f"local://{app.app_id}"))

    async def AppHeartbeat(self, stream) -> None:
        req: api_pb2.AppHeartbeatRequest = await stream.recv_message()
        self._app(req.app_id).heard_at = time.monotonic()
        await stream.send_message(Empty())

    async def AppPublish(self, stream) -> None:
        req: api_pb2.AppPublishRequest = await stream.recv_message()
        app = self._app(req.app_id)
        app.functions.update(req.function_ids)
        if req.app_state:
            app.state = req.app_state
        await stream.send_message(api_pb2.AppPublishResponse(deployed_at=time.time()))

    async def AppClientDisconnect(self, stream) -> None:
        # D5: the laptop's `modal run` ended: an ephemeral app stops with it, its containers too (runner.py:
        # 533-534, emulator S24); a detached one goes on (cli/run.py:365)
        req: api_pb2.AppClientDisconnectRequest = await stream.recv_message()
        await self.client_went(self._app(req.app_id), "the app's client disconnected")
        await stream.send_message(Empty())

    async def client_went(self, app: App, why: str) -> None:
        """D5, D12: an ephemeral app stops with its client; a detached one keeps "only the last triggered
        Modal function alive" (cli/run.py:365): of the calls its client made, the last goes on and any
        other still running is cancelled, its containers stopped (calls its containers made go on)."""
        if app.client_gone or app.stopped:
            return
        app.client_gone = True
        if app.state != api_pb2.APP_STATE_DETACHED:
            await self.stop_app(app, why)
            return
        for call_id in app.client_calls[:-1]:
            call = self.calls.get(call_id)
            if call is not None and call.output is None and not call.cancelled:
                call.cancelled = True
                for c in call.containers:
                    if not c.ended.is_set():
                        await self.containers.kill(c, f"{why}: only the last call its client made goes on")

    async def watch_clients(self, gone_after_s: float) -> None:
        """D12: an app whose client has not been heard for `gone_after_s` (a laptop killed or cut off:
        no AppClientDisconnect comes) is taken as disconnected."""
        while True:
            await asyncio.sleep(min(1.0, gone_after_s / 4))
            now = time.monotonic()
            for app in list(self.apps.values()):
                if not (app.client_gone or app.stopped) and now - app.heard_at > gone_after_s:
                    await self.client_went(app, f"the app's client was not heard for {gone_after_s:g}s")

    async def AppStop(self, stream) -> None:
        req: api_pb2.AppStopRequest = await stream.recv_message()
        await self.stop_app(self._app(req.app_id), "the app was stopped")
        await stream.send_message(Empty())

    async def stop_app(self, app: App, why: str) -> None:
        if app.stopped:
            return
        app.stopped = True
        await self.containers.stop_app(app.app_id, why)
        app.changed.notify_all()

    async def add_log(self, app_id: str, batch: api_pb2.TaskLogsBatch) -> None:
        app = self.apps.get(app_id)
        if app is None:
            return
        batch.entry_id = str(len(app.logs) + 1)
        app.logs.append(batch)
        app.changed.notify_all()

    async def AppGetLogs(self, stream) -> None:
        """D6: the app's container output after `last_entry_id`, waiting up to `timeout` for some; then
        `app_done` once the app has stopped (the client's log loop ends on it)."""
        req: api_pb2.AppGetLogsRequest = await stream.recv_message()
        app = self._app(req.app_id)
        start = int(req.last_entry_id) if req.last_entry_id.isdigit() else 0
        deadline = time.monotonic() + (req.timeout or 55.0)
        while len(app.logs) <= start and not app.stopped:
            left = deadline - time.monotonic()
            if left <= 0 or not await app.changed.wait(left):
                break
        batches = app.logs[start:]
        done = app.stopped
        for batch in batches:
            if not req.task_id or batch.task_id == req.task_id:
                await stream.send_message(batch)
        if done:
            await stream.send_message(api_pb2.TaskLogsBatch(app_done=True))

    # ---- environment, images, mounts

    async def EnvironmentGetOrCreate(self, stream) -> None:
        req: api_pb2.EnvironmentGetOrCreateRequest = await stream.recv_message()
        name = req.deployment_name or "main"  # D1: one environment
        settings = api_pb2.EnvironmentSettings(image_builder_version=IMAGE_BUILDER_VERSION)
        await stream.send_message(
            api_pb2.EnvironmentGetOrCreateResponse(
                environment_id="en-" + name, metadata=api_pb2.EnvironmentMetadata(name=name, settings=settings)
            )
        )

    async def ImageGetOrCreate(self, stream) -> None:
        req: api_pb2.ImageGetOrCreateRequest = await stream.recv_message()
        key = hashlib.sha256(req.image.SerializeToString(deterministic=True)).hexdigest()[:20]
        image_id = "im-" + key  # D3: the same recipe is the same image
        if image_id not in self.images:
            pips, env = _pip_packages(req.image), {}
            for base in req.image.base_images:  # a layer inherits its base's packages and variables
                if base.image_id in self.images:
                    pips = self.images[base.image_id].pip_packages + pips
                    env.update(self.images[base.image_id].env)
            self.images[image_id] = Image(image_id, req.image, pips, env | _image_env(req.image))
        v = sys.version_info
        metadata = api_pb2.ImageMetadata(
            python_version_info=f"{v.major}.{v.minor}.{v.micro}", image_builder_version=IMAGE_BUILDER_VERSION
        )
        await stream.send_message(
            api_pb2.ImageGetOrCreateResponse(
                image_id=image_id,
                result=api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS),
                metadata=metadata,
            )
        )

    async def MountBatchedCheckExistence(self, stream) -> None:
        req: api_pb2.MountBatchedCheckExistenceRequest = await stream.recv_message()
        missing = [h for h in req.sha256_hex_hashes if not (self.blobs_dir / h).exists()]
        await stream.send_message(api_pb2.MountBatchedCheckExistenceResponse(missing_sha256_hex_hashes=missing))

    async def MountPutFile(self, stream) -> None:
        # D4: a file's content by its sha256; `exists` tells the client it is stored (mount.py:645-660)
        req: api_pb2.MountPutFileRequest = await stream.recv_message()
        if req.WhichOneof("data_oneof") == "data":
            if hashlib.sha256(req.data).hexdigest() != req.sha256_hex:
                raise GRPCError(Status.INVALID_ARGUMENT, "content does not match its sha256")
            (self.blobs_dir / req.sha256_hex).write_bytes(req.data)
        elif req.data_blob_id:
            raise GRPCError(Status.UNIMPLEMENTED, "MountPutFile from a blob is not implemented (no blob store)")
        await stream.send_message(api_pb2.MountPutFileResponse(exists=(self.blobs_dir / req.sha256_hex).exists()))

    async def MountGetOrCreate(self, stream) -> None:
        req: api_pb2.MountGetOrCreateRequest = await stream.recv_message()
        # D4: a named mount in the global namespace is modal's own client mount (mount.py:836-841): the
        # containers run the installed `modal`, so it is an empty mount here
        mount = Mount(self.new_id("mo"), {f.filename: f.sha256_hex for f in req.files})
        self.mounts[mount.mount_id] = mount
        checksum = hashlib.sha256("".join(sorted(mount.files.values())).encode()).hexdigest()
        await stream.send_message(
            api_pb2.MountGetOrCreateResponse(
                mount_id=mount.mount_id,
                handle_metadata=api_pb2.MountHandleMetadata(content_checksum_sha256_hex=checksum),
            )
        )

    # ---- functions

    def handle_metadata(self, fn: FunctionDef) -> api_pb2.FunctionHandleMetadata:
        d = fn.definition
        return api_pb2.FunctionHandleMetadata(
            function_name=d.function_name,
            function_type=d.function_type,
            is_method=d.is_method,
            definition_id="de-" + fn.function_id,
            function_schema=d.function_schema,
            max_object_size_bytes=INLINE_OBJECT_BYTES,
            max_async_object_size_bytes=INLINE_OBJECT_BYTES,
            supported_input_formats=d.supported_input_formats,
            supported_output_formats=d.supported_output_formats,
            app_id=fn.app_id,
        )

    async def FunctionPrecreate(self, stream) -> None:
        req: api_pb2.FunctionPrecreateRequest = await stream.recv_message()
        function_id = req.existing_function_id or self.new_id("fu")
        meta = api_pb2.FunctionHandleMetadata(
            function_name=req.function_name,
            function_type=req.function_type,
            definition_id="de-" + function_id,
            function_schema=req.function_schema,
            max_object_size_bytes=INLINE_OBJECT_BYTES,
            max_async_object_size_bytes=INLINE_OBJECT_BYTES,
            supported_input_formats=req.supported_input_formats,
            supported_output_formats=req.supported_output_formats,
            app_id=req.app_id,
        )
        await stream.send_message(api_pb2.FunctionPrecreateResponse(function_id=function_id, handle_metadata=meta))

    async def FunctionCreate(self, stream) -> None:
        req: api_pb2.FunctionCreateRequest = await stream.recv_message()
        self._app(req.app_id)
        if req.HasField("function_data") and req.function_data.ranked_functions:
            ranked = sorted(req.function_data.ranked_functions, key=lambda r: r.rank)
            definition = ranked[0].function
        else:
            definition = req.function
        _check_gpus(definition)
        fn = FunctionDef(req.existing_function_id or self.new_id("fu"), req.app_id, definition)
        self.functions[fn.function_id] = fn
        # D8: the reply always carries `function_data` with its ranked functions, one for a plain
        # function: the client reads the function's info from it (_functions.py:1215, types.py:855-860)
        if req.function_data.ranked_functions:
            data = req.function_data
        else:
            d = req.function
            data = api_pb2.FunctionData(
                module_name=d.module_name,
                function_name=d.function_name,
                function_type=d.function_type,
                timeout_secs=d.timeout_secs,
                webhook_config=d.webhook_config,
                web_url=d.web_url,
                is_class=d.is_class,
                is_method=d.is_method,
                method_definitions=d.method_definitions,
                method_definitions_set=d.method_definitions_set,
                class_parameter_info=d.class_parameter_info,
                function_schema=d.function_schema,
                _experimental_group_size=d._experimental_group_size,
                ranked_functions=[api_pb2.FunctionData.RankedFunction(rank=0, function=d)],
            )
            if d.HasField("schedule"):
                data.schedule.CopyFrom(d.schedule)
        await stream.send_message(
            api_pb2.FunctionCreateResponse(
                function_id=fn.function_id, function_data=data, handle_metadata=self.handle_metadata(fn)
            )
        )

    async def FunctionBindParams(self, stream) -> None:
        """D9: `with_options` (and a class's parameters) make a variant: the base function's definition
        with what the options set. The client sends unset resources as 0 and unset optional fields
        absent, and the variant keeps the base's values for those: the server merges
        (_function_variants.py:135-198, emulator S25)."""
        req: api_pb2.FunctionBindParamsRequest = await stream.recv_message()
        base = self.functions.get(req.function_id)
        if base is None:
            raise GRPCError(Status.NOT_FOUND, f"Function {req.function_id} not found")
        o = req.function_options
        d = api_pb2.Function()
        d.CopyFrom(base.definition)
        if o.HasField("resources"):
            r = o.resources
            if r.gpu_config.count or r.gpu_config.gpu_type:
                d.resources.gpu_config.CopyFrom(r.gpu_config)
            for name in ("memory_mb", "memory_mb_max", "milli_cpu", "milli_cpu_max", "ephemeral_disk_mb"):
                if getattr(r, name):
                    setattr(d.resources, name, getattr(r, name))
            if r.rdma:
                d.resources.rdma = True
        if o.HasField("retry_policy"):
            d.retry_policy.CopyFrom(o.retry_policy)
        if o.HasField("timeout_secs") and o.timeout_secs:
            d.timeout_secs = o.timeout_secs
        if o.replace_secret_ids:
            d.ClearField("secret_ids")
            d.secret_ids.extend(o.secret_ids)
        if o.replace_volume_mounts:
            d.ClearField("volume_mounts")
            d.volume_mounts.extend(o.volume_mounts)
        _check_gpus(d)
        variant = FunctionDef(self.new_id("fu"), base.app_id, d, req.serialized_params or base.serialized_params)
        self.functions[variant.function_id] = variant
        await stream.send_message(
            api_pb2.FunctionBindParamsResponse(
                bound_function_id=variant.function_id, handle_metadata=self.handle_metadata(variant)
            )
        )
