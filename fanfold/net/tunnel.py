"""A CONNECT tunnel passed through: bytes both ways, unchanged, after the ClientHello's server name is
checked against the CONNECT (and against the policy's deny rules for a tunnel to an address)."""

from __future__ import annotations

import asyncio
from typing import Any

from .egress import Egress
from .heads import joined
from .policy import NetworkPolicy, as_address
from .session import HELLO_TIMEOUT, Upstream
from .state import CHUNK, Idle, copy
from .tls import MalformedHello, client_hello_sni, is_tls_handshake, read_client_hello


class Tunnel(Egress):
    """Splices a session's client to its upstream."""

    def _sni_refusal(self, policy: NetworkPolicy, upstream: Upstream, hello: bytes) -> str | None:
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

    async def _splice(self, upstream: Upstream, first_up: bytes, first_down: bytes, check_hello: Any = None) -> None:
        """Pass bytes both ways until both ends are done, starting with the bytes already read from either
        end; a ClientHello that starts the upstream bytes is checked by ``check_hello`` (a reason refuses it).
        A tunnel that moves no byte either way for the proxy's ``idle_timeout`` is closed."""
        idle = Idle(self.proxy.idle_timeout)
        async with idle.watched(self.stats, lambda: self._end_tunnel(upstream)):
            await self._spliced(upstream, first_up, first_down, check_hello, idle)

    def _end_tunnel(self, upstream: Upstream) -> None:
        self.writer.transport.abort()
        upstream.writer.transport.abort()

    async def _spliced(self, upstream: Upstream, first_up: bytes, first_down: bytes, check_hello: Any,
                       idle: Idle) -> None:
        if first_down:
            self.writer.write(first_down)
            self.stats.bytes_down += len(first_down)
        self.tunnel.append(asyncio.create_task(self._pump(upstream.reader, self.writer, up=False, idle=idle)))
        first = first_up or await self.reader.read(CHUNK)
        idle.touch()
        if check_hello is not None and first and is_tls_handshake(first):
            try:
                first = await read_client_hello(self.reader, first, HELLO_TIMEOUT)
            except MalformedHello as err:
                first = b""
                reason = f"unreadable TLS ClientHello: {err}"
            else:
                reason = check_hello(first)
            if reason is not None:
                self.stats.deny(f"TLS to {joined(upstream.host, upstream.port)}", reason)
                self.refused = True
                return
        if first:
            upstream.writer.write(first)
            self.stats.bytes_up += len(first)
            self.tunnel.append(asyncio.create_task(self._pump(self.reader, upstream.writer, up=True, idle=idle)))
        elif upstream.writer.can_write_eof():
            upstream.writer.write_eof()
        if not all(await asyncio.gather(*self.tunnel)) and not idle.fired:
            raise ConnectionResetError("one end of the tunnel broke off")

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, up: bool,
                    idle: Idle | None = None) -> bool:
        """Copy until EOF, then half-close; False (and both ends torn down) when either end breaks."""
        if not await copy(reader, writer, self.stats, up=up, idle=idle):
            self.writer.transport.abort()
            if self.upstream is not None:
                self.upstream.writer.transport.abort()
            return False
        return True
