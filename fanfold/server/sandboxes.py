"""Routes of sandboxes: create, get, list, kill and exec."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine import Engine
from ..errors import InvalidRequest
from ..models import Limits
from ..wire import b64, info_to_json, result_to_json, unb64
from .deps import NDJSON, engine, ndjson_events, owned_sandbox, tenant, until_disconnect
from .schemas import CreateRequest, ErrorBody, ExecRequest, ExecResultBody, SandboxBody

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (401, 404, 409, 413, 422, 429, 503)
}


@router.post("", status_code=201, response_model=SandboxBody, responses=ERRORS)
async def create(
    body: CreateRequest,
    request: Request,
    caller: str = Depends(tenant),
    request_id: str | None = Header(None, alias="X-Request-ID", max_length=128,
                                    description="Retrying with the same ID returns the same sandbox."),
) -> dict[str, Any]:
    """Start a sandbox; it is running when this answers."""
    fleet: Engine = engine(request)
    limits = Limits(cpus=body.cpus, memory_mb=body.memory_mb, pids=body.pids, disk_mb=body.disk_mb)
    params = body.model_dump()
    registry = request.app.state.creates
    entry = registry.start(caller, request_id, params, lambda: fleet.create(
        body.image, limits=limits, env=body.env, labels=body.labels, deadline=body.deadline,
        detached=body.detached, tenant=caller,
    ))
    info = await asyncio.shield(entry.future)
    if await request.is_disconnected():
        registry.abandoned(entry, request_id)
    else:
        registry.claimed(entry)
    return info_to_json(info)


@router.get("", response_model=list[SandboxBody], responses=ERRORS)
async def list_sandboxes(
    request: Request,
    caller: str = Depends(tenant),
    label: list[str] = Query(default_factory=list, description="KEY=VALUE; only sandboxes carrying all of them."),
) -> list[dict[str, Any]]:
    """The caller's sandboxes."""
    wanted = {}
    for item in label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"label filter {item!r} is not KEY=VALUE")
        wanted[key] = value
    return [info_to_json(info) for info in await engine(request).list(wanted, tenant=caller)]


@router.get("/{sandbox_id}", response_model=SandboxBody, responses=ERRORS)
async def get(request: Request, sandbox_id: str = Depends(owned_sandbox)) -> dict[str, Any]:
    return info_to_json(await engine(request).get(sandbox_id))


@router.delete("/{sandbox_id}", status_code=204, responses=ERRORS)
async def kill(request: Request, sandbox_id: str = Depends(owned_sandbox)) -> Response:
    """Destroy the sandbox and release all it held."""
    await engine(request).kill(sandbox_id)
    return Response(status_code=204)


@router.post(
    "/{sandbox_id}/exec",
    responses={**ERRORS, 200: {
        "description": "NDJSON: `{\"stream\": ..., \"data\": base64}` lines while the command runs, then"
                       " `{\"result\": ExecResult}` or `{\"error\": Error}`. With `Accept: application/json`,"
                       " the result alone.",
        "content": {NDJSON: {}, "application/json": {"schema": ExecResultBody.model_json_schema()}},
    }},
)
async def exec_command(body: ExecRequest, request: Request, sandbox_id: str = Depends(owned_sandbox)) -> Response:
    """Run a command. Output streams while it runs; a client that disconnects kills the command."""
    fleet: Engine = engine(request)
    stdin = None if body.stdin is None else unb64(body.stdin, "stdin")
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    streaming = "application/json" not in request.headers.get("accept", "")

    async def on_output(stream: str, data: bytes) -> None:
        queue.put_nowait({"stream": stream, "data": b64(data)})

    async def run() -> dict[str, Any]:
        result = await fleet.exec(
            sandbox_id, body.cmd, cwd=body.cwd, env=body.env, stdin=stdin, timeout=body.timeout,
            max_output=body.max_output, on_output=on_output if streaming else None,
        )
        return result_to_json(result)

    task = asyncio.create_task(run())
    if streaming:
        return StreamingResponse(ndjson_events(queue, task, "result"), media_type=NDJSON)
    return JSONResponse(await until_disconnect(request, task))
