"""The trajectory store: real SQLite files, exports read back with pyarrow and pandas, real
writer processes that die mid-episode, and ``fanfold traj`` as a user runs it. No sandboxes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from fanfold.cli import main
from fanfold.errors import InfrastructureError, InvalidRequest, NotFound
from fanfold.rl.store import TrajectoryStore
from fanfold.rl.trajectory import FORMAT_VERSION, Episode, Step

DAY = 86400.0


def full_step(index: int) -> Step:
    """A step with every field set to something other than its default."""
    return Step(
        index=index, model_output=f"let me look ({index}) — ünïcode", reward=0.25 * index,
        tool_call={"type": "function_call", "call_id": f"call_{index}", "name": "bash",
                   "arguments": json.dumps({"cmd": f"ls /env/{index}"})},
        tool_result=f"calc.py\ntest_{index}.py\n", token_ids=[101, 2**40 + index, 7, 8],
        logprobs=[-0.125, -1.5e-9, 0.0, 0.0], loss_mask=[1, 1, 0, 0], policy_version=f"policy-{index}",
        snapshot_id=f"snap-{index}", started_at=1_700_000_000.5 + index, duration_s=0.75 + index,
        info={"exit_code": index, "nested": {"ok": True, "list": [1, 2]}},
    )


def full_episode(**changes: Any) -> Episode:
    """An episode with every field set, two full steps, created ``changes.get('created_at')`` or now."""
    values: dict[str, Any] = dict(
        task="fix-calc", seed=7, rollout_id="rollout-1", image_id="img-abc", snapshot_id="snap-root",
        parent_id="0" * 32, fork_step=3, outcome="success", total_reward=1.5, error="a note for later",
        steps=[full_step(0), full_step(1)], metadata={"difficulty": "easy", "tags": ["a", "b"]},
        created_at=time.time(), finished_at=time.time() + 1.25,
    )
    return Episode(**{**values, **changes})


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "trajectories.db"


@pytest.fixture
def store(db: Path):
    with TrajectoryStore(db) as opened:
        yield opened


# Data model and round trips --------------------------------------------------------------------


def test_every_field_round_trips_through_the_store_and_json(store: TrajectoryStore, db: Path):
    episode = full_episode()
    assert store.add(episode) == episode.id
    assert store.get(episode.id) == episode
    with TrajectoryStore(db) as reopened:
        assert reopened.get(episode.id) == episode
    assert Episode.from_dict(json.loads(json.dumps(episode.to_dict()))) == episode
    assert episode.to_dict()["format_version"] == FORMAT_VERSION and episode.complete
    copied = episode.to_dict()  # a copy: changing it leaves the episode alone
    copied["steps"][0]["token_ids"].append(1)
    copied["steps"][0]["info"]["nested"]["ok"] = False
    assert episode == store.get(episode.id)


def test_jsonl_export_reads_back_with_pandas_and_from_dict(store: TrajectoryStore, tmp_path: Path):
    episodes = [full_episode(created_at=100.0), full_episode(steps=[], outcome="failure", created_at=200.0)]
    for episode in episodes:
        store.add(episode)
    path = tmp_path / "out.jsonl"
    assert store.export(path) == 2
    frame = pd.read_json(path, lines=True, dtype=False)
    assert list(frame["id"]) == [episodes[1].id, episodes[0].id]  # newest first
    assert [len(steps) for steps in frame["steps"]] == [0, 2]
    assert list(frame["format_version"]) == [FORMAT_VERSION] * 2
    read = [Episode.from_dict(json.loads(line)) for line in path.read_text().splitlines()]
    assert read == episodes[::-1]


def episodes_from_parquet_rows(rows: list[dict[str, Any]]) -> list[Episode]:
    """Rebuild episodes from a Parquet export's rows (one per step, episode columns repeated)."""
    episodes: dict[str, Episode] = {}
    step_names = {"step", "model_output", "tool_call", "tool_result", "reward", "token_ids", "logprobs", "loss_mask",
                  "policy_version", "step_snapshot_id", "started_at", "duration_s", "info"}
    for row in rows:
        head = {k: v for k, v in row.items() if k not in step_names}
        head["id"], head["metadata"] = head.pop("episode_id"), json.loads(head["metadata"])
        episode = episodes.setdefault(head["id"], Episode(**head))
        if row["step"] is not None:
            episode.steps.append(Step(
                index=row["step"], model_output=row["model_output"], reward=row["reward"],
                tool_call=None if row["tool_call"] is None else json.loads(row["tool_call"]),
                tool_result=row["tool_result"], token_ids=row["token_ids"], logprobs=row["logprobs"],
                loss_mask=row["loss_mask"], policy_version=row["policy_version"], snapshot_id=row["step_snapshot_id"],
                started_at=row["started_at"], duration_s=row["duration_s"], info=json.loads(row["info"])))
    return list(episodes.values())


def test_parquet_export_reads_back_with_pyarrow_and_pandas(store: TrajectoryStore, tmp_path: Path):
    bare = Step(index=0)  # every optional field null
    episodes = [full_episode(created_at=100.0), full_episode(steps=[], outcome="truncated", created_at=200.0),
                full_episode(steps=[bare], seed=None, parent_id=None, fork_step=None, error=None, created_at=300.0)]
    for episode in episodes:
        store.add(episode)
    path = tmp_path / "out.parquet"
    assert store.export(path) == 3

    table = pq.read_table(path)
    assert table.schema.metadata[b"fanfold_format_version"] == str(FORMAT_VERSION).encode()
    assert table.schema.field("token_ids").type == pa.list_(pa.int64())
    assert table.schema.field("logprobs").type == pa.list_(pa.float64())
    assert table.schema.field("loss_mask").type == pa.list_(pa.int8())
    assert table.num_rows == 4  # two steps, one row for the episode without steps, one step
    assert episodes_from_parquet_rows(table.to_pylist()) == episodes[::-1]

    frame = pd.read_parquet(path)
    assert len(frame) == 4 and frame["step"].isna().sum() == 1
    assert frame["episode_id"].nunique() == 3
    full = frame[frame["episode_id"] == episodes[0].id].sort_values("step")
    assert [list(ids) for ids in full["token_ids"]] == [s.token_ids for s in episodes[0].steps]
    assert json.loads(full["tool_call"].iloc[1]) == episodes[0].steps[1].tool_call


# Queries ---------------------------------------------------------------------------------------


def test_queries_by_task_and_outcome_newest_first(store: TrajectoryStore):
    now = time.time()
    made = [full_episode(task=task, outcome=outcome, created_at=now - 100 + n)
            for n, (task, outcome) in enumerate([("a", "success"), ("b", "failure"), ("a", "truncated"),
                                                 ("a", "failure"), ("b", "success")])]
    for episode in made:
        store.add(episode)
    ids = lambda found: [e.id for e in found]  # noqa: E731
    assert ids(store.episodes()) == ids(made[::-1])
    assert ids(store.episodes(task="a")) == [made[3].id, made[2].id, made[0].id]
    assert ids(store.episodes(outcome="failure")) == [made[3].id, made[1].id]
    assert ids(store.episodes(task="a", outcome=["success", "truncated"])) == [made[2].id, made[0].id]
    assert ids(store.episodes(since=now - 98)) == [made[4].id, made[3].id, made[2].id]
    assert ids(store.episodes(limit=2)) == [made[4].id, made[3].id]
    assert store.count(task="b") == 2 and store.count(outcome="failure", task="a") == 1
    light = store.episodes(task="b", with_steps=False)
    assert ids(light) == [made[4].id, made[1].id]
    assert all(e.steps == [] for e in light) and store.step_counts([e.id for e in light]) == {e.id: 2 for e in light}


def test_incomplete_episodes_only_on_request(store: TrajectoryStore):
    for outcome in ("success", "error", "infra_error", "partial"):
        store.add(full_episode(outcome=outcome))
    running = store.begin(full_episode(outcome="running", steps=[]))
    assert [e.outcome for e in store.episodes()] == ["success"]
    assert store.count() == 1 and store.count(include_incomplete=True) == 5
    assert {e.outcome for e in store.episodes(include_incomplete=True)} == {"success", "error", "infra_error",
                                                                              "partial", "running"}
    assert [e.id for e in store.episodes(outcome="running")] == [running]
    assert {e.outcome for e in store.episodes(outcome=["error", "infra_error"])} == {"error", "infra_error"}


def test_steps_slice_by_index(store: TrajectoryStore):
    episode = full_episode(steps=[full_step(n) for n in range(6)])
    store.add(episode)
    assert store.steps(episode.id, 2, 5) == episode.steps[2:5]
    assert [s.index for s in store.steps(episode.id, 4)] == [4, 5]
    assert store.steps(episode.id, 10) == [] and store.steps(episode.id, 3, 1) == []
    with pytest.raises(InvalidRequest, match="negative"):
        store.steps(episode.id, -1)
    with pytest.raises(NotFound):
        store.steps("nope")


# Incremental writing, recovery -----------------------------------------------------------------


def test_incremental_writing_begin_add_step_finish(store: TrajectoryStore):
    episode = full_episode(outcome="running", steps=[full_step(0)], total_reward=0.0, finished_at=None)
    episode_id = store.begin(episode)
    store.add_step(episode_id, full_step(1))
    store.add_step(episode_id, full_step(2))
    assert store.get(episode_id).outcome == "running" and store.count() == 0
    with pytest.raises(InvalidRequest, match="already has a step 2"):
        store.add_step(episode_id, full_step(2))
    store.finish(episode_id, "success")
    done = store.get(episode_id)
    assert (done.outcome, done.total_reward, len(done.steps)) == ("success", 0.75, 3)  # 0 + 0.25 + 0.5
    assert done.finished_at is not None and done.error == episode.error
    with pytest.raises(InvalidRequest, match="already ended"):
        store.add_step(episode_id, full_step(3))
    with pytest.raises(InvalidRequest, match="already ended"):
        store.finish(episode_id, "failure")
    with pytest.raises(NotFound):
        store.add_step("missing", full_step(0))
    with pytest.raises(InvalidRequest, match="outcome"):
        store.finish(store.begin(Episode("t")), "running")
    # The digest written at finish is the one Episode.digest computes: identical episodes dedupe.
    twin = Episode(**{**done.__dict__, "id": "f" * 32})
    assert store.add(twin, dedupe=True) == episode_id


def test_a_writer_that_exits_without_finishing_leaves_a_partial_episode(db: Path):
    script = textwrap.dedent(f"""
        import os
        from fanfold.rl.store import TrajectoryStore
        from fanfold.rl.trajectory import Episode, Step
        store = TrajectoryStore({str(db)!r})
        episode_id = store.begin(Episode("crashy", seed=1))
        store.add_step(episode_id, Step(0, model_output="first", reward=0.5, loss_mask=[1], token_ids=[3],
                                        logprobs=[-0.1]))
        print(episode_id, flush=True)
        os._exit(3)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    episode_id = done.stdout.strip()
    with TrajectoryStore(db) as store:
        episode = store.get(episode_id)
        assert episode.outcome == "partial" and episode.total_reward == 0.5 and "pid" in (episode.error or "")
        assert [(s.model_output, s.token_ids) for s in episode.steps] == [("first", [3])]
        assert store.count() == 0 and [e.id for e in store.episodes(outcome="partial")] == [episode_id]


def test_a_live_writer_keeps_its_episode_running_until_it_is_killed(db: Path):
    script = textwrap.dedent(f"""
        import sys, time
        from fanfold.rl.store import TrajectoryStore
        from fanfold.rl.trajectory import Episode, Step
        store = TrajectoryStore({str(db)!r})
        episode_id = store.begin(Episode("slow"))
        store.add_step(episode_id, Step(0))
        print(episode_id, flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        episode_id = child.stdout.readline().strip()
        with TrajectoryStore(db) as store:
            assert store.get(episode_id).outcome == "running"  # the writer is alive: hands off
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
            assert store.recover() == 1 and store.get(episode_id).outcome == "partial"
            assert len(store.get(episode_id).steps) == 1
    finally:
        child.kill()
        child.wait()


def test_a_writer_from_before_a_reboot_is_dead(db: Path):
    with TrajectoryStore(db) as store:
        episode_id = store.begin(Episode("t"))  # this process: alive
    with TrajectoryStore(db) as store:
        assert store.get(episode_id).outcome == "running"
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE episodes SET writer_boot = 'another-boot'")
    with TrajectoryStore(db) as store:
        assert store.get(episode_id).outcome == "partial"


def test_threads_share_one_store(store: TrajectoryStore):
    def roll(n: int) -> None:
        episode_id = store.begin(Episode("threads", seed=n))
        for index in range(25):
            store.add_step(episode_id, Step(index, reward=1.0, token_ids=[index], logprobs=[0.0], loss_mask=[1]))
        store.finish(episode_id, "success")

    workers = [threading.Thread(target=roll, args=(n,)) for n in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    found = store.episodes(task="threads")
    assert len(found) == 8 and all(len(e.steps) == 25 and e.total_reward == 25.0 for e in found)


# Pruning ---------------------------------------------------------------------------------------


def step_rows(db: Path, episode_id: str) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT COUNT(*) FROM steps WHERE episode_id = ?", (episode_id,)).fetchone()[0]


def test_dedupe_keeps_the_earliest_of_identical_complete_episodes(store: TrajectoryStore, db: Path):
    first = full_episode(created_at=100.0)
    later = full_episode(created_at=200.0, rollout_id="another", metadata={})  # not in the digest
    other = full_episode(created_at=300.0, seed=8)
    partial = full_episode(created_at=400.0, outcome="partial")
    for episode in (first, later, other, partial):
        store.add(episode)
    assert first.digest() == later.digest() == partial.digest() != other.digest()
    assert store.add(full_episode(created_at=500.0), dedupe=True) == first.id
    assert store.dedupe() == 1
    assert {e.id for e in store.episodes(include_incomplete=True)} == {first.id, other.id, partial.id}
    assert step_rows(db, later.id) == 0 and step_rows(db, first.id) == 2
    assert store.dedupe() == 0


def test_expire_and_delete(store: TrajectoryStore, db: Path):
    old = full_episode(created_at=time.time() - 10 * DAY)
    young = full_episode(created_at=time.time() - DAY)
    old_running = store.begin(full_episode(created_at=time.time() - 10 * DAY, outcome="running"))
    store.add(old)
    store.add(young)
    assert store.expire(7 * DAY) == 1
    assert {e.id for e in store.episodes(include_incomplete=True)} == {young.id, old_running}
    assert step_rows(db, old.id) == 0
    store.delete(young.id)
    with pytest.raises(NotFound):
        store.get(young.id)
    with pytest.raises(NotFound):
        store.delete(young.id)


# Validation ------------------------------------------------------------------------------------


def test_malformed_data_is_refused_with_the_reason(store: TrajectoryStore, tmp_path: Path):
    with pytest.raises(InvalidRequest, match="equal lengths.*token_ids=2, logprobs=1"):
        Step(0, token_ids=[1, 2], logprobs=[0.0])
    with pytest.raises(InvalidRequest, match="loss_mask"):
        Step(0, token_ids=[1], logprobs=[0.0], loss_mask=[2])
    with pytest.raises(InvalidRequest, match="index"):
        Step(-1)
    with pytest.raises(InvalidRequest, match="outcome must be one of"):
        Episode("t", outcome="done")
    with pytest.raises(InvalidRequest, match="task"):
        Episode("")
    newer = {**full_episode().to_dict(), "format_version": FORMAT_VERSION + 1, "new_field": 1}
    with pytest.raises(InvalidRequest, match="format version 2"):
        Episode.from_dict(newer)
    with pytest.raises(InvalidRequest, match="unknown episode field: colour"):
        Episode.from_dict({"task": "t", "colour": "red"})
    with pytest.raises(InvalidRequest, match="metadata must be JSON-able"):
        store.add(Episode("t", metadata={"when": object()}))
    with pytest.raises(InvalidRequest, match="token_ids"):
        store.add(Episode("t", steps=[Step(0, token_ids=["a"])]))
    assert store.count(include_incomplete=True) == 0  # nothing half-written
    episode = store.add(full_episode())
    with pytest.raises(InvalidRequest, match="already in the store"):
        store.add(full_episode(id=episode))
    with pytest.raises(InvalidRequest, match="outcome must be one of"):
        store.episodes(outcome="won")
    with pytest.raises(InvalidRequest, match="jsonl or parquet"):
        store.export(tmp_path / "out.csv")
    with pytest.raises(InvalidRequest, match="cannot write"):
        store.export(tmp_path / "no-such-dir" / "out.jsonl")


def test_a_store_from_a_newer_fanfold_is_refused(db: Path):
    TrajectoryStore(db).close()
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'format_version'", (str(FORMAT_VERSION + 1),))
    with pytest.raises(InvalidRequest, match="format version"):
        TrajectoryStore(db)


# The CLI ---------------------------------------------------------------------------------------


def traj(*args: str) -> Any:
    result = CliRunner().invoke(main, ["traj", *args], env={"COLUMNS": "200"})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


@pytest.fixture
def filled(db: Path) -> dict[str, Episode]:
    episodes = {
        "done": full_episode(id="abc1" + "0" * 28, steps=[full_step(n) for n in range(5)], created_at=100.0),
        "other": full_episode(id="abc2" + "0" * 28, task="other-task", outcome="failure", created_at=200.0),
        "broken": full_episode(id="ffff" + "0" * 28, outcome="partial", created_at=300.0),
    }
    with TrajectoryStore(db) as store:
        for episode in episodes.values():
            store.add(episode)
    return episodes


def test_cli_ls(db: Path, filled: dict[str, Episode]):
    listed = traj("ls", "--db", str(db))
    assert listed.exit_code == 0, listed.output
    assert "abc100000000" in listed.stdout and "fix-calc" in listed.stdout and "ffff" not in listed.stdout
    rows = json.loads(traj("ls", "--db", str(db), "--all", "--json").stdout)
    assert [(r["id"][:4], r["outcome"], r["steps"]) for r in rows] == [("ffff", "partial", 2), ("abc2", "failure", 2),
                                                                       ("abc1", "success", 5)]
    only = json.loads(traj("ls", "--db", str(db), "--task", "other-task", "--json").stdout)
    assert [r["task"] for r in only] == ["other-task"]
    assert len(json.loads(traj("ls", "--db", str(db), "--outcome", "partial", "--json").stdout)) == 1


def test_cli_show_with_a_slice_and_a_prefix(db: Path, filled: dict[str, Episode]):
    shown = traj("show", "--db", str(db), "abc1", "--steps", "1:3")
    assert shown.exit_code == 0, shown.output
    assert "step 1" in shown.stdout and "step 2" in shown.stdout and "step 0" not in shown.stdout
    assert "step 3" not in shown.stdout and "bash" in shown.stdout and "mask 4" in shown.stdout
    as_json = json.loads(traj("show", "--db", str(db), "abc1", "--steps", "3:", "--json").stdout)
    assert [s["index"] for s in as_json["steps"]] == [3, 4] and as_json["id"] == filled["done"].id
    assert [s["index"] for s in json.loads(traj("show", "--db", str(db), "abc1", "--steps", "2", "--json").stdout)
            ["steps"]] == [2]


def test_cli_export_dedupe_expire(db: Path, filled: dict[str, Episode], tmp_path: Path):
    out = tmp_path / "all.parquet"
    exported = traj("export", "--db", str(db), str(out), "--all")
    assert exported.exit_code == 0 and exported.stdout.startswith("3 episodes written"), exported.output
    assert pq.read_table(out).num_rows == 5 + 2 + 2
    jsonl = tmp_path / "some.data"
    assert traj("export", "--db", str(db), str(jsonl), "--format", "jsonl", "--task", "fix-calc").stdout.startswith(
        "1 episode written")
    assert len(pd.read_json(jsonl, lines=True)) == 1
    assert traj("dedupe", "--db", str(db)).stdout == "0 duplicate episodes deleted\n"
    assert traj("expire", "--db", str(db), "--older-than", "7d").stdout == "3 episodes older than 7d deleted\n"


@pytest.mark.parametrize("args", [
    ["show", "nothing-like-it"], ["show", "abc"], ["show", "abc1", "--steps", "3:1"], ["show", "abc1", "--steps", "x"],
    ["export", "out.csv"], ["expire", "--older-than", "7 weeks"],
])
def test_cli_bad_input_is_one_line_without_a_traceback(db: Path, filled: dict[str, Episode], args: list[str]):
    # Wide, so that rich does not fold the one line at 80 columns (its width when not on a terminal).
    done = subprocess.run([sys.executable, "-m", "fanfold.cli", "traj", *args[:1], "--db", str(db), *args[1:]],
                          capture_output=True, text=True, timeout=60, cwd=db.parent, env={**os.environ, "COLUMNS": "300"})
    assert done.returncode == 2 and done.stderr.startswith("error:"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_cli_without_a_store_says_so(tmp_path: Path):
    done = traj("ls", "--db", str(tmp_path / "none.db"))
    assert done.exit_code == 2 and "no trajectory store" in done.stderr
    assert not (tmp_path / "none.db").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs")
def test_a_full_disk_fails_writes_typed_and_the_store_writes_again_once_space_is_back(tmp_path: Path):
    where = tmp_path / "small"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "fanfold-small-store", str(where)], check=True)
    try:
        with TrajectoryStore(where / "t.db") as small:
            small.add(full_episode(id="a" * 32))
            with open(where / "filler", "wb") as filler:  # every free byte
                try:
                    while True:
                        filler.write(b"\0" * 65536)
                        filler.flush()
                except OSError:
                    pass
            with pytest.raises(InfrastructureError, match="disk is full"):
                for n in range(1000):  # until a COMMIT needs a page there is no room for
                    small.add(full_episode(id=f"{n:032x}", steps=[full_step(i) for i in range(20)]))
            (where / "filler").unlink()
            small.add(full_episode(id="b" * 32))  # a failed COMMIT left no transaction open behind it
            assert small.get("b" * 32).id == "b" * 32
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
