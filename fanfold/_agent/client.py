"""The host side of the agent protocol (see PROTOCOL.md): one connection per request."""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass, field
from typing import Awaitable, Callable

_HEADER = struct.Struct(">BI")
_MAX_FRAME = 1 << 20
OnChunk = Callable[[str, bytes], Awaitable[None] | None]


PROTOCOL_VERSION = 2
"""What this client speaks: version 2 added the ``u`` frame (run the command as a user)."""


class AgentUnreachable(Exception):
    """The agent's socket refused us or the connection broke mid-request."""


class AgentTooOld(Exception):
    """The agent (restored from an older memory snapshot) cannot do what was asked."""


@dataclass(frozen=True)
class ExecUser:
    """Whom a command runs as: the ``u`` frame's uid, gid and supplementary gids."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def payload(self) -> bytes:
        text = f"{self.uid} {self.gid}"
        if self.groups:
            text += " " + ",".join(str(g) for g in self.groups)
        return text.encode()


@dataclass
class RawExec:
    """What the agent reported of one exec, before the engine types it."""

    started: bool = False
    pid: int | None = None
    error: str | None = None
    status: dict[str, int] = field(default_factory=dict)
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)


def _frame(kind: bytes, payload: bytes = b"") -> bytes:
    return _HEADER.pack(kind[0], len(payload)) + payload


async def _read_frame(reader: asyncio.StreamReader) -> tuple[str, bytes]:
    try:
        header = await reader.readexactly(_HEADER.size)
        kind, size = _HEADER.unpack(header)
        if size > _MAX_FRAME:
            raise AgentUnreachable(f"agent sent an oversized frame ({size} bytes)")
        return chr(kind), await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError) as err:
        raise AgentUnreachable(f"agent connection closed: {err}") from None


class AgentClient:
    """Talks to one sandbox's agent over its host-side unix socket."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_unix_connection(self.socket_path, limit=_MAX_FRAME * 2)
        except OSError as err:
            raise AgentUnreachable(f"cannot reach the agent at {self.socket_path}: {err}") from None

    async def _request(self, kind: bytes) -> str:
        reader, writer = await self._connect()
        try:
            writer.write(_frame(kind))
            await writer.drain()
            _, payload = await _read_frame(reader)
            return payload.decode()
        finally:
            writer.close()

    async def ping(self) -> str:
        return await self._request(b"h")

    async def wait_ready(self) -> str:
        """``ok``, or ``fail NAME CODE`` for the first oneshot service that failed."""
        return await self._request(b"w")

    async def exec(
        self,
        argv: list[str],
        *,
        env: list[str],
        cwd: str,
        timeout_ms: int,
        max_output: int,
        stdin: bytes | None = None,
        on_chunk: OnChunk | None = None,
        user: ExecUser | None = None,
    ) -> RawExec:
        """Run one command; with ``user``, the ``u`` frame goes first, so an agent of protocol 1
        (which knows no ``u``) drops the connection instead of running the command as root."""
        try:
            return await self._exec(argv, env, cwd, timeout_ms, max_output, stdin, on_chunk, user)
        except AgentUnreachable:
            if user is not None and await self._version() < PROTOCOL_VERSION:
                raise AgentTooOld("this sandbox's agent predates running commands as a user") from None
            raise

    async def _version(self) -> int:
        try:
            return int((await self.ping()).rpartition(" ")[2])
        except (AgentUnreachable, ValueError):
            return PROTOCOL_VERSION  # unknown: the first error stands

    async def _exec(self, argv: list[str], env: list[str], cwd: str, timeout_ms: int, max_output: int,
                    stdin: bytes | None, on_chunk: OnChunk | None, user: ExecUser | None) -> RawExec:
        reader, writer = await self._connect()
        result = RawExec()
        feeder: asyncio.Task[None] | None = None
        try:
            frames = [] if user is None else [_frame(b"u", user.payload())]
            frames += [_frame(b"a", arg.encode()) for arg in argv]
            frames += [_frame(b"e", item.encode()) for item in env]
            frames += [_frame(b"c", cwd.encode()), _frame(b"t", str(timeout_ms).encode())]
            frames.append(_frame(b"l", str(max_output).encode()))
            if stdin is not None:
                frames.append(_frame(b"s", b"pipe"))
            frames.append(_frame(b"x"))
            writer.write(b"".join(frames))
            await writer.drain()
            if stdin is not None:
                feeder = asyncio.create_task(_feed(writer, stdin))
            await self._collect(reader, result, on_chunk)
            return result
        except ConnectionError as err:
            raise AgentUnreachable(f"agent connection broke: {err}") from None
        finally:
            if feeder is not None:
                feeder.cancel()
            writer.close()

    async def _collect(self, reader: asyncio.StreamReader, result: RawExec, on_chunk: OnChunk | None) -> None:
        while True:
            kind, payload = await _read_frame(reader)
            if kind == "p":
                result.started, result.pid = True, int(payload)
            elif kind in ("o", "r"):
                (result.stdout if kind == "o" else result.stderr).extend(payload)
                if on_chunk is not None:
                    maybe = on_chunk("stdout" if kind == "o" else "stderr", payload)
                    if maybe is not None:
                        await maybe
            elif kind == "f":
                result.error = payload.decode(errors="replace")
                return
            elif kind == "z":
                pairs = (item.split("=", 1) for item in payload.decode().split())
                result.status = {key: int(value) for key, value in pairs}
                return


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        for start in range(0, len(data), 1 << 16):
            writer.write(_frame(b"i", data[start : start + (1 << 16)]))
            await writer.drain()
        writer.write(_frame(b"i"))
        await writer.drain()
    except ConnectionError:
        pass
