"""The files half of the engine: reads, writes and streams confined to a sandbox's root.

Every write lands under a temporary name and is renamed into place (see
``safefs.PendingFile``), on every transport, so a broken-off write never leaves half a file.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, AsyncIterable, Callable

from ..errors import InvalidRequest, SandboxGone
from ..host import safefs
from ..models import FileEntry
from .checks import check_mode, file_bytes
from .lifecycle import Lifecycle

STREAM_CHUNK = 1 << 20


class Files:
    """File calls, each holding its sandbox running (``Lifecycle.using``) for its length."""

    def __init__(self, life: Lifecycle) -> None:
        self.life = life

    async def _files(self, sandbox_id: str, path: str, fn: Callable[..., Any], *args: Any) -> Any:
        async with self.life.using(sandbox_id) as row:
            return await self._in_root(row, path, fn, *args)

    async def _in_root(self, row: Any, path: str, fn: Callable[..., Any], *args: Any) -> Any:
        sandbox_id = row["id"]
        img = self.life.sources.store.load_image(row["image_id"])
        target = safefs.normalize(path, img.workdir)
        backend = self.life.backend
        root = backend.root(sandbox_id)

        def run() -> Any:
            try:
                fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                raise SandboxGone(f"sandbox {sandbox_id} was destroyed during the call") from None
            try:
                with backend.as_root(sandbox_id):  # what it makes is the sandbox root's, not the host's
                    return fn(fd, target, *args)
            finally:
                os.close(fd)

        return await asyncio.to_thread(run)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._files(sandbox_id, path, safefs.read)

    async def write_file(self, sandbox_id: str, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await self._files(sandbox_id, path, safefs.write, file_bytes(data), check_mode(mode))

    async def upload(self, sandbox_id: str, local_path: str | Path, path: str) -> int:
        if not Path(local_path).is_file():
            raise InvalidRequest(f"local file {local_path} does not exist or is not a file")
        return await self._files(sandbox_id, path, lambda fd, p: safefs.upload(fd, str(local_path), p))

    async def download(self, sandbox_id: str, path: str, local_path: str | Path) -> int:
        return await self._files(sandbox_id, path, lambda fd, p: safefs.download(fd, p, str(local_path)))

    async def open_file(self, sandbox_id: str, path: str) -> FileStream:
        """A sandbox file to stream out in chunks; close it (or read it to the end)."""
        return FileStream(await self._files(sandbox_id, path, safefs.open_reader))

    async def write_stream(self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes], mode: int = 0o644) -> int:
        """Stream ``chunks`` into a file that appears whole, or not at all; returns its size."""
        async with self.life.using(sandbox_id) as row:
            with await self._in_root(row, path, safefs.PendingFile, check_mode(mode)) as pending:
                batch = bytearray()
                async for chunk in chunks:
                    batch += chunk
                    if len(batch) >= STREAM_CHUNK:
                        await asyncio.to_thread(pending.write, bytes(batch))
                        batch.clear()
                await asyncio.to_thread(pending.write, bytes(batch))
        self.life.known(sandbox_id)  # killed midway: the file went down with the sandbox
        return pending.size

    async def list_files(self, sandbox_id: str, path: str = ".") -> list[FileEntry]:
        return await self._files(sandbox_id, path, safefs.listdir)

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self._files(sandbox_id, path, safefs.remove, recursive)


class FileStream:
    """Chunks of one open sandbox file; the fd closes at the end, on error, or on ``aclose``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __aiter__(self) -> FileStream:
        return self

    async def __anext__(self) -> bytes:
        if self.fd < 0:
            raise StopAsyncIteration
        try:
            data = await asyncio.to_thread(os.read, self.fd, STREAM_CHUNK)
        except BaseException:
            await self.aclose()
            raise
        if not data:
            await self.aclose()
            raise StopAsyncIteration
        return data

    async def aclose(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
