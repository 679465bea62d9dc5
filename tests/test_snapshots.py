"""Snapshots, fork, pause, suspend, resume and reset against real CRIU, crun and processes.

Each test runs embedded and over the unix socket (the TCP client is the same code);
the CRIU failure test swaps in a CRIU told to fail mid-dump, so it runs embedded only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import os
import shutil
import sqlite3
import stat
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pytest

from fanfold import (AsyncFleet, CheckpointFailed, EngineConfig, FanfoldError, Fleet, InvalidRequest, SnapshotInUse,
                     SnapshotNotFound)
from fanfold.engine.lifecycle import Lifecycle
from fanfold.engine.snapshots import SnapshotStore
from fanfold.host import cgroups

from conftest import fleet_args

# Each value is renamed into place: `echo > /tmp/count` truncates first, and a read between
# the truncate and the write saw an empty file. The first value is written before the loop is
# backgrounded: a pause right after starting it could freeze the loop before its first write.
COUNTER = ("echo 0 > /tmp/count; nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count;"
           " sleep 0.02; done' >/dev/null 2>&1 &")
SERVER = (
    "nohup python3 -c \"import http.server, socketserver; socketserver.TCPServer(('127.0.0.1', 8000),"
    " http.server.SimpleHTTPRequestHandler).serve_forever()\" >/dev/null 2>&1 &"
)
# argv, so no shell of ours matches; -P 1, so a loop's fork that has not exec'd sleep yet does not either
LOOPS = ["pgrep", "-c", "-P", "1", "-f", "while :"]
GET = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/').status)\""
# GET once the server just started listens: polled, up to 10 s
GET_SERVED = f"i=0; until {GET} 2>/dev/null; do i=$((i+1)); [ $i -lt 200 ] || exit 1; sleep 0.05; done"


@pytest.fixture(params=["embedded", "unix"])
async def sfleet(request: pytest.FixtureRequest, config: EngineConfig):
    async with AsyncFleet(**fleet_args(request.param, request, config)) as fleet:
        yield fleet


async def count(sandbox) -> int:
    return int((await sandbox.exec("cat /tmp/count")).text)


async def advances(sandbox, within: float = 10.0) -> bool:
    """True once the counter moves (it ticks every 20 ms while the sandbox runs); False if it
    stands still for ``within`` seconds. It polls: a loop just restored may be slow to get the CPU."""
    first = await count(sandbox)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        await sandbox.exec("sleep 0.05")
        if await count(sandbox) > first:
            return True
    return False


async def test_fork_children_run_on_apart(sfleet):
    async with await sfleet.create() as parent:
        await parent.exec(COUNTER)
        await parent.files.write("/root/before", "before\n")
        async with await parent.fork(3) as fork:
            assert fork.result.parent_pause_ms > 0 and fork.result.total_ms >= fork.result.parent_pause_ms
            assert fork.result.user_random_copied
            await fork.children[0].files.write("/root/after", "only here\n")
            for child in [parent, *fork.children]:
                assert await advances(child)
                assert (await child.exec("cat /root/before")).text == "before\n"
            assert (await fork.children[0].exec("cat /root/after")).ok
            assert not any([(await c.exec("cat /root/after")).ok for c in fork.children[1:] + [parent]])
            ids = {parent.id, *(c.id for c in fork.children)}
            assert len(ids) == 4
            names = {(await c.exec("hostname")).text.strip() for c in fork.children}
            assert names == {c.id for c in fork.children}
            randoms = {(await c.exec("head -c 16 /dev/urandom | od -An -tx1")).text for c in fork.children}
            assert len(randoms) == 3
            # own pid and network namespaces: each child can bind the same port
            for child in fork.children:
                assert (await child.exec(SERVER)).ok
            for child in fork.children:
                assert (await child.exec(GET_SERVED, timeout=30)).text.strip().endswith("200")


async def test_etc_hostname_names_the_sandbox_as_hostname_does(sfleet):
    async def names(sandbox) -> list[str]:
        return (await sandbox.exec("cat /etc/hostname; hostname")).text.split()

    async with await sfleet.create() as parent:
        assert await names(parent) == [parent.id, parent.id]
        disk, memory = await parent.snapshot(), await parent.snapshot(memory=True)
        async with await sfleet.create(disk) as from_disk, await sfleet.create(memory) as from_memory:
            assert await names(from_disk) == [from_disk.id, from_disk.id]
            assert await names(from_memory) == [from_memory.id, from_memory.id]
        async with await parent.fork(2) as fork:
            for child in fork.children:
                assert await names(child) == [child.id, child.id]
        await parent.reset()
        assert await names(parent) == [parent.id, parent.id]


async def test_fork_children_end_with_their_parent_unless_told_otherwise(sfleet):
    async with await sfleet.create(deadline=600) as parent:
        async with await parent.fork(2) as fork:
            assert [abs(c.info.deadline_at - parent.info.deadline_at) < 5 for c in fork.children] == [True, True]
    async with await sfleet.create(deadline=3) as short:
        async with await short.fork(1) as fork:
            child = fork.children[0]
            assert abs(child.info.deadline_at - short.info.deadline_at) < 1
            give_up = time.monotonic() + 30
            while {short.id, child.id} & {s.id for s in await sfleet.list()}:  # the deadline takes both
                assert time.monotonic() < give_up
                await asyncio.sleep(0.2)


async def test_a_fork_given_a_deadline_gives_it_to_its_children(afleet):
    async with await afleet.create(deadline=600) as parent:
        async with await parent.fork(1, deadline=1200) as fork:
            info = await fork.children[0].refresh()
            assert 1100 < info.deadline_at - time.time() <= 1200
        with pytest.raises(InvalidRequest, match="deadline"):
            await parent.fork(1, deadline=-1)


async def test_fork_runs_a_command_in_each_child(sfleet):
    async with await sfleet.create() as parent:
        async with await parent.fork(2, cmd="hostname > /root/me; cat /root/me") as fork:
            assert [r.text.strip() for r in fork.result.setup] == [c.id for c in fork.children]


async def test_rm_rf_in_a_child_harms_no_one(sfleet):
    async with await sfleet.create() as parent:
        await parent.exec(COUNTER)
        async with await parent.fork(2) as fork:
            victim, sibling = fork.children
            await victim.exec("rm -rf --no-preserve-root / 2>/dev/null", timeout=120)
            assert await advances(sibling) and await advances(parent)
            assert (await sibling.exec("ls /usr/bin | wc -l")).text.strip() != "0"


async def test_fork_of_a_fork_and_of_a_suspended_sandbox(sfleet):
    async with await sfleet.create() as parent:
        await parent.exec(COUNTER)
        first = await parent.fork(1)
        child = first.children[0]
        try:
            second = await child.fork(1)
            grandchild = second.children[0]
            assert await advances(grandchild)
            await grandchild.kill()
            suspended = await parent.suspend()
            assert suspended.state == "suspended"
            third = await parent.fork(1)
            assert await advances(third.children[0]) and await advances(parent)
            await third.children[0].kill()
        finally:
            await child.kill()


async def test_resume_frees_the_suspend_images_without_waiting_on_their_removal(config):
    async with AsyncFleet(config=config) as fleet:
        engine = fleet._transport
        async with await fleet.create() as sandbox:
            await sandbox.exec(COUNTER)
            await sandbox.suspend()
            snapshot_id = engine.db.get(sandbox.id)["suspended_to"]
            memory = engine.snaps.memory_dir(snapshot_id)
            assert memory.is_dir()
            await sandbox.resume()
            assert not memory.exists(), "renamed aside as the resume returns"
            assert await advances(sandbox)
            deadline = time.monotonic() + 30
            while list(memory.parent.glob(".drop-*")) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # its own thread removes it
            assert not list(memory.parent.glob(".drop-*"))


def _suspend_committed_after_its_sandbox_went(monkeypatch) -> tuple[threading.Event, list[str]]:
    """Hold each suspend's snapshot commit until a destroy of its sandbox is done: the moment a script
    failing with a suspend in flight gives, as its fleet's close destroys the sandbox mid-suspend.
    Returns (set once a commit waits, the ids of the suspend snapshots committed)."""
    waiting, destroyed, taken = threading.Event(), threading.Event(), []
    commit, release = SnapshotStore.commit, Lifecycle._release

    def held_commit(self, staged, info, layers, tenant):  # type: ignore[no-untyped-def]
        if info.kind == "suspend":
            waiting.set()
            destroyed.wait(60)
            time.sleep(1)  # slower than the rest of the close, as a big image's commit on a busy host was
            taken.append(info.id)
        return commit(self, staged, info, layers, tenant)

    async def marked_release(self, sandbox_id: str) -> None:
        try:
            await release(self, sandbox_id)
        finally:
            destroyed.set()

    monkeypatch.setattr(SnapshotStore, "commit", held_commit)
    monkeypatch.setattr(Lifecycle, "_release", marked_release)
    return waiting, taken


def _left_of(config: EngineConfig, sandbox_id: str, snapshot_ids: list[str]) -> list[str]:
    """Rows of snapshots taken of ``sandbox_id`` and files of ``snapshot_ids`` the state dir still holds."""
    with sqlite3.connect(config.state_dir / "fanfold.db") as db:
        rows = [r[0] for r in db.execute("SELECT id FROM snapshots WHERE sandbox_id=?", (sandbox_id,))]
    files = [config.state_dir / where / i for i in snapshot_ids for where in ("snapshots", "layers")]
    return rows + [str(path) for path in files if os.path.lexists(path)]


async def test_a_suspend_snapshot_goes_with_its_sandbox_when_the_async_script_fails(config, monkeypatch):
    waiting, taken = _suspend_committed_after_its_sandbox_went(monkeypatch)
    with pytest.raises(RuntimeError, match="the script failed"):
        async with AsyncFleet(config=config) as fleet:
            sandbox = await fleet.create()
            suspending = asyncio.ensure_future(sandbox.suspend())
            await asyncio.to_thread(waiting.wait, 60)
            raise RuntimeError("the script failed")
    assert suspending.done() and isinstance(suspending.exception(), FanfoldError)
    assert len(taken) == 1 and _left_of(config, sandbox.id, taken) == []


def test_a_suspend_snapshot_goes_with_its_sandbox_when_the_sync_script_fails(config, monkeypatch):
    waiting, taken = _suspend_committed_after_its_sandbox_went(monkeypatch)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with pytest.raises(RuntimeError, match="the script failed"):
            with Fleet(config=config) as fleet:
                sandbox = fleet.create()
                suspending = pool.submit(sandbox.suspend)
                waiting.wait(60)
                raise RuntimeError("the script failed")
        assert isinstance(suspending.exception(60), FanfoldError)
    assert len(taken) == 1 and _left_of(config, sandbox.id, taken) == []


async def test_a_listening_server_answers_after_resume_and_in_a_restored_copy(sfleet):
    async with await sfleet.create() as sandbox:
        await sandbox.exec(SERVER)
        assert (await sandbox.exec(GET_SERVED, timeout=30)).text.strip().endswith("200")
        await sandbox.suspend()
        assert (await sandbox.exec(GET)).text.strip() == "200"
        snapshot = await sandbox.snapshot(memory=True)
        async with await sfleet.create(snapshot.id) as copy:
            assert (await copy.exec(GET)).text.strip() == "200"


async def test_three_suspend_resume_cycles_lose_nothing(sfleet):
    async with await sfleet.create() as sandbox:
        await sandbox.exec(COUNTER)
        for cycle in range(3):
            await sandbox.files.write(f"/root/file{cycle}", f"{cycle}\n")
            before = await count(sandbox)
            info = await sandbox.suspend()
            assert info.state == "suspended"
            assert (await sandbox.resume()).state == "running"
            assert await count(sandbox) >= before
            assert await advances(sandbox)
        assert (await sandbox.exec("cat /root/file0 /root/file1 /root/file2")).text == "0\n1\n2\n"
        assert (await sandbox.exec(LOOPS)).text.strip() == "1"


async def test_any_call_resumes_a_suspended_or_paused_sandbox(sfleet, config):
    async with await sfleet.create() as sandbox:
        await sandbox.exec(COUNTER)
        assert (await sandbox.pause()).state == "paused"
        assert cgroups.frozen(config.cgroup_parent, sandbox.id)
        assert (await sandbox.unpause()).state == "running"
        assert not cgroups.frozen(config.cgroup_parent, sandbox.id)
        await sandbox.pause()
        assert await advances(sandbox)  # exec thawed it
        assert (await sandbox.refresh()).state == "running"
        await sandbox.suspend()
        assert (await sandbox.files.read("/tmp/count")).strip().isdigit()
        assert (await sandbox.refresh()).state == "running"


async def test_disk_snapshot_starts_fresh_processes_on_the_saved_disk(sfleet):
    async with await sfleet.create() as sandbox:
        await sandbox.exec(COUNTER)
        await sandbox.exec("echo kept > /root/kept; rm /etc/hostname 2>/dev/null; echo gone > /usr/local/gone")
        snapshot = await sandbox.snapshot()
        assert not snapshot.memory and snapshot.parent == sandbox.info.image_id
        async with await sfleet.create(snapshot.id) as copy:
            assert (await copy.exec("cat /root/kept /usr/local/gone")).text == "kept\ngone\n"
            assert (await copy.exec(LOOPS)).text.strip() == "0"
            assert copy.info.source == snapshot.id


async def test_memory_snapshot_continues_where_it_stopped(sfleet):
    async with await sfleet.create(memory_mb=256) as sandbox:
        await sandbox.exec(COUNTER)
        snapshot = await sandbox.snapshot(memory=True)
        assert snapshot.memory and snapshot.size_bytes > 0 and snapshot.limits.memory_mb == 256
        async with await sfleet.create(snapshot.id) as copy:
            assert await advances(copy)
            assert copy.info.limits.memory_mb == 256


# What a sandbox may leave in /dev, its tmpfs: a tree of directories, files and a symlink, with
# owners, modes and times of their own; and how it is seen, to compare a restored copy with.
DEEP = "/dev/tree/" + "d" * 60 + "/" + "f" * 60  # over ustar's 100 for a name: the header's prefix holds the rest
DEV_TREE = (f"mkdir -p /dev/tree/sub {DEEP.rsplit('/', 1)[0]} && echo deep > {DEEP}"
            " && echo noted > /dev/tree/note && ln -s note /dev/tree/link"
            " && chown 1000:1000 /dev/tree/note && chmod 640 /dev/tree/note && chmod 750 /dev/tree/sub"
            " && touch -d @1700000000 /dev/tree/note && touch -h -d @1650000000 /dev/tree/link"
            " && touch -d @1600000000 /dev/tree/sub")
SEE_TREE = f"cd /dev/tree && find . | sort | xargs stat -c '%n %F %a %u %g %Y' && cat note {DEEP}"
USTAR, GNU_TAR = b"ustar\x0000", b"ustar  \x00"  # the magic at offset 257 of the first header


# What only tar keeps: each case's /dev goes to tar (a hole, a fifo, a hard link)
TARS_ONLY = ["truncate -s 1M /dev/tree/hole", "rm /dev/tree/hole && mkfifo /dev/tree/pipe",
             "rm /dev/tree/pipe && ln /dev/tree/note /dev/tree/hard"]


@pytest.fixture
def tar_calls(monkeypatch: pytest.MonkeyPatch):
    """A ``tar`` first on the PATH CRIU inherits from the engine, logging each call and running the
    real one; yields the log. In a world-readable dir: CRIU runs the dump's tar as the sandbox's root."""
    where = Path(tempfile.mkdtemp(prefix="fanfold-tar-spy-"))
    try:
        where.chmod(0o755)
        log = where / "calls"
        log.touch(mode=0o666)
        log.chmod(0o666)
        (where / "tar").write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {shutil.which("tar")} "$@"\n')
        (where / "tar").chmod(0o755)
        monkeypatch.setenv("PATH", f"{where}:{os.environ['PATH']}")
        yield log
    finally:
        shutil.rmtree(where)


async def test_dev_is_dumped_and_restored_by_criu_itself_and_by_tar_when_it_must(config, tar_calls):
    """/dev is the tmpfs a dump still archives. Directories, files and symlinks CRIU writes and
    reads itself (POSIX ustar; tar was a process forked in the parent's pause and in every restore);
    a hole, a fifo or a hard link go to tar as before; an image dumped before, gzipped, restores."""
    def tar_ran() -> list[str]:  # the tar calls since the last look
        calls = tar_calls.read_text().splitlines()
        tar_calls.write_text("")
        return [call.split()[0] for call in calls]

    snapshots = []
    try:
        async with AsyncFleet(config=config) as fleet:
            async with await fleet.create() as sandbox:
                seen = [await ran(sandbox, DEV_TREE + " && " + SEE_TREE)]
                assert "./note regular file 640 1000 1000 1700000000" in seen[0] and "./link symbolic link" in seen[0]
                assert seen[0].endswith("noted\ndeep\n")
                snapshots.append(await sandbox.snapshot(memory=True))
                assert tar_ran() == []
                for case in TARS_ONLY:
                    seen.append(await ran(sandbox, f"{case} && {SEE_TREE}"))
                    snapshots.append(await sandbox.snapshot(memory=True))
                    assert tar_ran() == ["--create"]
            assert "./hole regular file 644 0 0" in seen[1] and "./pipe fifo 644" in seen[2]

            image = dev_image(config, snapshots[0].id)
            assert image.read_bytes()[257:265] == USTAR
            with tarfile.open(image, "r:") as archive:  # a plain archive tar reads too
                assert {"./tree/note", "./tree/link", "./tree/sub"} <= set(archive.getnames())
            for snapshot, was in zip(snapshots, seen):
                if snapshot is not snapshots[0]:
                    assert dev_image(config, snapshot.id).read_bytes()[257:265] == GNU_TAR
                async with await fleet.create(snapshot.id) as copy:
                    assert await ran(copy, SEE_TREE) == was
                assert tar_ran() == ([] if snapshot is snapshots[0] else ["--extract"])
            mode = image.stat().st_mode
            image.write_bytes(gzip.compress(image.read_bytes()))  # as dumped before: tar with gzip
            image.chmod(mode)
            async with await fleet.create(snapshots[0].id) as older:
                assert await ran(older, SEE_TREE) == seen[0]
            assert "--gzip" in tar_calls.read_text()
    finally:
        async with AsyncFleet(config=config) as fleet:
            for snapshot in snapshots:
                await fleet.delete_snapshot(snapshot.id)


async def ran(sandbox, cmd: str) -> str:
    done = await sandbox.exec(cmd)
    assert done.ok, done
    return done.text


def dev_image(config: EngineConfig, snapshot_id: str) -> Path:
    """The one tmpfs image of a memory snapshot with content: /dev's (the others are empty as mounted)."""
    memory = config.state_dir / "snapshots" / snapshot_id / "memory"
    images = [path for path in memory.glob("tmpfs-dev-*.img") if path.stat().st_size]
    assert len(images) == 1, images
    return images[0]


async def test_reset_returns_to_the_image_or_snapshot(sfleet):
    async with await sfleet.create() as sandbox:
        await sandbox.exec(COUNTER)
        await sandbox.exec("echo dirty > /root/dirty")
        info = await sandbox.reset()
        assert info.state == "running" and info.id == sandbox.id
        assert not (await sandbox.exec("cat /root/dirty")).ok
        assert not (await sandbox.exec("cat /tmp/count")).ok
        await sandbox.exec(COUNTER)
        snapshot = await sandbox.snapshot(memory=True)
        async with await sfleet.create(snapshot) as copy:
            await copy.exec("echo dirty > /root/dirty; pkill -f 'while :' || true")
            await copy.reset()
            assert not (await copy.exec("cat /root/dirty")).ok
            assert await advances(copy)


async def test_lineage_delete_and_gc(sfleet):
    async with await sfleet.create() as sandbox:
        await sandbox.exec("echo 1 > /root/one")
        first = await sandbox.snapshot(name=f"first-{sandbox.id}")
        async with await sfleet.create(first.name) as child:
            await child.exec("echo 2 > /root/two")
            second = await child.snapshot()
            assert second.parent == first.id
            unnamed = await child.snapshot()
        with pytest.raises(SnapshotInUse):
            await sfleet.delete_snapshot(first.id)
        removed = await sfleet.gc()
        assert second.id in removed and unnamed.id in removed and first.id not in removed
        with pytest.raises(SnapshotNotFound):
            await sfleet.get_snapshot(second.id)
        async with await sfleet.create(first.id) as again:
            assert (await again.exec("cat /root/one")).text == "1\n"
    await sfleet.delete_snapshot(first.id)
    assert first.id not in {s.id for s in await sfleet.snapshots()}


async def test_criu_failing_mid_dump_leaves_the_parent_running_and_nothing_behind(config, tmp_path):
    failing = tmp_path / "criu"
    failing.write_text(f'#!/bin/sh\nCRIU_FAULT=3 exec {config.criu} "$@"\n')  # 3: fail while dumping pages
    failing.chmod(failing.stat().st_mode | stat.S_IEXEC)
    broken = EngineConfig(state_dir=config.state_dir, criu=str(failing))
    async with AsyncFleet(config=broken) as fleet:
        async with await fleet.create() as parent:
            await parent.exec(COUNTER)
            snapshots = {s.id for s in await fleet.snapshots()}
            sandboxes = {s.id for s in await fleet.list()}
            with pytest.raises(CheckpointFailed, match="CRIU could not checkpoint"):
                await parent.fork(2)
            with pytest.raises(CheckpointFailed):
                await parent.suspend()
            assert (await parent.refresh()).state == "running"
            assert await advances(parent)
            assert {s.id for s in await fleet.snapshots()} == snapshots
            assert {s.id for s in await fleet.list()} == sandboxes
            assert not list((config.state_dir / "snapshots").glob(".tmp-*"))


async def test_idle_timeout_and_persistence(config):
    async with AsyncFleet(config=config) as fleet:
        ephemeral = await fleet.create(idle_timeout=0.5)
        kept = await fleet.create(persistence="persistent", idle_timeout=0.5)
        try:
            assert kept.info.detached
            await kept.exec(COUNTER)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                states = {s.id: s.state for s in await fleet.list()}
                if ephemeral.id not in states and states.get(kept.id) == "suspended":
                    break
                await asyncio.sleep(0.2)
            assert ephemeral.id not in states and states.get(kept.id) == "suspended"
            assert await advances(kept)
        finally:
            await kept.kill()


async def test_sticky_sandboxes_are_evicted_under_pressure_lowest_priority_first(config):
    squeezed = EngineConfig(state_dir=config.state_dir, pressure_memory_mb=1 << 30)
    async with AsyncFleet(config=config) as fleet:
        low = await fleet.create(persistence="sticky", priority=1)
        high = await fleet.create(persistence="sticky", priority=9)
        kept = await fleet.create(persistence="persistent")
        try:
            async with AsyncFleet(config=squeezed) as pressured:
                deadline = time.monotonic() + 20
                while low.id in {s.id for s in await pressured.list()} and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                ids = {s.id for s in await pressured.list()}
                assert low.id not in ids and high.id in ids and kept.id in ids
        finally:
            await asyncio.gather(low.kill(), high.kill(), kept.kill())


async def test_bad_requests_are_clear(sfleet):
    from fanfold import InvalidRequest

    async with await sfleet.create() as sandbox:
        for bad in (0, 65, -1):
            with pytest.raises(InvalidRequest, match="count"):
                await sandbox.fork(bad)
        before = {s.id for s in await sfleet.list()}
        for bad_cmd in ("", []):  # refused before any child exists: none is left running
            with pytest.raises(InvalidRequest):
                await sandbox.fork(2, cmd=bad_cmd)
        assert {s.id for s in await sfleet.list()} == before
        with pytest.raises(InvalidRequest, match="name"):
            await sandbox.snapshot(name="snap-nope")
        with pytest.raises(SnapshotNotFound):
            await sfleet.create("snap-000000000000")
        with pytest.raises(InvalidRequest, match="persistence"):
            await sfleet.create(persistence="forever")
