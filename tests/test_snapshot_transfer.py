"""Moving snapshots between servers (a cluster's nodes), each with its own state dir, over loopback TCP.

Node A is a server on the session's state dir with a node tag; node B is a server on a state dir of
this module's own, fresh (so it starts holding no image and no layer), removed again at the end,
after its own leak check. Imports go through B's unix socket (the host's tenant), with the
tenant's token for A; sandboxes on B are made over TCP with that token (the snapshot is the
tenant's on B too). The archive's checks run on hand-made tars, without servers.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import stat
import tarfile
import uuid
from pathlib import Path

import httpx
import pytest

from fanfold import (
    AsyncFleet, EngineConfig, ImageCorrupt, InfrastructureError, InvalidRequest, SnapshotNotFound, Unauthorized,
)
from fanfold.client._http import HttpTransport
from fanfold.engine import db as dbmod
from fanfold.engine import snapshots as snapmod
from fanfold.engine import transfer
from fanfold.host import cgroups, disk, mounts
from fanfold.images import LayerStore

from conftest import STATE_DIR, TOKENS, leaks, start_server, stop_server
from test_snapshots import COUNTER, advances, count

STATE_B = STATE_DIR.with_name(STATE_DIR.name + "-node-b")
ALICE = TOKENS["alice"]
HOST = "cluster-host-token-0123456789"
"""Both nodes take it as their host's own tenant, as a cluster's nodes do."""


def _remove_state(path: Path) -> None:
    if not path.exists():
        return
    assert not mounts.mounts_under(path) and not disk.ready(path), f"{path} still has mounts: not removing it"
    shutil.rmtree(path)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory):
    _remove_state(STATE_B)
    a = start_server(STATE_DIR, tmp_path_factory.mktemp("node-a"), "--host-token", HOST,
                     env={"FANFOLD_PULL": "never", "FANFOLD_NODE_TAG": "nodea"})
    try:
        b = start_server(STATE_B, tmp_path_factory.mktemp("node-b"), "--host-token", HOST,
                         env={"FANFOLD_PULL": "never", "FANFOLD_NODE_TAG": "nodeb"})
    except BaseException:
        stop_server(a)
        raise
    try:
        yield a, b
    finally:
        assert stop_server(b) == 0
        assert stop_server(a) == 0
        assert leaks(EngineConfig(state_dir=STATE_B)) == {"mounts": 0, "cgroups": 0, "containers": 0}
        assert not disk.ready(STATE_B)
        _remove_state(STATE_B)


@pytest.fixture
async def on_a(nodes):
    async with AsyncFleet(url=nodes[0].tcp_url, token=ALICE) as fleet:
        before = {s.id for s in await fleet.snapshots()}
        yield fleet
        for snapshot in reversed(await fleet.snapshots()):  # newest first: children before their parents
            if snapshot.id not in before:
                await fleet.delete_snapshot(snapshot.id)


@pytest.fixture
async def on_b(nodes):
    async with AsyncFleet(url=nodes[1].tcp_url, token=ALICE) as fleet:
        yield fleet
        for snapshot in reversed(await fleet.snapshots()):
            await fleet.delete_snapshot(snapshot.id)


@pytest.fixture
async def importer(nodes):
    """B's host tenant (its unix socket), which may make B fetch from A."""
    transport = HttpTransport(nodes[1].unix_url, None)
    yield lambda snapshot_id, **kw: transport.import_snapshot(nodes[0].tcp_url, snapshot_id, **{"token": ALICE, **kw})
    await transport.close()


def held_layers() -> set[str]:
    return {p.name for p in (STATE_B / "layers").iterdir() if not p.name.startswith(".")}


def exported_layers(nodes, snapshot_id: str, have: set[str]) -> set[str]:
    """The layers A's export of ``snapshot_id`` carries to a puller holding ``have``."""
    with httpx.stream("GET", f"{nodes[0].tcp_url}/v1/snapshots/{snapshot_id}/export", params={"have": ",".join(have)},
                      headers={"Authorization": f"Bearer {ALICE}"}, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "application/x-tar"
        with tarfile.open(fileobj=_Reader(response.iter_bytes()), mode="r|") as tar:
            return {m.name.split("/")[1] for m in tar if m.name.startswith("layers/") and m.name.count("/") == 1}


class _Reader(io.RawIOBase):
    def __init__(self, chunks) -> None:  # type: ignore[no-untyped-def]
        self.chunks, self.pending = iter(chunks), b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        while not self.pending:
            self.pending = next(self.chunks, None)
            if self.pending is None:
                return 0
        size = min(len(buffer), len(self.pending))
        buffer[:size], self.pending = self.pending[:size], self.pending[size:]
        return size


async def test_a_disk_snapshot_taken_on_a_starts_a_sandbox_on_b(on_a, on_b, importer):
    async with await on_a.create() as sandbox:
        await sandbox.exec("echo moved > /root/file; chmod 4751 /root/file; ln -s /etc/passwd /root/link")
        snapshot = await sandbox.snapshot(name=f"xfer-{uuid.uuid4().hex[:8]}")
    assert snapshot.id.startswith("snap-nodea-")
    imported = await importer(snapshot.id)
    assert (imported.id, imported.name, imported.parent, imported.image_id) == (
        snapshot.id, snapshot.name, snapshot.parent, snapshot.image_id)
    assert [s.id for s in await on_b.snapshots()] == [snapshot.id]  # alice's on B too: her token fetched it
    async with await on_b.create(snapshot.name) as copy:
        assert copy.id.startswith("sb-nodeb-")
        assert (await copy.exec("cat /root/file; stat -c %a /root/file; readlink /root/link")).text == \
            "moved\n4751\n/etc/passwd\n"


async def test_a_memory_snapshot_keeps_its_processes_on_b(on_a, on_b, importer):
    async with await on_a.create(memory_mb=256) as sandbox:
        await sandbox.exec(COUNTER)
        assert await advances(sandbox)
        before = await count(sandbox)
        snapshot = await sandbox.snapshot(memory=True)
    imported = await importer(snapshot.id)
    assert imported.memory and imported.limits.memory_mb == 256
    async with await on_b.create(snapshot.id) as copy:
        assert await count(copy) >= before  # the loop goes on from where it was: a disk snapshot would start none
        assert await advances(copy)


async def test_a_memory_snapshot_restores_as_a_nodes_first_sandbox(on_a, on_b, importer):
    async with await on_a.create() as sandbox:
        await sandbox.exec(COUNTER)
        snapshot = await sandbox.snapshot(memory=True)
    await importer(snapshot.id)
    cgroups.remove_parent(EngineConfig(state_dir=STATE_B).cgroup_parent)  # as after a restart, with no sandbox
    async with await on_b.create(snapshot.id) as copy:
        assert (await copy.exec("cat /tmp/count")).ok


async def test_a_snapshot_of_a_snapshot_brings_its_ancestors_and_only_missing_layers_move(
        nodes, on_a, on_b, importer):
    async with await on_a.create() as sandbox:
        await sandbox.exec("echo one > /root/one")
        first = await sandbox.snapshot(name=f"first-{uuid.uuid4().hex[:8]}")
    async with await on_a.create(first.id) as child:
        await child.exec("echo two > /root/two")
        second = await child.snapshot()
        await child.exec("echo three > /root/three")
        third = await child.snapshot()
    assert second.parent == first.id

    await importer(second.id)  # B gets first's row too, unnamed: its layer is second's lower one
    assert {s.id: s.name for s in await on_b.snapshots()} == {first.id: None, second.id: None}
    async with await on_b.create(second.id) as copy:
        assert (await copy.exec("cat /root/one /root/two")).text == "one\ntwo\n"
    async with await on_b.create(first.id) as copy:
        assert (await copy.exec("cat /root/one; ls /root/two")).exit_code != 0

    have = held_layers()
    assert exported_layers(nodes, third.id, have) == {third.id}  # the image's and first's layers are held
    assert first.id in exported_layers(nodes, third.id, set())
    await importer(third.id)
    async with await on_b.create(third.id) as copy:
        assert (await copy.exec("cat /root/one /root/two /root/three")).text == "one\ntwo\nthree\n"

    # B's own housekeeping keeps what came: every file has a row naming it, however old it looks.
    store = LayerStore(STATE_B)
    snaps = snapmod.SnapshotStore(STATE_B, store, dbmod.Database(STATE_B / "fanfold.db"))
    old, snapmod._ORPHAN_AGE_S = snapmod._ORPHAN_AGE_S, -60
    try:
        snaps.discard_orphans()
    finally:
        snapmod._ORPHAN_AGE_S = old
        snaps.db.close()
    assert all(store.layer_path(s).is_dir() and (STATE_B / "snapshots" / s).is_dir()
               for s in (first.id, second.id, third.id))


async def test_a_host_token_imports_the_hosts_snapshot_with_itself(nodes, importer):
    """A cluster's driver: the host token on both nodes, sent on to the source when no token is given."""
    async with AsyncFleet(url=nodes[0].tcp_url, token=HOST) as on_a, AsyncFleet(url=nodes[1].unix_url) as on_b:
        async with await on_a.create() as sandbox:
            await sandbox.exec("echo host > /root/host")
            snapshot = await sandbox.snapshot()
        with pytest.raises(SnapshotNotFound):  # the host's, not alice's
            await importer(snapshot.id)
        driver = HttpTransport(nodes[1].tcp_url, HOST)
        try:
            assert (await driver.import_snapshot(nodes[0].tcp_url, snapshot.id)).id == snapshot.id
        finally:
            await driver.close()
        assert snapshot.id in {s.id for s in await on_b.snapshots()}
        async with await on_b.create(snapshot.id) as copy:
            assert (await copy.exec("cat /root/host")).text == "host\n"
        await on_b.delete_snapshot(snapshot.id)
        await on_a.delete_snapshot(snapshot.id)


async def test_import_is_idempotent_also_when_two_run_at_once(on_a, on_b, importer):
    async with await on_a.create() as sandbox:
        await sandbox.exec("echo same > /root/same")
        snapshot = await sandbox.snapshot(memory=True)
    made = await asyncio.gather(importer(snapshot.id), importer(snapshot.id))
    again = await importer(snapshot.id)
    assert made[0] == made[1] == again and again.id == snapshot.id
    assert [s.id for s in await on_b.snapshots()] == [snapshot.id]
    assert not list((STATE_B / "snapshots").glob(".tmp-*")) and not list((STATE_B / "layers").glob(".tmp-*"))


async def test_refusals_are_clear(nodes, on_a, importer):
    async with await on_a.create() as sandbox:
        snapshot = await sandbox.snapshot()
    as_alice = HttpTransport(nodes[1].tcp_url, ALICE)
    try:
        with pytest.raises(Unauthorized, match="only the host's own tenant"):
            await as_alice.import_snapshot(nodes[0].tcp_url, snapshot.id)
    finally:
        await as_alice.close()
    with pytest.raises(SnapshotNotFound, match=nodes[0].tcp_url):
        await importer("snap-nodea-000000000000")
    with pytest.raises(SnapshotNotFound, match=nodes[0].tcp_url):  # bob's token: not his snapshot
        await importer(snapshot.id, token=TOKENS["bob"])
    with pytest.raises(InvalidRequest, match="refused the token"):
        await importer(snapshot.id, token="not-a-token-of-that-server")
    transport = HttpTransport(nodes[1].unix_url, None)
    try:
        for bad in ("ftp://elsewhere", "http://[", "http://host:99999", f"{nodes[0].tcp_url}/v1"):
            with pytest.raises(InvalidRequest, match=r"http\(s\)://host:port"):
                await transport.import_snapshot(bad, snapshot.id, token=ALICE)
        with pytest.raises(InfrastructureError, match="cannot reach the source"):
            await transport.import_snapshot("http://127.0.0.1:1", snapshot.id, token=ALICE)
        with pytest.raises(InvalidRequest, match="bad snapshot id|invalid request"):
            await transport.import_snapshot(nodes[0].tcp_url, "snap-../../etc", token=ALICE)
    finally:
        await transport.close()
    assert snapshot.id not in {p.name for p in (STATE_B / "snapshots").iterdir()}


# -- the archive's checks, on hand-made tars ------------------------------------------------------


def _manifest(layers: list[str], memory: bool = False) -> bytes:
    return transfer.json.dumps({
        "format": transfer.FORMAT, "layers": layers, "memory": memory,
        "snapshot": {"info": {"id": "snap-000000000001", "parent": "img-0000000000000000",
                              "image_id": "img-0000000000000000", "sandbox_id": "sb-1", "memory": memory,
                              "kind": "snapshot", "created_at": 1.0, "size_bytes": 0, "name": None, "limits": None},
                     "layers": ["snap-000000000001"]},
        "ancestors": [], "image": {"id": "img-0000000000000000", "base": "host", "layers": [], "host_dirs": [],
                                   "env": [], "workdir": "/", "services": []},
    }).encode()


def _tar(members: list[tuple[tarfile.TarInfo, bytes]], *, end: bool = True) -> bytes:
    """A manifest naming layer ``L``, ``members``, and (with ``end``) the end mark."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        manifest = tarfile.TarInfo(transfer.MANIFEST)
        manifest.size = len(data := _manifest(["L"]))
        tar.addfile(manifest, io.BytesIO(data))
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data else None)
        if end:
            tar.addfile(tarfile.TarInfo(transfer.END), io.BytesIO(b""))
    return buffer.getvalue()


def _member(name: str, kind: bytes = tarfile.DIRTYPE, **fields) -> tarfile.TarInfo:  # type: ignore[no-untyped-def]
    info = tarfile.TarInfo(name)
    info.type, info.mode = kind, fields.pop("mode", 0o755)
    for key, value in fields.items():
        setattr(info, key, value)
    return info


def _unpack(data: bytes, into: Path) -> transfer._Manifest:
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "wb") as out:  # small archives fit the pipe
        out.write(data)
    return transfer._extract(read_fd, into, "test")


@pytest.mark.parametrize("members, why", [
    ([(_member("layers/L/../../escape", tarfile.REGTYPE), b"")], "bad or repeated name"),
    ([(_member("/abs", tarfile.REGTYPE), b"")], "bad or repeated name"),
    ([(_member("layers/L"), b""), (_member("layers/L/up", tarfile.SYMTYPE, linkname="/tmp"), b""),
      (_member("layers/L/up/planted", tarfile.REGTYPE), b"")], "not below a directory"),
    ([(_member("layers/L"), b""), (_member("layers/L/x", tarfile.REGTYPE), b""),
      (_member("layers/L/x", tarfile.SYMTYPE, linkname="/etc/passwd"), b"")], "bad or repeated name"),
    ([(_member("layers/L"), b""), (_member("layers/L/shadow", tarfile.LNKTYPE, linkname="/etc/shadow"), b"")],
     "hard link to no earlier file"),
    ([(_member("layers/L"), b""), (_member("layers/L/disk", tarfile.BLKTYPE, devmajor=8), b"")], "kind of file"),
    ([(_member("layers/L"), b""), (_member("layers/L/mem", tarfile.CHRTYPE, devmajor=1, devminor=1), b"")],
     "kind of file"),
    ([(_member("layers/other"), b"")], "outside what the manifest names"),
    ([(_member("memory"), b"")], "outside what the manifest names"),
    ([(_member("layers/L", tarfile.SYMTYPE, linkname="/"), b"")], "not a directory"),
])
def test_an_unsafe_archive_is_refused_and_writes_nothing_outside(tmp_path, members, why):
    staged = tmp_path / "staged"
    staged.mkdir()
    with pytest.raises(ImageCorrupt, match=why):
        _unpack(_tar(members), staged)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["staged"]


def test_an_archive_without_its_end_or_with_a_missing_layer_is_refused(tmp_path):
    with pytest.raises(InfrastructureError, match="broke off"):
        _unpack(_tar([(_member("layers/L"), b"")], end=False), tmp_path)
    shutil.rmtree(tmp_path)
    tmp_path.mkdir()
    with pytest.raises(ImageCorrupt, match="lacks layers/L"):
        _unpack(_tar([]), tmp_path)


def test_a_layer_travels_exactly(tmp_path):
    """Owners, modes (setuid, a read-only dir), whiteouts, opaque dirs, file capabilities, links and times."""
    layer = tmp_path / "layer"
    (layer / "opaque").mkdir(parents=True)
    os.setxattr(layer / "opaque", "trusted.overlay.opaque", b"y")
    (layer / "tool").write_bytes(b"\x7fELF" + os.urandom(3000))
    os.chown(layer / "tool", 1234, 5678)
    os.chmod(layer / "tool", 0o4755)
    os.setxattr(layer / "tool", "security.capability",
                bytes([1, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]))
    os.link(layer / "tool", layer / "tool-again")
    os.mknod(layer / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    os.symlink("/usr/bin/python3", layer / "python")
    (layer / "locked").mkdir()
    (layer / "locked" / "inside").write_text("x")
    os.chmod(layer / "locked", 0o500)
    os.utime(layer / "locked", (1_000_000, 1_000_000))
    plan = transfer._Plan(_manifest(["L"]), (("L", str(layer)),), None)
    read_fd, write_fd = os.pipe()
    staged = tmp_path / "staged"
    staged.mkdir()

    async def both() -> transfer._Manifest:
        writer = asyncio.get_running_loop().run_in_executor(None, transfer._write_tar, write_fd, plan)
        manifest = await asyncio.to_thread(transfer._extract, read_fd, staged, "test")
        await writer
        return manifest

    assert asyncio.run(both()).layers == frozenset({"L"})
    copy = staged / "layers" / "L"
    for rel in ("", "opaque", "tool", "tool-again", "gone", "python", "locked", "locked/inside"):
        want, got = os.lstat(layer / rel), os.lstat(copy / rel)
        assert (got.st_mode, got.st_uid, got.st_gid, got.st_rdev) == (want.st_mode, want.st_uid, want.st_gid,
                                                                     want.st_rdev), rel
        if not stat.S_ISLNK(want.st_mode) and rel:
            assert got.st_mtime == want.st_mtime, rel
            assert {n: os.getxattr(copy / rel, n) for n in os.listxattr(copy / rel)} == \
                {n: os.getxattr(layer / rel, n) for n in os.listxattr(layer / rel)}, rel
    assert (copy / "tool").read_bytes() == (layer / "tool").read_bytes()
    assert os.lstat(copy / "tool").st_ino == os.lstat(copy / "tool-again").st_ino
    assert os.readlink(copy / "python") == "/usr/bin/python3"
