"""Connections out under the sandbox's policy: the checks of the filtering proxy on a name and on each
address it resolves to, the connection to the first allowed one, and TLS to it when asked."""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
from pathlib import Path

from .heads import joined
from .policy import NetworkPolicy, as_address
from .resolve import LookupFailed
from .session import Session, Upstream

UPSTREAM_BUFFER = 1 << 18


def upstream_context(cafile: str | Path | None = None) -> ssl.SSLContext:
    """The TLS client context for upstreams: the system's CAs (and ``cafile``'s), HTTP/1.1 only."""
    context = ssl.create_default_context()
    if cafile:
        context.load_verify_locations(cafile=str(cafile))
    context.set_alpn_protocols(["http/1.1"])
    return context


def _default_upstream_context() -> ssl.SSLContext:
    global _UPSTREAM_CONTEXT
    if _UPSTREAM_CONTEXT is None:
        _UPSTREAM_CONTEXT = upstream_context()
    return _UPSTREAM_CONTEXT


_UPSTREAM_CONTEXT: ssl.SSLContext | None = None


class Egress(Session):
    """Opens a session's upstreams, and admits the requests answered without one, under the sandbox's policy."""

    async def _open(self, what: str, host: str, port: int, policy: NetworkPolicy, tls: bool = False) -> Upstream:
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
                        connected = Upstream(host, port, address, reader, writer, tls=tls)
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
            await self._fail(what, f"TLS with {joined(host, port)} failed: {err or 'timed out'}")

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
