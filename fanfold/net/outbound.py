"""What the server fetches for a tenant from the host's network (an image pull, a build's git clone):
only from the hosts the operator allows, under the egress proxy's address rules.

The tenant names a host, and the tool then goes wherever that host sends it (a redirect, a layer's
URL). So the tool runs in a network namespace of its own holding only loopback, where its one way
out is the egress proxy (``proxy.Proxy``, served there for the one command) under a
``TrustedPolicy``: a host the operator lists is reached at whatever address it has (the operator
vouches for it), any other only at a public address or in ``net_reachable``, checked on the address
actually connected to (no DNS rebinding), on every redirect. Some tools never send loopback
(``localhost``, 127/8, ``::1``) through a proxy, so a listed host there gets a forwarder at its own
address inside the namespace; any other loopback address finds nothing there.

With no hosts listed, a tenant may fetch from any host at a public address. ``pulls`` (registries)
and ``clones`` (git hosts) are the two kinds, each with its own list.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator, Iterable

from ..errors import FanfoldError, InvalidRequest
from ..host import netns
from .policy import Address, NetworkPolicy, Reachable, as_address, normal_host
from .proxy import Proxy
from .resolve import Resolver
from .state import Idle, SandboxNet, copy

PROXY_PORT = 3128
"""Where the tool finds the proxy inside its namespace."""
NETNS_FD = 3
"""The descriptor nsenter reads the namespace from."""
DEFAULT_PORTS = (443, 80)
"""The ports of a listed host written without one (HTTPS, or plain HTTP)."""
_HOST = re.compile(r"^(?:\[(?P<v6>[0-9a-fA-F:]+)\]|(?P<host>[A-Za-z0-9.-]+))(?::(?P<port>\d{1,5}))?$")
Listed = tuple[tuple[str, "int | None"], ...]


def split_host(text: str, noun: str = "host", example: str = "host.example.com") -> tuple[str, int | None]:
    """``host[:port]`` (``[v6]:port``) as (lowercase host, port or None); InvalidRequest, naming it a
    ``noun`` and giving an ``example``, when it is not one."""
    found = _HOST.match(text.strip())
    port = int(found["port"]) if found and found["port"] else None
    if found is None or (port is not None and not 0 < port < 65536):
        raise InvalidRequest(f"{text!r} is not a {noun}: write HOST[:PORT], e.g. {example} or 10.1.2.3:5000")
    return normal_host(found["v6"] or found["host"]), port


def _same_port(port: int | None, other: int | None) -> bool:
    """Whether two ``host[:port]`` of one host mean the same port (none written: a default one)."""
    return port == other or (None in (port, other) and ({port, other} - {None}) <= set(DEFAULT_PORTS))


def _is_loopback(host: str) -> bool:
    address = as_address(host)
    return host == "localhost" or (address is not None and address.is_loopback)


@dataclass(frozen=True)
class TrustedPolicy(NetworkPolicy):
    """Any public address, and the operator's listed hosts wherever they are."""

    trusted: Listed = ()
    """(host, port or None) of the hosts the operator lists."""

    def trusts(self, host: str, port: int) -> bool:
        name = normal_host(host)
        return any(name == known and (port == known_port if known_port else port in DEFAULT_PORTS)
                   for known, known_port in self.trusted)

    def decide(self, host: str, port: int, address: Address, reachable: Reachable) -> str | None:
        return None if self.trusts(host, port) else super().decide(host, port, address, reachable)


class Gate:
    """The hosts of one kind server tenants may fetch from, and the way out each fetch takes.
    A kind says, in words: its fetch (``fetch``), from what (``noun``, ``plural``,
    ``example``), where else a fetch is sent (``elsewhere``) and how the operator allows a host
    (``how_to_allow``)."""

    fetch, elsewhere, how_to_allow = "fetch", "a redirect", ""
    noun, plural, example = "host", "hosts", "host.example.com"

    def __init__(self, listed: Iterable[str] = (), *, reachable: Iterable[str] = (),
                 hosts: dict[str, list[str]] | None = None, nameservers: Iterable[str] = (),
                 connect_timeout: float = 10.0, idle_timeout: float | None = None) -> None:
        self.listed: Listed = tuple(dict.fromkeys(split_host(text, self.noun, self.example) for text in listed))
        self.reachable = Reachable(reachable)
        self.resolver = Resolver(hosts=hosts, nameservers=tuple(nameservers))
        self.connect_timeout, self.idle_timeout = connect_timeout, idle_timeout

    def check_host(self, target: str) -> None:
        """InvalidRequest, naming ``target`` (``host[:port]``) and how the operator allows it, when a
        tenant may not fetch from it."""
        host, port = split_host(target, self.noun, self.example)
        if self.listed:
            if not any(host == known and _same_port(port, known_port) for known, known_port in self.listed):
                listed = ", ".join(f"{h}:{p}" if p else h for h, p in self.listed)
                raise InvalidRequest(f"this server's tenants {self.fetch} only from the {self.plural} its operator allows"
                                     f" ({listed}), and {target} is not one: {self.how_to_allow}")
            return
        address = as_address(host)
        why = "a loopback name" if host == "localhost" else \
            self.reachable.refuses(address) if address is not None else None
        if why is not None:
            raise InvalidRequest(f"{self.noun} {target} is {why}: this server's tenants {self.fetch} only"
                                 f" from {self.plural} at public addresses unless the operator allows one;"
                                 f" {self.how_to_allow}")

    @contextlib.asynccontextmanager
    async def opened(self, target: str, what: str) -> AsyncIterator[Route]:
        """The way out of one fetch (``what``, in words) from ``target`` (checked first), open for the block."""
        self.check_host(target)
        route = Route(self, target, what)
        try:
            await route.open()
            yield route
        finally:
            await route.close()

    def explain(self, route: Route, err: FanfoldError) -> FanfoldError:
        """The error a failed fetch on ``route`` raises: a refusal of its proxy's, named, over ``err``
        (what the tool made of it)."""
        if not route.net.stats.recent_denials:
            return err
        return InvalidRequest(
            f"{route.what} was refused: it went to {route.net.stats.recent_denials[-1]}. A tenant's {self.fetch}"
            f" reaches the {self.plural} the operator allows at any address, and any other host ({self.elsewhere})"
            f" only at a public address or one in FANFOLD_NET_REACHABLE; {self.how_to_allow}")


class Route:
    """One fetch's namespace, the proxy serving it there, and what that proxy refused
    (``images.registry.Route``)."""

    def __init__(self, gate: Gate, target: str, what: str) -> None:
        self.gate, self.target, self.what = gate, target, what
        self.net = SandboxNet(id=what, policy=TrustedPolicy(open=True, trusted=gate.listed))
        self.proxy = Proxy(gate.resolver, gate.reachable, connect_timeout=gate.connect_timeout,
                           idle_timeout=gate.idle_timeout)
        self.netns_fd = -1
        self.fds: dict[int, int] = {}
        self.servers: list[asyncio.Server] = []

    @property
    def proxy_url(self) -> str:
        """The proxy, as the tool inside the namespace reaches it."""
        return f"http://127.0.0.1:{PROXY_PORT}"

    async def open(self) -> None:
        self.netns_fd = await asyncio.to_thread(netns.new_netns)
        forwards = [(address, port) for host, port in self.gate.listed if _is_loopback(host)
                    for address in ["127.0.0.1" if host == "localhost" else host]
                    for port in ([port] if port else DEFAULT_PORTS)]
        wanted: list[netns.Binding] = [(socket.SOCK_STREAM, 128, ("127.0.0.1", PROXY_PORT))]
        wanted += [(socket.SOCK_STREAM, 128, target) for target in forwards]
        made = await asyncio.to_thread(netns.sockets_in_netns, self.netns_fd, wanted,
                                       f"opening the proxy of {self.what}")
        self.servers.append(await asyncio.start_server(lambda r, w: self.proxy.handle(r, w, self.net), sock=made[0]))
        for sock, target in zip(made[1:], forwards):
            self.servers.append(await asyncio.start_server(partial(self._forward, target), sock=sock))
        self.fds = {NETNS_FD: self.netns_fd}

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        self.proxy.cut(self.net)
        await asyncio.gather(*self.net.open, return_exceptions=True)
        if self.netns_fd >= 0:
            os.close(self.netns_fd)
            self.netns_fd = -1

    def explain(self, err: FanfoldError) -> FanfoldError:
        """The error the failed fetch raises (``Gate.explain``)."""
        return self.gate.explain(self, err)

    def command(self, argv: list[str]) -> list[str]:
        return ["nsenter", f"--net=/proc/self/fd/{NETNS_FD}", "--", *argv]

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` pointed at the proxy, for every tool: curl reads only the lowercase ``http_proxy``."""
        kept = {k: v for k, v in env.items() if k.lower() not in ("http_proxy", "https_proxy", "no_proxy", "all_proxy")}
        url = self.proxy_url
        return {**kept, "HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url}

    async def _forward(self, target: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.proxy.held(self.net, self._splice(target, reader, writer))

    async def _splice(self, target: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection to a listed loopback host, passed to it on the host."""
        stats = self.net.stats
        stats.connections += 1
        upstream = None
        try:
            async with asyncio.timeout(self.proxy.connect_timeout):
                up_reader, upstream = await asyncio.open_connection(*target)
            idle, ends = Idle(self.proxy.idle_timeout), (upstream, writer)
            async with idle.watched(stats, lambda: [end.transport.abort() for end in ends]):
                await asyncio.gather(copy(reader, upstream, stats, up=True, idle=idle),
                                     copy(up_reader, writer, stats, up=False, idle=idle))
        except (OSError, TimeoutError):
            stats.errors += 1
        finally:
            for end in (upstream, writer):
                if end is not None:
                    end.close()
