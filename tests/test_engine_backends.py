"""The engine's behaviours, each one test body run against both backends.

``fake`` is the real agent as a plain process over a directory: no root, a few seconds a test
at most. ``oci`` is crun, overlayfs, cgroups and CRIU on the session's shared state dir
(root only). Each test ends with nothing of its own left: no row, and on the fake no sandbox
directory, socket or agent process; on oci no mount, cgroup or container (``leaks``).

On the fake, commands run on the host's filesystem as this user, with only their cwd mapped
into the sandbox: no command here names an absolute path to write to. Files go through the
Files API (confined to the sandbox's root on both) or relative paths from a ``cwd``.

Live memory (a process that runs on across a fork or a resume) is the oci backend's alone and
is tested in test_snapshots.py; here fork and resume are checked for what both backends keep.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import os
import pwd
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import run_as_nobody, STATE_DIR, leaks, stray_processes
from fanfold import (
    AsyncFleet, CapacityExceeded, CreateParams, EngineConfig, FanfoldError, FileNotFoundInSandbox, InfrastructureError,
    InvalidRequest, LeaseNotFound, Outcome, SandboxGone, SandboxNotFound, SnapshotInUse, SnapshotNotFound,
)
from fanfold._agent.build import agent_binary
from fanfold.engine import Engine
from fanfold.host import procs
from fanfold.images import LayerStore
from fanfold.runtime import Capabilities, get_backend
from fanfold.runtime.fake import FakeBackend

REPO = Path(__file__).resolve().parent.parent
CLEAN = {"mounts": 0, "cgroups": 0, "containers": 0}
WAIT_S = 30.0
"""How long a poll waits for what should come in a second or two (2 cores, shared with other runs)."""
COUNTER = ("echo 0 > count; nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > count.new; mv count.new count; sleep 0.02; done'"
           " >/dev/null 2>&1 &")
"""A background loop ticking ``count`` in its cwd, each value renamed into place (no read sees half of one);
the first value is written before the loop starts, so a read right after never finds no file."""


class NoMemoryBackend(FakeBackend):
    """The fake, claiming no memory checkpoints: what the engine must refuse on such a backend."""

    name = "fake-no-memory"
    capabilities = Capabilities(memory="none", exact_counters=False, isolated=False)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def fake_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One state dir for every fake test: the ``host`` base and the agent are built there once."""
    return tmp_path_factory.mktemp("fake-state")


@pytest.fixture(params=["fake", "oci"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "oci" and os.geteuid() != 0:
        pytest.skip("the oci backend needs root")
    return request.param


@pytest.fixture
async def cfg(backend: str, fake_state: Path):
    """The backend's engine config; afterwards, nothing the test made is left anywhere."""
    config = (EngineConfig(backend="oci", state_dir=STATE_DIR) if backend == "oci"
              else EngineConfig(backend="fake", state_dir=fake_state))
    before = row_ids(config)
    yield config
    assert await settle(config, before) == set(), "sandbox rows left behind"
    if backend == "fake":
        assert await fake_ids(config) == set()
        assert fake_agents(config.state_dir) == []
    else:
        assert leaks(config) == CLEAN


def row_ids(config: EngineConfig) -> set[str]:
    """Ids of every sandbox row in the state dir's database, read apart from any engine."""
    path = config.state_dir / "fanfold.db"
    if not path.exists():
        return set()
    db = sqlite3.connect(path)
    try:
        return {row[0] for row in db.execute("SELECT id FROM sandboxes")}
    except sqlite3.OperationalError:  # no table yet
        return set()
    finally:
        db.close()


async def settle(config: EngineConfig, before: set[str]) -> set[str]:
    """Kill what a test left (a failed one), so the next starts clean; return the ids it left."""
    left = row_ids(config) - before
    if left:
        engine = Engine(config)
        await engine.start()
        for sandbox_id in left:
            with contextlib.suppress(FanfoldError):
                await engine.kill(sandbox_id)
        await engine.close()
    return left


async def fake_ids(config: EngineConfig) -> set[str]:
    """What a fresh fake backend on the state dir finds: sandbox dirs and sockets."""
    return await FakeBackend(config, LayerStore(config.state_dir)).list_ids()


def fake_agents(state_dir: Path) -> list[str]:
    return [line for line in stray_processes((state_dir,)) if "--subreaper" in line and str(state_dir) in line]


def engine_of(fleet: AsyncFleet) -> Engine:
    engine = fleet._transport
    assert isinstance(engine, Engine)
    return engine


async def until(check: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    """Poll ``check()`` (plain or async) until it returns something true; fail after ``timeout``."""
    give_up = time.monotonic() + timeout
    while True:
        got = check()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        assert time.monotonic() < give_up, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(0.05)


def gone(engine: Engine, *ids: str) -> Callable[[], bool]:
    return lambda: all(engine.db.get(i) is None for i in ids)


def state_is(engine: Engine, sandbox_id: str, state: str) -> Callable[[], bool]:
    return lambda: (row := engine.db.get(sandbox_id)) is not None and row["state"] == state


def ticks(engine: Engine, sandbox_id: str) -> int:
    """The COUNTER's value, read on the host from the live root: no call, so nothing is woken."""
    try:
        return int((engine.backend.root(sandbox_id) / "count").read_text() or 0)
    except (OSError, ValueError):
        return 0


# -- life of a sandbox ------------------------------------------------------------------------


async def test_create_get_list_kill_and_labels(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        tag = uuid.uuid4().hex[:8]
        red = await fleet.create(labels={"run": tag, "colour": "red"})
        blue = await fleet.create(labels={"run": tag, "colour": "blue"})
        assert red.info.state == "running" and red.id != blue.id and red.id.startswith("sb-")
        got = await fleet.get(red.id)
        assert (got.info.labels, got.info.state, got.info.image_id) == ({"run": tag, "colour": "red"}, "running",
                                                                        red.info.image_id)
        assert {s.id for s in await fleet.list(labels={"run": tag})} == {red.id, blue.id}
        assert [s.id for s in await fleet.list(labels={"run": tag, "colour": "blue"})] == [blue.id]
        assert (await red.exec("echo $HOSTNAME")).text == f"{red.id}\n"

        await red.kill()
        assert [s.id for s in await fleet.list(labels={"run": tag})] == [blue.id]
        with pytest.raises(SandboxNotFound):
            await fleet.get(red.id)
        for call in (lambda: red.exec("true"), lambda: red.files.read("/etc/hostname"), red.snapshot, red.pause,
                     red.reset, lambda: engine_of(fleet).kill(red.id)):
            with pytest.raises(SandboxNotFound):
                await call()
        await red.kill()  # the SDK's kill of a sandbox already gone is no error
        for call in (lambda: fleet.get("sb-000000000000"), lambda: engine_of(fleet).exec("sb-000000000000", "true")):
            with pytest.raises(SandboxNotFound):
                await call()


async def test_a_command_in_a_sandbox_killed_under_it_ends_killed_or_gone(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        sandbox = await fleet.create()
        started = asyncio.Event()
        running = asyncio.ensure_future(sandbox.exec("echo go; sleep 60", on_output=lambda *_: started.set()))
        await asyncio.wait_for(started.wait(), WAIT_S)
        await sandbox.kill()
        try:
            ended = await asyncio.wait_for(running, WAIT_S)
        except SandboxGone:
            return
        assert (ended.outcome, ended.signal) == (Outcome.KILLED, 9)  # Outcome.KILLED: "or the sandbox being destroyed"


async def test_pause_freezes_and_the_next_call_wakes_it(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        engine = engine_of(fleet)
        async with await fleet.create() as sandbox:
            await sandbox.exec(COUNTER)
            await until(lambda: ticks(engine, sandbox.id) > 2, "the counter to tick")
            assert (await sandbox.pause()).state == "paused"
            assert (await sandbox.refresh()).state == "paused"
            frozen_at = ticks(engine, sandbox.id)
            await asyncio.sleep(0.3)  # a window to watch for progress, not a synchronisation
            assert ticks(engine, sandbox.id) == frozen_at

            assert (await sandbox.exec("echo awake")).text == "awake\n"  # the call thaws it
            assert (await sandbox.refresh()).state == "running"
            await until(lambda: ticks(engine, sandbox.id) > frozen_at + 2, "the counter to go on")
            await sandbox.pause()
            assert (await sandbox.unpause()).state == "running"


async def test_suspend_and_resume_keep_the_disk_and_reset_returns_to_the_image(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        async with await fleet.create() as sandbox:
            await sandbox.files.write("/root/api.txt", "through the files api\n")
            assert (await sandbox.exec("echo by a command > cmd.txt", cwd="/root")).ok
            assert (await sandbox.suspend()).state == "suspended"
            assert (await sandbox.refresh()).state == "suspended"
            assert (await sandbox.resume()).state == "running"
            assert await sandbox.files.read("/root/api.txt") == b"through the files api\n"
            assert (await sandbox.exec("cat cmd.txt", cwd="/root")).text == "by a command\n"

            await sandbox.suspend()
            woken = await sandbox.exec("cat api.txt", cwd="/root")  # the call resumes it
            assert woken.text == "through the files api\n"
            assert (await sandbox.refresh()).state == "running"

            for before in (sandbox.pause, sandbox.suspend, sandbox.refresh):  # reset from each state
                await sandbox.files.write("/root/api.txt", "again\n")
                await before()
                assert (await sandbox.reset()).state == "running"
                for name in ("/root/api.txt", "/root/cmd.txt"):
                    with pytest.raises(FileNotFoundInSandbox):
                        await sandbox.files.read(name)
                assert (await sandbox.exec("echo fresh")).text == "fresh\n"


async def test_paused_and_suspended_sandboxes_can_be_killed(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        engine = engine_of(fleet)
        paused, suspended = await fleet.create(), await fleet.create()
        await paused.exec(COUNTER)
        await paused.pause()
        await suspended.suspend()
        for sandbox in (paused, suspended):
            await sandbox.kill()
            assert engine.db.get(sandbox.id) is None and sandbox.id not in await engine.backend.list_ids()
        assert suspended.id not in {s.sandbox_id for s in await fleet.snapshots()}  # its suspend image went too


# -- exec -------------------------------------------------------------------------------------


async def test_exec_outcomes(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        async with await fleet.create(env={"FROM_CREATE": "c"}) as sandbox:
            done = await sandbox.exec("echo out; echo err >&2; exit 3")
            assert (done.outcome, done.exit_code, done.stdout, done.stderr) == (Outcome.EXITED, 3, b"out\n", b"err\n")
            assert not done.ok and done.duration_s >= 0

            assert (await sandbox.exec("echo $FROM_CREATE $GREETING", env={"GREETING": "hi"})).text == "c hi\n"
            assert (await sandbox.exec(["printf", "%s|", "a b", "c"])).text == "a b|c|"
            assert (await sandbox.exec("echo here > made", cwd="/tmp")).ok
            assert await sandbox.files.read("/tmp/made") == b"here\n"
            assert (await sandbox.exec("cat", stdin="piped in")).stdout == b"piped in"

            started = time.monotonic()
            slow = await sandbox.exec("sleep 20", timeout=0.3)
            assert (slow.outcome, slow.exit_code) == (Outcome.TIMEOUT, None)
            assert time.monotonic() - started < 15

            killed = await sandbox.exec("kill -9 $$")
            assert (killed.outcome, killed.exit_code, killed.signal) == (Outcome.KILLED, None, 9)

            missing = await sandbox.exec("no-such-command-h8")
            assert (missing.outcome, missing.exit_code) == (Outcome.EXITED, 127)

            big = await sandbox.exec("yes | head -c 100000; yes | head -c 50 >&2", max_output=1000)
            assert (len(big.stdout), big.stdout_truncated) == (1000, True)
            assert (len(big.stderr), big.stderr_truncated) == (50, False)

            chunks: list[tuple[str, bytes]] = []
            streamed = await sandbox.exec("echo one; echo two >&2; echo three",
                                          on_output=lambda stream, data: chunks.append((stream, data)))
            assert b"".join(d for s, d in chunks if s == "stdout") == streamed.stdout == b"one\nthree\n"
            assert b"".join(d for s, d in chunks if s == "stderr") == streamed.stderr == b"two\n"


# -- deadlines, leases, owners ----------------------------------------------------------------


async def test_a_deadline_destroys_the_sandbox_unasked(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        engine = engine_of(fleet)
        sandbox = await fleet.create(deadline=0.5)
        assert sandbox.info.deadline_at is not None
        await until(gone(engine, sandbox.id), "the deadline to destroy it")
        assert sandbox.id not in await engine.backend.list_ids()
        with pytest.raises(SandboxNotFound):
            await sandbox.exec("true")


async def test_leases_renew_close_expire_and_adopt(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        engine = engine_of(fleet)
        lease = await engine.open_lease(ttl=60)
        first = await engine.create(CreateParams(), lease=lease.id)
        second = await engine.create(CreateParams(), lease=lease.id)
        renewed = await engine.renew_lease(lease.id)
        assert (renewed.sandboxes, renewed.ttl) == (2, 60.0) and renewed.expires_at >= lease.expires_at

        other = await engine.open_lease(ttl=60)
        adopted = await engine.adopt(second.id, other.id, labels={"adopted": "yes"}, deadline=600)
        assert adopted.labels == {"adopted": "yes"} and adopted.deadline_at is not None
        assert await engine.close_lease(lease.id) == 1  # only the first: the second changed hands
        assert engine.db.get(first.id) is None and first.id not in await engine.backend.list_ids()
        assert (await engine.exec(second.id, "echo still")).text == "still\n"
        with pytest.raises(LeaseNotFound):
            await engine.renew_lease(lease.id)

        short = await engine.open_lease(ttl=1)
        left = await engine.create(CreateParams(), lease=short.id)
        await until(gone(engine, left.id), "the reaper to reap the unrenewed lease's sandbox")
        with pytest.raises(LeaseNotFound):
            await engine.renew_lease(short.id)
        with pytest.raises(LeaseNotFound):
            await engine.create(CreateParams(), lease=short.id)
        assert left.id not in await engine.backend.list_ids()

        assert await engine.close_lease(other.id) == 1
        assert engine.db.get(second.id) is None


OWNER = textwrap.dedent("""
    import asyncio, json, os, sys
    from fanfold import CreateParams, EngineConfig
    from fanfold.engine import Engine

    async def main():
        engine = Engine(EngineConfig(backend=sys.argv[1], state_dir=sys.argv[2]))
        await engine.start()
        info = await engine.create(CreateParams())
        await engine.exec(info.id, "nohup sleep 1000 >/dev/null 2>&1 &")
        detached = await engine.create(CreateParams(detached=True))
        print(json.dumps({"id": info.id, "pid": engine.db.get(info.id)["pid"], "detached": detached.id}), flush=True)
        os.kill(os.getpid(), 9)

    asyncio.run(main())
""")


async def test_a_dead_owners_sandbox_is_reaped_by_the_next_engine(cfg: EngineConfig):
    env = {**os.environ, "FANFOLD_BACKEND": cfg.backend, "FANFOLD_STATE_DIR": str(cfg.state_dir)}
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", OWNER, cfg.backend, str(cfg.state_dir)],
        capture_output=True, text=True, env=env, timeout=120, cwd=REPO,
    )
    assert done.returncode == -9, done.stderr
    made = json.loads(done.stdout)
    assert procs.running(made["pid"])  # its owner died, not the sandbox
    other = get_backend(cfg, LayerStore(cfg.state_dir))
    await other.prepare()
    try:
        assert made["id"] in await other.list_ids()
    finally:
        await other.close()  # a prepared backend holds the state dir's disk until closed

    engine = Engine(cfg)
    await engine.start()  # reconciles
    try:
        assert engine.db.get(made["id"]) is None
        assert made["id"] not in await engine.backend.list_ids()
        await until(lambda: not procs.running(made["pid"]), "the dead owner's PID 1 to end")
        assert made["id"] not in {info.id for info in await engine.list()}
        assert (await engine.get(made["detached"])).detached  # detached: nobody's to die with
        assert (await engine.exec(made["detached"], "echo kept")).text == "kept\n"
    finally:
        if engine.db.get(made["detached"]) is not None:
            await engine.kill(made["detached"])
        await engine.close()


# -- idle policies, pools, admission ----------------------------------------------------------


async def test_idle_sandboxes_are_destroyed_or_suspended_by_persistence(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        engine = engine_of(fleet)
        ephemeral = await fleet.create(idle_timeout=0.5)
        kept = [await fleet.create(persistence=p, idle_timeout=0.5) for p in ("persistent", "sticky")]
        try:
            for sandbox in kept:
                assert sandbox.info.detached  # sticky and persistent ones outlive their creator
                await sandbox.files.write("/root/note", f"{sandbox.info.persistence}\n")
            await until(gone(engine, ephemeral.id), "the idle ephemeral sandbox to be destroyed")
            for sandbox in kept:
                await until(state_is(engine, sandbox.id, "suspended"), f"the idle {sandbox.info.persistence} suspend")
                assert sandbox.id not in await engine.backend.list_ids()  # no process, no mount: all on disk
                woken = await sandbox.exec("cat note", cwd="/root")  # an exec resumes it
                assert woken.text == f"{sandbox.info.persistence}\n"
        finally:
            for sandbox in kept:
                await sandbox.kill()


async def test_detached_and_persistent_sandboxes_outlive_their_fleet(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        ids = [(await fleet.create(detached=True)).id, (await fleet.create(persistence="persistent")).id]
        owned = await fleet.create()
        await (await fleet.get(ids[1])).files.write("/root/note", "persists\n")
    async with AsyncFleet(config=cfg) as fleet:
        with pytest.raises(SandboxNotFound):
            await fleet.get(owned.id)  # died with its fleet
        for sandbox_id in ids:
            sandbox = await fleet.get(sandbox_id)
            assert sandbox.info.detached and (await sandbox.exec("echo here")).text == "here\n"
            await sandbox.kill()
        persistent = await fleet.create(persistence="persistent")
        assert persistent.info.deadline_at is None  # no default deadline either
        await persistent.kill()


async def test_a_command_in_flight_when_the_fleet_closes_ends_typed(cfg: EngineConfig):
    fleet = AsyncFleet(config=cfg)
    await fleet.start()
    try:
        sandbox = await fleet.create()
        started = asyncio.Event()
        running = asyncio.ensure_future(sandbox.exec("echo go; sleep 60", on_output=lambda *_: started.set()))
        await asyncio.wait_for(started.wait(), WAIT_S)
    finally:
        await fleet.close()
    try:
        ended = await asyncio.wait_for(running, WAIT_S)
    except SandboxGone:
        return
    assert (ended.outcome, ended.signal) == (Outcome.KILLED, 9)


async def test_a_warm_pool_fills_hands_out_refills_and_empties(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        engine = engine_of(fleet)

        def warm() -> set[str]:
            return {r["id"] for r in engine.db.rows() if r["state"] == "pooled" and r["owner"] == engine.owner}

        info = await engine.set_pool("host", 2, wait=WAIT_S)
        assert (info.ready, info.target, info.size) == (2, 2, 2)
        ready = warm()
        assert len(ready) == 2 and not ready & {s.id for s in await fleet.list()}  # nobody's yet
        with pytest.raises(SandboxNotFound):
            await fleet.get(next(iter(ready)))

        sandbox = await fleet.create(labels={"from": "pool"}, env={"GREETING": "warm"})
        assert sandbox.id in ready and sandbox.info.labels == {"from": "pool"}
        assert (await sandbox.exec("echo $GREETING $HOSTNAME")).text == f"warm {sandbox.id}\n"
        assert (await sandbox.refresh()).deadline_at is not None
        [pool] = await engine.pools_info()
        assert (pool.handouts, pool.misses) == (1, 0)
        await until(lambda: len(warm()) == 2, "the pool to refill")
        assert (await engine.set_pool("host", 2, wait=WAIT_S)).ready == 2

        await engine.set_pool("host", 0)
        await until(lambda: not warm(), "the emptied pool's sandboxes to go")
        assert await engine.pools_info() == []
        await sandbox.kill()


async def test_max_sandboxes_refuses_then_queues_until_room(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as probe:
        live = engine_of(probe).db.count()
    async with AsyncFleet(config=dataclasses.replace(cfg, max_sandboxes=live + 2)) as fleet:
        first, _ = await fleet.create(), await fleet.create()
        with pytest.raises(CapacityExceeded, match="max_sandboxes"):
            await fleet.create(queue_timeout=0.3)
        waiting = asyncio.ensure_future(fleet.create(queue_timeout=WAIT_S))

        async def holding_a_slot() -> bool:
            return (await fleet.metrics())["queue"]["creating"] == 1

        await until(holding_a_slot, "the create to hold a slot, waiting for room")
        assert not waiting.done()
        await first.kill()
        third = await asyncio.wait_for(waiting, WAIT_S)
        assert (await third.exec("echo in")).text == "in\n"


async def test_max_creating_bounds_a_burst_that_all_succeeds(cfg: EngineConfig):
    async with AsyncFleet(config=dataclasses.replace(cfg, max_creating=2)) as fleet:
        engine = engine_of(fleet)
        bring_up, now, peak = engine.backend.bring_up, [0], [0]

        async def counted(spec):  # type: ignore[no-untyped-def]
            now[0] += 1
            peak[0] = max(peak[0], now[0])
            try:
                return await bring_up(spec)
            finally:
                now[0] -= 1

        engine.backend.bring_up = counted  # type: ignore[method-assign]
        sandboxes = await asyncio.gather(*(fleet.create(labels={"i": str(i)}) for i in range(20)))
        assert len({s.id for s in sandboxes}) == 20
        names = await asyncio.gather(*(s.exec("echo $HOSTNAME") for s in sandboxes))
        assert [r.text for r in names] == [f"{s.id}\n" for s in sandboxes]
        assert 1 <= peak[0] <= 2, peak
        assert (await fleet.metrics())["infra_errors"] == 0


# -- snapshots and fork -----------------------------------------------------------------------


async def test_disk_snapshots_lineage_delete_and_gc(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        source = await fleet.create()
        await source.files.write("/root/note", "v1\n")
        snap = await source.snapshot()
        assert (snap.parent, snap.sandbox_id, snap.memory, snap.kind) == (source.info.source, source.id, False,
                                                                        "snapshot")
        child = await fleet.create(snap)
        assert child.info.source == snap.id and await child.files.read("/root/note") == b"v1\n"
        await child.files.write("/root/note", "v2\n")  # replaced, not rewritten in place: the fake links layers

        name = f"h8-{uuid.uuid4().hex[:12]}"
        named = await child.snapshot(name=name)
        assert (named.name, named.parent) == (name, snap.id)  # lineage: the child's snapshot stands on snap
        grandchild = await fleet.create(name)
        assert grandchild.info.source == named.id and await grandchild.files.read("/root/note") == b"v2\n"
        assert await source.files.read("/root/note") == b"v1\n"
        with pytest.raises(InvalidRequest, match="exists already"):
            await child.snapshot(name=name)

        for used in (snap.id, named.id):
            with pytest.raises(SnapshotInUse):
                await fleet.delete_snapshot(used)
        unused = await source.snapshot()
        collected = await fleet.gc()
        assert unused.id in collected and not {snap.id, named.id} & set(collected)
        with pytest.raises(SnapshotNotFound):
            await fleet.get_snapshot(unused.id)

        await grandchild.kill()
        await fleet.delete_snapshot(named.id)  # kept by its name until deleted
        with pytest.raises(SnapshotNotFound):
            await fleet.get_snapshot(name)
        await child.kill()
        await fleet.delete_snapshot(snap.id)
        assert snap.id not in {s.id for s in await fleet.snapshots()}


async def test_fork_children_see_the_parents_disk_and_write_apart(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        engine = engine_of(fleet)
        parent = await fleet.create()
        await parent.files.write("/root/before", "before\n")
        async with await parent.fork(2) as fork:
            first, second = fork.children
            assert len({parent.id, first.id, second.id}) == 3 and fork.result.parent_id == parent.id
            for child in (first, second):
                assert child.info.source == fork.result.snapshot_id
                assert (await child.exec("cat before; echo $HOSTNAME", cwd="/root")).text == f"before\n{child.id}\n"
            await first.files.write("/root/first", "1\n")
            assert (await second.exec("echo 2 > second", cwd="/root")).ok
            with pytest.raises(FileNotFoundInSandbox):
                await first.files.read("/root/second")
            with pytest.raises(FileNotFoundInSandbox):
                await second.files.read("/root/first")
            assert (await parent.exec("ls", cwd="/root")).text == "before\n"
        assert engine.db.get(first.id) is None and engine.db.get(second.id) is None
        assert (await parent.exec("echo parent runs on")).ok
        assert fork.result.snapshot_id not in {s.id for s in await fleet.snapshots()}  # gone with its last child
        await parent.kill()


async def test_fork_children_die_at_the_parents_deadline(cfg: EngineConfig):
    async with AsyncFleet(config=cfg) as fleet:
        engine = engine_of(fleet)
        parent = await fleet.create(deadline=3)  # past the fork (a tenth of a second on oci, ~1 s on a busy fake)
        fork = await parent.fork(2)
        assert parent.info.deadline_at is not None
        for child in fork.children:
            assert child.info.deadline_at is not None and child.info.deadline_at <= parent.info.deadline_at + 0.5
        ids = (parent.id, *(child.id for child in fork.children))
        await until(gone(engine, *ids), "the parent's deadline to end it and its children")
        assert not set(ids) & await engine.backend.list_ids()


# -- faults -----------------------------------------------------------------------------------


async def test_a_release_that_failed_is_retried_by_the_reaper(cfg: EngineConfig, monkeypatch: pytest.MonkeyPatch):
    async with AsyncFleet(config=cfg) as fleet:
        engine = engine_of(fleet)
        sandbox = await fleet.create()
        release, failed = engine.backend.release, []

        async def busy_once(sandbox_id, handle=None):  # type: ignore[no-untyped-def]
            if sandbox_id == sandbox.id and not failed:
                failed.append(sandbox_id)
                raise InfrastructureError(f"releasing sandbox {sandbox_id} failed: busy (injected)")
            await release(sandbox_id, handle)

        monkeypatch.setattr(engine.backend, "release", busy_once)
        with pytest.raises(InfrastructureError, match="injected"):
            await sandbox.kill()
        assert engine.db.get(sandbox.id)["state"] == "destroying"
        with pytest.raises(SandboxGone):
            await sandbox.exec("true")
        await until(gone(engine, sandbox.id), "the reaper to retry the release")
        assert failed == [sandbox.id] and sandbox.id not in await engine.backend.list_ids()


async def test_the_reaper_leaves_a_sandbox_being_suspended_whose_processes_are_gone(
        cfg: EngineConfig, monkeypatch: pytest.MonkeyPatch):
    """Between CRIU ending the processes and the row saying suspended, reaper passes see a running
    row with a dead PID 1: a slow suspend (a large memory) must not be destroyed as crashed."""
    async with AsyncFleet(config=cfg) as fleet:
        engine = engine_of(fleet)
        sandbox = await fleet.create()
        checkpoint = engine.backend.checkpoint

        async def then_reaper_passes(handle, dest, host_dirs, **kwargs):  # type: ignore[no-untyped-def]
            paused = await checkpoint(handle, dest, host_dirs, **kwargs)
            assert not engine.backend.alive(handle)
            for _ in range(3):
                await engine.reaper._pass(sweep=False)
            return paused

        monkeypatch.setattr(engine.backend, "checkpoint", then_reaper_passes)
        assert (await sandbox.suspend()).state == "suspended"
        monkeypatch.undo()
        assert (await sandbox.exec("echo back")).text == "back\n"
        await sandbox.kill()


# -- fake only --------------------------------------------------------------------------------


@pytest.fixture
async def no_memory(fake_state: Path):
    """A fleet on a fake backend that claims no memory checkpoints (loaded by ``module:Class``)."""
    config = EngineConfig(backend=f"{__name__}:NoMemoryBackend", state_dir=fake_state)
    async with AsyncFleet(config=config) as fleet:
        assert isinstance(engine_of(fleet).backend, NoMemoryBackend)
        yield fleet
    assert await fake_ids(config) == set() and fake_agents(fake_state) == []


async def test_fake_no_memory_backend_refuses_memory_snapshots_fork_and_suspend(no_memory: AsyncFleet):
    async with await no_memory.create() as sandbox:
        await sandbox.files.write("/root/note", "disk\n")
        for call in (lambda: sandbox.snapshot(memory=True), lambda: sandbox.fork(2), sandbox.suspend):
            with pytest.raises(InvalidRequest, match="memory checkpoints"):
                await call()
        assert (await sandbox.refresh()).state == "running"
        snap = await sandbox.snapshot()  # a disk snapshot needs no memory
        async with await no_memory.create(snap) as copy:
            assert await copy.files.read("/root/note") == b"disk\n"
        assert (await sandbox.pause()).state == "paused"  # freezing is no checkpoint
        assert (await sandbox.exec("echo on")).text == "on\n"
        await no_memory.delete_snapshot(snap.id)


async def test_fake_no_memory_backend_still_reaps_idle_sandboxes_past_a_sticky_one(no_memory: AsyncFleet):
    engine = engine_of(no_memory)
    try:
        sticky = await no_memory.create(persistence="sticky", idle_timeout=0.3)
    except InvalidRequest:  # refusing such a sandbox up front is a fix too
        sticky = None
    try:
        ephemeral = await no_memory.create(idle_timeout=0.3)
        await until(gone(engine, ephemeral.id), "the idle ephemeral sandbox to be destroyed", timeout=15)
        if sticky is not None:
            assert (await sticky.refresh()).state == "running"  # cannot be suspended: left as it is
    finally:
        if sticky is not None:
            await sticky.kill()


NOBODY = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path
    from fanfold import AsyncFleet, EngineConfig
    from fanfold.images import LayerStore
    from fanfold.runtime.fake import FakeBackend

    async def main(state):
        config = EngineConfig(backend="fake", state_dir=state)
        got = {}
        async with AsyncFleet(config=config) as fleet:
            sandbox = await fleet.create()
            got["echo"] = (await sandbox.exec("echo ok; id -u")).text
            await sandbox.files.write("/root/note", "mine\\n")
            got["read"] = (await sandbox.files.read("/root/note")).decode()
            snap = await sandbox.snapshot()
            got["from_snapshot"] = (await (await fleet.create(snap)).files.read("/root/note")).decode()
            fork = await sandbox.fork(2)
            got["children"] = [(await c.exec("cat note", cwd="/root")).text for c in fork.children]
            for made in await fleet.list():
                await (await fleet.get(made.id)).kill()
            got["listed"] = len(await fleet.list())
        got["left"] = sorted(await FakeBackend(config, LayerStore(state)).list_ids())
        print(json.dumps(got))

    asyncio.run(main(Path(sys.argv[1])))
""")


def test_fake_fleet_runs_without_root(fake_state: Path):
    mark = f"PYTEST_FANFOLD_RUN={os.environ.get('PYTEST_FANFOLD_RUN', '')}"
    state, done = run_as_nobody(agent_binary(fake_state), "ff-h8-nobody-", NOBODY, env=(mark,))
    try:
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout.strip().splitlines()[-1])
        assert got == {
            "echo": f"ok\n{pwd.getpwnam('nobody').pw_uid}\n", "read": "mine\n", "from_snapshot": "mine\n",
            "children": ["mine\n", "mine\n"], "listed": 0, "left": [],
        }
        assert fake_agents(state) == []
    finally:
        for line in fake_agents(state):  # not left running after a failed run
            os.kill(int(line.partition(":")[0]), 9)
        shutil.rmtree(state, ignore_errors=True)
