"""envd, E2B's in-sandbox daemon, served by fanfold from the host: ``/health`` and the process
service (``process.Process``) over the Connect protocol, plus what every envd route shares: the
sandbox a call is for (header ``E2b-Sandbox-Id``, checked with ``X-Access-Token``) and errors
in the shapes envd answers with.

Commands run through the engine's exec: ``commands.run``'s ``/bin/bash -l -c CMD`` runs as
``/bin/sh -l -c CMD`` in images without ``/bin/bash``. PTYs (``pty``, ``Update``) and
``StreamInput`` answer ``unimplemented``. Processes end when their sandbox is paused or forked
(see ``processes``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute

from ..._agent.client import check_terminal_size
from ...engine import Engine
from ...errors import FanfoldError, SandboxNotFound
from .account import default_user
from .auth import EnvdTokens
from .connect import (
    STATUS, STREAM_JSON, RpcError, decode, end_of_stream, envelope, enum_value, error_json, field as message_field,
    gone_message, rpc_error, stream_request, unb64,
)
from .processes import Backlog, Ended, Process, Processes, missing_program
from .watchers import Watchers

log = logging.getLogger("fanfold.e2b")
ENVD_VERSION = "0.6.4"
"""The envd version fanfold answers as: the SDK gates stdin, close_stdin and octet-stream uploads on it."""
MAX_REQUEST = 1024 * 1024
"""Largest RPC request body (stdin chunks included); file uploads stream through /files instead."""
KEEPALIVE_S = 50.0
SIGNALS = {"SIGNAL_UNSPECIFIED": 0, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9}


@dataclass
class E2B:
    """What the E2B routes share, made with the app (``app.state.e2b``)."""

    processes: Processes
    tokens: EnvdTokens
    no_bash: set[str] = field(default_factory=set)
    """Sandboxes whose image has no /bin/bash: their commands run under /bin/sh."""
    watchers: Watchers = field(default_factory=Watchers)
    """The directory watchers of ``files.watch_dir``."""
    cpu_samples: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Each sandbox's CPU seconds at its last metrics sample, and when: the next one's rate."""
    stoppers: list[Callable[[str], Awaitable[Any]]] = field(default_factory=list)
    """Other enders of a sandbox's live execs (the code interpreter's kernels), run by ``quiet``."""

    @contextlib.asynccontextmanager
    async def quiet(self, sandbox_id: str) -> AsyncIterator[None]:
        """End every live exec the E2B endpoint runs in the sandbox (SIGKILL), and start no process,
        while the body runs: the engine's pause, fork and snapshot wait until no exec runs."""
        async with self.processes.quiet(sandbox_id):
            await self._stop_others(sandbox_id)
            yield

    async def end_live(self, sandbox_id: str) -> None:
        """End every live exec the endpoint runs in the sandbox (the engine's hook before any checkpoint)."""
        await self.processes.end_all(sandbox_id)
        await self._stop_others(sandbox_id)

    async def _stop_others(self, sandbox_id: str) -> None:
        for stop in self.stoppers:
            await stop(sandbox_id)


def e2b(request: Request) -> E2B:
    return request.app.state.e2b


def engine(request: Request) -> Engine:
    return request.app.state.engine


@dataclass(frozen=True)
class Call:
    """One envd call: the sandbox it is for, who it runs as, and its headers' limits."""

    sandbox_id: str
    engine: Engine
    e2b: E2B
    user: str | None
    timeout: float | None
    keepalive: float


async def call_of(request: Request) -> Call:
    """The call's sandbox, when its access token is right and it exists; else the answer a proxy in
    front of envd gives for a sandbox that is not there (no hint of which check failed). It runs as
    the user the client names, else the sandbox's E2B default (``user``)."""
    sandbox_id = request.headers.get("e2b-sandbox-id", "")
    state = e2b(request)
    try:
        state.tokens.check(sandbox_id, request.headers.get("x-access-token"))
    except SandboxNotFound:
        raise RpcError("unavailable", gone_message(sandbox_id)) from None
    if engine(request).tenant_of(sandbox_id) is None:
        raise RpcError("unavailable", gone_message(sandbox_id))
    user = _basic_user(request)
    if user is None:
        try:
            user = default_user(await engine(request).get(sandbox_id))
        except SandboxNotFound:
            raise RpcError("unavailable", gone_message(sandbox_id)) from None
    return Call(sandbox_id=sandbox_id, engine=engine(request), e2b=state, user=user,
                timeout=_seconds(request.headers.get("connect-timeout-ms"), 1000),
                keepalive=_seconds(request.headers.get("keepalive-ping-interval"), 1) or KEEPALIVE_S)


def _basic_user(request: Request) -> str | None:
    """The user of ``Authorization: Basic base64("user:")``, which the SDK sends for ``user=``."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        user = base64.b64decode(value, validate=True).decode().partition(":")[0]
    except (binascii.Error, ValueError):
        raise RpcError("unauthenticated", "the Authorization header is not Basic base64(user:)") from None
    return user or None


def _seconds(header: str | None, per_second: int) -> float | None:
    if not header or not header.isdigit() or len(header) > 12 or int(header) <= 0:  # 13 digits: no limit
        return None
    return int(header) / per_second


# -- errors in envd's shapes ------------------------------------------------------------------


class EnvdRoute(APIRoute):
    """Errors as envd gives them: Connect errors for RPCs (a streaming call's in its end-of-stream
    envelope), ``{"code": <status>, "message"}`` for /files and /health; never a traceback."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def answered(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as err:
                return envd_error(request, RpcError("invalid_argument", f"invalid request: {err.errors()[:3]}"))
            except FanfoldError as err:
                return envd_error(request, rpc_error(err, request.headers.get("e2b-sandbox-id", "")))
            except Exception as err:  # noqa: BLE001 - a bug still answers in envd's shape
                log.exception("fanfold e2b: unexpected error in envd")
                return envd_error(request, RpcError("internal", f"fanfold bug: {type(err).__name__}: {err}"))

        return answered


def envd_error(request: Request, err: RpcError) -> Response:
    if request.headers.get("content-type", "").startswith(STREAM_JSON):
        return Response(end_of_stream(err), media_type=STREAM_JSON)
    if "." in request.url.path.split("/")[-2]:  # /<package>.<Service>/<Method>
        return JSONResponse(error_json(err), status_code=STATUS[err.code])
    status = http_status(err)
    return JSONResponse({"code": status, "message": err.message}, status_code=status)


def http_status(err: RpcError) -> int:
    """envd's plain-HTTP status for an error: 502 for a sandbox that is not there, as its proxy says."""
    if err.code == "unavailable":
        return 502
    if err.code == "failed_precondition" and "disk is full" in err.message:
        return 507
    return STATUS[err.code]


async def read_body(request: Request, limit: int = MAX_REQUEST) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RpcError("resource_exhausted", f"the request is over {limit // 1024} KiB")
    return bytes(body)


# -- Connect calls ----------------------------------------------------------------------------

Unary = Callable[[Call, dict[str, Any]], Awaitable[dict[str, Any]]]
Streaming = Callable[[Call, dict[str, Any]], Awaitable[AsyncIterator[bytes]]]


async def serve_rpc(request: Request, service: str, method: str, unary: dict[str, Unary],
                    streams: dict[str, Streaming]) -> Response:
    """Run one Connect call of ``service`` (JSON codec only)."""
    content_type = request.headers.get("content-type", "").partition(";")[0].strip()
    if content_type not in ("application/json", STREAM_JSON):
        return JSONResponse(error_json(RpcError("unimplemented", f"content type {content_type!r}: fanfold's envd speaks"
                                                " the Connect protocol's JSON codec only")), status_code=415)
    call = await call_of(request)
    body = await read_body(request)
    if method in streams and content_type == STREAM_JSON:
        return ConnectStream(await streams[method](call, stream_request(body)))
    if method in unary and content_type == "application/json":
        return JSONResponse(await unary[method](call, decode(body)))
    raise RpcError("unimplemented", f"{service}/{method} is not implemented by fanfold's envd")


class ConnectStream(StreamingResponse):
    """A Connect stream that, cut short by the server (a stop that outlasted its grace), still ends
    with its end-of-stream envelope, so the client reads an error rather than a broken stream."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type=STREAM_JSON)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        state = {"started": False, "ended": False}

        async def tracked(message: dict[str, Any]) -> None:
            state["started"] = True
            state["ended"] = message["type"] == "http.response.body" and not message.get("more_body", False)
            await send(message)

        try:
            await super().__call__(scope, receive, tracked)
        except asyncio.CancelledError:
            if state["started"] and not state["ended"]:
                stopped = RpcError("unavailable", "the server stopped while the stream ran")
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": end_of_stream(stopped), "more_body": False})
            raise


router = APIRouter(prefix="/envd", route_class=EnvdRoute, tags=["e2b"])


@router.get("/health", status_code=204)
async def health(request: Request) -> Response:
    """204 while the sandbox runs; 502 when it is paused (suspended), gone or not the token's."""
    call = await call_of(request)
    info = await call.engine.get(call.sandbox_id)
    if info.state not in ("running", "paused"):
        raise RpcError("unavailable", gone_message(call.sandbox_id))
    return Response(status_code=204)


@router.post("/process.Process/{method}")
async def process_service(method: str, request: Request) -> Response:
    """process.Process: Start (with or without a PTY), Connect, List, SendInput, SendSignal, CloseStdin, Update."""
    return await serve_rpc(request, "process.Process", method, PROCESS_UNARY, PROCESS_STREAMS)


# -- process.Process --------------------------------------------------------------------------


async def start(call: Call, message: dict[str, Any]) -> AsyncIterator[bytes]:
    pty = None if message.get("pty") is None else _pty_size(message_field(message, "pty", dict, {}))
    config = message_field(message, "process", dict, {})
    cmd = message_field(config, "cmd", str, "")
    args = message_field(config, "args", list, [])
    envs = message_field(config, "envs", dict, {})
    if not cmd or not all(isinstance(arg, str) for arg in args):
        raise RpcError("invalid_argument", "process.cmd must be a program and process.args a list of strings")
    argv = [cmd, *args]
    if cmd == "/bin/bash" and call.sandbox_id in call.e2b.no_bash:
        argv[0] = "/bin/sh"
    options = dict(config={"cmd": cmd, "args": args, "envs": envs, **({"cwd": config["cwd"]} if "cwd" in config else {})},
                   tag=message_field(message, "tag", str), env=envs, cwd=message_field(config, "cwd", str),
                   user=call.user, stdin=pty is not None or message_field(message, "stdin", bool, False),
                   timeout=call.timeout, pty=pty)
    processes = call.e2b.processes
    try:
        process, queue = await processes.start(call.sandbox_id, argv, **options)
    except RpcError as err:
        if argv[0] != "/bin/bash" or not missing_program(err):
            raise
        call.e2b.no_bash.add(call.sandbox_id)
        process, queue = await processes.start(call.sandbox_id, ["/bin/sh", *args], **options)
    return watch(process, queue, call.keepalive)


async def connect(call: Call, message: dict[str, Any]) -> AsyncIterator[bytes]:
    process = call.e2b.processes.get(call.sandbox_id, message_field(message, "process", dict, {}))
    return watch(process, process.watch(replay=True), call.keepalive)


async def watch(process: Process, queue: Backlog, keepalive: float) -> AsyncIterator[bytes]:
    """The process's events as a Connect stream: start, data and end, keepalives while it is quiet.
    A client that leaves stops watching; the process runs on. A terminal's output is ``pty`` data."""
    tty = process.control.pty is not None
    try:
        yield envelope({"event": {"start": {"pid": process.pid}}})
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), keepalive)
            except asyncio.TimeoutError:
                yield envelope({"event": {"keepalive": {}}})
                continue
            if isinstance(item, Ended):
                yield end_of_stream(item.error)
                return
            if tty and "stdout" in item.get("data", {}):
                item = {"data": {"pty": item["data"]["stdout"]}}
            yield envelope({"event": item})
    finally:
        process.unwatch(queue)


async def list_processes(call: Call, message: dict[str, Any]) -> dict[str, Any]:
    return {"processes": [
        {"pid": p.pid, "config": p.config, **({"tag": p.tag} if p.tag is not None else {})}
        for p in call.e2b.processes.running(call.sandbox_id)
    ]}


async def send_input(call: Call, message: dict[str, Any]) -> dict[str, Any]:
    process = call.e2b.processes.get(call.sandbox_id, message_field(message, "process", dict, {}))
    given = message_field(message, "input", dict, {})
    kind = "pty" if "pty" in given else "stdin"
    if (kind == "pty") != (process.control.pty is not None):
        raise RpcError("failed_precondition", f"process {process.pid} {'has' if kind == 'stdin' else 'has no'} PTY:"
                       f" send its input as input.{'pty' if kind == 'stdin' else 'stdin'}")
    try:
        process.control.write(unb64(given.get(kind, ""), f"input.{kind}"))
    except ValueError:
        raise RpcError("failed_precondition", f"process {process.pid}'s stdin is closed") from None
    except BufferError as err:
        raise RpcError("resource_exhausted", f"process {process.pid}: {err}; send more once it reads") from None
    return {}


async def send_signal(call: Call, message: dict[str, Any]) -> dict[str, Any]:
    process = call.e2b.processes.get(call.sandbox_id, message_field(message, "process", dict, {}))
    number = enum_value(message.get("signal", "SIGNAL_UNSPECIFIED"), SIGNALS, "signal")
    if not number:
        raise RpcError("invalid_argument", "signal is SIGNAL_SIGTERM or SIGNAL_SIGKILL")
    process.control.signal(number)  # on a connection of its own: never behind stdin the process has not read
    return {}


async def update(call: Call, message: dict[str, Any]) -> dict[str, Any]:
    """Resize a PTY (the only update envd has)."""
    process = call.e2b.processes.get(call.sandbox_id, message_field(message, "process", dict, {}))
    if message.get("pty") is None:
        return {}
    if process.control.pty is None:
        raise RpcError("failed_precondition", f"process {process.pid} has no PTY to resize")
    process.control.resize(*_pty_size(message_field(message, "pty", dict, {})))
    return {}


def _pty_size(pty: dict[str, Any]) -> tuple[int, int]:
    """A PTY message's size (``{"size": {"rows", "cols"}}``) as ``(rows, cols)``; invalid_argument if bad."""
    size = message_field(pty, "size", dict, {})
    rows, cols = size.get("rows"), size.get("cols")
    try:
        return check_terminal_size(rows, cols)  # type: ignore[arg-type]
    except ValueError as err:
        raise RpcError("invalid_argument", f"pty.size: {err}") from None


async def close_stdin(call: Call, message: dict[str, Any]) -> dict[str, Any]:
    process = call.e2b.processes.get(call.sandbox_id, message_field(message, "process", dict, {}))
    process.control.close_stdin()
    return {}


PROCESS_UNARY: dict[str, Unary] = {
    "List": list_processes, "SendInput": send_input, "SendSignal": send_signal, "CloseStdin": close_stdin,
    "Update": update,
}
PROCESS_STREAMS: dict[str, Streaming] = {"Start": start, "Connect": connect}
