"""Lazy restore against real CRIU and crun: a sandbox restored from memory images gets each page
when it first touches it, from a page server (`criu lazy-pages`, patched) whose counters say
what it copied; a page server's death ends its sandbox with the reason, never leaves it running
on zero-filled memory.

A holder process keeps MB MiB whose pages each carry a known byte; on cue it reads every STEP-th
page and writes how many were wrong, so every touch also checks the memory came back intact.
"""

from __future__ import annotations

import asyncio
import os
import select
import stat
import subprocess

import pytest

from fanfold import AsyncFleet, CheckpointFailed, EngineConfig, SandboxGone
from fanfold.runtime import lazy, oci_sandbox

MB = 64
PAGES = MB * 256
ONE_PCT = PAGES // 100
HOLDER = f"""
import os, time
pages = {PAGES}
state = bytearray(pages * 4096)
for i in range(pages):
    state[i * 4096] = i % 251 + 1
open("/tmp/ready", "w").write("1")
n = 0
while True:
    n += 1
    while not os.path.exists(f"/tmp/go-{{n}}"):
        time.sleep(0.005)
    step = int(open(f"/tmp/go-{{n}}").read())
    bad = sum(state[i * 4096] != i % 251 + 1 for i in range(0, pages, step))
    open(f"/tmp/done-{{n}}.new", "w").write(str(bad))
    os.rename(f"/tmp/done-{{n}}.new", f"/tmp/done-{{n}}")
"""


async def start_holder(sandbox) -> None:
    await sandbox.files.write("/tmp/holder.py", HOLDER)
    await sandbox.exec("nohup python3 /tmp/holder.py >/dev/null 2>&1 &")
    assert (await sandbox.exec("while [ ! -f /tmp/ready ]; do sleep 0.01; done", timeout=60)).ok


async def touch(sandbox, round_: int, step: int) -> int:
    """Have the holder read every ``step``-th page (its ``round_``-th cue); the pages it found wrong."""
    await sandbox.files.write(f"/tmp/go-{round_}", str(step))
    done = await sandbox.exec(f"while [ ! -f /tmp/done-{round_} ]; do sleep 0.005; done; cat /tmp/done-{round_}",
                              timeout=60)
    return int(done.text)


async def pages(fleet, sandbox_id: str) -> dict | None:
    listed = {s["id"]: s for s in (await fleet.metrics())["sandboxes"]}
    return listed[sandbox_id]["memory_pages"]


def lazy_dir(config: EngineConfig, sandbox_id: str):
    return oci_sandbox.paths(config, sandbox_id).lazy


def wait_gone(pid: int, timeout: float = 60) -> bool:
    """Whether process ``pid`` exits within ``timeout`` s (a pidfd turns readable when it does)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([pidfd], [], [], timeout)[0])
    finally:
        os.close(pidfd)


@pytest.fixture
async def holder_snapshot(config):
    """A fleet and a memory snapshot of a sandbox whose holder keeps MB MiB."""
    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create(memory_mb=MB + 192) as parent:
            await start_holder(parent)
            snapshot = await parent.snapshot(memory=True)
        try:
            yield fleet, snapshot
        finally:
            await fleet.delete_snapshot(snapshot.id)


async def test_untouched_pages_are_never_copied_and_touched_ones_once(holder_snapshot):
    fleet, snapshot = holder_snapshot
    async with await fleet.create(snapshot.id, memory_mb=MB + 192) as child:
        first = await pages(fleet, child.id)
        assert first["state"] == "serving" and first["total"] >= PAGES
        assert first["copied"] < first["total"] // 20, "only what restoring and one exec touched is in"
        # its argv is on its main stack, restored eagerly: other processes read it (remote reads of a
        # page not yet copied would fail)
        assert "python3 /tmp/holder.py" in (await child.exec("ps -eo args")).text
        first = await pages(fleet, child.id)
        assert await touch(child, 1, 100) == 0  # 1% of the state, every page as it was
        after = await pages(fleet, child.id)
        assert ONE_PCT <= after["copied"] - first["copied"] < 3 * ONE_PCT
        assert after["faults"] >= ONE_PCT and after["state"] == "serving"
        assert await touch(child, 2, 100) == 0  # the same pages again: already in
        again = await pages(fleet, child.id)
        assert again["copied"] - after["copied"] < ONE_PCT // 2, "a page was copied twice"
        assert await touch(child, 3, 1) == 0  # every page
        assert (await pages(fleet, child.id))["copied"] >= PAGES


async def test_a_lazy_sandbox_is_drained_before_a_checkpoint_and_loses_nothing(holder_snapshot):
    """CRIU dumps only the pages a process has: the page server copies the rest in first."""
    fleet, snapshot = holder_snapshot
    async with await fleet.create(snapshot.id, memory_mb=MB + 192) as child:
        assert (await pages(fleet, child.id))["copied"] < PAGES // 20
        async with await child.fork(2) as fork:
            assert (await pages(fleet, child.id))["state"] == "done"  # drained, then dumped
            for grandchild in fork.children:
                assert (await pages(fleet, grandchild.id))["state"] == "serving"
                assert await touch(grandchild, 1, 1) == 0
        await child.suspend()
        await child.resume()
        assert (await pages(fleet, child.id))["copied"] < PAGES // 20
        assert await touch(child, 1, 1) == 0


async def test_a_killed_page_server_ends_its_sandbox_and_says_why(holder_snapshot, config):
    fleet, snapshot = holder_snapshot
    child = await fleet.create(snapshot.id, memory_mb=MB + 192)
    pid = int((lazy_dir(config, child.id) / lazy.PID_FILE).read_text().split()[0])
    os.kill(pid, 9)
    assert wait_gone(pid)
    with pytest.raises(SandboxGone, match="page server .* was killed by signal 9 after copying"):
        for _ in range(100):  # a call the engine took before it saw the kill may still finish
            await child.exec("true")
    assert child.id not in {s.id for s in await fleet.list()}


async def test_a_page_server_killed_mid_restore_fails_the_restore_cleanly(holder_snapshot, config, tmp_path):
    """The restore meets no page server: it fails, the create says so, nothing is left behind."""
    fleet, snapshot = holder_snapshot
    killing = tmp_path / "criu"
    killing.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = restore ]; then\n'
        '  work=$(echo "$@" | sed -n "s/.* -W \\([^ ]*\\) .*/\\1/p")\n'
        '  kill -9 $(cut -d" " -f1 "$work/lazy-pages.pid")\n'
        "fi\n"
        f'exec {config.criu} "$@"\n')
    killing.chmod(killing.stat().st_mode | stat.S_IEXEC)
    async with AsyncFleet(config=EngineConfig(state_dir=config.state_dir, criu=str(killing))) as broken:
        with pytest.raises(CheckpointFailed, match="CRIU could not restore"):
            await broken.create(snapshot.id, memory_mb=MB + 192)
        assert not [s for s in await broken.list() if s.source == snapshot.id]
    async with await fleet.create(snapshot.id, memory_mb=MB + 192) as child:  # the snapshot is unharmed
        assert await touch(child, 1, 10) == 0


async def test_a_sandbox_outliving_its_engine_gets_all_its_memory(holder_snapshot, config):
    """An engine that closes (or dies) lets its page servers copy the rest in and exit; the next
    engine can checkpoint the sandbox."""
    fleet, snapshot = holder_snapshot
    async with AsyncFleet(config=config) as other:
        kept = await other.create(snapshot.id, memory_mb=MB + 192, detached=True)
        pid = int((lazy_dir(config, kept.id) / lazy.PID_FILE).read_text().split()[0])
    try:
        assert wait_gone(pid), "the page server did not finish after its engine closed"
        assert (await pages(fleet, kept.id))["copied"] >= PAGES
        again = await fleet.get(kept.id)
        await again.suspend()
        await again.resume()
        assert await touch(again, 1, 1) == 0
    finally:
        await (await fleet.get(kept.id)).kill()


async def test_eager_restore_is_a_switch(config, holder_snapshot):
    _, snapshot = holder_snapshot
    eager = EngineConfig(state_dir=config.state_dir, lazy_restore=False)
    async with AsyncFleet(config=eager) as fleet:
        async with await fleet.create(snapshot.id, memory_mb=MB + 192) as child:
            assert await pages(fleet, child.id) is None
            assert not (lazy_dir(config, child.id) / lazy.PID_FILE).exists()
            assert await touch(child, 1, 1) == 0


async def test_an_idle_page_server_copies_the_rest_in_and_ends(config, holder_snapshot):
    """A sandbox that stops touching new pages does not keep a page server for the rest."""
    _, snapshot = holder_snapshot
    idle = EngineConfig(state_dir=config.state_dir, page_server_idle_s=0.5)
    async with AsyncFleet(config=idle) as fleet:
        async with await fleet.create(snapshot.id, memory_mb=MB + 192) as child:
            try:
                pid = int((lazy_dir(config, child.id) / lazy.PID_FILE).read_text().split()[0])
            except FileNotFoundError:
                pid = None  # drained already
            assert pid is None or await asyncio.to_thread(wait_gone, pid, 30), "the idle page server still runs"
            counts = await pages(fleet, child.id)
            assert counts["state"] == "done" and counts["copied"] >= PAGES
            assert await touch(child, 1, 1) == 0


async def test_restores_past_the_page_server_cap_copy_every_page_at_once(config, holder_snapshot):
    _, snapshot = holder_snapshot
    capped = EngineConfig(state_dir=config.state_dir, page_servers_max=1)
    async with AsyncFleet(config=capped) as fleet:
        async with await fleet.create(snapshot.id, memory_mb=MB + 192) as first, \
                await fleet.create(snapshot.id, memory_mb=MB + 192) as second:
            assert (await pages(fleet, first.id))["state"] == "serving"
            assert await pages(fleet, second.id) is None  # restored eagerly: no page server of its own
            assert list(fleet._transport.backend.page_sources) == [first.id]  # type: ignore[attr-defined]
            assert await touch(first, 1, 1) == 0 and await touch(second, 1, 1) == 0
        async with await fleet.create(snapshot.id, memory_mb=MB + 192) as third:  # room again: lazy
            assert (await pages(fleet, third.id))["state"] == "serving"


def resident(files) -> int:
    """Bytes of ``files`` in the page cache (util-linux's fincore)."""
    done = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                          capture_output=True, text=True, check=True)
    return sum(int(line) for line in done.stdout.split())


async def test_images_no_restore_used_lately_leave_the_page_cache(config):
    cold = EngineConfig(state_dir=config.state_dir, images_cold_s=0)
    async with AsyncFleet(config=cold) as fleet:
        async with await fleet.create() as sandbox:
            snapshot = await sandbox.snapshot(memory=True)
        try:
            images = sorted((config.state_dir / "snapshots" / snapshot.id / "memory").glob("pages-*.img"))
            assert images and resident(images) > 0  # just written: hot
            await fleet._transport.backend.sweep(thorough=True)
            assert resident(images) == 0
            async with await fleet.create(snapshot.id) as copy:  # read from disk again
                assert (await copy.exec("echo back")).text == "back\n"
        finally:
            await fleet.delete_snapshot(snapshot.id)
