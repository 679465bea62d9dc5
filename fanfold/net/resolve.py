"""Name resolution for netd: fixed answers first, then named DNS servers or the system resolver.

The proxy resolves every name itself (a sandbox's own answer is never trusted) and then checks
and connects to the addresses it got, so what was checked is what is reached.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping, Sequence
from ipaddress import ip_address

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from .policy import Address, as_address, normal_host

LOOKUP_TIMEOUT = 5.0


class LookupFailed(Exception):
    """A name that did not resolve; the message says why. It never leaves netd (the client gets a 502)."""


class Resolver:
    """Resolves names to addresses: a fixed ``hosts`` map (checked first, like /etc/hosts), else the DNS
    servers in ``nameservers`` ("IP" or "IP:PORT"; "[v6]:PORT" for IPv6 with a port), else the system
    resolver."""

    def __init__(
        self, *, hosts: Mapping[str, Sequence[str]] | None = None, nameservers: Sequence[str] = ()
    ) -> None:
        self._hosts = {normal_host(name): [_address(a) for a in ([found] if isinstance(found, str) else found)]
                       for name, found in (hosts or {}).items()}
        self._dns = _dns_resolver(nameservers) if nameservers else None

    async def resolve(self, host: str) -> list[Address]:
        """The addresses of ``host``, without duplicates, in the order found; an IP literal comes back as itself."""
        literal = as_address(host)
        if literal is not None:
            return [literal]
        name = normal_host(host)
        if not name or len(name) > 253:
            raise LookupFailed(f"{host!r} is not a host name")
        if name in self._hosts:
            return list(self._hosts[name])
        found = await (self._ask_dns(name) if self._dns else self._ask_system(name))
        if not found:
            raise LookupFailed(f"{name} has no address")
        return list(dict.fromkeys(found))

    async def _ask_system(self, name: str) -> list[Address]:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(name, None, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP), LOOKUP_TIMEOUT
            )
        except (socket.gaierror, UnicodeError) as error:
            raise LookupFailed(f"{name} did not resolve: {getattr(error, 'strerror', None) or error}") from None
        except asyncio.TimeoutError:
            raise LookupFailed(f"{name} did not resolve: no answer in {LOOKUP_TIMEOUT:g} s") from None
        return [_address(info[4][0].partition("%")[0]) for info in infos]

    async def _ask_dns(self, name: str) -> list[Address]:
        answers = await asyncio.gather(self._query(name, "A"), self._query(name, "AAAA"), return_exceptions=True)
        failures = [answer for answer in answers if isinstance(answer, BaseException)]
        if len(failures) == len(answers):
            raise failures[0]
        return [address for answer in answers if not isinstance(answer, BaseException) for address in answer]

    async def _query(self, name: str, kind: str) -> list[Address]:
        assert self._dns is not None
        try:
            answer = await self._dns.resolve(name, kind, search=False)
        except dns.resolver.NoAnswer:
            return []
        except dns.resolver.NXDOMAIN:
            raise LookupFailed(f"{name} does not exist (NXDOMAIN)") from None
        except dns.exception.Timeout:
            raise LookupFailed(f"{name} did not resolve: no DNS answer in {LOOKUP_TIMEOUT:g} s") from None
        except (dns.exception.DNSException, OSError) as error:
            raise LookupFailed(f"{name} did not resolve: {error}") from None
        return [_address(record.address) for record in answer]


def _dns_resolver(nameservers: Sequence[str]) -> dns.asyncresolver.Resolver:
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [_nameserver(spec) for spec in nameservers]
    resolver.lifetime = LOOKUP_TIMEOUT
    return resolver


def _nameserver(spec: str) -> dns.nameserver.Do53Nameserver:
    """``IP``, ``IP:PORT`` or ``[IPv6]:PORT`` as a dnspython nameserver; a ValueError for anything else."""
    spec = spec.strip()
    if spec.startswith("["):
        address, _, port = spec[1:].partition("]")
        port = port.removeprefix(":")
    elif spec.count(":") == 1:
        address, _, port = spec.partition(":")
    else:
        address, port = spec, ""
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"nameserver {spec!r}: bad port")
    return dns.nameserver.Do53Nameserver(str(ip_address(address)), int(port or 53))


def _address(text: str) -> Address:
    """An address as the policy compares it (IPv4-mapped IPv6 as IPv4); ValueError when ``text`` is none."""
    address = as_address(text)
    if address is None:
        raise ValueError(f"{text!r} is not an IP address")
    return address
