"""Transparent capture, for tools that ignore proxy variables (``network={"allow": [...], "transparent": True}``).

In such a sandbox's namespace the engine sets a default route into a veth pair that stays inside it,
and nftables rules there send every TCP connection to a second listener and every DNS query to a
UDP socket, both held by netd (``fanfold.host.netns.capture_in``). The sandbox resolves names with
netd's answers (allowed names only: a name the policy refuses does not resolve, so DNS carries
nothing out), connects where it likes, and netd reads the connection's original destination
(``SO_ORIGINAL_DST``), learns the name it meant from the TLS server name or the HTTP ``Host``, and
checks that name against the policy as the proxy checks a CONNECT, connecting to the address it
resolved itself. A connection that names nothing (raw TCP) is judged by its address alone. TLS
passes through unbroken: record, replay and cache need the proxy variables.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

from .policy import Address, as_address
from .proxy import Proxy
from .resolve import LookupFailed
from .state import Idle, SandboxNet, copy
from .tls import MalformedHello, client_hello_sni, is_tls_handshake, read_client_hello

SO_ORIGINAL_DST = 80
FIRST_BYTES_TIMEOUT_S = 1.0
"""How long a connection may stay silent before it is judged by its address (the server may speak first)."""
CHUNK = 1 << 20
DNS_TTL = 30
MAX_PENDING_QUERIES = 64


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a redirected IPv4 connection was headed (conntrack's record of it)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


def host_header(head: bytes) -> str | None:
    """The Host of a plain HTTP request's head, without the port."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"host":
            text = value.strip().decode("latin-1")
            return text.rsplit(":", 1)[0] if text.count(":") == 1 else text
        if not line:
            break
    return None


async def serve(proxy: Proxy, net: SandboxNet, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One captured connection: name it, check it, connect and splice; close on a refusal."""
    stats = net.stats
    stats.connections += 1
    upstream: asyncio.StreamWriter | None = None
    try:
        address, port = original_destination(writer.get_extra_info("socket"))
        try:
            first = await asyncio.wait_for(reader.read(CHUNK), FIRST_BYTES_TIMEOUT_S)
        except asyncio.TimeoutError:
            first = b""
        name = None
        if first and is_tls_handshake(first):
            try:
                first = await read_client_hello(reader, first, FIRST_BYTES_TIMEOUT_S)
                name = client_hello_sni(first)
            except (MalformedHello, asyncio.TimeoutError):
                stats.deny(f"TLS to {address}:{port}", "a malformed or incomplete ClientHello")
                return
        elif first[:16].split(b" ", 1)[0].isalpha() and b"\r\n" in first:
            name = host_header(first)
        kind = "TLS" if first and is_tls_handshake(first) else "TCP"
        what = f"{kind} {name or address}:{port} (to {address})"
        stats.requests += 1
        target = await _decide(proxy, net, name or address, port, what)
        if target is None:
            return
        up_reader, upstream = await asyncio.wait_for(asyncio.open_connection(str(target), port),
                                                     proxy.connect_timeout)
        if first:
            upstream.write(first)
            stats.bytes_up += len(first)
        idle, ends = Idle(proxy.idle_timeout), (upstream, writer)
        async with idle.watched(stats, lambda: [end.transport.abort() for end in ends]):
            await asyncio.gather(_pump(reader, upstream, net, idle, up=True), _pump(up_reader, writer, net, idle, up=False))
    except (OSError, asyncio.TimeoutError, LookupFailed):
        stats.errors += 1
    finally:
        for end in (upstream, writer):
            if end is not None:
                end.close()


async def _decide(proxy: Proxy, net: SandboxNet, host: str, port: int, what: str) -> Address | None:
    """The address to connect to for ``host`` (resolved here, never the sandbox's idea), or None when refused."""
    policy = net.policy
    if (reason := policy.precheck(host, port)) is not None:
        net.stats.deny(what, reason)
        return None
    literal = as_address(host)
    addresses = [literal] if literal is not None else await proxy.resolver.resolve(host)
    reasons = []
    for candidate in addresses:
        reason = policy.decide(host, port, candidate, proxy.reachable)
        if reason is None:
            return candidate
        reasons.append(reason)
    net.stats.deny(what, reasons[0] if reasons else f"{host} has no address")
    return None


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, net: SandboxNet, idle: Idle, *,
                up: bool) -> None:
    if not await copy(reader, writer, net.stats, up=up, idle=idle):
        writer.close()


class DnsAnswerer(asyncio.DatagramProtocol):
    """Answers a captured sandbox's DNS queries: allowed names with the addresses netd resolves for
    them, every other name NXDOMAIN (so queries carry nothing out)."""

    def __init__(self, proxy: Proxy, net: SandboxNet) -> None:
        self.proxy, self.net = proxy, net
        self.transport: asyncio.DatagramTransport | None = None
        self.pending: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if len(self.pending) >= MAX_PENDING_QUERIES:
            self.net.stats.errors += 1  # a flood: dropped, as a busy resolver would
            return
        task = asyncio.ensure_future(self._answer(data, addr))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _answer(self, data: bytes, addr: Any) -> None:
        try:
            query = dns.message.from_wire(data)
        except Exception:  # noqa: BLE001 - not DNS: dropped, as a resolver would
            self.net.stats.errors += 1
            return
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.RA
        for question in query.question:
            name = question.name.to_text(omit_final_dot=True).lower()
            kind = {dns.rdatatype.A: 4, dns.rdatatype.AAAA: 6}.get(question.rdtype)
            reason = self.net.policy.resolvable(name)
            if reason is not None:
                self.net.stats.deny(f"DNS {name}", reason)
                reply.set_rcode(dns.rcode.NXDOMAIN)
                continue
            if kind is None:
                continue  # an allowed name, a type we do not answer: empty
            try:
                found = [a for a in await self.proxy.resolver.resolve(name) if a.version == kind]
            except LookupFailed:
                reply.set_rcode(dns.rcode.NXDOMAIN)
                continue
            if found:
                reply.answer.append(dns.rrset.from_text_list(question.name, DNS_TTL, "IN", question.rdtype,
                                                             [str(a) for a in found]))
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(reply.to_wire(), addr)

    def close(self) -> None:
        for task in self.pending:
            task.cancel()
        if self.transport is not None:
            self.transport.close()
