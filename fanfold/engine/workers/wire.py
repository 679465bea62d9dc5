"""Frames between the router and its engine workers: a 4-byte length, then a pickle.

Both ends are this host's fanfold processes, joined by a socketpair the router made, so pickle
is safe here and carries the engine's own results and exceptions as they are. Router to worker:
``("start", config, owner, (index, count))`` once, then ``("call", id, method, args, kwargs)`` and
``("cancel", id)``. Worker to router: ``("ready",)`` or ``("err", 0, error)`` once, then
``("cb", id, name, args)`` for a callback the call was given (a command's output, a build's steps),
and ``("ok", id, value)`` or ``("err", id, error)``.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import Any, Callable

from ...errors import FanfoldError, InfrastructureError

HEADER = struct.Struct(">I")
CALLBACKS = ("on_output", "on_step", "on_progress")
"""The keyword arguments of the engine API that are callbacks: they cross as their name."""


class Callback:
    """Stands for a caller's callback on the worker's side: calling it sends a ``cb`` frame."""

    def __init__(self, name: str) -> None:
        self.name = name


def encode(message: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def encode_error(call_id: int, err: BaseException) -> bytes:
    """An ``err`` frame; an exception that does not pickle back crosses as an InfrastructureError."""
    if not isinstance(err, FanfoldError):
        err = InfrastructureError(f"engine worker error: {type(err).__name__}: {err}")
    try:
        pickle.loads(pickle.dumps(err))
        return encode(("err", call_id, err))
    except Exception:  # noqa: BLE001 - any exception type whose constructor pickle cannot replay
        return encode(("err", call_id, InfrastructureError(str(err))))


class Channel(asyncio.Protocol):
    """Frames over one socket, both ways: ``on_frame`` gets each as it arrives (on the loop, in order),
    ``ended`` resolves at the end of the stream."""

    def __init__(self, on_frame: Callable[[tuple[Any, ...]], None]) -> None:
        self.on_frame = on_frame
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= HEADER.size:
            end = HEADER.size + HEADER.unpack_from(buffer)[0]
            if len(buffer) < end:
                return
            frame = pickle.loads(memoryview(buffer)[HEADER.size:end])
            del buffer[:end]
            self.on_frame(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended.done():
            self.ended.set_result(None)

    @property
    def open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def send(self, frame: bytes) -> None:
        """Queue an encoded frame (``encode``); dropped once the stream has ended."""
        if self.open:
            assert self._transport is not None
            self._transport.write(frame)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def open_channel(sock: socket.socket, on_frame: Callable[[tuple[Any, ...]], None]) -> Channel:
    """A Channel over ``sock`` (one end of a socketpair), which it then owns."""
    _, channel = await asyncio.get_running_loop().create_unix_connection(lambda: Channel(on_frame), sock=sock)
    return channel
