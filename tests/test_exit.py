"""What a program leaves open closes as it exits: no traceback, no hang, and its sandboxes released.

Each case is a Python of its own on the test state directory, judged by how it ends and by what it
leaves on the host: a directory, a mount, a cgroup, runtime state, a database row or a process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from fanfold import EngineConfig
from fanfold.engine.db import Database
from fanfold.host import cgroups, disk, mounts

from conftest import STATE_DIR

ROOT = Path(__file__).resolve().parents[1]
SANDBOX_ID = re.compile(r"\bsb-[0-9a-f]{12}\b")


def run_to_exit(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[str, str, int]:
    """Run ``argv`` (a ``python -c`` script when it is one string) to its end; returns stdout, stderr
    and the exit code. A hang at exit fails the test by its timeout."""
    command = [sys.executable, "-c", textwrap.dedent(argv[0])] if len(argv) == 1 else list(argv)
    mark = uuid.uuid4().hex
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    child_env = {**os.environ, "PYTHONPATH": pythonpath, "FANFOLD_STATE_DIR": str(STATE_DIR),
                 "FANFOLD_EXIT_CASE": mark, **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, env=child_env, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=ROOT)
    assert marked_processes(mark) == [], "processes of the exited program still run"
    return done.stdout, done.stderr, done.returncode


def marked_processes(mark: str) -> list[str]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if f"FANFOLD_EXIT_CASE={mark}".encode() in handle.read().split(b"\0"):
                    found.append(entry)
        except OSError:
            continue  # gone meanwhile
    return found


def assert_exited_cleanly(stderr: str, code: int) -> None:
    assert code == 0, stderr
    assert "Traceback" not in stderr and "never awaited" not in stderr, stderr


def traces(config: EngineConfig, sandbox_id: str) -> list[str]:
    """What the host still holds of ``sandbox_id``; empty once it is released."""
    left = []
    if (config.state_dir / "sandboxes" / sandbox_id).exists():
        left.append("its directory")
    if any(sandbox_id in str(point) for point in mounts.mounts_under(config.state_dir / "sandboxes")):
        left.append("a mount")
    if sandbox_id in cgroups.leftover_ids(config.cgroup_parent):
        left.append("its cgroup")
    if sandbox_id in disk.ids(config.state_dir):
        left.append("its disk")
    if any(config.run_dir.glob(f"**/{sandbox_id}*")):
        left.append("runtime state")
    db = Database(config.state_dir / "fanfold.db")
    try:
        if any(row["id"] == sandbox_id for row in db.rows()):
            left.append("its row")
    finally:
        db.close()
    return left


def test_a_fleet_left_open_with_live_sandboxes(config):
    out, err, code = run_to_exit("""
        from fanfold import Fleet
        fleet = Fleet()
        busy, idle = fleet.create("host"), fleet.create("host")
        assert busy.exec("echo hi").stdout == b"hi\\n"
        idle.pause()
        print(busy.id, idle.id)
    """)
    assert_exited_cleanly(err, code)
    ids = out.split()
    assert len(ids) == 2 and all(SANDBOX_ID.fullmatch(i) for i in ids), out
    assert {i: traces(config, i) for i in ids} == {i: [] for i in ids}


def test_a_sandbox_used_after_the_exit_closed_its_fleet_is_an_error_not_a_hang(config):
    out, err, code = run_to_exit("""
        import atexit
        from fanfold import Fleet
        from fanfold.errors import FanfoldError
        fleet = Fleet()
        sandbox = fleet.create("host")

        def late():
            try:
                sandbox.exec("true")
            except FanfoldError as exc:
                print(type(exc).__name__, exc)

        atexit.register(late)
        print(sandbox.id)
    """)
    assert_exited_cleanly(err, code)
    sandbox_id, said = out.split("\n", 1)
    assert said.startswith("FanfoldError the interpreter is exiting"), out
    assert traces(config, sandbox_id) == []


def test_a_thread_still_waiting_on_the_fleet_at_exit_is_woken_not_left_hanging(config):
    """Threading's exit hooks run before non-daemon threads are joined: a worker still inside
    ``fleet.call`` when the fleet closes gets its work cancelled, and the program ends."""
    out, err, code = run_to_exit("""
        import asyncio, threading
        from fanfold import Fleet
        fleet = Fleet()
        sandbox = fleet.create("host")

        def worker():
            try:
                fleet.call(asyncio.sleep(600))
            except BaseException as exc:
                print("worker:", type(exc).__name__, flush=True)

        threading.Thread(target=worker).start()
        print(sandbox.id, flush=True)
    """, timeout=90)
    assert_exited_cleanly(err, code)
    sandbox_id, said = out.split("\n", 1)
    assert said.strip() == "worker: CancelledError", out
    assert traces(config, sandbox_id) == []


def test_a_forked_child_exits_without_touching_its_parents_fleet(config):
    out, err, code = run_to_exit("""
        import os
        from fanfold import Fleet
        fleet = Fleet()
        sandbox = fleet.create("host")
        child = os.fork()
        if child == 0:
            raise SystemExit(0)  # an ordinary exit in the child, exit hooks and all
        _, status = os.waitpid(child, 0)
        print(sandbox.id, os.waitstatus_to_exitcode(status), sandbox.exec("echo alive").text.strip())
    """, timeout=60)
    assert_exited_cleanly(err, code)
    sandbox_id, child_code, alive = out.split()
    assert (child_code, alive) == ("0", "alive")
    assert traces(config, sandbox_id) == []


def test_mini_swe_agents_environment_without_cleanup(config, tmp_path):
    pytest.importorskip("minisweagent")
    out, err, code = run_to_exit("""
        from fanfold.integrations.minisweagent import FanfoldEnvironment
        env = FanfoldEnvironment(image="host")
        assert env.execute({"command": "echo hi"})["output"] == "hi\\n"
        print(env.sandbox.id)
    """, env=mini_swe_agent_env(tmp_path))
    assert_exited_cleanly(err, code)
    assert traces(config, out.strip()) == []


def test_the_mini_cli_runs_its_steps_and_exits(config, tmp_path):
    pytest.importorskip("minisweagent")
    yaml = pytest.importorskip("yaml")
    said = [("Where am I?", "hostname"), ("Done.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "model": {"model_class": "deterministic", "model_name": "deterministic", "outputs": [
            {"role": "assistant", "content": text, "extra": {"actions": [{"command": command}], "cost": 0.0}}
            for text, command in said]},
        "environment": {"environment_class": "fanfold.integrations.minisweagent.FanfoldEnvironment", "image": "host"},
        "agent": {"mode": "yolo", "confirm_exit": False},
    }))
    trajectory = tmp_path / "run.traj.json"
    _, err, code = run_to_exit(sys.executable, "-m", "minisweagent.run.mini", "-c", "mini.yaml",
                               "-c", str(tmp_path / "run.yaml"), "-t", "Say where you run.", "-o", str(trajectory),
                               env=mini_swe_agent_env(tmp_path))
    assert_exited_cleanly(err, code)
    messages = json.loads(trajectory.read_text())["messages"]
    assert messages[-1]["extra"]["exit_status"] == "Submitted"
    observed = SANDBOX_ID.findall(json.dumps(messages))
    assert observed, "the hostname step's output names no sandbox"
    assert traces(config, observed[0]) == []


def mini_swe_agent_env(config_dir: Path) -> dict[str, str]:
    # No banner, no first-run questions, and its global config kept out of the home directory.
    return {"MSWEA_SILENT_STARTUP": "1", "MSWEA_CONFIGURED": "1", "MSWEA_GLOBAL_CONFIG_DIR": str(config_dir)}


def test_trls_environment_class_left_open(config):
    pytest.importorskip("gymnasium")
    out, err, code = run_to_exit("""
        from fanfold.integrations.trl import environment_factory
        instance = environment_factory("codefix", max_steps=2)()
        instance.reset()
        print(instance._env.sandbox_id)
    """)
    assert_exited_cleanly(err, code)
    assert traces(config, out.strip()) == []


def test_a_gymnasium_env_whose_reset_failed_exits_with_that_error_alone():
    pytest.importorskip("gymnasium")
    _, err, code = run_to_exit("""
        import gymnasium
        import fanfold.rl
        gymnasium.make("fanfold/SWEFix-v0").reset()
    """)
    assert code == 1 and err.count("Traceback") == 1, err
    assert err.strip().splitlines()[-1].startswith("fanfold.errors.InvalidRequest: swefix runs on a task image"), err
