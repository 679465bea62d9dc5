"""Routes of sandboxes: create, get, list, kill, exec, fork, and pause, suspend, reset and their undoing."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine import Engine
from ..errors import InvalidRequest
from ..wire import b64, create_from_json, fork_to_json, info_to_json, result_to_json, unb64
from ..web.deps import (
    ERRORS, NDJSON, RequestID, check_source, engine, host_only, ndjson_events, owned_sandbox, seen_by, tenant,
    until_disconnect,
)
from ..web.schemas import (
    CreateRequest, ExecInput, ExecRequest, ExecResultBody, ForkBody, ForkRequest, SandboxBody, network_value,
)
from .creates import Made
from .live import LiveExec

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])


@router.post("", status_code=201, response_model=SandboxBody, responses=ERRORS)
async def create(
    body: CreateRequest,
    request: Request,
    caller: str = Depends(tenant),
    request_id: str | None = RequestID,
) -> dict[str, Any]:
    """Start a sandbox from an image or one of the caller's snapshots; it is running when this answers."""
    fleet: Engine = engine(request)
    check_source(request, body.image, caller)
    if body.seccomp != "default":
        host_only(caller, "choose a seccomp profile other than default")
    params = create_from_json({**body.model_dump(exclude={"lease"}), "network": network_value(body.network)})
    info = await _once(request, caller, request_id, body.model_dump(),
                       lambda: fleet.create(params, tenant=caller, lease=body.lease))
    return info_to_json(info)


async def _once(request: Request, caller: str, request_id: str | None, params: dict[str, Any],
                run: Callable[[], Awaitable[Made]]) -> Made:
    """What ``run`` made, made once per request ID; killed if the caller left and never came back for it."""
    registry = request.app.state.creates
    entry = registry.start(caller, request_id, params, run)
    made = await asyncio.shield(entry.future)
    if await request.is_disconnected():
        registry.abandoned(entry, request_id)
    else:
        registry.claimed(entry)
    return made


@router.get("", response_model=list[SandboxBody], responses=ERRORS)
async def list_sandboxes(
    request: Request,
    caller: str = Depends(tenant),
    label: list[str] = Query(default_factory=list, description="KEY=VALUE; only sandboxes carrying all of them."),
) -> list[dict[str, Any]]:
    """The caller's sandboxes (the host's own tenant: every tenant's)."""
    wanted = {}
    for item in label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"label filter {item!r} is not KEY=VALUE")
        wanted[key] = value
    return [info_to_json(info) for info in await engine(request).list(wanted, tenant=seen_by(caller))]


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
    live = LiveExec.open(request, sandbox_id, body, queue) if body.live or body.pty else None
    if live is not None and not streaming:
        raise InvalidRequest("a live exec streams: ask for NDJSON, not application/json")

    async def on_output(stream: str, data: bytes) -> None:
        if live is not None:
            live.announce()  # the started line goes first, even when output came before its callback
        queue.put_nowait({"stream": stream, "data": b64(data)})

    async def run() -> dict[str, Any]:
        result = await fleet.exec(
            sandbox_id, body.cmd, cwd=body.cwd, env=body.env, stdin=stdin, timeout=body.timeout,
            max_output=body.max_output, on_output=on_output if streaming else None, user=body.user,
            control=None if live is None else live.control,
        )
        return result_to_json(result)

    task = asyncio.create_task(run())
    if live is not None:
        task.add_done_callback(lambda _: live.close())
    if streaming:
        return StreamingResponse(ndjson_events(queue, task, "result"), media_type=NDJSON)
    return JSONResponse(await until_disconnect(request, task))


@router.post("/{sandbox_id}/exec/{exec_id}/input", status_code=204, responses=ERRORS)
async def exec_input(body: ExecInput, request: Request, exec_id: str,
                     sandbox_id: str = Depends(owned_sandbox)) -> Response:
    """Feed a live exec (one started with `live` or `pty`): stdin, its end, signals, a resize."""
    LiveExec.find(request, sandbox_id, exec_id).apply(body)
    return Response(status_code=204)


@router.post("/{sandbox_id}/fork", status_code=201, response_model=ForkBody, responses=ERRORS)
async def fork(
    body: ForkRequest,
    request: Request,
    sandbox_id: str = Depends(owned_sandbox),
    caller: str = Depends(tenant),
    request_id: str | None = RequestID,
) -> dict[str, Any]:
    """Checkpoint the running sandbox (processes too) and restore ``count`` children from it; they
    are running when this answers. The parent is frozen only for the checkpoint."""
    fleet: Engine = engine(request)
    params = {"fork": sandbox_id, **body.model_dump()}
    result = await _once(request, caller, request_id, params,
                         lambda: fleet.fork(sandbox_id, body.count, cmd=body.cmd, deadline=body.deadline))
    return fork_to_json(result)


_LIFECYCLE = {
    "pause": "Freeze the sandbox's processes; its memory stays resident. Any later call wakes it.",
    "unpause": "Thaw a paused sandbox.",
    "suspend": "Checkpoint the sandbox's processes to disk and stop them, freeing memory. Any later call resumes it.",
    "resume": "Restore a suspended sandbox's processes from disk.",
    "reset": "Return the sandbox to the image or snapshot it was made from (same id, fresh disk and processes).",
}


def _lifecycle_route(verb: str, summary: str) -> None:
    async def route(request: Request, sandbox_id: str = Depends(owned_sandbox)) -> dict[str, Any]:
        return info_to_json(await getattr(engine(request), verb)(sandbox_id))

    route.__doc__ = summary
    router.post(f"/{{sandbox_id}}/{verb}", response_model=SandboxBody, responses=ERRORS, name=verb)(route)


for _verb, _summary in _LIFECYCLE.items():
    _lifecycle_route(_verb, _summary)
