"""Routes of the host: leases (owners' heartbeats), warm pools, stats and Prometheus metrics.

Pools are per tenant: a tenant lists, resizes and takes from only its own, made from its own
or shared images (another tenant's image is a 404), within its ``pools`` quota."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Path, Query, Request, Response

from ..web.deps import check_source, engine, seen_by, tenant
from ..web.schemas import ErrorBody, LeaseBody, LeaseRequest, PoolBody, PoolRequest, limits_of

router = APIRouter(prefix="/v1", tags=["host"])
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (401, 404, 422, 429, 503)}
LeaseID = Path(description="A lease id, as POST /v1/leases returned it.", max_length=64)
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


@router.post("/leases", status_code=201, response_model=LeaseBody, responses=ERRORS)
async def open_lease(body: LeaseRequest, request: Request, caller: str = Depends(tenant)) -> dict[str, Any]:
    """A lease for the caller's sandboxes: renew it within its ttl, or they are destroyed."""
    return (await engine(request).open_lease(body.ttl, tenant=caller)).to_dict()


@router.post("/leases/{lease_id}/renew", response_model=LeaseBody, responses=ERRORS)
async def renew_lease(request: Request, lease_id: str = LeaseID, caller: str = Depends(tenant)) -> dict[str, Any]:
    """The heartbeat: keep the lease and its sandboxes for another ttl (404 once it expired)."""
    return (await engine(request).renew_lease(lease_id, tenant=caller)).to_dict()


@router.delete("/leases/{lease_id}", responses=ERRORS)
async def close_lease(request: Request, lease_id: str = LeaseID, caller: str = Depends(tenant)) -> dict[str, int]:
    """End the lease now and destroy its sandboxes."""
    return {"destroyed": await engine(request).close_lease(lease_id, tenant=caller)}


@router.put("/pools", response_model=PoolBody, responses=ERRORS)
async def set_pool(body: PoolRequest, request: Request, caller: str = Depends(tenant)) -> dict[str, Any]:
    """Keep sandboxes of an image (or one of the caller's snapshots) warm for the caller's creates with the
    same limits; size 0 removes the pool."""
    check_source(request, body.image, caller)
    limits = limits_of(body)
    return (await engine(request).set_pool(body.image, body.size, limits=limits, wait=body.wait,
                                           tenant=caller)).to_dict()


@router.get("/pools", response_model=list[PoolBody], responses=ERRORS)
async def list_pools(request: Request, caller: str = Depends(tenant)) -> list[dict[str, Any]]:
    """The caller's warm pools."""
    return [pool.to_dict() for pool in await engine(request).pools_info(tenant=caller)]


@router.get("/stats", responses=ERRORS)
async def stats(request: Request, caller: str = Depends(tenant),
                sandboxes: bool = Query(True, description="List the sandboxes with their usage (false: the counts "
                                                          "only, cheap to poll).")) -> dict[str, Any]:
    """The host at a glance (``fanfold top``): counts, queue, pools, latency percentiles, error
    rates and alerts; the sandbox and pool lists hold the caller's only, but for the host's tenant (all)."""
    return await engine(request).stats(tenant=seen_by(caller), sandboxes=sandboxes)


@router.get("/metrics", responses=ERRORS, response_class=Response)
async def metrics(request: Request, caller: str = Depends(tenant)) -> Response:
    """Prometheus metrics (text format 0.0.4); also served at ``/metrics``. A tenant's token sees the host's
    figures with its own pools only and provisioning times summed over sources; the host's own tenant, all."""
    return Response(await engine(request).metrics_text(tenant=seen_by(caller)), media_type=PROMETHEUS)
