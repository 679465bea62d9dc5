"""Faults the fleet survives: an engine SIGKILLed mid-burst, a full disk, memory exhausted,
a runaway process at its deadline, and clients that vanish without closing anything."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import leaks, start_server, stop_server
from fanfold import (
    AsyncFleet, CapacityExceeded, FanfoldError, InfrastructureError, Outcome, Retryable, SandboxGone, SandboxNotFound,
)
from fanfold.engine import Engine
from fanfold.host import cgroups

CLEAN = {"mounts": 0, "cgroups": 0, "containers": 0}


async def _gone(engine: Engine, ids: list[str], within: float) -> None:
    """Wait until every one of ``ids`` has no row (the reaper passes once a second)."""
    give_up = time.monotonic() + within
    while any(engine.db.get(i) is not None for i in ids):
        assert time.monotonic() < give_up, [i for i in ids if engine.db.get(i) is not None]
        await asyncio.sleep(0.1)


async def test_engine_killed_mid_burst_loses_nothing_reported_and_leaks_nothing(config, tmp_path):
    where = tmp_path / "srv"
    where.mkdir()
    server = start_server(config.state_dir, where)
    restarted = None
    try:
        async with AsyncFleet(server.unix_url) as fleet:
            made: list = []
            failed: list[BaseException] = []
            enough = asyncio.Event()

            async def one(i: int) -> None:
                try:
                    made.append(await fleet.create(labels={"burst": str(i)}, disk_mb=64))  # 200 disks fit any host
                except FanfoldError as err:
                    failed.append(err)
                if len(made) >= 40:
                    enough.set()

            burst = [asyncio.create_task(one(i)) for i in range(200)]
            await asyncio.wait_for(enough.wait(), 120)
            in_flight = sum(not task.done() for task in burst)
            server.process.send_signal(signal.SIGKILL)
            server.process.wait(30)
            restarted = start_server(config.state_dir, where)
            await asyncio.gather(*burst)
            assert len(made) + len(failed) == 200 and len(made) >= 40
            assert in_flight > 0  # the kill landed mid-burst
            assert all(isinstance(err, Retryable) for err in failed), failed[:3]
            # Every sandbox reported created survived the crash, and works.
            results = await asyncio.gather(*(sandbox.exec("echo $HOSTNAME") for sandbox in made))
            assert [r.text.strip() for r in results] == [s.id for s in made]
            # The failed ones succeed when retried: the burst completes.
            retried = await asyncio.gather(*(fleet.create(disk_mb=64) for _ in failed))
            assert len(made) + len(retried) == 200 and len({s.id for s in made + retried}) == 200
            listed = {info.id for info in await fleet.list()}
            assert {s.id for s in made + retried} <= listed
        stop_server(restarted)
        restarted = None
    finally:
        for running in (server, restarted):
            if running is not None and running.process.poll() is None:
                stop_server(running)
    assert leaks(config) == CLEAN


async def test_a_sandbox_filling_its_disk_is_stopped_and_recovers(afleet):
    async with await afleet.create(disk_mb=32) as full, await afleet.create(disk_mb=32) as neighbour:
        result = await full.exec("dd if=/dev/zero of=/fill bs=1M count=64", timeout=60)
        assert result.exit_code != 0 and (b"No space left" in result.stderr or b"Disk quota exceeded" in result.stderr)
        assert (await full.exec("rm /fill && echo ok > /after && cat /after")).text == "ok\n"
        assert (await neighbour.exec("dd if=/dev/zero of=/fill bs=1M count=16 2>&1 && echo fine")).text.endswith("fine\n")


async def test_a_sandbox_exhausting_memory_is_oom_killed_alone(afleet):
    async with await afleet.create(memory_mb=64) as hog, await afleet.create(memory_mb=64) as neighbour:
        result = await hog.exec(["python3", "-c", "x = []\nwhile True: x.append(bytearray(8 << 20))"], timeout=60)
        assert result.outcome is Outcome.OOM and "memory" in result.limits_hit
        assert (await hog.exec("echo alive")).text == "alive\n"
        assert (await neighbour.exec("echo fine")).text == "fine\n"


async def test_a_runaway_process_dies_with_its_deadline(config):
    async with AsyncFleet(config=config) as fleet:
        sandbox = await fleet.create(deadline=2)
        started = time.monotonic()
        with pytest.raises(SandboxGone):
            await sandbox.exec("while :; do :; done")  # no timeout: only the deadline stops it
        assert time.monotonic() - started < 15
        with pytest.raises((SandboxNotFound, SandboxGone)):
            await sandbox.exec("true")
    assert leaks(config) == CLEAN


VANISHING_CLIENT = textwrap.dedent("""
    import asyncio, os, signal, sys
    from fanfold import AsyncFleet, EngineConfig

    async def main():
        url = sys.argv[1]
        fleet = AsyncFleet(url) if url != "embedded" else AsyncFleet(config=EngineConfig(state_dir=sys.argv[2]))
        await fleet.start()
        sandboxes = [await fleet.create() for _ in range(2)]
        fork = await sandboxes[0].fork(1) if url != "embedded" else None
        ids = [s.id for s in sandboxes] + ([c.id for c in fork.children] if fork else [])
        print(" ".join(ids), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # gone, closing nothing

    asyncio.run(main())
""")


@pytest.mark.parametrize("transport", ["unix", "embedded"])
async def test_a_client_that_vanishes_has_its_sandboxes_reaped(transport, server, config):
    url = server.unix_url if transport == "unix" else "embedded"
    env = {**os.environ, "FANFOLD_LEASE_TTL": "2"}
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", VANISHING_CLIENT, url, str(config.state_dir)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    ids = done.stdout.split()
    assert len(ids) == (3 if transport == "unix" else 2)
    # The session server's engine reaps them: the lease expires, or the owning process is dead.
    watcher = Engine(config)
    await watcher.start()
    try:
        await _gone(watcher, ids, within=30)
    finally:
        await watcher.close()


async def test_a_sandbox_whose_init_is_killed_is_gone_not_retryable(config):
    async with AsyncFleet(config=config) as fleet:
        engine: Engine = fleet._transport  # type: ignore[assignment]
        first, second = await fleet.create(), await fleet.create()
        for sandbox in (first, second):
            os.kill(engine.db.get(sandbox.id)["pid"], signal.SIGKILL)
        with pytest.raises(SandboxGone, match="init process died"):
            await first.exec("true")  # the call that finds it out destroys it
        await _gone(engine, [first.id, second.id], within=15)  # the reaper finds the other
    assert leaks(config) == CLEAN


async def test_fork_snapshot_and_pause_of_a_sandbox_whose_init_died_say_gone_not_retry(config):
    async with AsyncFleet(config=config) as fleet:
        engine: Engine = fleet._transport  # type: ignore[assignment]
        sandboxes = [await fleet.create() for _ in range(3)]
        for sandbox in sandboxes:
            os.kill(engine.db.get(sandbox.id)["pid"], signal.SIGKILL)
        calls = [sandboxes[0].fork(1), sandboxes[1].snapshot(memory=True), sandboxes[2].pause()]
        for sandbox, call in zip(sandboxes, calls):
            with pytest.raises(SandboxGone, match="init process died") as gone:
                await call
            assert not isinstance(gone.value, Retryable)
            assert engine.db.get(sandbox.id) is None  # destroyed by the call that found it out, as exec does
    assert leaks(config) == CLEAN


async def test_host_errors_from_resume_and_reset_are_retryable_not_raw(config, monkeypatch):
    from fanfold.runtime import oci_sandbox as resources

    async def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create() as sandbox:
            await sandbox.exec("echo kept > /root/note")
            await sandbox.suspend()
            with monkeypatch.context() as patch:
                patch.setattr(resources, "restore", no_space)
                with pytest.raises(CapacityExceeded, match="resuming sandbox .* state filesystem is full: No space"):
                    await sandbox.resume()
                assert (await sandbox.refresh()).state == "suspended"  # nothing lost: resumed later
            assert (await sandbox.exec("cat /root/note")).text == "kept\n"
            with monkeypatch.context() as patch:
                patch.setattr(resources, "mount_trusted", lambda *a, **kw: (_ for _ in ()).throw(OSError(28, "No space")))
                with pytest.raises(CapacityExceeded, match="resetting sandbox"):
                    await sandbox.reset()
    assert leaks(config) == CLEAN


async def test_a_release_that_failed_is_retried_by_the_reaper(config, monkeypatch):
    from fanfold.runtime import oci_sandbox as resources

    real, failures = resources.release_host, []

    def busy_once(*args):
        if not failures:
            failures.append(args[1])
            raise OSError(16, "Device or resource busy")
        real(*args)

    monkeypatch.setattr(resources, "release_host", busy_once)
    async with AsyncFleet(config=config) as fleet:
        engine: Engine = fleet._transport  # type: ignore[assignment]
        sandbox = await fleet.create()
        with pytest.raises(InfrastructureError, match="the reaper tries again"):
            await sandbox.kill()
        assert engine.db.get(sandbox.id)["state"] == "destroying"
        await _gone(engine, [sandbox.id], within=10)
    assert failures == [sandbox.id] and leaks(config) == CLEAN


@pytest.mark.skipif("freezer" not in cgroups.v1_roots(), reason="needs cgroup v1's freezer")
def test_a_sandbox_group_a_dead_checkpointer_left_frozen_is_removed_whole(config):
    """CRIU freezes a sandbox in v1's freezer to dump it; one that dies mid-dump (a full disk, a
    SIGKILL) leaves the group FROZEN, where a SIGKILL waits for good. Removing the groups (the
    release of a sandbox the runtime forgot, a crashed engine's leftovers) thaws them first."""
    sandbox_id = f"sb-{os.urandom(6).hex()}"
    cgroups.ensure_parent(config.cgroup_parent)
    directories = cgroups.sandbox_dirs(config.cgroup_parent, sandbox_id)
    for directory in directories:
        directory.mkdir(parents=True)
        for name in ("cpuset.cpus", "cpuset.mems"):  # a v1 cpuset group takes no task while empty
            if (directory / name).exists():
                (directory / name).write_text((directory.parent / name).read_text())
    task = subprocess.Popen(["sleep", "600"])
    try:
        for directory in directories:
            (directory / "cgroup.procs").write_text(str(task.pid))
        freezer = cgroups.v1_roots()["freezer"] / config.cgroup_parent / sandbox_id / "freezer.state"
        freezer.write_text("FROZEN")
        cgroups.remove(config.cgroup_parent, sandbox_id)
        assert task.wait(10) == -signal.SIGKILL
        assert not any(directory.exists() for directory in directories)
    finally:
        if task.poll() is None:  # reported above; not left frozen for the run's end
            cgroups.thaw(config.cgroup_parent, sandbox_id)
            task.kill()
            task.wait()
            cgroups.remove(config.cgroup_parent, sandbox_id)


async def test_a_create_failing_while_its_runtime_starts_leaves_nothing(config, monkeypatch):
    # The runtime starts from the create's thread before /etc/hostname is written: a failure there (here once
    # the sandbox's agent runs) waits the runtime out, and the create's usual release removes all it made.
    from fanfold.host import census
    from fanfold.runtime import oci_sandbox as resources

    def full(*args):
        give_up = time.monotonic() + 30
        while not census.agent_pids(config):
            assert time.monotonic() < give_up, "the runtime never started the agent"
            time.sleep(0.005)
        raise OSError(28, "No space left on device")

    async with AsyncFleet(config=config) as fleet:
        await (await fleet.create()).kill()  # the base is built
        monkeypatch.setattr(resources, "name_host", full)
        with pytest.raises(CapacityExceeded, match="creating sandbox failed: .*No space"):
            await fleet.create()
        assert await fleet.list() == []
    assert census.census(config)["agents"] == 0 and leaks(config) == CLEAN


async def test_a_create_cancelled_while_its_runtime_starts_leaves_nothing(config, monkeypatch):
    import threading

    from fanfold.host import census
    from fanfold.runtime import oci_sandbox as resources

    entered, release, real = threading.Event(), threading.Event(), resources.name_host

    def held(*args):
        entered.set()
        release.wait(30)
        real(*args)

    async with AsyncFleet(config=config) as fleet:
        await (await fleet.create()).kill()  # the base is built
        monkeypatch.setattr(resources, "name_host", held)
        creating = asyncio.ensure_future(fleet.create())
        assert await asyncio.to_thread(entered.wait, 30)  # the runtime is starting, the thread still busy
        creating.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await creating
        assert await fleet.list() == []
    assert census.census(config)["agents"] == 0 and leaks(config) == CLEAN
