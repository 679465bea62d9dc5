"""One HTTP request forwarded: its target read (absolute form, or origin form inside a terminated
tunnel), the request passed on upstream with its body streamed, and the answer streamed back, each
copied to the recording's and the cache's taps; upgrades (WebSocket) go on as a raw tunnel after a 101.
Stored answers (the cache's, a recording's) are sent from here too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h11

from .heads import (
    NOT_STORED, USE_THE_PROXY, BadRequest, Target, check_host_header, forwardable, origin_form, phrase,
    split_absolute, upgrade_of,
)
from .record import Spool, Taps
from .session import ClientGone, Refused, Upstream
from .state import CHUNK
from .tunnel import Tunnel


class Forwarding(Tunnel):
    """Passes HTTP requests on and streams their answers back."""

    def _target(self, request: h11.Request) -> Target:
        text = request.target.decode("latin-1")
        if self.origin is not None:  # inside a terminated tunnel: origin-form, to the CONNECT's host
            if not text.startswith("/"):
                raise BadRequest(f"inside a CONNECT tunnel requests are origin-form (/path), not {text[:200]!r}")
            host, port = self.origin
            check_host_header(request, host, port, default_port=443)
            return Target("https", host, port, text.partition("#")[0])
        if text.startswith("/") or text == "*":
            raise BadRequest(f"origin-form request {text[:200]!r}. {USE_THE_PROXY}")
        host, port, path = split_absolute(text)
        check_host_header(request, host, port)
        return Target("http", host, port, path)

    async def _pass_on(self, request: h11.Request, target: Target, what: str, upgrade: bytes | None,
                       taps: Taps, body: Spool | None = None) -> None:
        """Forward the request (its body from the client, or ``body`` when already read) and stream the
        answer back, copying both to ``taps``."""
        head = origin_form(request, target, upgrade)
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
            headers = forwardable(response.headers, None, 0, upgrade_of(response.headers) or upgrade)
            self._send_down(h11.InformationalResponse(status_code=101, reason=response.reason, headers=headers))
            await self._splice(upstream, bytes(self.http.trailing_data[0]), bytes(upstream.http.trailing_data[0]))
            return
        await self._stream_response(upstream, response, taps)

    async def _upstream_for(self, what: str, target: Target) -> tuple[Upstream, bool]:
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

    async def _stream_request_body(self, upstream: Upstream, taps: Taps) -> int:
        """Pass the client's request body on; how many body bytes that was."""
        sent = 0
        while True:
            try:
                event = await self._client_event()
            except h11.RemoteProtocolError as err:
                self._drop_upstream()
                raise BadRequest(f"malformed request body: {err}") from None
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
                raise ClientGone("the client closed inside its request body")

    async def _send_spool(self, upstream: Upstream, body: Spool) -> int:
        body.handle.seek(0)
        while data := body.handle.read(CHUNK):
            self._send_up(upstream, h11.Data(data=data))
            await upstream.writer.drain()
        self._send_up(upstream, h11.EndOfMessage())
        await upstream.writer.drain()
        return body.size

    async def _read_body(self, request: h11.Request, taps: Taps | None = None, *, keep: bool = False) -> Spool:
        """The client's whole request body, with its digest; its bytes kept (``keep``: to send on) up to
        the proxy's ``spool_limit``, past which the request is refused with a 413."""
        limit = self.proxy.spool_limit
        declared = next((value for name, value in request.headers if name == b"content-length"), b"0")
        if keep and int(declared) > limit:
            await self._too_large(limit)
        if self.http.they_are_waiting_for_100_continue:
            self.writer.write(self.http.send(h11.InformationalResponse(status_code=100, headers=[])))
        body = Spool(self.proxy.spool_dir, keep=keep, limit=limit)
        try:
            while True:
                try:
                    event = await self._client_event()
                except h11.RemoteProtocolError as err:
                    raise BadRequest(f"malformed request body: {err}") from None
                if isinstance(event, h11.Data):
                    body.write(event.data)
                    if keep and body.size > limit:
                        await self._too_large(limit)
                    if taps is not None:
                        taps.request_data(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return body
                else:
                    raise ClientGone("the client closed inside its request body")
        except BaseException:
            body.handle.close()
            raise

    async def _too_large(self, limit: int) -> None:
        self.stats.errors += 1
        await self._respond(413, f"fanfold: a replay that may go out live keeps the request body to send on, and"
                                 f" this one is over {limit >> 20} MiB: send a smaller body, or record and replay"
                                 " without \"live\"\n", close=True)
        raise Refused

    async def _response_head(self, upstream: Upstream) -> h11.Response | h11.InformationalResponse:
        """The upstream's response head (or its 101), passing other 1xx responses on to the client."""
        while True:
            event = await self._upstream_event(upstream)
            if isinstance(event, h11.Response) or (isinstance(event, h11.InformationalResponse)
                                                   and event.status_code == 101):
                return event
            if not isinstance(event, h11.InformationalResponse):
                raise ConnectionResetError("the upstream closed without answering")
            self._send_down(event)

    async def _upstream_event(self, upstream: Upstream) -> Any:
        while (event := upstream.http.next_event()) is h11.NEED_DATA:
            upstream.http.receive_data(await upstream.reader.read(CHUNK))
        return event

    async def _stream_response(self, upstream: Upstream, response: h11.Response, taps: Taps) -> None:
        headers = forwardable(response.headers, None, 0, None)
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
        elif taps.refused:
            self.stats.deny(f"{taps.method} {taps.url[:200]}", taps.refused)

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
            reason = phrase(status)
            self._send_down(h11.Response(status_code=status, reason=reason, headers=fields))
            taps.response(status, fields)
            while not bodiless and (data := handle.read(CHUNK)):
                self._send_down(h11.Data(data=data))
                taps.response_data(data)
                await self.writer.drain()
        self._send_down(h11.EndOfMessage())
        self._commit(taps)
        await self.writer.drain()
