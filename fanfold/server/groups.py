"""Routes of sandbox groups: create (from members or a group snapshot), get, list, kill, snapshot, fork.

A group belongs to its creator's tenant (another tenant's answers 404, as sandboxes do); each member
is made as that tenant's create would make it, so a tenant's limits, images and policies hold.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends, Request, Response

from ..groups import info_to_wire, params_from_wire, snapshot_to_wire
from ..errors import InvalidRequest
from ..web.deps import ERRORS, check_source, engine, host_only, seen_by, tenant

router = APIRouter(tags=["groups"])
GROUP_BODY = Body(..., description="A fanfold.GroupParams as JSON: members (name, params, after, health, ports)"
                                   " or source (a group snapshot), network, labels, deadline, detached; and lease.")


@router.post("/v1/groups", status_code=201, responses=ERRORS)
async def create_group(request: Request, body: dict[str, Any] = GROUP_BODY,
                       caller: str = Depends(tenant)) -> dict[str, Any]:
    """Start sandboxes on a private network of their own; running (and healthy, where checked) when this answers."""
    lease = body.pop("lease", None)
    if lease is not None and not isinstance(lease, str):
        raise InvalidRequest(f"lease must be a lease id, got {lease!r}")
    params = params_from_wire(body)
    for member in params.members:
        check_source(request, member.params.image, caller)
        if member.params.seccomp != "default":
            host_only(caller, "choose a seccomp profile other than default")
    return info_to_wire(await engine(request).create_group(params, tenant=caller, lease=lease))


@router.get("/v1/groups", responses=ERRORS)
async def list_groups(request: Request, caller: str = Depends(tenant)) -> list[dict[str, Any]]:
    """The caller's groups (the host's own tenant: every tenant's)."""
    return [info_to_wire(info) for info in await engine(request).list_groups(tenant=seen_by(caller))]


@router.get("/v1/groups/{group_id}", responses=ERRORS)
async def get_group(group_id: str, request: Request, caller: str = Depends(tenant)) -> dict[str, Any]:
    return info_to_wire(await engine(request).get_group(group_id, tenant=seen_by(caller)))


@router.delete("/v1/groups/{group_id}", status_code=204, responses=ERRORS)
async def kill_group(group_id: str, request: Request, caller: str = Depends(tenant)) -> Response:
    """Destroy every member and the group's network."""
    await engine(request).kill_group(group_id, tenant=seen_by(caller))
    return Response(status_code=204)


@router.post("/v1/groups/{group_id}/snapshot", status_code=201, responses=ERRORS)
async def snapshot_group(group_id: str, request: Request, caller: str = Depends(tenant),
                         body: dict[str, Any] = Body(default_factory=dict)) -> dict[str, Any]:
    """Snapshot every member as one group snapshot (``memory``: processes too; ``name``: kept by name)."""
    memory, name = body.get("memory", False), body.get("name")
    made = await engine(request).snapshot_group(group_id, memory=memory, name=name, tenant=seen_by(caller))
    return snapshot_to_wire(made)


@router.post("/v1/groups/{group_id}/fork", status_code=201, responses=ERRORS)
async def fork_group(group_id: str, request: Request, caller: str = Depends(tenant),
                     body: dict[str, Any] = Body(...)) -> list[dict[str, Any]]:
    """``count`` live copies of the whole group, each on a private network of its own."""
    made = await engine(request).fork_group(group_id, body.get("count"), tenant=seen_by(caller))
    return [info_to_wire(info) for info in made]


@router.get("/v1/group-snapshots", responses=ERRORS)
async def group_snapshots(request: Request, caller: str = Depends(tenant)) -> list[dict[str, Any]]:
    return [snapshot_to_wire(s) for s in await engine(request).group_snapshots(tenant=seen_by(caller))]


@router.delete("/v1/group-snapshots/{snapshot_id}", status_code=204, responses=ERRORS)
async def delete_group_snapshot(snapshot_id: str, request: Request, caller: str = Depends(tenant)) -> Response:
    await engine(request).delete_group_snapshot(snapshot_id, tenant=seen_by(caller))
    return Response(status_code=204)
