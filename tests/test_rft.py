"""Agent RFT's tool and grader endpoints against the real server: the JSON its docs show, replayed
(one sandbox per trace_id, isolation, model-visible 4xx, retries, the codefix grader)."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest

from conftest import TOKENS
from fanfold.rl.envs.scripts import CODEFIX_FIXES


@pytest.fixture
async def http(server):
    headers = {"Authorization": f"Bearer {TOKENS['alice']}"}
    async with httpx.AsyncClient(base_url=server.tcp_url, headers=headers, timeout=120) as client:
        yield client


@pytest.fixture
async def traces(http):
    """New trace ids; their rollouts are deleted at the end (a graded one is gone already)."""
    made: list[str] = []

    def new() -> str:
        made.append(f"trace_{uuid.uuid4()}")
        return made[-1]

    yield new
    for trace_id in made:
        assert (await http.delete(f"/v1/rollouts/{trace_id}")).status_code in (204, 404)


def call(trace_id: str, name: str, arguments: object, call_id: str | None = None, **item: object) -> dict:
    """A tool call as Agent RFT posts it."""
    number = uuid.uuid4().hex[:8]
    return {"type": "function_call", "id": f"fc_{number}", "call_id": call_id or f"call_{number}", "name": name,
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
            "trace_id": trace_id, "item": {"question": "fix it", **item}}


async def tool(http: httpx.AsyncClient, body: dict, url: str | None = None, **kw: object) -> httpx.Response:
    return await http.post(url or f"/v1/rft/tools/{body['name']}", json=body, **kw)


async def test_calls_of_one_trace_share_a_sandbox_and_traces_are_isolated(http, traces):
    first, second = traces(), traces()
    body = call(first, "write_file", {"path": "/tmp/note", "content": "hello"})
    wrote = await tool(http, body)
    assert wrote.status_code == 200, wrote.text
    assert wrote.json() == {"type": "function_call_output", "call_id": body["call_id"], "id": body["id"],
                            "output": "wrote 5 bytes to /tmp/note", "status": "completed"}
    read = await tool(http, call(first, "read_file", {"path": "/tmp/note"}))
    assert read.json()["output"] == "hello"
    # One URL for every tool dispatches on the body's name.
    shell = await tool(http, call(first, "shell", {"command": "cat /tmp/note"}), "/v1/rft/tools")
    assert shell.json()["output"] == "exit code 0\nhello"
    rollout = (await http.get(f"/v1/rollouts/{first}")).json()
    assert rollout["image"] == "host" and rollout["state"] == "running"

    other = await tool(http, call(second, "read_file", {"path": "/tmp/note"}))
    assert other.status_code == 422 and "no such file" in other.json()["message"].lower()
    assert (await http.get(f"/v1/rollouts/{second}")).json()["sandbox_id"] != rollout["sandbox_id"]


async def test_concurrent_first_calls_of_a_trace_make_one_sandbox(http, traces):
    trace_id = traces()
    replies = await asyncio.gather(*(
        tool(http, call(trace_id, "write_file", {"path": f"/tmp/f{n}", "content": "x"})) for n in range(4)))
    assert [reply.status_code for reply in replies] == [200] * 4
    listed = await tool(http, call(trace_id, "shell", {"command": "cd /tmp && ls f*"}))
    assert listed.json()["output"].split() == ["exit", "code", "0", "f0", "f1", "f2", "f3"]
    made = (await http.get("/v1/sandboxes", params={"label": f"rollout_id={trace_id}"})).json()
    assert len(made) == 1


async def test_the_models_mistakes_are_4xx_without_output(http, traces, server):
    trace_id = traces()
    cases = [
        (call(trace_id, "shell", "{not json"), None, "not valid JSON"),
        (call(trace_id, "shell", {"cmd": "ls"}), None, "unexpected argument 'cmd'"),
        (call(trace_id, "rm_rf", {}), None, "unknown tool 'rm_rf'"),
        (call(trace_id, "read_file", {"path": "/nowhere"}), None, "no such file"),
        (call(trace_id, "shell", {"command": "ls"}), "/v1/rft/tools/search", "names tool 'shell'"),
        ({**call(trace_id, "shell", {}), "name": None}, "/v1/rft/tools", "names no tool"),
    ]
    for body, url, words in cases:
        reply = await tool(http, body, url)
        assert reply.status_code == 422, reply.text
        assert set(reply.json()) == {"kind", "message"} and words.lower() in reply.json()["message"].lower()
    async with httpx.AsyncClient(base_url=server.tcp_url, timeout=60) as anonymous:
        refused = await anonymous.post("/v1/rft/tools/shell", json=call(trace_id, "shell", {"command": "ls"}),
                                       headers={"Authorization": "Bearer not-a-fanfold-token"})
    assert refused.status_code == 401
    assert (await tool(http, {**call(trace_id, "shell", {}), "trace_id": "../x"})).status_code == 422


async def test_a_retried_call_runs_once(http, traces):
    trace_id = traces()
    append = call(trace_id, "shell", {"command": "echo run >> /tmp/log"})
    assert (await tool(http, append)).status_code == 200
    assert (await tool(http, append)).status_code == 200  # Agent RFT resends the same call id
    again = {**append, "call_id": "call_other"}
    headers = {"X-Request-ID": f"req-{trace_id}"}
    assert (await tool(http, again, headers=headers)).status_code == 200
    assert (await tool(http, again, headers=headers)).json()["call_id"] == "call_other"
    log = await tool(http, call(trace_id, "read_file", {"path": "/tmp/log"}))
    assert log.json()["output"] == "run\nrun\n"


async def test_a_rollout_whose_sandbox_is_gone_answers_410_and_cannot_be_graded(http, traces):
    trace_id = traces()
    made = await tool(http, call(trace_id, "shell", {"command": "true"}), "/v1/rft/tools/shell?env=codefix")
    assert made.status_code == 200
    sandbox_id = (await http.get(f"/v1/rollouts/{trace_id}")).json()["sandbox_id"]
    assert (await http.delete(f"/v1/sandboxes/{sandbox_id}")).status_code == 204
    gone = await tool(http, call(trace_id, "shell", {"command": "true"}))
    assert gone.status_code == 410 and gone.json()["kind"] == "sandbox_gone"
    graded = await http.post("/v1/rft/grade/codefix", json={"sample": {}, "item": {}, "trace_id": trace_id})
    assert graded.status_code == 410  # Agent RFT discards the rollout rather than train on a made-up score


async def test_the_grader_scores_codefix_by_its_tests_and_ends_the_rollout(http, traces):
    solved, untouched = traces(), traces()
    url = "/v1/rft/tools/{}?env=codefix"
    source = (await tool(http, call(solved, "read_file", {"path": "stats.py"}), url.format("read_file"))).json()
    fixed = source["output"]
    for _, old, right, _ in CODEFIX_FIXES:
        fixed = fixed.replace(old, right)
    wrote = await tool(http, call(solved, "write_file", {"path": "stats.py", "content": fixed}), url.format("write_file"))
    assert wrote.status_code == 200, wrote.text
    sandbox_id = (await http.get(f"/v1/rollouts/{solved}")).json()["sandbox_id"]

    grade = {"sample": {"output_text": "Fixed."}, "item": {"question": "fix it"}, "trace_id": solved}
    scored = await http.post("/v1/rft/grade/codefix", json=grade)
    assert scored.status_code == 200 and scored.json() == {"score": 1.0}, scored.text
    assert (await http.get(f"/v1/rollouts/{solved}")).status_code == 404
    assert (await http.get(f"/v1/sandboxes/{sandbox_id}")).status_code == 404
    assert (await http.post("/v1/rft/grade/codefix", json=grade)).json() == {"score": 1.0}  # a retry: replayed

    # A model that called no tool leaves the project as it was: some of its tests fail.
    score = (await http.post("/v1/rft/grade/codefix", json={**grade, "trace_id": untouched})).json()["score"]
    assert 0 < score < 1
    assert (await http.get(f"/v1/rollouts/{untouched}")).status_code == 404


async def test_the_grader_refuses_what_it_cannot_score(http, traces):
    host_trace = traces()
    assert (await tool(http, call(host_trace, "shell", {"command": "true"}))).status_code == 200
    grade = {"sample": {}, "item": {}, "trace_id": host_trace}
    mismatched = await http.post("/v1/rft/grade/codefix", json=grade)
    assert mismatched.status_code == 422 and "?env=codefix" in mismatched.json()["message"]
    assert (await http.post("/v1/rft/grade/nosuchenv", json=grade)).status_code == 404
    assert (await http.post("/v1/rft/grade/corpus", json=grade)).status_code == 422
    assert (await http.post("/v1/rft/grade/rl.x:Y", json=grade)).status_code == 404
    assert (await http.get(f"/v1/rollouts/{host_trace}")).json()["state"] == "running"  # untouched by a refusal


async def test_the_item_or_else_the_url_names_the_image(http, traces):
    missing = await tool(http, call(traces(), "shell", {"command": "true"}, image="no-such-image-anywhere"))
    assert missing.status_code == 404 and missing.json()["kind"] == "image_not_found"
    by_url = await tool(http, call(traces(), "shell", {"command": "true"}), "/v1/rft/tools/shell?image=no-such-image")
    assert by_url.status_code == 404
    item_wins = traces()
    made = await tool(http, call(item_wins, "shell", {"command": "true"}, image="host"),
                      "/v1/rft/tools/shell?image=no-such-image")
    assert made.status_code == 200 and (await http.get(f"/v1/rollouts/{item_wins}")).json()["image"] == "host"
    assert (await tool(http, call(traces(), "shell", {}, image=7))).status_code == 422


async def test_a_submission_that_fakes_or_crashes_the_grader_scores_zero_not_a_retry(http, traces):
    url = "/v1/rft/tools/write_file?env=codefix"
    forged = '{"passed": 8, "total": 8}'
    attacks = {
        "atexit": f"import atexit\natexit.register(print, {forged!r})\n",
        "os._exit": f"import os\nprint({forged!r}, flush=True)\nos._exit(0)\n",
        "crash": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    }
    for name, source in attacks.items():
        trace_id = traces()
        wrote = await tool(http, call(trace_id, "write_file", {"path": "stats.py", "content": source}), url)
        assert wrote.status_code == 200, wrote.text
        scored = await http.post("/v1/rft/grade/codefix", json={"sample": {}, "item": {}, "trace_id": trace_id})
        assert scored.status_code == 200 and scored.json() == {"score": 0.0}, (name, scored.text)
