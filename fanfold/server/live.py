"""Live execs over HTTP: the command's stream says its id first, and input requests reach its control."""

from __future__ import annotations

import asyncio
import inspect
import secrets
from typing import Any

from fastapi import Request

from .._agent.client import ExecControl
from ..errors import CapacityExceeded, InvalidRequest, NotFound
from ..web.deps import engine
from ..web.schemas import ExecInput, ExecRequest
from ..wire import unb64


class LiveExec:
    """One running exec that takes input: its control, and the stream that announces it."""

    def __init__(self, registry: dict[str, LiveExec], sandbox_id: str, control: ExecControl,
                 queue: asyncio.Queue[dict[str, Any] | None]) -> None:
        self.id = secrets.token_urlsafe(16)  # unguessable: another client of the tenant cannot type into it
        self.sandbox_id, self.control, self._queue, self._registry = sandbox_id, control, queue, registry
        self._announced = False
        control.started.add_done_callback(lambda _: self.announce())

    @classmethod
    def open(cls, request: Request, sandbox_id: str, body: ExecRequest,
             queue: asyncio.Queue[dict[str, Any] | None]) -> LiveExec:
        if "control" not in inspect.signature(engine(request).exec).parameters:
            raise InvalidRequest("live execs and terminals are not available on a server with several engine workers")
        registry = _registry(request)
        pty = None if body.pty is None else (body.pty.rows, body.pty.cols)
        live = cls(registry, sandbox_id, ExecControl(keep_output=False, pty=pty), queue)
        registry[live.id] = live
        return live

    @staticmethod
    def find(request: Request, sandbox_id: str, exec_id: str) -> LiveExec:
        live = _registry(request).get(exec_id)
        if live is None or live.sandbox_id != sandbox_id:
            raise NotFound(f"no live exec {exec_id!r} in sandbox {sandbox_id} (it has ended, or was never live)")
        return live

    def announce(self) -> None:
        if not self._announced and self.control.pid is not None:
            self._announced = True
            self._queue.put_nowait({"started": {"pid": self.control.pid, "exec": self.id}})

    def apply(self, body: ExecInput) -> None:
        control = self.control
        try:
            if body.stdin:
                control.write(unb64(body.stdin, "stdin"))
            if body.eof:
                control.close_stdin()
            if body.resize is not None:
                control.resize(body.resize.rows, body.resize.cols)
        except ValueError as err:
            raise InvalidRequest(str(err)) from None
        except BufferError as err:
            raise CapacityExceeded(f"{err}: send again once it reads") from None
        for signum in body.signals:
            control.signal(signum)

    def close(self) -> None:
        self._registry.pop(self.id, None)


def _registry(request: Request) -> dict[str, LiveExec]:
    state = request.app.state
    if not hasattr(state, "live_execs"):
        state.live_execs = {}
    return state.live_execs
