"""What every route needs: the engine, the caller's tenant, and a sandbox or snapshot the tenant owns."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from fastapi import Depends, Header, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..engine import Engine
from ..errors import FanfoldError, SandboxNotFound, SnapshotNotFound, Unauthorized, host_full
from ..wire import error_to_json
from .auth import LOCAL_TENANT
from .schemas import ErrorBody
from .status import bug_body

log = logging.getLogger("fanfold.server")
_bearer = HTTPBearer(auto_error=False, description="A token given to `fanfold serve`; optional on the unix socket.")
NDJSON = "application/x-ndjson"
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (401, 404, 409, 413, 422, 429, 503)
}
"""The error replies a route may give, for its OpenAPI description."""
RequestID = Header(None, alias="X-Request-ID", max_length=128,
                   description="Retrying with the same ID returns what the first call made, never more.")


def engine(request: Request) -> Engine:
    return request.app.state.engine


def tenant(request: Request, _: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> str:
    """Checked by the Gate middleware before the body is read; this only hands it over."""
    return request.state.tenant


def seen_by(caller: str) -> str | None:
    """Whose things ``caller`` lists: its own, or everyone's for the host's own tenant (None), which
    sees and acts on every tenant's sandboxes and snapshots, as the embedded SDK and CLI do."""
    return None if caller == LOCAL_TENANT else caller


def sees(caller: str, owner: str | None) -> bool:
    """Whether ``caller`` may see and act on what ``owner`` holds (None: there is no such thing)."""
    return owner is not None and (caller == LOCAL_TENANT or owner == caller)


def owned_sandbox(
    request: Request,
    sandbox_id: str = Path(description="A sandbox id, as create returned it."),
    caller: str = Depends(tenant),
) -> str:
    """The sandbox id, when it exists and the caller sees it; another tenant's is a 404 too."""
    if not sees(caller, engine(request).tenant_of(sandbox_id)):
        raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
    return sandbox_id


def owned_snapshot(
    request: Request,
    snapshot_id: str = Path(description="A snapshot id, or the name it was given."),
    caller: str = Depends(tenant),
) -> str:
    """The snapshot's id, when it exists and the caller sees it; another tenant's is a 404 too. A name
    is looked up among the caller's own (each tenant names its own snapshots; the host's own tenant
    reaches another's by id)."""
    resolved = engine(request).resolve_snapshot(snapshot_id, tenant=caller)
    if resolved is None or not sees(caller, engine(request).snapshot_tenant(resolved)):
        raise SnapshotNotFound(f"no snapshot {snapshot_id!r}")
    return resolved


def check_source(request: Request, ref: str, caller: str) -> None:
    """A create's image may name a snapshot: then it must be the caller's (else 404, as for sandboxes)."""
    check_source_of(engine(request), ref, caller)


def check_source_of(on: Engine, ref: str, caller: str) -> None:
    """``check_source`` where there is no request (a server's own sessions)."""
    resolved = on.resolve_snapshot(ref, tenant=caller)
    if resolved is not None and not sees(caller, on.snapshot_tenant(resolved)):
        raise SnapshotNotFound(f"no snapshot {ref!r}")


def line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


async def ndjson_events(queue: asyncio.Queue[dict[str, Any] | None], task: asyncio.Task[Any],
                        final_key: str) -> AsyncIterator[bytes]:
    """Lines from ``queue`` while ``task`` runs, then its result under ``final_key`` or its error.

    The response is already 200 when the work fails, so a failure is the last line:
    ``{"error": {"kind": ..., "message": ...}}``. If the client goes away, the work is cancelled.
    """
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (item := await queue.get()) is not None:
            yield line(item)
        try:
            yield line({final_key: task.result()})
        except FanfoldError as err:
            yield line({"error": error_to_json(err)})
        except Exception as err:  # noqa: BLE001 - the 200 is gone: a bug still ends the stream in a line
            if (full := host_full(err)) is not None:
                yield line({"error": error_to_json(full)})
            else:
                log.exception("fanfold server: unexpected error in a stream")
                yield line({"error": bug_body(err)})
    finally:
        await _cancel(task)


class ClientGone(Exception):
    """The client disconnected before the answer; its work was cancelled."""


async def until_disconnect(request: Request, task: asyncio.Task[Any]) -> Any:
    """``task``'s result, unless the client disconnects first: then the task is cancelled."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        await _cancel(task)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _cancel(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` unless it is done, and wait until it has let go of what it held."""
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def host_only(caller: str, what: str) -> None:
    """Unauthorized unless the caller is the host's own tenant (the unix socket)."""
    if caller != LOCAL_TENANT:
        raise Unauthorized(f"only the host's own tenant (the unix socket) may {what}")
