"""Where a server tenant's image pulls may go: the registries the operator allows, under the egress
proxy's address rules.

A tenant names the registry in its reference, and skopeo then goes wherever that registry sends it
(blob downloads redirect to other hosts; a manifest may list a layer's URLs). So a tenant's skopeo
runs in a network namespace of its own holding only loopback, where its one way out is the egress
proxy (``proxy.Proxy``, served here for the pull) under a ``PullPolicy``: a registry the operator
lists is reached at whatever address it has (the operator vouches for it), any other host only at a
public address or in ``net_reachable``, checked on the address actually connected to (no DNS
rebinding), on every redirect. Go never sends loopback (``localhost``, 127/8, ``::1``) through a proxy,
so a listed registry there gets a forwarder at its own address inside the namespace; any other
loopback address finds nothing there.

With no registries listed, a tenant may pull from any registry at a public address.
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

from ..errors import FanfoldError, InvalidRequest, RegistryUnavailable
from ..host import netns
from .policy import Address, NetworkPolicy, Reachable, as_address, normal_host
from .proxy import Proxy
from .resolve import Resolver
from .state import Idle, SandboxNet, copy

PROXY_PORT = 3128
"""Where skopeo finds the proxy inside the pull's namespace."""
NETNS_FD = 3
"""The descriptor nsenter reads the pull's namespace from."""
REGISTRY_PORTS = (443, 80)
"""The ports of a registry written without one (HTTPS, or plain HTTP when it is insecure)."""
HOW_TO_ALLOW = ("the operator lists the registries tenants may pull from with `fanfold serve --registry HOST[:PORT]`"
                " (repeatable) or FANFOLD_TENANT_REGISTRIES=HOST[:PORT],...")
_REGISTRY = re.compile(r"^(?:\[(?P<v6>[0-9a-fA-F:]+)\]|(?P<host>[A-Za-z0-9.-]+))(?::(?P<port>\d{1,5}))?$")


def split_registry(text: str) -> tuple[str, int | None]:
    """``host[:port]`` (``[v6]:port``) as (lowercase host, port or None); InvalidRequest when it is not one."""
    found = _REGISTRY.match(text.strip())
    port = int(found["port"]) if found and found["port"] else None
    if found is None or (port is not None and not 0 < port < 65536):
        raise InvalidRequest(f"{text!r} is not a registry: write HOST[:PORT], e.g. registry.example.com or"
                             " 10.1.2.3:5000")
    return normal_host(found["v6"] or found["host"]), port


def _is_loopback(host: str) -> bool:
    address = as_address(host)
    return host == "localhost" or (address is not None and address.is_loopback)


@dataclass(frozen=True)
class PullPolicy(NetworkPolicy):
    """Any public address, and the operator's registries wherever they are."""

    trusted: tuple[tuple[str, int | None], ...] = ()
    """(host, port or None) of the registries the operator lists."""

    def trusts(self, host: str, port: int) -> bool:
        name = normal_host(host)
        return any(name == known and (port == known_port if known_port else port in REGISTRY_PORTS)
                   for known, known_port in self.trusted)

    def decide(self, host: str, port: int, address: Address, reachable: Reachable) -> str | None:
        return None if self.trusts(host, port) else super().decide(host, port, address, reachable)


class PullGate:
    """The registries server tenants may pull from, and the way out each of their pulls takes."""

    def __init__(self, registries: Iterable[str] = (), *, reachable: Iterable[str] = (),
                 hosts: dict[str, list[str]] | None = None, nameservers: Iterable[str] = (),
                 connect_timeout: float = 10.0, idle_timeout: float | None = None) -> None:
        self.registries = tuple(dict.fromkeys(split_registry(text) for text in registries))
        self.reachable = Reachable(reachable)
        self.resolver = Resolver(hosts=hosts, nameservers=tuple(nameservers))
        self.connect_timeout, self.idle_timeout = connect_timeout, idle_timeout

    def check(self, registry: str) -> None:
        """InvalidRequest, naming the registry and how the operator allows it, when a tenant may not pull from it."""
        host, port = split_registry(registry)
        if self.registries:
            if (host, port) not in self.registries:
                listed = ", ".join(f"{h}:{p}" if p else h for h, p in self.registries)
                raise InvalidRequest(f"this server's tenants pull only from the registries its operator allows"
                                     f" ({listed}), and {registry} is not one: {HOW_TO_ALLOW}")
            return
        address = as_address(host)
        why = "a loopback name" if host == "localhost" else \
            self.reachable.refuses(address) if address is not None else None
        if why is not None:
            raise InvalidRequest(f"registry {registry} is {why}: this server's tenants pull only from registries at"
                                 f" public addresses unless the operator allows one; {HOW_TO_ALLOW}")

    @contextlib.asynccontextmanager
    async def route(self, registry: str) -> AsyncIterator[PullRoute]:
        """The way out of one tenant pull from ``registry`` (checked first), open for the block."""
        self.check(registry)
        route = PullRoute(self, registry)
        try:
            await route.open()
            yield route
        finally:
            await route.close()


class PullRoute:
    """One tenant pull's namespace, the proxy serving it there, and what that proxy refused
    (``images.registry.Route``)."""

    def __init__(self, gate: PullGate, registry: str) -> None:
        self.gate, self.registry = gate, registry
        self.net = SandboxNet(id=f"pull from {registry}", policy=PullPolicy(open=True, trusted=gate.registries))
        self.proxy = Proxy(gate.resolver, gate.reachable, connect_timeout=gate.connect_timeout,
                           idle_timeout=gate.idle_timeout)
        self.netns_fd = -1
        self.fds: dict[int, int] = {}
        self.servers: list[asyncio.Server] = []

    async def open(self) -> None:
        self.netns_fd = await asyncio.to_thread(netns.new_netns)
        forwards = [(address, port) for host, port in self.gate.registries if _is_loopback(host)
                    for address in ["127.0.0.1" if host == "localhost" else host]
                    for port in ([port] if port else REGISTRY_PORTS)]
        wanted: list[netns.Binding] = [(socket.SOCK_STREAM, 128, ("127.0.0.1", PROXY_PORT))]
        wanted += [(socket.SOCK_STREAM, 128, target) for target in forwards]
        made = await asyncio.to_thread(netns.sockets_in_netns, self.netns_fd, wanted,
                                       f"opening the proxy of a pull from {self.registry}")
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

    def command(self, argv: list[str]) -> list[str]:
        return ["nsenter", f"--net=/proc/self/fd/{NETNS_FD}", "--", *argv]

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        url = f"http://127.0.0.1:{PROXY_PORT}"
        kept = {k: v for k, v in env.items() if k.lower() not in ("http_proxy", "https_proxy", "no_proxy", "all_proxy")}
        return {**kept, "HTTP_PROXY": url, "HTTPS_PROXY": url}

    def explain(self, err: FanfoldError) -> FanfoldError:
        """The error a failed pull raises: a refusal of the proxy's, named, over what skopeo made of it."""
        if self.net.stats.recent_denials:
            return InvalidRequest(
                f"a pull from {self.registry} was refused: it went to {self.net.stats.recent_denials[-1]}. A tenant's"
                " pull reaches the registries the operator allows at any address, and any other host (a redirect, a"
                f" layer's URL) only at a public address or one in FANFOLD_NET_REACHABLE; {HOW_TO_ALLOW}")
        if isinstance(err, RegistryUnavailable) and self.net.stats.bytes_down == 0:  # the proxy's 502s alone
            return RegistryUnavailable(f"{self.registry} could not be reached (no address, or nothing answered);"
                                       f" nothing was kept, try again ({err})", reached=False)
        return err

    async def _forward(self, target: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.proxy.held(self.net, self._splice(target, reader, writer))

    async def _splice(self, target: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection to a listed loopback registry, passed to it on the host."""
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
