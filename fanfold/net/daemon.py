"""``fanfold netd``: the egress proxy process of one engine.

The engine starts it (``netd.Netd``) as an unprivileged user and talks to it over a SOCK_SEQPACKET
socket: one JSON message per packet, file descriptors alongside. Each sandbox with a network policy
is attached with a listener the engine opened inside the sandbox's network namespace; netd knows a
sandbox by the listener a connection came in on, so no header, address or credential can pass for
another. It holds no rights over namespaces, and it ends when the engine's end of the socket closes.

Messages (each answered with ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``):
``ca {cert, key}`` (the fleet's CA, for sandboxes whose TLS is terminated);
``attach {id, policy, scope, quota}`` + the listener (``scope``: the tenant whose recordings it uses,
``<net_dir>/recordings/<scope or _host>/<name>/``; ``quota``: ``{bytes, count}`` its recordings may take);
``policy {id, policy, cut}``; ``detach {id}``;
``splice {id}`` + two connected sockets (an exposed port: bytes pass both ways);
``stats {}``; ``ping {}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import sys
from functools import partial
from pathlib import Path
from typing import Any

from .ca import FleetCA, Leaves
from .cache import Cache
from .egress import upstream_context
from .policy import NetworkPolicy, Reachable
from .proxy import Proxy
from .record import Recordings
from .resolve import Resolver
from .state import Idle, NetStats, SandboxNet
from . import transparent
from .transparent import DnsAnswerer

TOTALS = ("connections", "requests", "bytes_up", "bytes_down", "denied", "errors", "exposed_in", "exposed_out",
          "cache_hits", "cache_misses", "cache_bytes", "recorded", "replayed", "replay_misses", "idle_closed")
LEAVES = 1024
"""Hosts whose leaf certificates (and TLS contexts) netd keeps; more are minted again when used."""
DEFAULT_CACHE_MB = 4096
MAX_MESSAGE = 1 << 20
MAX_OPEN = 512
"""Connections one sandbox may hold open through netd at once."""
MAX_FDS = 4


class Daemon:
    """The sandboxes attached to this netd, and the proxy serving them."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.sandboxes: dict[str, SandboxNet] = {}
        self.servers: dict[str, list[Any]] = {}
        """Per sandbox: its proxy listener's server, and with capture the captured TCP's and the DNS answerer."""
        self.splices: set[asyncio.Task[None]] = set()
        self.ca: tuple[bytes, bytes] | None = None
        self.retired = NetStats()
        """What detached sandboxes' counters came to: totals only ever grow."""

    async def serve(self, control: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        control.setblocking(False)
        while True:
            data, fds = await _receive(loop, control)
            if not data:
                return  # the engine is gone: so is everything it attached
            try:
                reply = await self.handle(json.loads(data), fds)
            except Exception as err:  # a bad message must not end netd: the engine hears why
                for fd in fds:
                    os.close(fd)
                reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            try:
                await loop.sock_sendall(control, json.dumps(reply).encode())
            except OSError as err:  # too large for one message: the engine hears that instead of losing netd
                await loop.sock_sendall(control, json.dumps({"ok": False, "error": f"the reply failed: {err}"}).encode())

    async def handle(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        op = message.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}
        if op == "ca":  # the fleet's CA, for the sandboxes whose TLS is terminated
            self.ca = (message["cert"].encode(), message["key"].encode())
            self.proxy.leaves = Leaves(FleetCA(*self.ca), LEAVES).context
            return {"ok": True}
        if op == "attach":
            fd, *capture = fds
            quota = message.get("quota") or {}
            if self.proxy.recordings is not None:
                self.proxy.recordings.limit(message.get("scope") or "", quota.get("bytes"), quota.get("count"))
            await self.attach(message["id"], NetworkPolicy.from_wire(message["policy"]), fd, message.get("scope") or "",
                              capture)
            return {"ok": True}
        if op == "policy":
            net = self.sandboxes[message["id"]]
            net.policy = _policy(message["policy"])
            if message.get("cut"):
                self.proxy.cut(net)
            return {"ok": True}
        if op == "detach":
            self.detach(message["id"])
            return {"ok": True}
        if op == "splice":
            outside, inside = fds
            net = self.sandboxes.get(message["id"])
            task = asyncio.ensure_future(_splice(outside, inside, self.retired if net is None else net.stats,
                                                 self.proxy.idle_timeout))
            self.splices.add(task)
            task.add_done_callback(self.splices.discard)
            return {"ok": True}
        if op == "stats":  # one sandbox's, denial reasons included; else every sandbox's counters alone
            if message.get("id"):
                net = self.sandboxes.get(message["id"])
                return {"ok": True, "sandboxes": {} if net is None else {net.id: net.stats.to_dict()}}
            return {"ok": True, "sandboxes": {i: _counters(net.stats) for i, net in self.sandboxes.items()},
                    "totals": self.totals()}
        raise ValueError(f"unknown op {op!r}")

    async def attach(self, sandbox_id: str, policy: NetworkPolicy | None, fd: int, scope: str = "",
                     capture: list[int] | tuple[int, ...] = ()) -> None:
        """Serve the sandbox's proxy listener (``fd``); with ``capture`` (a TCP listener and a UDP socket
        inside it, ``transparent``), its redirected connections and DNS queries too."""
        listener = socket.socket(fileno=fd)
        listener.setblocking(False)
        captured = [socket.socket(fileno=f) for f in capture]
        old = self.sandboxes.get(sandbox_id)
        if old is not None:  # a restored sandbox (resume): a new namespace, the same counters
            self._close_servers(sandbox_id)
            self.proxy.cut(old)
        net = SandboxNet(id=sandbox_id, policy=_policy(policy), stats=old.stats if old else NetStats(), open=set(),
                         scope=scope)
        if old is not None and old.scope == scope:
            net.replayed = old.replayed  # a replay goes on where it was
        self.sandboxes[sandbox_id] = net
        servers: list[Any] = [await asyncio.start_server(partial(self._connection, net), sock=listener)]
        self.servers[sandbox_id] = servers
        if captured:
            tcp, udp = captured
            tcp.setblocking(False)
            udp.setblocking(False)
            servers.append(await asyncio.start_server(partial(self._captured, net), sock=tcp))
            _, answerer = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: DnsAnswerer(self.proxy, net), sock=udp)
            servers.append(answerer)

    def _close_servers(self, sandbox_id: str) -> None:
        for server in self.servers.pop(sandbox_id, []):
            server.close()

    async def _captured(self, net: SandboxNet, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not _over_limit(net, writer):  # serve closes the connection on every way out, a cut's included
            await self.proxy.held(net, transparent.serve(self.proxy, net, reader, writer))

    async def _connection(self, net: SandboxNet, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not _over_limit(net, writer):
            await self.proxy.handle(reader, writer, net)

    def detach(self, sandbox_id: str) -> None:
        self._close_servers(sandbox_id)
        net = self.sandboxes.pop(sandbox_id, None)
        if net is not None:
            self.proxy.cut(net)
            for name in TOTALS:
                setattr(self.retired, name, getattr(self.retired, name) + getattr(net.stats, name))

    def totals(self) -> dict[str, int]:
        """Every counter summed over the sandboxes attached now and before."""
        live = [net.stats for net in self.sandboxes.values()]
        return {name: getattr(self.retired, name) + sum(getattr(s, name) for s in live) for name in TOTALS}


def _over_limit(net: SandboxNet, writer: asyncio.StreamWriter) -> bool:
    """Whether the sandbox holds MAX_OPEN connections already: then this one is closed at once, so that
    one sandbox cannot take every descriptor netd has from the others."""
    if len(net.open) < MAX_OPEN:
        return False
    net.stats.deny("a connection", f"the sandbox holds {MAX_OPEN} open connections through the proxy already")
    writer.close()
    return True


def _counters(stats: NetStats) -> dict[str, int]:
    return {name: getattr(stats, name) for name in TOTALS}


def _policy(wire: Any) -> NetworkPolicy:
    """The policy netd enforces; "none" leaves a listener that refuses every request."""
    return (wire if isinstance(wire, NetworkPolicy) else NetworkPolicy.from_wire(wire)) or NetworkPolicy()


async def _receive(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[bytes, list[int]]:
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
            return data, fds
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_reader(sock, ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_reader(sock)
        except ConnectionResetError:
            return b"", []


async def _splice(outside: int, inside: int, stats: NetStats, idle_timeout: float | None = None) -> None:
    """Pass bytes both ways between an exposed port's host connection and the sandbox's service, until
    both ends are done or neither moved a byte for ``idle_timeout`` seconds."""
    host_side, sandbox_side = socket.socket(fileno=outside), socket.socket(fileno=inside)
    try:
        host_r, host_w = await asyncio.open_connection(sock=host_side)
        box_r, box_w = await asyncio.open_connection(sock=sandbox_side)
    except OSError:
        host_side.close()
        sandbox_side.close()
        return

    idle = Idle(idle_timeout)

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, inbound: bool) -> None:
        try:
            while data := await reader.read(65536):
                idle.touch()
                writer.write(data)
                if inbound:
                    stats.exposed_in += len(data)
                else:
                    stats.exposed_out += len(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except OSError:
            writer.close()

    try:
        async with idle.watched(stats, lambda: [w.transport.abort() for w in (host_w, box_w)]):
            await asyncio.gather(pump(host_r, box_w, True), pump(box_r, host_w, False))
    finally:
        host_w.close()
        box_w.close()


def _preload() -> None:
    """Import now what would otherwise load on first use: once netd runs as its own user, the
    interpreter's library may be out of its reach."""
    import importlib

    for name in ("encodings.idna", "encodings.punycode", "stringprep", "dns.rdtypes.IN.A", "dns.rdtypes.IN.AAAA",
                 "dns.rdtypes.ANY.CNAME", "dns.rdtypes.ANY.SOA", "dns.message", "dns.query", "dns._asyncio_backend",
                 "asyncio.unix_events", "ssl", "concurrent.futures.thread"):
        importlib.import_module(name)
    "fanfold.test".encode("idna")
    socket.getaddrinfo("localhost", None)  # loads the resolver's NSS modules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fanfold netd", description=__doc__.splitlines()[0])
    parser.add_argument("--control", type=int, required=True, help="the fd of the engine's control socket")
    parser.add_argument("--settings", default="{}", help="JSON: reachable, hosts, nameservers, connect_timeout,"
                        " idle_timeout, net_dir, upstream_ca, cache_mb")
    parser.add_argument("--user", default=None, metavar="UID:GID", help="drop to this user once started")
    args = parser.parse_args(argv)
    settings = json.loads(args.settings)
    resolver = Resolver(hosts=settings.get("hosts") or {}, nameservers=settings.get("nameservers") or ())
    proxy = Proxy(resolver, Reachable(settings.get("reachable") or ()),
                  connect_timeout=float(settings.get("connect_timeout", 10.0)),
                  idle_timeout=float(settings.get("idle_timeout") or 0) or None,
                  upstream_tls=upstream_context(settings.get("upstream_ca")))  # files root may read, before the drop
    control = socket.socket(fileno=args.control)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # descriptors: a few per sandbox and connection
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if args.user:
        _preload()
        uid, _, gid = args.user.partition(":")
        os.setgroups([])
        os.setgid(int(gid))
        os.setuid(int(uid))
    if settings.get("net_dir"):  # netd's own directory: what it makes there is its user's
        net_dir = Path(settings["net_dir"])
        proxy.recordings = Recordings(net_dir / "recordings")
        proxy.spool_dir = net_dir / "spool"
        proxy.spool_dir.mkdir(mode=0o700, exist_ok=True)
        proxy.cache = Cache(net_dir / "cache", int(float(settings.get("cache_mb") or DEFAULT_CACHE_MB) * (1 << 20)))
    try:
        asyncio.run(Daemon(proxy).serve(control))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
