"""An HTTP/1.1 client on asyncio streams and h11: what ``HttpTransport`` asks of one fanfold server.

h11 (the sans-IO protocol library under httpcore and uvicorn) does the HTTP: it writes the
requests, parses the replies, frames bodies by Content-Length or chunks both ways, and says
whether a connection may carry the next request. This module does only the I/O: keep-alive
connections (unix socket, TCP, or TLS when the URL says https) and how many run at once.
Importing aiohttp cost a CLI call against a server ~0.3 s here (its TLS contexts alone
~0.1 s, made at import); h11 costs ~10 ms, and ``ssl`` loads only for an https server.

A reply whose body was not read to its end closes its connection when released: that is
how a cancelled exec stream tells the server its caller went away.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import socket
from contextlib import asynccontextmanager
from typing import Any, AsyncIterable, AsyncIterator
from urllib.parse import urlencode

import h11

CONNECT_TIMEOUT_S = 30.0
KEEPALIVE = ((socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1), (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 15),
             (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5), (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3))
"""TCP keepalive on every connection: a call (a long exec is rightly silent) to a machine that vanished
fails within about 30 s instead of the kernel's quarter of an hour."""
MAX_HEAD = 1 << 16
CHUNK = 1 << 20


class ConnectionLost(Exception):
    """The server refused, closed or broke a connection, or sent something that is not HTTP."""


class _Unanswered(Exception):
    """The connection failed before any byte of a reply arrived."""


class _Conn:
    """One socket and h11's view of the exchanges on it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.http = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)

    @property
    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def send(self, *events: h11.Event) -> None:
        self.writer.writelines([piece for event in events for piece in self.http.send_with_data_passthrough(event)])

    async def next_event(self) -> h11.Event:
        """The reply's next event, reading the socket whenever h11 needs more bytes."""
        while (event := self.http.next_event()) is h11.NEED_DATA:
            self.http.receive_data(await self.reader.read(CHUNK))  # b"" at the end tells h11 so
        return event

    def settled(self) -> bool:
        """Whether the exchange ended cleanly and the connection may carry the next one; if so, ready it."""
        if self.http.their_state is h11.SEND_BODY:  # an empty body's end is known without reading
            try:
                if not isinstance(self.http.next_event(), h11.EndOfMessage):
                    return False
            except h11.RemoteProtocolError:
                return False
        if self.http.our_state is h11.DONE and self.http.their_state is h11.DONE:
            self.http.start_next_cycle()
            return True
        return False

    def close(self) -> None:
        self.writer.close()


class Response:
    """A reply: ``status``, ``headers`` (lower-case names), and its body through ``read`` or ``iter_any``."""

    def __init__(self, conn: _Conn, head: h11.Response) -> None:
        self.status, self._conn = head.status_code, conn
        self.headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in head.headers}

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_any()])

    async def json(self) -> Any:
        return jsonlib.loads(await self.read())

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, in pieces of at most about 1 MiB."""
        conn = self._conn
        try:
            while conn.http.their_state is h11.SEND_BODY:
                event = await conn.next_event()
                if isinstance(event, h11.Data) and event.data:
                    yield bytes(event.data)
        except (OSError, h11.RemoteProtocolError) as err:
            raise ConnectionLost(f"the reply broke off: {err or type(err).__name__}") from None


class Client:
    """Keep-alive connections to one server; at most ``limit`` requests in flight at once."""

    def __init__(self, *, socket_path: str | None = None, host: str = "localhost", port: int = 80, tls: bool = False,
                 headers: dict[str, str] | None = None, limit: int = 256) -> None:
        self._socket_path, self._host, self._port, self._tls = socket_path, host, port, tls
        self._host_header = "fanfold" if socket_path else (host if port in (80, 443) else f"{host}:{port}")
        self._headers = headers or {}
        self._idle: list[_Conn] = []
        self._live: set[_Conn] = set()
        """Every open connection, idle or carrying a call (``abort`` ends them all)."""
        self._slots = asyncio.Semaphore(limit)

    async def _open(self) -> _Conn:
        try:
            if self._socket_path is not None:
                opening = asyncio.open_unix_connection(self._socket_path)
            elif self._tls:
                import ssl  # only an https server pays for TLS

                opening = asyncio.open_connection(self._host, self._port, ssl=ssl.create_default_context(),
                                                  server_hostname=self._host)
            else:
                opening = asyncio.open_connection(self._host, self._port)
            reader, writer = await asyncio.wait_for(opening, CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as err:
            where = self._socket_path or f"{self._host}:{self._port}"
            raise ConnectionLost(f"cannot connect to {where}: {err or type(err).__name__}") from None
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                for option in KEEPALIVE:
                    sock.setsockopt(*option)
            except OSError as err:  # reset and closed before this task ran again: a server dying as it accepted
                writer.close()
                raise ConnectionLost(f"the connection to {self._host}:{self._port} closed as it opened: "
                                     f"{err.strerror or err}") from None
        conn = _Conn(reader, writer)
        self._live = {live for live in self._live if live.usable}  # forget those closed since
        self._live.add(conn)
        return conn

    def _idle_conn(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable:
                return conn
            conn.close()
        return None

    @asynccontextmanager
    async def request(self, method: str, path: str, *, params: Any = None, json: Any = None, data: Any = None,
                      headers: dict[str, str] | None = None) -> AsyncIterator[Response]:
        """Send one request; yield the reply once its head has arrived."""
        if params:
            path += "?" + urlencode(params, doseq=True)
        head, body = self._head(method, path, json, data, headers or {})
        async with self._slots:
            conn, response = await self._exchange(head, body)
            try:
                yield response
            finally:
                if conn.usable and conn.settled():
                    self._idle.append(conn)
                else:  # unread or not to be kept: hang up, so a streaming call on the server ends too
                    conn.close()

    def _head(self, method: str, path: str, json: Any, data: Any,
              headers: dict[str, str]) -> tuple[h11.Request, bytes | AsyncIterable[bytes]]:
        fields = {"Host": self._host_header, **self._headers, **headers}
        body: bytes | AsyncIterable[bytes]
        if json is not None:
            body = jsonlib.dumps(json).encode()
            fields.setdefault("Content-Type", "application/json")
        elif isinstance(data, (bytes, bytearray, memoryview)):
            body = bytes(data)
            fields.setdefault("Content-Type", "application/octet-stream")
        elif data is not None:
            body = data
            fields.setdefault("Content-Type", "application/octet-stream")
            fields["Transfer-Encoding"] = "chunked"
        else:
            body = b""
        if isinstance(body, bytes) and (body or method in ("POST", "PUT", "PATCH")):
            fields["Content-Length"] = str(len(body))
        try:
            return h11.Request(method=method, target=path, headers=list(fields.items())), body
        except h11.LocalProtocolError as err:  # a header or path that HTTP cannot carry
            raise ValueError(f"cannot send {method} {path!r}: {err}") from None

    async def _exchange(self, head: h11.Request, body: bytes | AsyncIterable[bytes]) -> tuple[_Conn, Response]:
        """Send on a kept-alive connection, or a new one; a kept one the server closed meanwhile
        (its idle timeout) fails before any reply, and the request goes once more on a new one."""
        reused = self._idle_conn()
        if reused is not None and isinstance(body, bytes):
            try:
                return reused, await self._send(reused, head, body)
            except _Unanswered:
                reused.close()
            except BaseException:
                reused.close()
                raise
        elif reused is not None:
            self._idle.append(reused)  # a streamed body cannot be sent twice: it goes on a fresh connection
        conn = await self._open()
        try:
            return conn, await self._send(conn, head, body)
        except _Unanswered as err:
            conn.close()
            raise ConnectionLost(str(err)) from None
        except BaseException:
            conn.close()
            raise

    async def _send(self, conn: _Conn, head: h11.Request, body: bytes | AsyncIterable[bytes]) -> Response:
        try:
            if isinstance(body, bytes):
                conn.send(*([head, h11.Data(data=body)] if body else [head]), h11.EndOfMessage())
            else:
                conn.send(head)
                async for chunk in body:
                    if chunk:
                        conn.send(h11.Data(data=chunk))
                        await conn.writer.drain()
                conn.send(h11.EndOfMessage())
            await conn.writer.drain()
            first = await conn.reader.read(CHUNK)
        except OSError as err:
            raise _Unanswered(f"the server closed the connection: {err or type(err).__name__}") from None
        if not first:
            raise _Unanswered("the server closed the connection before replying")
        conn.http.receive_data(first)
        try:
            while not isinstance(event := await conn.next_event(), h11.Response):
                pass  # an informational 1xx head; the reply's own follows
        except (OSError, h11.RemoteProtocolError) as err:
            raise ConnectionLost(f"the reply broke off or is not HTTP/1.1: {err or type(err).__name__}") from None
        return Response(conn, event)

    async def close(self) -> None:
        for conn in self._idle:
            conn.close()
            self._live.discard(conn)
        self._idle.clear()
        self._live = {conn for conn in self._live if conn.usable}

    def abort(self) -> None:
        """Hang up every connection, those carrying calls too: each such call fails with ConnectionLost."""
        for conn in self._live:
            conn.close()
        self._live.clear()
        self._idle.clear()
