"""Reading the server name (SNI) a TLS client asks for, from its first handshake bytes.

The proxy never terminates TLS on the policy path: it reads the ClientHello a client sends through a
CONNECT tunnel, checks the name in it, and passes the same bytes on unchanged. The parser is strict
(a ClientHello that cannot be read whole is refused, not waved through), so a name hidden from this
parser cannot be read by the server either.
"""

from __future__ import annotations

import asyncio
import struct

HANDSHAKE = 0x16
CLIENT_HELLO = 0x01
SERVER_NAME = 0x0000
HOST_NAME = 0x00
RECORD_HEADER = 5
MAX_RECORD = (1 << 14) + 2048  # TLSCiphertext's bound; a plaintext record is at most 2**14
MAX_HELLO = 1 << 16  # a ClientHello split over records may be long (post-quantum key shares) but not longer


class MalformedHello(Exception):
    """Bytes that start like a TLS handshake but hold no well-formed ClientHello."""


def is_tls_handshake(first: bytes) -> bool:
    """Whether ``first`` (at least one byte) starts a TLS handshake record: content type 22, version 3.x."""
    return first[:1] == b"\x16" and (len(first) < 2 or first[1] == 3) and (len(first) < 3 or first[2] <= 4)


def sni_of(record: bytes) -> str | None:
    """The server_name of a TLS ClientHello (one or more records), lowercase; None when absent or not TLS."""
    try:
        return client_hello_sni(record)
    except MalformedHello:
        return None


def client_hello_sni(data: bytes) -> str | None:
    """The server_name of the ClientHello in ``data``, lowercase, None when it has none; MalformedHello when
    ``data`` is not a whole, well-formed ClientHello."""
    message = handshake_message(data)
    if message is None:
        raise MalformedHello("the ClientHello is incomplete")
    return _server_name(message)


def handshake_message(data: bytes) -> bytes | None:
    """The first handshake message carried by the records in ``data``, or None while more bytes are needed."""
    payload = bytearray()
    offset = 0
    while offset + RECORD_HEADER <= len(data):
        kind, major, _minor, length = struct.unpack_from("!BBBH", data, offset)
        if kind != HANDSHAKE or major != 3:
            raise MalformedHello("not a TLS handshake record")
        if length == 0 or length > MAX_RECORD:
            raise MalformedHello(f"a TLS record of {length} bytes")
        fragment = data[offset + RECORD_HEADER : offset + RECORD_HEADER + length]
        payload += fragment
        offset += RECORD_HEADER + length
        if len(payload) >= 4:
            if payload[0] != CLIENT_HELLO:
                raise MalformedHello("the first handshake message is not a ClientHello")
            size = int.from_bytes(payload[1:4], "big")
            if size > MAX_HELLO:
                raise MalformedHello(f"a ClientHello of {size} bytes")
            if len(payload) >= 4 + size:
                return bytes(payload[4 : 4 + size])
        if len(fragment) < length:
            return None
    return None


async def read_client_hello(reader: asyncio.StreamReader, first: bytes, timeout: float) -> bytes:
    """Every byte read until the ClientHello that ``first`` begins is whole (``first`` included), within
    ``timeout`` seconds; MalformedHello on bad bytes, an early end, too many bytes or no time left."""
    data = bytearray(first)
    try:
        async with asyncio.timeout(timeout):
            while handshake_message(bytes(data)) is None:
                if len(data) > MAX_HELLO + 4 * (RECORD_HEADER + MAX_RECORD):
                    raise MalformedHello("the ClientHello does not end")
                chunk = await reader.read(MAX_RECORD)
                if not chunk:
                    raise MalformedHello("the connection ended inside the ClientHello")
                data += chunk
    except TimeoutError:
        raise MalformedHello(f"no whole ClientHello in {timeout:g} s") from None
    return bytes(data)


def _server_name(hello: bytes) -> str | None:
    try:
        offset = 2 + 32  # legacy_version, random
        offset += 1 + hello[offset]  # session id
        offset += 2 + _u16(hello, offset)  # cipher suites
        offset += 1 + hello[offset]  # compression methods
        if offset == len(hello):
            return None  # no extensions at all (TLS 1.0 style)
        end = offset + 2 + _u16(hello, offset)
        if end != len(hello):
            raise MalformedHello("the ClientHello's extensions do not fill it")
        return _find_server_name(hello, offset + 2, end)
    except (IndexError, struct.error):
        raise MalformedHello("a truncated ClientHello") from None


def _find_server_name(hello: bytes, offset: int, end: int) -> str | None:
    name = None
    seen: set[int] = set()
    while offset < end:
        kind, size = struct.unpack_from("!HH", hello, offset)
        offset += 4
        if offset + size > end:
            raise MalformedHello("an extension runs past the ClientHello")
        if kind in seen:
            raise MalformedHello(f"extension {kind} appears twice")
        seen.add(kind)
        if kind == SERVER_NAME:
            name = _host_name(hello[offset : offset + size])
        offset += size
    return name


def _host_name(extension: bytes) -> str:
    """The single host_name of a server_name extension (RFC 6066 allows only one)."""
    if _u16(extension, 0) != len(extension) - 2 or len(extension) < 5:
        raise MalformedHello("a malformed server_name extension")
    kind, size = extension[2], _u16(extension, 3)
    if kind != HOST_NAME or 5 + size != len(extension) or size == 0:
        raise MalformedHello("server_name must hold exactly one host_name")
    raw = extension[5:]
    if not all(0x21 <= byte < 0x7F for byte in raw):
        raise MalformedHello("server_name is not a printable ASCII host name")
    return raw.decode("ascii").lower().rstrip(".")


def _u16(data: bytes, offset: int) -> int:
    return struct.unpack_from("!H", data, offset)[0]
