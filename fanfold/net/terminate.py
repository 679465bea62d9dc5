"""A CONNECT whose TLS the proxy ends itself (the policy records, replays or caches): the ClientHello's
name is checked, and the handshake completed with a leaf of the fleet's CA; the HTTPS requests inside
are then served like plain ones."""

from __future__ import annotations

import h11

from .ca import TLSServerStream
from .egress import Egress
from .heads import joined
from .policy import NetworkPolicy
from .session import HELLO_TIMEOUT, ClientGone, Refused
from .state import CHUNK
from .tls import MalformedHello, client_hello_sni, is_tls_handshake, read_client_hello


class Terminating(Egress):
    """Ends a CONNECT's TLS in the proxy."""

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
            raise ClientGone("the client closed its tunnel before TLS")
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
            self.stats.deny(f"TLS to {joined(host, port)}", reason)
            self.refused = True
            raise Refused
        stream = TLSServerStream(self.reader, self.writer, self.proxy.leaves(host), first)
        await stream.handshake(HELLO_TIMEOUT)
        self.reader = self.writer = stream  # type: ignore[assignment]
        self.http = h11.Connection(h11.SERVER)
        self.origin = (host, port)
        self.closing = False
