"""The code interpreter's API (``e2b-code-interpreter``'s port 49999) without Jupyter: each context is
one long-lived Python process in the sandbox (``repl.py``), fed cells over its stdin through a live
exec, so state persists from cell to cell and a pause, fork or kill of the sandbox ends it.

Python only: a cell's last expression comes back as a ``text/plain`` result (plus HTML, Markdown or
JSON when the object renders itself so), stdout and stderr stream as they are printed, an exception
is an ``error``. No rich display (plots, images), no other languages: those are refused with a 400.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import signal
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..._agent.client import ExecControl
from ...engine import Engine
from ...errors import FanfoldError, InvalidRequest, SandboxGone, SandboxNotFound
from .auth import envd_tokens
from .envd import read_body

log = logging.getLogger("fanfold.e2b")
KERNEL = Path(__file__).with_name("repl.py").read_text()
MARK = "\x1e"
ABANDON_S = 5.0
"""How long an interrupted cell may take to stop before its kernel is killed (the context then
starts afresh on its next cell)."""
UNLIMITED = 1 << 62
MAX_EVENT = 32 * 1024 * 1024
"""Longest event line (a result's repr) the host holds while it arrives; past it, the line is stdout."""
MAX_BACKLOG = 64 * 1024 * 1024
"""Characters of output a cell's client may fall behind by; past it, output is dropped (and said so)."""
MAX_BODY = 16 * 1024 * 1024
"""Largest /execute or /contexts request body."""
router = APIRouter(prefix="/envd", include_in_schema=False)


class KernelDied(Exception):
    """The context's process ended while a cell ran."""


class Kernel:
    """One context: a Python process in a sandbox and the cell that runs in it, one at a time."""

    def __init__(self, engine: Engine, sandbox_id: str, context_id: str, cwd: str | None,
                 on_gone: Callable[[str], None] = lambda _: None) -> None:
        self.engine, self.sandbox_id, self.id, self.cwd = engine, sandbox_id, context_id, cwd
        self.on_gone = on_gone
        """Told the sandbox's id when the process ended because the sandbox did (deadline, /v1 kill)."""
        self.lock = asyncio.Lock()
        self.control: ExecControl | None = None
        self.task: asyncio.Task[Any] | None = None
        self._sink: asyncio.Queue[dict[str, Any] | None] | None = None
        self._backlog = 0
        """Characters of output waiting in ``_sink`` for the client."""
        self._dropping = False
        self._finished = False
        """Whether the running cell's ``done`` is in the sink: a later one (printed by the cell) is dropped."""
        self._event: list[str] | None = None
        """The pieces of an event line still arriving (after its MARK), or None between events."""
        self.ended = False
        """Set when the context is removed or its sandbox paused, forked or killed: it runs no more cells."""
        self._decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "language": "python", "cwd": self.cwd or "/"}

    async def _ensure(self) -> ExecControl:
        if self.task is not None and not self.task.done():
            assert self.control is not None
            return self.control
        if self.ended:
            raise KernelDied("this context was ended (its sandbox was paused, forked or killed, or the context"
                             " removed): its state is lost; run the cell again")
        self.control = ExecControl(keep_output=False)
        self._event = None
        self.task = asyncio.create_task(self.engine.exec(
            self.sandbox_id, ["python3", "-u", "-c", KERNEL], cwd=self.cwd, control=self.control,
            on_output=self._output, max_output=UNLIMITED))
        self.task.add_done_callback(self._ended)
        started = asyncio.ensure_future(self.control.started)
        await asyncio.wait({started, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            started.cancel()
            result = self.task.result()  # raises what ended it
            raise KernelDied(f"the sandbox could not start python3 (exit {result.exit_code}):"
                             f" {result.stderr.decode(errors='replace')[:300] or 'does the image have python3?'}")
        return self.control

    def _ended(self, task: asyncio.Task[Any]) -> None:
        if self._sink is not None:
            self._sink.put_nowait(None)
        if not task.cancelled() and isinstance(task.exception(), (SandboxGone, SandboxNotFound)):
            self.on_gone(self.sandbox_id)  # (the exception is retrieved: the waiting cell reports the death)

    def _output(self, stream: str, data: bytes) -> None:
        """Text between MARK-led event lines is printed output; each chunk is scanned once."""
        text = self._decoders[stream].decode(data)
        if stream == "stderr":
            self._deliver(_printed("stderr", text))
            return
        while text:
            if self._event is None:
                mark = text.find(MARK)
                self._deliver(_printed("stdout", text if mark == -1 else text[:mark]))
                if mark == -1:
                    return
                self._event, text = [], text[mark + 1 :]
                continue
            end = text.find("\n")
            if end == -1:
                self._event.append(text)
                if sum(map(len, self._event)) > MAX_EVENT:  # no event is this long: it was printed
                    self._deliver(_printed("stdout", MARK + "".join(self._event)))
                    self._event = None
                return
            line, self._event, text = "".join(self._event) + text[:end], None, text[end + 1 :]
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            self._deliver(event if isinstance(event, dict) else _printed("stdout", MARK + line + "\n"))

    def _deliver(self, event: dict[str, Any]) -> None:
        """Into the cell's sink, unless the client is over ``MAX_BACKLOG`` behind: then output is dropped."""
        if self._sink is None or event.get("text", True) == "":
            return
        if event.get("type") == "done":
            if self._finished:
                return
            self._finished = True
        else:
            if self._backlog > MAX_BACKLOG:
                if not self._dropping:
                    self._dropping = True
                    self._sink.put_nowait(_printed("stderr", "[fanfold: the client fell behind the cell's output;"
                                                   " output was dropped]\n"))
                return
            self._dropping = False
            self._backlog += _weight(event)
        self._sink.put_nowait(event)

    async def _next(self, sink: asyncio.Queue[dict[str, Any] | None]) -> dict[str, Any] | None:
        event = await sink.get()
        if event is not None:
            self._backlog = max(0, self._backlog - _weight(event))
        return event

    async def execute(self, code: str, env: dict[str, str]) -> AsyncIterator[dict[str, Any]]:
        """The cell's events, ending with ``number_of_executions``; an ``error`` when the kernel dies."""
        await self.lock.acquire()
        done = False
        try:
            try:
                control = await self._ensure()
            except (KernelDied, FanfoldError) as err:
                done = True
                yield _error("KernelError", str(err))
                return
            self._sink = sink = asyncio.Queue()
            self._backlog, self._dropping, self._finished = 0, False, False
            control.write((json.dumps({"code": code, "env": env}) + "\n").encode())
            while True:
                event = await self._next(sink)
                if event is None:
                    done = True
                    yield _error("KernelDied", "the code interpreter's process ended (the sandbox was paused,"
                                 " forked or killed, or the code exited it); its state is lost")
                    return
                if event.get("type") == "done":
                    done = True
                    yield {"type": "number_of_executions", "execution_count": event.get("execution_count", 0)}
                    return
                yield event
        finally:
            if done:
                self._sink = None
                self.lock.release()
            else:  # the client left mid-cell (its timeout): interrupt it, keep the lock until it stops
                asyncio.get_running_loop().create_task(self._abandon())

    async def _abandon(self) -> None:
        try:
            if self.control is not None and self.task is not None and not self.task.done():
                self.control.signal(signal.SIGINT)
                sink = self._sink
                deadline = time.monotonic() + ABANDON_S
                while sink is not None and (left := deadline - time.monotonic()) > 0:
                    try:
                        event = await asyncio.wait_for(self._next(sink), left)
                    except asyncio.TimeoutError:
                        break
                    if event is None or event.get("type") == "done":
                        return
                await self.stop()
        finally:
            self._sink = None
            self.lock.release()

    async def close(self) -> None:
        """End the process for good: a cell still waiting on this context gets an error, and starts none."""
        self.ended = True
        await self.stop()

    async def stop(self) -> None:
        """End the process (its names are gone); the next cell starts a fresh one."""
        if self.task is not None and not self.task.done():
            self.task.cancel()  # closes the agent connection: the agent kills the process group
            await asyncio.gather(self.task, return_exceptions=True)


class Kernels:
    """Every context of every sandbox this server runs code in."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.by_sandbox: dict[str, dict[str, Kernel]] = {}

    def get(self, sandbox_id: str, context_id: str | None) -> Kernel:
        contexts = self.by_sandbox.setdefault(sandbox_id, {})
        key = context_id or "default-python"
        if key not in contexts:
            if context_id is not None:
                raise SandboxNotFound(f"no context {context_id!r} in sandbox {sandbox_id}")
            contexts[key] = Kernel(self.engine, sandbox_id, key, None, self._forget)
        return contexts[key]

    def add(self, sandbox_id: str, cwd: str | None) -> Kernel:
        kernel = Kernel(self.engine, sandbox_id, uuid.uuid4().hex, cwd, self._forget)
        self.by_sandbox.setdefault(sandbox_id, {})[kernel.id] = kernel
        return kernel

    def _forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: its contexts with it (their processes ended with it)."""
        self.by_sandbox.pop(sandbox_id, None)

    async def remove(self, sandbox_id: str, context_id: str) -> None:
        kernel = self.by_sandbox.get(sandbox_id, {}).pop(context_id, None)
        if kernel is None:
            raise SandboxNotFound(f"no context {context_id!r} in sandbox {sandbox_id}")
        await kernel.close()

    async def end(self, sandbox_id: str) -> None:
        """Stop every context of the sandbox: before a pause or fork (an exec in flight would hold
        it), and when it is killed."""
        for kernel in self.by_sandbox.pop(sandbox_id, {}).values():
            await kernel.close()

    async def close(self) -> None:
        for sandbox_id in list(self.by_sandbox):
            await self.end(sandbox_id)


def kernels(app: Any) -> Kernels:
    """The app's kernels, made on first use (``close_kernels`` ends them with the app)."""
    found = getattr(app.state, "e2b_kernels", None)
    if found is None:
        found = app.state.e2b_kernels = Kernels(app.state.engine)
    return found


async def close_kernels(app: Any) -> None:
    found = getattr(app.state, "e2b_kernels", None)
    if found is not None:
        await found.close()


def _printed(stream: str, text: str) -> dict[str, Any]:
    return {"type": stream, "text": text, "timestamp": time.time_ns()}


def _weight(event: dict[str, Any]) -> int:
    """An event's share of a client's backlog: its text, or the size of its other fields."""
    text = event.get("text")
    return len(text) if isinstance(text, str) else len(str(event))


def _error(name: str, value: str) -> dict[str, Any]:
    return {"type": "error", "name": name, "value": value, "traceback": f"{name}: {value}"}


def _sandbox(request: Request, sandbox_id: str | None, access: str | None, traffic: str | None) -> str:
    """The sandbox the headers name, when one of its tokens came with them."""
    if not sandbox_id:
        raise SandboxNotFound("missing the E2b-Sandbox-Id header")
    envd_tokens(request.app).check(sandbox_id, access or traffic)
    if request.app.state.engine.tenant_of(sandbox_id) is None:
        raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
    return sandbox_id


def _refusal(err: FanfoldError) -> JSONResponse:
    status = 404 if isinstance(err, SandboxNotFound) else 400
    return JSONResponse({"code": status, "message": str(err)}, status)


def _python_only(language: str | None) -> None:
    if language not in (None, "python", "python3"):
        raise InvalidRequest(f"fanfold's code interpreter runs Python only; got language {language!r}")


Sandbox = Header(None, alias="E2b-Sandbox-Id")
Access = Header(None, alias="X-Access-Token")
Traffic = Header(None, alias="E2B-Traffic-Access-Token")


@router.post("/execute")
async def execute(request: Request, sandbox: str | None = Sandbox, access: str | None = Access,
                  traffic: str | None = Traffic) -> Response:
    try:
        sandbox_id = _sandbox(request, sandbox, access, traffic)
        body = json.loads(await read_body(request, MAX_BODY))
        if not isinstance(body, dict) or not isinstance(body.get("code"), str):
            raise InvalidRequest("the body must be JSON with a string 'code'")
        if not isinstance(body.get("context_id"), (str, type(None))):
            raise InvalidRequest("context_id must be a string")
        _python_only(body.get("language"))
        env = body.get("env_vars") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise InvalidRequest("env_vars must map names to strings")
        kernel = kernels(request.app).get(sandbox_id, body.get("context_id"))
    except FanfoldError as err:
        return _refusal(err)
    except ValueError:
        return _refusal(InvalidRequest("the body is not JSON"))

    async def lines() -> AsyncIterator[bytes]:
        async for event in kernel.execute(body["code"], env):
            yield (json.dumps(event) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/contexts")
async def create_context(request: Request, sandbox: str | None = Sandbox, access: str | None = Access,
                         traffic: str | None = Traffic) -> Response:
    try:
        sandbox_id = _sandbox(request, sandbox, access, traffic)
        body = json.loads(await read_body(request, MAX_BODY) or b"{}")
        _python_only(body.get("language"))
        cwd = body.get("cwd")
        return JSONResponse(kernels(request.app).add(sandbox_id, cwd if isinstance(cwd, str) else None).describe())
    except FanfoldError as err:
        return _refusal(err)
    except (ValueError, AttributeError):
        return _refusal(InvalidRequest("the body must be a JSON object"))


@router.get("/contexts")
async def list_contexts(request: Request, sandbox: str | None = Sandbox, access: str | None = Access,
                        traffic: str | None = Traffic) -> Response:
    try:
        sandbox_id = _sandbox(request, sandbox, access, traffic)
    except FanfoldError as err:
        return _refusal(err)
    found = kernels(request.app).by_sandbox.get(sandbox_id, {})
    return JSONResponse([kernel.describe() for kernel in found.values()])


@router.delete("/contexts/{context_id}")
async def remove_context(context_id: str, request: Request, sandbox: str | None = Sandbox,
                         access: str | None = Access, traffic: str | None = Traffic) -> Response:
    try:
        await kernels(request.app).remove(_sandbox(request, sandbox, access, traffic), context_id)
    except FanfoldError as err:
        return _refusal(err)
    return Response(status_code=204)


@router.post("/contexts/{context_id}/restart")
async def restart_context(context_id: str, request: Request, sandbox: str | None = Sandbox,
                          access: str | None = Access, traffic: str | None = Traffic) -> Response:
    try:
        kernel = kernels(request.app).get(_sandbox(request, sandbox, access, traffic), context_id)
    except FanfoldError as err:
        return _refusal(err)
    await kernel.stop()  # a running cell ends now (with an error), rather than being waited for
    async with kernel.lock:
        await kernel.stop()  # and so does a kernel that a cell queued behind it started
    return Response(status_code=204)
