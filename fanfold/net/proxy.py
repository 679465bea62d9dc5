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

This module reads each request and picks its path; each path has its own module, one class each that
the session here combines: ``session`` (the client connection), ``egress`` (connections out under the
policy), ``tunnel`` (CONNECT passed through), ``terminate`` (TLS ended here), ``forward`` (plain and
recorded requests), ``replay`` and ``cached``; ``heads`` parses and filters request heads, ``state``
holds the per-sandbox state and counters.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path
from typing import Any, Awaitable, Callable

import h11

from .cache import Cache, cacheable
from .cached import Caching
from .heads import BadRequest, header_text, joined, split_authority, upgrade_of
from .policy import NetworkPolicy, Reachable
from .record import MAX_SPOOLED_BODY, Recorder, RecordingFull, Recordings, Taps
from .replay import Replaying
from .resolve import Resolver
from .session import ClientGone, Refused
from .state import SandboxNet
from .terminate import Terminating
from .tls import MalformedHello

log = logging.getLogger(__name__)

HEAD_TIMEOUT = 60.0
IDLE_TIMEOUT = 600.0
"""A tunnel (CONNECT, upgrade, exposed port, captured connection) that moves no byte for this long is closed."""


class Proxy:
    """Serves sandboxes' proxy connections under their policies."""

    def __init__(self, resolver: Resolver, reachable: Reachable, *, connect_timeout: float = 10.0,
                 head_timeout: float = HEAD_TIMEOUT, leaves: Callable[[str], ssl.SSLContext] | None = None,
                 recordings: Recordings | None = None, cache: Cache | None = None,
                 upstream_tls: ssl.SSLContext | None = None, idle_timeout: float | None = IDLE_TIMEOUT,
                 spool_dir: Path | None = None, spool_limit: int = MAX_SPOOLED_BODY) -> None:
        self.resolver = resolver
        self.reachable = reachable
        self.connect_timeout = connect_timeout
        self.head_timeout = head_timeout
        """A client that sends no request head for this long is dropped."""
        self.idle_timeout = idle_timeout
        """A tunnel that moves no byte either way for this long is closed; None: never."""
        self.spool_dir = spool_dir
        """Where a replay keeps request bodies it may send on (netd's own directory); None: in memory."""
        self.spool_limit = spool_limit
        """The largest request body a replay keeps to send on."""
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
        except (OSError, h11.ProtocolError, MalformedHello, TimeoutError, ClientGone):
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


class _Session(Replaying, Caching, Terminating):
    """One client connection: its h11 state, the upstream kept alive for it, and the requests on it."""

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
            except BadRequest as err:
                self.stats.errors += 1
                await self._respond(400, f"{err}\n", close=True)
            except Refused:
                pass
            if self.http.our_state is h11.SWITCHED_PROTOCOL or not await self._next_cycle():
                break
        self.broken = False

    async def _connect(self, request: h11.Request) -> bool:
        """Serve a CONNECT: a checked tunnel, or (the policy terminates) TLS ended here; True for the latter."""
        host, port = split_authority(request.target.decode("latin-1"), default_port=None)
        what = f"CONNECT {joined(host, port)}"
        if not isinstance(await self._client_event(), h11.EndOfMessage):
            raise BadRequest("a CONNECT request has no body")
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

    async def _forward(self, request: h11.Request) -> None:
        target = self._target(request)
        method = request.method.decode("latin-1")
        what = f"{method} {target.scheme}://{joined(target.host, target.port)}{target.path[:200]}"
        upgrade = upgrade_of(request.headers)
        policy = self._policy()
        if upgrade and (policy.record or policy.replay):
            await self._deny(what, "an upgrade (WebSocket) cannot be recorded or replayed")
        if policy.replay:
            await self._replay(request, target, what, policy)
            return
        if policy.record and self.proxy.recordings is None:
            await self._fail(what, "netd has no directory to record into (its settings lack net_dir)")
        taps = Taps(recorder=await self._recorder(what, policy))
        try:
            if policy.cache and self.proxy.cache is not None and cacheable(method, target.path, request.headers):
                if await self._from_cache(request, target, what, policy, taps):
                    return
                taps.cache = self.proxy.cache.writer(target.url)
            await self._pass_on(request, target, what, upgrade, taps)
        finally:
            taps.discard()

    async def _recorder(self, what: str, policy: NetworkPolicy) -> Recorder | None:
        """The recording this request goes into; a 507 when the tenant's recordings are at their quota."""
        if not policy.record or self.proxy.recordings is None:
            return None
        try:
            return self.proxy.recordings.recorder(self.sandbox.scope, policy.record)
        except RecordingFull as err:
            reason = f"recording {policy.record!r} is full: {err}"
            self.stats.deny(what, reason)
            await self._respond(507, f"fanfold: {what} was not sent: {reason}. Delete recordings"
                                     " (fleet.delete_recording(NAME), `fanfold recordings`) or ask the operator"
                                     " to raise the quota.\n", (("x-fanfold-denied", header_text(reason)),))
            raise Refused from None
