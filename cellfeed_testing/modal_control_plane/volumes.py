"""Volumes: a committed folder per Volume on the host, and a private view of it in each container.

Modal's rule (the class docstring, modal/volume.py:487-505): a container sees the Volume as it was when
mounted or last reloaded; its writes reach others only when it commits; a reload fails while files of
the Volume are open. So each container gets a **copy** of the committed folder (V2), `VolumeCommit`
from it copies what it changed since its last sync back (V3: last writer wins per file), and
`VolumeReload` refuses while one of the container's processes holds a file of its view open, else
commits and refreshes the view (V4). The container's client commits by itself on a normal exit
(_runtime/task_lifecycle_manager.py:129-156, user_code_imports.py:109-115); a killed container's
uncommitted writes are lost.

A Volume is mounted at an absolute path (`volumes={"/checkpoints": vol}`) which the plane cannot
create on this machine: the container is told where its view is instead (V5), in
`MODAL_CONTROL_PLANE_VOLUMES` (JSON, mount path -> folder) and in any variable the plane was asked to
set for a mount path (`ControlPlane(mount_env={"/checkpoints": "CELLFEED_CHECKPOINT_MOUNT"})`).

The laptop reads files through `VolumeGetFile2`, whose reply is a list of block URLs the client GETs
with aiohttp (volume.py:978-1027): the plane serves them itself (`BlockServer`, V6).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from google.protobuf.empty_pb2 import Empty
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from modal_proto import api_pb2

from cellfeed_testing.modal_control_plane.containers import Container, _tree

BLOCK_SIZE = 8 * 1024 * 1024  # modal/_utils/blob_utils.py:64: block URLs cover BLOCK_SIZE-aligned ranges
VOLUMES_ENV = "MODAL_CONTROL_PLANE_VOLUMES"
OPEN_FILES = "there are open files preventing the operation"  # volume.py:922: the text the client looks for


@dataclass
class Volume:
    volume_id: str
    name: str | None
    committed: Path
    version: int
    created_at: float
    deleted: bool = False


def snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under `folder`: relative path -> (size, mtime_ns, inode). The inode too: a file replaced
    (`os.replace`, as a pointer file is) by one of the same size within one tick of the clock that stamps
    mtimes (a few ms) has a new inode and the same size and mtime."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            p = Path(dirpath, f)
            try:
                st = p.lstat()
            except FileNotFoundError:  # deleted since the folder was listed (the container runs on)
                continue
            out[str(p.relative_to(folder))] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".cp-tmp")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)  # a reader of the committed folder never sees half a file


def publish_once(committed: Path, folder: Path) -> None:
    """V9: a lasting Volume's committed files published at its host folder, each top-level entry whole
    and once: the first plane to stop with an entry renames a full copy of it into place, and an entry
    already there stays as it is. Merging runs file by file would mix two runs' files: numba numbers a
    function's compiled variants in its index (`_tokenize-…1.nbc`, `…2.nbc`), so two planes that each
    compiled a new variant from the same start both write a `…N.nbc`, and an index from one beside the
    data of the other would load code compiled for other types. (The kernels Volume keeps a folder per
    run: producers/kernel_cache.py.)"""
    folder.mkdir(parents=True, exist_ok=True)
    for entry in committed.iterdir():
        if (folder / entry.name).exists() or (entry.is_dir() and not snapshot(entry)):  # (an empty folder: nothing)
            continue
        tmp = folder / f".{entry.name}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        if entry.is_dir():
            shutil.copytree(entry, tmp)
        else:
            shutil.copy2(entry, tmp)
        try:
            os.rename(tmp, folder / entry.name)  # (fails where another plane published it first: its copy stays)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # (a file replaces a file: only a folder can be refused)


def _safe(root: Path, path: str) -> Path:
    p = (root / path.lstrip("/")).resolve()
    if p != root.resolve() and root.resolve() not in p.parents:
        raise GRPCError(Status.INVALID_ARGUMENT, f"path {path!r} is outside the Volume")
    return p


class BlockServer:
    """V6: serves a Volume file's byte range over HTTP, for the block URLs of `VolumeGetFile2`."""

    def __init__(self, volumes: dict[str, Volume]) -> None:
        self.volumes = volumes
        self.base_url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/blocks/{volume_id}/{start}/{length}/{path:.*}", self._get)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _get(self, request: web.Request) -> web.Response:
        v = self.volumes.get(request.match_info["volume_id"])
        if v is None or v.deleted:
            return web.Response(status=404)
        path = _safe(v.committed, request.match_info["path"])
        start, length = int(request.match_info["start"]), int(request.match_info["length"])
        with open(path, "rb") as f:
            f.seek(start)
            return web.Response(body=f.read(length), content_type="application/octet-stream")


class VolumeRPCs:
    """Mixed into the servicer: `self.volumes`, `self.block_server`, `self.containers`, `self.root`."""

    volumes: dict[str, Volume]
    volume_names: dict[tuple[str, str], str]
    block_server: BlockServer

    def _volume(self, volume_id: str) -> Volume:
        v = self.volumes.get(volume_id)
        if v is None or v.deleted:
            raise GRPCError(Status.NOT_FOUND, f"Volume {volume_id} not found")
        return v

    def _volume_metadata(self, v: Volume) -> api_pb2.VolumeMetadata:
        return api_pb2.VolumeMetadata(
            name=v.name or "",
            version=v.version,
            creation_info=api_pb2.CreationInfo(created_at=v.created_at, created_by="cellfeed-control-plane"),
        )

    def create_volume(self, name: str | None, version: int = 0) -> Volume:
        vid = self.new_id("vo")
        v = Volume(vid, name, self.root / "volumes" / vid, version or api_pb2.VOLUME_FS_VERSION_V1, time.time())
        v.committed.mkdir(parents=True)
        self.volumes[vid] = v
        if name:
            self.volume_names["main", name] = vid
        return v

    async def VolumeGetOrCreate(self, stream) -> None:
        # V1: as Queue and Dict's C1 (volume.py:745-765); v1 unless v2 was asked (volume.py:247-248, 688-704)
        req: api_pb2.VolumeGetOrCreateRequest = await stream.recv_message()
        t = req.object_creation_type
        if t == api_pb2.OBJECT_CREATION_TYPE_EPHEMERAL:
            v = self.create_volume(None, req.version)
        else:
            vid = self.volume_names.get(("main", req.deployment_name))
            if vid is not None and t == api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS:
                raise GRPCError(Status.ALREADY_EXISTS, f"Volume {req.deployment_name!r} already exists")
            if vid is not None:
                v = self.volumes[vid]
            elif t in (
                api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING,
                api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS,
            ):
                v = self.create_volume(req.deployment_name, req.version)
            else:
                raise GRPCError(Status.NOT_FOUND, f"Volume {req.deployment_name!r} not found")
        await stream.send_message(
            api_pb2.VolumeGetOrCreateResponse(
                volume_id=v.volume_id, version=v.version, metadata=self._volume_metadata(v)
            )
        )

    async def VolumeGetById(self, stream) -> None:
        req: api_pb2.VolumeGetByIdRequest = await stream.recv_message()
        v = self._volume(req.volume_id)
        await stream.send_message(
            api_pb2.VolumeGetByIdResponse(volume_id=v.volume_id, metadata=self._volume_metadata(v))
        )

    async def VolumeHeartbeat(self, stream) -> None:
        req: api_pb2.VolumeHeartbeatRequest = await stream.recv_message()
        self._volume(req.volume_id)
        await stream.send_message(Empty())

    async def VolumeDelete(self, stream) -> None:
        req: api_pb2.VolumeDeleteRequest = await stream.recv_message()
        v = self._volume(req.volume_id)
        v.deleted = True
        self.volume_names = {k: i for k, i in self.volume_names.items() if i != v.volume_id}
        await stream.send_message(Empty())

    # ---- in a container: V2-V5

    def mount_volumes(self, c_folder: Path, fn_def: api_pb2.Function) -> tuple[dict, dict[str, str]]:
        """Each mounted Volume's view for a new container: (volume id -> (view, baseline)), its env."""
        views, paths = {}, {}
        for i, vm in enumerate(fn_def.volume_mounts):
            v = self._volume(vm.volume_id)
            view = c_folder / "volumes" / str(i)
            shutil.copytree(v.committed, view, dirs_exist_ok=True)
            views[v.volume_id] = [view, snapshot(view), vm.read_only]
            paths[vm.mount_path] = str(view)
        env = {VOLUMES_ENV: json.dumps(paths)}
        for mount_path, var in self.mount_env.items():
            if mount_path in paths:
                env[var] = paths[mount_path]
        return views, env

    def _view(self, stream, volume_id: str) -> tuple[Container, list]:
        c = self.containers.of(stream)
        v = self._volume(volume_id)
        if c is None or v.volume_id not in c.volumes:
            # the client's docstring: "Must be called inside a container that mounts the Volume" (volume.py:891)
            raise GRPCError(Status.FAILED_PRECONDITION, f"Volume {volume_id} is not mounted by the caller")
        return c, c.volumes[v.volume_id]

    def commit_view(self, volume_id: str, entry: list) -> None:
        """V3: what the container changed since its last sync goes to the committed folder; files it
        deleted are deleted there; files others committed meanwhile stay (last writer wins per file)."""
        view, baseline, read_only = entry
        if read_only:
            return
        committed = self._volume(volume_id).committed
        now = snapshot(view)
        for rel, stat in list(now.items()):
            if baseline.get(rel) != stat or not (committed / rel).exists():
                try:
                    _copy(view / rel, committed / rel)
                except FileNotFoundError:  # deleted by the container since the listing (a background
                    del now[rel]  # commit runs beside it): deleted here too, as if listed after
        for rel in baseline.keys() - now.keys():
            (committed / rel).unlink(missing_ok=True)
            folder = (committed / rel).parent  # a folder the container emptied (and removed) goes too
            while folder != committed and not (view / folder.relative_to(committed)).exists():
                try:
                    folder.rmdir()
                except OSError:  # not empty: another container's files are in it
                    break
                folder = folder.parent
        entry[1] = now

    async def VolumeCommit(self, stream) -> None:
        req: api_pb2.VolumeCommitRequest = await stream.recv_message()
        _, entry = self._view(stream, req.volume_id)
        self.commit_view(req.volume_id, entry)
        # the client reloads after a commit unless told to skip (volume.py:899-904): it does, as on Modal
        await stream.send_message(api_pb2.VolumeCommitResponse(skip_reload=False))

    async def VolumeReload(self, stream) -> None:
        """V4: refused while any process of the container holds a file of the view open (FAILED_PRECONDITION:
        the client's ConflictError, raised as RuntimeError, volume.py:908-930); else the container's
        changes are committed ("may implicitly be committed", volume.py:914) and the view refreshed."""
        req: api_pb2.VolumeReloadRequest = await stream.recv_message()
        c, entry = self._view(stream, req.volume_id)
        view = entry[0]
        held = _open_files(c, view)
        if held:
            raise GRPCError(Status.FAILED_PRECONDITION, f"{OPEN_FILES} (e.g. {held[0]})")
        self.commit_view(req.volume_id, entry)
        committed = self._volume(req.volume_id).committed
        shutil.rmtree(view)
        shutil.copytree(committed, view)
        entry[1] = snapshot(view)
        await stream.send_message(Empty())

    # ---- from the laptop: V6

    def _entry(self, root: Path, p: Path) -> api_pb2.FileEntry:
        st = p.lstat()
        kind = api_pb2.FileEntry.FileType.DIRECTORY if p.is_dir() else api_pb2.FileEntry.FileType.FILE
        return api_pb2.FileEntry(path=str(p.relative_to(root)), type=kind, mtime=int(st.st_mtime), size=st.st_size)

    async def _list_files(self, stream, response_type) -> None:
        req = await stream.recv_message()
        v = self._volume(req.volume_id)
        target = _safe(v.committed, req.path or "/")
        if not target.exists():
            raise GRPCError(Status.NOT_FOUND, f"No such file or directory: {req.path}")
        if target.is_file():
            found = [target]
        elif req.recursive:
            found = sorted(p for p in target.rglob("*"))
        else:
            found = sorted(target.iterdir())
        await stream.send_message(response_type(entries=[self._entry(v.committed, p) for p in found]))

    async def VolumeListFiles(self, stream) -> None:
        await self._list_files(stream, api_pb2.VolumeListFilesResponse)

    async def VolumeListFiles2(self, stream) -> None:
        await self._list_files(stream, api_pb2.VolumeListFiles2Response)

    async def VolumeGetFile2(self, stream) -> None:
        req: api_pb2.VolumeGetFile2Request = await stream.recv_message()
        v = self._volume(req.volume_id)
        path = _safe(v.committed, req.path)
        if not path.is_file():
            raise GRPCError(Status.NOT_FOUND, f"No such file: {req.path}")  # the client's FileNotFoundError
        size = path.stat().st_size
        start = min(req.start, size)
        length = size - start if not req.len else min(req.len, size - start)
        urls, pos = [], start
        while pos < start + length:
            end = min(start + length, (pos // BLOCK_SIZE + 1) * BLOCK_SIZE)
            urls.append(f"{self.block_server.base_url}/blocks/{v.volume_id}/{pos}/{end - pos}/{req.path.lstrip('/')}")
            pos = end
        await stream.send_message(api_pb2.VolumeGetFile2Response(get_urls=urls, size=size, start=start, len=length))

    async def _remove(self, stream) -> None:
        req = await stream.recv_message()
        v = self._volume(req.volume_id)
        path = _safe(v.committed, req.path)
        if not path.exists():
            raise GRPCError(Status.NOT_FOUND, f"No such file or directory: {req.path}")
        if path.is_dir():
            if any(path.iterdir()) and not req.recursive:
                raise GRPCError(Status.INVALID_ARGUMENT, f"{req.path} is a non-empty directory: use recursive")
            shutil.rmtree(path)
        else:
            path.unlink()
        await stream.send_message(Empty())

    async def VolumeRemoveFile(self, stream) -> None:
        await self._remove(stream)

    async def VolumeRemoveFile2(self, stream) -> None:
        await self._remove(stream)


def _open_files(c: Container, view: Path) -> list[str]:
    """Files under `view` that a process of the container holds open (read from /proc)."""
    if c.proc is None or c.proc.returncode is not None:
        return []
    prefix = str(view.resolve()) + os.sep
    held = []
    for pid in _tree(c.proc.pid):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, PermissionError):
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                held.append(target[len(prefix) :])
    return held
