"""Routes of snapshots: take one of a sandbox, list, get, delete, collect the unneeded, and move one
between servers (a cluster's nodes): export streams it as a tar, import pulls it from another server.

A snapshot belongs to its sandbox's tenant; another tenant's answers 404, as sandboxes do.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse

from ..engine.transfer import MAX_HAVE_BYTES, TAR
from ..errors import InvalidRequest
from ..wire import snapshot_to_json
from ..web.deps import ERRORS, engine, host_only, owned_sandbox, owned_snapshot, seen_by, tenant
from ..web.schemas import GcBody, SnapshotBody, SnapshotImportRequest, SnapshotRequest

router = APIRouter(tags=["snapshots"])


@router.post("/v1/sandboxes/{sandbox_id}/snapshot", status_code=201, response_model=SnapshotBody, responses=ERRORS)
async def snapshot_sandbox(body: SnapshotRequest, request: Request,
                           sandbox_id: str = Depends(owned_sandbox)) -> dict[str, Any]:
    """Snapshot the sandbox's disk, and with ``memory`` its processes; it runs on afterwards."""
    return snapshot_to_json(await engine(request).snapshot(sandbox_id, memory=body.memory, name=body.name))


@router.get("/v1/snapshots", response_model=list[SnapshotBody], responses=ERRORS)
async def list_snapshots(request: Request, caller: str = Depends(tenant)) -> list[dict[str, Any]]:
    """The caller's snapshots (the host's own tenant: every tenant's)."""
    return [snapshot_to_json(snapshot) for snapshot in await engine(request).snapshots(tenant=seen_by(caller))]


@router.post("/v1/snapshots/gc", response_model=GcBody, responses=ERRORS)
async def gc_snapshots(request: Request, caller: str = Depends(tenant)) -> dict[str, list[str]]:
    """Delete the caller's snapshots that are unnamed and that no sandbox or later snapshot needs."""
    return {"removed": await engine(request).gc(tenant=caller)}


@router.post("/v1/snapshots/import", status_code=201, response_model=SnapshotBody, responses=ERRORS)
async def import_snapshot(body: SnapshotImportRequest, request: Request, caller: str = Depends(tenant)) -> dict[str, Any]:
    """Pull a snapshot from another server (its export route) and keep it here under the same id, owned by
    the tenant the token stands for here; one already here is answered as it is. The host's tenant only:
    the server fetches the URL it is given."""
    host_only(caller, "import snapshots from another server")
    token = body.token or _bearer(request)
    owner = request.app.state.tenants.tenant_of_token(token) if token else None
    info = await engine(request).import_snapshot(body.source, body.snapshot, token=token,
                                                 tenant=caller if owner is None else owner)
    return snapshot_to_json(info)


@router.get(
    "/v1/snapshots/{snapshot_id}/export",
    responses={**ERRORS, 200: {"content": {TAR: {}}, "description": "The snapshot as a tar, for another server's import."}},
    response_class=StreamingResponse,
)
async def export_snapshot(
    request: Request, snapshot_id: str = Depends(owned_snapshot), caller: str = Depends(tenant),
    # No maxLength in the schema: one near the server's 64 KiB head invites fuzzers past it, to a non-JSON 400.
    have: str = Query("", description="Layers the importer holds (comma-separated): not sent."),
) -> StreamingResponse:
    """The snapshot's row, the rows, image and layers it stacks on, and its memory, as one tar stream."""
    if len(have) > MAX_HAVE_BYTES:
        raise InvalidRequest(f"have names over {MAX_HAVE_BYTES} bytes of layers")
    held = {name for name in have.split(",") if name}
    return StreamingResponse(await engine(request).export_snapshot(snapshot_id, have=held, tenant=seen_by(caller)), media_type=TAR)


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


@router.get("/v1/snapshots/{snapshot_id}", response_model=SnapshotBody, responses=ERRORS)
async def get_snapshot(request: Request, snapshot_id: str = Depends(owned_snapshot)) -> dict[str, Any]:
    return snapshot_to_json(await engine(request).get_snapshot(snapshot_id))


@router.delete("/v1/snapshots/{snapshot_id}", status_code=204, responses=ERRORS)
async def delete_snapshot(request: Request, snapshot_id: str = Depends(owned_snapshot)) -> Response:
    """Delete a snapshot; 409 while sandboxes or later snapshots are made from it."""
    await engine(request).delete_snapshot(snapshot_id)
    return Response(status_code=204)
