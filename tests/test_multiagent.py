"""Multi-agent envs over real sandbox groups: PettingZoo's API test, the handoff env won by its scripted
policies and lost by a wrong or forged answer, forks mid-episode that go their own ways, per-agent
trajectories under one joint episode id, and nothing left behind."""

from __future__ import annotations

import json
import warnings

import pytest
from pettingzoo.test import parallel_api_test

from fanfold import AsyncFleet, Fleet
from fanfold.errors import InvalidRequest
from fanfold.rl import (
    ParallelSandboxEnv,
    ScriptedPolicy,
    TrajectoryStore,
    make_parallel_async,
    parallel_env_class,
    run_parallel_episode,
    scripted,
)
from fanfold.rl.envs.handoff import MASK, HandoffEnv
from fanfold.rl.envs.scripts import HANDOFF_FETCH, handoff, reply

from conftest import leaks

WAIT = {"name": "wait", "arguments": {}}


def shell(command: str) -> dict:
    return {"name": "shell", "arguments": {"command": command}}


def report(secret: str) -> dict:
    return {"name": "report", "arguments": {"secret": secret}}


def serve(port: int) -> dict:
    return shell(f"cd /srv && nohup python3 -m http.server {port} --bind 0.0.0.0 >/dev/null 2>&1 & echo serving")


def fetch(port: int, path: str = "secret") -> dict:
    return shell(HANDOFF_FETCH.format(url=f"http://server:{port}/{path}"))


def fetched(observation: str) -> str:
    status, _, body = observation.partition("\n")
    assert status == "exit code 0", observation
    return body.strip()


@pytest.fixture(scope="module")
def sync_fleet(config):
    with Fleet(config=config) as fleet:
        yield fleet
        assert fleet.groups() == [] and fleet.list() == []


def test_the_handoff_env_passes_pettingzoos_parallel_api_test(fleet):
    env = ParallelSandboxEnv("handoff", fleet=fleet, render_mode="ansi")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # PettingZoo warns of a missing agent, reward or space
            parallel_api_test(env, num_cycles=3)
        assert env.max_cycles == env.inner.max_steps == 3
        observations, infos = env.reset(seed=5)
        assert env.agents == env.possible_agents == ["server", "client"] and set(infos) == set(observations)
        assert all(env.observation_space(agent).contains(text) for agent, text in observations.items())
        assert env.action_space("server") is env.action_space("client")
        members = fleet.group(env.group_id).members
        assert {name: sandbox.info.state for name, sandbox in members.items()} == {"server": "running",
                                                                                   "client": "running"}
        assert env.render() == "\n".join(f"[{agent}]\n{text}" for agent, text in observations.items())
    finally:
        env.close()
    assert env.group_id is None and fleet.groups() == []


async def test_the_scripted_policies_win_for_both_and_trajectories_share_a_joint_id(config, tmp_path):
    store = TrajectoryStore(tmp_path / "t.db")
    async with AsyncFleet(config=config) as fleet:
        async with make_parallel_async("handoff", fleet) as env:
            [episodes] = await run_parallel_episode(env, scripted("handoff"), seed=11, store=store, rollout_id="r-1")
    assert {agent: (e.outcome, e.total_reward) for agent, e in episodes.items()} == {
        "server": ("success", 1.0), "client": ("success", 1.0)}
    client, server = episodes["client"], episodes["server"]
    assert [s.reward for s in client.steps] == [0.0, 0.0, 1.0] and server.steps[-1].reward == 1.0
    joint = client.metadata["joint_episode"]
    stored = store.joint_episode(joint)
    assert set(stored) == {"server", "client"} and stored["client"].id == client.id != server.id
    assert all(e.metadata["agent"] == agent and e.rollout_id == "r-1" and e.task == "handoff/secret"
               for agent, e in stored.items())
    step = stored["client"].steps[-1]
    assert step.tool_call["name"] == "report" and step.loss_mask and set(step.loss_mask) == {0, 1}
    assert len(step.token_ids) == len(step.logprobs) == len(step.loss_mask)
    secret = json.loads(step.tool_call["arguments"])["secret"]
    assert secret in stored["client"].steps[1].tool_result  # it crossed the network to the client
    assert all(secret not in (s.tool_result or "") for s in stored["server"].steps)  # the server never saw it
    assert store.episodes(task="handoff/secret", outcome="success") and len(store.episodes()) == 2


def test_a_wrong_report_loses_for_both(sync_fleet):
    env = ParallelSandboxEnv("handoff", fleet=sync_fleet)
    try:
        env.reset(seed=3)
        port = env.inner.task["port"]
        observations, rewards, terminations, truncations, _ = env.step({"server": serve(port), "client": WAIT})
        assert observations["server"] == "exit code 0\nserving\n" and not any(terminations.values())
        right = fetched(env.step({"server": WAIT, "client": fetch(port)})[0]["client"])
        observations, rewards, terminations, truncations, _ = env.step({"server": WAIT, "client": report(right[:-1])})
        assert rewards == {"server": 0.0, "client": 0.0} and terminations == {"server": True, "client": True}
        assert env.agents == [] and observations["client"] == "reported: wrong"
        with pytest.raises(RuntimeError, match="reset"):
            env.step({"server": WAIT, "client": WAIT})
    finally:
        env.close()


def test_the_grader_trusts_no_file_of_the_sandboxes(sync_fleet):
    env = ParallelSandboxEnv("handoff", fleet=sync_fleet)
    try:
        env.reset(seed=4)
        port = env.inner.task["port"]
        forge = f"echo forged > /srv/secret && cat /srv/secret; {serve(port)['arguments']['command']}"
        assert env.step({"server": shell(forge), "client": WAIT})[0]["server"] == "exit code 0\nforged\nserving\n"
        served = fetched(env.step({"server": WAIT, "client": fetch(port)})[0]["client"])
        assert served == "forged"
        assert env.step({"server": WAIT, "client": report(served)})[1] == {"server": 0.0, "client": 0.0}
    finally:
        env.close()


def test_the_server_never_sees_the_secret_and_bad_actions_are_observations(sync_fleet):
    env = ParallelSandboxEnv("handoff", fleet=sync_fleet, max_steps=2)
    try:
        env.reset(seed=6)
        observations, rewards, _, _, infos = env.step({"server": shell("cat /srv/secret"), "client": "not json"})
        assert observations["server"] == f"exit code 0\n{MASK}\n"
        assert observations["client"].startswith("error: an action is a JSON tool call") and infos["client"]["error"]
        observations, _, terminations, truncations, _ = env.step({"server": report("x"), "client": WAIT})
        assert observations["server"].startswith("error: unknown tool 'report'; server's tools are shell, wait")
        assert truncations == {"server": True, "client": True} and not any(terminations.values()) and env.agents == []
        env.reset(seed=6)
        with pytest.raises(InvalidRequest, match="one action per live agent"):
            env.step({"server": WAIT})
        with pytest.raises(InvalidRequest, match="has no agent 'nobody'"):
            env.observation_space("nobody")
    finally:
        env.close()


def test_a_fork_mid_episode_continues_independently(sync_fleet):
    env = ParallelSandboxEnv("handoff", fleet=sync_fleet)
    copies: list[ParallelSandboxEnv] = []
    try:
        env.reset(seed=8)
        port = env.inner.task["port"]
        env.step({"server": serve(port), "client": WAIT})
        copies = env.fork(2)
        assert len({env.group_id, *(copy.group_id for copy in copies)}) == 3
        assert all(copy.agents == ["server", "client"] and copy.inner.task == env.inner.task for copy in copies)
        first, second = copies
        first.step({"server": shell("echo only-in-the-first > /srv/note"), "client": WAIT})
        second.step({"server": WAIT, "client": WAIT})
        assert fetched(second.step({"server": WAIT, "client": fetch(port, "")})[0]["client"])  # its server answers
        assert fetched(first.step({"server": WAIT, "client": fetch(port, "note")})[0]["client"]) == "only-in-the-first"
        missing = second.step({"server": WAIT, "client": shell(
            f"python3 -c \"import urllib.request as u; u.urlopen('http://server:{port}/note', timeout=5)\"")})
        assert "404" in missing[0]["client"]
        secret = fetched(first.step({"server": WAIT, "client": fetch(port)})[0]["client"])
        assert first.step({"server": WAIT, "client": report(secret)})[1] == {"server": 1.0, "client": 1.0}
        assert second.step({"server": WAIT, "client": report("wrong")})[1] == {"server": 0.0, "client": 0.0}
        assert first.agents == second.agents == [] and env.agents == ["server", "client"]  # the original runs on
        assert fetched(env.step({"server": WAIT, "client": fetch(port)})[0]["client"]) == secret
    finally:
        for copy in copies:
            copy.close()
        env.close()
    assert sync_fleet.groups() == [] and sync_fleet.list() == []


async def test_run_parallel_episode_forks_into_branches_with_their_own_joint_ids(config, tmp_path):
    store = TrajectoryStore(tmp_path / "t.db")
    async with AsyncFleet(config=config) as fleet:
        async with make_parallel_async("handoff", fleet) as env:
            main, branch = await run_parallel_episode(env, scripted("handoff"), seed=2, store=store, fork_at=1)
        assert await fleet.groups() == []
    assert all(e.outcome == "success" and e.total_reward == 1.0 for e in [*main.values(), *branch.values()])
    for agent in ("server", "client"):
        assert branch[agent].parent_id == main[agent].id and branch[agent].fork_step == 1
        assert branch[agent].steps[:1] == main[agent].steps[:1] and len(branch[agent].steps) == 3
    joint, forked = main["client"].metadata["joint_episode"], branch["client"].metadata["joint_episode"]
    assert joint != forked and branch["server"].metadata["joint_parent"] == joint
    assert set(store.joint_episode(forked)) == {"server", "client"}
    assert {e.id for e in store.joint_episode(joint).values()} == {main["server"].id, main["client"].id}


async def test_a_policy_that_raises_ends_every_agents_episode_as_an_error(config, tmp_path):
    store = TrajectoryStore(tmp_path / "t.db")

    def broken(messages, rng):
        if "agent `client`" in messages[0]["content"] and len(messages) > 2:
            raise ValueError("the model fell over")
        return handoff(messages, rng) if len(messages) <= 2 else reply("wait", {})

    async with AsyncFleet(config=config) as fleet:
        async with make_parallel_async("handoff", fleet) as env:
            with pytest.raises(ValueError, match="fell over"):
                await run_parallel_episode(env, ScriptedPolicy(broken), seed=1, store=store)
    [episode] = store.episodes(outcome="error", limit=1)
    stored = store.joint_episode(episode.metadata["joint_episode"])
    assert {agent: e.outcome for agent, e in stored.items()} == {"server": "error", "client": "error"}
    assert all(len(e.steps) == 1 for e in stored.values())


def test_envs_by_name_and_nothing_left_behind(config, sync_fleet):
    assert parallel_env_class("handoff") is HandoffEnv
    with pytest.raises(InvalidRequest, match="unknown env 'codefix'"):
        ParallelSandboxEnv("codefix", fleet=sync_fleet)  # a single-agent env's name
    assert parallel_env_class("fanfold.rl.envs.handoff:HandoffEnv") is HandoffEnv
    with pytest.raises(InvalidRequest, match="unknown env 'nope'"):
        parallel_env_class("nope")
    with pytest.raises(InvalidRequest, match="not an AsyncParallelSandboxEnv subclass"):
        parallel_env_class("fanfold.rl.envs.codefix:CodeFixEnv")
    assert leaks(config) == {"mounts": 0, "cgroups": 0, "containers": 0}
