"""The host side of the agent protocol (see PROTOCOL.md): one connection per request.

The host never trusts what a sandbox says: the socket must be a socket (never a link the
sandbox planted to a host service), every frame is checked against the protocol, and output
is capped here whatever the agent claims to have capped.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import hashlib
import hmac
import os
import re
import secrets
import socket
import stat
import struct
from dataclasses import dataclass, field
from typing import Awaitable, Callable

_HEADER = struct.Struct(">BI")
_MAX_FRAME = 1 << 20
OnChunk = Callable[[str, bytes], Awaitable[None] | None]


PROTOCOL_VERSION = 6
"""What this client speaks: version 2 added the ``u`` frame (run the command as a user), version 3
the ``q`` and ``g`` requests (a runtime without fd passing: gVisor), version 4 the relays of gVisor's
sandbox networks (``l``, ``L``, ``o``), version 5 the ``k`` request (a signal on a connection of its
own) and the host's key (``g KEY``, ``n``+``q``, ``t NONCE``), version 6 terminals (the ``y`` frame
and the ``Y`` request)."""
USER_FRAME_VERSION = 2
PTY_VERSION = 6
MAX_TERMINAL_SIDE = 65535


class AgentUnreachable(Exception):
    """The agent's socket refused us or the connection broke mid-request."""


class AgentProtocolError(AgentUnreachable):
    """The agent sent what the protocol does not allow: a sandbox that subverted its agent."""


class AgentGone(AgentUnreachable):
    """The agent's socket is there but nothing listens on it: the agent let go of it (only a ``q``
    does that, and only an agent of protocol 4 or older takes one from inside the sandbox)."""


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


def check_terminal_size(rows: int, cols: int) -> tuple[int, int]:
    """``(rows, cols)`` as a terminal takes them (1 to 65535 each), or ValueError."""
    if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_TERMINAL_SIDE for v in (rows, cols)):
        raise ValueError(f"a terminal's rows and cols are whole numbers from 1 to {MAX_TERMINAL_SIDE},"
                         f" got {rows!r} x {cols!r}")
    return rows, cols


class ExecControl:
    """Live stdin, signals and terminal size for one exec while it runs. Stdin goes in order as ``i``
    frames on the exec's connection, which the agent reads only as fast as the command takes them;
    each signal goes at once on a connection of its own (``k PID SIGNAL``), so it never waits behind
    stdin the command does not read (an agent older than protocol 5 gets it as a ``k`` frame on the
    exec's connection, ahead of stdin still queued here); so does each resize (``Y PID ROWS COLS``).
    With ``pty=(rows, cols)`` the command runs on a pseudo-terminal of that size: its output is one
    stream (stdout), and Ctrl-C is the byte 0x03 written to its stdin. ``pid`` is set once the agent
    has started the command (``started`` is then done)."""

    MAX_BACKLOG = 16 << 20

    def __init__(self, *, keep_output: bool = True, pty: tuple[int, int] | None = None) -> None:
        self.pty = None if pty is None else check_terminal_size(*pty)
        """The terminal's size asked at the start, or None: pipes, no terminal."""
        self._stdin: collections.deque[bytes] = collections.deque()
        """Stdin payloads in order; an empty one ends stdin."""
        self._signals: collections.deque[int] = collections.deque()
        self._signalled = asyncio.Event()
        self._size: tuple[int, int] | None = None
        """The latest resize not yet sent (only the last one matters)."""
        self._inline: collections.deque[bytes] = collections.deque()
        """Frames for the exec's connection that go ahead of stdin still queued: an older agent's ``k``."""
        self._inline_only = False
        self._wake = asyncio.Event()
        self.keep_output = keep_output
        """False: output only reaches ``on_chunk`` (a long-lived process), the result keeps none."""
        self.backlog = 0
        """Stdin bytes queued or in flight, which the agent has not yet passed to the command."""
        self.written = 0
        """Stdin bytes written in all."""
        self.pid: int | None = None
        self.started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.stdin_closed = False

    def write(self, data: bytes) -> None:
        """Queue ``data`` for the command's stdin: ValueError once stdin is closed, BufferError while
        more than ``MAX_BACKLOG`` bytes wait for a command that does not read them."""
        if self.stdin_closed:
            raise ValueError("the command's stdin is closed")
        if self.backlog + len(data) > self.MAX_BACKLOG:
            raise BufferError(f"the command has not read the {self.backlog} bytes of stdin sent before")
        for start in range(0, len(data), 1 << 16):
            self._stdin.append(data[start : start + (1 << 16)])
        self.backlog += len(data)
        self.written += len(data)
        self._wake.set()

    def close_stdin(self) -> None:
        """End the command's stdin (the next read sees end of file); closing twice does nothing."""
        if not self.stdin_closed:
            self.stdin_closed = True
            self._stdin.append(b"")
            self._wake.set()

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the command's process group (once it started)."""
        self._signals.append(int(signum))
        self._signalled.set()
        self._wake.set()

    def resize(self, rows: int, cols: int) -> None:
        """Give the command's terminal a new size (the kernel tells it by SIGWINCH); ValueError
        without a terminal."""
        if self.pty is None:
            raise ValueError("the command has no terminal to resize: start it with a pty")
        self._size = check_terminal_size(rows, cols)
        self._signalled.set()
        self._wake.set()

    def take(self) -> tuple[list[bytes], list[int], tuple[int, int] | None]:
        """What was asked since the last take, for a relay of this control (a server's client): the
        stdin payloads (an empty one ends stdin), the signals, the latest size. ``await`` the
        ``changed()`` between takes."""
        stdin, signals, size = list(self._stdin), list(self._signals), self._size
        self._stdin.clear()
        self._signals.clear()
        self._size = None
        return stdin, signals, size

    def taken(self, written: int) -> None:
        """A relay passed ``written`` stdin bytes on: they no longer count in the backlog."""
        self.backlog -= written

    async def changed(self) -> None:
        """Wait until something is asked (stdin, a signal, a resize)."""
        if not (self._stdin or self._signals or self._size):
            self._wake.clear()
            await self._wake.wait()

    def _started(self, pid: int) -> None:
        self.pid = pid
        if not self.started.done():
            self.started.set_result(pid)

    async def _send_inline(self, sock: socket.socket) -> None:
        """Feed the exec's connection: stdin, and the signals an older agent takes only there."""
        loop = asyncio.get_running_loop()
        while True:
            if self._inline:
                await loop.sock_sendall(sock, self._inline.popleft())
            elif self._stdin:
                data = self._stdin.popleft()
                await loop.sock_sendall(sock, _frame(b"i", data))
                self.backlog -= len(data)
            else:
                self._wake.clear()
                await self._wake.wait()

    async def _send_signals(self, agent: AgentClient) -> None:
        """Send each signal and resize on a connection of its own, as soon as the command has started."""
        pid = await asyncio.shield(self.started)  # cancelling this task must not cancel ``started``
        while True:
            await self._signalled.wait()
            self._signalled.clear()
            if self._size is not None:
                size, self._size = self._size, None
                try:
                    await agent.resize(pid, *size)
                except AgentUnreachable:
                    pass  # the exec ended meanwhile: its own connection tells how
            while self._signals:
                signum = self._signals.popleft()
                if self._inline_only or not await agent.signal(pid, signum):
                    self._inline_only = True  # an agent before protocol 5: on the exec's connection then
                    self._inline.append(_frame(b"k", str(signum).encode()))
                    self._wake.set()


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
            raise AgentProtocolError(f"agent sent an oversized frame ({size} bytes)")
        return chr(kind), await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError) as err:
        raise AgentUnreachable(f"agent connection closed: {err}") from None


class AgentClient:
    """Talks to one sandbox's agent over its host-side unix socket."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = await self._connect_raw()
        try:
            return await asyncio.open_unix_connection(sock=sock, limit=_MAX_FRAME * 2)
        except OSError as err:
            sock.close()
            raise AgentUnreachable(f"cannot reach the agent at {self.socket_path}: {err}") from None

    async def _request(self, kind: bytes, answer: re.Pattern[str], *, payload: bytes = b"",
                       until_closed: bool = False) -> str:
        reader, writer = await self._connect()
        try:
            text = await _ask(reader, writer, kind, answer, payload)
            if until_closed and await reader.read(1):
                raise AgentProtocolError(f"agent sent more after its {kind.decode()!r} answer")
            return text
        finally:
            writer.close()

    async def ping(self) -> str:
        return await self._request(b"h", _PING)

    async def drop_listener(self, key: str) -> None:
        """Have the agent close its listening socket (``q``), proving the request with ``key`` (the
        one its first ``g`` gave it) over a nonce the agent gives first (``n``): the agent lets go for
        no one else. Returns once it also closed this connection, so it holds nothing of the host's;
        AgentProtocolError when it refused. SIGUSR2 to the agent binds it again."""
        reader, writer = await self._connect()
        try:
            nonce = await _ask(reader, writer, b"n", _NONCE)
            if await _ask(reader, writer, b"q", _OK_OR_FAIL, mac(key, "q", nonce).encode()) != "ok":
                raise AgentProtocolError("the agent refused the host's key: it is not the agent the key was given to")
            if await reader.read(1):
                raise AgentProtocolError("agent sent more after its 'q' answer")
        finally:
            writer.close()

    async def proves(self, key: str) -> bool:
        """Whether what answers at the socket is the agent that holds ``key`` and listens on that very
        socket (``t`` with a fresh nonce: the agent's MAC over it, given only once it has connected to
        its own socket's path and found itself there). Ask only with the socket's dir locked."""
        nonce = secrets.token_hex(16)
        try:
            proof = await self._request(b"t", _PROOF, payload=nonce.encode())
        except AgentProtocolError:
            return False
        return hmac.compare_digest(proof, mac(key, "t", nonce))

    async def drop_listener_legacy(self, token: str) -> None:
        """``drop_listener`` for an agent of protocol 3 or 4 (restored from an older checkpoint), which
        has no key: ``q`` with ``token`` (up to 64 hex digits), which ``token`` asks back."""
        if not _TOKEN.fullmatch(token):
            raise ValueError("a token is 1 to 64 lowercase hex digits")
        await self._request(b"q", _OK, payload=token.encode(), until_closed=True)

    async def token(self) -> str:
        """An agent of protocol 3 or 4: the token of its last ``q`` (``t``), empty when it had none. It
        tells anyone that asks: weaker than ``proves``, for agents that know no better."""
        return await self._request(b"t", _TOKEN_OR_NONE)

    async def release_services(self, key: str | None = None) -> None:
        """Let an agent started with ``--hold`` start its services (``g``), giving it ``key`` (64 hex
        digits) on that first ``g``: what proves the host's ``q`` and the agent's ``t`` from then on.
        Only the first ``g`` gives a key, while nothing of the sandbox has run yet."""
        if key is not None and not _KEY.fullmatch(key):
            raise ValueError("a key is 64 lowercase hex digits")
        await self._request(b"g", _OK, payload=(key or "").encode())

    async def signal(self, pid: int, signum: int) -> bool:
        """Send ``signum`` to the process group of the running exec whose command is ``pid``, on a
        connection of its own (``k``): True once sent, or when that exec has ended; False when the
        agent predates the request (protocol 4 or older) or could not be reached."""
        try:
            await self._request(b"k", _SIGNALLED, payload=f"{int(pid)} {int(signum)}".encode())
        except AgentUnreachable:
            return False
        return True

    async def resize(self, pid: int, rows: int, cols: int) -> bool:
        """Resize the terminal of the running exec whose command is ``pid`` (``Y``): True once done,
        False when that exec has ended (or has no terminal)."""
        rows, cols = check_terminal_size(rows, cols)
        answer = await self._request(b"Y", _SIGNALLED, payload=f"{int(pid)} {rows} {cols}".encode())
        return answer == "ok"

    async def relay(self, port: int, path: str) -> None:
        """Have the agent listen on 127.0.0.1:``port`` inside the sandbox, if it does not already, and
        pass each connection to the unix socket at ``path`` (``l``); OSError (EADDRINUSE: a process
        of the sandbox listens there) when it cannot."""
        _raise_failure(await self._request(b"l", _OK_OR_FAIL, payload=f"{port} {path}".encode()), f"port {port}")

    async def stop_relay(self, port: int) -> None:
        """Have the agent stop listening on ``port`` and end that relay's connections (``L``)."""
        await self._request(b"L", _OK, payload=str(port).encode())

    async def open_port(self, port: int) -> socket.socket:
        """A connection to 127.0.0.1:``port`` inside the sandbox, through the agent (``o``): the
        socket, non-blocking, carries the service's bytes once the agent answered; OSError (such as
        ECONNREFUSED) when nothing listens there."""
        sock = await self._connect_raw()
        try:
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(sock, _frame(b"o", str(port).encode()))
            # Read exactly the answer: what follows it is the service's, which the caller reads.
            kind, size = _HEADER.unpack(await _recv_exactly(loop, sock, _HEADER.size))
            text = (await _recv_exactly(loop, sock, size)).decode(errors="replace") if size <= 64 else ""
            if chr(kind) != "o" or not _OK_OR_FAIL.fullmatch(text):
                raise AgentProtocolError(f"agent answered 'o' with {chr(kind)!r} {text[:80]!r}")
            _raise_failure(text, f"port {port}")
            return sock
        except BaseException:
            sock.close()
            raise

    async def _connect_raw(self) -> socket.socket:
        try:
            return await _connect_socket(self.socket_path)
        except ConnectionRefusedError:
            raise AgentGone(f"the agent at {self.socket_path} no longer listens on its socket") from None
        except OSError as err:
            raise AgentUnreachable(f"cannot reach the agent at {self.socket_path}: {err}") from None

    async def wait_ready(self) -> str:
        """``ok``, or ``fail NAME CODE`` for the first oneshot service that failed."""
        return await self._request(b"w", _READY)

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
        control: ExecControl | None = None,
    ) -> RawExec:
        """Run one command; with ``user``, the ``u`` frame goes first, so an agent of protocol 1
        (which knows no ``u``) drops the connection instead of running the command as root.
        With ``control``, stdin stays open after ``stdin`` (if any) for what the control writes,
        and its signals reach the command; a control with a ``pty`` runs it on a terminal, whose ``y``
        frame then goes first (an agent before protocol 6 drops the connection and runs nothing)."""
        try:
            return await self._exec(argv, env, cwd, timeout_ms, max_output, stdin, on_chunk, user, control)
        except AgentProtocolError:
            raise
        except AgentUnreachable:
            if control is not None and control.pty is not None and await self._version() < PTY_VERSION:
                raise AgentTooOld("this sandbox's agent predates terminals (protocol 6)") from None
            if user is not None and await self._version() < USER_FRAME_VERSION:
                raise AgentTooOld("this sandbox's agent predates running commands as a user") from None
            raise

    async def _version(self) -> int:
        try:
            return int((await self.ping()).rpartition(" ")[2])
        except (AgentUnreachable, ValueError):
            return PROTOCOL_VERSION  # unknown: the first error stands

    async def _exec(self, argv: list[str], env: list[str], cwd: str, timeout_ms: int, max_output: int,
                    stdin: bytes | None, on_chunk: OnChunk | None, user: ExecUser | None,
                    control: ExecControl | None = None) -> RawExec:
        reader, writer = await self._connect()
        result = RawExec()
        feeder: asyncio.Task[None] | None = None
        second: socket.socket | None = None
        try:
            tty = control is not None and control.pty is not None
            frames = [_frame(b"y", "{} {}".format(*control.pty).encode())] if tty else []
            frames += [] if user is None else [_frame(b"u", user.payload())]
            frames += [_frame(b"a", arg.encode()) for arg in argv]
            frames += [_frame(b"e", item.encode()) for item in env]
            frames += [_frame(b"c", cwd.encode()), _frame(b"t", str(timeout_ms).encode())]
            frames.append(_frame(b"l", str(max_output).encode()))
            if stdin is not None or control is not None:
                frames.append(_frame(b"s", b"pipe"))
            frames.append(_frame(b"x"))
            writer.write(b"".join(frames))
            await writer.drain()
            if stdin is not None or control is not None:
                second = _second_handle(writer)
                feeder = asyncio.create_task(_feed(second, stdin or b"", control, self))
            await self._collect(reader, result, on_chunk, max_output, control)
            return result
        except ConnectionError as err:
            raise AgentUnreachable(f"agent connection broke: {err}") from None
        finally:
            if feeder is not None:
                feeder.cancel()
                await asyncio.gather(feeder, return_exceptions=True)
            if second is not None:
                second.close()
            writer.close()

    async def _collect(self, reader: asyncio.StreamReader, result: RawExec, on_chunk: OnChunk | None,
                       max_output: int, control: ExecControl | None = None) -> None:
        cut = {"o": False, "r": False}
        while True:
            kind, payload = await _read_frame(reader)
            if kind == "p" and not result.started and _NUMBER.fullmatch(payload.decode(errors="replace")):
                result.started, result.pid = True, int(payload)
                if control is not None:
                    control._started(result.pid)
            elif kind in ("o", "r") and result.started:
                kept = result.stdout if kind == "o" else result.stderr
                room = max_output - len(kept)
                if len(payload) > room:  # past the limit whatever the agent says it did
                    payload, cut[kind] = payload[:max(room, 0)], True
                if not payload:
                    continue
                if control is None or control.keep_output:
                    kept.extend(payload)
                if on_chunk is not None:
                    maybe = on_chunk("stdout" if kind == "o" else "stderr", payload)
                    if maybe is not None:
                        await maybe
            elif kind == "f":
                result.error = payload.decode(errors="replace")
                return
            elif kind == "z" and result.started:
                result.status = _status(payload)
                result.status["out_trunc"] |= cut["o"]
                result.status["err_trunc"] |= cut["r"]
                return
            else:
                raise AgentProtocolError(f"agent sent frame {kind!r} ({len(payload)} bytes) out of turn during an exec")


_NUMBER = re.compile(r"[0-9]{1,10}")
_OK = re.compile("ok")
_OK_OR_FAIL = re.compile(r"ok|fail (E[A-Z0-9]{1,20}|[0-9]{1,5})")
_TOKEN = re.compile("[0-9a-f]{1,64}")
_TOKEN_OR_NONE = re.compile("[0-9a-f]{0,64}")
_KEY = re.compile("[0-9a-f]{64}")
_NONCE = re.compile("[0-9a-f]{32}")
_PROOF = re.compile("[0-9a-f]{64}|fail EPERM")
_SIGNALLED = re.compile("ok|gone")
_PING = re.compile(r"fanfold-agent [0-9]{1,4}")
_READY = re.compile(r"ok|fail [^\s]{1,255} -?[0-9]{1,10}")
_STATUS_KEYS = ("code", "signal", "timeout", "out_bytes", "err_bytes", "out_trunc", "err_trunc", "duration_us")


def mac(key: str, kind: str, nonce: str) -> str:
    """What proves a request between the host and an agent holding ``key``: hex HMAC-SHA256 over
    ``KIND NONCE`` (``q``: the host's, over the agent's nonce; ``t``: the agent's, over the host's)."""
    return hmac.new(key.encode(), f"{kind} {nonce}".encode(), hashlib.sha256).hexdigest()


async def _ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kind: bytes, answer: re.Pattern[str],
               payload: bytes = b"") -> str:
    """Send one frame and read the agent's answer: a frame of the same kind that ``answer`` matches."""
    writer.write(_frame(kind, payload))
    await writer.drain()
    got, said = await _read_frame(reader)
    text = said.decode(errors="replace")
    if got != kind.decode() or not answer.fullmatch(text):
        raise AgentProtocolError(f"agent answered {kind.decode()!r} with {got!r} {text[:80]!r}")
    return text


def _status(payload: bytes) -> dict[str, int]:
    """The ``z`` frame's fields, every one present and a number, or AgentProtocolError."""
    try:
        status = {key: int(value) for key, value in (item.split("=", 1) for item in payload.decode().split())}
    except ValueError:
        status = {}
    if not all(key in status for key in _STATUS_KEYS):
        raise AgentProtocolError(f"agent sent a malformed exit status {payload[:120]!r}")
    return status


def _raise_failure(answer: str, what: str) -> None:
    """An ``l`` or ``o`` answer of ``fail ERRNO`` as the OSError it names."""
    if answer == "ok":
        return
    name = answer.removeprefix("fail ")
    code = int(name) if name.isdigit() else getattr(errno, name, errno.EIO)
    raise OSError(code, f"{what} inside the sandbox: {os.strerror(code)}")


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    try:
        while len(data) < size:
            chunk = await loop.sock_recv(sock, size - len(data))
            if not chunk:
                raise AgentUnreachable("agent connection closed before its answer")
            data += chunk
    except ConnectionError as err:
        raise AgentUnreachable(f"agent connection closed: {err}") from None
    return bytes(data)


async def _connect_socket(path: str) -> socket.socket:
    """A connection to the unix socket at ``path``, refused unless that is a socket itself:
    opened without following links and connected through its descriptor, so nothing in the
    sandbox can point the host at another socket between the check and the connect."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a socket")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, f"/proc/self/fd/{fd}")
        except BaseException:
            sock.close()
            raise
        return sock
    finally:
        os.close(fd)


async def _feed(sock: socket.socket, data: bytes, control: ExecControl | None, agent: AgentClient) -> None:
    """Write stdin (and then the control's frames) on ``sock``, a second handle on the exec's
    connection: a write that fails there (the agent closed after a fast command's ``z``) ends
    the feeding and nothing else, where a failed write on the stream's transport would also
    discard the frames still unread, ``z`` among them. The control's signals go meanwhile."""
    loop = asyncio.get_running_loop()
    signals = None if control is None else asyncio.create_task(control._send_signals(agent))
    try:
        for start in range(0, len(data), 1 << 16):
            await loop.sock_sendall(sock, _frame(b"i", data[start : start + (1 << 16)]))
        if control is not None:
            await control._send_inline(sock)
            return
        await loop.sock_sendall(sock, _frame(b"i"))
    except ConnectionError:
        pass
    finally:
        if signals is not None:
            signals.cancel()
            await asyncio.gather(signals, return_exceptions=True)


def _second_handle(writer: asyncio.StreamWriter) -> socket.socket:
    """A socket on a duplicate descriptor of the writer's connection, for the loop's own socket calls
    (which refuse a descriptor a transport uses); closing it leaves the connection open."""
    return socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))