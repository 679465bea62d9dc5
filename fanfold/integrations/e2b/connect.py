"""The Connect protocol's wire, JSON codec only, without I/O: envelopes, end-of-stream, errors
and the proto3-JSON forms envd's messages use (written from connectrpc.com/docs/protocol).

Unary calls: the request and the answer are plain JSON; an error is a non-200 status with
``{"code": "not_found", "message": ...}``. Server streams: the request is one envelope and the
answer a sequence of them, each a flag byte, a 4-byte big-endian length and JSON; the last has
flag 2 (end of stream) and carries ``{}`` or ``{"error": {...}}``.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from datetime import datetime, timezone
from typing import Any

from ... import errors
from ...errors import FanfoldError

STREAM_JSON = "application/connect+json"
UNARY_JSON = "application/json"
END_STREAM = 0x02
COMPRESSED = 0x01
_HEADER = struct.Struct(">BI")
MAX_MESSAGE = 16 * 1024 * 1024
"""Largest request message read: envd's requests are small (stdin goes in unary calls)."""

STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
    "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
    "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}
"""Each Connect code's HTTP status, for unary errors."""
_FROM_STATUS = {400: "internal", 401: "unauthenticated", 403: "permission_denied", 404: "unimplemented",
                429: "unavailable", 502: "unavailable", 503: "unavailable", 504: "unavailable"}


class RpcError(FanfoldError):
    """A Connect error with its code (``not_found``, ``unimplemented``, ...): what the client sees."""

    kind = "rpc_error"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code if code in STATUS else "unknown"
        self.message = message


def code_for_status(status: int) -> str:
    """The Connect code of a plain HTTP error without a Connect body (the protocol's own table)."""
    return _FROM_STATUS.get(status, "unknown")


def gone_message(sandbox_id: str) -> str:
    """What envd's proxy says of a sandbox that is not running; the SDK reads "was not found"."""
    return f"The sandbox {sandbox_id} was not found: it was killed, reached its timeout or never existed"


def rpc_error(err: FanfoldError, sandbox_id: str = "") -> RpcError:
    """fanfold's error as the Connect error an envd client expects."""
    if isinstance(err, RpcError):
        return err
    text = str(err)
    if isinstance(err, (errors.SandboxNotFound, errors.SandboxGone)):
        return RpcError("unavailable", gone_message(sandbox_id) if sandbox_id else text)
    table: list[tuple[type[FanfoldError], str]] = [
        (errors.NotFound, "not_found"),
        (errors.Unauthorized, "unauthenticated"),
        (errors.QuotaExceeded, "resource_exhausted"),
        (errors.LimitExceeded, "failed_precondition"),
        (errors.InvalidRequest, "invalid_argument"),
        (errors.ExecTimeout, "deadline_exceeded"),
        (errors.Retryable, "unavailable"),
        (errors.HostNotReady, "unavailable"),
    ]
    for cls, code in table:
        if isinstance(err, cls):
            return RpcError(code, text)
    return RpcError("internal", text)


def error_json(err: RpcError) -> dict[str, str]:
    return {"code": err.code, "message": err.message}


# -- envelopes ----------------------------------------------------------------------------


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    """One framed message of a stream."""
    payload = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(flags, len(payload)) + payload


def end_of_stream(error: RpcError | None = None) -> bytes:
    """The envelope every stream ends with: ``{}``, or the error that ended it."""
    return envelope({} if error is None else {"error": error_json(error)}, END_STREAM)


def read_envelopes(data: bytes) -> list[tuple[int, dict[str, Any]]]:
    """Every envelope of ``data`` as (flags, message); RpcError when the framing is broken."""
    found = []
    offset = 0
    while offset < len(data):
        if len(data) - offset < _HEADER.size:
            raise RpcError("invalid_argument", "a Connect envelope was cut short")
        flags, size = _HEADER.unpack_from(data, offset)
        offset += _HEADER.size
        if size > MAX_MESSAGE or offset + size > len(data):
            raise RpcError("invalid_argument", "a Connect envelope's length is past the end of the body")
        if flags & COMPRESSED:
            raise RpcError("unimplemented", "compressed Connect messages are not supported: send identity")
        found.append((flags, decode(data[offset : offset + size])))
        offset += size
    return found


def stream_request(data: bytes) -> dict[str, Any]:
    """The one message of a server-streaming call's request body."""
    messages = [message for flags, message in read_envelopes(data) if not flags & END_STREAM]
    if len(messages) != 1:
        raise RpcError("invalid_argument", f"a server-streaming call takes one message, got {len(messages)}")
    return messages[0]


def decode(payload: bytes) -> dict[str, Any]:
    """A JSON message (an object); RpcError otherwise. An empty body is the empty message."""
    if not payload.strip():
        return {}
    try:
        message = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        raise RpcError("invalid_argument", "the message is not JSON") from None
    if not isinstance(message, dict):
        raise RpcError("invalid_argument", "the message is not a JSON object")
    return message


# -- proto3 JSON --------------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: Any, what: str) -> bytes:
    """proto3 JSON bytes: standard or URL-safe base64, padding optional."""
    if not isinstance(text, str):
        raise RpcError("invalid_argument", f"{what} must be base64 text")
    try:
        return base64.urlsafe_b64decode(text.replace("+", "-").replace("/", "_") + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise RpcError("invalid_argument", f"{what} is not base64") from None


def int64(value: int) -> str:
    """proto3 JSON writes 64-bit integers as strings."""
    return str(int(value))


def timestamp(epoch: float) -> str:
    """A google.protobuf.Timestamp in proto3 JSON: RFC 3339 in UTC."""
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def enum_value(value: Any, names: dict[str, int], what: str) -> int:
    """An enum given by name (``SIGNAL_SIGKILL``) or number, as its number."""
    if isinstance(value, str) and value in names:
        return names[value]
    if isinstance(value, int) and not isinstance(value, bool) and value in names.values():
        return value
    raise RpcError("invalid_argument", f"unknown {what} {value!r}")


def field(message: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """``message[name]`` when it is a ``kind`` (absent: ``default``); RpcError when it is something else."""
    value = message.get(name, default)
    if value is default:
        return value
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RpcError("invalid_argument", f"{name} must be {kind.__name__}")
    return value
