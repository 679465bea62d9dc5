"""What one sandbox's lifecycle (create, exec ``true``, kill) costs the engine's own process, counted
against the real runtime: SQLite statements, calls handed to threads and processes spawned. Every
create, exec and destroy of a host passes through one process; these budgets keep its hot path lean.
The small pieces the budgets rest on are checked beside them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sqlite3
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import leaks
from fanfold import AsyncFleet, EnvSpec, InvalidRequest, SandboxInfo
from fanfold.engine import Engine
from fanfold.engine import db as dbmod
from fanfold.host import procs, setup, spawn
from fanfold.models import Limits

CLEAN = {"mounts": 0, "cgroups": 0, "containers": 0}
STATEMENTS_PER_LIFECYCLE = 9
"""A create's insert, admission's count and its one conditional update; an exec's two activity stamps
(the first reads the row too); a kill's read, its release's mark-and-read, the delete and the look
for suspend images to drop."""


@contextlib.contextmanager
def statements(engine: Engine, sandbox: list[str]) -> Iterator[list[str]]:
    """The statements the engine runs meanwhile that name the sandbox ``sandbox[0]`` (once known) or
    count the sandboxes (admission's)."""
    seen: list[str] = []
    conn: sqlite3.Connection = engine.db.conn
    conn.set_trace_callback(seen.append)
    found: list[str] = []
    try:
        yield found
    finally:
        conn.set_trace_callback(None)
        found += [sql for sql in seen if sql == "SELECT COUNT(*) FROM sandboxes" or (sandbox and sandbox[0] in sql)]


async def test_a_lifecycle_runs_nine_statements_two_thread_calls_and_one_runtime_process(config, monkeypatch):
    async with AsyncFleet(config=config) as fleet:
        engine: Engine = fleet._transport  # type: ignore[assignment]
        await (await fleet.create()).kill()  # the base is built, and every cache warm
        assert engine._reaper_task is not None
        engine._reaper_task.cancel()  # its passes (once a second) are no lifecycle's
        loop = asyncio.get_running_loop()
        handed: list[Any] = []
        real_executor = loop.run_in_executor

        def counted(executor: Any, fn: Any, *args: Any) -> Any:
            handed.append(getattr(fn, "__name__", fn))
            return real_executor(executor, fn, *args)

        spawned: list[tuple[str, bool]] = []  # (runtime command, started on the event loop's thread)
        real_run, real_start = spawn.run, spawn.start_logged

        async def run(argv: list[str], **kwargs: Any) -> spawn.Finished:
            spawned.append((argv[3], True))
            return await real_run(argv, **kwargs)

        def start_logged(argv: list[str], **kwargs: Any) -> int:
            spawned.append((argv[3], threading.current_thread() is threading.main_thread()))
            return real_start(argv, **kwargs)

        monkeypatch.setattr(loop, "run_in_executor", counted)
        monkeypatch.setattr("fanfold.runtime.oci.run", run)
        monkeypatch.setattr("fanfold.runtime.oci.start_logged", start_logged)
        made: list[str] = []
        with statements(engine, made) as sql:
            sandbox = await fleet.create()
            made.append(sandbox.id)
            assert (await sandbox.exec(["true"])).ok
            await sandbox.kill()
        thread_calls, runtime_calls = list(handed), list(spawned)
    assert len(sql) == STATEMENTS_PER_LIFECYCLE, sql
    assert thread_calls == ["_make_root", "_end_and_release"]  # a create's file system work, then a release's
    # The runtime starts from the create's one thread call, whose file system work goes on while it runs: its
    # spawn, which waits out the runtime's exec, holds neither the event loop nor the GIL (see below). No
    # `crun delete`: the engine forgets a container whose processes are gone.
    assert runtime_calls == [("run", False)]
    assert leaks(config) == CLEAN


async def test_a_created_sandbox_is_named_before_its_services_start(config):
    # /etc/hostname is written while the runtime starts: a service (started once that is done) reads it written.
    async with AsyncFleet(config=config) as fleet:
        image = await fleet.build(EnvSpec("host").service("name", "cat /etc/hostname > /tmp/seen", mode="oneshot"))
        async with await fleet.create(image) as sandbox:
            assert (await sandbox.exec(["cat", "/etc/hostname", "/tmp/seen"])).stdout.decode() == f"{sandbox.id}\n" * 2
    assert leaks(config) == CLEAN


async def test_a_call_stamps_activity_only_on_a_running_sandbox_of_its_own_backend(config):
    async with AsyncFleet(config=config) as fleet:
        engine: Engine = fleet._transport  # type: ignore[assignment]
        async with await fleet.create() as sandbox:
            engine.db.update(sandbox.id, active_at=1.0)
            assert (await sandbox.exec(["true"])).ok
            assert engine.db.get(sandbox.id)["active_at"] > 1.0
            engine.db.update(sandbox.id, backend="runsc", active_at=1.0)  # as if a gVisor engine ran it
            try:
                with pytest.raises(InvalidRequest, match="runsc backend"):
                    await sandbox.exec(["true"])
                assert engine.db.get(sandbox.id)["active_at"] == 1.0
            finally:
                engine.db.update(sandbox.id, backend="oci")
    assert leaks(config) == CLEAN


def test_database_conditional_update_and_touch_of_a_running_row(tmp_path: Path):
    db = dbmod.Database(tmp_path / "fanfold.db")
    try:
        info = SandboxInfo(id="sb-0123456789ab", state="creating", image_id="img", limits=Limits(), created_at=1.0)
        db.insert(info, owner="o", env={}, layers=(), backend="oci")
        assert db.touch_running(info.id, ("oci", "")) is None  # creating: nothing stamped
        assert db.get(info.id)["active_at"] == 1.0
        assert db.update(info.id, if_state="creating", state="running", pid=7, layers=("a",))
        assert not db.update(info.id, if_state="creating", state="running")  # it is no longer creating
        assert db.touch_running(info.id, ("runsc",)) is None
        row = db.touch_running(info.id, ("oci", ""))
        assert row is not None and row["pid"] == 7 and row["active_at"] > 1.0 and dbmod.row_layers(row) == ("a",)
        row = db.update_returning(info.id, state="destroying", claimed_by="me")
        assert row is not None and (row["state"], row["claimed_by"], row["pid"]) == ("destroying", "me", 7)
        db.delete(info.id)
        assert db.update_returning(info.id, state="destroying") is None
    finally:
        db.close()


async def test_a_spawned_program_sees_the_environment_as_changed_since_start(monkeypatch):
    monkeypatch.setenv("FANFOLD_TEST_SPAWN_ENV", "after start")
    monkeypatch.delenv("FANFOLD_TEST_SPAWN_GONE", raising=False)
    os.environ["FANFOLD_TEST_SPAWN_GONE"] = "here"
    del os.environ["FANFOLD_TEST_SPAWN_GONE"]
    done = await spawn.run(["sh", "-c", 'echo "$FANFOLD_TEST_SPAWN_ENV|${FANFOLD_TEST_SPAWN_GONE-unset}"'])
    assert done.stdout == b"after start|unset\n"


def test_read_small_reads_a_file_whole(tmp_path: Path):
    big = tmp_path / "big"
    big.write_bytes(bytes(range(256)) * 1000)  # several reads' worth
    assert procs.read_small(str(big)) == big.read_bytes()
    assert procs.read_small("/proc/self/stat").split()[0] == str(os.getpid()).encode()
    assert re.match(rb"MemTotal:\s+\d+ kB", procs.read_small("/proc/meminfo"))
    with pytest.raises(FileNotFoundError):
        procs.read_small(str(tmp_path / "missing"))


def test_a_spawn_lets_go_of_the_gil_while_its_child_starts(monkeypatch):
    # With a switch interval this long, the GIL changes hands only when its holder blocks: the main thread,
    # waking every 0.1 ms, sees the other thread inside posix_spawn only if the call let go of the GIL
    # (os.posix_spawnp holds it while the child executes, and every other thread, the event loop's among
    # them, waits that long).
    inside, seen, done, real = [False], [False], threading.Event(), spawn._posix_spawnp

    def marked(*args: Any) -> int:
        inside[0] = True
        try:
            return real(*args)
        finally:
            inside[0] = False

    def spawner() -> None:
        for _ in range(20):
            pid = spawn.start_logged(["true"], log=os.devnull)
            os.waitpid(pid, 0)
            spawn.WAITING.discard(pid)
        done.set()

    monkeypatch.setattr(spawn, "_posix_spawnp", marked)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000)
    try:
        thread = threading.Thread(target=spawner)
        thread.start()
        while not done.wait(0.0001):
            seen[0] = seen[0] or inside[0]
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert seen[0]


async def test_a_runtime_that_exits_before_its_starter_records_it_is_not_reaped_as_an_orphan(monkeypatch, tmp_path):
    # The starter gets the GIL back only after the child (named as a runtime, so orphan reaping looks
    # at it) is already a zombie, and a reaper pass runs in between, as under a burst of creates.
    runtime = tmp_path / "crun"
    runtime.symlink_to("/bin/true")
    real = spawn._posix_spawnp

    def slow_to_record(*args: Any) -> int:
        pid = real(*args)
        while procs.stat_fields(pid)[:1] != ["Z"]:
            os.sched_yield()
        setup.reap_orphans()
        return pid

    monkeypatch.setattr(spawn, "_posix_spawnp", slow_to_record)
    done = await spawn.run([str(runtime)], timeout=10)
    assert done.returncode == 0
