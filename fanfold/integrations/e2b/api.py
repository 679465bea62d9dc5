"""E2B's control plane (the REST API at ``E2B_API_URL``) on fanfold's engine.

``X-API-KEY`` is a fanfold token: its tenant owns what it creates, and another tenant's sandbox
is a 404. Errors are ``{"code": <status>, "message": ...}``. The mapping:

- create: ``templateID`` is a fanfold image reference or one of the tenant's snapshots (id or name);
  E2B's default ``base`` is fanfold's ``host``. ``timeout`` (seconds, default 300) is the deadline,
  ``metadata`` the labels (names of letters, digits and ``_.:/-``), ``envVars`` the sandbox's env;
  one ``Idempotency-Key`` (per tenant, for an hour) makes one sandbox, however often it is sent.
  Network: fanfold's default, none, unless ``network.allowOut`` lists what it may reach (a fanfold
  allow-list policy); ``allow_internet_access: true`` asks for ``open``, which fanfold grants only to
  the host's own callers, so a tenant gets a 400 saying to list hosts instead.
- pause is fanfold's suspend (memory to disk), connect resumes; running processes end first
  (fanfold cannot checkpoint a process fed from a host connection). A frozen (``paused``) fanfold
  sandbox reads as ``running``, a suspended one as ``paused``.
- fork is a live fork (its processes end first, as for pause); snapshots are disk snapshots,
  usable as a ``templateID``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import urllib.parse
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from ...errors import FanfoldError, SandboxNotFound
from ...models import CreateParams, SandboxInfo, SnapshotInfo
from ...web.deps import check_source
from ...web.status import status_for
from .account import DEFAULT_USER, USER_LABEL, make_account
from .auth import tenant_of_key
from .hosts import domain
from .envd import ENVD_VERSION, e2b, engine

log = logging.getLogger("fanfold.e2b")
TEMPLATE_LABEL = "e2b.template"
DEFAULT_TEMPLATES = {"base": "host", "code-interpreter-v1": "host"}
"""The SDKs' default templates (``e2b``'s and ``e2b-code-interpreter``'s), as fanfold images."""
"""The label keeping the templateID a sandbox was created from (left out of its metadata)."""
DEFAULT_TIMEOUT_S = 300
MAX_TIMEOUT_S = 86_400
CLIENT_ID = "fanfold"
MAX_BODY = 1024 * 1024
"""Largest control-plane request body."""
NEVER = "9999-12-31T23:59:59Z"
"""``endAt`` of a sandbox without a deadline."""


class ApiRoute(APIRoute):
    """Every error as E2B's API gives it, ``{"code", "message"}``; never a traceback."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def answered(request: Request) -> Response:
            try:
                tenant_of_key(request.app.state.tenants, request.headers.get("x-api-key"))  # before any body is read
                declared = request.headers.get("content-length", "0")
                if declared.isdigit() and int(declared) > MAX_BODY:
                    return api_error(413, f"the request body is over {MAX_BODY // 1024} KiB")
                return await handler(request)
            except RequestValidationError as err:
                problems = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in err.errors()[:5])
                return api_error(400, f"invalid request: {problems}")
            except FanfoldError as err:
                status = status_for(err)
                return api_error(400 if status == 422 else status, str(err))
            except HTTPException as err:  # a body FastAPI could not parse (not UTF-8, say)
                return api_error(err.status_code, str(err.detail))
            except Exception as err:  # noqa: BLE001 - a bug still answers in E2B's shape
                log.exception("fanfold e2b: unexpected error in the API")
                return api_error(500, f"fanfold bug: {type(err).__name__}: {err}")

        return answered


def api_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


router = APIRouter(route_class=ApiRoute, tags=["e2b"])


def caller(request: Request, x_api_key: str | None = Header(None)) -> str:
    """The tenant whose token is the ``X-API-KEY``."""
    return tenant_of_key(request.app.state.tenants, x_api_key)


def owned(request: Request, sandbox_id: str, tenant: str = Depends(caller)) -> str:
    if engine(request).tenant_of(sandbox_id) != tenant:
        raise SandboxNotFound(f"sandbox {sandbox_id} not found")
    return sandbox_id


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Network(_Body):
    allowOut: list[str] | None = None
    denyOut: list[str] | None = None


class NewSandbox(_Body):
    templateID: str = "base"
    timeout: int = Field(DEFAULT_TIMEOUT_S, ge=1, le=MAX_TIMEOUT_S)
    metadata: dict[str, str] | None = None
    envVars: dict[str, str] | None = None
    allow_internet_access: bool | None = None
    network: Network | None = None


class NetworkUpdate(Network):
    allow_internet_access: bool | None = None


class Timeout(_Body):
    timeout: int = Field(ge=1, le=MAX_TIMEOUT_S)


class Connect(_Body):
    timeout: int | None = Field(None, ge=1, le=MAX_TIMEOUT_S)


class Fork(_Body):
    count: int = Field(1, ge=1, le=64)
    timeout: int | None = Field(None, ge=1, le=MAX_TIMEOUT_S)


class Snapshot(_Body):
    name: str | None = None
    memory: bool = False


# -- bodies -----------------------------------------------------------------------------------


def created(request: Request, info: SandboxInfo) -> dict[str, Any]:
    """What create, connect and fork answer for a sandbox."""
    return {
        "templateID": template_of(info), "sandboxID": info.id, "clientID": CLIENT_ID, "envdVersion": ENVD_VERSION,
        "envdAccessToken": e2b(request).tokens.token(info.id),
        "trafficAccessToken": e2b(request).tokens.token(info.id),  # the code interpreter sends only this one
        "domain": domain(request),
    }


def detail(request: Request, info: SandboxInfo) -> dict[str, Any]:
    """get_info's and list's body for a sandbox."""
    return {
        **created(request, info),
        "startedAt": iso(info.created_at), "endAt": NEVER if info.deadline_at is None else iso(info.deadline_at),
        "cpuCount": max(1, math.ceil(info.limits.cpus)), "memoryMB": info.limits.memory_mb,
        "diskSizeMB": info.limits.disk_mb, "state": state_of(info),
        "metadata": {k: v for k, v in info.labels.items() if k not in (TEMPLATE_LABEL, USER_LABEL)},
    }


def template_of(info: SandboxInfo) -> str:
    return info.labels.get(TEMPLATE_LABEL) or info.source or info.image_id


def state_of(info: SandboxInfo) -> str:
    return "paused" if info.state == "suspended" else "running"


def iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch)) + f".{int(epoch % 1 * 1000):03d}Z"


def network_of(body: NewSandbox | NetworkUpdate) -> Any:
    """fanfold's network for E2B's: an allow list (and deny list) as a policy, else open or none."""
    rules = body.network if isinstance(body, NewSandbox) else body
    if rules is not None and rules.allowOut:
        return {"allow": rules.allowOut, **({"deny": rules.denyOut} if rules.denyOut else {})}
    return "open" if body.allow_internet_access else "none"


# -- routes -----------------------------------------------------------------------------------


@router.post("/sandboxes", status_code=201)
@router.post("/v2/sandboxes", status_code=201)
async def create(body: NewSandbox, request: Request, tenant: str = Depends(caller)) -> dict[str, Any]:
    """Start a sandbox; it is running when this answers."""
    image = DEFAULT_TEMPLATES.get(body.templateID, body.templateID)
    check_source(request, image, tenant)
    labels = {**(body.metadata or {}), TEMPLATE_LABEL: body.templateID, USER_LABEL: DEFAULT_USER}
    params = CreateParams(image=image, env=body.envVars or {}, labels=labels, deadline=body.timeout,
                          network=network_of(body))
    fleet = engine(request)

    async def run() -> SandboxInfo:
        made = await fleet.create(params, tenant=tenant)
        try:
            await make_account(fleet, made.id)
        except BaseException:
            await asyncio.shield(fleet.kill(made.id))
            raise
        return made

    # One Idempotency-Key, one sandbox: the server's registry of creates (as X-Request-ID for /v1)
    key = request.headers.get("idempotency-key")
    registry = request.app.state.creates
    entry = registry.start(tenant, f"e2b:{key}" if key else None, body.model_dump(), run)
    info = await asyncio.shield(entry.future)
    if await request.is_disconnected():
        registry.abandoned(entry, key)
    else:
        registry.claimed(entry)
    return created(request, info)


@router.get("/sandboxes")
@router.get("/v2/sandboxes")
async def list_sandboxes(
    request: Request, response: Response, tenant: str = Depends(caller),
    metadata: str | None = Query(None, description="URL-encoded key=value pairs the sandboxes carry."),
    state: str | None = Query(None, description="running, paused, or both, comma-separated."),
    limit: int = Query(1000, ge=1, le=1000), next_token: str | None = Query(None, alias="nextToken"),
) -> list[dict[str, Any]]:
    """The tenant's sandboxes, oldest first, a page at a time (the next page's token in ``x-next-token``)."""
    wanted = {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in urllib.parse.parse_qsl(metadata or "")}
    states = set((state or "running,paused").split(","))
    infos = [info for info in await engine(request).list(wanted, tenant=tenant) if state_of(info) in states]
    infos.sort(key=lambda info: (info.created_at, info.id))
    start = int(next_token) if next_token and next_token.isdigit() and len(next_token) < 10 else 0
    page = infos[start : start + limit]
    if start + limit < len(infos):
        response.headers["x-next-token"] = str(start + limit)
    return [detail(request, info) for info in page]


@router.get("/sandboxes/{sandbox_id}")
async def get_info(request: Request, sandbox_id: str = Depends(owned)) -> dict[str, Any]:
    return detail(request, await engine(request).get(sandbox_id))


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill(request: Request, sandbox_id: str = Depends(owned)) -> Response:
    """Destroy the sandbox; its processes end first."""
    state = e2b(request)
    async with state.quiet(sandbox_id):
        await engine(request).kill(sandbox_id)
    state.no_bash.discard(sandbox_id)
    state.watchers.forget(sandbox_id)
    state.cpu_samples.pop(sandbox_id, None)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/connect")
@router.post("/v2/sandboxes/{sandbox_id}/connect")
@router.post("/sandboxes/{sandbox_id}/resume")
async def connect(request: Request, body: Connect | None = None, sandbox_id: str = Depends(owned)) -> JSONResponse:
    """Resume a paused sandbox (201) or reach a running one (200); a longer ``timeout`` extends it."""
    fleet = engine(request)
    info = await fleet.get(sandbox_id)
    status = 200
    if info.state == "suspended":
        info, status = await fleet.resume(sandbox_id), 201
    if body is not None and body.timeout is not None:
        until = time.time() + body.timeout
        if info.deadline_at is not None and until > info.deadline_at:
            info = await fleet.set_deadline(sandbox_id, body.timeout)
    return JSONResponse(created(request, info), status_code=status)


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause(request: Request, sandbox_id: str = Depends(owned)) -> Response:
    """Suspend the sandbox to disk (409 if it is already); its running processes are ended first."""
    fleet = engine(request)
    if (await fleet.get(sandbox_id)).state == "suspended":
        return api_error(409, f"sandbox {sandbox_id} is already paused")
    async with e2b(request).quiet(sandbox_id):
        await fleet.suspend(sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(body: Timeout, request: Request, sandbox_id: str = Depends(owned)) -> Response:
    """The sandbox ends ``timeout`` seconds from now, instead of at its old deadline."""
    await engine(request).set_deadline(sandbox_id, body.timeout)
    return Response(status_code=204)


@router.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(request: Request, sandbox_id: str = Depends(owned), tenant: str = Depends(caller)) -> list[dict[str, Any]]:
    """One sample, now: CPU use since the last sample (since the start, the first time), memory in use,
    and the sandbox's limits. fanfold keeps no history and does not measure disk use (``diskUsed`` 0)."""
    fleet = engine(request)
    info = await fleet.get(sandbox_id)
    row = next((r for r in (await fleet.stats(tenant=tenant))["sandboxes"] if r["id"] == sandbox_id), None)
    if row is None:
        raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
    now, cpus = time.time(), max(info.limits.cpus, 0.01)
    last_cpu, last_at = e2b(request).cpu_samples.get(sandbox_id, (0.0, info.created_at))
    e2b(request).cpu_samples[sandbox_id] = (row["cpu_s"], now)
    used = (row["cpu_s"] - last_cpu) / max(now - last_at, 1e-3) / cpus * 100
    return [{
        "timestamp": iso(now), "timestampUnix": int(now), "cpuCount": math.ceil(cpus),
        "cpuUsedPct": round(min(max(used, 0.0), 100.0), 2), "memUsed": row["memory_bytes"],
        "memTotal": info.limits.memory_mb << 20, "memCache": 0, "diskUsed": 0, "diskTotal": info.limits.disk_mb << 20,
    }]


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(body: NetworkUpdate, request: Request, sandbox_id: str = Depends(owned),
                         tenant: str = Depends(caller)) -> Response:
    """Replace the sandbox's network as create would set it (fanfold's set_network): new connections
    and later commands follow it at once."""
    await engine(request).set_network(sandbox_id, network_of(body), tenant=tenant)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork(body: Fork, request: Request, sandbox_id: str = Depends(owned)) -> list[dict[str, Any]]:
    """``count`` live copies of the sandbox; its running processes are ended first."""
    async with e2b(request).quiet(sandbox_id):
        result = await engine(request).fork(sandbox_id, body.count, deadline=body.timeout)
    return [{"sandbox": created(request, child)} for child in result.children]


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def snapshot(body: Snapshot, request: Request, sandbox_id: str = Depends(owned)) -> dict[str, Any]:
    """Snapshot the sandbox's disk (with ``memory``, its processes too, once the envd ones end); the
    snapshot's id or name is then a templateID."""
    async with e2b(request).quiet(sandbox_id):
        snap = await engine(request).snapshot(sandbox_id, memory=body.memory, name=body.name)
    return snapshot_json(snap)


def snapshot_json(snap: SnapshotInfo) -> dict[str, Any]:
    return {"snapshotID": snap.id, "names": [snap.name] if snap.name else []}


@router.get("/snapshots")
async def list_snapshots(
    request: Request, response: Response, tenant: str = Depends(caller),
    sandbox_id: str | None = Query(None, alias="sandboxID"), name: str | None = Query(None),
    limit: int = Query(1000, ge=1, le=1000), next_token: str | None = Query(None, alias="nextToken"),
) -> list[dict[str, Any]]:
    """The tenant's snapshots, oldest first, of one sandbox or with one name if asked, a page at a time."""
    snaps = [snap for snap in await engine(request).snapshots(tenant=tenant)
             if sandbox_id in (None, snap.sandbox_id) and name in (None, snap.name, snap.id)]
    snaps.sort(key=lambda snap: (snap.created_at, snap.id))
    start = int(next_token) if next_token and next_token.isdigit() and len(next_token) < 10 else 0
    if start + limit < len(snaps):
        response.headers["x-next-token"] = str(start + limit)
    return [snapshot_json(snap) for snap in snaps[start : start + limit]]


@router.delete("/templates/{template_id}", status_code=204)
async def delete_snapshot(request: Request, template_id: str, tenant: str = Depends(caller)) -> Response:
    """Delete a snapshot (E2B's SDK deletes snapshots as templates); 404 when the tenant has none of
    that id or name, 409 while sandboxes or later snapshots are made from it."""
    fleet = engine(request)
    resolved = fleet.resolve_snapshot(template_id, tenant=tenant)
    if resolved is None or fleet.snapshot_tenant(resolved) != tenant:
        return api_error(404, f"no snapshot {template_id!r}")
    await fleet.delete_snapshot(resolved)
    return Response(status_code=204)
