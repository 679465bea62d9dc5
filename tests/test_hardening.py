"""Regressions for what a review found: host safety, races and error translation."""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import leaks

from fanfold import AsyncFleet, EnvSpec, InvalidPath, InvalidRequest, Limits, Outcome
from fanfold.runtime.oci_sandbox import paths
from fanfold.host import mounts


async def test_sandbox_roots_are_nosuid_and_nodev_on_the_host(afleet, config):
    async with await afleet.create() as sandbox:
        root = str(paths(config, sandbox.id).rootfs)
        with open("/proc/self/mountinfo") as handle:
            options = [line.split()[5] for line in handle if line.split()[4] == root]
    assert options and "nosuid" in options[0] and "nodev" in options[0]


async def test_files_api_refuses_fifos_and_device_nodes(afleet):
    async with await afleet.create() as sandbox:
        made = await sandbox.exec("mkfifo /tmp/fifo; mknod /tmp/zero c 1 5 2>&1; echo rc=$?")
        paths = ["/tmp/fifo"]
        if "rc=0" in made.text:
            paths.append("/tmp/zero")
        else:  # in a user namespace of its own, root in a sandbox makes no device nodes at all
            assert "Operation not permitted" in made.text, made.text
        for path in paths:
            with pytest.raises(InvalidPath):  # nodev gives EACCES, a FIFO is refused by type
                await asyncio.wait_for(sandbox.files.read(path), 10)
            with pytest.raises(InvalidPath):  # refused, or ENXIO for a FIFO with no reader; never blocks
                await asyncio.wait_for(sandbox.files.write(path, b"x"), 10)


async def test_concurrent_builds_of_one_spec_share_the_work(afleet):
    spec = EnvSpec("host").run(f"echo {time.time_ns()} > /stamp")
    first, second = await asyncio.wait_for(asyncio.gather(afleet.build(spec), afleet.build(spec)), 60)
    assert first == second


async def test_a_second_engine_does_not_kill_a_build_in_progress(afleet, config):
    spec = EnvSpec("host").run(f"sleep 1.5; echo {time.time_ns()} > /slow")
    build = asyncio.create_task(afleet.build(spec))
    runtime_root = config.run_dir / config.runtime

    async def step_container_running() -> None:
        while not runtime_root.is_dir() or not any(p.name.startswith("build-") for p in runtime_root.iterdir()):
            await asyncio.sleep(0.01)

    await asyncio.wait_for(step_container_running(), 30)
    async with AsyncFleet(config=config):
        pass
    image = await build
    assert image.layers


def test_whole_float_limits_become_ints():
    limits = Limits(memory_mb=256.0, disk_mb=512.0, pids=64.0, cpus=1)
    assert (limits.memory_mb, limits.disk_mb, limits.pids, limits.cpus) == (256, 512, 64, 1.0)
    assert all(type(v) is int for v in (limits.memory_mb, limits.disk_mb, limits.pids))


async def test_sub_millisecond_timeout_still_times_out(afleet):
    async with await afleet.create() as sandbox:
        result = await sandbox.exec("sleep 30", timeout=0.0004)
    assert result.outcome is Outcome.TIMEOUT


async def test_host_side_errors_are_named_as_such(afleet, tmp_path):
    async with await afleet.create() as sandbox:
        await sandbox.files.write("/tmp/a.txt", "x")
        with pytest.raises(InvalidRequest, match="local file"):
            await sandbox.files.download("/tmp/a.txt", tmp_path / "missing-dir" / "a.txt")
    with pytest.raises(Exception) as info:
        await afleet._transport.kill(["not", "an", "id"])  # type: ignore[arg-type]
    assert type(info.value).__name__ == "SandboxNotFound"


async def test_close_with_creates_in_flight_leaves_nothing(config):
    fleet = AsyncFleet(config=config)
    await fleet.start()
    creates = [asyncio.create_task(fleet.create()) for _ in range(6)]
    await asyncio.sleep(0)
    await fleet.close()
    await asyncio.gather(*creates, return_exceptions=True)
    assert leaks(config) == {"mounts": 0, "cgroups": 0, "containers": 0}
    assert not mounts.mounts_under(config.state_dir / "sandboxes")


async def test_a_sandbox_is_released_whatever_is_stacked_on_its_mounts(afleet, config):
    # Release unmounts the root and disk it made without reading the mount table; one
    # more mount on top of each (or deep inside the root) must still all go, and nothing
    # under them may be deleted through a live mount.
    outside = config.state_dir / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "keep").write_text("kept")
    sandbox = await afleet.create()
    where = paths(config, sandbox.id)
    mounts.mount("fanfold", where.rootfs, "tmpfs", 0, "size=1m")
    (where.rootfs / "deep").mkdir()
    mounts.mount(str(outside), where.rootfs / "deep", "", 4096)  # MS_BIND
    assert mounts.is_mount_point(where.rootfs)
    disk = where.disk  # the root itself on a tmpfs disk; a subvolume of the disks' btrfs otherwise
    if disk != where.root:
        mounts.mount_tmpfs(disk, 1)
    mounts.mount_tmpfs(where.root, 1)  # on the root: hides the rest
    assert mounts.is_mount_point(where.root) and not where.rootfs.exists()
    await sandbox.kill()
    assert mounts.mounts_under(where.root) == [] and not where.root.exists()
    assert mounts.mounts_under(disk) == [] and not disk.exists()
    assert (outside / "keep").read_text() == "kept"
    assert leaks(config) == {"mounts": 0, "cgroups": 0, "containers": 0}


async def test_a_runtime_state_left_half_made_does_not_stop_engines(config):
    # crun killed mid-create leaves a state dir holding only `status`: `crun delete` cannot
    # load it, and once made every engine's start failed on it.
    state = config.run_dir / config.runtime / "sb-0123456789ab"
    state.mkdir(parents=True)
    (state / "status").write_text('{"pid": 999999999, "bundle": "/nonexistent"}')
    async with AsyncFleet(config=config) as fleet:
        assert not state.exists()
        async with await fleet.create() as sandbox:
            assert (await sandbox.exec("true")).ok
