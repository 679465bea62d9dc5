"""Shared fixtures: a state directory for the whole run and fleets on it, plus a leak check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fanfold import AsyncFleet, EngineConfig, Fleet
from fanfold.host import cgroups, mounts

STATE_DIR = Path(os.environ.get("FANFOLD_TEST_STATE_DIR", "/var/lib/fanfold-test"))


@pytest.fixture(scope="session")
def config() -> EngineConfig:
    return EngineConfig(state_dir=STATE_DIR)


@pytest.fixture
async def afleet(config: EngineConfig):
    async with AsyncFleet(config=config) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def fleet(config: EngineConfig):
    with Fleet(config=config) as handle:
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
        "mounts": len(mounts.mounts_under(config.state_dir / "sandboxes")),
        "cgroups": len(cgroups.leftover_ids(config.cgroup_parent)),
        "containers": len([p for p in runtime_root.iterdir()]) if runtime_root.is_dir() else 0,
    }


def run_cli(*args: str, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FANFOLD_STATE_DIR": str(STATE_DIR)}
    return subprocess.run(
        [sys.executable, "-m", "fanfold.cli", *args], capture_output=True, text=True, env=env, input=input,
        timeout=timeout,
    )


@pytest.fixture(scope="session", autouse=True)
def no_leaks_at_end(config: EngineConfig):
    yield
    import asyncio

    from fanfold.engine import Engine

    async def settle() -> None:
        engine = Engine(config)
        await engine.start()
        for info in await engine.list():
            if info.detached:
                await engine.kill(info.id)
        await engine.close()

    asyncio.run(settle())
    assert leaks(config) == {"mounts": 0, "cgroups": 0, "containers": 0}
    assert not any(d.exists() for d in cgroups.sandbox_dirs(config.cgroup_parent)), "parent cgroups left"
