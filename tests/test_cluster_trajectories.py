"""One trajectory store for a Ray cluster: Ray tasks write episodes through the store's actor, the
driver reads them back from the SQLite file it keeps and exports them; the store's errors arrive as
themselves and a dead actor as ``InfrastructureError``. A small local Ray of this module's own."""

from __future__ import annotations

import inspect
import json
import os
import select
import subprocess
import sys

import pytest

from conftest import stray_processes

ray = pytest.importorskip("ray")

from fanfold.cluster.trajectories import METHODS, ClusterTrajectoryStore  # noqa: E402
from fanfold.errors import InfrastructureError, InvalidRequest, NotFound  # noqa: E402
from fanfold.rl.store import TrajectoryStore  # noqa: E402
from fanfold.rl.trajectory import Episode, Step  # noqa: E402

TASKS = 4
EPISODES_PER_TASK = 3
STEPS = 4


@pytest.fixture(scope="module")
def local_ray():
    """A Ray of this module's own (``address="local"``: never another test's); no Ray process outlives it."""
    assert not ray.is_initialized(), "another module's Ray is still connected"
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20,
             namespace="fanfold", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert not [line for line in stray_processes() if "ray" in line]


def _step(worker: int, episode: int, index: int) -> Step:
    model, tool = [worker, episode, index], [7, 8]
    return Step(index=index, model_output=f"w{worker} e{episode} s{index}", reward=0.25 * index,
                token_ids=model + tool, logprobs=[-0.5] * len(model) + [0.0] * len(tool),
                loss_mask=[1] * len(model) + [0] * len(tool), info={"worker": worker})


@ray.remote
def rollouts(worker: int, given: ClusterTrajectoryStore | None) -> list[str]:
    """A rollout worker: episodes written step by step (and the last one whole) through the store."""
    store = given or ClusterTrajectoryStore(name="test-trajectories", create=False)
    ids = []
    for episode_no in range(EPISODES_PER_TASK):
        steps = [_step(worker, episode_no, i) for i in range(STEPS)]
        episode = Episode(task=f"task-{worker}", seed=episode_no, metadata={"worker": worker})
        if episode_no == EPISODES_PER_TASK - 1:
            episode.steps, episode.outcome, episode.total_reward = steps, "success", sum(s.reward for s in steps)
            ids.append(store.add(episode))
            continue
        ids.append(store.begin(episode))
        for step in steps:
            store.add_step(episode.id, step)
        store.finish(episode.id, "success")
    return ids


@ray.remote
def create_in_a_task() -> str:
    try:
        ClusterTrajectoryStore(name="made-by-a-task")
    except InvalidRequest as err:
        return str(err)
    return "created"


def test_tasks_write_one_store_the_trainer_reads(local_ray, tmp_path):
    path = tmp_path / "trajectories.db"
    store = ClusterTrajectoryStore(path, name="test-trajectories")
    assert (store.path, store.node_id) == (str(path), ray.get_runtime_context().get_node_id())
    # Half the tasks attach by name, half get the client itself.
    written = ray.get([rollouts.remote(n, store if n % 2 else None) for n in range(TASKS)])
    assert store.count() == TASKS * EPISODES_PER_TASK
    assert store.step_counts(written[0]) == dict.fromkeys(written[0], STEPS)
    store.export(tmp_path / "through-actor.jsonl")
    store.stop()

    with TrajectoryStore(path, create=False) as local:
        episodes = {e.id: e for e in local.episodes()}
        assert sorted(episodes) == sorted(i for ids in written for i in ids)
        for worker, ids in enumerate(written):
            for episode_no, episode_id in enumerate(ids):
                episode = episodes[episode_id]
                expected = [_step(worker, episode_no, i) for i in range(STEPS)]
                assert (episode.task, episode.seed, episode.outcome) == (f"task-{worker}", episode_no, "success")
                assert episode.total_reward == sum(s.reward for s in expected)
                assert [(s.index, s.model_output, s.reward, s.token_ids, s.logprobs, s.loss_mask, s.info)
                        for s in episode.steps] == [
                    (s.index, s.model_output, s.reward, s.token_ids, s.logprobs, s.loss_mask, s.info) for s in expected]
        assert local.export(tmp_path / "all.parquet") == TASKS * EPISODES_PER_TASK
        assert local.export(tmp_path / "all.jsonl") == TASKS * EPISODES_PER_TASK
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(tmp_path / "all.parquet")
    assert table.num_rows == TASKS * EPISODES_PER_TASK * STEPS
    lines = (tmp_path / "through-actor.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == sorted(episodes)


def test_store_errors_arrive_as_themselves(local_ray, tmp_path):
    store = ClusterTrajectoryStore(tmp_path / "t.db", name="errors")
    try:
        with pytest.raises(NotFound) as caught:
            store.finish("nope", "success")
        assert type(caught.value) is NotFound and str(caught.value) == "no episode nope (begin it first)"
        episode = Episode(task="t")
        store.begin(episode)
        with pytest.raises(InvalidRequest, match=f"episode {episode.id} is already in the store"):
            store.begin(episode)
        with pytest.raises(InvalidRequest, match="keeps .*t.db, not .*other.db"):
            ClusterTrajectoryStore(tmp_path / "other.db", name="errors")
        with pytest.raises(NotFound, match="no trajectory store 'missing'"):
            ClusterTrajectoryStore(name="missing", create=False)
        assert "make it in the driver" in ray.get(create_in_a_task.remote())
    finally:
        store.stop()
    (tmp_path / "junk.db").write_bytes(b"not SQLite " * 100)
    with pytest.raises(InvalidRequest, match="cannot open trajectory store .*junk.db: file is not a database"):
        ClusterTrajectoryStore(tmp_path / "junk.db", name="unopenable")
    with pytest.raises(NotFound):  # that actor is gone, its name free
        ClusterTrajectoryStore(name="unopenable", create=False)


def test_a_dead_actor_is_an_infrastructure_error(local_ray, tmp_path):
    store = ClusterTrajectoryStore(tmp_path / "t.db", name="doomed")
    episode_id = store.begin(Episode(task="t"))
    pidfd = os.pidfd_open(store.pid)
    ray.kill(ray.get_actor("doomed", namespace="fanfold"), no_restart=True)
    # Its process gone first: a call sent meanwhile could still be served.
    assert select.select([pidfd], [], [], 30)[0], "the actor's process outlived ray.kill by 30 s"
    os.close(pidfd)
    with pytest.raises(InfrastructureError, match="'doomed': its actor is gone"):
        store.add_step(episode_id, Step(index=0))
    store.close()
    with pytest.raises(InvalidRequest, match="is closed"):
        store.count()
    # What it wrote stays; whoever opens the file next (a new actor too) sees the episode it left running as partial.
    with TrajectoryStore(tmp_path / "t.db", create=False) as local:
        assert local.get(episode_id).outcome == "partial"


def test_the_same_methods_as_the_local_store():
    for name in METHODS:
        local = inspect.signature(getattr(TrajectoryStore, name))
        assert inspect.signature(getattr(ClusterTrajectoryStore, name)) == local, name
    public = {n for n in vars(TrajectoryStore) if not n.startswith("_")} - {"close"}
    assert public == set(METHODS)


def test_import_fanfold_leaves_ray_alone():
    code = "import sys, fanfold, fanfold.rl, fanfold.rl.store; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
