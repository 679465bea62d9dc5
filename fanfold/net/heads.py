"""Request heads as the proxy reads and forwards them: request targets and authorities, the Host check,
and the headers that stay behind (hop-by-hop, framing). No I/O."""

from __future__ import annotations

import http
from dataclasses import dataclass
from typing import Any

import h11

from .policy import as_address, normal_host
from .record import normal_url

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authorization", b"proxy-authenticate",
                        b"proxy-connection", b"te", b"trailer", b"upgrade", b"expect"})
FRAMING = frozenset({b"host", b"content-length", b"transfer-encoding"})
NOT_STORED = HOP_BY_HOP | {b"content-length", b"transfer-encoding"}
"""Headers a stored response is sent without: its length comes from the body on disk."""
USE_THE_PROXY = ("This is fanfold's egress proxy: send requests through it with the proxy variables"
                 " (HTTP_PROXY/HTTPS_PROXY), not to it as a server.\n")


class BadRequest(Exception):
    """A request the proxy answers with 400; the message says why."""


@dataclass(frozen=True)
class Target:
    """Where a request goes: scheme, host, port and the origin-form path (with its query)."""

    scheme: str
    host: str
    port: int
    path: str

    @property
    def url(self) -> str:
        return normal_url(self.scheme, self.host, self.port, self.path)

    @property
    def tls(self) -> bool:
        return self.scheme == "https"


def origin_form(request: h11.Request, target: Target, upgrade: bytes | None) -> h11.Request:
    """The request as it goes upstream: origin-form, without hop-by-hop headers, with a Host."""
    return h11.Request(method=request.method, target=target.path.encode(),
                       headers=forwardable(request.headers, target.host, target.port, upgrade,
                                            default_port=443 if target.tls else 80))


def phrase(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def header_text(text: str) -> str:
    """``text`` as a header value: printable ASCII on one line, bounded."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:512]


def joined(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_authority(text: str, *, default_port: int | None) -> tuple[str, int]:
    """``host[:port]`` or ``[v6][:port]`` as (normal host, port); BadRequest when malformed."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise BadRequest(f"malformed authority {text[:200]!r}")
        number = rest[1:] if rest else None
        if as_address(host) is None:
            raise BadRequest(f"{host[:200]!r} in brackets is not an IPv6 address")
    elif ":" in text:
        host, _, number = text.rpartition(":")
    else:
        host, number = text, None
    if number is None or number == "":
        if default_port is None:
            raise BadRequest(f"{text[:200]!r} names no port: CONNECT takes host:port")
        port = default_port
    elif number.isdigit() and 0 < int(number) < 65536:
        port = int(number)
    else:
        raise BadRequest(f"{text[:200]!r} has a bad port")
    host = normal_host(host)
    name_like = host.isascii() and all(c.isalnum() or c in "-._" for c in host)
    if not host or not (name_like or as_address(host) is not None):
        raise BadRequest(f"{text[:200]!r} names no valid host")
    return host, port


def split_absolute(target: str) -> tuple[str, int, str]:
    """An absolute-form ``http://`` target as (host, port, origin-form path)."""
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() != "http":
        raise BadRequest(f"cannot forward {target[:200]!r}: only http:// URLs go as plain requests;"
                          " https:// goes through CONNECT (HTTPS_PROXY)")
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:].partition("#")[0]
    if "@" in authority:
        raise BadRequest("URLs with user information (user@host) are not forwarded")
    host, port = split_authority(authority, default_port=80)
    return host, port, path if path.startswith("/") else "/" + path


def check_host_header(request: h11.Request, host: str, port: int, default_port: int = 80) -> None:
    values = [value for name, value in request.headers if name == b"host"]
    if not values:
        return  # HTTP/1.0: the URL alone names the place
    named = split_authority(values[0].decode("latin-1"), default_port=default_port)
    if named != (host, port):
        raise BadRequest(f"the Host header names {joined(*named)} but the URL names {joined(host, port)}")


def upgrade_of(headers: Any) -> bytes | None:
    """The protocol a request asks to upgrade to (``Connection: upgrade`` + ``Upgrade``), or None."""
    tokens = {t.strip().lower() for name, value in headers if name == b"connection" for t in value.split(b",")}
    values = [value for name, value in headers if name == b"upgrade"]
    return values[0] if b"upgrade" in tokens and values else None


def forwardable(headers: Any, host: str | None, port: int, upgrade: bytes | None,
                 default_port: int = 80) -> list[tuple[bytes, bytes]]:
    """``headers`` without hop-by-hop ones (those the Connection header lists too); a Host added when a
    request has none; Connection/Upgrade put back for an upgrade."""
    listed = {t.strip().lower() for name, value in headers if name == b"connection" for t in value.split(b",")}
    listed -= FRAMING  # a Connection header cannot take away what frames the message
    kept = [(name, value) for name, value in headers.raw_items()
            if name.lower() not in HOP_BY_HOP and name.lower() not in listed]
    if any(name.lower() == b"transfer-encoding" for name, _ in kept):
        # h11 framed it by Transfer-Encoding: a Content-Length beside it would let the upstream read it otherwise
        kept = [(name, value) for name, value in kept if name.lower() != b"content-length"]
    if host is not None and not any(name.lower() == b"host" for name, _ in kept):
        kept.insert(0, (b"Host", (host if port == default_port else joined(host, port)).encode()))
    if upgrade is not None:
        kept += [(b"Connection", b"upgrade"), (b"Upgrade", upgrade)]
    return kept
