"""Lazy restore against real CRIU and crun: a sandbox restored from memory images gets each page
when it first touches it, from the engine's one page server (`criu lazy-pages`, patched to serve
every restore), whose counters say what it copied for each; the page server's death ends the
sandboxes it had not finished with the reason, never leaves them running on zero-filled memory.

A holder process keeps MB MiB whose pages each carry a known byte; on cue it reads every STEP-th
page and writes how many were wrong, so every touch also checks the memory came back intact.
"""

from __future__ import annotations

import asyncio
import os
import select
import stat
import subprocess
import time

import pytest

from fanfold import AsyncFleet, CheckpointFailed, EngineConfig, InfrastructureError, SandboxGone
from fanfold.host import census, procs
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


def our_page_servers(config: EngineConfig) -> list[int]:
    """The page servers of this process's engine: a server the session started on the same state dir
    (the unix and tcp transports' engine) has its own."""
    return [pid for pid in census.page_servers(config) if procs.stat_fields(pid)[1:2] == [str(os.getpid())]]


def server_pid(config: EngineConfig, sandbox_id: str) -> int:
    """The pid of the page server serving ``sandbox_id``."""
    return int((lazy_dir(config, sandbox_id) / lazy.PID_FILE).read_text().split()[0])


async def kill_page_server(pid: int, sandbox) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL page server ``pid`` and see ``sandbox``, which it had not finished, end for it."""
    os.kill(pid, 9)
    assert wait_gone(pid)
    with pytest.raises(SandboxGone, match="page server .* was killed by signal 9 after copying"):
        for _ in range(100):  # a call the engine took before it saw the kill may still finish
            await sandbox.exec("true")


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


async def test_one_page_server_serves_every_lazy_restore(holder_snapshot, config):
    fleet, snapshot = holder_snapshot
    async with await fleet.create(snapshot.id, memory_mb=MB + 192) as first, \
            await fleet.create(snapshot.id, memory_mb=MB + 192) as second:
        pid = server_pid(config, first.id)
        assert server_pid(config, second.id) == pid
        assert our_page_servers(config) == [pid]
        assert await touch(first, 1, 100) == 0
        assert (await pages(fleet, second.id))["copied"] < PAGES // 20, "each sandbox counts its own pages"
        assert await touch(second, 1, 1) == 0
        assert (await pages(fleet, second.id))["copied"] >= PAGES
        assert (await pages(fleet, first.id))["copied"] < PAGES // 20
        async with await first.fork(2) as fork:  # drains first alone, its children served by the same daemon
            assert (await pages(fleet, first.id))["state"] == "done"
            assert (await pages(fleet, second.id))["state"] == "serving"
            assert {server_pid(config, c.id) for c in fork.children} == {pid}
            assert await touch(fork.children[0], 1, 1) == 0


async def test_execs_in_a_served_sandbox_leave_the_page_server_nothing(holder_snapshot, config):
    """Each exec forks the agent, whose uffd the page server gets for the child: it lets go of it
    once the child exec'd, not at the sandbox's end."""
    fleet, snapshot = holder_snapshot
    async with await fleet.create(snapshot.id, memory_mb=MB + 192) as child:
        fds = f"/proc/{server_pid(config, child.id)}/fd"
        before = len(os.listdir(fds))
        for _ in range(20):
            assert (await child.exec("true")).ok
        assert len(os.listdir(fds)) - before < 5
        assert await touch(child, 1, 1) == 0


async def test_a_restore_the_page_server_cannot_serve_fails_alone(holder_snapshot, config, tmp_path):
    fleet, snapshot = holder_snapshot
    async with await fleet.create(snapshot.id, memory_mb=MB + 192) as served:
        pages_ = fleet._transport.backend.pages  # type: ignore[attr-defined]
        with pytest.raises(InfrastructureError, match="cannot serve sandbox sb-none: cannot open the images dir"):
            await pages_.serve("sb-none", tmp_path / "missing", tmp_path)
        assert await touch(served, 1, 1) == 0
        async with await fleet.create(snapshot.id, memory_mb=MB + 192) as later:
            assert server_pid(config, later.id) == server_pid(config, served.id)
            assert await touch(later, 1, 10) == 0


async def test_a_sandbox_whose_pages_cannot_be_read_ends_alone(holder_snapshot, config):
    """The page server fails that sandbox's session, not itself: the sandbox ends with the reason,
    another it serves goes on."""
    fleet, snapshot = holder_snapshot
    async with await fleet.create() as plain:
        other = await plain.snapshot(memory=True)
    try:
        async with await fleet.create(other.id) as bystander:
            broken = await fleet.create(snapshot.id, memory_mb=MB + 192)
            assert server_pid(config, broken.id) == server_pid(config, bystander.id)
            for image in (config.state_dir / "snapshots" / snapshot.id / "memory").glob("pages-*.img"):
                os.truncate(image, 0)
            with pytest.raises(SandboxGone, match="page server .* failed to serve it"):
                await broken.files.write("/tmp/go-1", "1")  # the holder reads every page: a fault fails
                # The wait may come back as a command the sandbox's end killed, with no output; a call
                # after the engine has ended the sandbox raises.
                await broken.exec("while [ ! -f /tmp/done-1 ]; do sleep 0.005; done", timeout=60)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    await broken.exec("true")
            assert (await bystander.exec("echo on")).text == "on\n"
            assert our_page_servers(config) == [server_pid(config, bystander.id)]
    finally:
        await fleet.delete_snapshot(other.id)


async def test_page_server_processes_share_the_sandboxes_and_die_alone(config, holder_snapshot):
    _, snapshot = holder_snapshot
    two = EngineConfig(state_dir=config.state_dir, page_server_processes=2)
    async with AsyncFleet(config=two) as fleet:
        first, second = await asyncio.gather(*(fleet.create(snapshot.id, memory_mb=MB + 192) for _ in range(2)))
        async with first, second:  # restored at once, on one server each
            pid = server_pid(config, first.id)
            assert server_pid(config, second.id) != pid
            assert sorted(our_page_servers(config)) == sorted([pid, server_pid(config, second.id)])
            await kill_page_server(pid, first)
            assert await touch(second, 1, 1) == 0


async def test_a_killed_page_server_ends_its_sandbox_and_says_why(holder_snapshot, config):
    fleet, snapshot = holder_snapshot
    child = await fleet.create(snapshot.id, memory_mb=MB + 192)
    pid = server_pid(config, child.id)
    await kill_page_server(pid, child)
    assert child.id not in {s.id for s in await fleet.list()}


async def test_a_killed_page_server_ends_only_the_sandboxes_it_had_not_finished(holder_snapshot, config):
    """A sandbox whose memory is all in keeps running; the next lazy restore gets a new page server."""
    fleet, snapshot = holder_snapshot
    async with await fleet.create(snapshot.id, memory_mb=MB + 192) as finished:
        pid = server_pid(config, finished.id)
        await fleet.delete_snapshot((await finished.snapshot(memory=True)).id)  # drains it first
        assert (await pages(fleet, finished.id))["state"] == "done"
        unfinished = await fleet.create(snapshot.id, memory_mb=MB + 192)
        assert server_pid(config, unfinished.id) == pid
        await kill_page_server(pid, unfinished)
        assert await touch(finished, 1, 1) == 0
        async with await fleet.create(snapshot.id, memory_mb=MB + 192) as later:
            assert server_pid(config, later.id) != pid
            assert await touch(later, 1, 1) == 0


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
        pid = server_pid(config, kept.id)
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


async def test_an_idle_sandbox_gets_the_rest_of_its_memory(config, holder_snapshot):
    """A sandbox that stops touching new pages does not keep the page server serving it."""
    _, snapshot = holder_snapshot
    idle = EngineConfig(state_dir=config.state_dir, page_server_idle_s=0.5)
    async with AsyncFleet(config=idle) as fleet:
        async with await fleet.create(snapshot.id, memory_mb=MB + 192) as child:
            source = fleet._transport.backend.page_sources.get(child.id)  # type: ignore[attr-defined]
            if source is not None:  # else drained already
                assert await asyncio.wait_for(source.ended(), 30) is None
            assert not (lazy_dir(config, child.id) / lazy.PID_FILE).exists()
            counts = await pages(fleet, child.id)
            assert counts["state"] == "done" and counts["copied"] >= PAGES
            assert await touch(child, 1, 1) == 0


async def test_restores_past_the_cap_on_lazy_sandboxes_copy_every_page_at_once(config, holder_snapshot):
    _, snapshot = holder_snapshot
    capped = EngineConfig(state_dir=config.state_dir, page_servers_max=1)
    async with AsyncFleet(config=capped) as fleet:
        async with await fleet.create(snapshot.id, memory_mb=MB + 192) as first, \
                await fleet.create(snapshot.id, memory_mb=MB + 192) as second:
            assert (await pages(fleet, first.id))["state"] == "serving"
            assert await pages(fleet, second.id) is None  # restored eagerly: not served
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
