"""Moving a snapshot from one engine to another over HTTP (cluster nodes, each with its own state dir).

The source streams one uncompressed tar: ``manifest.json`` first (the snapshot's row, the rows of
the snapshots whose layers it stacks on, its image's record, and which layers and memory follow),
then ``layers/<name>/…`` for each layer the puller lacks, ``memory/…`` for a memory snapshot, and
``end`` last: a stream without it broke off. Layer trees travel exactly: numeric owners, modes
(setuid included), times, hard links, whiteout devices and extended attributes (opaque dirs, file
capabilities) as pax headers.

The puller checks every member before it is written (``_Checker``: nothing lands outside its
staging dir), extracts under the snapshots dir, renames the layers and the memory dir into place,
and only then inserts the rows, as a local snapshot is committed: a crash leaves no half snapshot
behind a row. The snapshot keeps its id (and the node tag in it) and its name.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import io
import json
import os
import posixpath
import re
import shutil
import sqlite3
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable
from urllib.parse import quote, urlsplit

from .. import wire
from ..ids import is_snapshot_id
from ..errors import (
    FanfoldError, ImageCorrupt, ImageNotFound, InfrastructureError, InvalidRequest, NotFound, Retryable,
    SnapshotNotFound, Unauthorized,
)
from ..host.offload import host_errors, on_thread
from ..images import Image, LayerStore
from ..models import SnapshotInfo
from ..refs import is_image_id
from ..transport.h1 import Client, ConnectionLost
from . import db as dbmod
from .snapshots import PREFIX, SnapshotStore

FORMAT = 1
MANIFEST, END = "manifest.json", "end"
CHUNK = 1 << 20
MAX_MANIFEST = 16 << 20
MAX_HAVE_BYTES = 48 * 1024
"""How much of a URL a puller fills with the layers it holds (a server takes 64 KiB of head); a layer
it holds but leaves out is sent again, and kept once."""
TAR = "application/x-tar"
IDLE_TIMEOUT_S = 60.0
"""How long an import waits for the source's next bytes before it gives up."""
_LAYER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
_XATTR = "SCHILY.xattr."
_F_SETPIPE_SZ = 1031
_TAR_THREADS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="fanfold-transfer")
"""Where archives are written and unpacked: a slow peer holds a thread for as long as it takes, so not the
loop's default pool, which the rest of the engine waits on."""


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one export sends."""

    manifest: bytes
    layers: tuple[tuple[str, str], ...]
    """(name, directory) of each layer, the directory with a pulled layer's link followed."""
    memory: Path | None


@dataclasses.dataclass(frozen=True)
class _Manifest:
    """What an import received: the snapshot and its ancestors (bottom first), each with its layer stack."""

    snapshot: tuple[SnapshotInfo, tuple[str, ...]]
    ancestors: tuple[tuple[SnapshotInfo, tuple[str, ...]], ...]
    image: Image
    layers: frozenset[str]
    memory: bool


class Transfers:
    """Exports and imports of one engine's snapshots."""

    def __init__(self, db: dbmod.Database, store: LayerStore, snaps: SnapshotStore) -> None:
        self.db, self.store, self.snaps = db, store, snaps

    # -- export -------------------------------------------------------------------------------

    async def export(self, ref: str, *, have: set[str], tenant: str | None = None) -> AsyncIterator[bytes]:
        """The tar of snapshot ``ref`` (of ``tenant``, when given) less the layers named in ``have``.
        Unknown snapshots fail here, before any byte is streamed."""
        row = self.snaps.row(ref, tenant or "")
        if tenant is not None and row["tenant"] != tenant:
            raise SnapshotNotFound(f"no snapshot {ref!r}")
        plan = await asyncio.to_thread(self._plan, row, frozenset(have))
        return _stream(plan)

    def _plan(self, row: Any, have: frozenset[str]) -> _Plan:
        stack = dbmod.row_layers(row)
        ancestors = [self.snaps.row(layer) for layer in stack if layer.startswith(PREFIX) and layer != row["id"]]
        image = self.store.load_image(row["image_id"])
        names = dict.fromkeys(self.store.layer_path(layer).name for layer in (*image.layers, *stack))
        layers = []
        for name in names:
            if name in have:
                continue
            path = os.path.realpath(self.store.layers_dir / name)  # a pulled layer: its link's diff dir
            if not os.path.isdir(path):
                raise InfrastructureError(f"layer {name} of snapshot {row['id']} is missing from this host's store")
            layers.append((name, path))
        memory = self.snaps.memory_dir(row["id"]) if row["memory"] else None
        memory = memory if memory is not None and memory.is_dir() else None  # a resumed suspend's is freed
        manifest = {
            "format": FORMAT, "snapshot": _row_json(row), "ancestors": [_row_json(a) for a in ancestors],
            "image": json.loads(image.stored().to_json()), "layers": [name for name, _ in layers],
            "memory": memory is not None,
        }
        return _Plan(json.dumps(manifest).encode(), tuple(layers), memory)

    # -- import -------------------------------------------------------------------------------

    async def pull(self, source: str, snapshot_id: str, *, token: str | None, tenant: str) -> SnapshotInfo:
        """Snapshot ``snapshot_id`` of the server at ``source``, fetched and committed here for
        ``tenant``; one already here is returned as it is."""
        base = _source_url(source)
        if not is_snapshot_id(snapshot_id):
            raise InvalidRequest(f"bad snapshot id {snapshot_id!r}: give the id (snap-…) the source server gave it")
        if token is not None and (not isinstance(token, str) or not token.isprintable() or " " in token or not token):
            raise InvalidRequest("a token is printable characters without spaces")
        async with self.store.alock(hashlib.sha256(f"import:{snapshot_id}".encode()).hexdigest()):
            if (row := self.db.snapshot(snapshot_id)) is not None:
                return dbmod.snapshot_info(row)
            # No layer gc meanwhile: layers named as held, or moved in before a row names them, stay.
            async with self.store.making():
                have = await asyncio.to_thread(self._held)
                staged = self.snaps.staging(snapshot_id)
                try:
                    async with _fetch(base, snapshot_id, token, have) as chunks:
                        manifest = await _receive(chunks, staged, base)
                    _check_manifest(manifest, snapshot_id, base)
                    with host_errors(f"committing snapshot {snapshot_id} from {base} failed"):
                        info = await on_thread(self._commit, staged, manifest, tenant, executor=None)
                finally:
                    shutil.rmtree(staged, ignore_errors=True)
        return info

    def _held(self) -> set[str]:
        """Layers this store holds: built and pulled ones, and snapshots' whose row is here (a layer
        without one is a crash's leftover, which ``discard_orphans`` may remove at any moment)."""
        rows = {row["id"] for row in self.db.snapshot_rows()}
        held = set()
        for path in self.store.layers_dir.iterdir():
            if path.name.startswith(".") or not path.is_dir():
                continue
            if not path.name.startswith(PREFIX) or path.name in rows:
                held.add(path.name)
        return held

    def _commit(self, staged: Path, manifest: _Manifest, tenant: str) -> SnapshotInfo:
        """Image record, layers, memory, then rows (bottom first): each in place before a row names it."""
        top, stack = manifest.snapshot
        if top.name is not None and self.db.snapshot(top.name, tenant) is not None:
            raise InvalidRequest(f"a snapshot named {top.name!r} exists already here: delete or rename it,"
                                 " then import again")
        try:
            self.store.load_image(manifest.image.id)
        except ImageNotFound:
            self.store.save_image(manifest.image)
        if tenant:
            self.db.grant_image(manifest.image.id, tenant)
        rows = {row["id"] for row in self.db.snapshot_rows()}
        for name in manifest.layers:
            if name.startswith(PREFIX) and name not in rows:  # a crash's leftover: replaced, with its subvolume
                self.store.remove_layer(name)
            _move_in(staged / "layers" / name, self.store.layers_dir / name)
        missing = [layer for layer in (*manifest.image.layers, *stack) if not self.store.layer_path(layer).is_dir()]
        if missing:  # one named as held was deleted meanwhile (a snapshot of it deleted here)
            raise InfrastructureError(f"layers {', '.join(missing[:3])} of {top.id} went away during the import: retry")
        if manifest.memory:
            (staged / "snapshot").mkdir()
            os.rename(staged / "memory", staged / "snapshot" / "memory")
        for info, layers in manifest.ancestors:
            self._insert(dataclasses.replace(info, name=None), layers, tenant, None)
        return self._insert(top, stack, tenant, staged / "snapshot" if manifest.memory else None)

    def _insert(self, info: SnapshotInfo, layers: tuple[str, ...], tenant: str, files: Path | None) -> SnapshotInfo:
        """A row for ``info`` (its dir moved or made first), unless one is here already."""
        if (row := self.db.snapshot(info.id)) is not None:
            return dbmod.snapshot_info(row)
        home = self.snaps.dir / info.id
        if files is not None:
            _move_in(files, home, replace=True)  # no row names it: a crash's leftover
        else:
            home.mkdir(exist_ok=True)
        try:
            self.db.insert_snapshot(info, layers=layers, tenant=tenant)
        except sqlite3.IntegrityError:
            if (row := self.db.snapshot(info.id)) is not None and row["id"] == info.id:
                return dbmod.snapshot_info(row)  # another engine on this state dir imported it meanwhile
            raise InvalidRequest(f"a snapshot named {info.name!r} exists already here: delete or rename it,"
                                 " then import again") from None
        return info


# -- the export's stream ------------------------------------------------------------------------


async def _stream(plan: _Plan) -> AsyncIterator[bytes]:
    """The tar, written by a thread into a pipe and read from it here: memory-bounded at any size.
    If the reader stops (the client went away), the writer's next write fails and it ends."""
    loop = asyncio.get_running_loop()
    read_fd, write_fd = os.pipe()
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_fd, _F_SETPIPE_SZ, CHUNK)
    reader = asyncio.StreamReader(limit=CHUNK)
    try:
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(read_fd, "rb", buffering=0))
    except BaseException:
        os.close(write_fd)
        raise
    writing = loop.run_in_executor(_TAR_THREADS, _write_tar, write_fd, plan)
    writing.add_done_callback(lambda done: done.exception())  # its failure shows as a stream without ``end``
    try:
        while chunk := await reader.read(CHUNK):
            yield chunk
    finally:
        transport.close()


def _write_tar(fd: int, plan: _Plan) -> None:
    # tarfile's plain write mode copies in CHUNK-sized reads and writes (its stream mode cuts all into
    # 10 KiB records in Python, holding the GIL the server's loop wants); it asks its file for tell() once.
    with open(fd, "wb", buffering=CHUNK) as out, \
            tarfile.TarFile(fileobj=_Appender(out), mode="w", format=tarfile.PAX_FORMAT, copybufsize=CHUNK) as tar:
        _add_bytes(tar, MANIFEST, plan.manifest)
        for name, path in plan.layers:
            _add_tree(tar, path, f"layers/{name}")
        if plan.memory is not None:
            _add_tree(tar, str(plan.memory), "memory")
        _add_bytes(tar, END, b"")


class _Appender:
    """A pipe as tarfile's write mode sees a file: it writes, and asks where it starts."""

    def __init__(self, out: Any) -> None:
        self.write = out.write

    def tell(self) -> int:
        return 0


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o600
    tar.addfile(info, io.BytesIO(data))


def _add_tree(tar: tarfile.TarFile, root: str, arcname: str) -> None:
    """``root`` and all below it (links not followed) as ``arcname/…``, with extended attributes."""

    def with_xattrs(info: tarfile.TarInfo) -> tarfile.TarInfo:
        path = root + info.name[len(arcname):]
        info.uname = info.gname = ""  # numeric owners only: the puller's names may differ
        try:
            names = os.listxattr(path, follow_symlinks=False)
        except OSError as err:
            if err.errno != errno.EOPNOTSUPP:
                raise
            names = []
        for name in names:
            value = os.getxattr(path, name, follow_symlinks=False)
            info.pax_headers[_XATTR + name] = value.decode("utf-8", "surrogateescape")
        return info

    tar.add(root, arcname=arcname, filter=with_xattrs)


# -- the import's fetch and extraction ----------------------------------------------------------


def _source_url(source: str) -> str:
    """``source`` as ``scheme://host:port``, or InvalidRequest."""
    try:
        parts = urlsplit(source)
        parts.port  # noqa: B018 - raises ValueError when out of range or not a number
        ok = parts.scheme in ("http", "https") and parts.hostname and parts.path in ("", "/") \
            and not (parts.query or parts.fragment or parts.username or parts.password)
    except (ValueError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise InvalidRequest(f"a source is a fanfold server's URL, http(s)://host:port, not {source!r}")
    return f"{parts.scheme}://{parts.netloc}"


@contextlib.asynccontextmanager
async def _fetch(base: str, snapshot_id: str, token: str | None, have: set[str]) -> AsyncIterator[AsyncIterator[bytes]]:
    """The export's body from ``base``; its errors as this server's."""
    parts = urlsplit(base)
    tls = parts.scheme == "https"
    client = Client(host=parts.hostname or "", port=parts.port or (443 if tls else 80), tls=tls,
                    headers={"Authorization": f"Bearer {token}"} if token else {})
    path = f"/v1/snapshots/{quote(snapshot_id, safe='')}/export"
    try:
        async with client.request("GET", path, params={"have": _have_param(have)}) as response:
            if response.status >= 400:
                raise _source_error(base, snapshot_id, response.status, await _body(response))
            kind = response.headers.get("content-type", "")
            if not kind.startswith(TAR):
                raise InvalidRequest(f"{base} is not a fanfold server that exports snapshots (it answered {kind!r})")
            yield _body_chunks(response.iter_any(), base)
    except ConnectionLost as err:
        raise InfrastructureError(f"cannot reach the source {base}: {err}") from None
    finally:
        await client.close()


def _have_param(have: set[str]) -> str:
    """``have`` comma-separated, at most MAX_HAVE_BYTES once in the URL."""
    names: list[str] = []
    size = 0
    for name in sorted(have):
        size += len(quote(name, safe="")) + 3  # and an encoded comma
        if size > MAX_HAVE_BYTES:
            break
        names.append(name)
    return ",".join(names)


async def _body(response: Any) -> Any:
    try:
        return await response.json()
    except (ValueError, ConnectionLost):
        return None


async def _body_chunks(chunks: AsyncIterator[bytes], base: str) -> AsyncIterator[bytes]:
    """The body's chunks; a source silent for ``IDLE_TIMEOUT_S`` ends the import (it holds gc off)."""
    try:
        while True:
            try:
                async with asyncio.timeout(IDLE_TIMEOUT_S):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            yield chunk
    except ConnectionLost as err:
        raise InfrastructureError(f"the transfer from {base} broke off: {err}") from None
    except TimeoutError:
        raise InfrastructureError(f"the transfer from {base} stalled: nothing came for {IDLE_TIMEOUT_S:g} s") from None


def _source_error(base: str, snapshot_id: str, status: int, body: Any) -> FanfoldError:
    """The source's refusal, as this server's answer names it."""
    err = wire.error_from_json(body, status)
    if isinstance(err, NotFound):
        return SnapshotNotFound(f"no snapshot {snapshot_id!r} at {base} (or not the token's): {err}")
    if isinstance(err, Unauthorized):
        return InvalidRequest(f"{base} refused the token: pass one it accepts (token=): {err}")
    if isinstance(err, Retryable) or status >= 500:
        return InfrastructureError(f"{base} could not export {snapshot_id}: {err}")
    return InvalidRequest(f"{base} refused to export {snapshot_id}: {err}")


async def _receive(chunks: AsyncIterator[bytes], staged: Path, base: str) -> _Manifest:
    """``chunks`` through a pipe into a thread that checks and extracts them under ``staged``."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_fd, _F_SETPIPE_SZ, CHUNK)
    extracting = asyncio.get_running_loop().run_in_executor(_TAR_THREADS, _extract, read_fd, staged, base)
    try:
        async for chunk in chunks:
            if not await _write_all(write_fd, chunk):
                break  # the extractor stopped: its outcome says why
    finally:
        os.close(write_fd)
        await _settled(extracting)  # even when cancelled: ``staged`` is removed next
    return extracting.result()


async def _write_all(fd: int, data: bytes) -> bool:
    """Write all of ``data`` to a non-blocking pipe, waiting on the loop while it is full; False if
    the reader has gone."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            await _writable(fd)
        except BrokenPipeError:
            return False
    return True


async def _writable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_writer(fd)


async def _settled(future: Awaitable[Any]) -> None:
    """Wait for a thread's future to end, through cancellations (re-raised after)."""
    cancelled = False
    while True:
        try:
            await asyncio.shield(future)
            break
        except asyncio.CancelledError:
            if future.done():  # type: ignore[attr-defined]
                break
            cancelled = True
        except BaseException:  # noqa: BLE001 - read by the caller through .result()
            break
    if cancelled:
        raise asyncio.CancelledError()


def _extract(fd: int, staged: Path, base: str) -> _Manifest:
    with open(fd, "rb", buffering=CHUNK) as source:
        try:
            with tarfile.open(fileobj=source, mode="r|") as tar:
                tar.errorlevel = 2  # a failed chown or chmod fails the import, not only a log line
                return _Unpacker(tar, staged, base).run()
        except (tarfile.TarError, EOFError) as err:
            raise InfrastructureError(f"the snapshot archive from {base} is broken or broke off: {err}") from None
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise InfrastructureError(f"no room for the snapshot from {base}: {err}") from None
            raise InfrastructureError(f"unpacking the snapshot from {base} failed: {err}") from None


class _Unpacker:
    """Extracts a checked archive member by member; directories' own attributes are set last,
    so a read-only one still receives its contents."""

    def __init__(self, tar: tarfile.TarFile, staged: Path, base: str) -> None:
        self.tar, self.staged, self.base = tar, staged, base

    def run(self) -> _Manifest:
        members = iter(self.tar)
        first = next(members, None)
        if first is None or first.name != MANIFEST or not first.isreg() or first.size > MAX_MANIFEST:
            raise ImageCorrupt(f"the archive from {self.base} does not start with a snapshot manifest")
        handle = self.tar.extractfile(first)
        assert handle is not None
        manifest = _parse_manifest(handle.read(), self.base)
        check = _Checker(manifest, self.base)
        directories: list[tarfile.TarInfo] = []
        ended = False
        for member in members:
            if ended or member.name == END:
                if ended or not member.isreg():
                    raise ImageCorrupt(f"the archive from {self.base} goes on after its end")
                ended = True
                continue
            check(member)
            # Checked above: every parent is a directory of this archive, no name repeats, and a hard
            # link names an earlier file: nothing written here can lead outside ``staged``.
            self.tar.extract(member, self.staged, set_attrs=not member.isdir(), numeric_owner=True,
                             filter="fully_trusted")
            if member.isdir():
                directories.append(member)
            else:
                _set_xattrs(member, self.staged / member.name)
        if not ended:
            raise InfrastructureError(f"the snapshot archive from {self.base} broke off")
        check.complete()
        for member in reversed(directories):
            path = str(self.staged / member.name)
            self.tar.chown(member, path, True)
            self.tar.chmod(member, path)
            self.tar.utime(member, path)
            _set_xattrs(member, Path(path))
        return manifest


def _set_xattrs(member: tarfile.TarInfo, path: Path) -> None:
    """After chown, which clears file capabilities."""
    for key, value in member.pax_headers.items():
        if key.startswith(_XATTR):
            os.setxattr(path, key[len(_XATTR):], value.encode("utf-8", "surrogateescape"), follow_symlinks=False)


class _Checker:
    """Refuses any member that could write outside the staging dir or make what a layer may not hold.

    Names are canonical and relative, under ``layers/<a layer the manifest names>`` or ``memory``;
    each appears once, after its parent directory (so no member is written through a link, the
    staging dir being fresh and private); a hard link names an earlier regular file; the only
    devices are overlayfs' whiteouts (character 0:0), and only in layers.
    """

    def __init__(self, manifest: _Manifest, base: str) -> None:
        self.roots = {f"layers/{name}" for name in manifest.layers} | ({"memory"} if manifest.memory else set())
        self.base = base
        self.seen: dict[str, str] = {}

    def __call__(self, member: tarfile.TarInfo) -> None:
        name = member.name
        if not name or "\0" in name or name.startswith("/") or posixpath.normpath(name) != name \
                or ".." in name.split("/") or name in self.seen:
            self._refuse(member, "a bad or repeated name")
        root = name if name in self.roots else "/".join(name.split("/")[:2 if name.startswith("layers/") else 1])
        if root not in self.roots:
            self._refuse(member, "outside what the manifest names")
        if name == root and not member.isdir():
            self._refuse(member, "not a directory")
        if name != root and self.seen.get(posixpath.dirname(name)) != "dir":
            self._refuse(member, "not below a directory of the archive")
        self.seen[name] = self._kind(member, in_layer=root != "memory")

    def _kind(self, member: tarfile.TarInfo, *, in_layer: bool) -> str:
        if member.isdir():
            return "dir"
        if member.isreg():
            return "file"
        if member.issym() and in_layer:
            return "link"  # never followed here: no later member may be below it
        if member.islnk():
            if self.seen.get(member.linkname) != "file":
                self._refuse(member, "a hard link to no earlier file")
            return "file"
        if in_layer and (member.isfifo() or (member.ischr() and member.devmajor == 0 and member.devminor == 0)):
            return "other"
        self._refuse(member, "a kind of file a snapshot does not hold")
        raise AssertionError  # unreachable

    def complete(self) -> None:
        missing = sorted(self.roots - self.seen.keys())
        if missing:
            raise ImageCorrupt(f"the archive from {self.base} lacks {', '.join(missing[:3])}")

    def _refuse(self, member: tarfile.TarInfo, why: str) -> None:
        raise ImageCorrupt(f"the snapshot archive from {self.base} is not a safe tree: {member.name!r} is {why}")


# -- the manifest -------------------------------------------------------------------------------


def _row_json(row: Any) -> dict[str, Any]:
    return {"info": wire.snapshot_to_json(dbmod.snapshot_info(row)), "layers": list(dbmod.row_layers(row))}


def _parse_manifest(data: bytes, base: str) -> _Manifest:
    try:
        raw = json.loads(data)
        if raw.get("format") != FORMAT:
            raise ImageCorrupt(f"the snapshot archive from {base} has format {raw.get('format')!r}, not {FORMAT}:"
                               " run the same fanfold version on both")
        layers = raw["layers"]
        if not isinstance(layers, list) or not all(isinstance(n, str) and _LAYER_NAME.match(n) for n in layers):
            raise ValueError("bad layer names")
        return _Manifest(
            snapshot=_parse_row(raw["snapshot"]), ancestors=tuple(_parse_row(r) for r in raw["ancestors"]),
            image=Image.from_dict(raw["image"]), layers=frozenset(layers), memory=raw["memory"] is True,
        )
    except ImageCorrupt:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, FanfoldError) as err:
        raise ImageCorrupt(f"the snapshot manifest from {base} is malformed: {type(err).__name__}: {err}") from None


def _parse_row(raw: dict[str, Any]) -> tuple[SnapshotInfo, tuple[str, ...]]:
    info = wire.snapshot_from_json(raw["info"])
    layers = raw["layers"]
    if not isinstance(layers, list) or not all(isinstance(layer, str) and _LAYER_NAME.match(layer) for layer in layers):
        raise ValueError("bad layer stack")
    if not is_snapshot_id(info.id) or not isinstance(info.name, (str, type(None))):
        raise ValueError(f"bad snapshot id {info.id!r}")
    return info, tuple(layers)


def _check_manifest(manifest: _Manifest, snapshot_id: str, base: str) -> None:
    """The snapshot asked for, its ancestors the snapshots in its stack, its image the one it names."""
    top, stack = manifest.snapshot
    stacked = {layer for layer in stack if layer.startswith(PREFIX)}
    problems = []
    if top.id != snapshot_id or top.id not in stacked:
        problems.append(f"it holds {top.id!r}, not {snapshot_id!r}")
    if {info.id for info, _ in manifest.ancestors} != stacked - {top.id}:
        problems.append("its ancestors are not the snapshots it stacks on")
    if top.image_id != manifest.image.id or not is_image_id(manifest.image.id):
        problems.append(f"its image {manifest.image.id!r} is not the snapshot's")
    if not all(_LAYER_NAME.match(layer) for layer in manifest.image.layers):
        problems.append("its image names bad layers")
    if problems:
        raise ImageCorrupt(f"the snapshot archive from {base} is inconsistent: {'; '.join(problems)}")


def _move_in(staged: Path, target: Path, *, replace: bool = False) -> None:
    """Rename ``staged`` to ``target``; if that exists, it is kept (a layer another import or build made
    meanwhile), or with ``replace`` removed first. It gets the time it arrived, so ``discard_orphans`` does
    not take a snapshot's for a crash's leftover before its row is in."""
    if os.path.lexists(target):
        if not replace:
            return
        shutil.rmtree(target, ignore_errors=True)
    os.utime(staged)
    try:
        os.rename(staged, target)
    except OSError as err:
        if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
