"""The examples/ files that README.md and the guides show (their ```` ```python example=... ````
blocks) are those files as they are, and each runs as written against a real engine (or a real
server), its output checked, twice where a second run could trip on the first; the RL guide's
`fanfold traj` commands run as written on a store the RL example filled. The guides' other
Python blocks run in tests/test_docs.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import STATE_DIR, Server, start_server, stop_server
from doc_blocks import ROOT, python_blocks

EXAMPLES = ["quickstart.py", "async_fleet.py", "snapshots.py", "own_image.py", "pool.py", "network.py", "rl_fanout.py",
            "remote.py", "e2b_sdk.py", "openenv_client.py", "multiagent.py"]


def run_example(name: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The example with the venv's python, embedded on the tests' state dir, the scripted policy."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("FANFOLD_URL", "FANFOLD_TOKEN", "FANFOLD_POLICY_URL")}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True,
                          cwd=cwd, env={**inherited, "FANFOLD_STATE_DIR": str(STATE_DIR), **(env or {})}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_every_example_block_is_its_file_and_every_example_is_shown_once():
    shown = [block for block in python_blocks() if block.kind == "example"]
    assert sorted(block.example.relative_to(ROOT).as_posix() for block in shown) == sorted(f"examples/{n}" for n in EXAMPLES)
    for block in shown:
        assert block.code == block.example.read_text(), f"{block.name} differs from {block.example.name}"
        link = "examples/" if block.page.parent == ROOT else "../examples/"
        assert f"[`examples/{block.example.name}`]({link}{block.example.name})" in block.page.read_text(), block.name


def test_quickstart(tmp_path):
    lines = run_example("quickstart.py", cwd=tmp_path).stdout.splitlines()
    assert lines == ["Outcome.EXITED 1", "FAILED (failures=1)",
                     "['__pycache__', 'calc.py', 'notes.txt', 'test_calc.py']"]


def test_async_fleet_streams_output_then_the_result(tmp_path):
    out = run_example("async_fleet.py", cwd=tmp_path).stdout
    assert out.startswith("stderr ")  # each chunk as it came, wherever the pipe happened to cut it
    text = out.replace("stderr ", "")
    assert "FAIL: test_add" in text and text.endswith("FAILED (failures=1)\nOutcome.EXITED 1\n")


def test_network_example_allows_denies_locks_and_exposes(tmp_path):
    lines = run_example("network.py", cwd=tmp_path).stdout.splitlines()
    assert lines == ["200", "403", "no route", "1", "hello from inside"]


def test_own_image_imports_a_task_image_and_runs_as_its_user(tmp_path):
    lines = run_example("own_image.py", cwd=tmp_path).stdout.splitlines()
    assert lines == ["agent /env 2", "agent", "FAILED (failures=1)", "",
                     "root", ""]


def test_snapshots_runs_twice(tmp_path):
    for _ in range(2):  # the snapshot's name is free again for the second run
        lines = run_example("snapshots.py", cwd=tmp_path).stdout.splitlines()
        assert re.fullmatch(r"parent paused \d+ ms", lines[0])
        children = [line.split() for line in lines[1:5]]
        assert all(host.startswith("sb-") for host, _ in children)
        assert len({host for host, _ in children}) == len({seed for _, seed in children}) == 4
        assert lines[5:] == ["server in the copy: 200", "after suspend: [b'reseed.py', b'server.py']",
                             "after reset: []"]


def test_pool(tmp_path):
    out = run_example("pool.py", cwd=tmp_path).stdout
    assert re.fullmatch(r"\{'p50': [\d.]+, 'p90': [\d.]+, 'p99': [\d.]+, 'max': [\d.]+\}\n", out)


def test_rl_fanout_then_the_rl_guides_traj_commands(tmp_path):
    lines = run_example("rl_fanout.py", cwd=tmp_path).stdout.splitlines()
    assert sorted(int(line.split()[0]) for line in lines) == list(range(8))
    assert all(line.split()[1] == "ok" for line in lines)
    assert sum(line.count(",") + 1 for line in lines) == 10  # rollouts 0 and 4 forked into two episodes

    db = tmp_path / "trajectories.db"
    some_id = subprocess.run([sys.executable, "-c", "import sys\nfrom fanfold.rl import TrajectoryStore\n"
                              "print(TrajectoryStore(sys.argv[1], create=False).episodes(limit=1)[0].id)", str(db)],
                             capture_output=True, text=True, check=True).stdout.strip()
    (commands,) = re.findall(r"```console\n(.*?)```", (ROOT / "docs" / "rl.md").read_text(), re.S)
    for command in commands.splitlines():
        argv = command.removeprefix("$ fanfold ").replace("<id or a prefix of it>", some_id[:8]).split()
        argv = [str(db) if arg == "demo-out/trajectories.db" else arg for arg in argv]
        done = subprocess.run([sys.executable, "-m", "fanfold.cli", *argv], capture_output=True, text=True,
                              cwd=tmp_path, env={**os.environ, "FANFOLD_STATE_DIR": str(STATE_DIR)}, timeout=120)
        assert done.returncode == 0, f"{command}: {done.stderr}"
    assert (tmp_path / "episodes.parquet").stat().st_size > 0


def test_multiagent_scripted_policies_win_and_a_wrong_report_loses(tmp_path):
    for _ in range(2):  # the second run adds to the same trajectory store
        lines = run_example("multiagent.py", cwd=tmp_path).stdout.splitlines()
        assert lines == ["server success 1.0 ['shell', 'wait', 'wait']",
                         "client success 1.0 ['wait', 'shell', 'report']",
                         "['client', 'server']",
                         "['server', 'client'] ['shell', 'wait', 'report']",
                         "{'server': 0.0, 'client': 0.0} {'server': True, 'client': True} []"]


@pytest.fixture
def own_server(tmp_path):
    running: Server = start_server(STATE_DIR, tmp_path)
    yield running
    assert stop_server(running) == 0


def test_remote_over_a_real_server(own_server, tmp_path):
    out = run_example("remote.py", own_server.unix_url, cwd=tmp_path).stdout
    assert re.fullmatch(r"hello from sb-[0-9a-f]+\n", out)


def test_an_unmodified_e2b_script_runs_with_three_variables_set(server, tmp_path):
    env = {"E2B_API_URL": server.tcp_url + "/e2b", "E2B_SANDBOX_URL": server.tcp_url + "/e2b/envd",
           "E2B_API_KEY": server.tokens["alice"]}
    lines = run_example("e2b_sdk.py", cwd=tmp_path, env=env).stdout.splitlines()
    assert lines == ["hello from Linux", "exit code 3", "typed in", "['greet.sh']"]


def test_openenvs_own_client_drives_codefix(server, tmp_path):
    lines = run_example("openenv_client.py", server.tcp_url, server.tokens["alice"], cwd=tmp_path).stdout.splitlines()
    assert lines == ["['edit_file', 'read_file', 'run_tests', 'submit']", "False FAILED (failures=5)"]
