"""The remote transport: the engine's methods, spoken over HTTP to ``fanfold serve``.

It has the engine's signatures, so AsyncFleet and AsyncSandbox work unchanged on either.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
import uuid
from pathlib import Path
from typing import Any, AsyncIterator
from urllib.parse import quote, urlsplit

import httpx

from .. import wire
from ..engine.core import OnOutput
from ..errors import CapacityExceeded, FanfoldError, InfrastructureError, InvalidRequest, InvalidSpec, SandboxNotFound
from ..images import Image
from ..images.builder import OnStep
from ..models import ExecResult, FileEntry, Limits, SandboxInfo
from ..spec import EnvSpec

CHUNK = 1 << 20
CREATE_ATTEMPTS = 5


def _endpoint(url: str) -> tuple[str, httpx.AsyncHTTPTransport]:
    """``unix:///run/fanfold.sock`` or ``http(s)://host:port`` to a base URL and a transport."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        if not parts.path:
            raise InvalidRequest(f"a unix URL names a socket path, e.g. unix:///run/fanfold.sock, not {url!r}")
        return "http://fanfold", httpx.AsyncHTTPTransport(uds=parts.path)
    if parts.scheme in ("http", "https") and parts.netloc:
        return url.rstrip("/"), httpx.AsyncHTTPTransport()
    raise InvalidRequest(f"a fanfold server URL is unix:///path/to.sock or http://host:port, not {url!r}")


class HttpTransport:
    """One server, one tenant (the token's); tracks the sandboxes it creates to kill them on close."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url
        base, transport = _endpoint(url)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(
            base_url=base, transport=transport, headers=headers,
            timeout=httpx.Timeout(None, connect=30), limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )
        self._created: set[str] = set()

    # -- plumbing -----------------------------------------------------------------------------

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._client.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise InfrastructureError(f"cannot reach the fanfold server at {self.url}: {err or type(err).__name__}") from None
        if response.status_code >= 400:
            raise _error(response)
        return response

    async def _lines(self, method: str, path: str, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """NDJSON lines of a streamed reply; an ``error`` line raises it."""
        try:
            async with self._client.stream(method, path, **kwargs) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise _error(response)
                async for text in response.aiter_lines():
                    if text:
                        item = json.loads(text)
                        if "error" in item:
                            raise wire.error_from_json(item["error"], 200)
                        yield item
        except httpx.TransportError as err:
            raise InfrastructureError(f"lost the fanfold server at {self.url}: {err or type(err).__name__}") from None

    # -- the engine's surface -----------------------------------------------------------------

    async def start(self) -> None:
        await self._send("GET", "/v1/whoami")

    async def close(self) -> None:
        await asyncio.gather(*(self._kill_quietly(i) for i in list(self._created)))
        await self._client.aclose()

    async def _kill_quietly(self, sandbox_id: str) -> None:
        try:
            await self.kill(sandbox_id)
        except FanfoldError:
            pass

    async def build(self, spec: EnvSpec, on_step: OnStep | None = None) -> Image:
        if not isinstance(spec, EnvSpec):
            raise InvalidRequest(f"build() takes an EnvSpec, got {type(spec).__name__}")
        body, kind = await asyncio.to_thread(_build_request, spec)
        async for item in self._lines("POST", "/v1/images", content=body, headers={"Content-Type": kind}):
            if "event" in item and on_step is not None:
                on_step(wire.event_from_json(item["event"]))
            elif "image" in item:
                return wire.image_from_json(item["image"])
        raise InfrastructureError("the server ended the build without an image")

    async def images(self) -> list[Image]:
        return [wire.image_from_json(i) for i in (await self._send("GET", "/v1/images")).json()]

    async def create(
        self, image: str | Image = "host", *, limits: Limits | None = None, env: dict[str, str] | None = None,
        labels: dict[str, str] | None = None, deadline: float | None = None, detached: bool = False,
    ) -> SandboxInfo:
        limits = limits or Limits()
        body = {
            "image": image.id if isinstance(image, Image) else image, **limits.__dict__,
            "env": env or {}, "labels": labels or {}, "deadline": deadline, "detached": detached,
        }
        request_id = uuid.uuid4().hex
        for attempt in range(CREATE_ATTEMPTS):
            try:
                response = await self._send("POST", "/v1/sandboxes", json=body, headers={"X-Request-ID": request_id})
                break
            except (InfrastructureError, CapacityExceeded):
                if attempt == CREATE_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.2 * 2**attempt)  # the same X-Request-ID makes the retry safe
        info = wire.info_from_json(response.json())
        if not detached:
            self._created.add(info.id)
        return info

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return wire.info_from_json((await self._send("GET", _sandbox(sandbox_id))).json())

    async def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        return [wire.info_from_json(i) for i in (await self._send("GET", "/v1/sandboxes", params=params)).json()]

    async def kill(self, sandbox_id: str) -> None:
        await self._send("DELETE", _sandbox(sandbox_id))
        self._created.discard(sandbox_id)

    async def exec(
        self, sandbox_id: str, cmd: str | list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
        stdin: bytes | str | None = None, timeout: float | None = None, max_output: int | None = None,
        on_output: OnOutput | None = None,
    ) -> ExecResult:
        if isinstance(stdin, str):
            stdin = stdin.encode()
        body = {"cmd": cmd, "cwd": cwd, "env": env or {}, "timeout": timeout, "max_output": max_output,
                "stdin": None if stdin is None else wire.b64(bytes(stdin))}
        path = _sandbox(sandbox_id) + "/exec"
        if on_output is None:
            response = await self._send("POST", path, json=body, headers={"Accept": "application/json"})
            return wire.result_from_json(response.json())
        async for item in self._lines("POST", path, json=body):
            if "result" in item:
                return wire.result_from_json(item["result"])
            maybe = on_output(item["stream"], wire.unb64(item["data"], "output"))
            if maybe is not None:
                await maybe
        raise InfrastructureError("the server ended the exec stream without a result")

    # -- files --------------------------------------------------------------------------------

    def _content(self, sandbox_id: str) -> str:
        return _sandbox(sandbox_id) + "/files/content"

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return (await self._send("GET", self._content(sandbox_id), params={"path": path})).content

    async def write_file(self, sandbox_id: str, path: str, data: bytes | str, mode: int = 0o644) -> None:
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidRequest(f"file data must be bytes or str, got {type(data).__name__}")
        await self._send("PUT", self._content(sandbox_id), params={"path": path, "mode": mode}, content=bytes(data))

    async def upload(self, sandbox_id: str, local_path: str | Path, path: str) -> int:
        if not Path(local_path).is_file():
            raise InvalidRequest(f"local file {local_path} does not exist or is not a file")
        mode = os.stat(local_path).st_mode & 0o7777
        response = await self._send(
            "PUT", self._content(sandbox_id), params={"path": path, "mode": mode}, content=_read_chunks(Path(local_path))
        )
        return response.json()["bytes"]

    async def download(self, sandbox_id: str, path: str, local_path: str | Path) -> int:
        try:
            async with self._client.stream("GET", self._content(sandbox_id), params={"path": path}) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise _error(response)
                try:
                    handle = open(local_path, "wb")
                except OSError as err:
                    raise InvalidRequest(f"cannot write the local file {local_path}: {err.strerror}") from None
                total = 0
                with handle:
                    async for chunk in response.aiter_bytes(CHUNK):
                        await asyncio.to_thread(handle.write, chunk)
                        total += len(chunk)
                return total
        except httpx.TransportError as err:
            raise InfrastructureError(f"lost the fanfold server at {self.url}: {err or type(err).__name__}") from None

    async def list_files(self, sandbox_id: str, path: str = ".") -> list[FileEntry]:
        response = await self._send("GET", _sandbox(sandbox_id) + "/files", params={"path": path})
        return [wire.entry_from_json(e) for e in response.json()]

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        await self._send("DELETE", _sandbox(sandbox_id) + "/files", params=params)


def _sandbox(sandbox_id: str) -> str:
    if not isinstance(sandbox_id, str) or not sandbox_id or "/" in sandbox_id:
        raise SandboxNotFound(f"bad sandbox id {sandbox_id!r}")
    return "/v1/sandboxes/" + quote(sandbox_id, safe="")


def _error(response: httpx.Response) -> FanfoldError:
    try:
        body = response.json()
    except ValueError:
        body = None
    return wire.error_from_json(body, response.status_code)


async def _read_chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as handle:
        while chunk := await asyncio.to_thread(handle.read, CHUNK):
            yield chunk


def _build_request(spec: EnvSpec) -> tuple[bytes, str]:
    """The spec as JSON, or, when it copies local sources, a tar of spec.json and those sources."""
    context = spec.context or Path.cwd()
    sources: dict[str, Path] = {}
    steps = []
    for number, step in enumerate(spec.steps):
        args = dict(step.args)
        remote_repo = step.kind == "repo" and ("://" in args["src"] or args["src"].startswith("git@"))
        if step.kind in ("copy", "repo") and not remote_repo:
            local = Path(args["src"]) if os.path.isabs(args["src"]) else context / args["src"]
            if not local.exists():
                raise InvalidSpec(f"{step.kind} source {args['src']!r} does not exist (resolved to {local})")
            name = f"src{number}"
            sources[name] = local
            args["src"] = name
        steps.append((step.kind, args))
    data = wire.spec_to_json(spec)
    for item, (_, args) in zip(data["steps"], steps):
        if "src" in args:
            item["src"] = args["src"]
    if not sources:
        return json.dumps(data).encode(), "application/json"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        encoded = json.dumps(data).encode()
        info = tarfile.TarInfo("spec.json")
        info.size = len(encoded)
        tar.addfile(info, io.BytesIO(encoded))
        for name, local in sources.items():
            tar.add(local, arcname=f"context/{name}")
    return buffer.getvalue(), "application/x-tar"
