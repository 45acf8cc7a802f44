"""Secrets: named sets of environment variables, given to the containers of the functions that name them.

`Secret.from_name(name)` hydrates with `SecretGetOrCreate` (no creation type: a lookup, `NOT_FOUND`
if missing: secret.py:470-477, emulator S22); `Secret.from_dict` sends an anonymous one with its
`env_dict`; `Secret.objects.create` a named one (secret.py:540-553). A function's container gets the
variables of each Secret in its definition's `secret_ids`, in order (later ones win).
The plane is given its named Secrets when it starts (`ControlPlane(secrets={name: {VAR: value}})`).
"""

from __future__ import annotations

import time

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from modal_proto import api_pb2


class SecretRPCs:
    """Mixed into the servicer: `self.secrets` (id -> (name, variables)), `self.secret_names`."""

    secrets: dict[str, tuple[str | None, dict[str, str]]]
    secret_names: dict[str, str]

    def add_secret(self, name: str | None, variables: dict[str, str]) -> str:
        sid = self.new_id("st")
        self.secrets[sid] = (name, dict(variables))
        if name:
            self.secret_names[name] = sid
        return sid

    async def SecretGetOrCreate(self, stream) -> None:
        req: api_pb2.SecretGetOrCreateRequest = await stream.recv_message()
        t = req.object_creation_type
        if not req.deployment_name:  # Secret.from_dict: anonymous, owned by the app or ephemeral
            sid = self.add_secret(None, dict(req.env_dict))
        else:
            sid = self.secret_names.get(req.deployment_name)
            if sid is not None and t == api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS:
                raise GRPCError(Status.ALREADY_EXISTS, f"Secret {req.deployment_name!r} already exists")
            if t in (
                api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS,
                api_pb2.OBJECT_CREATION_TYPE_CREATE_OVERWRITE_IF_EXISTS,
            ):
                sid = self.add_secret(req.deployment_name, dict(req.env_dict))
            elif sid is None:
                raise GRPCError(Status.NOT_FOUND, f"Secret {req.deployment_name!r} not found")
        name, variables = self.secrets[sid]
        missing = [k for k in req.required_keys if k not in variables]
        if missing:  # Secret.from_name(required_keys=...)
            raise GRPCError(Status.NOT_FOUND, f"Secret {name!r} is missing keys: {', '.join(missing)}")
        metadata = api_pb2.SecretMetadata(
            name=name or "",
            keys=sorted(variables),
            environment_name="main",
            creation_info=api_pb2.CreationInfo(created_at=time.time(), created_by="cellfeed-control-plane"),
        )
        await stream.send_message(api_pb2.SecretGetOrCreateResponse(secret_id=sid, metadata=metadata))

    def secret_env(self, fn_def: api_pb2.Function) -> dict[str, str]:
        env: dict[str, str] = {}
        for sid in fn_def.secret_ids:
            if sid not in self.secrets:
                raise GRPCError(Status.NOT_FOUND, f"Secret {sid} not found")
            env.update(self.secrets[sid][1])
        return env
