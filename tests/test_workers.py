"""The engine as worker processes (``EngineConfig.workers``): the same API over the real runtime,
and nothing lost when a worker or the router itself is killed with SIGKILL in the middle of a burst."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from fanfold import AsyncFleet, EngineConfig, InfrastructureError, InvalidRequest, SandboxNotFound, ids
from fanfold.engine.workers import Router

from conftest import leaks

WORKERS = 2
NO_LEAKS = {"mounts": 0, "cgroups": 0, "containers": 0}


@pytest.fixture
def wconfig(config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(config, workers=WORKERS)


def rows(config: EngineConfig) -> list[str]:
    db = sqlite3.connect(config.state_dir / "fanfold.db")
    try:
        return [row[0] for row in db.execute("SELECT id FROM sandboxes")]
    finally:
        db.close()


def wait_exit(pid: int, timeout: float = 60) -> None:
    """Block until ``pid`` (not necessarily our child) has exited."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        assert select.select([pidfd], [], [], timeout)[0], f"process {pid} did not exit within {timeout} s"
    finally:
        os.close(pidfd)


async def test_calls_go_to_the_worker_each_sandbox_names(config, wconfig):
    async with AsyncFleet(config=wconfig) as fleet:
        router = fleet._transport
        assert isinstance(router, Router) and len(router.pids()) == WORKERS
        boxes = await asyncio.gather(*(fleet.create("host", labels={"n": str(i)}) for i in range(6)))
        assert {ids.shard_of(box.id, WORKERS) for box in boxes} == set(range(WORKERS))  # spread over all
        streams: list[str] = []
        result = await boxes[0].exec("echo out; echo err >&2", on_output=lambda stream, data: streams.append(stream))
        assert (result.stdout, result.stderr, sorted(set(streams))) == (b"out\n", b"err\n", ["stderr", "stdout"])
        await boxes[1].files.write("/tmp/note", b"kept")
        assert await boxes[1].files.read("/tmp/note") == b"kept"
        async with await boxes[1].fork(2) as fork:  # children are their parent's worker's, with its files
            assert {ids.shard_of(c.id, WORKERS) for c in fork.children} == {ids.shard_of(boxes[1].id, WORKERS)}
            assert [await c.files.read("/tmp/note") for c in fork.children] == [b"kept", b"kept"]
        listed = {info.id for info in await fleet.list()}
        assert {box.id for box in boxes} <= listed
        figures = await fleet.metrics()
        assert figures["workers"] == WORKERS
        assert {box.id for box in boxes} <= {row["id"] for row in figures["sandboxes"]}
        await boxes[2].kill()
        with pytest.raises(SandboxNotFound):
            await boxes[2].exec("true")
        with pytest.raises(SandboxNotFound):
            await fleet.get("sb-000000000001")
    assert leaks(config) == NO_LEAKS
    assert not any(box.id in rows(config) for box in boxes)


async def test_a_worker_killed_mid_burst_loses_nothing(config, wconfig):
    """SIGKILL of a worker at a random point of a burst: every call succeeds or raises InfrastructureError
    (retryable), the worker comes back under the same index and adopts the sandboxes it held, and
    what it was half-way through is released."""
    async with AsyncFleet(config=wconfig) as fleet:
        router: Router = fleet._transport
        await fleet.pool("host", 4)  # creates take warm ones as the pool refills: its rows die with a worker too
        held = await asyncio.gather(*(fleet.create("host") for _ in range(4)))
        victim = ids.shard_of(held[0].id, WORKERS)
        old_pid = router.workers[victim].pid
        kill_at, finished, outcomes = random.randint(2, 25), 0, []
        gate = asyncio.Semaphore(8)

        async def cycle() -> None:
            nonlocal finished
            async with gate:
                try:
                    sandbox = await fleet.create("host")
                    assert (await sandbox.exec("true")).ok
                    await sandbox.kill()
                    outcomes.append("ok")
                except InfrastructureError:
                    outcomes.append("retryable")
                finally:
                    finished += 1
                    if finished == kill_at:
                        os.kill(old_pid, signal.SIGKILL)

        await asyncio.gather(*(cycle() for _ in range(40)))  # any other error fails the test here
        assert len(outcomes) == 40 and outcomes.count("ok") >= 20, outcomes
        await asyncio.wait_for(router.workers[victim].up.wait(), 60)
        assert router.workers[victim].pid != old_pid
        for sandbox in held:  # adopted by the new worker, or never the dead one's
            assert (await sandbox.exec("echo alive")).stdout == b"alive\n"
    assert leaks(config) == NO_LEAKS
    assert rows(config) == []


ROUTER_SCRIPT = textwrap.dedent("""
    import asyncio, dataclasses, json, sys
    from fanfold import AsyncFleet, EngineConfig

    async def main():
        config = EngineConfig(state_dir=sys.argv[1], workers=2)
        async with AsyncFleet(config=config) as fleet:
            first = await asyncio.gather(*(fleet.create("host") for _ in range(3)))
            print(json.dumps({"workers": fleet._transport.pids(), "sandboxes": [s.id for s in first]}), flush=True)
            async def cycle():
                sandbox = await fleet.create("host")
                await sandbox.exec("true")
                print("cycle", flush=True)
            while True:  # a burst that goes on until this process is killed
                await asyncio.gather(*(cycle() for _ in range(6)))

    asyncio.run(main())
""")


async def test_the_router_killed_mid_burst_leaves_nothing(config, tmp_path):
    """SIGKILL of the router (the fleet's process): its workers see their socket end and destroy every
    sandbox they made for it, those being created included."""
    script = tmp_path / "router.py"
    script.write_text(ROUTER_SCRIPT)
    process = subprocess.Popen([sys.executable, str(script), str(config.state_dir)], stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(process.stdout.readline())
        assert len(started["workers"]) == 2 and len(started["sandboxes"]) == 3
        for _ in range(random.randint(1, 12)):  # killed at a random point of the burst that follows
            assert process.stdout.readline() == "cycle\n"
        process.kill()
        process.wait()
        for pid in started["workers"]:
            wait_exit(pid)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert leaks(config) == NO_LEAKS
    assert not set(rows(config)) & set(started["sandboxes"])
    assert rows(config) == []


@pytest.mark.parametrize("count", [1, 2, 3, 16, 64])
def test_each_worker_mints_ids_of_its_own_share(count):
    for index in range(count):
        for _ in range(50):
            minted = ids.new_id(ids.SANDBOX, None, (index, count))
            tagged = ids.new_id(ids.SANDBOX, "node7", (index, count))
            assert ids.shard_of(minted, count) == index == ids.shard_of(tagged, count)
            assert ids.node_of(tagged) == "node7" and ids.node_of(minted) is None
    assert ids.shard_of("not-an-id", count) == 0


def test_pools_are_shared_out_and_summed():
    from fanfold.engine.workers import merge
    from fanfold.models import Limits, PoolInfo

    assert merge.split(10, 4) == [3, 3, 2, 2] and merge.split(1, 3) == [1, 0, 0]
    assert merge.split(None, 2) == [None, None]
    share = PoolInfo(source="img-1", limits=Limits(), size=3, target=3, ready=2, filling=1, handouts=5, misses=1)
    [pool] = merge.pools([[share], [dataclasses.replace(share, size=2, target=2, ready=2, filling=0, misses=0)]])
    assert (pool.size, pool.target, pool.ready, pool.filling, pool.handouts, pool.misses) == (5, 5, 4, 1, 10, 1)


async def test_a_worker_that_cannot_start_says_why_and_leaves_no_process(config):
    bad = dataclasses.replace(config, workers=WORKERS, backend="nosuch")
    fleet = AsyncFleet(config=bad)
    with pytest.raises(InvalidRequest, match="unknown backend 'nosuch'"):
        await fleet.start()
    assert all(worker.process.returncode is not None for worker in fleet._transport.workers)
