"""The egress proxy that ``fanfold netd`` runs for each connection from a sandbox.

A forward proxy for clients that read ``HTTP_PROXY``/``HTTPS_PROXY``, speaking HTTP/1.1 (h11) to them:

- ``CONNECT host:port``: the policy is checked on the name, the name is resolved here (never by the
  sandbox), each address is checked, and the proxy connects to the first allowed one; then the TLS
  ClientHello's server name must be the CONNECT name (an IP CONNECT: a name the policy allows for that
  address), and bytes pass through unchanged: TLS stays end to end unless the policy terminates it (below).
- ``GET http://host/path`` (absolute form): the ``Host`` header must agree with the URL; every request,
  kept-alive ones included, is checked against the sandbox's current policy and forwarded in origin
  form with bodies streamed. WebSocket (and other) upgrades pass through raw after a 101.

When the policy records, replays or caches (``NetworkPolicy.terminates``), a CONNECT is answered by
the proxy itself: after the same name and SNI checks it completes the TLS handshake with a leaf of the
fleet's CA (``ca.Leaves``) and serves the HTTP/1.1 requests inside like plain ones, with scheme https,
opening its own TLS connection upstream when a request has to go out. Then each request is

- replayed: answered from the recording (``record.py``), never from outside; a miss is a 502 with
  ``X-Fanfold-Replay: miss`` (or, with ``live``, goes out unrecorded);
- cached: an immutable download (``cache.cacheable``) is answered from the shared cache, or fetched and
  kept there as it streams to the sandbox;
- recorded: forwarded, and the exchange stored as it streams.

The policy is checked first on every path: a denied URL is a 403 even when recorded or cached.

Refusals answer 403 with ``X-Fanfold-Denied``, lookups and upstreams that fail 502 with
``X-Fanfold-Error``; both are counted in the sandbox's ``NetStats``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import http
import logging
import ssl
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import h11

from .ca import TLSServerStream
from .cache import Cache, cacheable
from .policy import Address, NetworkPolicy, Reachable, as_address, normal_host
from .record import Recorder, Recordings, Spool, Taps, normal_url
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
NOT_STORED = HOP_BY_HOP | {b"content-length", b"transfer-encoding"}
"""Headers a stored response is sent without: its length comes from the body on disk."""
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
    cache_hits: int = 0
    cache_misses: int = 0
    cache_bytes: int = 0
    """Body bytes answered from the cache."""
    recorded: int = 0
    """Exchanges stored in a recording."""
    replayed: int = 0
    """Requests answered from a recording."""
    replay_misses: int = 0
    """Requests a replay found no recorded answer for (502, or out live)."""
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
    scope: str = ""
    """The tenant whose recordings this sandbox records into and replays from ("" for the host's)."""
    replayed: collections.Counter[tuple[str, Any]] = field(default_factory=collections.Counter)
    """How often each (recording, request key) has been answered: the next answer is the next recorded one."""


def upstream_context(cafile: str | Path | None = None) -> ssl.SSLContext:
    """The TLS client context for upstreams: the system's CAs (and ``cafile``'s), HTTP/1.1 only."""
    context = ssl.create_default_context()
    if cafile:
        context.load_verify_locations(cafile=str(cafile))
    context.set_alpn_protocols(["http/1.1"])
    return context


class Proxy:
    """Serves sandboxes' proxy connections under their policies."""

    def __init__(self, resolver: Resolver, reachable: Reachable, *, connect_timeout: float = 10.0,
                 head_timeout: float = HEAD_TIMEOUT, leaves: Callable[[str], ssl.SSLContext] | None = None,
                 recordings: Recordings | None = None, cache: Cache | None = None,
                 upstream_tls: ssl.SSLContext | None = None) -> None:
        self.resolver = resolver
        self.reachable = reachable
        self.connect_timeout = connect_timeout
        self.head_timeout = head_timeout
        """A client that sends no request head for this long is dropped."""
        self.leaves = leaves
        """host -> the server context showing the fleet CA's leaf for it; None: no CA, nothing terminated."""
        self.recordings = recordings
        self.cache = cache
        self.upstream_tls = upstream_tls
        """For https upstreams of terminated tunnels; None: the system's CAs."""
        self._cut: set[asyncio.Task[Any]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sandbox: SandboxNet) -> None:
        """Serve one client connection from inside ``sandbox`` until it ends; never raises (errors are counted)."""
        sandbox.stats.connections += 1
        session = _Session(self, sandbox, reader, writer)
        await self.held(sandbox, self._serve(session), on_cut=session.abort)

    async def held(self, sandbox: SandboxNet, work: Awaitable[None], on_cut: Callable[[], None] | None = None) -> None:
        """Run one connection's ``work`` as one of ``sandbox``'s open connections, which ``cut`` ends
        quietly (``on_cut`` then tears it down)."""
        task = asyncio.current_task()
        assert task is not None
        sandbox.open.add(task)
        try:
            await work
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            task.uncancel()  # cut: this connection ends here, quietly
            if on_cut is not None:
                on_cut()
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


async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stats: NetStats, *, up: bool) -> bool:
    """Copy until end of file, then half-close, counting bytes (``up``: sandbox to outside); False when
    either end broke."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            if up:
                stats.bytes_up += len(data)
            else:
                stats.bytes_down += len(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        return True
    except OSError:
        return False


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
    tls: bool = False


@dataclass(frozen=True)
class _Target:
    """Where a request goes: scheme, host, port and the origin-form path (with its query)."""

    scheme: str
    host: str
    port: int
    path: str

    @property
    def url(self) -> str:
        return normal_url(self.scheme, self.host, self.port, self.path)

    @property
    def tls(self) -> bool:
        return self.scheme == "https"


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
        self.origin: tuple[str, int] | None = None  # inside a terminated CONNECT: its host and port

    async def run(self) -> None:
        while True:
            request = await self._read_head()
            if request is None:
                break
            self.stats.requests += 1
            self.closing = request.method == b"CONNECT"  # a refused CONNECT ends the connection (as curl expects)
            try:
                if request.method == b"CONNECT":
                    if await self._connect(request):
                        continue  # TLS terminated: HTTPS requests come next, on a new h11 connection
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

    async def _open(self, what: str, host: str, port: int, policy: NetworkPolicy, tls: bool = False) -> _Upstream:
        """A connection to the first address of ``host`` that ``policy`` allows (TLS, verified, when ``tls``);
        403/502 answered otherwise."""
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
        failures, connected = [], None
        try:
            async with asyncio.timeout(self.proxy.connect_timeout):
                for address in allowed:
                    try:
                        reader, writer = await asyncio.open_connection(str(address), port, limit=UPSTREAM_BUFFER)
                        connected = _Upstream(host, port, address, reader, writer, tls=tls)
                        break
                    except OSError as err:
                        failures.append(f"{address}: {err.strerror or err}")
        except TimeoutError:
            failures.append(f"no connection in {self.proxy.connect_timeout:g} s")
        if connected is None:
            await self._fail(what, f"could not connect to {host}:{port} ({'; '.join(failures)})")
            raise AssertionError("unreachable")
        if tls:
            await self._start_tls(what, host, port, connected.writer)
        return connected

    async def _start_tls(self, what: str, host: str, port: int, writer: asyncio.StreamWriter) -> None:
        context = self.proxy.upstream_tls or _default_upstream_context()
        try:
            async with asyncio.timeout(self.proxy.connect_timeout):
                await writer.start_tls(context, server_hostname=host)
        except (OSError, TimeoutError) as err:
            writer.transport.abort()
            await self._fail(what, f"TLS with {_joined(host, port)} failed: {err or 'timed out'}")

    async def _admit(self, what: str, host: str, port: int, policy: NetworkPolicy, *, lookup: bool) -> None:
        """403 unless ``policy`` lets a request to ``host:port`` be answered without connecting anywhere
        (from a recording or the cache). Decided on the name (a literal address on itself); with ``lookup``,
        a name that only a CIDR rule could allow is resolved and its addresses checked. A replay without
        allow rules is bound only by its deny rules: the recording is what it may reach."""
        if policy.replay and not (policy.allow or policy.open):
            policy = dataclasses.replace(policy, open=True)
        if (reason := policy.precheck(host, port)) is None and (address := as_address(host)) is not None:
            reason = policy.decide(host, port, address, self.proxy.reachable)
        elif reason is None and lookup and not (policy.open or any(r.matches_name(host, port) for r in policy.allow)):
            try:
                addresses = await self.proxy.resolver.resolve(host)
            except LookupFailed as err:
                await self._fail(what, str(err))
            verdicts = [policy.decide(host, port, address, self.proxy.reachable) for address in addresses]
            if None not in verdicts:
                reason = verdicts[0] or "no address"
        if reason is not None:
            await self._deny(what, reason)

    def _drop_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream.writer.transport.abort()
            self.upstream = None

    # -- CONNECT ------------------------------------------------------------------------------------

    async def _connect(self, request: h11.Request) -> bool:
        """Serve a CONNECT: a checked tunnel, or (the policy terminates) TLS ended here; True for the latter."""
        host, port = _authority(request.target.decode("latin-1"), default_port=None)
        what = f"CONNECT {_joined(host, port)}"
        if not isinstance(await self._client_event(), h11.EndOfMessage):
            raise _BadRequest("a CONNECT request has no body")
        policy = self._policy()
        self._drop_upstream()
        if policy.terminates and self.origin is None:
            await self._terminate(what, host, port, policy)
            return True
        upstream = self.upstream = await self._open(what, host, port, policy)
        self.writer.write(self.http.send(h11.Response(status_code=200, reason=b"Connection established", headers=[])))
        await self._splice(upstream, bytes(self.http.trailing_data[0]), b"",
                           lambda hello: self._sni_refusal(policy, upstream, hello))
        return False

    async def _terminate(self, what: str, host: str, port: int, policy: NetworkPolicy) -> None:
        """Answer the CONNECT, check the ClientHello's name, and complete the handshake with a leaf for
        ``host``; the session then reads HTTPS requests from the tunnel. Nothing is resolved or connected
        here: each request decides whether it goes out."""
        if self.proxy.leaves is None:
            await self._fail(what, "the proxy has no CA to terminate TLS with (netd was given none)")
        assert self.proxy.leaves is not None
        await self._admit(what, host, port, policy, lookup=False)
        self.writer.write(self.http.send(h11.Response(status_code=200, reason=b"Connection established", headers=[])))
        first = bytes(self.http.trailing_data[0]) or await self.reader.read(CHUNK)
        if not first:
            raise _ClientGone("the client closed its tunnel before TLS")
        reason = None
        if not is_tls_handshake(first):
            reason = "only TLS may pass a tunnel whose traffic is recorded, replayed or cached"
        else:
            try:
                first = await read_client_hello(self.reader, first, HELLO_TIMEOUT)
                sni = client_hello_sni(first)
            except MalformedHello as err:
                reason = f"unreadable TLS ClientHello: {err}"
            else:
                if sni is not None and sni != host:
                    reason = f"TLS server name {sni} differs from the CONNECT host {host}"
        if reason is not None:
            self.stats.deny(f"TLS to {_joined(host, port)}", reason)
            self.refused = True
            raise _Refused
        stream = TLSServerStream(self.reader, self.writer, self.proxy.leaves(host), first)
        await stream.handshake(HELLO_TIMEOUT)
        self.reader = self.writer = stream  # type: ignore[assignment]
        self.http = h11.Connection(h11.SERVER)
        self.origin = (host, port)
        self.closing = False

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
        # A tunnel to an allowed address: the name only says which site there; a denied one is refused
        for rule in policy.deny:
            if rule.matches_name(sni.lower().rstrip("."), upstream.port):
                return f"TLS server name {sni} is denied by rule {rule.text!r}"
        return None

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
        if not await copy(reader, writer, self.stats, up=up):
            self.writer.transport.abort()
            if self.upstream is not None:
                self.upstream.writer.transport.abort()
            return False
        return True

    # -- plain HTTP ---------------------------------------------------------------------------------

    async def _forward(self, request: h11.Request) -> None:
        target = self._target(request)
        method = request.method.decode("latin-1")
        what = f"{method} {target.scheme}://{_joined(target.host, target.port)}{target.path[:200]}"
        upgrade = _upgrade(request.headers)
        policy = self._policy()
        if upgrade and (policy.record or policy.replay):
            await self._deny(what, "an upgrade (WebSocket) cannot be recorded or replayed")
        if policy.replay:
            await self._replay(request, target, what, policy)
            return
        if policy.record and self.proxy.recordings is None:
            await self._fail(what, "netd has no directory to record into (its settings lack net_dir)")
        taps = Taps(recorder=self._recorder(policy))
        try:
            if policy.cache and self.proxy.cache is not None and cacheable(method, target.path, request.headers):
                if await self._from_cache(request, target, what, policy, taps):
                    return
                taps.cache = self.proxy.cache.writer(target.url)
            await self._pass_on(request, target, what, upgrade, taps)
        finally:
            taps.discard()

    def _target(self, request: h11.Request) -> _Target:
        text = request.target.decode("latin-1")
        if self.origin is not None:  # inside a terminated tunnel: origin-form, to the CONNECT's host
            if not text.startswith("/"):
                raise _BadRequest(f"inside a CONNECT tunnel requests are origin-form (/path), not {text[:200]!r}")
            host, port = self.origin
            _check_host_header(request, host, port, default_port=443)
            return _Target("https", host, port, text.partition("#")[0])
        if text.startswith("/") or text == "*":
            raise _BadRequest(f"origin-form request {text[:200]!r}. {USE_THE_PROXY}")
        host, port, path = _absolute(text)
        _check_host_header(request, host, port)
        return _Target("http", host, port, path)

    def _recorder(self, policy: NetworkPolicy) -> Recorder | None:
        if not policy.record or self.proxy.recordings is None:
            return None
        return self.proxy.recordings.recorder(self.sandbox.scope, policy.record)

    async def _pass_on(self, request: h11.Request, target: _Target, what: str, upgrade: bytes | None,
                       taps: Taps, body: Spool | None = None) -> None:
        """Forward the request (its body from the client, or ``body`` when already read) and stream the
        answer back, copying both to ``taps``."""
        head = _origin_form(request, target, upgrade)
        taps.request(head.method.decode("latin-1"), target.url, head.headers.raw_items())
        upstream, reused = await self._upstream_for(what, target)
        body_sent = None
        try:
            self._send_up(upstream, head)
            if body is not None:
                body_sent = await self._send_spool(upstream, body)
            else:
                if self.http.they_are_waiting_for_100_continue:
                    self.writer.write(self.http.send(h11.InformationalResponse(status_code=100, headers=[])))
                body_sent = await self._stream_request_body(upstream, taps)
            response = await self._response_head(upstream)
        except (OSError, h11.RemoteProtocolError, h11.LocalProtocolError) as err:
            self._drop_upstream()
            if not (reused and body_sent == 0):
                await self._fail(what, f"the upstream broke off: {err}")
            # a kept-alive upstream that closed while idle: once more on a new connection
            upstream = self.upstream = await self._open(what, target.host, target.port, self._policy(), target.tls)
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
        await self._stream_response(upstream, response, taps)

    async def _upstream_for(self, what: str, target: _Target) -> tuple[_Upstream, bool]:
        """The upstream for a request, and whether it is the kept-alive one (to the same place, idle,
        and still allowed by the current policy) rather than a new connection."""
        policy = self._policy()
        host, port = target.host, target.port
        kept = self.upstream
        if kept is not None and (kept.host, kept.port, kept.tls) == (host, port, target.tls) \
                and kept.http.our_state is h11.IDLE and not kept.reader.at_eof():
            if (reason := policy.decide(host, port, kept.address, self.proxy.reachable)) is not None:
                self._drop_upstream()
                await self._deny(what, reason)
            return kept, True
        self._drop_upstream()
        self.upstream = await self._open(what, host, port, policy, target.tls)
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

    async def _stream_request_body(self, upstream: _Upstream, taps: Taps) -> int:
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
                taps.request_data(event.data)
                sent += len(event.data)
                await upstream.writer.drain()
            elif isinstance(event, h11.EndOfMessage):
                self._send_up(upstream, h11.EndOfMessage())
                await upstream.writer.drain()
                return sent
            else:  # the client went away mid-body
                raise _ClientGone("the client closed inside its request body")

    async def _send_spool(self, upstream: _Upstream, body: Spool) -> int:
        body.handle.seek(0)
        while data := body.handle.read(CHUNK):
            self._send_up(upstream, h11.Data(data=data))
            await upstream.writer.drain()
        self._send_up(upstream, h11.EndOfMessage())
        await upstream.writer.drain()
        return body.size

    async def _read_body(self, taps: Taps | None = None) -> Spool:
        """The client's whole request body, spooled (to disk when large), with its digest."""
        if self.http.they_are_waiting_for_100_continue:
            self.writer.write(self.http.send(h11.InformationalResponse(status_code=100, headers=[])))
        body = Spool(CHUNK)
        while True:
            try:
                event = await self._client_event()
            except h11.RemoteProtocolError as err:
                body.handle.close()
                raise _BadRequest(f"malformed request body: {err}") from None
            if isinstance(event, h11.Data):
                body.write(event.data)
                if taps is not None:
                    taps.request_data(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return body
            else:
                body.handle.close()
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

    async def _stream_response(self, upstream: _Upstream, response: h11.Response, taps: Taps) -> None:
        headers = _forwardable(response.headers, None, 0, None)
        self._send_down(h11.Response(status_code=response.status_code, reason=response.reason, headers=headers))
        taps.response(response.status_code, headers)
        while True:
            event = await self._upstream_event(upstream)  # errors now break the client connection
            if isinstance(event, h11.Data):
                self._send_down(event)
                taps.response_data(event.data)
                await self.writer.drain()
            elif isinstance(event, h11.EndOfMessage):
                self._send_down(h11.EndOfMessage())
                break
            else:
                raise ConnectionResetError("the upstream closed inside its response")
        self._commit(taps)
        if upstream.http.our_state is h11.DONE and upstream.http.their_state is h11.DONE:
            upstream.http.start_next_cycle()
        else:
            self._drop_upstream()
        await self.writer.drain()

    def _commit(self, taps: Taps) -> None:
        if taps.commit():
            self.stats.recorded += 1

    # -- answers from disk: the cache and recordings ----------------------------------------------

    async def _from_cache(self, request: h11.Request, target: _Target, what: str, policy: NetworkPolicy,
                          taps: Taps) -> bool:
        """Answer from the cache (after the policy's check) and True; False on a miss, to be fetched."""
        cache = self.proxy.cache
        assert cache is not None
        await self._admit(what, target.host, target.port, policy, lookup=True)
        await cache.wait_for(target.url)  # the same file on its way in for another sandbox: fetched once
        hit = cache.lookup(target.url)
        if hit is None:
            self.stats.cache_misses += 1
            return False
        body = await self._read_body(taps)
        body.handle.close()
        self.stats.cache_hits += 1
        self.stats.cache_bytes += hit.size
        head = _origin_form(request, target, None)
        taps.request(head.method.decode("latin-1"), target.url, head.headers.raw_items())
        await self._serve_stored(request.method, 200, hit.headers, hit.path, taps)
        return True

    async def _replay(self, request: h11.Request, target: _Target, what: str, policy: NetworkPolicy) -> None:
        """Answer from the policy's recording; a miss is a 502 (or, with ``live``, goes out unrecorded)."""
        name = policy.replay
        assert name is not None
        await self._admit(what, target.host, target.port, policy, lookup=False)
        body = await self._read_body()
        try:
            try:
                recording = self.proxy.recordings.recording(self.sandbox.scope, name) if self.proxy.recordings else None
            except (OSError, ValueError, TypeError) as err:
                await self._fail(what, f"recording {name!r} cannot be read: {err}")
            if recording is None:
                self.stats.replay_misses += 1
                await self._respond(502, f"fanfold: the sandbox replays recording {name!r}, which does not exist;"
                                         f" {what} has no answer\n", (("x-fanfold-replay", "no-recording"),))
                return
            key = (request.method.decode("latin-1"), target.url, body.sha.hexdigest())
            seen = self.sandbox.replayed[(name, key)]
            exchange = recording.find(key, seen)
            if exchange is not None and not recording.blob(exchange.response_body_sha256).is_file():
                await self._fail(what, f"recording {name!r} lacks the body {exchange.response_body_sha256}")
            if exchange is not None:
                self.sandbox.replayed[(name, key)] += 1
                self.stats.replayed += 1
                await self._serve_stored(request.method, exchange.status, exchange.response_headers,
                                         recording.blob(exchange.response_body_sha256), Taps())
                return
            self.stats.replay_misses += 1
            if policy.live:
                await self._pass_on(request, target, what, None, Taps(), body)
                return
            await self._respond(502, f"fanfold: recording {name!r} holds no answer to {what} (request body sha256"
                                     f" {key[2]}); record it again with this request, or replay with"
                                     " \"live\": true to let misses go out\n", (("x-fanfold-replay", "miss"),))
        finally:
            body.handle.close()

    async def _serve_stored(self, method: bytes, status: int, headers: list[list[str]], path: Path,
                            taps: Taps) -> None:
        """Send a stored response: its headers less hop-by-hop and framing, a length from the body on disk."""
        fields = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers
                  if k.lower().encode("latin-1") not in NOT_STORED]
        bodiless = method == b"HEAD" or status in (204, 304) or status < 200
        if method == b"HEAD":  # the length of what a GET would get, as recorded
            fields += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers if k.lower() == "content-length"]
        with open(path, "rb") as handle:
            size = 0 if bodiless else handle.seek(0, 2)
            handle.seek(0)
            if not bodiless:
                fields.append((b"content-length", str(size).encode()))
            reason = _phrase(status)
            self._send_down(h11.Response(status_code=status, reason=reason, headers=fields))
            taps.response(status, fields)
            while not bodiless and (data := handle.read(CHUNK)):
                self._send_down(h11.Data(data=data))
                taps.response_data(data)
                await self.writer.drain()
        self._send_down(h11.EndOfMessage())
        self._commit(taps)
        await self.writer.drain()


def _origin_form(request: h11.Request, target: _Target, upgrade: bytes | None) -> h11.Request:
    """The request as it goes upstream: origin-form, without hop-by-hop headers, with a Host."""
    return h11.Request(method=request.method, target=target.path.encode(),
                       headers=_forwardable(request.headers, target.host, target.port, upgrade,
                                            default_port=443 if target.tls else 80))


def _default_upstream_context() -> ssl.SSLContext:
    global _UPSTREAM_CONTEXT
    if _UPSTREAM_CONTEXT is None:
        _UPSTREAM_CONTEXT = upstream_context()
    return _UPSTREAM_CONTEXT


_UPSTREAM_CONTEXT: ssl.SSLContext | None = None


def _phrase(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


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


def _check_host_header(request: h11.Request, host: str, port: int, default_port: int = 80) -> None:
    values = [value for name, value in request.headers if name == b"host"]
    if not values:
        return  # HTTP/1.0: the URL alone names the place
    named = _authority(values[0].decode("latin-1"), default_port=default_port)
    if named != (host, port):
        raise _BadRequest(f"the Host header names {_joined(*named)} but the URL names {_joined(host, port)}")


def _upgrade(headers: Any) -> bytes | None:
    """The protocol a request asks to upgrade to (``Connection: upgrade`` + ``Upgrade``), or None."""
    tokens = {t.strip().lower() for name, value in headers if name == b"connection" for t in value.split(b",")}
    values = [value for name, value in headers if name == b"upgrade"]
    return values[0] if b"upgrade" in tokens and values else None


def _forwardable(headers: Any, host: str | None, port: int, upgrade: bytes | None,
                 default_port: int = 80) -> list[tuple[bytes, bytes]]:
    """``headers`` without hop-by-hop ones (those the Connection header lists too); a Host added when a
    request has none; Connection/Upgrade put back for an upgrade."""
    listed = {t.strip().lower() for name, value in headers if name == b"connection" for t in value.split(b",")}
    listed -= FRAMING  # a Connection header cannot take away what frames the message
    kept = [(name, value) for name, value in headers.raw_items()
            if name.lower() not in HOP_BY_HOP and name.lower() not in listed]
    if any(name.lower() == b"transfer-encoding" for name, _ in kept):
        # h11 framed it by Transfer-Encoding: a Content-Length beside it would let the upstream read it otherwise
        kept = [(name, value) for name, value in kept if name.lower() != b"content-length"]
    if host is not None and not any(name.lower() == b"host" for name, _ in kept):
        kept.insert(0, (b"Host", (host if port == default_port else _joined(host, port)).encode()))
    if upgrade is not None:
        kept += [(b"Connection", b"upgrade"), (b"Upgrade", upgrade)]
    return kept
