"""The shared download cache: immutable package files (wheels, sdists, npm tarballs, .debs, crates),
kept by content under ``<net_dir>/cache`` so that many sandboxes installing one package fetch it once.

Only GET 200 responses to URLs whose content never changes are kept: ``cacheable`` says which. Index
pages (``/simple/``, npm packuments, apt's ``Release``/``Packages``) change, and are never cached.
``sha256/<digest>`` holds a body, ``index/<sha256 of the URL>`` its digest, size and headers; a body's
mtime is its last use, and the least recently used go first when the cache outgrows its cap.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO


IMMUTABLE = (
    re.compile(r"\.whl$"),
    re.compile(r"/packages/.+\.(tar\.gz|zip|tar\.bz2)$"),  # PyPI's files
    re.compile(r"/-/[^/]+-\d[^/]*\.tgz$"),  # npm tarballs: /<name>/-/<name>-<version>.tgz
    re.compile(r"/pool/.+\.deb$"),
    re.compile(r"\.crate$"),
)
NEVER = re.compile(r"/simple/|/dists/|/(Release|InRelease|Packages)(\.\w+)?$")
INFLIGHT_WAIT_S = 300.0
STALLED_S = 2.0
"""A download that grows by nothing for this long is no longer waited for: a sandbox that stops
reading must not hold up another's install (the waiter fetches the file itself)."""


def cacheable(method: str, path: str, headers: Any = ()) -> bool:
    """Whether a request for ``path`` (query and all) may be answered from, and stored in, the cache: a GET
    of an immutable file, without credentials (what those fetch may be for this sandbox only)."""
    if method != "GET" or any(name.lower() in (b"authorization", b"cookie") for name, _ in headers):
        return False
    bare = path.partition("?")[0].partition("#")[0]
    return not NEVER.search(bare) and any(pattern.search(bare) for pattern in IMMUTABLE)


@dataclass(frozen=True)
class Hit:
    """A cached body: where it is, how long, and the headers it came with (less framing)."""

    path: Path
    size: int
    headers: list[list[str]]


class Cache:
    """The cache directory of one netd; at most ``max_bytes`` of bodies (least recently used evicted)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes
        self.bodies, self.index, self.temp = root / "sha256", root / "index", root / "tmp"
        for where in (root, self.bodies, self.index, self.temp):
            where.mkdir(mode=0o700, parents=True, exist_ok=True)
        for stale in self.temp.iterdir():  # a netd that died midway left these
            stale.unlink(missing_ok=True)
        self.size = sum(p.stat().st_size for p in self.bodies.iterdir())
        self._inflight: dict[str, asyncio.Event] = {}
        self._writers: dict[str, CacheWriter] = {}
        """The download each in-flight event stands for (its size shows whether it moves)."""

    def _entry(self, url: str) -> Path:
        return self.index / hashlib.sha256(url.encode()).hexdigest()

    def lookup(self, url: str) -> Hit | None:
        """The cached body for ``url``, marked as just used; None on a miss."""
        entry = self._entry(url)
        try:
            meta = json.loads(entry.read_bytes())
            body = self.bodies / meta["digest"]
            os.utime(body)
        except FileNotFoundError:
            entry.unlink(missing_ok=True)  # its body was evicted
            return None
        except (ValueError, KeyError):
            entry.unlink(missing_ok=True)
            return None
        return Hit(body, int(meta["size"]), meta["headers"])

    async def wait_for(self, url: str) -> None:
        """Wait while another request downloads ``url`` (so that it is fetched once, not once per sandbox)."""
        event = self._inflight.get(url)
        writer = self._writers.get(url)
        deadline = asyncio.get_running_loop().time() + INFLIGHT_WAIT_S
        while event is not None and not event.is_set() and asyncio.get_running_loop().time() < deadline:
            seen = writer.size if writer is not None else 0
            try:
                await asyncio.wait_for(event.wait(), STALLED_S)
            except TimeoutError:
                if writer is None or writer.size == seen:
                    return  # stalled: fetch it ourselves

    def writer(self, url: str) -> CacheWriter:
        """A writer for a body being downloaded; others asking for ``url`` meanwhile wait (``wait_for``)."""
        event = self._inflight.setdefault(url, asyncio.Event())
        writer = CacheWriter(self, url, event)
        self._writers.setdefault(url, writer)
        return writer

    def _commit(self, writer: CacheWriter, headers: list[list[str]]) -> None:
        digest, new = writer.keep_in(self.bodies)
        if new:
            self.size += writer.size
        staged = self.temp / f"entry-{secrets.token_hex(8)}"
        staged.write_text(json.dumps({"url": writer.url, "digest": digest, "size": writer.size, "headers": headers}))
        os.replace(staged, self._entry(writer.url))
        if self.size > self.max_bytes:
            self.evict(keep=self.bodies / digest)

    def evict(self, keep: Path | None = None) -> None:
        """Delete the least recently used bodies until the cache is under 90% of its cap."""
        found = []
        for path in self.bodies.iterdir():
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            found.append((stat.st_mtime_ns, stat.st_size, path))
        found.sort()
        self.size = sum(size for _, size, _ in found)
        for _, size, path in found:
            if self.size <= self.max_bytes * 0.9:
                break
            if path != keep:
                path.unlink(missing_ok=True)
                self.size -= size

    def _done(self, writer: CacheWriter) -> None:
        if self._inflight.get(writer.url) is writer.event:
            del self._inflight[writer.url]
        if self._writers.get(writer.url) is writer:
            del self._writers[writer.url]
        writer.event.set()


class HashedFile:
    """A file a body is written to while it streams, hashed and counted as it goes: a temporary
    file at ``temp`` by default, or the ``handle`` given."""

    def __init__(self, temp: Path | None = None, handle: BinaryIO | None = None) -> None:
        self.temp = temp
        self.handle: BinaryIO = handle if handle is not None else open(temp, "wb")  # type: ignore[arg-type]
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        self.handle.write(data)
        self.sha.update(data)
        self.size += len(data)

    def keep_in(self, directory: Path) -> tuple[str, bool]:
        """Move the temporary file to ``directory``/<its sha256>, unless that content is there
        already (one copy per content): the digest, and whether it was new."""
        self.handle.close()
        digest = self.sha.hexdigest()
        final = directory / digest
        if final.exists():
            assert self.temp is not None
            self.temp.unlink()
            return digest, False
        os.replace(self.temp, final)  # type: ignore[arg-type]
        return digest, True


class CacheWriter(HashedFile):
    """A download on its way into the cache: kept only if ``commit`` is called (a whole 200 response)."""

    def __init__(self, cache: Cache, url: str, event: asyncio.Event) -> None:
        self.cache, self.url, self.event = cache, url, event
        super().__init__(cache.temp / f"body-{secrets.token_hex(8)}")

    def may_keep(self, status: int, headers: Any) -> bool:
        """Whether a response with this status and headers may be kept: a 200 that shared caches may store."""
        return status == 200 and not any(
            name.lower() == b"cache-control" and (b"private" in value.lower() or b"no-store" in value.lower())
            for name, value in headers)

    def commit(self, headers: Any) -> None:
        """Keep the body, with ``headers`` (less framing), once the response is whole."""
        try:
            self.cache._commit(self, stored_headers(headers))
        finally:
            self.cache._done(self)

    def discard(self) -> None:
        self.handle.close()
        self.temp.unlink(missing_ok=True)
        self.cache._done(self)


def stored_headers(headers: Any) -> list[list[str]]:
    """Response headers as kept on disk: text pairs, without framing (a body's length is recomputed)."""
    return [[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers
            if name.lower() not in (b"content-length", b"transfer-encoding")]
