"""One client connection to the proxy: its h11 state, the answers the proxy gives itself (400, 403,
502), and the upstream kept alive for it. The paths a request takes build on this class: ``egress``
(connections out under the policy), ``tunnel``, ``terminate``, ``forward``, ``replay``, ``cached``."""

from __future__ import annotations

import asyncio
import http
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import h11

from .cache import Cache
from .heads import header_text
from .policy import Address, NetworkPolicy, Reachable
from .record import Recordings
from .resolve import Resolver
from .state import CHUNK, SandboxNet

HELLO_TIMEOUT = 10.0
CLOSE_TIMEOUT = 10.0


class Settings(Protocol):
    """What a session reads from the ``Proxy`` that serves it (``proxy.Proxy`` documents each)."""

    resolver: Resolver
    reachable: Reachable
    connect_timeout: float
    head_timeout: float
    idle_timeout: float | None
    spool_dir: Path | None
    spool_limit: int
    leaves: Callable[[str], ssl.SSLContext] | None
    recordings: Recordings | None
    cache: Cache | None
    upstream_tls: ssl.SSLContext | None


class ClientGone(Exception):
    """The client went away in the middle of a request: nothing is left to answer."""


class Refused(Exception):
    """A response has been sent instead of forwarding (403, 502): the request is over."""


@dataclass
class Upstream:
    host: str
    port: int
    address: Address
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    http: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))
    tls: bool = False


class Session:
    """One client connection: its h11 state, the upstream kept alive for it, and the requests on it."""

    def __init__(self, proxy: Settings, sandbox: SandboxNet, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.proxy, self.sandbox, self.stats = proxy, sandbox, sandbox.stats
        self.reader, self.writer = reader, writer
        self.http = h11.Connection(h11.SERVER)
        self.upstream: Upstream | None = None
        self.broken = True  # until run() ends on its own
        self.refused = False  # a tunnel refused after its 200: both ends are cut at once
        self.closing = False  # the response being sent is the connection's last
        self.tunnel: list[asyncio.Task[Any]] = []
        self.origin: tuple[str, int] | None = None  # inside a terminated CONNECT: its host and port

    async def close(self) -> None:
        """Close both ends (at once when broken, else after what is written) and wait until they are."""
        if self.broken or self.refused:
            self.abort()
        writers = self._writers()
        for writer in writers:
            writer.close()
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
        except TimeoutError:  # a peer that takes nothing more: drop what it did not take
            self.abort()

    def abort(self) -> None:
        """Drop both ends now, and the tunnel's pumps."""
        for task in self.tunnel:
            task.cancel()
        for writer in self._writers():
            writer.transport.abort()

    def _writers(self) -> list[asyncio.StreamWriter]:
        return [w for w in (self.writer, self.upstream.writer if self.upstream else None) if w is not None]

    # -- the client side --------------------------------------------------------------------------

    async def _read_head(self) -> h11.Request | None:
        """The next request head, or None when the client is done, idle too long or sent garbage (400)."""
        try:
            async with asyncio.timeout(self.proxy.head_timeout):
                event = await self._client_event()
        except TimeoutError:
            return None
        except h11.RemoteProtocolError as err:
            self.stats.errors += 1
            if self.http.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await self._respond(err.error_status_hint, f"malformed request: {err}\n", close=True)
            return None
        return event if isinstance(event, h11.Request) else None

    async def _client_event(self) -> Any:
        while (event := self.http.next_event()) is h11.NEED_DATA:
            self.http.receive_data(await self.reader.read(CHUNK))
        return event

    async def _next_cycle(self) -> bool:
        if self.http.our_state is h11.DONE and self.http.their_state is h11.DONE:
            self.http.start_next_cycle()
            return True
        return False

    async def _respond(self, status: int, text: str, headers: tuple[tuple[str, str], ...] = (),
                       close: bool = False) -> None:
        body = text.encode()
        fields = [("content-type", "text/plain; charset=utf-8"), ("content-length", str(len(body))), *headers]
        if self.http.their_state is h11.SEND_BODY:
            try:  # a request without a body has its end parsed already; one with a body is not read
                self.http.next_event()
            except h11.RemoteProtocolError:
                close = True
        if close or self.closing or self.http.their_state not in (h11.DONE, h11.MIGHT_SWITCH_PROTOCOL):
            fields.append(("connection", "close"))
        self.writer.write(b"".join(self.http.send(event) for event in (
            h11.Response(status_code=status, headers=fields, reason=http.HTTPStatus(status).phrase.encode()),
            h11.Data(data=body), h11.EndOfMessage())))
        await self.writer.drain()

    async def _deny(self, what: str, reason: str) -> None:
        self.stats.deny(what, reason)
        await self._respond(403, f"fanfold: the sandbox's network policy refused {what}:\n  {reason}\n"
                                 "The policy's allow list (network={\"allow\": [...]}) names what the sandbox may"
                                 " reach; special address ranges also need the operator's net_reachable.\n",
                            (("x-fanfold-denied", header_text(reason)),))
        raise Refused

    async def _fail(self, what: str, reason: str) -> None:
        self.stats.errors += 1
        await self._respond(502, f"fanfold: {what} failed: {reason}\n", (("x-fanfold-error", header_text(reason)),))
        raise Refused

    # -- the upstream and the bytes each way ------------------------------------------------------

    def _policy(self) -> NetworkPolicy:
        return self.sandbox.policy or NetworkPolicy()

    def _drop_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream.writer.transport.abort()
            self.upstream = None

    def _send_up(self, upstream: Upstream, event: Any) -> None:
        data = upstream.http.send(event)
        if data:
            upstream.writer.write(data)
            self.stats.bytes_up += len(data)

    def _send_down(self, event: Any) -> None:
        data = self.http.send(event)
        if data:
            self.writer.write(data)
            self.stats.bytes_down += len(data)
