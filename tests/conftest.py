"""Shared fixtures: a state directory for the whole run, a real ``fanfold serve`` on it, and
fleets over every transport (embedded, unix socket, TCP with a token), plus a leak check.

``afleet`` and ``fleet`` are parametrised over the transports, so every test that uses them
runs against each, and the remote SDK cannot drift from the embedded one.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from fanfold import AsyncFleet, EngineConfig, Fleet
from fanfold.host import cgroups, disk, mounts, procs
from fanfold.host.census import KINDS, census, orphan_claims

STATE_DIR = Path(os.environ.get("FANFOLD_TEST_STATE_DIR", "/var/lib/fanfold-test"))
pytest_plugins = ["outside"]  # the session fixture ``outside``: the "internet" of the network tests

# Every process this test run starts inherits this mark (a name start_server's FANFOLD_ filter keeps),
# even one that outlives the child that started it, so the end of the run can find what is left.
RUN_MARK = f"PYTEST_FANFOLD_RUN={uuid.uuid4().hex}"
os.environ["PYTEST_FANFOLD_RUN"] = RUN_MARK.partition("=")[2]


@pytest.fixture(scope="session")
def config() -> EngineConfig:
    return EngineConfig(state_dir=STATE_DIR)


TRANSPORTS = ["embedded", "unix", "tcp"]
TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdef0"}


@dataclass
class Server:
    process: subprocess.Popen[str]
    unix_url: str
    tcp_url: str
    tokens: dict[str, str]


def start_server(state_dir: Path, where: Path, *extra: str, env: dict[str, str] | None = None) -> Server:
    """``fanfold serve`` in its own process, on a unix socket and a free TCP port; waits until it listens.

    It gets none of this process's FANFOLD_ variables, only those of ``env``."""
    tokens_file = where / "tokens"
    tokens_file.write_text("".join(f"{tenant} {token}\n" for tenant, token in TOKENS.items()))
    process = subprocess.Popen(
        [sys.executable, "-m", "fanfold.cli", "--state-dir", str(state_dir), "serve", "--socket", str(where / "ff.sock"),
         "--port", "0", "--tokens-file", str(tokens_file), *extra],
        stdout=subprocess.PIPE, text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("FANFOLD_")}, **(env or {})},
    )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], 120)
    line = process.stdout.readline() if ready else ""
    match = re.search(r"listening on (unix://\S+) (http://\S+)", line)
    if match is None:
        process.kill()
        raise RuntimeError(f"fanfold serve did not start: {line!r}")
    return Server(process, match.group(1), match.group(2), dict(TOKENS))


def stop_server(server: Server) -> int:
    server.process.send_signal(signal.SIGTERM)
    return server.process.wait(timeout=120)


@pytest.fixture(scope="session")
def server(config: EngineConfig, tmp_path_factory: pytest.TempPathFactory):
    """One real server for the session, on the same state directory as the embedded fleets. It pulls
    images only when asked (FANFOLD_PULL=never): no request may make it fetch from a registry."""
    running = start_server(config.state_dir, tmp_path_factory.mktemp("server"), env={"FANFOLD_PULL": "never"})
    yield running
    assert stop_server(running) == 0


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory):
    """A plain-HTTP reference registry on loopback, named in FANFOLD_INSECURE_REGISTRIES for the module."""
    from registry import run_insecure_registry

    with run_insecure_registry(tmp_path_factory.mktemp("registry")) as running:
        yield running
    assert running.process.poll() is not None


@pytest.fixture(scope="module")
def image_server(config: EngineConfig, registry, tmp_path_factory: pytest.TempPathFactory):
    """A server of the module's own, which may pull from ``registry`` (the session's pulls nothing)."""
    running = start_server(config.state_dir, tmp_path_factory.mktemp("server"),
                           env={"FANFOLD_INSECURE_REGISTRIES": registry.host})
    yield running
    assert stop_server(running) == 0


def fleet_args(transport: str, request: pytest.FixtureRequest, config: EngineConfig) -> dict[str, object]:
    if transport == "embedded":
        return {"config": config}
    running: Server = request.getfixturevalue("server")
    if transport == "unix":
        return {"url": running.unix_url}
    return {"url": running.tcp_url, "token": running.tokens["alice"]}


@pytest.fixture(params=TRANSPORTS)
async def afleet(request: pytest.FixtureRequest, config: EngineConfig):
    async with AsyncFleet(**fleet_args(request.param, request, config)) as fleet:
        yield fleet


@pytest.fixture(scope="module", params=TRANSPORTS)
def fleet(request: pytest.FixtureRequest, config: EngineConfig):
    with Fleet(**fleet_args(request.param, request, config)) as handle:
        yield handle


@pytest.fixture(scope="session")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Python project whose one test fails until ``add`` is fixed."""
    root = tmp_path_factory.mktemp("project")
    (root / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "test_calc.py").write_text(
        "import unittest\nfrom calc import add\n\n"
        "class T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
        "if __name__ == '__main__':\n    unittest.main()\n"
    )
    return root


def leaks(config: EngineConfig) -> dict[str, int]:
    """Mounts, cgroups and runtime containers of this state directory that are still there."""
    runtime_root = config.run_dir / config.runtime
    return {
        "mounts": sum(len(mounts.mounts_under(config.state_dir / part)) for part in ("sandboxes", "groups")),
        "cgroups": len(cgroups.leftover_ids(config.cgroup_parent)) + len(cgroups.top_groups(f"build-{os.getpid()}-")),
        "containers": len([p for p in runtime_root.iterdir()]) if runtime_root.is_dir() else 0,
    }


def stray_processes(roots: tuple[Path, ...] = ()) -> list[str]:
    """Live processes carrying this run's mark, but this one: what fixtures and tests failed to end.

    Fake-backend agents get only their sandbox's environment, not the mark: one counts too when
    it is a ``--subreaper`` whose ``--root`` lies under one of ``roots`` (dirs this run made).
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid() or not procs.running(entry):
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                marked = RUN_MARK.encode() in handle.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        command = b" ".join(argv).decode(errors="replace").strip()
        if marked or _fake_agent_under(argv, roots):
            found.append(f"{entry}: {command}")
    return found


def _fake_agent_under(argv: list[bytes], roots: tuple[Path, ...]) -> bool:
    if b"--subreaper" not in argv or b"--root" not in argv[:-1]:
        return False
    root = Path(os.fsdecode(argv[argv.index(b"--root") + 1]))
    return any(root.is_relative_to(top) for top in roots)


def run_as_nobody(agent: Path, prefix: str, script: str, *args: str, timeout: float = 120,
                  env: tuple[str, ...] = ()) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Run the Python ``script`` as ``nobody`` with a temp state dir of its own (holding a copy of
    the built ``agent``: nobody cannot compile where it cannot write) as its first argument.
    Skips when not root or when there is no setpriv or no Python nobody may run; the caller
    removes the state dir, returned with the result."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to become nobody")
    run_as = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    pythons = (sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}", shutil.which(version))
    runnable = [p for p in pythons if p and subprocess.run([*run_as, "env", p, "-c", ""], capture_output=True).returncode == 0]
    if not runnable:  # this venv's may live under /root
        pytest.skip("no Python that nobody may run")
    state = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        (state / "bin").mkdir()
        shutil.copy2(agent, state / "bin" / agent.name)
        for path in [state, *state.rglob("*")]:
            os.chown(path, pwd.getpwnam("nobody").pw_uid, grp.getgrnam("nogroup").gr_gid)
        # The chosen Python gets this one's packages and the repository.
        pythonpath = os.pathsep.join([str(Path(__file__).resolve().parents[1]), sysconfig.get_paths()["purelib"]])
        done = subprocess.run(
            [*run_as, "env", f"PYTHONPATH={pythonpath}", *env, runnable[0], "-c", script, str(state), *args],
            capture_output=True, text=True, timeout=timeout, cwd="/", check=False,
        )
    except BaseException:
        shutil.rmtree(state, ignore_errors=True)
        raise
    return state, done


def run_cli(*args: str, input: str | None = None, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FANFOLD_STATE_DIR": str(STATE_DIR), **(env or {})}
    return subprocess.run(  # stdin /dev/null unless given: exec and run read a stdin that is not a terminal
        [sys.executable, "-m", "fanfold.cli", *args], capture_output=True, text=True, env=env, input=input,
        stdin=subprocess.DEVNULL if input is None else None, timeout=timeout,
    )


def settle(config: EngineConfig) -> None:
    """Release all a state dir holds: an engine adopts what earlier ones left (a killed run's disk,
    cgroups, sandboxes), kills the detached sandboxes, and closes."""
    import asyncio

    from fanfold.engine import Engine

    async def release() -> None:
        engine = Engine(config)
        await engine.start()
        for info in await engine.list():
            if info.detached:
                await engine.kill(info.id)
        await engine.close()

    asyncio.run(release())


@pytest.fixture(scope="session", autouse=True)
def no_leaks_at_end(config: EngineConfig, tmp_path_factory: pytest.TempPathFactory):
    claims_before = frozenset(orphan_claims())  # host-wide: what earlier runs left is not this run's
    yield
    settle(config)
    strays = stray_processes((tmp_path_factory.getbasetemp(),))
    for line in strays:  # reported below, but not left running for hours after a failed run
        try:
            os.kill(int(line.partition(":")[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert strays == [], "processes this test run started were still running"
    assert census(config, claims_before=claims_before) == dict.fromkeys(KINDS, 0)
    assert not any(d.exists() for d in cgroups.sandbox_dirs(config.cgroup_parent)), "parent cgroups left"
    assert not disk.ready(config.state_dir), "the sandboxes' disk is still mounted: an engine or backend was not closed"
