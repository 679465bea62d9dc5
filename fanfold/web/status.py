"""Errors to HTTP status codes: the one place the mapping lives."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .. import errors
from ..wire import error_to_json

RETRY_AFTER_S = 1
_STATUS: list[tuple[type[errors.FanfoldError], int]] = [
    (errors.Unauthorized, 401),
    (errors.PortUnreachable, 502),  # the gateway's answer: the sandbox's service, not fanfold, failed
    (errors.NotFound, 404),
    (errors.SandboxGone, 409),
    (errors.SnapshotInUse, 409),
    (errors.ImageInUse, 409),
    (errors.CapacityExceeded, 429),
    (errors.QuotaExceeded, 429),
    (errors.Retryable, 503),
    (errors.HostNotReady, 503),
    (errors.InvalidRequest, 422),
    (errors.BuildFailed, 422),
    (errors.ImageCorrupt, 422),
    (errors.ServiceFailed, 422),
    (errors.ExecTimeout, 422),
    (errors.CommandFailed, 422),
]


def status_for(err: errors.FanfoldError) -> int:
    """404 unknown, 409 wrong state, 422 bad input, 429/503 retry later, 500 only for our bugs."""
    for cls, status in _STATUS:
        if isinstance(err, cls):
            return status
    return 500


def bug_body(err: Exception) -> dict[str, str]:
    """The body of a 500: an error that is not a FanfoldError is fanfold's own bug."""
    return {"kind": "internal_error", "message": f"fanfold bug: {type(err).__name__}: {err}"}


def error_response(err: errors.FanfoldError, status: int | None = None) -> JSONResponse:
    status = status or status_for(err)
    # A quota is not lifted by waiting: no Retry-After, so clients do not retry it.
    retry = status in (429, 503) and not isinstance(err, errors.QuotaExceeded)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_to_json(err), status_code=status, headers=headers)
