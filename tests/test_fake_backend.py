"""The fake backend through the backend contract, no engine: the real agent as a plain process
over a directory. The last test runs it as ``nobody`` to show it needs no root."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import run_as_nobody

from fanfold._agent.build import agent_binary
from fanfold.config import EngineConfig
from fanfold.errors import InfrastructureError
from fanfold.images import LayerStore
from fanfold.models import Limits
from fanfold.runtime import get_backend
from fanfold.runtime.base import Handle, SandboxSpec
from fanfold.runtime.fake import MARKER, FakeBackend, process_tree

# The run's mark (conftest) in every process we start, so its stray-process check sees ours too.
MARK = [f"PYTEST_FANFOLD_RUN={os.environ['PYTEST_FANFOLD_RUN']}"] if "PYTEST_FANFOLD_RUN" in os.environ else []
ENV = ["PATH=/usr/local/bin:/usr/bin:/bin", *MARK]


@pytest.fixture(scope="session")
def built_agent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return agent_binary(tmp_path_factory.mktemp("agent"))


@pytest.fixture
async def backend(tmp_path: Path, built_agent: Path):
    """A prepared fake backend on ``tmp_path``; every sandbox left is released at the end."""
    (tmp_path / "bin").mkdir()
    shutil.copy2(built_agent, tmp_path / "bin" / built_agent.name)  # agent_binary finds it: no compile per test
    config = EngineConfig(state_dir=tmp_path, backend="fake")
    fake = get_backend(config, LayerStore(tmp_path))
    assert isinstance(fake, FakeBackend)
    await fake.prepare()
    try:
        yield fake
    finally:
        for sandbox_id in await fake.list_ids():
            await fake.release(sandbox_id)
        await fake.sweep()
        await fake.close()


def layer(backend: FakeBackend, digest: str, files: dict[str, str]) -> str:
    tree = backend.store.scratch()
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    backend.store.commit(tree, digest)
    return digest


def spec(sandbox_id: str, *layers: str, **more) -> SandboxSpec:  # type: ignore[no-untyped-def]
    return SandboxSpec(id=sandbox_id, layers=layers, limits=Limits(), env=("GREETING=hi", *ENV), **more)


async def sh(backend: FakeBackend, handle: Handle, script: str, cwd: str = "/", env: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    return await backend.exec(handle, ["/bin/sh", "-c", script], env=[*ENV, *env], cwd=cwd,
                              timeout_ms=20_000, max_output=1 << 20)


async def until(check, what: str, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    """Poll ``check()`` until it returns something true; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)
    return got


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def count(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


async def test_exec_runs_over_the_layers_with_its_cwd_in_the_root(backend: FakeBackend):
    base = layer(backend, "base", {"hello.txt": "hello\n", "work/data": "x"})
    handle = await backend.bring_up(spec("sb-exec", base))
    root = backend.root("sb-exec")
    assert backend.alive(handle) and handle.pid is not None
    assert (root / "hello.txt").stat().st_ino == (backend.store.layer_path(base) / "hello.txt").stat().st_ino  # linked

    done = await sh(backend, handle, "cat hello.txt; echo oops >&2; exit 3")
    assert (bytes(done.stdout), bytes(done.stderr), done.status["code"]) == (b"hello\n", b"oops\n", 3)
    done = await sh(backend, handle, "echo made > made.txt; ls; echo $FOO", cwd="/work", env=("FOO=bar",))
    assert bytes(done.stdout) == b"data\nmade.txt\nbar\n"
    assert (root / "work/made.txt").read_text() == "made\n"
    missing = await sh(backend, handle, "true", cwd="/nowhere")
    assert missing.error is not None and missing.error.startswith("2 chdir"), missing.error
    assert not (root / "nowhere").exists()
    assert await backend.list_ids() == {"sb-exec"}


async def test_services_run_in_the_root_with_the_sandbox_env(backend: FakeBackend):
    services = (("prep", "echo $GREETING > greeting", "oneshot"),
                ("srv", "echo up > srv.out; exec sleep 1000", "simple"))
    handle = await backend.bring_up(spec("sb-svc", layer(backend, "base", {"a": "a"}), services=services))
    root = backend.root("sb-svc")
    assert await backend.wait_ready(handle) == "ok"
    assert (root / "greeting").read_text() == "hi\n"
    await until((root / "srv.out").exists, "the simple service")

    failing = (("bad", "echo broken; exit 3", "oneshot"), ("never", "touch never", "simple"))
    handle = await backend.bring_up(spec("sb-bad", layer(backend, "base2", {"a": "a"}), services=failing))
    assert await backend.wait_ready(handle) == "fail bad 3"
    assert (backend.root("sb-bad") / "var/log/fanfold/bad.log").read_text() == "broken\n"
    assert not (backend.root("sb-bad") / "never").exists()


async def test_freeze_stops_the_whole_tree_and_thaw_resumes_it(backend: FakeBackend):
    handle = await backend.bring_up(spec("sb-frz", layer(backend, "base", {"a": "a"})))
    counter = backend.root("sb-frz") / "count"
    loop = "i=0; while :; do i=$((i+1)); echo $i > count.new; mv count.new count; sleep 0.01; done"
    await sh(backend, handle, f"({loop}) >/dev/null 2>&1 &")
    await until(lambda: count(counter) > 2, "the loop to count")

    await backend.freeze(handle)
    assert handle.pid is not None
    tree = process_tree(handle.pid)
    assert len(tree) >= 2, tree  # the agent and the orphaned loop it adopted
    states = [Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()[0] for p in tree]
    # a child that exited just before the stop is a zombie until the thaw lets its parent reap it
    assert set(states) <= {"T", "t", "Z"} and "T" in states, states
    frozen_at = count(counter)
    await asyncio.sleep(0.2)  # a window to watch for progress, not a synchronisation
    assert count(counter) == frozen_at

    await backend.thaw(handle)
    await until(lambda: count(counter) > frozen_at + 2, "the loop to go on")
    assert bytes((await sh(backend, handle, "echo back")).stdout) == b"back\n"
    await backend.thaw(handle)  # a no-op on a running sandbox


async def test_checkpoint_writes_a_full_tree_that_a_new_sandbox_starts_from(backend: FakeBackend, tmp_path: Path):
    base = layer(backend, "base", {"keep.txt": "keep\n", "gone.txt": "gone\n", "dir/f": "f\n"})
    services = (("prep", "echo $GREETING >> ran", "oneshot"),)
    handle = await backend.bring_up(spec("sb-src", base, services=services))
    assert await backend.wait_ready(handle) == "ok"
    await sh(backend, handle, "rm gone.txt; rm -r dir; echo new > new.txt; mkdir -p d/e; echo deep > d/e/x")

    dest = tmp_path / "snap"
    pause_ms = await backend.checkpoint(handle, dest, (), memory=True, leave_running=True)
    assert pause_ms >= 0 and backend.alive(handle)
    assert (dest / "layer" / MARKER).exists() and (dest / "memory" / "fake.json").exists()
    assert sorted(p.name for p in (dest / "layer").iterdir()) == [MARKER, "d", "keep.txt", "new.txt", "ran", "var"]
    await sh(backend, handle, "echo later > new.txt")  # a copy: the sandbox's writes stay out of it
    assert (dest / "layer/new.txt").read_text() == "new\n"

    backend.store.commit(dest / "layer", "snap")
    above = layer(backend, "above", {"top.txt": "top\n"})
    restored = await backend.bring_up(spec("sb-copy", base, "snap", above, services=services, restore=dest / "memory"))
    assert await backend.wait_ready(restored) == "ok"
    root = backend.root("sb-copy")
    assert sorted(p.name for p in root.iterdir()) == ["d", "keep.txt", "new.txt", "ran", "top.txt", "var"]
    assert (root / "d/e/x").read_text() == "deep\n" and (root / "ran").read_text() == "hi\nhi\n"  # cold: re-ran


async def test_checkpoint_without_leave_running_ends_the_processes(backend: FakeBackend, tmp_path: Path):
    handle = await backend.bring_up(spec("sb-end", layer(backend, "base", {"a": "a"})))
    orphan = int((await sh(backend, handle, "sleep 1000 >/dev/null 2>&1 & echo $!")).stdout)
    await backend.checkpoint(handle, tmp_path / "snap", (), memory=False, leave_running=False)
    assert not backend.alive(handle) and gone(orphan)
    assert (tmp_path / "snap/layer/a").read_text() == "a" and not (tmp_path / "snap/memory").exists()
    await backend.release("sb-end", handle)


async def test_a_checkpoint_of_a_frozen_sandbox_leaves_it_frozen(backend: FakeBackend, tmp_path: Path):
    handle = await backend.bring_up(spec("sb-paused", layer(backend, "base", {"a": "a"})))
    await backend.freeze(handle)
    await backend.checkpoint(handle, tmp_path / "snap", (), memory=False, leave_running=True, frozen=True)
    assert handle.pid is not None
    assert Path(f"/proc/{handle.pid}/stat").read_text().rpartition(")")[2].split()[0] == "T"
    await backend.thaw(handle)
    assert bytes((await sh(backend, handle, "echo on")).stdout) == b"on\n"


async def test_release_kills_what_commands_left_and_removes_everything(backend: FakeBackend):
    handle = await backend.bring_up(spec("sb-rel", layer(backend, "base", {"a": "a"})))
    orphan = int((await sh(backend, handle, "sleep 1000 >/dev/null 2>&1 & echo $!")).stdout)
    await sh(backend, handle, "mkdir -p ro/sub && touch ro/sub/f && chmod 0500 ro/sub ro && chmod 0 ro/sub/f")
    await backend.release("sb-rel", handle)
    assert gone(orphan) and not backend.alive(handle)
    assert not backend.root("sb-rel").parent.exists() and not backend._socket("sb-rel").exists()
    assert await backend.list_ids() == set()
    await backend.release("sb-rel", handle)  # idempotent
    await backend.release("sb-never-made")


async def test_a_later_backend_finds_and_releases_a_lost_sandbox(backend: FakeBackend):
    handle = await backend.bring_up(spec("sb-lost", layer(backend, "base", {"a": "a"})))
    orphan = int((await sh(backend, handle, "sleep 1000 >/dev/null 2>&1 & echo $!")).stdout)
    later = FakeBackend(backend.config, backend.store)  # as a new engine on the same state dir
    await later.prepare()
    assert await later.list_ids() == {"sb-lost"}
    await later.release("sb-lost")
    assert gone(orphan) and not backend.alive(handle)
    await backend.sweep()  # the agent was our child: collect it
    assert handle.pid is not None and not Path(f"/proc/{handle.pid}").exists()
    assert await later.list_ids() == set()


async def test_an_agent_that_dies_at_start_is_reported_and_released(backend: FakeBackend):
    too_long = "sb-" + "x" * 120  # its socket's path does not fit in sun_path: the agent exits
    with pytest.raises(InfrastructureError, match="died at start: fanfold-agent: no listening socket"):
        await backend.bring_up(spec(too_long, layer(backend, "base", {"a": "a"})))
    assert await backend.list_ids() == {too_long}
    await backend.release(too_long)
    assert await backend.list_ids() == set()


async def test_counters_see_cpu_time_and_memory(backend: FakeBackend):
    handle = await backend.bring_up(spec("sb-cpu", layer(backend, "base", {"a": "a"})))
    counters = backend.counters(handle)
    try:
        counters.reset_peak()
        before = counters.read()
        await sh(backend, handle, "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done")
        after = counters.read()
    finally:
        counters.close()
    assert after["cpu_us"] > before["cpu_us"] and after["memory_peak"] > 0
    cpu_s, rss = backend.usage(handle)
    assert cpu_s > 0 and rss > 0


async def test_whiteouts_and_opaque_dirs_are_honoured(backend: FakeBackend):
    if os.geteuid() != 0:
        pytest.skip("whiteouts (device nodes) and trusted xattrs need root to make")
    lower = layer(backend, "lower", {"etc/a": "a", "etc/b": "b", "opq/old": "old", "file": "f"})
    tree = backend.store.scratch()
    (tree / "etc").mkdir()
    os.mknod(tree / "etc/a", 0o600 | 0o020000, 0)  # a char device 0:0: a whiteout
    (tree / "opq").mkdir()
    (tree / "opq/new").write_text("new")
    os.setxattr(tree / "opq", "trusted.overlay.opaque", b"y")
    (tree / "file").mkdir()  # a directory over a file replaces it
    backend.store.commit(tree, "upper")
    await backend.bring_up(spec("sb-wo", lower, "upper"))
    root = backend.root("sb-wo")
    assert [p.name for p in (root / "etc").iterdir()] == ["b"]
    assert [p.name for p in (root / "opq").iterdir()] == ["new"]
    assert (root / "file").is_dir()


UNPRIVILEGED = """
import asyncio, sys
from pathlib import Path
from fanfold.config import EngineConfig
from fanfold.errors import InfrastructureError
from fanfold.images import LayerStore
from fanfold.models import Limits
from fanfold.runtime.base import SandboxSpec
from fanfold.runtime.fake import FakeBackend

async def main(state):
    store = LayerStore(state)
    tree = store.scratch()
    (tree / "hello").write_text("hi")
    store.commit(tree, "base")
    backend = FakeBackend(EngineConfig(state_dir=state), store)
    await backend.prepare()
    handle = await backend.bring_up(SandboxSpec(id="sb-nobody", layers=("base",), limits=Limits(),
                                                env=tuple(sys.argv[2:]), services=(("s", "touch made", "oneshot"),)))
    try:
        assert await backend.wait_ready(handle) == "ok"
        done = await backend.exec(handle, ["/bin/sh", "-c", "cat hello; echo ok"], env=sys.argv[2:], cwd="/",
                                  timeout_ms=10000, max_output=4096)
        print(bytes(done.stdout).decode(), (backend.root("sb-nobody") / "made").exists())
    finally:
        await backend.release("sb-nobody", handle)
        await backend.close()
    assert not backend.alive(handle) and await backend.list_ids() == set()

asyncio.run(main(Path(sys.argv[1])))
"""


def test_it_runs_without_root(built_agent: Path):
    state, done = run_as_nobody(built_agent, "ff-nobody-", UNPRIVILEGED, *ENV, timeout=60)
    try:
        assert done.returncode == 0, done.stderr
        assert done.stdout == "hiok\n True\n"
    finally:
        shutil.rmtree(state, ignore_errors=True)
