"""Snapshots and forks of sandboxes whose disk is a btrfs subvolume take their layer by reference
(``rootfs.snapshot_upper``): a snapshot of the subvolume, linked from ``layers/``, not a copy; a
sandbox made from such a layer gets a writable snapshot of it as its disk (``rootfs.inherit_layer``),
reading the layers from its own subvolume so that overlayfs sees one inode space. tmpfs disks still
copy theirs. Against the real engine, crun, CRIU and the btrfs the engine mounts.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from fanfold import AsyncFleet, CheckpointFailed, EngineConfig
from fanfold.engine import db as dbmod
from fanfold.engine import snapshots as snapmod
from fanfold.host import disk
from fanfold.images import LayerStore
from fanfold.store.rootfs import LOWER_PREFIX, copy_tree, copy_upper

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("btrfs") is None,
                                reason="needs root and btrfs-progs")

WRITE_200MB = ("mkdir -p /root/big /root/small && for i in $(seq 200); do head -c 1048576 /dev/urandom > /root/big/$i;"
               " done && for i in $(seq 500); do echo $i > /root/small/$i; done && chown 1000:1000 /root/big/1")
DIGEST = "cat /root/big/* /root/small/* | md5sum; stat -c %u:%g /root/big/1"


@pytest.fixture
async def dfleet(config: EngineConfig):
    """An embedded fleet whose sandboxes get btrfs disks (the default, said here whatever FANFOLD_DISK says)."""
    async with AsyncFleet(config=dataclasses.replace(config, disk="btrfs")) as fleet:
        yield fleet


def btrfs(*args: str) -> str:
    return subprocess.run(["btrfs", *args], capture_output=True, text=True, check=True, timeout=120).stdout


def usage(state_dir: Path, subvolume: Path) -> tuple[int, int]:
    """(referenced, exclusive) bytes of a subvolume's quota group."""
    group = "0/" + btrfs("inspect-internal", "rootid", str(subvolume)).strip()
    for row in btrfs("qgroup", "show", "-r", "--raw", str(disk.disk_dir(state_dir))).splitlines():
        if row.split()[:1] == [group]:
            return int(row.split()[1]), int(row.split()[2])
    raise AssertionError(f"no quota group {group}")


def subvolumes(state_dir: Path) -> set[str]:
    """Paths (under the disk) of every subvolume on the sandboxes' btrfs."""
    return {line.split(" path ", 1)[1] for line in btrfs("subvolume", "list", str(disk.disk_dir(state_dir))).splitlines()}


def referenced_layer(state_dir: Path, snapshot_id: str) -> Path:
    """The subvolume a snapshot's layer links to, after checking that it does."""
    link = LayerStore(state_dir).layer_path(snapshot_id)
    home = disk.layers_dir(state_dir) / link.name
    assert link.is_symlink() and link.resolve() == (home / "upper").resolve()
    assert disk.is_subvolume(home)
    # no overlay work dir, no host dir's upper of its own; the copies of the layers it stands on
    assert all(p.name == "upper" or p.name.startswith(LOWER_PREFIX) for p in home.iterdir())
    return home


def assert_gone(state_dir: Path, *snapshot_ids: str) -> None:
    """No link, no subvolume and, once the filesystem has dropped them, no quota group is left of these."""
    names = [LayerStore(state_dir).layer_path(s).name for s in snapshot_ids]
    assert not any(os.path.lexists(LayerStore(state_dir).layers_dir / name) for name in names)
    assert not any(f"{disk.LAYERS}/{name}" in subvolumes(state_dir) for name in names)
    give_up = time.monotonic() + 10
    while True:  # the cleaner drops a deleted subvolume's group after its extents are accounted: commit, look again
        btrfs("filesystem", "sync", str(disk.disk_dir(state_dir)))
        btrfs("subvolume", "sync", str(disk.disk_dir(state_dir)))
        done = subprocess.run(["btrfs", "qgroup", "show", "--raw", str(disk.disk_dir(state_dir))],
                              capture_output=True, text=True, check=True)
        assert "inconsistent" not in done.stderr + done.stdout  # quotas still count right: disk_mb holds
        live = {line.split()[1] for line in btrfs("subvolume", "list", str(disk.disk_dir(state_dir))).splitlines()}
        groups = {row.split()[0].split("/")[1] for row in done.stdout.splitlines() if row.startswith("0/")}
        if not groups - live - {"5"} or time.monotonic() > give_up:
            break
    assert groups - live - {"5"} == set(), "quota groups of deleted subvolumes are left"


async def test_a_fork_takes_its_layer_by_reference_and_deleting_everything_frees_it(dfleet, config):
    state = config.state_dir
    async with await dfleet.create(disk_mb=512) as parent:
        assert (await parent.exec(WRITE_200MB, timeout=300)).ok
        digest = (await parent.exec(DIGEST, timeout=60)).text
        fork = await parent.fork(2)
        home = referenced_layer(state, fork.result.snapshot_id)
        referenced, exclusive = usage(state, home)
        # it shares every block with the parent's disk: nothing was copied
        assert referenced > 200 << 20 and exclusive < 4 << 20
        async with fork:
            for child in fork.children:
                assert (await child.exec(DIGEST, timeout=60)).text == digest  # owners too, through the idmaps
                own = disk.sandbox_disk(state, child.id)
                # its disk is a snapshot of the layer: it holds the layer's tree, sharing its blocks
                assert disk.is_subvolume(own) and (own / f"{LOWER_PREFIX}{fork.result.snapshot_id}/root/big").is_dir()
                referenced, exclusive = usage(state, own)
                assert referenced > 200 << 20 and exclusive < 16 << 20
                # the 200 MB inherited are not charged to the child's disk_mb (512)
                assert (await child.exec("head -c 400M /dev/zero > /root/more && echo ok", timeout=120)).ok
            assert (await fork.children[0].exec("rm -r /root/big && ls /root")).text.split() == ["more", "small"]
            assert (await parent.exec("ls /root/big | wc -l")).text.strip() == "200"
    # a fork's snapshot goes with its last child; the parent's disk with the parent
    assert fork.result.snapshot_id not in {s.id for s in await dfleet.snapshots()}
    assert not disk.sandbox_disk(state, parent.id).exists()
    assert_gone(state, fork.result.snapshot_id)


async def test_a_child_cannot_write_past_its_own_disk_mb(dfleet, config):
    async with await dfleet.create(disk_mb=512) as parent:
        assert (await parent.exec("head -c 100M /dev/urandom > /root/inherited && sync", timeout=120)).ok
        snapshot = await parent.snapshot()
    async with await dfleet.create(snapshot, disk_mb=64) as child:
        assert (await child.exec("head -c 40M /dev/zero > /root/a && sync && echo ok", timeout=120)).ok
        full = await child.exec("head -c 60M /dev/zero > /root/b && sync", timeout=120)
        assert full.exit_code != 0 and "quota" in full.stderr.decode().lower(), full.stderr
        # overwriting what it inherited is its own write too; deleting it frees none of its quota
        assert (await child.exec("rm -f /root/b /root/inherited && sync && head -c 20M /dev/zero > /root/c"
                                 " && echo ok", timeout=120)).ok
    await dfleet.delete_snapshot(snapshot.id)
    assert_gone(config.state_dir, snapshot.id)


NEW_FILES = ("for i in $(seq 50); do echo new > {dir}/new$i; done && mkdir -p {dir}/sub && echo s > {dir}/sub/s"
             " && cp {dir}/old1 {dir}/new1 && mv {dir}/new2 {dir}/old3 && mv {dir}/old4 {dir}/moved"
             " && cp -a {dir}/old5 {dir}/copied && echo ok")
UNIQUE = "find /root /etc -xdev -print0 | xargs -0 stat -c '%d:%i %h %F %n' "


async def dev_inos_unique(sandbox) -> None:
    """Every path of the sandbox's root (one filesystem) has a dev:ino no other path that is not a hard link has."""
    listing = (await sandbox.exec(UNIQUE + "2>/dev/null", timeout=120)).text.splitlines()
    seen: dict[str, list[str]] = {}
    for line in listing:
        key, links, rest = line.split(" ", 2)
        if links == "1" or rest.startswith("directory"):
            seen.setdefault(key, []).append(rest)
    clashes = {key: names for key, names in seen.items() if len(names) > 1}
    assert not clashes, list(clashes.items())[:5]


async def test_no_inode_numbers_collide_in_a_child_or_a_grandchild(dfleet, config):
    async with await dfleet.create() as parent:
        assert (await parent.exec("mkdir /root/d && for i in $(seq 50); do echo $i > /root/d/old$i; done")).ok
        one = await parent.snapshot()
    async with await dfleet.create(one) as child:
        assert (await child.exec(NEW_FILES.format(dir="/root/d"))).text == "ok\n"
        await dev_inos_unique(child)
        assert (await child.exec("mkdir /root/e && for i in $(seq 50); do echo $i > /root/e/old$i; done")).ok
        two = await child.snapshot()
    async with await dfleet.create(two) as grandchild:
        for directory in ("/root/d", "/root/e"):  # from the grandparent's layer, and from the parent's
            done = await grandchild.exec(NEW_FILES.replace("new", "more").replace("moved", "moved2")
                                         .replace("copied", "copied2").replace("old3", "old6").replace("old4", "old7")
                                         .format(dir=directory))
            assert done.text == "ok\n", done.stderr
        await dev_inos_unique(grandchild)
        assert (await grandchild.exec("cat /root/d/old1 /root/d/new1 /root/d/old3 /root/e/old1")).text == "1\n1\nnew\n1\n"
    for snapshot in (two, one):
        await dfleet.delete_snapshot(snapshot.id)
    assert_gone(config.state_dir, one.id, two.id)


async def test_whiteouts_opaque_dirs_and_host_dir_writes_survive_layers_by_reference(dfleet, config):
    state = config.state_dir
    async with await dfleet.create() as first:
        assert (await first.exec("mkdir -p /root/dir && echo a > /root/dir/a && echo x > /root/gone"
                                 " && echo mine > /usr/local/mine")).ok
        one = await first.snapshot()
    async with await dfleet.create(one) as second:
        assert (await second.exec("rm /root/gone && rm -r /root/dir && mkdir /root/dir && echo b > /root/dir/b"
                                  " && rm /usr/local/mine")).ok
        two = await second.snapshot()
    upper = referenced_layer(state, two.id) / "upper"
    assert os.stat(upper / "root/gone", follow_symlinks=False).st_rdev == 0  # a whiteout: char device 0/0
    assert os.getxattr(upper / "root/dir", "trusted.overlay.opaque") == b"y"
    assert (referenced_layer(state, one.id) / "upper/usr/local/mine").read_text() == "mine\n"  # /usr's own upper
    async with await dfleet.create(two) as third:
        listing = await third.exec("ls /root/dir; ls /root/gone /usr/local/mine")
        assert listing.text.split() == ["b"] and listing.exit_code != 0
    async with await dfleet.create(one) as fourth:
        assert (await fourth.exec("cat /root/dir/a /root/gone /usr/local/mine")).text == "a\nx\nmine\n"
    for snapshot in (two, one):  # the later one first: it stands on the earlier
        await dfleet.delete_snapshot(snapshot.id)
    assert_gone(state, one.id, two.id)


async def test_a_snapshot_by_reference_does_not_grow_with_the_disk_as_a_copy_does(dfleet, config):
    """The disk step of a pause, timed alone on the idle sandbox's disk: a snapshot against the ``cp -a``
    into the state dir that it replaces."""
    scratch = Path(tempfile.mkdtemp(prefix=".disk-reference-", dir=config.state_dir))
    try:
        async with await dfleet.create(disk_mb=512) as sandbox:
            assert (await sandbox.exec(WRITE_200MB + " && sync", timeout=300)).ok
            where = disk.sandbox_disk(config.state_dir, sandbox.id)
            started = time.perf_counter()
            copy_upper(where, (), scratch / "layer")
            by_reference = time.perf_counter() - started
            taken = (scratch / "layer").resolve().parent
            try:
                assert taken.parent == disk.layers_dir(config.state_dir) and disk.is_subvolume(taken)
                started = time.perf_counter()
                copy_tree(where / "upper", scratch / "copy")
                copied = time.perf_counter() - started
            finally:
                disk.delete(taken)
    finally:
        shutil.rmtree(scratch)
    assert by_reference < copied / 3, f"snapshot {by_reference * 1000:.0f} ms, cp -a {copied * 1000:.0f} ms"


async def test_the_parent_pause_of_a_fork_does_not_grow_with_what_it_wrote(dfleet):
    """With 200 MB written the pause stays within a bound a copy misses by far (``cp -a`` of it into
    the state dir, the step this replaces, took 1-3 s of the pause here)."""
    pauses = []
    for command in ("true", WRITE_200MB):
        async with await dfleet.create(disk_mb=512) as parent:
            assert (await parent.exec(command, timeout=300)).ok
            async with await parent.fork(1) as fork:
                pauses.append(fork.result.parent_pause_ms)
                assert (await fork.children[0].exec("ls /root/big 2>/dev/null | wc -l")).text.strip() in ("0", "200")
    empty, written = pauses
    assert written < max(3 * empty, empty + 400), f"pause {written:.0f} ms with 200 MB written, {empty:.0f} ms without"


async def test_half_made_snapshots_of_a_dead_engine_are_swept(dfleet, config):
    state = config.state_dir
    done = subprocess.Popen(["true"])
    done.wait()
    dead = done.pid
    store = LayerStore(state)
    snaps = snapmod.SnapshotStore(state, store, dbmod.Database(state / "fanfold.db"))
    async with await dfleet.create() as sandbox:
        where = disk.sandbox_disk(state, sandbox.id)
        home = disk.layers_dir(state)
        home.mkdir(exist_ok=True)
        # taken, not yet committed: a snapshot under its temporary name, linked from a staging dir
        staged = state / "snapshots" / f".tmp-{dead}-snap-0123456789ab"
        staged.mkdir()
        disk.snapshot(where, home / f".tmp-{dead}-0123abcd")
        (staged / "layer").symlink_to(home / f".tmp-{dead}-0123abcd" / "upper")
        # committed, but no row names it: a crash before the insert
        orphan = "snap-fedcba987654"
        disk.snapshot(where, home / orphan)
        store.layer_path(orphan).symlink_to(f"../disk/layers/{orphan}/upper")
        for path in (home / orphan, store.layer_path(orphan)):
            os.utime(path, (time.time() - 3600,) * 2, follow_symlinks=False)
    try:
        store.discard_scratch()
        snaps.discard_orphans()
    finally:
        snaps.db.close()
    assert not staged.exists() and not os.path.lexists(store.layer_path(orphan))
    assert not any(p.name.startswith(".tmp-") or p.name == orphan for p in home.iterdir())
    assert_gone(state, orphan)


async def test_a_fork_that_fails_after_taking_the_disk_leaves_no_subvolume_behind(config, tmp_path):
    failing = tmp_path / "criu"
    failing.write_text(f'#!/bin/sh\nCRIU_FAULT=3 exec {config.criu} "$@"\n')  # 3: fail while dumping pages
    failing.chmod(0o755)
    store = LayerStore(config.state_dir)
    async with AsyncFleet(config=dataclasses.replace(config, criu=str(failing), disk="btrfs")) as fleet:
        async with await fleet.create() as parent:
            with pytest.raises(CheckpointFailed):
                await parent.fork(2)
            # Its disk was taken before CRIU failed: the failed checkpoint's discard deleted that subvolume.
            assert store.referenced(staged=True) == []
            snapshot = await parent.snapshot()
            assert store.referenced(staged=True) == []
        await fleet.delete_snapshot(snapshot.id)
    assert not list((config.state_dir / "snapshots").glob(".tmp-*"))


async def test_a_tmpfs_disk_still_copies_its_writes_into_a_plain_layer(config):
    # userns off: on this host (Linux 6.18, HEAD de14529 too) a tmpfs disk's idmapped upper refuses
    # mkdir (EACCES on mapped/0/upper), a limit of tmpfs disks in user namespaces, not of this change
    async with AsyncFleet(config=dataclasses.replace(config, disk="tmpfs", userns=False)) as fleet:
        async with await fleet.create() as parent:
            assert (await parent.exec("echo kept > /root/kept")).ok
            snapshot = await parent.snapshot()
        layer = LayerStore(config.state_dir).layer_path(snapshot.id)
        assert layer.is_dir() and not layer.is_symlink() and (layer / "root/kept").read_text() == "kept\n"
        async with await fleet.create(snapshot) as child:
            assert (await child.exec("cat /root/kept")).text == "kept\n"
        await fleet.delete_snapshot(snapshot.id)
        assert not layer.exists()
