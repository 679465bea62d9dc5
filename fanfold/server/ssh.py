"""``POST /v1/sandboxes/{id}/ssh``: a real sshd in the caller's sandbox, authorizing the keys the
request names and the tenant's keys registered with the server (``fanfold serve --ssh-keys``),
never another tenant's."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field, StringConstraints

from ..ssh import DEFAULT_PORT, MAX_KEYS, SshAccess
from ..web.deps import ERRORS, LOCAL_TENANT, engine, owned_sandbox, tenant
from ..web.schemas import model_of

router = APIRouter(prefix="/v1/sandboxes", tags=["ssh"])
PublicKey = Annotated[str, StringConstraints(min_length=1, max_length=16384)]


class SshRequest(BaseModel):
    authorized_keys: list[PublicKey] = Field(default_factory=list, max_length=MAX_KEYS, description=(
        "OpenSSH public key lines to authorize, besides the tenant's keys registered with the server."))
    port: int = Field(DEFAULT_PORT, ge=1, le=65535, description="sshd's port inside the sandbox.")


SshBody = model_of(SshAccess, name="SshBody")


@router.post("/{sandbox_id}/ssh", response_model=SshBody, responses=ERRORS)
async def enable_ssh(body: SshRequest, request: Request, sandbox_id: str = Depends(owned_sandbox),
                     caller: str = Depends(tenant)) -> dict[str, Any]:
    """Start sshd in the sandbox (or keep the one running), authorizing exactly the request's keys and
    the tenant's registered ones; idempotent. A tenant over TCP reaches it with ``fanfold ssh --stdio``
    as its ssh ProxyCommand; the host's own tenant also gets a loopback address."""
    registered = request.app.state.tenants.ssh_keys.get(caller, ())
    access = await engine(request).enable_ssh(sandbox_id, [*registered, *body.authorized_keys], port=body.port)
    return {**access.to_dict(), "address": access.address if caller == LOCAL_TENANT else None}
