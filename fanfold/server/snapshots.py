"""Routes of snapshots: take one of a sandbox, list, get, delete, and collect the unneeded.

A snapshot belongs to its sandbox's tenant; another tenant's answers 404, as sandboxes do.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from ..wire import snapshot_to_json
from .deps import engine, owned_sandbox, owned_snapshot, tenant
from .sandboxes import ERRORS
from .schemas import GcBody, SnapshotBody, SnapshotRequest

router = APIRouter(tags=["snapshots"])


@router.post("/v1/sandboxes/{sandbox_id}/snapshot", status_code=201, response_model=SnapshotBody, responses=ERRORS)
async def snapshot_sandbox(body: SnapshotRequest, request: Request,
                           sandbox_id: str = Depends(owned_sandbox)) -> dict[str, Any]:
    """Snapshot the sandbox's disk, and with ``memory`` its processes; it runs on afterwards."""
    return snapshot_to_json(await engine(request).snapshot(sandbox_id, memory=body.memory, name=body.name))


@router.get("/v1/snapshots", response_model=list[SnapshotBody], responses=ERRORS)
async def list_snapshots(request: Request, caller: str = Depends(tenant)) -> list[dict[str, Any]]:
    """The caller's snapshots."""
    return [snapshot_to_json(snapshot) for snapshot in await engine(request).snapshots(tenant=caller)]


@router.post("/v1/snapshots/gc", response_model=GcBody, responses=ERRORS)
async def gc_snapshots(request: Request, caller: str = Depends(tenant)) -> dict[str, list[str]]:
    """Delete the caller's snapshots that are unnamed and that no sandbox or later snapshot needs."""
    return {"removed": await engine(request).gc(tenant=caller)}


@router.get("/v1/snapshots/{snapshot_id}", response_model=SnapshotBody, responses=ERRORS)
async def get_snapshot(request: Request, snapshot_id: str = Depends(owned_snapshot)) -> dict[str, Any]:
    return snapshot_to_json(await engine(request).get_snapshot(snapshot_id))


@router.delete("/v1/snapshots/{snapshot_id}", status_code=204, responses=ERRORS)
async def delete_snapshot(request: Request, snapshot_id: str = Depends(owned_snapshot)) -> Response:
    """Delete a snapshot; 409 while sandboxes or later snapshots are made from it."""
    await engine(request).delete_snapshot(snapshot_id)
    return Response(status_code=204)
