"""Ending the calls a stopping server could not finish, with an answer instead of a traceback.

When the grace period of a stop runs out, uvicorn cancels whatever still runs: the client
gets a bare 500 and the log an ``Exception in ASGI application`` traceback. ``Drain`` ends
those calls itself a moment earlier, by cancelling them (so an exec's command is killed,
as when its client leaves), and answers each with a retryable error in fanfold's body: a
503 when nothing was sent yet, or a last ``{"error": ...}`` line in an NDJSON stream.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from ..errors import InfrastructureError
from ..wire import error_to_json
from ..web.deps import NDJSON, line
from ..web.status import error_response

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]


def stopped_error() -> InfrastructureError:
    return InfrastructureError("the server stopped before the call finished, and cancelled it; retry once it is back")


class Drain:
    """ASGI middleware around the whole app: ``end_calls()`` cancels the HTTP calls in flight,
    and each answers with a retryable error instead of failing."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self._calls: set[asyncio.Task[Any]] = set()
        self._ended: set[asyncio.Task[Any]] = set()

    def end_calls(self) -> int:
        """Cancel every call in flight; returns how many there were."""
        for task in self._calls - self._ended:
            self._ended.add(task)
            task.cancel()
        return len(self._ended)

    async def __call__(self, scope: Message, receive: Callable[[], Awaitable[Message]], send: Send) -> None:
        task = asyncio.current_task()
        if scope["type"] != "http" or task is None:
            await self.app(scope, receive, send)
            return
        started: list[Message] = []

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                started.append(message)
            await send(message)

        self._calls.add(task)
        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if task not in self._ended:
                raise  # not ours: a disconnect or uvicorn's own backstop
            task.uncancel()  # the cancellation was only to stop the work; the call still answers
            await _answer(send, started[0] if started else None)
        finally:
            self._calls.discard(task)
            self._ended.discard(task)


async def _answer(send: Send, started: Message | None) -> None:
    err = stopped_error()
    if started is None:
        response = error_response(err)
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": [*response.raw_headers, (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": response.body, "more_body": False})
    elif _header(started, b"content-type").startswith(NDJSON):
        await send({"type": "http.response.body", "body": line({"error": error_to_json(err)}), "more_body": False})
    # Else a body is half sent (a file download): it is left unfinished, so the client sees
    # a cut connection rather than a complete-looking truncated file.


def _header(message: Message, name: bytes) -> str:
    for key, value in message.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return ""

