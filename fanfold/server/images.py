"""Routes of images: list, build from a spec (with its copy sources, when it has any), pull from a
registry, import an archive, remove, share; and registry credentials (the host's own tenant only).

Each image belongs to the tenants that built, pulled or imported it (``engine.catalog``): a
tenant sees, builds on, creates from and removes only those and the ones the host's tenant
shared; another tenant's image answers 404, as if it did not exist.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from ..engine import Engine
from ..engine.catalog import check_tag
from ..errors import FanfoldError, InvalidRequest, InvalidSpec
from ..host import safefs
from ..images.builder import check_network
from ..spec import REMOTE_LOCAL_REPO, EnvSpec, is_repo_url
from ..wire import event_to_json, image_to_json, pull_event_to_json, spec_from_json
from ..web.deps import ERRORS, NDJSON, engine, host_only, ndjson_events, tenant
from ..web.schemas import ImageBody

router = APIRouter(prefix="/v1/images", tags=["images"])
TAR = "application/x-tar"
_UPLOADED = re.compile(r"^src[0-9]{1,6}$")
MAX_CONTEXT = 8 << 30
"""Largest build context (the copy sources) a client may upload."""
MAX_MEMBERS = 500_000


@router.get("", response_model=list[ImageBody], responses=ERRORS)
async def list_images(request: Request, caller: str = Depends(tenant)) -> list[dict[str, Any]]:
    """The caller's images and the shared ones (the host's own tenant: every image)."""
    return [image_to_json(image) for image in await engine(request).images(tenant=caller)]


@router.post(
    "",
    responses={**ERRORS, 200: {"content": {NDJSON: {}}, "description":
        "NDJSON: `{\"event\": StepEvent}` lines as steps start and end, then `{\"image\": Image}` or `{\"error\": Error}`."}},
    openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"type": "object", "description": "A spec: {base, steps: [{kind, ...}]}"}},
        TAR: {"schema": {"type": "string", "format": "binary"},
              "description": "spec.json plus context/: the spec's copy and local repo sources"},
    }}},
)
async def build(request: Request, caller: str = Depends(tenant), network: str = Query(
        "isolated", description="Where `run` steps are: `isolated` (egress through NAT, nothing of the host) or"
                                " `host` (the host's network: the host's own tenant only)."),
                tag: str | None = Query(None, description="A name for the image (`myenv`, `team/env:v2`), in the"
                                                          " caller's own namespace of names.")) -> StreamingResponse:
    """Build a spec into an image; cached layers are reused. Progress streams as it goes."""
    fleet: Engine = engine(request)
    if check_network(network) == "host":  # a step on the host's network reaches its loopback services
        host_only(caller, "build with the host's network (network=host)")
    if tag is not None:
        check_tag(tag)  # refused before the upload, not after the build
    # The pid in the name lets reconcile clear what a crashed server left.
    scratch = Path(tempfile.mkdtemp(prefix=f"context-{os.getpid()}-", dir=fleet.config.state_dir / "bundles"))
    try:
        spec = await _read_spec(request, scratch)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise

    async def work(report):  # type: ignore[no-untyped-def]
        try:
            return await fleet.build(await fleet.catalog.scoped(spec, caller), report, network=network, tag=tag,
                                     tenant=caller)
        finally:
            await asyncio.to_thread(shutil.rmtree, scratch, True)

    return _stream_image(work, event_to_json)


class PullRequest(BaseModel):
    ref: str = Field(description="An image reference: python:3.12-slim, registry.example.org/env@sha256:...")
    platform: str | None = Field(None, description="os/arch[/variant] to take from a multi-arch index; default the host's.")


class LoginRequest(BaseModel):
    registry: str = Field(description="host[:port] of the registry.")
    username: str = ""
    password: str = ""


class RemovedImage(BaseModel):
    id: str


PULL_STREAM = {**ERRORS, 200: {"content": {NDJSON: {}}, "description":
    "NDJSON: `{\"event\": PullEvent}` lines per layer as it goes, then `{\"image\": Image}` or `{\"error\": Error}`."}}


def _stream_image(work, event_json=pull_event_to_json) -> StreamingResponse:  # type: ignore[no-untyped-def]
    """NDJSON of ``work(report)``: an ``event`` line per report as it goes, then its image (or its error)."""
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def run() -> dict[str, Any]:
        return image_to_json(await work(lambda event: queue.put_nowait({"event": event_json(event)})))

    return StreamingResponse(ndjson_events(queue, asyncio.create_task(run()), "image"), media_type=NDJSON)


@router.post("/pull", responses=PULL_STREAM)
async def pull(body: PullRequest, request: Request, caller: str = Depends(tenant)) -> StreamingResponse:
    """Pull an image from its registry with the host's credentials; layers already here are kept.
    On a host that pulls only when asked (FANFOLD_PULL=never), only its own tenant may ask."""
    fleet: Engine = engine(request)
    if fleet.config.pull == "never":
        host_only(caller, "pull images on this host (FANFOLD_PULL=never)")
    return _stream_image(lambda report: fleet.pull(body.ref, platform=body.platform, on_progress=report, tenant=caller))


@router.post("/import", responses=PULL_STREAM, openapi_extra={"requestBody": {
    "required": True, "content": {TAR: {"schema": {"type": "string", "format": "binary"},
                                        "description": "A docker save tarball or an OCI archive"}}}})
async def import_image(request: Request, caller: str = Depends(tenant), ref: str | None = Query(
        None, description="A name to give the image (the host's own tenant only: names are shared).")
                       ) -> StreamingResponse:
    """Import an image from a ``docker save`` tarball or an OCI archive sent as the body; it is known
    by its id, and by ``ref`` when the host's own tenant gives one."""
    fleet: Engine = engine(request)
    if ref is not None:  # a tenant naming an image could stand it in for what others pull by that name
        host_only(caller, "name imported images")
    scratch = Path(tempfile.mkdtemp(prefix=f"context-{os.getpid()}-", dir=fleet.config.state_dir / "bundles"))
    archive = scratch / "image.tar"
    try:
        await _receive(request, archive, "the image archive")
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise

    async def work(report):  # type: ignore[no-untyped-def]
        try:
            return await fleet.import_image(archive, ref=ref, on_progress=report, tenant=caller)
        finally:
            await asyncio.to_thread(shutil.rmtree, scratch, True)

    return _stream_image(work)


@router.delete("", response_model=RemovedImage, responses=ERRORS)
async def remove_image(request: Request, ref: str = Query(description="An image id or a reference naming it."),
                       force: bool = False, caller: str = Depends(tenant)) -> dict[str, str]:
    """Remove one of the caller's images: its names and its claim go, the image once nobody else holds it."""
    return {"id": await engine(request).remove_image(ref, force=force, tenant=caller)}


class ShareRequest(BaseModel):
    ref: str = Field(description="An image id or a reference naming it.")
    shared: bool = Field(True, description="True publishes it to every tenant; false takes it back.")


@router.post("/share", response_model=ImageBody, responses=ERRORS)
async def share(body: ShareRequest, request: Request, caller: str = Depends(tenant)) -> dict[str, Any]:
    """Publish an image to every tenant, or take it back (the host's own tenant only); sandboxes
    already made from it keep running."""
    host_only(caller, "share images")
    return image_to_json(await engine(request).share_image(body.ref, body.shared))


registries = APIRouter(prefix="/v1/registries", tags=["images"])


@registries.post("/login", status_code=204, responses=ERRORS)
async def login(body: LoginRequest, request: Request, caller: str = Depends(tenant)) -> None:
    """Check credentials against a registry and keep them for the host's pulls (the host's own tenant only)."""
    host_only(caller, "log in to registries")
    await engine(request).login(body.registry, body.username, body.password)


@registries.post("/logout", status_code=204, responses=ERRORS)
async def logout(body: LoginRequest, request: Request, caller: str = Depends(tenant)) -> None:
    host_only(caller, "log out of registries")
    await engine(request).logout(body.registry)


async def _receive(request: Request, path: Path, what: str) -> None:
    """The request's body streamed into ``path``, refused past MAX_CONTEXT bytes."""
    size = 0
    with open(path, "wb") as handle:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_CONTEXT:
                raise InvalidRequest(f"{what} is over {MAX_CONTEXT >> 30} GiB")
            await asyncio.to_thread(handle.write, chunk)


async def _read_spec(request: Request, scratch: Path) -> EnvSpec:
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    context = scratch / "context"
    context.mkdir()
    if kind == TAR:
        archive = scratch / "upload.tar"
        await _receive(request, archive, "the build context")
        await asyncio.to_thread(_extract, archive, scratch)
        try:
            data = json.loads((scratch / "spec.json").read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            raise InvalidRequest("the build archive needs a spec.json holding the spec as JSON") from None
    elif kind in ("application/json", ""):
        try:
            data = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest("the request body is not valid JSON") from None
    else:
        raise InvalidRequest(f"send the spec as application/json, or as {TAR} with its sources; not {kind!r}")
    spec = spec_from_json(data)
    _check_sources(spec, context)
    return spec.with_context(context)


def _extract(archive: Path, into: Path) -> None:
    """Unpack an uncompressed tar of regular files, directories and symlinks, each created
    beneath ``into`` through openat2(RESOLVE_IN_ROOT), so no member name or symlink planted
    by an earlier member can reach outside. tarfile's own extraction is not used: its
    filters have had escapes."""
    root = os.open(into, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    directories: list[tuple[str, int]] = []
    try:
        with tarfile.open(archive, mode="r:") as tar:
            for count, member in enumerate(tar):
                if count >= MAX_MEMBERS:
                    raise InvalidRequest(f"the build archive has over {MAX_MEMBERS} entries")
                _extract_member(tar, member, root, directories)
        for path, mode in reversed(directories):  # modes last: a read-only directory still gets its files
            with safefs.opened(root, path, os.O_RDONLY | os.O_DIRECTORY) as fd:
                os.fchmod(fd, mode)
    except FanfoldError:
        raise
    except Exception as err:  # noqa: BLE001 - a malformed archive is bad input, whatever broke
        raise InvalidRequest(f"the build archive is not a usable uncompressed tar: {type(err).__name__}: {err}") from None
    finally:
        os.close(root)
        os.unlink(archive)


def _extract_member(tar: tarfile.TarFile, member: tarfile.TarInfo, root: int,
                    directories: list[tuple[str, int]]) -> None:
    parts = [p for p in PurePosixPath(member.name).parts if p not in ("", ".")]
    if not parts or PurePosixPath(member.name).is_absolute() or ".." in parts or "\0" in member.name:
        raise InvalidRequest(f"the build archive has a bad member name {member.name!r}")
    path = "/" + "/".join(parts)
    mode = member.mode & 0o777  # never setuid/setgid/sticky
    if member.isdir():
        safefs.makedirs(root, path)
        directories.append((path, mode))
    elif member.isfile():
        source = tar.extractfile(member)
        assert source is not None
        with safefs.PendingFile(root, path, mode) as pending:
            while chunk := source.read(1 << 20):
                pending.write(chunk)
            os.fchmod(pending.fd, mode)
    elif member.issym():
        parent = str(PurePosixPath(path).parent)
        safefs.makedirs(root, parent)
        with safefs.opened(root, parent, os.O_PATH | os.O_DIRECTORY) as fd, safefs.translated(path):
            os.symlink(member.linkname, PurePosixPath(path).name, dir_fd=fd)  # created, never followed here
    else:
        raise InvalidRequest(f"the build archive may hold files, directories and symlinks only, not {member.name!r}")


def _check_sources(spec: EnvSpec, context: Path) -> None:
    """A remote spec reads only what its client uploaded, never the server's own files."""
    for step in spec.steps:
        if step.kind == "copy_from" and isinstance(step.arg("source"), EnvSpec):
            _check_sources(step.arg("source"), context)  # a stage: its sources came in the same upload
        src = step.arg("src") if step.kind in ("copy", "repo") else None
        if step.kind == "repo" and not is_repo_url(src):
            raise InvalidSpec(REMOTE_LOCAL_REPO.format(src=src))
        if step.kind == "copy":
            uploaded = context / src if _UPLOADED.match(src) else None
            if uploaded is None or uploaded.is_symlink() or not uploaded.exists():
                raise InvalidSpec(
                    f"copy source {src!r} was not uploaded with the spec: a server build reads only the sources"
                    " sent with it (the SDK sends them for you)"
                )
