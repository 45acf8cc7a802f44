"""The Queue and Dict RPCs: requests unpacked, handed to `store.Store`, answers packed.

Which RPC each client method sends: `modal/queue.py` (QueueGetOrCreate 414, QueueGetById 462, QueueGet
493/518, QueueClear 551, QueuePut 687/721, QueueLen 749, QueueDelete 220, QueueHeartbeat 372) and
`modal/dict.py` (DictGetOrCreate 415, DictGetById 464, DictClear 491, DictGet 500, DictContains 509,
DictLen 519, DictUpdate 548/566, DictPop 589, DictContents 620-646, DictDelete 247, DictHeartbeat 367).
"""

from __future__ import annotations

from google.protobuf.empty_pb2 import Empty
from modal_proto import api_pb2

from cellfeed_testing.modal_control_plane.store import Store


def _creation_info(created_at: float) -> api_pb2.CreationInfo:
    return api_pb2.CreationInfo(created_at=created_at, created_by="cellfeed-control-plane")


class ObjectRPCs:
    """Mixed into the servicer, which sets `self.store`."""

    store: Store

    # ---- Queue

    def _queue_metadata(self, oid: str) -> api_pb2.QueueMetadata:
        q = self.store.queues[oid]
        return api_pb2.QueueMetadata(name=q.name or "", creation_info=_creation_info(q.created_at))

    async def QueueGetOrCreate(self, stream) -> None:
        req: api_pb2.QueueGetOrCreateRequest = await stream.recv_message()
        oid = self.store.get_or_create("queue", req.deployment_name, req.environment_name, req.object_creation_type)
        await stream.send_message(api_pb2.QueueGetOrCreateResponse(queue_id=oid, metadata=self._queue_metadata(oid)))

    async def QueueGetById(self, stream) -> None:
        req: api_pb2.QueueGetByIdRequest = await stream.recv_message()
        self.store.by_id("queue", req.queue_id)
        await stream.send_message(
            api_pb2.QueueGetByIdResponse(queue_id=req.queue_id, metadata=self._queue_metadata(req.queue_id))
        )

    async def QueueHeartbeat(self, stream) -> None:
        req: api_pb2.QueueHeartbeatRequest = await stream.recv_message()
        self.store.by_id("queue", req.queue_id)
        await stream.send_message(Empty())

    async def QueueDelete(self, stream) -> None:
        req: api_pb2.QueueDeleteRequest = await stream.recv_message()
        await self.store.delete("queue", req.queue_id)
        await stream.send_message(Empty())

    async def QueuePut(self, stream) -> None:
        req: api_pb2.QueuePutRequest = await stream.recv_message()
        await self.store.queue_put(req.queue_id, req.partition_key, list(req.values), req.partition_ttl_seconds)
        await stream.send_message(Empty())

    async def QueueGet(self, stream) -> None:
        req: api_pb2.QueueGetRequest = await stream.recv_message()
        values = await self.store.queue_get(req.queue_id, req.partition_key, req.n_values, req.timeout)
        await stream.send_message(api_pb2.QueueGetResponse(values=values))

    async def QueueLen(self, stream) -> None:
        req: api_pb2.QueueLenRequest = await stream.recv_message()
        n = self.store.queue_len(req.queue_id, req.partition_key, req.total)
        await stream.send_message(api_pb2.QueueLenResponse(len=n))

    async def QueueClear(self, stream) -> None:
        req: api_pb2.QueueClearRequest = await stream.recv_message()
        self.store.queue_clear(req.queue_id, req.partition_key, req.all_partitions)
        await stream.send_message(Empty())

    # ---- Dict

    def _dict_metadata(self, oid: str) -> api_pb2.DictMetadata:
        d = self.store.dicts[oid]
        return api_pb2.DictMetadata(name=d.name or "", creation_info=_creation_info(d.created_at))

    async def DictGetOrCreate(self, stream) -> None:
        req: api_pb2.DictGetOrCreateRequest = await stream.recv_message()
        oid = self.store.get_or_create("dict", req.deployment_name, req.environment_name, req.object_creation_type)
        # C1: `data` seeds a new Dict (ephemeral(data=...)); a named Dict that exists keeps its entries
        if req.data and not self.store.dicts[oid].entries:
            self.store.dict_update(oid, [(e.key, e.value) for e in req.data], False)
        await stream.send_message(api_pb2.DictGetOrCreateResponse(dict_id=oid, metadata=self._dict_metadata(oid)))

    async def DictGetById(self, stream) -> None:
        req: api_pb2.DictGetByIdRequest = await stream.recv_message()
        self.store.by_id("dict", req.dict_id)
        await stream.send_message(
            api_pb2.DictGetByIdResponse(dict_id=req.dict_id, metadata=self._dict_metadata(req.dict_id))
        )

    async def DictHeartbeat(self, stream) -> None:
        req: api_pb2.DictHeartbeatRequest = await stream.recv_message()
        self.store.by_id("dict", req.dict_id)
        await stream.send_message(Empty())

    async def DictDelete(self, stream) -> None:
        req: api_pb2.DictDeleteRequest = await stream.recv_message()
        await self.store.delete("dict", req.dict_id)
        await stream.send_message(Empty())

    async def DictUpdate(self, stream) -> None:
        req: api_pb2.DictUpdateRequest = await stream.recv_message()
        created = self.store.dict_update(req.dict_id, [(e.key, e.value) for e in req.updates], req.if_not_exists)
        await stream.send_message(api_pb2.DictUpdateResponse(created=created))

    async def DictGet(self, stream) -> None:
        req: api_pb2.DictGetRequest = await stream.recv_message()
        value = self.store.dict_get(req.dict_id, req.key)
        await stream.send_message(api_pb2.DictGetResponse(found=value is not None, value=value or b""))

    async def DictContains(self, stream) -> None:
        req: api_pb2.DictContainsRequest = await stream.recv_message()
        found = self.store.dict_get(req.dict_id, req.key) is not None  # a read is a use (C10)
        await stream.send_message(api_pb2.DictContainsResponse(found=found))

    async def DictPop(self, stream) -> None:
        req: api_pb2.DictPopRequest = await stream.recv_message()
        value = self.store.dict_pop(req.dict_id, req.key)
        await stream.send_message(api_pb2.DictPopResponse(found=value is not None, value=value or b""))

    async def DictLen(self, stream) -> None:
        req: api_pb2.DictLenRequest = await stream.recv_message()
        await stream.send_message(api_pb2.DictLenResponse(len=self.store.dict_len(req.dict_id)))

    async def DictClear(self, stream) -> None:
        req: api_pb2.DictClearRequest = await stream.recv_message()
        self.store.dict_clear(req.dict_id)
        await stream.send_message(Empty())

    async def DictContents(self, stream) -> None:
        # a server stream of DictEntry (dict.py:620): keys, values or both, as asked
        req: api_pb2.DictContentsRequest = await stream.recv_message()
        for k, v in self.store.dict_contents(req.dict_id):
            await stream.send_message(api_pb2.DictEntry(key=k if req.keys else b"", value=v if req.values else b""))
