"""The sync SDK: the async classes' twins, differing only by ``await``.

Each call runs on the fleet's private event loop thread (see ``_portal``).
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Callable, Iterator

from ..config import EngineConfig
from ..images import Image
from ..images.builder import OnStep
from ..models import ExecResult, FileEntry, OutputChunk, SandboxInfo
from ..spec import EnvSpec
from ._async import AsyncFiles, AsyncFleet, AsyncSandbox
from ._portal import Portal

OnOutputSync = Callable[[str, bytes], None]


class Fleet:
    """A handle on one host's sandboxes: ``Fleet()`` embeds the engine in-process,
    ``Fleet(url, token=...)`` (or ``FANFOLD_URL``/``FANFOLD_TOKEN``) uses a server.

    Use it as ``with Fleet() as fleet:``; closing destroys the sandboxes it created
    (except ``detached`` ones).
    """

    def __init__(self, url: str | None = None, *, token: str | None = None, config: EngineConfig | None = None) -> None:
        self._async = AsyncFleet(url, token=token, config=config)
        self.config = self._async.config
        self.url = self._async.url
        self._portal: Portal | None = None

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro):  # type: ignore[no-untyped-def]
        if self._portal is None:
            self.start()
        assert self._portal is not None
        return self._portal.call(coro)

    def start(self) -> None:
        """Start the embedded engine (reaping what crashed owners left), or check the server and token."""
        if self._portal is not None:
            return
        self._portal = Portal()
        try:
            self._portal.call(self._async.start())
        except BaseException:
            self._portal.stop()
            self._portal = None
            raise
        atexit.register(self.close)

    def close(self) -> None:
        """Destroy this fleet's sandboxes (not detached ones) and stop its engine or connection."""
        if self._portal is None:
            return
        portal, self._portal = self._portal, None
        try:
            portal.call(self._async.close())
        finally:
            portal.stop()
            atexit.unregister(self.close)

    def build(self, spec: EnvSpec, *, on_step: OnStep | None = None) -> Image:
        """Build ``spec`` into an image; cached layers make a rebuild almost free."""
        return self._call(self._async.build(spec, on_step=on_step))

    def images(self) -> list[Image]:
        return self._call(self._async.images())

    def create(
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
    ) -> Sandbox:
        """Start a sandbox from an image, image id or base name; ``deadline`` in seconds."""
        inner = self._call(self._async.create(
            image, cpus=cpus, memory_mb=memory_mb, pids=pids, disk_mb=disk_mb, env=env, labels=labels,
            deadline=deadline, detached=detached,
        ))
        return Sandbox(self, inner)

    def get(self, sandbox_id: str) -> Sandbox:
        """A handle on an existing sandbox."""
        return Sandbox(self, self._call(self._async.get(sandbox_id)))

    def list(self, *, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        """Every sandbox on the host, optionally only those carrying ``labels``."""
        return self._call(self._async.list(labels=labels))


class Sandbox:
    """One sandbox. ``with`` kills it on exit, whatever happened inside."""

    def __init__(self, fleet: Fleet, inner: AsyncSandbox) -> None:
        self._fleet = fleet
        self._async = inner
        self.files = Files(fleet, inner.files)

    @property
    def id(self) -> str:
        return self._async.id

    @property
    def info(self) -> SandboxInfo:
        return self._async.info

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.state}>"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def exec(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        on_output: OnOutputSync | None = None,
    ) -> ExecResult:
        """Run a shell string or argv list; ``on_output(stream, data)`` sees output as it comes."""
        return self._fleet._call(self._async.exec(
            cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output, on_output=on_output
        ))

    def exec_stream(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
    ) -> Iterator[OutputChunk | ExecResult]:
        """Yield output chunks as the command runs, then its ExecResult last."""
        stream = self._async.exec_stream(cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output)
        assert self._fleet._portal is not None
        return self._fleet._portal.iterate(stream)

    def kill(self) -> None:
        """Destroy the sandbox; killing one already gone is not an error."""
        self._fleet._call(self._async.kill())

    def refresh(self) -> SandboxInfo:
        """Reload and return what the engine knows of this sandbox."""
        return self._fleet._call(self._async.refresh())


class Files:
    """Files inside one sandbox; relative paths start at the image's workdir."""

    def __init__(self, fleet: Fleet, inner: AsyncFiles) -> None:
        self._fleet = fleet
        self._async = inner

    def read(self, path: str) -> bytes:
        return self._fleet._call(self._async.read(path))

    def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Write a file, creating parent directories."""
        self._fleet._call(self._async.write(path, data, mode=mode))

    def upload(self, local_path: str | Path, path: str) -> int:
        """Copy a host file in; returns bytes copied."""
        return self._fleet._call(self._async.upload(local_path, path))

    def download(self, path: str, local_path: str | Path) -> int:
        """Copy a file out to the host; returns bytes copied."""
        return self._fleet._call(self._async.download(path, local_path))

    def list(self, path: str = ".") -> list[FileEntry]:
        return self._fleet._call(self._async.list(path))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._fleet._call(self._async.remove(path, recursive=recursive))
