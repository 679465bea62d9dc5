"""`make demo`'s job, examples/rl_demo.py, end to end on a small scale: real sandboxes, real CRIU
forks, the scripted policy; its store, exports and HTML report read back."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd

from fanfold.rl import TrajectoryStore

from conftest import STATE_DIR

DEMO = Path(__file__).resolve().parent.parent / "examples" / "rl_demo.py"


def run_demo(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The demo as a subprocess on the tests' state dir, embedded and scripted whatever the caller's environment."""
    base = {k: v for k, v in os.environ.items() if k not in ("FANFOLD_URL", "FANFOLD_TOKEN", "FANFOLD_POLICY_URL")}
    return subprocess.run([sys.executable, str(DEMO), *args], capture_output=True, text=True, timeout=timeout,
                          env={**base, "FANFOLD_STATE_DIR": str(STATE_DIR), "COLUMNS": "120", **(env or {})})


def test_demo_runs_forks_stores_and_reports(tmp_path: Path):
    done = run_demo("--rollouts", "8", "--concurrency", "4", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "10: 8 rollouts + 2 forked branches" in done.stdout  # rollouts 0 and 4 fork into two
    assert "ok 8, failed 0, timeout 0" in done.stdout

    # The store: every rollout's episode, and for each fork a branch naming its parent and fork step.
    with TrajectoryStore(tmp_path / "trajectories.db", create=False) as store:
        episodes = store.episodes()  # complete ones only
        everything = store.episodes(include_incomplete=True, with_steps=False)
        step_counts = store.step_counts(e.id for e in everything)
    assert len(episodes) == 10
    # The tools really ran: every episode's first step is run_tests on the buggy project, and
    # some episode fixed all three bugs.
    assert all("FAILED (failures=5)" in e.steps[0].tool_result for e in episodes)
    assert any(e.outcome == "success" and e.total_reward == 1.0 for e in episodes)
    by_rollout: dict[str, list] = {}
    for episode in episodes:
        by_rollout.setdefault(episode.rollout_id, []).append(episode)
    assert sorted(by_rollout) == sorted(f"demo-{i}" for i in range(8))
    for rollout_id, group in by_rollout.items():
        if rollout_id not in ("demo-0", "demo-4"):
            assert len(group) == 1 and group[0].parent_id is None and group[0].fork_step is None
            continue
        (parent,), (branch,) = [e for e in group if e.parent_id is None], [e for e in group if e.parent_id]
        assert branch.parent_id == parent.id and branch.fork_step == 3 and branch.snapshot_id
        assert [s.tool_call["name"] for s in branch.steps[:3]] == [s.tool_call["name"] for s in parent.steps[:3]]
        assert branch.steps[:3] == parent.steps[:3] and branch.steps[3].snapshot_id == branch.snapshot_id
        assert len(branch.steps) > 3  # it played on after the fork

    # The exports hold the same episodes; the Parquet file reads back with pandas.
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert {json.loads(line)["id"] for line in lines} == {e.id for e in everything}
    frame = pd.read_parquet(tmp_path / "trajectories.parquet")
    assert set(frame["episode_id"]) == {e.id for e in everything}
    assert len(frame) == sum(max(n, 1) for n in step_counts.values())  # a row per step
    assert set(frame.loc[frame["parent_id"].notna(), "fork_step"]) == {3}

    # The report is one file: four plots as inline PNGs, the summary and the episodes.
    report = (tmp_path / "report.html").read_text()
    images = re.findall(r'<img alt="(\w+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', report)
    assert [name for name, _ in images] == ["rewards", "reset", "exec", "timeline"]
    assert all(base64.b64decode(data).startswith(b"\x89PNG") for _, data in images)
    for label in ("success rate", "reward mean / median", "fork branch vs parent", "infra errors", "throughput"):
        assert label in report
    assert report.count("demo-0") == 2 and "branch 1 (forked at step 3)" in report


def test_demo_fails_clearly_when_the_fleet_cannot_start(tmp_path: Path):
    done = run_demo("--rollouts", "2", "--out", str(tmp_path), env={"FANFOLD_RUNTIME": "no-such-runtime"}, timeout=60)
    assert done.returncode == 2
    assert "error: InvalidRequest: unknown runtime 'no-such-runtime'" in done.stdout
    assert "fanfold doctor" in done.stdout and "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "report.html").exists()


def test_demo_help_names_its_options():
    done = run_demo("--help", timeout=60)
    assert done.returncode == 0
    for option in ("--rollouts", "--concurrency", "--out", "--db", "--policy-url", "--model", "--no-pool"):
        assert option in done.stdout
