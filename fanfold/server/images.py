"""Routes of images: list, and build from a spec (with its copy sources, when it has any)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from ..engine import Engine
from ..errors import InvalidRequest, InvalidSpec
from ..spec import EnvSpec
from ..wire import event_to_json, image_to_json, spec_from_json
from .deps import NDJSON, engine, ndjson_events, tenant
from .sandboxes import ERRORS
from .schemas import ImageBody

router = APIRouter(prefix="/v1/images", tags=["images"])
TAR = "application/x-tar"
_REMOTE_REPO = ("https://", "http://", "git://", "ssh://", "git@")


@router.get("", response_model=list[ImageBody], responses=ERRORS, dependencies=[Depends(tenant)])
async def list_images(request: Request) -> list[dict[str, Any]]:
    return [image_to_json(image) for image in await engine(request).images()]


@router.post(
    "",
    dependencies=[Depends(tenant)],
    responses={**ERRORS, 200: {"content": {NDJSON: {}}, "description":
        "NDJSON: `{\"event\": StepEvent}` lines as steps start and end, then `{\"image\": Image}` or `{\"error\": Error}`."}},
    openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"type": "object", "description": "A spec: {base, steps: [{kind, ...}]}"}},
        TAR: {"schema": {"type": "string", "format": "binary"},
              "description": "spec.json plus context/: the spec's copy and local repo sources"},
    }}},
)
async def build(request: Request) -> StreamingResponse:
    """Build a spec into an image; cached layers are reused. Progress streams as it goes."""
    fleet: Engine = engine(request)
    scratch = Path(tempfile.mkdtemp(prefix="context-", dir=fleet.config.state_dir / "bundles"))
    try:
        spec = await _read_spec(request, scratch)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def run() -> dict[str, Any]:
        try:
            image = await fleet.build(spec, lambda event: queue.put_nowait({"event": event_to_json(event)}))
            return image_to_json(image)
        finally:
            await asyncio.to_thread(shutil.rmtree, scratch, True)

    return StreamingResponse(ndjson_events(queue, asyncio.create_task(run()), "image"), media_type=NDJSON)


async def _read_spec(request: Request, scratch: Path) -> EnvSpec:
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    context = scratch / "context"
    context.mkdir()
    if kind == TAR:
        archive = scratch / "upload.tar"
        with open(archive, "wb") as handle:
            async for chunk in request.stream():
                await asyncio.to_thread(handle.write, chunk)
        await asyncio.to_thread(_extract, archive, scratch)
        try:
            data = json.loads((scratch / "spec.json").read_text())
        except (OSError, ValueError):
            raise InvalidRequest("the build archive needs a spec.json holding the spec as JSON") from None
    elif kind in ("application/json", ""):
        try:
            data = json.loads(await request.body())
        except ValueError:
            raise InvalidRequest("the request body is not valid JSON") from None
    else:
        raise InvalidRequest(f"send the spec as application/json, or as {TAR} with its sources; not {kind!r}")
    spec = spec_from_json(data)
    _check_sources(spec, context)
    return spec.with_context(context)


def _extract(archive: Path, into: Path) -> None:
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")  # refuses absolute paths, '..', device nodes and setuid bits
    except (tarfile.TarError, OSError) as err:
        raise InvalidRequest(f"the build archive is not a usable tar file: {err}") from None
    finally:
        os.unlink(archive)


def _check_sources(spec: EnvSpec, context: Path) -> None:
    """A remote spec reads only what its client sent: never the server's own files."""
    for step in spec.steps:
        if step.kind not in ("copy", "repo"):
            continue
        src = step.arg("src")
        if step.kind == "repo" and src.startswith(_REMOTE_REPO):
            continue
        if PurePosixPath(src).is_absolute() or ".." in PurePosixPath(src).parts:
            raise InvalidSpec(
                f"{step.kind} source {src!r}: a server build reads sources from the uploaded context only;"
                " the SDK uploads them for you"
            )
        if not (context / src).exists():
            raise InvalidSpec(f"{step.kind} source {src!r} was not uploaded with the spec")
