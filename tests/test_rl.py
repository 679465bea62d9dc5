"""The env API over real sandboxes: Gymnasium's checker, the two envs that ship, episodes
recorded step by step (forks, partial ones), and the OpenAI-compatible policy client
against a real HTTP server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import warnings

import gymnasium
import pytest
from aiohttp import web
from gymnasium.utils.env_checker import check_env

from fanfold import AsyncFleet, Fleet
from fanfold.errors import InvalidRequest, PolicyUnavailable, ToolError
from fanfold.rl import (
    OpenAIPolicy,
    SandboxEnv,
    ScriptedPolicy,
    ToolCall,
    TrajectoryStore,
    default_policy,
    env_class,
    make_async,
    run_episode,
    scripted,
)
from fanfold.rl.envs.corpus import generate

from conftest import STATE_DIR, TRANSPORTS, fleet_args


@pytest.fixture(scope="module")
def sync_fleet(config):
    with Fleet(config=config) as fleet:
        yield fleet


@pytest.fixture
async def fleet(config):
    async with AsyncFleet(config=config) as handle:
        yield handle


@pytest.mark.parametrize("name", ["codefix", "corpus"])
def test_envs_pass_gymnasiums_checker(sync_fleet, name):
    env = SandboxEnv(name, fleet=sync_fleet)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*render.*")
            check_env(env)
        obs, info = env.reset(seed=3)
        assert env.observation_space.contains(obs) and info["tools"]
        assert sync_fleet.get(env.sandbox_id).info.state == "running"
    finally:
        env.close()
    assert env.sandbox_id is None


def test_gymnasium_make_and_a_full_sync_episode(sync_fleet):
    env = gymnasium.make("fanfold/CodeFix-v0", fleet=sync_fleet, disable_env_checker=True)
    try:
        obs, _ = env.reset(seed=0)
        assert "stats.py" in obs
        obs, reward, terminated, truncated, info = env.step(json.dumps({"name": "run_tests", "arguments": {}}))
        assert "FAILED (failures=5)" in obs and reward == 0 and not (terminated or truncated)
        fix = {"name": "edit_file", "arguments": {"path": "stats.py", "old": "// len(values)", "new": "/ len(values)"}}
        assert env.step(fix)[0].startswith("edited stats.py")
        obs, reward, terminated, truncated, info = env.step({"name": "submit", "arguments": {}})
        assert (obs, reward, terminated, truncated) == ("submitted: 4 of 8 tests pass", 0.5, True, False)
        with pytest.raises(RuntimeError, match="reset"):
            env.step({"name": "submit"})
    finally:
        env.close()


def test_a_sync_fleet_lends_its_async_twin_to_async_code(config):
    """What the Gymnasium wrapper runs its async env on: ``aio``, ``call`` (the fleet's own loop) and ``started``."""
    fleet = Fleet(config=config)
    assert not fleet.started and fleet.aio.aio is fleet.aio

    async def on_the_loop():
        async with await fleet.aio.create(memory_mb=128) as sandbox:
            return (await sandbox.exec("echo hi")).stdout, threading.current_thread().name

    try:
        assert fleet.call(on_the_loop()) == (b"hi\n", "fanfold-loop")  # the first call starts the fleet
        assert fleet.started and fleet.aio.started
    finally:
        fleet.close()
    assert not fleet.started and not fleet.aio.started


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_sandbox_runs_the_generic_tools_as_envs_do(transport, request, config):
    async with AsyncFleet(**fleet_args(transport, request, config)) as afleet:
        async with await afleet.create(memory_mb=128) as sandbox:
            assert await sandbox.run_tool("write_file", {"path": "/tmp/n.txt", "content": "one\ntwo\n"}) == \
                "wrote 8 bytes to /tmp/n.txt"
            assert await sandbox.run_tool("read_file", '{"path": "/tmp/n.txt", "start_line": 2}') == "two\n"
            assert await sandbox.run_tool("shell", {"command": "wc -l < /tmp/n.txt"}) == "exit code 0\n2\n"
            with pytest.raises(ToolError, match="unknown tool 'rm_rf'"):
                await sandbox.run_tool("rm_rf", {})
            with pytest.raises(ToolError, match="no such file"):
                await sandbox.run_tool("read_file", {"path": "/tmp/none"})


def test_a_sync_sandbox_runs_the_generic_tools(sync_fleet):
    with sync_fleet.create(memory_mb=128) as sandbox:
        assert sandbox.run_tool("shell", {"command": "echo sync"}, max_output=100) == "exit code 0\nsync\n"


async def test_misused_tools_are_observations_not_exceptions(fleet):
    env = make_async("codefix", fleet)
    await env.reset(seed=1)
    try:
        cases = {
            "not json": "an action is a JSON tool call",
            json.dumps({"name": "rm_rf"}): "unknown tool 'rm_rf'",
            json.dumps({"name": "read_file", "arguments": {"path": "../etc/passwd"}}): "outside the project",
            json.dumps({"name": "read_file", "arguments": {"path": "nope.py"}}): "cannot read nope.py",
            json.dumps({"name": "edit_file", "arguments": {"path": "stats.py", "old": "return", "new": "x"}}):
                "occurs 5 times",
            json.dumps({"name": "read_file", "arguments": "{bad"}): "not valid JSON",
            json.dumps({"name": "read_file", "arguments": {"path": 3}}): "'path' must be a string",
            json.dumps({"name": "edit_file", "arguments": {"path": "stats.py"}}): "missing required argument 'old'",
            json.dumps({"name": "run_tests", "arguments": {"all": True}}): "unexpected argument 'all'",
        }
        for action, expected in cases.items():
            obs, reward, terminated, truncated, info = await env.step(action)
            assert expected in obs and obs.startswith("error:") and info["error"], (action, obs)
            assert reward == 0 and not terminated and not truncated
    finally:
        await env.close()


async def test_deleting_the_tests_earns_nothing(fleet):
    env = make_async("codefix", fleet)
    await env.reset(seed=2)
    try:
        await env.sandbox.exec("rm test_stats.py && echo 'def mean(' > stats.py")
        obs, reward, terminated, _, _ = await env.step(ToolCall("submit", {}))
        assert terminated and reward == 0.0 and obs == "submitted: 0 of 8 tests pass"
    finally:
        await env.close()


async def test_episodes_are_recorded_with_forks_and_token_masks(fleet, tmp_path):
    store = TrajectoryStore(tmp_path / "t.db")
    env = make_async("codefix", fleet)
    try:
        episodes = await run_episode(env, scripted("codefix"), seed=4, store=store, rollout_id="r-4", fork_at=3)
    finally:
        await env.close()
    main, branch = episodes
    assert branch.parent_id == main.id and branch.fork_step == 3 and branch.rollout_id == "r-4"
    assert [s.tool_call["name"] for s in main.steps][:3] == ["run_tests", "read_file", "edit_file"]
    assert branch.steps[:3] == main.steps[:3]  # the shared prefix
    assert main.steps[3].snapshot_id == branch.steps[3].snapshot_id == branch.snapshot_id is not None
    assert main.steps[-1].tool_call["name"] == branch.steps[-1].tool_call["name"] == "submit"
    for episode in episodes:
        stored = store.get(episode.id)
        assert stored.outcome in ("success", "failure") and stored.complete
        assert stored.total_reward == pytest.approx(episode.total_reward)
        assert len(stored.steps) == len(episode.steps) and stored.steps[-1].reward == episode.total_reward
        for step in stored.steps:
            model = len(step.model_output.encode()) + len(json.dumps(step.tool_call).encode()) - 0
            assert step.loss_mask.count(1) > 0 and step.loss_mask.count(0) == len(step.tool_result.encode())
            assert len(step.token_ids) == len(step.logprobs) == len(step.loss_mask)
            assert step.policy_version == "scripted-1" and model > 0
            # The scripted policy's tokens are the bytes it wrote, then the tool's output (masked out).
            spoken, result = (step.model_output + json.dumps(step.tool_call)).encode(), step.tool_result.encode()
            assert step.loss_mask.count(1) == model == len(spoken)
            assert step.token_ids == list(spoken) + list(result)
            assert step.loss_mask == [1] * len(spoken) + [0] * len(result)
            assert step.logprobs == [-1.0] * len(spoken) + [0.0] * len(result)
    # The branch's sandbox died with its episode, and the fork's snapshot with its last child.
    assert [s for s in await fleet.list() if s.source == branch.snapshot_id] == []
    assert branch.snapshot_id not in {s.id for s in await fleet.snapshots()}


async def test_trajectory_writes_run_off_the_event_loop(fleet, tmp_path):
    # Another rollout's tool calls run on the loop meanwhile: a write to a busy SQLite file
    # must not stall them.
    writers: list[str] = []

    class Watched(TrajectoryStore):
        def begin(self, episode):
            writers.append(threading.current_thread().name)
            return super().begin(episode)

        def add_step(self, episode_id, step):
            writers.append(threading.current_thread().name)
            super().add_step(episode_id, step)

        def finish(self, episode_id, outcome, **kwargs):
            writers.append(threading.current_thread().name)
            super().finish(episode_id, outcome, **kwargs)

    store = Watched(tmp_path / "t.db")
    env = make_async("corpus", fleet)
    try:
        [episode] = await run_episode(env, scripted("corpus"), seed=3, store=store)
    finally:
        await env.close()
    assert len(writers) == len(episode.steps) + 2 and threading.current_thread().name not in writers
    assert store.get(episode.id).complete


async def test_the_same_seed_replays_the_same_episode(fleet):
    env = make_async("corpus", fleet)
    try:
        first = await run_episode(env, scripted("corpus"), seed=11)
        answer = set(env.task["answer"])
        second = await run_episode(env, scripted("corpus"), seed=11)
        other = await run_episode(env, scripted("corpus"), seed=12)
    finally:
        await env.close()
    assert first[0].digest() == second[0].digest()
    assert first[0].seed == 11 and other[0].digest() != first[0].digest()  # the seed is what decides
    submitted = json.loads(first[0].steps[-1].tool_call["arguments"])["paths"]
    assert first[0].total_reward == pytest.approx(
        2 * len(answer & {p.removeprefix("/corpus/") for p in submitted}) / (len(answer) + len(submitted)))


async def test_corpus_env_serves_every_question_from_a_read_only_corpus(fleet):
    docs, questions = generate()
    env = make_async("corpus", fleet)
    try:
        for question in questions[:3] + questions[-2:]:
            prompt, _ = await env.reset(options={"question": question.id})
            assert question.text in prompt
            obs, reward, done, _, _ = await env.step(ToolCall("submit", {"paths": list(question.answer)}))
            assert done and reward == 1.0
        await env.reset(seed=0)
        listing = await env.sandbox.exec("find /corpus -type f | wc -l; stat -c %a /corpus/auth/faq.md")
        assert listing.text.split() == [str(len(docs)), "444"]
        obs, *_ = await env.step(ToolCall("search", {"pattern": "INC-4100", "path": "/corpus"}))
        assert "postmortems/" in obs
        with pytest.raises(InvalidRequest, match="unknown question"):
            await env.reset(options={"question": "nope"})
    finally:
        await env.close()


async def test_a_cancelled_episode_is_stored_as_partial(fleet, tmp_path):
    store = TrajectoryStore(tmp_path / "t.db")
    env = make_async("codefix", fleet)
    gate = asyncio.Event()
    policy = scripted("codefix")
    act = policy.act

    async def slow_act(messages, tools, *, seed=None):
        if len(messages) > 4:
            gate.set()
            await asyncio.sleep(60)
        return await act(messages, tools, seed=seed)

    policy.act = slow_act
    task = asyncio.create_task(run_episode(env, policy, seed=1, store=store))
    await gate.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await env.close()
    [episode] = store.episodes(include_incomplete=True)
    assert episode.outcome == "partial" and len(episode.steps) == 2 and "cancelled" in episode.error
    assert store.episodes() == []  # never mixed with complete ones


GYM_MAKE = """
{imports}
loaded_by_fanfold = "gymnasium" in sys.modules
import gymnasium
env = gymnasium.make({env_id!r}, disable_env_checker=True)
try:
    obs, info = env.reset(seed=0)
    print(loaded_by_fanfold, type(env.unwrapped).__name__, "stats.py" in obs)
finally:
    env.close()
"""


@pytest.mark.parametrize("imports,env_id,loads_gymnasium", [
    ("import sys, fanfold", "fanfold/CodeFix-v0", False),  # registered when gymnasium loads, later
    ("import sys, gymnasium, fanfold", "fanfold/CodeFix-v0", True),
    ("import sys", "fanfold:fanfold/CodeFix-v0", False),  # gymnasium 1.x's module:id, no fanfold import
])
def test_gymnasium_make_works_after_import_fanfold_or_by_module_prefix(imports, env_id, loads_gymnasium):
    env = {**os.environ, "FANFOLD_STATE_DIR": str(STATE_DIR)}
    done = subprocess.run([sys.executable, "-c", GYM_MAKE.format(imports=imports, env_id=env_id)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout == f"{loads_gymnasium} SandboxEnv True\n", done.stderr


def test_env_lookup_by_name_and_path():
    assert env_class("codefix").__name__ == "CodeFixEnv"
    assert env_class("fanfold.rl.envs.corpus:CorpusSearchEnv").name == "corpus"
    for bad in ("nope", "fanfold.rl.core:ToolCall", "no.such.module:X"):
        with pytest.raises(InvalidRequest):
            env_class(bad)


# -- the OpenAI-compatible client against a real HTTP server -------------------------------------------

@pytest.fixture
async def model_server(aiohttp_port=0):
    """A fake of the model (never of the sandbox): tool calls with vLLM-style token ids and logprobs."""
    state = {"requests": [], "fail": 0, "tokenize": 200}

    async def complete(request):
        body = await request.json()
        state["requests"].append(body)
        if state["fail"]:
            state["fail"] -= 1
            return web.json_response({"error": "overloaded"}, status=503)
        turn = sum(m["role"] == "tool" for m in body["messages"])
        name, args = ("run_tests", {}) if turn == 0 else ("submit", {})
        return web.json_response({
            "model": "m", "choices": [{"finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": f"turn {turn}",
                "tool_calls": [{"id": f"c{turn}", "type": "function",
                                "function": {"name": name, "arguments": json.dumps(args)}}]},
                "logprobs": {"content": [{"token": "token_id:17", "logprob": -0.5},
                                         {"token": "token_id:4", "logprob": -1.25}]}}],
        }, headers={"X-Policy-Version": f"v{len(state['requests'])}"})

    async def tokenize(request):
        body = await request.json()
        if state["tokenize"] != 200:  # a server without /tokenize that answers in JSON (FastAPI does)
            return web.json_response({"detail": "Not Found"}, status=state["tokenize"])
        return web.json_response({"tokens": list(range(len(body["prompt"].split())))})

    async def models(request):
        return web.json_response({"data": [{"id": "served-model"}]})

    app = web.Application()
    app.add_routes([web.post("/v1/chat/completions", complete), web.post("/tokenize", tokenize),
                    web.get("/v1/models", models)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/v1", state
    await runner.cleanup()


async def test_openai_policy_records_tokens_logprobs_and_versions(fleet, model_server, tmp_path):
    url, state = model_server
    policy = OpenAIPolicy(url, temperature=0.5)
    env = make_async("codefix", fleet)
    try:
        [episode] = await run_episode(env, policy, seed=5, store=TrajectoryStore(tmp_path / "t.db"))
    finally:
        await env.close()
        await policy.close()
    assert [s.tool_call["name"] for s in episode.steps] == ["run_tests", "submit"]
    first = episode.steps[0]
    tool_tokens = len(first.tool_result.split())
    assert first.token_ids == [17, 4] + list(range(tool_tokens))
    assert first.loss_mask == [1, 1] + [0] * tool_tokens
    assert first.logprobs[:2] == [-0.5, -1.25]
    assert first.logprobs == [-0.5, -1.25] + [0.0] * tool_tokens
    assert [s.policy_version for s in episode.steps] == ["v1", "v2"]
    body = state["requests"][0]
    assert body["model"] == "served-model" and body["seed"] is not None and body["temperature"] == 0.5
    assert body["logprobs"] is True and body["return_tokens_as_token_ids"] is True
    assert [r["seed"] for r in state["requests"]] == [5 * 1_000_003, 5 * 1_000_003 + 101]  # one per turn
    assert {t["function"]["name"] for t in body["tools"]} == {"read_file", "edit_file", "run_tests", "submit"}
    assert state["requests"][1]["messages"][-1]["role"] == "tool"


async def test_openai_policy_without_tokenize_records_model_tokens_only(fleet, model_server):
    url, state = model_server
    state["tokenize"] = 404
    policy = OpenAIPolicy(url, model="m")
    env = make_async("codefix", fleet)
    try:
        [episode] = await run_episode(env, policy, seed=6)
    finally:
        await env.close()
        await policy.close()
    assert [s.tool_call["name"] for s in episode.steps] == ["run_tests", "submit"]
    for step in episode.steps:
        assert (step.token_ids, step.loss_mask, step.logprobs) == ([17, 4], [1, 1], [-0.5, -1.25])


async def test_openai_policy_retries_then_reports_the_server_down(model_server):
    url, state = model_server
    policy = OpenAIPolicy(url, model="m", retries=2)
    try:
        state["fail"] = 2
        reply = await policy.act([{"role": "user", "content": "hi"}], [])
        assert reply.tool_calls[0].name == "run_tests" and len(state["requests"]) == 3
        state["fail"] = 5
        with pytest.raises(PolicyUnavailable, match="failed 3 times"):
            await policy.act([{"role": "user", "content": "hi"}], [])
    finally:
        await policy.close()
    with pytest.raises(InvalidRequest):
        OpenAIPolicy("localhost:8000")


def test_default_policy_follows_fanfold_policy_url(monkeypatch):
    monkeypatch.delenv("FANFOLD_POLICY_URL", raising=False)
    assert isinstance(default_policy("corpus"), ScriptedPolicy)
    monkeypatch.setenv("FANFOLD_POLICY_URL", "http://gpu:8000/v1")
    policy = default_policy("corpus", model="m")
    assert isinstance(policy, OpenAIPolicy) and policy.url == "http://gpu:8000/v1" and policy.model == "m"
    with pytest.raises(InvalidRequest, match="no scripted policy"):
        scripted("nope")
