"""envd's filesystem on fanfold: the ``filesystem.Filesystem`` service (Stat, ListDir, MakeDir, Move,
Remove) over Connect, and ``GET``/``POST /files`` for contents, in both upload encodings.

Contents, listings and removal use the engine's file API (as the sandbox's root); ``MakeDir`` and
``Move``, which it lacks, run ``mkdir``/``mv`` as argv lists (as the call's user). An upload for a
user other than root makes the file's missing parents as that user and hands the file to it. Stat reads the
parent directory's listing, so an entry's ``owner`` and ``group`` are left empty. Watching
(``WatchDir``, ``CreateWatcher``...) answers ``unimplemented``.
"""

from __future__ import annotations

import posixpath
import zlib
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.datastructures import UploadFile

from ...errors import FanfoldError, FileNotFoundInSandbox
from .connect import RpcError, field as message_field, rpc_error, timestamp
from .entries import entry_info
from .envd import Call, EnvdRoute, Streaming, Unary, call_of, serve_rpc
from .watch import create_watcher, get_watcher_events, remove_watcher, watch_dir

TOOL_TIMEOUT_S = 60.0
MAX_DEPTH = 32
UPLOAD_CHUNK = 1024 * 1024

router = APIRouter(prefix="/envd", route_class=EnvdRoute, tags=["e2b"])


@router.post("/filesystem.Filesystem/{method}")
async def filesystem_service(method: str, request: Request) -> Response:
    """filesystem.Filesystem: Stat, ListDir, MakeDir, Move, Remove and the watchers."""
    return await serve_rpc(request, "filesystem.Filesystem", method, UNARY, STREAMS)


MAX_MULTIPART = 256 * 1024 * 1024
"""Largest multipart upload: its parts are spooled on the host (octet-stream uploads stream, uncapped)."""


@router.get("/files")
async def download(request: Request, path: str = Query(...)) -> Response:
    """A file's bytes, streamed."""
    call = await call_of(request)
    stream = await call.engine.open_file(call.sandbox_id, path)
    return StreamingResponse(stream, media_type="application/octet-stream", background=BackgroundTask(stream.aclose))


@router.post("/files")
async def upload(request: Request, path: str | None = Query(None), username: str | None = Query(None)) -> Response:
    """Write files: a ``multipart/form-data`` body (parts named ``file``, each filename its path unless
    ``path`` is given) or an ``application/octet-stream`` body (gzip allowed) for ``path``; owned by
    ``username`` (the SDK's ``user=``), else the sandbox's default user."""
    call = await call_of(request)
    if username:
        call = replace(call, user=username)
    kind = request.headers.get("content-type", "").partition(";")[0].strip()
    written = []
    if kind == "multipart/form-data":
        declared = request.headers.get("content-length", "")
        if not declared.isdigit() or int(declared) > MAX_MULTIPART:
            # the form's parts are spooled on the host before they reach the sandbox: bounded here
            raise RpcError("invalid_argument", f"a multipart upload needs a Content-Length of at most"
                           f" {MAX_MULTIPART >> 20} MiB: send larger files as application/octet-stream (the SDK"
                           " does for file objects and iterables), which streams into the sandbox")
        async with request.form(max_files=1000) as form:
            parts = [part for part in form.getlist("file") if isinstance(part, UploadFile)]
            for part in parts:
                target = path if path and len(parts) == 1 else part.filename
                if not target:
                    raise RpcError("invalid_argument", "a file part without a filename needs ?path=")
                await _prepare(call, target)
                await call.engine.write_stream(call.sandbox_id, target, _part_chunks(part))
                await _hand_over(call, target)
                written.append(target)
    elif kind == "application/octet-stream":
        if not path:
            raise RpcError("invalid_argument", "an octet-stream upload needs ?path=")
        gzipped = request.headers.get("content-encoding", "").lower() == "gzip"
        chunks = _gunzip(request.stream()) if gzipped else request.stream()
        await _prepare(call, path)
        await call.engine.write_stream(call.sandbox_id, path, chunks)
        await _hand_over(call, path)
        written.append(path)
    else:
        raise RpcError("invalid_argument", f"upload files as multipart/form-data or application/octet-stream, not {kind!r}")
    return JSONResponse([{"name": posixpath.basename(p), "type": "file", "path": p} for p in written])


def _as_root(call: Call) -> bool:
    return call.user is None or call.user.partition(":")[0] in ("root", "0")


async def _prepare(call: Call, path: str) -> None:
    """For a user other than root, its missing parent directories, made as that user; an upload
    where that user may not write fails, as envd's (which writes as the user) does."""
    if _as_root(call):
        return
    check = ('d=$(dirname -- "$1") && mkdir -p -- "$d" 2>/dev/null && test -w "$d" && { ! test -e "$1" || test -w "$1"; }'
             ' || { echo "$1: Permission denied" >&2; exit 1; }')
    try:
        await _run_tool(call, ["/bin/sh", "-c", check, "sh", path])
    except RpcError as err:
        raise RpcError("permission_denied", f"{err.message} for user {call.user}") from None


async def _hand_over(call: Call, path: str) -> None:
    """A file written (as root, by the engine) for another user becomes that user's."""
    if not _as_root(call):
        assert call.user is not None
        owner = call.user if ":" in call.user else f"{call.user}:"
        await _run_tool(replace(call, user="root"), ["chown", "-h", "--", owner, path])


async def _part_chunks(part: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await part.read(UPLOAD_CHUNK):
        yield chunk


async def _gunzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        async for chunk in chunks:
            if data := inflate.decompress(chunk):
                yield data
        if tail := inflate.flush():
            yield tail
    except zlib.error:
        raise RpcError("invalid_argument", "the upload is not valid gzip") from None


# -- filesystem.Filesystem --------------------------------------------------------------------


async def stat_path(call: Call, path: str) -> dict[str, Any]:
    """The EntryInfo of ``path`` (not followed, if a symlink); not_found when there is none."""
    path = posixpath.normpath(path) if path else "."
    parent, name = posixpath.split(path)
    if name in ("", ".", ".."):
        return {"name": posixpath.basename(path) or "/", "type": "FILE_TYPE_DIRECTORY", "path": path, "size": "0",
                "mode": 0o755, "permissions": "drwxr-xr-x", "owner": "", "group": "", "modifiedTime": timestamp(0)}
    missing = RpcError("not_found", f"no such file or directory in the sandbox: {path}")
    try:
        entries = await call.engine.list_files(call.sandbox_id, parent or ".")
    except FileNotFoundInSandbox:
        raise missing from None
    for entry in entries:
        if entry.name == name:
            return entry_info(entry)
    raise missing


async def stat_request(call: Call, message: dict[str, Any]) -> dict[str, Any]:
    return {"entry": await stat_path(call, _path(message, "path"))}


async def list_dir(call: Call, message: dict[str, Any]) -> dict[str, Any]:
    """The entries under ``path``, ``depth`` levels down (1: its own entries)."""
    depth = message_field(message, "depth", int, 0) or 1
    if not 1 <= depth <= MAX_DEPTH:
        raise RpcError("invalid_argument", f"depth is from 1 to {MAX_DEPTH}")
    found: list[dict[str, Any]] = []
    level = [_path(message, "path")]
    for _ in range(depth):
        below = []
        for directory in level:
            for entry in await call.engine.list_files(call.sandbox_id, directory):
                found.append(entry_info(entry))
                if entry.type == "dir":
                    below.append(entry.path)
        level = below
    return {"entries": found}


async def make_dir(call: Call, message: dict[str, Any]) -> dict[str, Any]:
    """Make the directory and any missing parents; already_exists when it is there."""
    path = _path(message, "path")
    try:
        await stat_path(call, path)
    except RpcError as err:
        if err.code != "not_found":
            raise
    else:
        raise RpcError("already_exists", f"{path} already exists")
    await _run_tool(call, ["mkdir", "-p", "--", path])
    return {"entry": await stat_path(call, path)}


async def move(call: Call, message: dict[str, Any]) -> dict[str, Any]:
    source, destination = _path(message, "source"), _path(message, "destination")
    await stat_path(call, source)
    await _run_tool(call, ["mv", "--", source, destination])
    return {"entry": await stat_path(call, destination)}


async def remove(call: Call, message: dict[str, Any]) -> dict[str, Any]:
    """Remove a file, or a directory with all it holds."""
    await call.engine.remove_file(call.sandbox_id, _path(message, "path"), recursive=True)
    return {}


def _path(message: dict[str, Any], name: str) -> str:
    path = message_field(message, name, str, "")
    if not path:
        raise RpcError("invalid_argument", f"{name} is empty")
    return path


async def _run_tool(call: Call, argv: list[str]) -> None:
    """Run a tool of the image for what the file API lacks; its stderr is the error when it fails."""
    try:
        result = await call.engine.exec(call.sandbox_id, argv, user=call.user, timeout=TOOL_TIMEOUT_S)
    except FanfoldError as err:
        raise rpc_error(err, call.sandbox_id) from None
    if not result.ok:
        detail = result.stderr.decode(errors="replace").strip() or f"{argv[0]} failed ({result.outcome.value})"
        raise RpcError("invalid_argument", detail)


UNARY: dict[str, Unary] = {
    "Stat": stat_request, "ListDir": list_dir, "MakeDir": make_dir, "Move": move, "Remove": remove,
    "CreateWatcher": create_watcher, "GetWatcherEvents": get_watcher_events, "RemoveWatcher": remove_watcher,
}
STREAMS: dict[str, Streaming] = {"WatchDir": watch_dir}
