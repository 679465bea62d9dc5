"""Copy-on-write dumps (``scripts/criu/shadow-fork-dump.patch``): a fork or memory snapshot of a running
sandbox stops it only while CRIU dumps everything but its memory; the pages are written from a shadow
(a fork of each process) while the sandbox runs on. Real CRIU, crun and processes, embedded.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from fanfold import AsyncFleet, EngineConfig
from fanfold.host import cgroups
from fanfold.runtime.criu import Criu, Resumed

# Adds 1 to a random-ish slot of a 64 MiB array and 1 to a counter, as fast as Python goes, so the
# array's sum equals the counter at every loop boundary. A copy of its memory taken all at once keeps
# that; pages copied at different times while it writes do not (the sum drifts from the counter, for
# good: the loop only ever adds 1 to both). SIGUSR2 writes the counter now (a peek, the loop goes on);
# SIGUSR1 stops the loop at its boundary and writes "counter sum".
HOLDER = r"""
import array, os, signal, sys
n = 8 << 20
slots = array.array("q", bytes(8 * n))
stop = False
def on_stop(sig, frame):
    global stop
    stop = True
def on_peek(sig, frame):
    open("/tmp/peek.new", "w").write(str(c))
    os.rename("/tmp/peek.new", "/tmp/peek")
c = 0
signal.signal(signal.SIGUSR1, on_stop)
signal.signal(signal.SIGUSR2, on_peek)
open("/tmp/ready", "w").write("1")
while not stop:
    c += 1
    slots[(c * 4099) % n] += 1
open("/tmp/report.new", "w").write(f"{c} {sum(slots)}")
os.rename("/tmp/report.new", "/tmp/report")
signal.pause()
"""
START = "nohup python3 /tmp/holder.py >/dev/null 2>&1 & echo $! > /tmp/holder.pid"
READY = "while [ ! -f /tmp/ready ]; do sleep 0.01; done"
PEEK = "rm -f /tmp/peek; kill -USR2 $(cat /tmp/holder.pid); while [ ! -f /tmp/peek ]; do sleep 0.01; done; cat /tmp/peek"
REPORT = "kill -USR1 $(cat /tmp/holder.pid); while [ ! -f /tmp/report ]; do sleep 0.01; done; cat /tmp/report"
SHADOWS = "ps -eo comm,stat | grep -c -e criu-cow -e ' Z' || true"


@pytest.fixture
def resumes(monkeypatch: pytest.MonkeyPatch) -> list[Resumed | None]:
    """What each of this process's CRIU dumps said as it resumed its tree (None: not copy-on-write)."""
    said: list[Resumed | None] = []
    dump = Criu.dump

    async def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        said.append(await dump(self, *args, **kwargs))
        return said[-1]

    monkeypatch.setattr(Criu, "dump", spy)
    return said


async def no_shadow_left(sandbox) -> bool:  # type: ignore[no-untyped-def]
    """CRIU waits for its shadows to exit; the agent reaps them a moment later."""
    for _attempt in range(100):
        if (await sandbox.exec(SHADOWS)).text.strip() == "0":
            return True
        await sandbox.exec("sleep 0.02")
    return False


async def holder(fleet: AsyncFleet):  # type: ignore[no-untyped-def]
    sandbox = await fleet.create(memory_mb=512)
    await sandbox.files.write("/tmp/holder.py", HOLDER)
    await sandbox.exec(START)
    await sandbox.exec(READY, timeout=60)
    return sandbox


async def counter_and_sum(sandbox) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    counter, total = (await sandbox.exec(REPORT, timeout=60)).text.split()
    return int(counter), int(total)


async def test_the_children_hold_the_memory_of_the_fork_instant_while_the_parent_writes(
    config: EngineConfig, resumes: list[Resumed | None],
):
    async with AsyncFleet(config=config) as fleet:
        parent = await holder(fleet)
        try:
            before = int((await parent.exec(PEEK, timeout=30)).text)
            started = time.monotonic()
            fork = await parent.fork(3)
            took_ms = (time.monotonic() - started) * 1000
            try:
                after = int((await parent.exec(PEEK, timeout=30)).text)
                assert after > before, "the parent runs on after the fork"
                # the pause ends when CRIU resumes the parent, before the pages are written: the holder's
                # come from its shadow; the agent's, guarded from the sandbox's processes, are dumped frozen
                assert 0 < fork.result.parent_pause_ms < took_ms
                assert [r.shadows for r in resumes if r] == [1]
                for child in fork.children:
                    counter, total = await counter_and_sum(child)
                    assert total == counter, f"{child.id}'s memory was copied at more than one instant"
                    assert counter >= before
                assert await no_shadow_left(parent), "no shadow or zombie is left"
            finally:
                await fork.kill()
            counter, total = await counter_and_sum(parent)
            assert total == counter > after
        finally:
            await parent.kill()


async def test_a_memory_snapshot_taken_while_writing_restores_whole(
    config: EngineConfig, resumes: list[Resumed | None],
):
    async with AsyncFleet(config=config) as fleet:
        parent = await holder(fleet)
        try:
            snap = await parent.snapshot(memory=True)
            assert [r.shadows for r in resumes if r] == [1]
            async with await fleet.create(snap) as copy:
                counter, total = await counter_and_sum(copy)
                assert total == counter
            await fleet.delete_snapshot(snap.id)
        finally:
            await parent.kill()


async def test_the_old_way_still_forks_whole(config: EngineConfig, resumes: list[Resumed | None]):
    old = dataclasses.replace(config, copy_on_write_dump=False)
    async with AsyncFleet(config=old) as fleet:
        parent = await holder(fleet)
        try:
            fork = await parent.fork(1)
            assert resumes == [None]
            try:
                counter, total = await counter_and_sum(fork.children[0])
                assert total == counter
            finally:
                await fork.kill()
        finally:
            await parent.kill()


HOLD_50MB = ("head -c 50000000 /dev/zero | python3 -c 'import sys, time; d = sys.stdin.buffer.read();"
             " open(\"/tmp/ok\", \"w\").write(\"1\"); time.sleep(300)' & while [ ! -f /tmp/ok ]; do sleep 0.01; done")


async def test_room_for_copies_raises_the_memory_limit_until_put_back(config: EngineConfig):
    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create(memory_mb=200) as sandbox:
            await sandbox.exec(HOLD_50MB, timeout=60)
            limit_file = cgroups._memory_limit_files(config.cgroup_parent, sandbox.id)[-1]
            limit = int(limit_file.read_text())
            assert limit == 200 << 20
            raised = cgroups.make_room(config.cgroup_parent, sandbox.id)
            assert int(limit_file.read_text()) >= limit + (50 << 20)
            assert cgroups.put_back(raised)
            assert int(limit_file.read_text()) == limit


@pytest.mark.skipif(cgroups.is_v2_only(), reason="v2 reclaims and OOM-kills a group over a lowered memory.max")
async def test_a_sandbox_that_grew_into_the_room_keeps_it_and_the_dump_stands(config: EngineConfig):
    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create(memory_mb=64) as sandbox:
            await sandbox.exec(HOLD_50MB, timeout=60)
            raised = cgroups.make_room(config.cgroup_parent, sandbox.id)
            await sandbox.exec(HOLD_50MB.replace("/tmp/ok", "/tmp/ok2"), timeout=60)  # 100 MB now, over 64
            assert not cgroups.put_back(raised, within=0.2)
            assert (await sandbox.exec("echo alive")).text == "alive\n"


@pytest.mark.parametrize("advice", ["MADV_DONTFORK", "MADV_WIPEONFORK"])
async def test_memory_a_fork_would_not_copy_is_dumped_while_frozen(config: EngineConfig, advice: str):
    holder_py = (
        "import ctypes, mmap, os\n"
        "m = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
        "m[:5] = b'hello'\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "at = ctypes.addressof(ctypes.c_char.from_buffer(m))\n"
        f"assert libc.madvise(ctypes.c_void_p(at), 1 << 20, {18 if advice == 'MADV_WIPEONFORK' else 10}) == 0\n"
        "import signal\n"
        "def seen(*_):\n"
        "    open('/tmp/seen.new', 'w').write(m[:5].decode())\n"
        "    os.rename('/tmp/seen.new', '/tmp/seen')  # whole, never seen half-written\n"
        "signal.signal(signal.SIGUSR1, seen)\n"
        "open('/tmp/ready', 'w').write('1')  # only now: an earlier SIGUSR1 would end it\n"
        "while True: signal.pause()\n"
    )
    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create() as parent:
            await parent.files.write("/tmp/h.py", holder_py)
            await parent.exec("nohup python3 /tmp/h.py >/dev/null 2>&1 & echo $! > /tmp/holder.pid")
            await parent.exec(READY, timeout=60)
            fork = await parent.fork(1)
            try:
                seen = await fork.children[0].exec(
                    "kill -USR1 $(cat /tmp/holder.pid); while [ ! -f /tmp/seen ]; do sleep 0.01; done; cat /tmp/seen",
                    timeout=30)
                assert seen.ok and seen.text == "hello"
            finally:
                await fork.kill()
