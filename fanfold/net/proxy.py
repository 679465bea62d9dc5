"""The egress proxy that ``fanfold netd`` runs for each connection from a sandbox.

A forward proxy for clients that read ``HTTP_PROXY``/``HTTPS_PROXY``, speaking HTTP/1.1 (h11) to them:

- ``CONNECT host:port``: the policy is checked on the name, the name is resolved here (never by the
  sandbox), each address is checked, and the proxy connects to the first allowed one; then the TLS
  ClientHello's server name must be the CONNECT name (an IP CONNECT: a name the policy allows for that
  address), and bytes pass through unchanged. TLS is never terminated on this path.
- ``GET http://host/path`` (absolute form): the ``Host`` header must agree with the URL; every request,
  kept-alive ones included, is checked against the sandbox's current policy and forwarded in origin
  form with bodies streamed. WebSocket (and other) upgrades pass through raw after a 101.

Refusals answer 403 with ``X-Fanfold-Denied``, lookups and upstreams that fail 502 with
``X-Fanfold-Error``; both are counted in the sandbox's ``NetStats``.
"""

from __future__ import annotations

import asyncio
import collections
import http
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import h11

from .policy import Address, NetworkPolicy, Reachable, as_address, normal_host
from .resolve import LookupFailed, Resolver
from .tls import MalformedHello, client_hello_sni, is_tls_handshake, read_client_hello

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # reads take what is buffered, up to this: fewer, bigger copies
UPSTREAM_BUFFER = 1 << 18
HEAD_TIMEOUT = 60.0
HELLO_TIMEOUT = 10.0
CLOSE_TIMEOUT = 10.0
RECENT_DENIALS = 20
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authorization", b"proxy-authenticate",
                        b"proxy-connection", b"te", b"trailer", b"upgrade", b"expect"})
FRAMING = frozenset({b"host", b"content-length", b"transfer-encoding"})
USE_THE_PROXY = ("This is fanfold's egress proxy: send requests through it with the proxy variables"
                 " (HTTP_PROXY/HTTPS_PROXY), not to it as a server.\n")


@dataclass
class NetStats:
    """Per-sandbox counters kept by the proxy; ``bytes_up`` is sandbox to outside."""

    connections: int = 0
    """Client connections the sandbox opened to the proxy."""
    requests: int = 0
    """Request heads read: CONNECTs and plain HTTP requests, refused ones included."""
    bytes_up: int = 0
    bytes_down: int = 0
    denied: int = 0
    errors: int = 0
    """Malformed requests, failed lookups and upstreams, connections broken midway."""
    exposed_in: int = 0
    """Bytes into the sandbox through exposed ports (counted by netd's splices)."""
    exposed_out: int = 0
    recent_denials: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=RECENT_DENIALS))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "recent_denials": list(self.recent_denials)}

    def deny(self, what: str, reason: str) -> None:
        self.denied += 1
        self.recent_denials.append(f"{what}: {reason}")


@dataclass
class SandboxNet:
    """What netd keeps for one attached sandbox."""

    id: str
    policy: NetworkPolicy
    """Replaced at run time; every new connection and request reads the current one."""
    stats: NetStats = field(default_factory=NetStats)
    open: set[asyncio.Task[Any]] = field(default_factory=set)
    """The connection tasks running now, so that they can be cut."""


class Proxy:
    """Serves sandboxes' proxy connections under their policies."""

    def __init__(self, resolver: Resolver, reachable: Reachable, *, connect_timeout: float = 10.0,
                 head_timeout: float = HEAD_TIMEOUT) -> None:
        self.resolver = resolver
        self.reachable = reachable
        self.connect_timeout = connect_timeout
        self.head_timeout = head_timeout
        """A client that sends no request head for this long is dropped."""
        self._cut: set[asyncio.Task[Any]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sandbox: SandboxNet) -> None:
        """Serve one client connection from inside ``sandbox`` until it ends; never raises (errors are counted)."""
        task = asyncio.current_task()
        assert task is not None
        sandbox.open.add(task)
        sandbox.stats.connections += 1
        session = _Session(self, sandbox, reader, writer)
        try:
            await self._serve(session)
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            task.uncancel()  # cut: this connection ends here, quietly
            session.abort()
        finally:
            sandbox.open.discard(task)
            self._cut.discard(task)

    async def _serve(self, session: _Session) -> None:
        try:
            await session.run()
        except (OSError, h11.ProtocolError, MalformedHello, TimeoutError, _ClientGone):
            session.stats.errors += 1
        except Exception:  # a bug here must cost one connection, not netd
            log.exception("proxy connection of sandbox %s failed", session.sandbox.id)
            session.stats.errors += 1
        finally:
            await session.close()

    def cut(self, sandbox: SandboxNet) -> None:
        """End every open connection of ``sandbox`` (after a policy change that asks for it, or a detach)."""
        for task in list(sandbox.open):
            self._cut.add(task)
            task.cancel()


class _BadRequest(Exception):
    """A request the proxy answers with 400; the message says why."""


class _ClientGone(Exception):
    """The client went away in the middle of a request: nothing is left to answer."""


class _Refused(Exception):
    """A response has been sent instead of forwarding (403, 502): the request is over."""


@dataclass
class _Upstream:
    host: str
    port: int
    address: Address
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    http: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))


class _Session:
    """One client connection: its h11 state, the upstream kept alive for it, and the requests on it."""

    def __init__(self, proxy: Proxy, sandbox: SandboxNet, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.proxy, self.sandbox, self.stats = proxy, sandbox, sandbox.stats
        self.reader, self.writer = reader, writer
        self.http = h11.Connection(h11.SERVER)
        self.upstream: _Upstream | None = None
        self.broken = True  # until run() ends on its own
        self.refused = False  # a tunnel refused after its 200: both ends are cut at once
        self.closing = False  # the response being sent is the connection's last
        self.tunnel: list[asyncio.Task[Any]] = []

    async def run(self) -> None:
        while True:
            request = await self._read_head()
            if request is None:
                break
            self.stats.requests += 1
            self.closing = request.method == b"CONNECT"  # a refused CONNECT ends the connection (as curl expects)
            try:
                if request.method == b"CONNECT":
                    await self._connect(request)
                else:
                    await self._forward(request)
            except _BadRequest as err:
                self.stats.errors += 1
                await self._respond(400, f"{err}\n", close=True)
            except _Refused:
                pass
            if self.http.our_state is h11.SWITCHED_PROTOCOL or not await self._next_cycle():
                break
        self.broken = False

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
                            (("x-fanfold-denied", _header_text(reason)),))
        raise _Refused

    async def _fail(self, what: str, reason: str) -> None:
        self.stats.errors += 1
        await self._respond(502, f"fanfold: {what} failed: {reason}\n", (("x-fanfold-error", _header_text(reason)),))
        raise _Refused

    # -- opening upstreams --------------------------------------------------------------------------

    def _policy(self) -> NetworkPolicy:
        return self.sandbox.policy or NetworkPolicy()

    async def _open(self, what: str, host: str, port: int, policy: NetworkPolicy) -> _Upstream:
        """A connection to the first address of ``host`` that ``policy`` allows; 403/502 answered otherwise."""
        if (reason := policy.precheck(host, port)) is not None:
            await self._deny(what, reason)
        try:
            addresses = await self.proxy.resolver.resolve(host)
        except LookupFailed as err:
            await self._fail(what, str(err))
        verdicts = [(address, policy.decide(host, port, address, self.proxy.reachable)) for address in addresses]
        allowed = [address for address, reason in verdicts if reason is None]
        if not allowed:
            await self._deny(what, verdicts[0][1] or "no address")
        failures = []
        try:
            async with asyncio.timeout(self.proxy.connect_timeout):
                for address in allowed:
                    try:
                        reader, writer = await asyncio.open_connection(str(address), port, limit=UPSTREAM_BUFFER)
                        return _Upstream(host, port, address, reader, writer)
                    except OSError as err:
                        failures.append(f"{address}: {err.strerror or err}")
        except TimeoutError:
            failures.append(f"no connection in {self.proxy.connect_timeout:g} s")
        await self._fail(what, f"could not connect to {host}:{port} ({'; '.join(failures)})")
        raise AssertionError("unreachable")

    def _drop_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream.writer.transport.abort()
            self.upstream = None

    # -- CONNECT ------------------------------------------------------------------------------------

    async def _connect(self, request: h11.Request) -> None:
        host, port = _authority(request.target.decode("latin-1"), default_port=None)
        what = f"CONNECT {_joined(host, port)}"
        if not isinstance(await self._client_event(), h11.EndOfMessage):
            raise _BadRequest("a CONNECT request has no body")
        policy = self._policy()
        self._drop_upstream()
        upstream = self.upstream = await self._open(what, host, port, policy)
        self.writer.write(self.http.send(h11.Response(status_code=200, reason=b"Connection established", headers=[])))
        await self._splice(upstream, bytes(self.http.trailing_data[0]), b"",
                           lambda hello: self._sni_refusal(policy, upstream, hello))

    def _sni_refusal(self, policy: NetworkPolicy, upstream: _Upstream, hello: bytes) -> str | None:
        try:
            sni = client_hello_sni(hello)
        except MalformedHello as err:
            return f"unreadable TLS ClientHello: {err}"
        if sni is None:
            return None  # no name to check: the address was
        if as_address(upstream.host) is None:
            same = sni == upstream.host
            return None if same else f"TLS server name {sni} differs from the CONNECT host {upstream.host}"
        return policy.decide(sni, upstream.port, upstream.address, self.proxy.reachable)

    async def _splice(self, upstream: _Upstream, first_up: bytes, first_down: bytes, check_hello: Any = None) -> None:
        """Pass bytes both ways until both ends are done, starting with the bytes already read from either
        end; a ClientHello that starts the upstream bytes is checked by ``check_hello`` (a reason refuses it)."""
        if first_down:
            self.writer.write(first_down)
            self.stats.bytes_down += len(first_down)
        self.tunnel.append(asyncio.create_task(self._pump(upstream.reader, self.writer, up=False)))
        first = first_up or await self.reader.read(CHUNK)
        if check_hello is not None and first and is_tls_handshake(first):
            try:
                first = await read_client_hello(self.reader, first, HELLO_TIMEOUT)
            except MalformedHello as err:
                first = b""
                reason = f"unreadable TLS ClientHello: {err}"
            else:
                reason = check_hello(first)
            if reason is not None:
                self.stats.deny(f"TLS to {_joined(upstream.host, upstream.port)}", reason)
                self.refused = True
                return
        if first:
            upstream.writer.write(first)
            self.stats.bytes_up += len(first)
            self.tunnel.append(asyncio.create_task(self._pump(self.reader, upstream.writer, up=True)))
        elif upstream.writer.can_write_eof():
            upstream.writer.write_eof()
        if not all(await asyncio.gather(*self.tunnel)):
            raise ConnectionResetError("one end of the tunnel broke off")

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, up: bool) -> bool:
        """Copy until EOF, then half-close; False (and both ends torn down) when either end breaks."""
        try:
            while data := await reader.read(CHUNK):
                writer.write(data)
                if up:
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            return True
        except OSError:
            self.writer.transport.abort()
            if self.upstream is not None:
                self.upstream.writer.transport.abort()
            return False

    # -- plain HTTP ---------------------------------------------------------------------------------

    async def _forward(self, request: h11.Request) -> None:
        target = request.target.decode("latin-1")
        if target.startswith("/") or target == "*":
            raise _BadRequest(f"origin-form request {target[:200]!r}. {USE_THE_PROXY}")
        host, port, path = _absolute(target)
        _check_host_header(request, host, port)
        what = f"{request.method.decode('latin-1')} http://{_joined(host, port)}{path[:200]}"
        upgrade = _upgrade(request.headers)
        head = h11.Request(method=request.method, target=path.encode(),
                           headers=_forwardable(request.headers, host, port, upgrade))
        upstream, reused = await self._upstream_for(what, host, port)
        body_sent = None
        try:
            self._send_up(upstream, head)
            if self.http.they_are_waiting_for_100_continue:
                self.writer.write(self.http.send(h11.InformationalResponse(status_code=100, headers=[])))
            body_sent = await self._stream_request_body(upstream)
            response = await self._response_head(upstream)
        except (OSError, h11.RemoteProtocolError, h11.LocalProtocolError) as err:
            self._drop_upstream()
            if not (reused and body_sent == 0):
                await self._fail(what, f"the upstream broke off: {err}")
            # a kept-alive upstream that closed while idle: once more on a new connection
            upstream = self.upstream = await self._open(what, host, port, self._policy())
            try:
                self._send_up(upstream, head)
                self._send_up(upstream, h11.EndOfMessage())
                response = await self._response_head(upstream)
            except (OSError, h11.RemoteProtocolError, h11.LocalProtocolError) as err:
                self._drop_upstream()
                await self._fail(what, f"the upstream broke off: {err}")
        if response.status_code == 101 and upgrade:
            headers = _forwardable(response.headers, None, 0, _upgrade(response.headers) or upgrade)
            self._send_down(h11.InformationalResponse(status_code=101, reason=response.reason, headers=headers))
            await self._splice(upstream, bytes(self.http.trailing_data[0]), bytes(upstream.http.trailing_data[0]))
            return
        await self._stream_response(upstream, response)

    async def _upstream_for(self, what: str, host: str, port: int) -> tuple[_Upstream, bool]:
        """The upstream for a request, and whether it is the kept-alive one (to the same place, idle,
        and still allowed by the current policy) rather than a new connection."""
        policy = self._policy()
        kept = self.upstream
        if kept is not None and (kept.host, kept.port) == (host, port) and kept.http.our_state is h11.IDLE \
                and not kept.reader.at_eof():
            if (reason := policy.decide(host, port, kept.address, self.proxy.reachable)) is not None:
                self._drop_upstream()
                await self._deny(what, reason)
            return kept, True
        self._drop_upstream()
        self.upstream = await self._open(what, host, port, policy)
        return self.upstream, False

    def _send_up(self, upstream: _Upstream, event: Any) -> None:
        data = upstream.http.send(event)
        if data:
            upstream.writer.write(data)
            self.stats.bytes_up += len(data)

    def _send_down(self, event: Any) -> None:
        data = self.http.send(event)
        if data:
            self.writer.write(data)
            self.stats.bytes_down += len(data)

    async def _stream_request_body(self, upstream: _Upstream) -> int:
        """Pass the client's request body on; how many body bytes that was."""
        sent = 0
        while True:
            try:
                event = await self._client_event()
            except h11.RemoteProtocolError as err:
                self._drop_upstream()
                raise _BadRequest(f"malformed request body: {err}") from None
            if isinstance(event, h11.Data):
                self._send_up(upstream, event)
                sent += len(event.data)
                await upstream.writer.drain()
            elif isinstance(event, h11.EndOfMessage):
                self._send_up(upstream, h11.EndOfMessage())
                await upstream.writer.drain()
                return sent
            else:  # the client went away mid-body
                raise _ClientGone("the client closed inside its request body")

    async def _response_head(self, upstream: _Upstream) -> h11.Response | h11.InformationalResponse:
        """The upstream's response head (or its 101), passing other 1xx responses on to the client."""
        while True:
            event = await self._upstream_event(upstream)
            if isinstance(event, h11.Response) or (isinstance(event, h11.InformationalResponse)
                                                   and event.status_code == 101):
                return event
            if not isinstance(event, h11.InformationalResponse):
                raise ConnectionResetError("the upstream closed without answering")
            self._send_down(event)

    async def _upstream_event(self, upstream: _Upstream) -> Any:
        while (event := upstream.http.next_event()) is h11.NEED_DATA:
            upstream.http.receive_data(await upstream.reader.read(CHUNK))
        return event

    async def _stream_response(self, upstream: _Upstream, response: h11.Response) -> None:
        self._send_down(h11.Response(status_code=response.status_code, reason=response.reason,
                                     headers=_forwardable(response.headers, None, 0, None)))
        while True:
            event = await self._upstream_event(upstream)  # errors now break the client connection
            if isinstance(event, h11.Data):
                self._send_down(event)
                await self.writer.drain()
            elif isinstance(event, h11.EndOfMessage):
                self._send_down(h11.EndOfMessage())
                break
            else:
                raise ConnectionResetError("the upstream closed inside its response")
        if upstream.http.our_state is h11.DONE and upstream.http.their_state is h11.DONE:
            upstream.http.start_next_cycle()
        else:
            self._drop_upstream()
        await self.writer.drain()


def _header_text(text: str) -> str:
    """``text`` as a header value: printable ASCII on one line, bounded."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:512]


def _joined(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _authority(text: str, *, default_port: int | None) -> tuple[str, int]:
    """``host[:port]`` or ``[v6][:port]`` as (normal host, port); _BadRequest when malformed."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise _BadRequest(f"malformed authority {text[:200]!r}")
        number = rest[1:] if rest else None
        if as_address(host) is None:
            raise _BadRequest(f"{host[:200]!r} in brackets is not an IPv6 address")
    elif ":" in text:
        host, _, number = text.rpartition(":")
    else:
        host, number = text, None
    if number is None or number == "":
        if default_port is None:
            raise _BadRequest(f"{text[:200]!r} names no port: CONNECT takes host:port")
        port = default_port
    elif number.isdigit() and 0 < int(number) < 65536:
        port = int(number)
    else:
        raise _BadRequest(f"{text[:200]!r} has a bad port")
    host = normal_host(host)
    name_like = host.isascii() and all(c.isalnum() or c in "-._" for c in host)
    if not host or not (name_like or as_address(host) is not None):
        raise _BadRequest(f"{text[:200]!r} names no valid host")
    return host, port


def _absolute(target: str) -> tuple[str, int, str]:
    """An absolute-form ``http://`` target as (host, port, origin-form path)."""
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() != "http":
        raise _BadRequest(f"cannot forward {target[:200]!r}: only http:// URLs go as plain requests;"
                          " https:// goes through CONNECT (HTTPS_PROXY)")
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:].partition("#")[0]
    if "@" in authority:
        raise _BadRequest("URLs with user information (user@host) are not forwarded")
    host, port = _authority(authority, default_port=80)
    return host, port, path if path.startswith("/") else "/" + path


def _check_host_header(request: h11.Request, host: str, port: int) -> None:
    values = [value for name, value in request.headers if name == b"host"]
    if not values:
        return  # HTTP/1.0: the URL alone names the place
    named = _authority(values[0].decode("latin-1"), default_port=80)
    if named != (host, port):
        raise _BadRequest(f"the Host header names {_joined(*named)} but the URL names {_joined(host, port)}")


def _upgrade(headers: Any) -> bytes | None:
    """The protocol a request asks to upgrade to (``Connection: upgrade`` + ``Upgrade``), or None."""
    tokens = {t.strip().lower() for name, value in headers if name == b"connection" for t in value.split(b",")}
    values = [value for name, value in headers if name == b"upgrade"]
    return values[0] if b"upgrade" in tokens and values else None


def _forwardable(headers: Any, host: str | None, port: int, upgrade: bytes | None) -> list[tuple[bytes, bytes]]:
    """``headers`` without hop-by-hop ones (those the Connection header lists too); a Host added when a
    request has none; Connection/Upgrade put back for an upgrade."""
    listed = {t.strip().lower() for name, value in headers if name == b"connection" for t in value.split(b",")}
    listed -= FRAMING  # a Connection header cannot take away what frames the message
    kept = [(name, value) for name, value in headers.raw_items()
            if name.lower() not in HOP_BY_HOP and name.lower() not in listed]
    if host is not None and not any(name.lower() == b"host" for name, _ in kept):
        kept.insert(0, (b"Host", (host if port == 80 else _joined(host, port)).encode()))
    if upgrade is not None:
        kept += [(b"Connection", b"upgrade"), (b"Upgrade", upgrade)]
    return kept
