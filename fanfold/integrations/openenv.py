"""Any fanfold env as an OpenEnv environment server, on ``fanfold serve``: OpenEnv's own clients drive
it unchanged, ``GenericEnvClient(base_url="http://fanfold:TOKEN@HOST:PORT/openenv/codefix")``.

Written from OpenEnv's wire protocol (``openenv-core`` 0.2), which it does not import. Routes, under
``/openenv/{env}`` where ``env`` is a short name (``codefix``, ``corpus``) or, for the host's own
tenant only, a ``package.module:Class`` (importing a module runs its code in the server):

- ``WS /ws``: one socket is one session and one env instance. JSON text frames:
  ``{"type": "reset", "data": {"seed"?, "episode_id"?, ...options}}`` and ``{"type": "step", "data":
  ACTION}`` answer ``{"type": "observation", "data": {"observation": OBSERVATION, "reward": float |
  null, "done": bool}}``; ``{"type": "state"}`` answers ``{"type": "state", "data": {"episode_id",
  "step_count", "env", "task", "done", "total_reward", "sandbox_id"}}``; ``{"type": "close"}`` ends
  the session. Failures answer ``{"type": "error", "data": {"message", "code", "kind"?,
  "retryable"?}}`` with OpenEnv's codes (``INVALID_JSON``, ``UNKNOWN_TYPE``, ``VALIDATION_ERROR``,
  ``EXECUTION_ERROR``, ``CAPACITY_REACHED``, ``FACTORY_ERROR``) or ``UNAUTHORIZED``.
- ``GET /health``, ``/schema`` (action, observation and state JSON schemas), ``/metadata`` (with the
  tools and system prompt). ``POST /reset``, ``POST /step`` and ``GET /state`` answer 501: an episode
  lives in a sandbox, which outlives one request only on the WebSocket.

ACTION is a tool call: ``{"name": TOOL, "arguments": {...} | "<JSON>", "call_id"?}``, a Responses API
``function_call`` item, or OpenEnv's ``{"type": "call_tool", "tool_name": TOOL, "arguments": {...}}``.
An action of another shape is a ``VALIDATION_ERROR`` and takes no step; a tool the model misused
(unknown, bad arguments) is an observation with ``info.error`` and reward 0, as in fanfold's env API.
OBSERVATION is ``{"text": ..., "info": {...}}``; after a reset it also has ``tools`` (chat
completions' list) and ``system_prompt``; after a step ``info`` has ``terminated`` and ``truncated``
(``done`` is either).

Auth: OpenEnv's client sends no headers of its own, but its WebSocket library sends a URL's user
info as ``Authorization: Basic``; so the token is the URL's password (any user name). A bearer
header works too, and the unix socket needs none. A refused socket gets an ``UNAUTHORIZED`` error,
then a close with 1008 (policy violation); HTTP answers 401.

The env's sandboxes belong to the caller's tenant, under a lease of the session's: closing the
session, a dropped socket (even mid-step) or the server's end destroys them, and a crashed server's
are reaped when the lease expires.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import secrets
from typing import Any

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from starlette.requests import HTTPConnection

from ..__version__ import __version__
from ..client import AsyncFleet
from ..engine import Engine
from ..errors import (
    CapacityExceeded, FanfoldError, InvalidRequest, LeaseNotFound, NotFound, QuotaExceeded, Retryable,
    SandboxNotFound, Unauthorized,
)
from ..models import CreateParams
from ..web.auth import LOCAL_TENANT, Tenants
from ..web.deps import check_source_of, host_only
from ..web.status import error_response
from ..wire import error_to_json

log = logging.getLogger("fanfold.server")
router = APIRouter(prefix="/openenv/{env}", tags=["openenv"])

REFUSED_WAIT_S = 10.0
"""How long a refused socket stays open for the client's first message, so that it reads the error."""
MAX_PENDING = 16
"""Messages a client may send ahead of the replies (OpenEnv's waits for each) before it is cut off."""
ACTION_KEYS = frozenset({"name", "tool_name", "arguments", "call_id", "id", "type", "status", "metadata"})

ACTION_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "description": "A tool call: {name, arguments}, a Responses function_call item, or OpenEnv's call_tool.",
    "properties": {
        "name": {"type": "string"}, "tool_name": {"type": "string", "description": "OpenEnv's name for `name`"},
        "arguments": {"anyOf": [{"type": "object"}, {"type": "string", "description": "JSON of an object"}]},
        "call_id": {"type": "string"}, "id": {"type": "string"}, "status": {"type": "string"},
        "type": {"enum": ["function_call", "call_tool"]}, "metadata": {"type": "object"},
    },
    "oneOf": [{"required": ["name"]}, {"required": ["tool_name"]}],
}
OBSERVATION_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["text", "info"],
    "properties": {
        "text": {"type": "string", "description": "The task (after reset) or the tool's output"},
        "info": {"type": "object", "description": "After a step: tool, error, step, terminated, truncated"},
        "tools": {"type": "array", "description": "After reset: the tools, as chat completions' `tools`"},
        "system_prompt": {"type": "string", "description": "After reset"},
    },
}
STATE_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["episode_id", "step_count"],
    "properties": {
        "episode_id": {"type": ["string", "null"]}, "step_count": {"type": "integer", "minimum": 0},
        "env": {"type": "string"}, "task": {"type": ["string", "null"]}, "done": {"type": "boolean"},
        "total_reward": {"type": "number"}, "sandbox_id": {"type": ["string", "null"]},
    },
}


class InvalidAction(InvalidRequest):
    """A message or action of the wrong shape: OpenEnv's VALIDATION_ERROR."""


# -- who calls, and which env ------------------------------------------------------------------


def caller(conn: HTTPConnection) -> str:
    """The caller's tenant: the password of ``Authorization: Basic`` (a URL's user info) is a token,
    else the bearer token, else (on the unix socket) the host's own tenant."""
    tenants: Tenants = conn.app.state.tenants
    scheme, _, value = conn.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return tenants.tenant_for(conn)
    try:
        token = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
    except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
        token = ""
    tenant = tenants.tenant_of_token(token) if token else None
    if tenant is None:
        raise Unauthorized("the token is not valid on this server: put it in the URL, http://fanfold:TOKEN@host/...")
    return tenant


def env_type(name: str, tenant: str) -> type[Any]:
    """The env class ``name`` stands for, if this tenant may serve it."""
    if ":" in name and tenant != LOCAL_TENANT:
        host_only(tenant, f"serve an env by module path ({name}): other tenants use a short name")
    from ..rl.env import ENVS, env_class  # the rl extra loads only when an env is asked for

    if ":" not in name and name not in ENVS:
        raise NotFound(f"no env {name!r}: use one of {', '.join(ENVS)}")
    return env_class(name)


# -- the engine as one session's env sees it -----------------------------------------------------


class SessionEngine:
    """The engine for one tenant's session: sandboxes go under the session's lease and are the only
    ones it touches; the rest of a fleet's API is refused."""

    def __init__(self, engine: Engine, tenant: str, lease: str) -> None:
        self.engine = engine
        self.tenant = tenant
        self.lease = lease
        self.made: set[str] = set()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass  # the session closes the lease, which ends the sandboxes

    async def build(self, spec: Any, on_step: Any = None, *, network: str = "isolated", tag: str | None = None) -> Any:
        if network == "host":
            host_only(self.tenant, "build with the host's network (network=host)")
        return await self.engine.build(await self.engine.catalog.scoped(spec, self.tenant), on_step, network=network,
                                       tag=tag, tenant=self.tenant)

    async def create(self, params: CreateParams) -> Any:
        check_source_of(self.engine, params.image, self.tenant)
        if params.seccomp != "default":
            host_only(self.tenant, "choose a seccomp profile other than default")
        # Ephemeral and under the lease, whatever the env asked: the session's end must end it.
        params = dataclasses.replace(params, detached=False, persistence="ephemeral")
        info = await self.engine.create(params, tenant=self.tenant, lease=self.lease)
        self.made.add(info.id)
        return info

    async def get(self, sandbox_id: str) -> Any:
        return await self.engine.get(self._mine(sandbox_id))

    async def list(self, labels: dict[str, str] | None = None) -> list[Any]:
        return [info for info in await self.engine.list(labels, tenant=self.tenant) if info.id in self.made]

    async def kill(self, sandbox_id: str) -> None:
        await self.engine.kill(self._mine(sandbox_id))
        self.made.discard(sandbox_id)

    async def exec(self, sandbox_id: str, cmd: str | list[str], **options: Any) -> Any:
        return await self.engine.exec(self._mine(sandbox_id), cmd, **options)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self.engine.read_file(self._mine(sandbox_id), path)

    async def write_file(self, sandbox_id: str, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await self.engine.write_file(self._mine(sandbox_id), path, data, mode)

    async def list_files(self, sandbox_id: str, path: str = ".") -> list[Any]:
        return await self.engine.list_files(self._mine(sandbox_id), path)

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self.engine.remove_file(self._mine(sandbox_id), path, recursive)

    def _mine(self, sandbox_id: str) -> str:
        if sandbox_id not in self.made:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} in this session")
        return sandbox_id

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise InvalidRequest(f"{name} is not open to an env served over OpenEnv")


class SessionFleet(AsyncFleet):
    """An ``AsyncFleet`` over the server's own engine, for one session (see ``SessionEngine``)."""

    def __init__(self, transport: SessionEngine) -> None:  # not super().__init__: it would make a transport
        self.url = None
        self._transport = transport  # type: ignore[assignment]
        self.config = transport.engine.config


# -- one session -----------------------------------------------------------------------------------


class Session:
    """One socket's env and episode; ``answer`` turns a message into its reply (None: close)."""

    def __init__(self, engine: Engine, tenant: str, env_name: str, env_cls: type[Any]) -> None:
        self.engine = engine
        self.tenant = tenant
        self.env_name = env_name
        self.env_cls = env_cls
        self.env: Any = None
        self.lease: str | None = None
        self.episode_id: str | None = None
        self.total_reward = 0.0
        self._renewing: asyncio.Task[None] | None = None

    async def open(self) -> None:
        ttl = self.engine.config.lease_ttl_s
        self.lease = (await self.engine.open_lease(ttl, tenant=self.tenant)).id
        self._renewing = asyncio.create_task(self._renew(ttl))
        self.env = self.env_cls(SessionFleet(SessionEngine(self.engine, self.tenant, self.lease)))

    async def close(self) -> None:
        """Destroy the env's sandboxes (idempotent)."""
        if self._renewing is not None:
            self._renewing.cancel()
        if self.env is not None:
            with contextlib.suppress(FanfoldError):
                await self.env.close()
        if self.lease is not None:
            lease, self.lease = self.lease, None
            with contextlib.suppress(LeaseNotFound):
                await self.engine.close_lease(lease, tenant=self.tenant)

    async def _renew(self, ttl: float) -> None:
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                await self.engine.renew_lease(self.lease or "", tenant=self.tenant)
            except FanfoldError:  # expired (its sandboxes were reaped) or the engine is closing
                return

    async def answer(self, raw: str) -> dict[str, Any] | None:
        try:
            message = json.loads(raw)
        except ValueError as err:
            return error_message("INVALID_JSON", f"Invalid JSON: {err}")
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "close":
            return None
        handler = {"reset": self.reset, "step": self.step, "state": self.state}.get(kind)  # type: ignore[arg-type]
        if handler is None:
            return error_message("UNKNOWN_TYPE", f"Unknown message type: {kind}")
        data = message.get("data", {})
        try:
            if not isinstance(data, dict):
                raise InvalidAction("a message's data is a JSON object")
            return await handler(data)
        except FanfoldError as err:
            return fanfold_error(err)
        except Exception as err:  # noqa: BLE001  the session goes on; the client sees the bug
            log.exception("openenv: unexpected error in %s", kind)
            return error_message("EXECUTION_ERROR", f"fanfold bug: {type(err).__name__}: {err}")

    async def reset(self, data: dict[str, Any]) -> dict[str, Any]:
        options = dict(data)
        seed, episode_id = options.pop("seed", None), options.pop("episode_id", None)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise InvalidAction(f"seed is an integer >= 0, got {seed!r}")
        if episode_id is not None and (not isinstance(episode_id, str) or len(episode_id) > 255):
            raise InvalidAction("episode_id is a string of at most 255 characters")
        prompt, info = await self.env.reset(seed=seed, options=options)
        self.episode_id = episode_id or "ep-" + secrets.token_hex(8)
        self.total_reward = 0.0
        observation = {"text": prompt, "info": info, "tools": self.env.tool_schemas(),
                       "system_prompt": self.env.system_prompt}
        return observation_message(observation, None, False)

    async def step(self, data: dict[str, Any]) -> dict[str, Any]:
        action = tool_call(data)
        if self.env.sandbox is None or self.env.done:
            return error_message("EXECUTION_ERROR", "no episode is running: reset first (and again once one is done)")
        text, reward, terminated, truncated, info = await self.env.step(action)
        self.total_reward += reward
        observation = {"text": text, "info": {**info, "terminated": terminated, "truncated": truncated}}
        return observation_message(observation, reward, terminated or truncated)

    async def state(self, data: dict[str, Any]) -> dict[str, Any]:
        env = self.env
        running = env.sandbox is not None
        return {"type": "state", "data": {
            "episode_id": self.episode_id, "step_count": env.steps, "env": self.env_name,
            "task": env.task_name() if running else None, "done": env.done, "total_reward": self.total_reward,
            "sandbox_id": env.sandbox.id if running else None,
        }}


def tool_call(data: dict[str, Any]) -> dict[str, Any]:
    """fanfold's ``{"name", "arguments", "call_id"}`` from any of the action shapes, or InvalidAction."""
    unknown = sorted(set(data) - ACTION_KEYS)
    if unknown:
        raise InvalidAction(f"unknown action fields {unknown}: an action is "
                            '{"name": "<tool>", "arguments": {...}} (or "tool_name" for "name")')
    if "name" in data and "tool_name" in data:
        raise InvalidAction('give the tool as "name" or as "tool_name", not both')
    name = data.get("name", data.get("tool_name"))
    if not isinstance(name, str) or not name:
        raise InvalidAction('an action names its tool: {"name": "<tool>", "arguments": {...}}')
    arguments = data.get("arguments", {})
    if not isinstance(arguments, (dict, str)):
        raise InvalidAction("an action's arguments are an object, or the JSON text of one")
    call_id = data.get("call_id", "")
    if not isinstance(call_id, str) or data.get("type") not in (None, "function_call", "call_tool"):
        raise InvalidAction('call_id is a string and type, when given, "function_call" or "call_tool"')
    return {"name": name, "arguments": arguments, "call_id": call_id}


def observation_message(observation: dict[str, Any], reward: float | None, done: bool) -> dict[str, Any]:
    return {"type": "observation", "data": {"observation": observation, "reward": reward, "done": done}}


def error_message(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "error", "data": {"message": message, "code": code, **extra}}


def fanfold_error(err: FanfoldError) -> dict[str, Any]:
    """A fanfold error as OpenEnv's error message, with its ``kind`` and whether a retry may help."""
    if isinstance(err, InvalidAction):
        code = "VALIDATION_ERROR"
    elif isinstance(err, Unauthorized):
        code = "UNAUTHORIZED"
    elif isinstance(err, (CapacityExceeded, QuotaExceeded)):
        code = "CAPACITY_REACHED"
    else:
        code = "EXECUTION_ERROR"
    body = error_to_json(err)
    return error_message(code, body.pop("message"), retryable=isinstance(err, Retryable), **body)


# -- routes ----------------------------------------------------------------------------------------


@router.websocket("/ws")
async def session_socket(websocket: WebSocket, env: str) -> None:
    """One OpenEnv session: one env instance and its sandboxes, for as long as the socket lasts."""
    await websocket.accept()
    session = None
    try:
        tenant = caller(websocket)
        session = Session(websocket.app.state.engine, tenant, env, env_type(env, tenant))
        await session.open()
    except Exception as err:  # noqa: BLE001  an env that cannot be made is the client's error to read
        if session is not None:
            await asyncio.shield(session.close())
        if isinstance(err, Unauthorized):
            await _refuse(websocket, fanfold_error(err), 1008)
        else:
            kind = err.kind if isinstance(err, FanfoldError) else "internal_error"
            await _refuse(websocket, error_message("FACTORY_ERROR", f"cannot make env {env!r}: {err}", kind=kind), 1011)
        return
    try:
        await _serve(websocket, session)
    finally:
        await asyncio.shield(session.close())
        with contextlib.suppress(RuntimeError, WebSocketDisconnect):  # the client closed first
            await websocket.close()


async def _serve(websocket: WebSocket, session: Session) -> None:
    """Answer each message in turn; a client that leaves mid-call has its call cancelled."""
    inbox: asyncio.Queue[str | None] = asyncio.Queue()
    reader = asyncio.create_task(_read(websocket, inbox))
    try:
        while (raw := await inbox.get()) is not None:
            work = asyncio.create_task(session.answer(raw))
            await asyncio.wait((work, reader), return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client is gone: nobody waits for the reply
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
                return
            reply = work.result()
            if reply is None:
                return
            try:
                await websocket.send_text(json.dumps(reply))
            except Exception:  # noqa: BLE001  the client left as the reply went
                return
    finally:
        reader.cancel()


async def _read(websocket: WebSocket, inbox: asyncio.Queue[str | None]) -> None:
    """Messages into ``inbox``, then None once the client leaves or sends too far ahead."""
    try:
        while inbox.qsize() < MAX_PENDING:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            inbox.put_nowait(message.get("text") or (message.get("bytes") or b"").decode(errors="replace"))
    finally:
        inbox.put_nowait(None)


async def _refuse(websocket: WebSocket, reply: dict[str, Any], close_code: int) -> None:
    """Send the error, then close once the client sent its first message (so its read finds the
    error, not a closed socket) or after ``REFUSED_WAIT_S``."""
    with contextlib.suppress(Exception):
        await websocket.send_text(json.dumps(reply))
        await asyncio.wait_for(websocket.receive(), REFUSED_WAIT_S)
    with contextlib.suppress(Exception):
        await websocket.close(close_code, reply["data"]["message"][:120])


def _checked(request: Request, env: str) -> type[Any]:
    return env_type(env, caller(request))


@router.get("/health")
async def health(request: Request, env: str) -> dict[str, str]:
    """OpenEnv's health check (the token is checked here too)."""
    _checked(request, env)
    return {"status": "healthy"}


@router.get("/schema")
async def schema(request: Request, env: str) -> dict[str, Any]:
    """JSON schemas of the env's actions, observations and state."""
    cls = _checked(request, env)
    action = {**ACTION_SCHEMA, "properties": {**ACTION_SCHEMA["properties"],
                                              "name": {"enum": [tool.name for tool in cls.tools]}}}
    return {"action": action, "observation": OBSERVATION_SCHEMA, "state": STATE_SCHEMA}


@router.get("/metadata")
async def metadata(request: Request, env: str) -> dict[str, Any]:
    """OpenEnv's metadata, with the env's tools and system prompt."""
    cls = _checked(request, env)
    doc = (cls.__doc__ or "").strip()
    return {"name": cls.name, "description": doc.splitlines()[0] if doc else cls.name, "version": __version__,
            "tools": [tool.chat_schema() for tool in cls.tools], "system_prompt": cls.system_prompt,
            "max_steps": cls.max_steps}


# Out of the OpenAPI document: they only point at the WebSocket, and 501 is no bug of fanfold's.
@router.post("/reset", include_in_schema=False)
@router.post("/step", include_in_schema=False)
@router.get("/state", include_in_schema=False)
async def stateless(request: Request, env: str) -> JSONResponse:
    """501: an episode lives in a sandbox, which outlives a request only on the WebSocket."""
    _checked(request, env)
    return error_response(InvalidRequest(
        f"fanfold serves OpenEnv episodes over the WebSocket only: connect to /openenv/{env}/ws "
        "(OpenEnv's clients do)"), 501)
