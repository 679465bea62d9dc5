"""The async SDK. With no address the fleet runs an engine in this process (the default);
with one (``unix:///run/fanfold.sock``, ``http://host:port``) it talks to ``fanfold serve``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator

from ..config import EngineConfig, env_token, env_url
from ..engine import Engine
from ..engine.core import OnOutput
from ..errors import InvalidRequest, SandboxNotFound
from ..images import Image
from ..images.builder import OnStep
from ..models import ExecResult, FileEntry, Limits, OutputChunk, SandboxInfo
from ..spec import EnvSpec
from ._http import HttpTransport
from ._transport import Transport


class AsyncFleet:
    """A handle on one host's sandboxes: ``AsyncFleet()`` embeds the engine in-process,
    ``AsyncFleet(url, token=...)`` (or ``FANFOLD_URL``/``FANFOLD_TOKEN``) uses a server.

    Use it as ``async with AsyncFleet() as fleet:``; closing destroys the sandboxes it
    created (except ``detached`` ones).
    """

    def __init__(self, url: str | None = None, *, token: str | None = None, config: EngineConfig | None = None) -> None:
        self.url = url or env_url()
        self._transport: Transport
        if self.url is None:
            engine = Engine(config)
            self._transport, self.config = engine, engine.config
        elif config is not None:
            raise InvalidRequest("config= sets up an embedded engine; a remote fleet uses its server's")
        else:
            self._transport, self.config = HttpTransport(self.url, token or env_token()), None

    async def __aenter__(self) -> AsyncFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start the embedded engine (reaping what crashed owners left), or check the server and token."""
        await self._transport.start()

    async def close(self) -> None:
        """Destroy this fleet's sandboxes (not detached ones) and stop its engine or connection."""
        await self._transport.close()

    async def build(self, spec: EnvSpec, *, on_step: OnStep | None = None) -> Image:
        """Build ``spec`` into an image; cached layers make a rebuild almost free."""
        return await self._transport.build(spec, on_step)

    async def images(self) -> list[Image]:
        return await self._transport.images()

    async def create(
        self,
        image: str | Image = "host",
        *,
        cpus: float = 1.0,
        memory_mb: int = 512,
        pids: int = 256,
        disk_mb: int = 1024,
        env: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        deadline: float | None = None,
        detached: bool = False,
    ) -> AsyncSandbox:
        """Start a sandbox from an image, image id or base name; ``deadline`` in seconds."""
        limits = Limits(cpus=cpus, memory_mb=memory_mb, pids=pids, disk_mb=disk_mb)
        info = await self._transport.create(image, limits=limits, env=env, labels=labels, deadline=deadline, detached=detached)
        return AsyncSandbox(self, info)

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on an existing sandbox."""
        return AsyncSandbox(self, await self._transport.get(sandbox_id))

    async def list(self, *, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        """Every sandbox on the host, optionally only those carrying ``labels``."""
        return await self._transport.list(labels)


class AsyncSandbox:
    """One sandbox. ``async with`` kills it on exit, whatever happened inside."""

    def __init__(self, fleet: AsyncFleet, info: SandboxInfo) -> None:
        self._fleet = fleet
        self._transport = fleet._transport
        self.info = info
        self.files = AsyncFiles(self)

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.info.state}>"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()

    async def exec(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        on_output: OnOutput | None = None,
    ) -> ExecResult:
        """Run a shell string or argv list; ``on_output(stream, data)`` sees output as it comes."""
        return await self._transport.exec(
            self.id, cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output, on_output=on_output
        )

    async def exec_stream(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
    ) -> AsyncIterator[OutputChunk | ExecResult]:
        """Yield output chunks as the command runs, then its ExecResult last."""
        # Unbounded is safe: the agent caps each stream at max_output.
        queue: asyncio.Queue[OutputChunk | None] = asyncio.Queue()

        async def push(stream: str, data: bytes) -> None:
            queue.put_nowait(OutputChunk(stream=stream, data=data))

        task = asyncio.create_task(
            self.exec(cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output, on_output=push)
        )
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (item := await queue.get()) is not None:
                yield item
            yield await task
        finally:
            task.cancel()

    async def kill(self) -> None:
        """Destroy the sandbox; killing one already gone is not an error."""
        try:
            await self._transport.kill(self.id)
        except SandboxNotFound:
            pass

    async def refresh(self) -> SandboxInfo:
        """Reload and return what the engine knows of this sandbox."""
        self.info = await self._transport.get(self.id)
        return self.info


class AsyncFiles:
    """Files inside one sandbox; relative paths start at the image's workdir."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox
        self._transport = sandbox._transport

    async def read(self, path: str) -> bytes:
        return await self._transport.read_file(self._sandbox.id, path)

    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Write a file, creating parent directories."""
        await self._transport.write_file(self._sandbox.id, path, data, mode)

    async def upload(self, local_path: str | Path, path: str) -> int:
        """Copy a host file in; returns bytes copied."""
        return await self._transport.upload(self._sandbox.id, local_path, path)

    async def download(self, path: str, local_path: str | Path) -> int:
        """Copy a file out to the host; returns bytes copied."""
        return await self._transport.download(self._sandbox.id, path, local_path)

    async def list(self, path: str = ".") -> list[FileEntry]:
        return await self._transport.list_files(self._sandbox.id, path)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._transport.remove_file(self._sandbox.id, path, recursive)
