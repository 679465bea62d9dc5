"""Frames between the router and its engine workers: a 4-byte length, then a pickle.

Both ends are this host's fanfold processes, joined by a socketpair the router made, so pickle
is safe here and carries the engine's own results and exceptions as they are. Router to worker:
``("call", id, method, args, kwargs)`` and ``("cancel", id)``. Worker to router: ``("ready",)``
or ``("fail", error)`` once, then ``("cb", id, name, args)`` for a callback the call was given
(a command's output, a build's steps), ``("ok", id, value)`` or ``("err", id, error)``.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

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


async def read(reader: asyncio.StreamReader) -> tuple[Any, ...]:
    """The next frame; IncompleteReadError at the end of the stream."""
    size = HEADER.unpack(await reader.readexactly(HEADER.size))[0]
    return pickle.loads(await reader.readexactly(size))
