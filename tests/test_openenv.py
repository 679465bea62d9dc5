"""fanfold envs as OpenEnv environment servers: OpenEnv's own ``GenericEnvClient`` against a real
``fanfold serve``, over its WebSocket protocol, with the token in the URL."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from websockets.asyncio.client import connect, unix_connect
from websockets.exceptions import ConnectionClosed

from fanfold import AsyncFleet
from fanfold.rl.core import AsyncSandboxEnv, ToolCall, ToolOutcome
from fanfold.rl.envs.corpus import generate
from fanfold.tools import Tool

FIX = {"path": "stats.py", "old": "// len(values)", "new": "/ len(values)"}


class EchoEnv(AsyncSandboxEnv):
    """Echoes text through the sandbox's shell: a custom env, served by its module path."""

    name = "echo"
    tools = (Tool("echo", "Echo the text.", {"type": "object", "properties": {"text": {"type": "string"}},
                                             "required": ["text"], "additionalProperties": False}),)

    @classmethod
    async def prepare(cls, fleet: Any) -> Any:
        return "host"

    async def begin(self, options: dict[str, Any]) -> str:
        self.task = {"id": "echo"}
        return "Say something."

    async def call(self, tool: ToolCall) -> ToolOutcome:
        result = await self.sandbox.exec(["echo", tool.arguments["text"]])
        return ToolOutcome(result.text.strip(), reward=1.0, done=True)


def client(base_url: str) -> Any:
    """OpenEnv's ``GenericEnvClient`` (imported here: the server imports this module for ``EchoEnv``,
    and importing OpenEnv's client costs ~10 s, gradio included)."""
    from openenv.core.generic_client import GenericEnvClient

    return GenericEnvClient(base_url=base_url)


def env_url(server, env: str, token: str | None = None) -> str:
    """The base URL OpenEnv's clients take: the token rides as the URL's password."""
    address = urlsplit(server.tcp_url).netloc
    return f"http://fanfold:{token or server.tokens['alice']}@{address}/openenv/{env}"


def ws_url(server, env: str) -> str:
    return server.tcp_url.replace("http://", "ws://", 1) + f"/openenv/{env}/ws"


@pytest.fixture
async def alice(server):
    async with AsyncFleet(server.tcp_url, token=server.tokens["alice"]) as fleet:
        yield fleet


async def gone(fleet: AsyncFleet, sandbox_id: str, within: float = 30.0) -> bool:
    """Whether the sandbox is destroyed within ``within`` seconds (the server ends it after the socket)."""
    deadline = time.monotonic() + within
    while sandbox_id in {info.id for info in await fleet.list()}:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_a_codefix_episode_runs_to_its_reward_and_its_sandbox_ends_with_the_session(server, alice):
    async with client(env_url(server, "codefix")) as env:
        first = await env.reset(seed=0, episode_id="ep-1")
        assert first.reward is None and not first.done and "stats.py" in first.observation["text"]
        assert {t["function"]["name"] for t in first.observation["tools"]} == {"read_file", "edit_file", "run_tests",
                                                                               "submit"}
        tests = await env.step({"name": "run_tests", "arguments": {}})
        assert "FAILED (failures=5)" in tests.observation["text"] and tests.reward == 0 and not tests.done
        misuse = await env.step({"name": "rm_rf", "arguments": {}})  # the model's mistake: an observation
        assert misuse.observation["info"]["error"] and "unknown tool" in misuse.observation["text"]
        edit = await env.step({"type": "call_tool", "tool_name": "edit_file", "arguments": FIX})  # OpenEnv's shape
        assert edit.observation["text"].startswith("edited stats.py")
        submit = await env.step({"type": "function_call", "call_id": "call_1", "name": "submit", "arguments": "{}"})
        assert (submit.observation["text"], submit.reward, submit.done) == ("submitted: 4 of 8 tests pass", 0.5, True)
        assert submit.observation["info"] == {"tool": "submit", "error": False, "step": 4, "terminated": True,
                                              "truncated": False}
        state = await env.state()
        assert {k: state[k] for k in ("episode_id", "step_count", "env", "task", "done", "total_reward")} == {
            "episode_id": "ep-1", "step_count": 4, "env": "codefix", "task": "codefix/stats", "done": True,
            "total_reward": 0.5}
        with pytest.raises(RuntimeError, match="reset first.*EXECUTION_ERROR"):
            await env.step({"name": "submit"})
        sandbox_id = state["sandbox_id"]
        assert sandbox_id in {info.id for info in await alice.list()}  # the caller's tenant owns it
    assert await gone(alice, sandbox_id)


async def test_a_malformed_action_is_the_servers_validation_error_and_the_session_goes_on(server, alice):
    async with client(env_url(server, "codefix")) as env:
        with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
            await env.step({"command": "ls"})
        await env.reset()
        with pytest.raises(RuntimeError, match="names its tool.*VALIDATION_ERROR"):
            await env.step({"arguments": {}})
        assert (await env.state())["step_count"] == 0  # no step was taken
        sandbox_id = (await env.state())["sandbox_id"]
    assert await gone(alice, sandbox_id)


async def test_corpus_resets_with_options_and_steps(server):
    question = generate()[1][0]
    async with client(env_url(server, "corpus")) as env:
        first = await env.reset(question=question.id)  # what is not seed or episode_id goes to options
        assert question.text in first.observation["text"]
        found = await env.step({"name": "search", "arguments": {"pattern": "INC-4100", "path": "/corpus"}})
        assert "postmortems/" in found.observation["text"] and not found.done
        answer = await env.step({"name": "submit", "arguments": {"paths": list(question.answer)}})
        assert answer.reward == 1.0 and answer.done


async def test_a_socket_dropped_idle_or_mid_step_ends_its_sandbox(server, alice):
    for mid_step in (False, True):
        env = client(env_url(server, "corpus"))
        await env.reset()
        sandbox_id = (await env.state())["sandbox_id"]
        if mid_step:  # a step that would run 25 s is cancelled, not waited for
            await env._send({"type": "step", "data": {"name": "shell", "arguments": {"command": "sleep 25"}}})
        env._ws.transport.abort()  # no close message, no closing handshake
        assert await gone(alice, sandbox_id, within=10), f"{sandbox_id} outlived its socket (mid_step={mid_step})"


async def test_a_bad_token_is_refused(server):
    with pytest.raises(RuntimeError, match="UNAUTHORIZED"):
        async with client(env_url(server, "codefix", token="not-a-token-of-this-server")) as env:
            await env.reset()
    async with connect(ws_url(server, "codefix"), additional_headers={"Authorization": "Bearer nope-0123456789abcdef"}) as ws:
        await ws.send(json.dumps({"type": "reset", "data": {}}))
        assert json.loads(await ws.recv())["data"]["code"] == "UNAUTHORIZED"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd.code == 1008  # policy violation
    async with httpx.AsyncClient() as http:
        for url in (env_url(server, "codefix", token="not-a-token-of-this-server") + "/health",
                    f"{server.tcp_url}/openenv/codefix/health"):
            assert (await http.get(url)).status_code == 401


async def test_a_bearer_header_works_too_and_bad_frames_get_openenvs_codes(server):
    headers = {"Authorization": f"Bearer {server.tokens['alice']}"}
    async with connect(ws_url(server, "codefix"), additional_headers=headers) as ws:
        for frame, code in (("{not json", "INVALID_JSON"), (json.dumps({"type": "mcp"}), "UNKNOWN_TYPE"),
                            (json.dumps({"type": "reset", "data": {"seed": -1}}), "VALIDATION_ERROR")):
            await ws.send(frame)
            assert json.loads(await ws.recv())["data"]["code"] == code
        await ws.send(json.dumps({"type": "state"}))
        state = json.loads(await ws.recv())
        assert state["type"] == "state" and state["data"]["step_count"] == 0 and state["data"]["sandbox_id"] is None


async def test_the_http_companions(server):
    base = env_url(server, "codefix")
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{base}/health")).json() == {"status": "healthy"}
        schema = (await http.get(f"{base}/schema")).json()
        assert set(schema["action"]["properties"]["name"]["enum"]) == {"read_file", "edit_file", "run_tests", "submit"}
        assert set(schema) == {"action", "observation", "state"}
        metadata = (await http.get(f"{base}/metadata")).json()
        assert metadata["name"] == "codefix" and len(metadata["tools"]) == 4
        stateless = await http.post(f"{base}/reset", json={})
        assert stateless.status_code == 501 and "/openenv/codefix/ws" in stateless.json()["message"]
        assert (await http.get(env_url(server, "nope") + "/schema")).status_code == 404
        # A module path imports code into the server: the host's own tenant only.
        assert (await http.get(env_url(server, "tests.test_openenv:EchoEnv") + "/schema")).status_code == 401


async def test_a_custom_env_by_module_path_for_the_hosts_own_tenant(server, alice):
    with pytest.raises(RuntimeError, match="UNAUTHORIZED"):
        async with client(env_url(server, "tests.test_openenv:EchoEnv")) as env:
            await env.reset()
    # The unix socket needs no token; OpenEnv's client speaks over a connection made for it.
    env = client("http://localhost/openenv/tests.test_openenv:EchoEnv")
    env._ws = await unix_connect(server.unix_url.removeprefix("unix://"),
                                 "ws://localhost/openenv/tests.test_openenv:EchoEnv/ws")
    try:
        assert (await env.reset()).observation["text"] == "Say something."
        said = await env.step({"name": "echo", "arguments": {"text": "hello"}})
        assert (said.observation["text"], said.reward, said.done) == ("hello", 1.0, True)
    finally:
        await env.close()
