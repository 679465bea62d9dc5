"""A state filesystem that fills up, against the real engine, crun and the btrfs it makes on it: the
sandbox that writes on meets its own quota error, its neighbours and the engine's state keep working.

The state dir sits on a small tmpfs of its own, so the sandboxes' btrfs is a sparse file on it (as on
a host whose state dir is not a btrfs): left alone, a sandbox writing into it fills the tmpfs, the
loop device's writes fail, the kernel forces the btrfs read-only under every sandbox, and the
engine's database can no longer be written.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from fanfold import AsyncFleet, CapacityExceeded, EngineConfig
from fanfold.host import disk, diskspace

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mkfs.btrfs") is None,
                                reason="needs root and btrfs-progs")

MB = 1 << 20


@pytest.fixture
def small_state(tmp_path: Path):
    """A state dir on a 768 MB filesystem of its own."""
    where = tmp_path / "fs"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=768m,mode=0755", "fanfold-small", str(where)], check=True)
    try:
        yield where / "state"
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)  # reported by the test's own failure


async def caps(state: Path, *sandboxes, settled: bool) -> dict[str, int]:
    """The sandboxes' caps (bytes) once the reaper has shrunk them (``settled`` False) or restored them
    to their ``disk_mb`` (True); it passes once a second."""
    give_up = time.monotonic() + 20
    while True:
        uses = await asyncio.to_thread(diskspace.usage, state)
        now = {s.id: uses[s.id].limit for s in sandboxes}
        if all((now[s.id] == s.info.limits.disk_mb * MB) == settled for s in sandboxes):
            return now
        assert time.monotonic() < give_up, f"the caps did not {'come back' if settled else 'shrink'}: {now}"
        await asyncio.sleep(0.1)


async def test_a_filling_state_filesystem_fails_only_the_sandbox_that_writes_on(small_state):
    config = EngineConfig(state_dir=small_state, disk="btrfs", reserve_disk_mb=128)
    async with AsyncFleet(config=config) as fleet:
        writer = await fleet.create(disk_mb=256)
        neighbour = await fleet.create(disk_mb=64)
        # Something else takes the state filesystem's space: the two disks' 320 MB no longer fit in it.
        filler = small_state / "filler"
        with open(filler, "wb") as handle:
            handle.truncate(shutil.disk_usage(small_state).free - 224 * MB)
            os.posix_fallocate(handle.fileno(), 0, handle.seek(0, os.SEEK_END))
        shrunk = await caps(small_state, writer, neighbour, settled=False)
        assert sum(shrunk.values()) < 320 * MB

        full = await writer.exec("dd if=/dev/zero of=/root/big bs=1M count=256; sync", timeout=120)
        assert b"Disk quota exceeded" in full.stderr, full.stderr
        assert shutil.disk_usage(small_state).free > 128 * MB  # the engine's reserve is whole
        modest = await neighbour.exec("dd if=/dev/zero of=/root/some bs=1M count=4 && sync && echo ok", timeout=60)
        assert modest.text.endswith("ok\n"), modest.stderr
        assert (await writer.exec("echo alive")).text == "alive\n"  # each call writes its activity to the database
        with pytest.raises(CapacityExceeded, match="disk_mb=64, but .* MB free"):
            await fleet.create(disk_mb=64, queue_timeout=0.5)
        assert {s.id for s in await fleet.list()} == {writer.id, neighbour.id}

        filler.unlink()  # the space comes back, and so do the caps
        await caps(small_state, writer, neighbour, settled=True)
        again = await writer.exec("rm /root/big && dd if=/dev/zero of=/root/big bs=1M count=200 && sync && echo ok",
                                  timeout=120)
        assert again.text.endswith("ok\n"), again.stderr
        async with await fleet.create(disk_mb=64) as late:
            assert (await late.exec("true")).ok
    assert not disk.ready(small_state)


async def test_a_snapshot_on_a_full_state_filesystem_is_capacity_exceeded_and_leaves_nothing(small_state):
    config = EngineConfig(state_dir=small_state, disk="btrfs", reserve_disk_mb=16)
    async with AsyncFleet(config=config) as fleet:
        sandbox = await fleet.create(disk_mb=64)
        await asyncio.to_thread(os.sync)  # the btrfs's own writes are done before the space goes
        filler = small_state / "filler"
        with open(filler, "wb") as handle:
            handle.truncate(shutil.disk_usage(small_state).free)
            os.posix_fallocate(handle.fileno(), 0, handle.seek(0, os.SEEK_END))
        try:
            with pytest.raises(CapacityExceeded, match="state filesystem is full"):
                await sandbox.snapshot()
            assert not list((small_state / "snapshots").glob(".tmp-*"))
        finally:
            filler.unlink()
        assert (await sandbox.exec("echo alive")).text == "alive\n"
        assert (await sandbox.snapshot()).id
