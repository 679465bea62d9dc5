"""Tools over HTTP keyed by rollout id (docs/http.md, "Tools over HTTP, keyed by rollout id").

A rollout is a row of the server's own store (``rollout_store.py``: ``server.db`` beside the
engine's database), per tenant, so another token's rollout is a 404: what its sandbox is made
from, its deadline, and the lease and sandbox that serve it. The sandbox is made on the first
tool call or fork, under a lease of its own that lives until the deadline, so the engine
reaps it at the deadline even across a server restart, and DELETE ends it by closing the
lease. A fork's children are moved under leases of their new rollouts, so each rollout
ends alone. Rollouts and their sandboxes outlive a server restart, graceful or not: the
next server on the state directory serves them, until their deadline.

A tool call's model-visible mistakes answer 422 with a ``function_call_output`` for the
model in the body; an unknown rollout 404; one whose deadline passed or whose sandbox was
destroyed 410; infrastructure failures 429/503 with Retry-After. An ``X-Request-ID``
makes a call, fork or create run once however often it is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import time
import weakref
from collections import OrderedDict
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from ..engine import Engine
from ..engine.admission import check_fits_host
from ..engine.api import MAX_LEASE_TTL_S
from ..engine.sources import check_gpus, image_gpus
from ..errors import InvalidRequest, LeaseNotFound, NotFound, SandboxGone, SandboxNotFound, SnapshotNotFound, ToolError
from ..models import NO_GPUS, CreateParams, Limits
from ..spec import BASES
from ..tools import TOOLS, function_call_output, parse_arguments, run_checked
from ..wire import error_to_json
from .deps import ERRORS, RequestID, check_source, tenant
from .rollout_store import RolloutStore
from .schemas import (
    ROLLOUT_ID, ErrorBody, FunctionCall, FunctionCallOutput, RolloutBody, RolloutForkBody, RolloutForkRequest,
    RolloutRequest, ToolErrorBody, ToolsBody, network_value,
)
from .status import error_response

KEEP_ENDED_S = 3600.0
"""How long a rollout past its deadline still answers 410 before it is forgotten (then 404)."""
TOOL_TIMEOUT_S = 60.0
TOOL_MAX_OUTPUT = 16384
Reply = tuple[int, dict[str, Any], float]
"""A reply kept for retries: status, body, and the milliseconds the work took."""


class _RolloutRoute(APIRoute):
    """Here SandboxGone means the rollout is over: 410, not the 409 of the sandbox routes."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except SandboxGone as err:
                return error_response(err, 410)

        return route


router = APIRouter(prefix="/v1", tags=["rollouts"], route_class=_RolloutRoute)
RESPONSES: dict[int | str, dict[str, Any]] = {**ERRORS, 410: {"model": ErrorBody}}
RolloutID = Path(min_length=1, max_length=256, pattern=ROLLOUT_ID, description="The rollout's id.")
ToolName = Path(min_length=1, max_length=64, description="shell, read_file, write_file or search.")


class Replies:
    """One reply per (tenant, X-Request-ID): a retry waits for or replays the first call's,
    and the work runs once. Failures are forgotten, so a retry after one runs again."""

    MAX = 10_000
    KEEP_S = 3600.0

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[str, str], tuple[str, float, asyncio.Future[Reply]]] = OrderedDict()

    async def once(self, tenant: str, request_id: str | None, params: dict[str, Any],
                   run: Callable[[], Awaitable[Reply]]) -> Reply:
        # The work runs apart from the request, so a client that drops the connection and
        # retries gets what the first call did rather than cancelling it halfway.
        if request_id is None:
            return await asyncio.shield(asyncio.ensure_future(run()))
        self._prune()
        key = (tenant, request_id)
        fingerprint = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()
        if key in self._entries:
            known, _, future = self._entries[key]
            if known != fingerprint:
                raise InvalidRequest(f"X-Request-ID {request_id!r} was already used for a different request")
        else:
            future = asyncio.ensure_future(run())
            self._entries[key] = (fingerprint, time.monotonic(), future)
            future.add_done_callback(lambda done: self._forget_failed(key, done))
        return await asyncio.shield(future)

    def _forget_failed(self, key: tuple[str, str], future: asyncio.Future[Reply]) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry[2] is future and (future.cancelled() or future.exception() is not None):
            del self._entries[key]

    def _prune(self) -> None:
        old = time.monotonic() - self.KEEP_S
        while self._entries:  # oldest first; a call still running keeps those after it a while longer
            key, (_, at, future) = next(iter(self._entries.items()))
            if not future.done() or (at >= old and len(self._entries) <= self.MAX):
                return
            del self._entries[key]

    async def close(self) -> None:
        futures = [future for _, _, future in self._entries.values()]
        for future in futures:
            future.cancel()
        await asyncio.gather(*futures, return_exceptions=True)
        self._entries.clear()


class Rollouts:
    """The server's rollouts: rows in the server's own store, a lock per rollout (so two first
    calls make one sandbox), and the replies kept for retries."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.replies = Replies()
        self._store: RolloutStore | None = None
        self._locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = weakref.WeakValueDictionary()

    @property
    def store(self) -> RolloutStore:
        """Opened on first use: the state dir exists once the engine has started."""
        if self._store is None:
            self._store = RolloutStore(self.engine.config.state_dir)
        return self._store

    async def close(self) -> None:
        await self.replies.close()
        if self._store is not None:
            self._store.close()
            self._store = None

    def _lock(self, tenant: str, rollout_id: str) -> asyncio.Lock:
        lock = self._locks.get((tenant, rollout_id))
        if lock is None:
            lock = self._locks[(tenant, rollout_id)] = asyncio.Lock()
        return lock

    def row(self, tenant: str, rollout_id: str) -> Any:
        row = self.store.get(tenant, rollout_id)
        if row is None:
            raise NotFound(f"no rollout {rollout_id!r}: it never existed, was deleted, or ended over an hour ago")
        return row

    def live(self, tenant: str, rollout_id: str) -> Any:
        """The row of a rollout whose deadline has not passed (SandboxGone, so 410, if it has)."""
        row = self.row(tenant, rollout_id)
        if row["deadline_at"] <= time.time():
            raise SandboxGone(f"rollout {rollout_id} is over: its deadline passed and its sandboxes were destroyed")
        return row

    async def body(self, row: Any) -> dict[str, Any]:
        params = json.loads(row["params"])
        return {
            "rollout_id": row["id"], "image": params["image"], "snapshot": params["snapshot"],
            "limits": params["limits"], "labels": params["labels"], "created_at": row["created_at"],
            "deadline_at": row["deadline_at"], "sandbox_id": row["sandbox_id"], "state": await self._state(row),
            "forked_from": row["forked_from"], "network": params.get("network", "none"),
        }

    async def _state(self, row: Any) -> str:
        if row["deadline_at"] <= time.time():
            return "expired"
        if not row["sandbox_id"]:
            return "pending"
        try:
            return (await self.engine.get(row["sandbox_id"])).state
        except SandboxNotFound:
            return "gone"

    async def create(self, tenant: str, request: RolloutRequest) -> Reply:
        """A new rollout (201), or the same one again when its id and parameters match (200)."""
        params = {
            "image": None if request.snapshot else request.image or "host", "snapshot": request.snapshot,
            "limits": request.limits.model_dump() if request.limits else None, "env": request.env,
            "labels": request.labels, "deadline": request.deadline,
        }
        if request.network != "none":  # checked now, not at the first tool call; rollouts without one keep their old params
            params["network"] = network_value(request.network)
            self.engine.life.network.check(params["network"], tenant)
        rollout_id = request.rollout_id or "ro-" + secrets.token_hex(8)
        self.store.prune(time.time() - KEEP_ENDED_S)
        while True:
            if self.store.insert(tenant, rollout_id, json.dumps(params), time.time() + request.deadline):
                return 201, await self.body(self.row(tenant, rollout_id)), 0.0
            row = self.store.get(tenant, rollout_id)
            if row is None:
                continue  # deleted between the two: make it anew
            if json.loads(row["params"]) != params:
                return 409, error_to_json(InvalidRequest(
                    f"rollout {rollout_id} exists with other parameters: pick another id or delete it")), 0.0
            return 200, await self.body(row), 0.0

    async def sandbox(self, tenant: str, rollout_id: str) -> str:
        """The rollout's sandbox, made now if this is its first use."""
        async with self._lock(tenant, rollout_id):
            row = self.live(tenant, rollout_id)
            if row["sandbox_id"]:
                return row["sandbox_id"]
            params = json.loads(row["params"])
            lease = await self._lease(tenant, row["deadline_at"])
            try:
                limits = Limits(**params["limits"]) if params["limits"] else None
                info = await self.engine.create(CreateParams(
                    image=params["snapshot"] or params["image"], limits=limits, env=params["env"],
                    labels={**params["labels"], "rollout_id": rollout_id}, deadline=row["deadline_at"] - time.time(),
                    network=params.get("network", "none"),
                ), tenant=tenant, lease=lease)
            except BaseException:
                await asyncio.shield(self._end_lease(lease, tenant))
                raise
            self.store.set_sandbox(tenant, rollout_id, lease, info.id)
            return info.id

    async def _lease(self, tenant: str, deadline_at: float) -> str:
        """A lease that ends at ``deadline_at`` and outlives this server (closing it ends the rollout)."""
        # The ttl is at least a second; the sandbox's own deadline is exact.
        ttl = min(max(1.0, deadline_at - time.time()), MAX_LEASE_TTL_S)
        return (await self.engine.open_lease(ttl, tenant=tenant, outlive=True)).id

    async def call(self, tenant: str, rollout_id: str, name: str, call: FunctionCall) -> Reply:
        """Run one tool call; a model-visible mistake is a 422 whose body the model can read."""
        started = time.perf_counter()
        row = self.live(tenant, rollout_id)
        try:
            if call.name is not None and call.name != name:
                raise ToolError(f"the call names tool {call.name!r} but was sent to {name!r}")
            args = parse_arguments(name, call.arguments)  # before a sandbox is made for it
            sandbox_id = row["sandbox_id"] or await self.sandbox(tenant, rollout_id)
            try:
                output = await run_checked(self.engine, sandbox_id, name, args, timeout=TOOL_TIMEOUT_S,
                                           max_output=TOOL_MAX_OUTPUT)
            except SandboxNotFound:
                raise SandboxGone(f"rollout {rollout_id}'s sandbox was destroyed") from None
        except ToolError as err:
            body = {**error_to_json(err), **function_call_output(call.call_id, str(err))}
            return 422, body, ms_since(started)
        return 200, {**function_call_output(call.call_id, output), "status": "completed"}, ms_since(started)

    async def fork(self, tenant: str, rollout_id: str, count: int, ids: list[str] | None) -> Reply:
        """``count`` new rollouts, each with a live copy of this one's sandbox and its deadline."""
        if ids is not None and len(ids) != count:
            raise InvalidRequest(f"rollout_ids names {len(ids)} rollouts but count is {count}")
        self.live(tenant, rollout_id)
        ids = ids or self._fork_ids(tenant, rollout_id, count)
        parent_sandbox = await self.sandbox(tenant, rollout_id)
        async with contextlib.AsyncExitStack() as held:
            for child in sorted(ids):  # in order, so two forks naming the same ids cannot deadlock
                await held.enter_async_context(self._lock(tenant, child))
            row = self.live(tenant, rollout_id)
            taken = self._reserve(tenant, row, ids)
            if taken is not None:
                return 409, error_to_json(InvalidRequest(f"rollout {taken} exists already")), 0.0
            try:
                try:
                    result = await self.engine.fork(parent_sandbox, count)
                except SandboxNotFound:
                    raise SandboxGone(f"rollout {rollout_id}'s sandbox was destroyed") from None
                await self._adopt(tenant, row, ids, [child.id for child in result.children])
            except BaseException:
                for child in ids:
                    self.store.delete(tenant, child)
                raise
            bodies = [await self.body(self.row(tenant, child)) for child in ids]
        return 200, {"rollouts": bodies, "parent_pause_ms": result.parent_pause_ms}, result.total_ms

    def _reserve(self, tenant: str, parent: Any, ids: list[str]) -> str | None:
        """Insert the children's rows (with their locks held, no call can use them yet); the id
        already taken, if one is, and then none is inserted."""
        for number, child in enumerate(ids):
            if not self.store.insert(tenant, child, parent["params"], parent["deadline_at"], parent["id"]):
                for made in ids[:number]:
                    self.store.delete(tenant, made)
                return child
        return None

    async def _adopt(self, tenant: str, parent: Any, ids: list[str], sandbox_ids: list[str]) -> None:
        """Give each fork child to its rollout, under a lease of its own; on failure, none survives."""
        leases: list[str] = []
        try:
            labels = json.loads(parent["params"])["labels"]
            for rollout_id, sandbox_id in zip(ids, sandbox_ids):
                leases.append(await self._lease(tenant, parent["deadline_at"]))
                left = max(parent["deadline_at"] - time.time(), 0.001)  # past it, the reaper takes the child at once
                await self.engine.adopt(sandbox_id, leases[-1], tenant=tenant, deadline=left,
                                        labels={**labels, "rollout_id": rollout_id})
                self.store.set_sandbox(tenant, rollout_id, leases[-1], sandbox_id)
        except BaseException:
            await asyncio.shield(self._discard(tenant, sandbox_ids, leases))
            raise

    async def _discard(self, tenant: str, sandbox_ids: list[str], leases: list[str]) -> None:
        for sandbox_id in sandbox_ids:
            with contextlib.suppress(SandboxNotFound):
                await self.engine.kill(sandbox_id)
        for lease_id in leases:
            await self._end_lease(lease_id, tenant)

    def _fork_ids(self, tenant: str, rollout_id: str, count: int) -> list[str]:
        ids, number = [], 0
        while len(ids) < count:
            number += 1
            candidate = f"{rollout_id}.f{number}"
            if len(candidate) > 256:
                raise InvalidRequest("generated fork ids would be over 256 characters: pass rollout_ids")
            if self.store.get(tenant, candidate) is None:
                ids.append(candidate)
        return ids

    async def delete(self, tenant: str, rollout_id: str) -> None:
        """End the rollout now: its sandbox is destroyed and its record forgotten."""
        async with self._lock(tenant, rollout_id):
            row = self.row(tenant, rollout_id)
            if row["lease"]:
                await self._end_lease(row["lease"], tenant)
            if row["sandbox_id"]:  # should the lease be gone already, the sandbox still goes
                with contextlib.suppress(SandboxNotFound):
                    await self.engine.kill(row["sandbox_id"])
            self.store.delete(tenant, rollout_id)

    async def _end_lease(self, lease_id: str, tenant: str) -> None:
        with contextlib.suppress(LeaseNotFound):
            await self.engine.close_lease(lease_id, tenant=tenant)

    async def list(self, tenant: str) -> list[dict[str, Any]]:
        self.store.prune(time.time() - KEEP_ENDED_S)
        return [await self.body(row) for row in self.store.of(tenant)]


def ms_since(started: float) -> float:
    """Milliseconds since ``started`` (a ``time.perf_counter()``)."""
    return (time.perf_counter() - started) * 1000


def app_rollouts(request: Request) -> Rollouts:
    return request.app.state.rollouts


def reply_response(reply: Reply) -> JSONResponse:
    """A kept reply as the response, with the work's duration in ``X-Fanfold-Duration-Ms``."""
    status, body, ms = reply
    return JSONResponse(body, status, headers={"X-Fanfold-Duration-Ms": f"{ms:.1f}"})


async def check_rollout(request: Request, body: RolloutRequest, caller: str) -> None:
    """What a new rollout names, checked before it is recorded: a bad source or limits fail now,
    not at the first tool call."""
    check_source(request, body.snapshot or body.image or "host", caller)
    engine = app_rollouts(request).engine
    if body.snapshot is not None and engine.resolve_snapshot(body.snapshot, tenant=caller) is None:
        raise SnapshotNotFound(f"no snapshot {body.snapshot!r}")
    img = None
    if body.image not in (None, *BASES) and engine.resolve_snapshot(body.image, tenant=caller) is None:
        img = await engine.image(body.image, tenant=caller)  # ImageNotFound; a pull is the caller's, as its create's
    asked = None if body.limits is None else Limits(**body.limits.model_dump())
    if asked is not None:  # limits the host cannot hold
        check_fits_host(asked)
    if img is not None:  # GPUs it cannot give, the image's own included
        check_gpus(engine.life.gpus.check, image_gpus(asked, img) or Limits(), asked, img)
    elif asked is not None and asked.gpus not in (None, NO_GPUS):
        engine.life.gpus.check(asked)


@router.post("/rollouts", status_code=201, response_model=RolloutBody,
             responses={**RESPONSES, 200: {"model": RolloutBody, "description": "It existed with these parameters."}})
async def create_rollout(body: RolloutRequest, request: Request, caller: str = Depends(tenant),
                         request_id: str | None = RequestID) -> JSONResponse:
    """A rollout; its sandbox is made on its first tool call or fork, and destroyed at its deadline."""
    await check_rollout(request, body, caller)
    rollouts = app_rollouts(request)
    params = {"create": body.model_dump()}
    return reply_response(await rollouts.replies.once(caller, request_id, params, lambda: rollouts.create(caller, body)))


@router.get("/rollouts", response_model=list[RolloutBody], responses=RESPONSES)
async def list_rollouts(request: Request, caller: str = Depends(tenant)) -> list[dict[str, Any]]:
    """The caller's rollouts, oldest first (ended ones for an hour after their deadline)."""
    return await app_rollouts(request).list(caller)


@router.get("/rollouts/{rollout_id}", response_model=RolloutBody, responses=RESPONSES)
async def get_rollout(request: Request, rollout_id: str = RolloutID, caller: str = Depends(tenant)) -> dict[str, Any]:
    rollouts = app_rollouts(request)
    return await rollouts.body(rollouts.row(caller, rollout_id))


@router.delete("/rollouts/{rollout_id}", status_code=204, responses=RESPONSES)
async def delete_rollout(request: Request, rollout_id: str = RolloutID, caller: str = Depends(tenant)) -> Response:
    """End the rollout and destroy its sandbox; 204, then 404 for a second delete."""
    await app_rollouts(request).delete(caller, rollout_id)
    return Response(status_code=204)


@router.post("/rollouts/{rollout_id}/tools/{name}", response_model=FunctionCallOutput,
             responses={**RESPONSES, 422: {"model": ToolErrorBody, "description": (
                 "The model's mistake (unknown tool, bad arguments, a missing file): `output` says it, for the model."
                 " A malformed request body answers a plain error instead.")}})
async def call_tool(body: FunctionCall, request: Request, rollout_id: str = RolloutID,
                    name: str = ToolName,
                    caller: str = Depends(tenant), request_id: str | None = RequestID) -> JSONResponse:
    """Run a Responses API function_call in the rollout's sandbox (made now if this is its first use);
    the answer is its function_call_output. Retrying with the same X-Request-ID runs it once."""
    rollouts = app_rollouts(request)
    params = {"tool": name, "rollout": rollout_id, "call": body.model_dump()}
    return reply_response(await rollouts.replies.once(caller, request_id, params,
                                              lambda: rollouts.call(caller, rollout_id, name, body)))


@router.post("/rollouts/{rollout_id}/fork", response_model=RolloutForkBody, responses=RESPONSES)
async def fork_rollout(body: RolloutForkRequest, request: Request, rollout_id: str = RolloutID,
                       caller: str = Depends(tenant), request_id: str | None = RequestID) -> JSONResponse:
    """Fork the rollout's sandbox (processes and all) into ``count`` new rollouts with its deadline."""
    rollouts = app_rollouts(request)
    params = {"fork": rollout_id, **body.model_dump()}
    return reply_response(await rollouts.replies.once(
        caller, request_id, params, lambda: rollouts.fork(caller, rollout_id, body.count, body.rollout_ids)))


@router.get("/tools", response_model=ToolsBody, responses=RESPONSES)
async def list_tools(_: str = Depends(tenant)) -> dict[str, Any]:
    """The tools' schemas, to hand to a model: Responses API and Chat Completions formats."""
    return {"responses": [tool.responses_schema() for tool in TOOLS.values()],
            "chat_completions": [tool.chat_schema() for tool in TOOLS.values()]}
