"""Recordings of a sandbox's HTTP exchanges, and replaying them: plain, versioned data on disk.

``<net_dir>/recordings/<scope or _host>/<name>/`` holds ``index.jsonl`` (a format line first, then one
line per exchange) and ``blobs/<sha256>``, the request and response bodies by content. An exchange is
matched by method, normalized URL and request body digest; ``ordinal`` counts repeats of that key, so
a replay serves the n-th recorded answer to the n-th same request (then the last one again).
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache import CacheWriter, HashedFile

FORMAT = {"format": "fanfold-recording", "version": 1}
DEFAULT_PORTS = {"http": 80, "https": 443}
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()

Key = tuple[str, str, str]
"""method, normalized URL, request body sha256."""


def normal_url(scheme: str, host: str, port: int, path: str) -> str:
    """``scheme://host[:port]path?query``: lowercase host, the port only when not the scheme's default,
    the path and query as sent."""
    host = host.lower()
    shown = f"[{host}]" if ":" in host else host
    if port != DEFAULT_PORTS.get(scheme):
        shown = f"{shown}:{port}"
    return f"{scheme}://{shown}{path or '/'}"


MAX_RECORDED_BODY = 1 << 30
"""The largest request or response body a recording keeps; an exchange with a larger one is not recorded."""


class RecordingFull(Exception):
    """A tenant's recordings hold all its quota allows; the message says which quota and what to do.
    It never leaves netd (the sandbox gets a 507)."""


class BlobWriter(HashedFile):
    """A body written to a temporary file (in ``parts``, outside every recording) while it streams,
    hashed, and moved into ``directory`` under its digest when whole."""

    def __init__(self, parts: Path, directory: Path) -> None:
        self.directory = directory
        super().__init__(parts / f"part-{secrets.token_hex(8)}")

    def commit(self) -> str:
        """Keep the body under its digest (one copy per content); its sha256."""
        return self.keep_in(self.directory)[0]

    def discard(self) -> None:
        self.handle.close()
        self.temp.unlink(missing_ok=True)


@dataclass
class Exchange:
    """One recorded request and its response, as a line of ``index.jsonl``."""

    method: str
    url: str
    request_headers: list[list[str]]
    request_body_sha256: str
    status: int
    response_headers: list[list[str]]
    response_body_sha256: str
    ordinal: int
    started: float
    duration_ms: float

    @property
    def key(self) -> Key:
        return (self.method, self.url, self.request_body_sha256)


class Recorder:
    """Appends exchanges to one recording; every sandbox recording into it shares this one writer, so
    lines never interleave (the event loop is the lock: each line is one write, of O_APPEND). The
    index is opened per line, so that a netd holds no descriptor of a recording the engine deletes.
    Nothing of a new recording is on disk until its first exchange is whole (``started``)."""

    def __init__(self, directory: Path, budget: Budget | None = None) -> None:
        self.directory = directory
        self.blobs = directory / "blobs"
        self.parts = directory.parent / PARTS
        self.budget = budget or Budget()
        index = directory / "index.jsonl"
        self.ordinals: collections.Counter[Key] = collections.Counter()
        if index.exists():  # recording again under a name continues it
            for exchange in _read_index(index):
                self.ordinals[exchange.key] += 1
        self.index = index
        self.started = index.exists()

    def _start(self) -> None:
        self.blobs.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.blobs / EMPTY_SHA256).touch(mode=0o600)  # every bodiless message's
        if not self.index.exists() or self.index.stat().st_size == 0:
            self._write(json.dumps(FORMAT).encode() + b"\n")
        self.started = True

    def _write(self, line: bytes) -> None:
        fd = os.open(self.index, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def blob(self) -> BlobWriter:
        self.parts.mkdir(mode=0o700, exist_ok=True)
        return BlobWriter(self.parts, self.blobs)

    def keep(self, blob: BlobWriter | None) -> str:
        """Move a whole body into the recording (started now if it was not); its digest."""
        if not self.started or not self.blobs.is_dir():
            self._start()
        if blob is None:
            return EMPTY_SHA256
        self.budget.used += blob.size
        return blob.commit()

    def append(self, **fields: Any) -> Exchange:
        """Add one exchange (``ordinal`` is counted here); the line is written whole."""
        if not self.started:
            self._start()
        key = (fields["method"], fields["url"], fields["request_body_sha256"])
        exchange = Exchange(**fields, ordinal=self.ordinals[key])
        self.ordinals[key] += 1
        self._write(json.dumps(exchange.__dict__, separators=(",", ":")).encode() + b"\n")
        return exchange


class Recording:
    """A recording read for replay: the exchanges of each key, in the order they were recorded."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.exchanges: dict[Key, list[Exchange]] = collections.defaultdict(list)
        for exchange in _read_index(directory / "index.jsonl"):
            self.exchanges[exchange.key].append(exchange)
        for found in self.exchanges.values():
            found.sort(key=lambda e: e.ordinal)

    def find(self, key: Key, seen: int) -> Exchange | None:
        """The answer to the ``seen``-th (from 0) repeat of ``key``: that recording's, or its last."""
        found = self.exchanges.get(key)
        return found[min(seen, len(found) - 1)] if found else None

    def blob(self, digest: str) -> Path:
        return self.directory / "blobs" / digest


def _read_index(index: Path) -> list[Exchange]:
    with open(index, "rb") as handle:
        lines = handle.read().splitlines()
    if not lines:
        return []
    head = json.loads(lines[0])
    if head.get("format") != FORMAT["format"] or head.get("version") != FORMAT["version"]:
        raise ValueError(f"{index} is not a fanfold recording of version {FORMAT['version']}: {lines[0][:100]!r}")
    return [Exchange(**json.loads(line)) for line in lines[1:] if line.strip()]


PARTS = ".parts"
"""Per tenant, beside its recordings: the bodies being written (no recording name starts with a dot)."""
RECOUNT_S = 10.0


@dataclass
class Budget:
    """What one tenant's recordings may take (``None``: no limit) and what they take now."""

    max_bytes: int | None = None
    max_count: int | None = None
    used: int = 0
    """Bytes of bodies: counted from disk every RECOUNT_S (recordings the engine deleted), added to between."""
    counted: float = -RECOUNT_S

    def room(self) -> int | None:
        """Bytes of bodies the tenant may still record; None: no limit."""
        return None if self.max_bytes is None else self.max_bytes - self.used


class Recordings:
    """The recordings under ``<net_dir>/recordings``: writers shared by name, indexes read once (again when
    they change), and each tenant's quota (``limit``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.recorders: dict[Path, Recorder] = {}
        self.budgets: dict[str, Budget] = {}
        self._read: dict[Path, tuple[tuple[int, int], Recording]] = {}
        for parts in root.glob(f"*/{PARTS}"):  # bodies a netd that died was writing
            shutil.rmtree(parts, ignore_errors=True)

    def directory(self, scope: str, name: str) -> Path:
        return self.root / (scope or "_host") / name

    def limit(self, scope: str, max_bytes: int | None, max_count: int | None) -> None:
        """Set the quota of ``scope``'s recordings (bytes of bodies, how many)."""
        budget = self.budgets.setdefault(scope, Budget())
        budget.max_bytes, budget.max_count = max_bytes, max_count

    def budget(self, scope: str) -> Budget:
        """``scope``'s quota, its use counted again from disk when the count is old."""
        budget = self.budgets.setdefault(scope, Budget())
        if budget.max_bytes is not None and time.monotonic() - budget.counted > RECOUNT_S:
            where = self.root / (scope or "_host")
            budget.used = sum(_size(blob) for blob in where.glob("*/blobs/*"))
            budget.counted = time.monotonic()
        return budget

    def recorder(self, scope: str, name: str) -> Recorder:
        """The writer of recording ``name``; RecordingFull when ``scope`` may record no more."""
        where = self.directory(scope, name)
        budget = self.budget(scope)
        room = budget.room()
        if room is not None and room <= 0:
            raise RecordingFull(f"the tenant's recordings take {budget.used >> 20} MiB of the {budget.max_bytes >> 20}"
                                " MiB its quota allows (recordings_mb)")
        recorder = self.recorders.get(where)
        if recorder is None or (recorder.started and not recorder.index.exists()):  # deleted meanwhile: anew
            if budget.max_count is not None and not (where / "index.jsonl").exists():
                held = sum(1 for index in where.parent.glob("*/index.jsonl"))
                if held >= budget.max_count:
                    raise RecordingFull(f"the tenant keeps {held} recordings, as many as its quota allows (recordings),"
                                        f" and {name!r} would be a new one")
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            where.parent.mkdir(mode=0o700, exist_ok=True)
            recorder = self.recorders[where] = Recorder(where, budget)
        return recorder

    def recording(self, scope: str, name: str) -> Recording | None:
        """The recording as it is on disk now (read again when its index changed); None when there is none."""
        where = self.directory(scope, name)
        try:
            stat = (where / "index.jsonl").stat()
        except FileNotFoundError:
            return None
        version = (stat.st_size, stat.st_mtime_ns)
        cached = self._read.get(where)
        if cached is None or cached[0] != version:
            cached = self._read[where] = (version, Recording(where))
        return cached[1]


MAX_SPOOLED_BODY = 64 << 20
"""The largest request body a replay keeps to send on (a live miss); a larger one is refused (413)."""
SPOOL_IN_MEMORY = 1 << 20


class Spool(HashedFile):
    """A request body read whole before it is answered (to match it in a recording), hashed and counted.
    Its bytes are kept only when ``keep`` (a replay's live miss may send it on): in memory, then in a
    file under ``directory`` (netd's own, never /tmp) that is unlinked from the start, so no way out
    leaves it behind. Without ``directory`` it stays in memory."""

    def __init__(self, directory: Path | None = None, *, keep: bool = False, limit: int = MAX_SPOOLED_BODY) -> None:
        self.keep = keep
        handle = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY if directory else limit + 1,
                                               dir=directory) if keep else io.BytesIO()
        super().__init__(handle=handle)  # type: ignore[arg-type]

    def write(self, data: bytes) -> None:
        if self.keep:
            self.handle.write(data)
        self.sha.update(data)
        self.size += len(data)


@dataclass
class Taps:
    """Where one exchange is copied as it streams, besides the client: a recording, the cache. Nothing
    is kept unless ``commit`` is called once the response is whole."""

    recorder: Recorder | None = None
    cache: CacheWriter | None = None
    started: float = field(default_factory=time.time)
    clock: float = field(default_factory=time.monotonic)
    method: str = ""
    url: str = ""
    request_headers: list[list[str]] = field(default_factory=list)
    request_blob: BlobWriter | None = None
    response_blob: BlobWriter | None = None
    status: int = 0
    response_headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    def request(self, method: str, url: str, headers: list[tuple[bytes, bytes]]) -> None:
        self.method, self.url = method, url
        if self.recorder is not None:
            self.request_headers = redacted(text_pairs(headers))

    refused: str | None = None
    """Why the exchange was not recorded (its tenant's quota), to be reported."""

    def request_data(self, data: bytes) -> None:
        if self.recorder is not None:
            if self.request_blob is None:
                self.request_blob = self.recorder.blob()
            self.request_blob.write(data)
            self._within_cap(self.request_blob)

    def response(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.response_headers = status, headers
        if self.cache is not None and not self.cache.may_keep(status, headers):
            self.cache.discard()
            self.cache = None

    def response_data(self, data: bytes) -> None:
        if self.recorder is not None:
            if self.response_blob is None:
                self.response_blob = self.recorder.blob()
            self.response_blob.write(data)
            self._within_cap(self.response_blob)
        if self.cache is not None:
            self.cache.write(data)

    def _within_cap(self, blob: BlobWriter) -> None:
        """A body past MAX_RECORDED_BODY, or bodies past the room the tenant's quota leaves, are not
        recorded (the exchange still goes through): a sandbox must not fill the host's disk through
        its recording."""
        assert self.recorder is not None
        room = self.recorder.budget.room()
        taken = sum(kept.size for kept in (self.request_blob, self.response_blob) if kept is not None)
        if room is not None and taken > room:
            self.refused = (f"not recorded: its bodies would take the tenant's recordings past the"
                            f" {self.recorder.budget.max_bytes >> 20} MiB its quota allows (recordings_mb)")
        if blob.size > MAX_RECORDED_BODY or self.refused:
            for kept in (self.request_blob, self.response_blob):
                if kept is not None:
                    kept.discard()
            self.request_blob = self.response_blob = None
            self.recorder = None

    def commit(self) -> bool:
        """Keep what the whole exchange left (the cache's body, the recording's line); True when recorded."""
        if self.cache is not None:
            self.cache.commit(self.response_headers)
            self.cache = None
        if self.recorder is None or not self.status:
            return False
        request_blob, self.request_blob = self.request_blob, None
        response_blob, self.response_blob = self.response_blob, None
        self.recorder.append(method=self.method, url=self.url, request_headers=self.request_headers,
                             request_body_sha256=self.recorder.keep(request_blob),
                             status=self.status, response_headers=text_pairs(self.response_headers),
                             response_body_sha256=self.recorder.keep(response_blob),
                             started=self.started, duration_ms=round((time.monotonic() - self.clock) * 1e3, 3))
        self.recorder = None
        return True

    def discard(self) -> None:
        """Drop what an unfinished exchange left (nothing once committed)."""
        for blob in (self.request_blob, self.response_blob):
            if blob is not None:
                blob.discard()
        self.request_blob = self.response_blob = None
        if self.cache is not None:
            self.cache.discard()
            self.cache = None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def text_pairs(headers: Any) -> list[list[str]]:
    """Header pairs as JSON keeps them."""
    return [[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers]


CREDENTIALS = {"authorization", "proxy-authorization", "cookie", "x-api-key", "api-key", "x-auth-token",
               "private-token", "x-goog-api-key", "x-amz-security-token"}
"""Request headers a recording keeps only the name of: replay matches no header, and a recording is a
file to share, not a vault."""


def redacted(pairs: list[list[str]]) -> list[list[str]]:
    return [[name, "<redacted>" if name.lower() in CREDENTIALS else value] for name, value in pairs]
