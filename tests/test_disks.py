"""Sandbox disks on the btrfs with quotas (``fanfold/host/disk.py``), through the real engine:
a write past ``disk_mb`` fails with EDQUOT, the memory limit counts only memory, snapshots and
forks keep the data on disks of their own, and destroy leaves no subvolume and no quota group.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fanfold import AsyncFleet, EngineConfig
from fanfold.host import disk

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mkfs.btrfs") is None,
                                reason="needs root and btrfs-progs")


@pytest.fixture
async def dfleet(config: EngineConfig):
    """An embedded fleet whose sandboxes get btrfs disks (the default, said here whatever FANFOLD_DISK says)."""
    async with AsyncFleet(config=dataclasses.replace(config, disk="btrfs")) as fleet:
        yield fleet


def subvolume_id(path: Path) -> int:
    done = subprocess.run(["btrfs", "inspect-internal", "rootid", str(path)], capture_output=True, text=True, check=True)
    return int(done.stdout)


def qgroups(state_dir: Path) -> dict[str, int]:
    """Quota groups of the disk: ``0/ID`` to their byte limit (0: none)."""
    done = subprocess.run(["btrfs", "qgroup", "show", "-r", "--raw", str(disk.disk_dir(state_dir))],
                          capture_output=True, text=True, check=True)
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("0/")]
    return {row[0]: 0 if row[3] == "none" else int(row[3]) for row in rows}


async def test_a_write_past_disk_mb_is_edquot_and_the_sandbox_goes_on(dfleet, config):
    async with await dfleet.create(disk_mb=64) as sandbox:
        assert disk.ready(config.state_dir)
        assert qgroups(config.state_dir)[f"0/{subvolume_id(disk.sandbox_disk(config.state_dir, sandbox.id))}"] == 64 << 20
        full = await sandbox.exec("dd if=/dev/zero of=/root/big bs=1M count=100", timeout=60)
        assert full.outcome == "exited" and full.exit_code != 0
        assert b"Disk quota exceeded" in full.stderr
        again = await sandbox.exec("rm /root/big && sync && dd if=/dev/zero of=/root/big bs=1M count=32 && echo ok",
                                   timeout=60)
        assert again.ok and again.text.strip().endswith("ok")


async def test_the_memory_limit_counts_only_memory(dfleet):
    async with await dfleet.create(memory_mb=128, disk_mb=1024) as sandbox:
        done = await sandbox.exec("dd if=/dev/zero of=/root/big bs=1M count=400 && stat -c %s /root/big", timeout=120)
        assert done.outcome == "exited" and "memory" not in done.limits_hit
        assert done.ok and done.text.split()[-1] == str(400 << 20)


async def test_destroy_leaves_no_subvolume_and_no_quota_group(dfleet, config):
    sandbox = await dfleet.create(disk_mb=128)
    where = disk.sandbox_disk(config.state_dir, sandbox.id)
    assert (await sandbox.exec("dd if=/dev/zero of=/root/data bs=1M count=16")).ok
    group = f"0/{subvolume_id(where)}"
    assert group in qgroups(config.state_dir)
    await sandbox.kill()
    assert not where.exists() and sandbox.id not in disk.ids(config.state_dir)
    # The filesystem frees a deleted subvolume's blocks, then its quota group, in the background.
    subprocess.run(["btrfs", "subvolume", "sync", str(disk.disk_dir(config.state_dir)), group.partition("/")[2]],
                   capture_output=True, check=True, timeout=120)
    assert group not in qgroups(config.state_dir)


async def test_snapshot_and_fork_keep_the_data_on_disks_of_their_own(dfleet, config):
    async with await dfleet.create(disk_mb=64) as parent:
        assert (await parent.exec("dd if=/dev/urandom of=/root/data bs=1M count=20 && md5sum /root/data")).ok
        digest = (await parent.exec("md5sum < /root/data")).text
        snapshot = await parent.snapshot()
        async with await dfleet.create(snapshot, disk_mb=32) as child:
            assert (await child.exec("md5sum < /root/data")).text == digest
            # the snapshot's data is a lower layer: the child's own 32 MB are all free
            assert (await child.exec("dd if=/dev/zero of=/root/more bs=1M count=24")).ok
            assert b"Disk quota exceeded" in (await child.exec("dd if=/dev/zero of=/root/most bs=1M count=24")).stderr
            assert (await parent.exec("dd if=/dev/zero of=/root/more bs=1M count=24")).ok  # not charged to the parent
        async with await parent.fork(1) as fork:
            forked = fork.children[0]
            assert (await forked.exec("md5sum < /root/data")).text == digest
            assert disk.sandbox_disk(config.state_dir, forked.id).is_dir()
            assert b"Disk quota exceeded" in (await forked.exec("dd if=/dev/zero of=/root/x bs=1M count=80")).stderr


async def test_the_last_engine_to_close_unmounts_an_empty_disk(tmp_path):
    state = tmp_path / "state"
    async with AsyncFleet(config=EngineConfig(state_dir=state, disk="btrfs")) as first:
        async with AsyncFleet(config=EngineConfig(state_dir=state, disk="btrfs")):
            async with await first.create(disk_mb=16) as sandbox:
                assert disk.ready(state) and (await sandbox.exec("echo hi > /root/f")).ok
        assert disk.ready(state)  # the first engine still holds it
    assert not disk.ready(state)
    attached = subprocess.run(["losetup", "-j", str(state / "disk.img")], capture_output=True, text=True, check=True)
    assert attached.stdout == ""  # the loop device went with the mount
