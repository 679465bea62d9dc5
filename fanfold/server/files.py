"""Routes of files inside a sandbox; contents stream both ways, so memory stays bounded."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from ..wire import entry_to_json
from ..web.deps import ERRORS, engine, owned_sandbox
from ..web.schemas import FileEntryBody, WrittenBody

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/files", tags=["files"])
# Paths are checked by the engine, so a bad one is the same InvalidPath on every transport.
PathQuery = Query(description="Absolute, or relative to the image's workdir.")


@router.get("", response_model=list[FileEntryBody], responses=ERRORS)
async def list_files(request: Request, path: str = Query(".", description="A directory; absolute, or relative to the image's workdir."),
                     sandbox_id: str = Depends(owned_sandbox)) -> list[dict[str, Any]]:
    """The entries of a directory."""
    return [entry_to_json(entry) for entry in await engine(request).list_files(sandbox_id, path)]


@router.delete("", status_code=204, responses=ERRORS)
async def remove_file(request: Request, path: str = PathQuery, recursive: bool = False,
                      sandbox_id: str = Depends(owned_sandbox)) -> Response:
    await engine(request).remove_file(sandbox_id, path, recursive)
    return Response(status_code=204)


@router.get(
    "/content",
    responses={**ERRORS, 200: {"content": {"application/octet-stream": {}}, "description": "The file's bytes."}},
    response_class=StreamingResponse,
)
async def read_file(request: Request, path: str = PathQuery, sandbox_id: str = Depends(owned_sandbox)) -> StreamingResponse:
    """Stream a file out of the sandbox."""
    stream = await engine(request).open_file(sandbox_id, path)
    # Chunked, not a Content-Length: the sandbox may change the file while it streams.
    return StreamingResponse(stream, media_type="application/octet-stream", background=BackgroundTask(stream.aclose))


@router.put(
    "/content",
    response_model=WrittenBody,
    responses=ERRORS,
    openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {"schema": {
        "type": "string", "format": "binary"}}}}},
)
async def write_file(request: Request, path: str = PathQuery, mode: int = Query(0o644, ge=0, le=0o7777),
                     sandbox_id: str = Depends(owned_sandbox)) -> dict[str, int]:
    """Stream the request body into a file; it appears whole or, if the upload breaks off, not at all."""
    size = await engine(request).write_stream(sandbox_id, path, request.stream(), mode)
    return {"bytes": size}
