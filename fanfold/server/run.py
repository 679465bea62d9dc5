"""Running the app: binding the sockets, serving with uvicorn, shutting down gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import os
import resource
import socket
import stat
from pathlib import Path
from typing import Any, Callable, Iterator

import uvicorn

from ..config import DEFAULT_SOCKET, EngineConfig
from ..errors import HostNotReady, InvalidRequest
from ..host import setup
from ..web.auth import Tenants
from .app import create_app
from .drain import Drain


def serve(
    config: EngineConfig | None = None,
    *,
    tenants: Tenants,
    socket_path: str | None = DEFAULT_SOCKET,
    host: str = "127.0.0.1",
    port: int | None = None,
    grace_s: float = 10.0,
    announce: Callable[[list[str]], None] = lambda urls: None,
) -> None:
    """Serve until SIGINT/SIGTERM; then stop accepting, give calls in flight ``grace_s`` to
    finish, cancel the rest, and destroy every sandbox the server owns (not detached ones)."""
    if port is not None and not len(tenants):
        raise InvalidRequest("serving over TCP needs at least one token")
    if not setup.is_root():
        raise HostNotReady("fanfold serve runs the engine, which needs root (mounts, cgroups): run it as root")
    _raise_fd_limit()
    sockets: list[socket.socket] = []
    urls: list[str] = []
    try:
        if socket_path:
            sockets.append(_bind_unix(socket_path))
            urls.append(f"unix://{Path(socket_path).absolute()}")
        if port is not None:
            tcp = _bind_tcp(host, port)
            sockets.append(tcp)
            bound_host, bound_port = tcp.getsockname()[:2]
            urls.append(f"http://{bound_host if ':' not in bound_host else f'[{bound_host}]'}:{bound_port}")
        if not sockets:
            raise InvalidRequest("nothing to serve on: give a socket path or a TCP port")
        drain = Drain(create_app(config, tenants))
        server = _Server(uvicorn.Config(
            drain, lifespan="on", log_level="warning", access_log=False, timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=math.ceil(grace_s) + BACKSTOP_S, backlog=4096, **_fast_parts(),
        ), lambda: announce(urls), drain, grace_s)
        server.run(sockets=sockets)
        if not server.started:
            raise HostNotReady("the server could not start its engine: see the log above, and `fanfold doctor`")
    finally:
        for sock in sockets:
            sock.close()
        if socket_path:
            _unlink_socket(socket_path)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None], drain: Drain, grace_s: float) -> None:
        super().__init__(config)
        self._on_ready = on_ready
        self._drain = drain
        self._grace_s = grace_s

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            self._on_ready()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Calls still running when the grace ends are ended here, each with a typed answer,
        # before uvicorn's own timeout (BACKSTOP_S later) would cancel them into bare 500s.
        timer = asyncio.get_running_loop().call_later(max(0.0, self._grace_s), self._drain.end_calls)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises SIGTERM/SIGINT after its graceful stop, killing the process before
        # our own cleanup (the socket file) runs; a clean stop asked for by a signal exits 0.
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()


BACKSTOP_S = 5
"""How long after the grace uvicorn cancels calls that did not end when told to."""
KEEP_ALIVE_S = 120
"""How long an idle client connection is kept: longer than clients keep theirs (httpx 5 s, aiohttp
15 s, reqwest 90 s), so the client hangs up first and never sends on a connection the server is
closing (the request would meet a reset, which most clients do not retry)."""
MAX_HEADER_BYTES = 64 * 1024
"""Largest request line plus headers; h11 enforces this itself, httptools does not."""


def _fast_parts() -> dict[str, Any]:
    """uvloop and httptools when installed: about half the per-request overhead."""
    parts: dict[str, Any] = {"h11_max_incomplete_event_size": MAX_HEADER_BYTES}
    try:
        __import__("uvloop")
        parts["loop"] = "uvloop"
    except ImportError:
        pass
    try:
        parts["http"] = _bounded_httptools()
    except ImportError:
        pass
    return parts


def _bounded_httptools() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpTools(HttpToolsProtocol):
        """Refuses (400, then closes) a request whose headers outgrow MAX_HEADER_BYTES."""

        def on_message_begin(self) -> None:
            self._header_bytes = 0
            super().on_message_begin()

        def _count(self, size: int) -> None:
            self._header_bytes += size
            if self._header_bytes > MAX_HEADER_BYTES:
                raise ValueError("request headers too large")  # httptools turns this into a parser error

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value))
            super().on_header(name, value)

    return BoundedHttpTools


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _bind_unix(path: str) -> socket.socket:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        if not stat.S_ISSOCK(target.lstat().st_mode):
            raise InvalidRequest(f"{path} exists and is not a socket: choose another --socket path")
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(path)
            raise HostNotReady(f"another server is already listening on {path}")
        except OSError:
            target.unlink()  # a dead server's socket
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # 0600 from the first instant, not after a chmod
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(4096)
    return sock


def _bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise HostNotReady(f"port {port} on {host} is in use: choose another --port") from None
        raise InvalidRequest(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.listen(4096)
    return sock


def _unlink_socket(path: str) -> None:
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass
