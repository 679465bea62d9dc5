"""Tools keyed by rollout id: ``fanfold.tools`` through the embedded engine, then the HTTP
routes against the real server and real sandboxes (create, tool calls, errors, tenancy,
idempotent retries, fork, delete, deadlines, restarts)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time

import httpx
import pytest

from conftest import TOKENS, Server, start_server, stop_server
from fanfold import AsyncFleet, InfrastructureError, SandboxGone, ToolError
from fanfold.runtime import oci_sandbox as resources
from fanfold.host import cgroups
from fanfold.models import ExecResult, Outcome
from fanfold.tools import TOOLS, function_call_output, parse_arguments, run_tool

# -- fanfold.tools, through the embedded engine ----------------------------------------------------


@pytest.fixture
async def box(config):
    async with AsyncFleet(config=config) as fleet:
        sandbox = await fleet.create(memory_mb=128, deadline=120)
        yield fleet._transport, sandbox.id


async def test_shell_reports_exit_code_output_timeouts_and_truncation(box):
    ops, sandbox_id = box
    assert await run_tool(ops, sandbox_id, "shell", {"command": "echo out; echo err >&2; exit 3"}) == \
        "exit code 3\nout\nerr\n"
    assert await run_tool(ops, sandbox_id, "shell", '{"command": "pwd", "workdir": "/tmp"}') == "exit code 0\n/tmp\n"
    missing = await run_tool(ops, sandbox_id, "shell", {"command": "pwd", "workdir": "/nowhere"})
    assert missing.startswith("exit code 1\n") and "/nowhere" in missing
    slow = await run_tool(ops, sandbox_id, "shell", {"command": "echo begun; sleep 5", "timeout": 0.3})
    assert slow == "timed out after 0.3s\nbegun\n"
    long = await run_tool(ops, sandbox_id, "shell", {"command": "yes | head -c 5000"}, max_output=100)
    assert long.endswith("[output truncated to 100 bytes]") and len(long) < 200


async def test_files_round_trip_and_missing_ones_are_the_models_error(box):
    ops, sandbox_id = box
    text = "".join(f"line {n}\n" for n in range(1, 11))
    assert await run_tool(ops, sandbox_id, "write_file", {"path": "/tmp/n.txt", "content": text}) == \
        f"wrote {len(text)} bytes to /tmp/n.txt"
    assert await run_tool(ops, sandbox_id, "read_file", {"path": "/tmp/n.txt"}) == text
    assert await run_tool(ops, sandbox_id, "read_file", {"path": "/tmp/n.txt", "start_line": 3, "end_line": 4}) == \
        "line 3\nline 4\n"
    capped = await run_tool(ops, sandbox_id, "read_file", {"path": "/tmp/n.txt"}, max_output=14)
    assert capped.startswith("line 1\nline 2\n") and "start_line=3" in capped
    await ops.write_file(sandbox_id, "/tmp/bin", b"\xff\xfeok")
    assert await run_tool(ops, sandbox_id, "read_file", {"path": "/tmp/bin"}) == "\ufffd\ufffdok"
    for args, words in [({"path": "/tmp/none"}, "no such file"), ({"path": "/tmp"}, "directory"),
                        ({"path": "../../.."}, "leaves"), ({"path": "/tmp/n.txt", "start_line": 50}, "past the end")]:
        with pytest.raises(ToolError, match=words):
            await run_tool(ops, sandbox_id, "read_file", args)


async def test_search_finds_lines_and_says_when_there_are_none(box):
    ops, sandbox_id = box
    await ops.write_file(sandbox_id, "/src/a.py", "def alpha():\n    return 1\n")
    await ops.write_file(sandbox_id, "/src/b.txt", "alpha in text\n")
    assert await run_tool(ops, sandbox_id, "search", {"pattern": "alpha", "path": "/src", "glob": "*.py"}) == \
        "/src/a.py:1:def alpha():"
    both = await run_tool(ops, sandbox_id, "search", {"pattern": "alph[a]", "path": "/src"})
    assert sorted(both.splitlines()) == ["/src/a.py:1:def alpha():", "/src/b.txt:1:alpha in text"]
    assert await run_tool(ops, sandbox_id, "search", {"pattern": "$(touch /tmp/pwned)", "path": "/src"}) == "no matches"
    assert "exit code 1" in await run_tool(ops, sandbox_id, "shell", {"command": "test -e /tmp/pwned"})
    with pytest.raises(ToolError, match="No such file"):
        await run_tool(ops, sandbox_id, "search", {"pattern": "x", "path": "/nowhere"})
    many = "".join(f"hit {n}\n" for n in range(500))
    await ops.write_file(sandbox_id, "/src/many.txt", many)
    capped = await run_tool(ops, sandbox_id, "search", {"pattern": "hit", "path": "/src/many.txt"})
    assert capped.endswith("[300 more matches not shown]") and capped.count("\n") == 200


@pytest.mark.parametrize("name,arguments,words", [
    ("rm_rf", {}, "unknown tool 'rm_rf'"),
    ("shell", "{not json", "not valid JSON"),
    ("shell", "[1]", "must be a JSON object"),
    ("shell", {}, "missing required argument 'command'"),
    ("shell", {"command": "ls", "sudo": True}, "unexpected argument 'sudo'"),
    ("shell", {"command": 1}, "'command' must be a string"),
    ("shell", {"command": "ls", "timeout": "5"}, "'timeout' must be a number"),
    ("shell", {"command": "ls", "timeout": 0}, "too small"),
    ("read_file", {"path": "x", "start_line": 1.5}, "must be a integer"),
    ("read_file", {"path": "x", "start_line": True}, "must be a integer"),
])
def test_bad_calls_are_tool_errors_that_name_the_problem(name, arguments, words):
    with pytest.raises(ToolError, match=words):
        parse_arguments(name, arguments)


def test_schemas_and_outputs_have_the_openai_shapes():
    assert parse_arguments("read_file", '{"path": "a", "start_line": 2.0}') == {"path": "a", "start_line": 2}
    assert set(TOOLS) == {"shell", "read_file", "write_file", "search"}
    chat, responses = TOOLS["shell"].chat_schema(), TOOLS["shell"].responses_schema()
    assert chat["type"] == "function" and chat["function"]["name"] == "shell"
    assert responses["name"] == "shell" and responses["parameters"]["required"] == ["command"]
    assert function_call_output("c1", "hi") == {"type": "function_call_output", "call_id": "c1", "output": "hi"}


class _Failing:
    """Ops whose every call fails as the infrastructure can: the error must reach the caller unchanged."""

    def __init__(self, err: Exception) -> None:
        self.err = err

    async def exec(self, *args, **kwargs) -> ExecResult:  # type: ignore[no-untyped-def]
        raise self.err

    read_file = write_file = exec


@pytest.mark.parametrize("err", [InfrastructureError("agent lost"), SandboxGone("destroyed")])
async def test_infrastructure_errors_are_never_the_models(err):
    for name, args in [("shell", {"command": "ls"}), ("read_file", {"path": "a"}), ("search", {"pattern": "a"})]:
        with pytest.raises(type(err)):
            await run_tool(_Failing(err), "sb-x", name, args)


async def test_oom_and_signals_are_reported_as_outcomes():
    class Ops(_Failing):
        async def exec(self, *args, **kwargs) -> ExecResult:  # type: ignore[no-untyped-def]
            return self.err  # type: ignore[return-value]

    oom = ExecResult(outcome=Outcome.OOM, exit_code=None, signal=9, stdout=b"partial")
    assert await run_tool(Ops(oom), "sb-x", "shell", {"command": "x"}) == "killed: out of memory\npartial"
    killed = ExecResult(outcome=Outcome.KILLED, exit_code=None, signal=15)
    assert await run_tool(Ops(killed), "sb-x", "shell", {"command": "x"}) == "killed by signal 15\n"


# -- over HTTP ------------------------------------------------------------------------------------


def http(server: Server, tenant: str = "alice") -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.tcp_url, headers={"Authorization": f"Bearer {TOKENS[tenant]}"}, timeout=60)


def call(name: str, call_id: str = "call_1", **arguments: object) -> dict[str, object]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": json.dumps(arguments)}


async def tool(client: httpx.AsyncClient, rollout_id: str, name: str, **arguments: object) -> str:
    response = await client.post(f"/v1/rollouts/{rollout_id}/tools/{name}", json=call(name, **arguments))
    assert response.status_code == 200, response.text
    return response.json()["output"]


@pytest.fixture(autouse=True)
async def no_rollouts_left(request):
    """Rollouts outlive servers until their deadline: whatever a test left (failing midway) goes now,
    so later tests' leak checks see only their own."""
    yield
    if "server" not in request.fixturenames:
        return
    server = request.getfixturevalue("server")
    for tenant in TOKENS:
        async with http(server, tenant) as client:
            for rollout in (await client.get("/v1/rollouts")).json():
                await client.delete(f"/v1/rollouts/{rollout['rollout_id']}")


def gone_from_host(config, sandbox_id: str) -> bool:
    """No cgroup, no sandbox directory, no PID 1 of the sandbox is left."""
    return sandbox_id not in cgroups.leftover_ids(config.cgroup_parent) and \
        not resources.paths(config, sandbox_id).root.exists()


async def test_first_call_makes_the_sandbox_and_tools_round_trip(server, config):
    async with http(server) as client:
        made = await client.post("/v1/rollouts", json={"rollout_id": "rt-basic", "limits": {"memory_mb": 128},
                                                       "labels": {"task": "t1"}})
        assert made.status_code == 201, made.text
        assert made.json()["state"] == "pending" and made.json()["sandbox_id"] is None
        assert (await client.post("/v1/rollouts", json={"rollout_id": "rt-basic", "limits": {"memory_mb": 128},
                                                        "labels": {"task": "t1"}})).status_code == 200
        assert (await client.post("/v1/rollouts", json={"rollout_id": "rt-basic"})).status_code == 409
        response = await client.post("/v1/rollouts/rt-basic/tools/shell", json=call("shell", command="echo hi"))
        assert response.json() == {"type": "function_call_output", "call_id": "call_1", "output": "exit code 0\nhi\n",
                                   "status": "completed"}
        record = (await client.get("/v1/rollouts/rt-basic")).json()
        sandbox_id = record["sandbox_id"]
        assert record["state"] == "running" and sandbox_id.startswith("sb-")
        sandbox = (await client.get(f"/v1/sandboxes/{sandbox_id}")).json()
        assert sandbox["labels"] == {"task": "t1", "rollout_id": "rt-basic"} and sandbox["limits"]["memory_mb"] == 128
        assert await tool(client, "rt-basic", "write_file", path="/work/x.py", content="print('x')\n") == \
            "wrote 11 bytes to /work/x.py"
        assert await tool(client, "rt-basic", "read_file", path="/work/x.py") == "print('x')\n"
        assert await tool(client, "rt-basic", "search", pattern="print", path="/work") == "/work/x.py:1:print('x')"
        # arguments may be an object too, and the body's name is optional
        response = await client.post("/v1/rollouts/rt-basic/tools/shell",
                                     json={"call_id": "c2", "arguments": {"command": "python3 /work/x.py"}})
        assert response.json()["output"] == "exit code 0\nx\n"
        assert "rt-basic" in [r["rollout_id"] for r in (await client.get("/v1/rollouts")).json()]
        tools = (await client.get("/v1/tools")).json()
        assert {t["name"] for t in tools["responses"]} == set(TOOLS) == \
            {t["function"]["name"] for t in tools["chat_completions"]}
        assert (await client.delete("/v1/rollouts/rt-basic")).status_code == 204
        assert (await client.delete("/v1/rollouts/rt-basic")).status_code == 404
        assert (await client.get(f"/v1/sandboxes/{sandbox_id}")).status_code == 404
    assert gone_from_host(config, sandbox_id)


async def test_model_mistakes_are_4xx_with_an_output_for_the_model(server):
    async with http(server) as client:
        await client.post("/v1/rollouts", json={"rollout_id": "rt-errors"})
        cases = [
            ("shell", {"type": "function_call", "call_id": "c", "arguments": "{oops"}, "not valid JSON"),
            ("delete_everything", call("delete_everything", call_id="c"), "unknown tool"),
            ("read_file", call("read_file", call_id="c", path="/no/such/file"), "no such file"),
            ("read_file", call("read_file", call_id="c", path="../../etc"), "leaves"),
            ("shell", call("read_file", call_id="c", path="x"), "names tool 'read_file'"),
        ]
        for name, body, words in cases:
            response = await client.post(f"/v1/rollouts/rt-errors/tools/{name}", json=body)
            assert 400 <= response.status_code < 500, response.text
            reply = response.json()
            assert reply["type"] == "function_call_output" and reply["call_id"] == "c" and words in reply["output"]
            assert reply["kind"] == "tool_error" and reply["message"] == reply["output"]
        unknown = await client.post("/v1/rollouts/rt-nobody/tools/shell", json=call("shell", command="ls"))
        assert unknown.status_code == 404 and unknown.json()["kind"] == "not_found"
        assert (await client.delete("/v1/rollouts/rt-errors")).status_code == 204


async def test_a_sandbox_destroyed_under_a_rollout_ends_it_with_410(server):
    async with http(server) as client:
        await client.post("/v1/rollouts", json={"rollout_id": "rt-killed"})
        await tool(client, "rt-killed", "shell", command="true")
        sandbox_id = (await client.get("/v1/rollouts/rt-killed")).json()["sandbox_id"]
        assert (await client.delete(f"/v1/sandboxes/{sandbox_id}")).status_code == 204
        assert (await client.get("/v1/rollouts/rt-killed")).json()["state"] == "gone"
        for path, body in [("tools/shell", call("shell", command="ls")), ("fork", {"count": 1})]:
            response = await client.post(f"/v1/rollouts/rt-killed/{path}", json=body)
            assert response.status_code == 410 and response.json()["kind"] == "sandbox_gone", response.text
        assert (await client.delete("/v1/rollouts/rt-killed")).status_code == 204


async def test_rollouts_start_from_a_snapshot_of_the_callers_own(server):
    async with http(server) as alice, http(server, "bob") as bob:
        made = (await alice.post("/v1/sandboxes", json={"memory_mb": 128, "deadline": 120})).json()
        await alice.post(f"/v1/sandboxes/{made['id']}/exec", json={"cmd": "echo golden > /tmp/state"},
                         headers={"Accept": "application/json"})
        snapshot = (await alice.post(f"/v1/sandboxes/{made['id']}/snapshot", json={"name": "rt-golden"})).json()
        await alice.delete(f"/v1/sandboxes/{made['id']}")
        try:
            made = await alice.post("/v1/rollouts", json={"rollout_id": "rt-snap", "snapshot": "rt-golden"})
            assert made.status_code == 201 and made.json()["snapshot"] == "rt-golden"
            assert await tool(alice, "rt-snap", "read_file", path="/tmp/state") == "golden\n"
            assert (await bob.post("/v1/rollouts", json={"snapshot": "rt-golden"})).status_code == 404
            assert (await alice.post("/v1/rollouts", json={"image": "img-nonexistent"})).status_code == 404
            both = await alice.post("/v1/rollouts", json={"image": "host", "snapshot": "rt-golden"})
            assert both.status_code == 422 and both.json()["kind"] == "invalid_request"
            assert (await alice.delete("/v1/rollouts/rt-snap")).status_code == 204
        finally:
            assert (await alice.delete(f"/v1/snapshots/{snapshot['id']}")).status_code == 204


async def test_another_tenants_rollout_is_a_404(server):
    async with http(server, "alice") as alice, http(server, "bob") as bob:
        assert (await alice.post("/v1/rollouts", json={"rollout_id": "rt-mine"})).status_code == 201
        assert (await bob.get("/v1/rollouts/rt-mine")).status_code == 404
        assert (await bob.post("/v1/rollouts/rt-mine/tools/shell", json=call("shell", command="ls"))).status_code == 404
        assert (await bob.delete("/v1/rollouts/rt-mine")).status_code == 404
        assert "rt-mine" not in [r["rollout_id"] for r in (await bob.get("/v1/rollouts")).json()]
        # the same id is free for bob: rollout ids are per tenant
        assert (await bob.post("/v1/rollouts", json={"rollout_id": "rt-mine"})).status_code == 201
        for client in (alice, bob):
            assert (await client.delete("/v1/rollouts/rt-mine")).status_code == 204


async def test_a_retried_call_with_the_same_request_id_runs_once(server):
    async with http(server) as client:
        await client.post("/v1/rollouts", json={"rollout_id": "rt-once"})
        append = call("shell", command="echo x >> /tmp/f; wc -l < /tmp/f")
        headers = {"X-Request-ID": "req-append-1"}
        replies = await asyncio.gather(*(client.post("/v1/rollouts/rt-once/tools/shell", json=append, headers=headers)
                                         for _ in range(3)))
        replies.append(await client.post("/v1/rollouts/rt-once/tools/shell", json=append, headers=headers))
        assert {r.json()["output"] for r in replies} == {"exit code 0\n1\n"}
        assert await tool(client, "rt-once", "read_file", path="/tmp/f") == "x\n"
        reused = await client.post("/v1/rollouts/rt-once/tools/shell", json=call("shell", command="ls"), headers=headers)
        assert reused.status_code == 422
        # two first calls at once make one sandbox
        await client.post("/v1/rollouts", json={"rollout_id": "rt-race"})
        await asyncio.gather(*(tool(client, "rt-race", "shell", command="true") for _ in range(4)))
        sandboxes = (await client.get("/v1/sandboxes", params={"label": "rollout_id=rt-race"})).json()
        assert len(sandboxes) == 1
        # a create retried without a rollout id makes one rollout
        first = await client.post("/v1/rollouts", json={}, headers={"X-Request-ID": "req-create-1"})
        again = await client.post("/v1/rollouts", json={}, headers={"X-Request-ID": "req-create-1"})
        assert first.json()["rollout_id"] == again.json()["rollout_id"]
        for rollout_id in ("rt-once", "rt-race", first.json()["rollout_id"]):
            assert (await client.delete(f"/v1/rollouts/{rollout_id}")).status_code == 204


async def test_forks_share_the_state_at_the_fork_then_diverge(server, config):
    async with http(server) as client:
        await client.post("/v1/rollouts", json={"rollout_id": "rt-tree", "deadline": 300})
        await tool(client, "rt-tree", "write_file", path="/tmp/shared", content="before\n")
        # a process holding state in memory: the children get it too
        await tool(client, "rt-tree", "shell", command="sh -c 'echo $$ > /tmp/pid; exec sleep 1000' >/dev/null 2>&1 &")
        forked = await client.post("/v1/rollouts/rt-tree/fork", json={"count": 2})
        assert forked.status_code == 200, forked.text
        children = forked.json()["rollouts"]
        assert [c["rollout_id"] for c in children] == ["rt-tree.f1", "rt-tree.f2"]
        assert forked.json()["parent_pause_ms"] > 0
        parent = (await client.get("/v1/rollouts/rt-tree")).json()
        assert all(c["deadline_at"] == parent["deadline_at"] and c["forked_from"] == "rt-tree" for c in children)
        for child in children:
            assert await tool(client, child["rollout_id"], "read_file", path="/tmp/shared") == "before\n"
            assert (await tool(client, child["rollout_id"], "shell", command="kill -0 $(cat /tmp/pid) && echo alive")
                    ).endswith("alive\n")
            sandbox = (await client.get(f"/v1/sandboxes/{child['sandbox_id']}")).json()
            assert sandbox["labels"]["rollout_id"] == child["rollout_id"]
        await tool(client, "rt-tree.f1", "write_file", path="/tmp/mine", content="f1\n")
        assert "no such file" in (await client.post("/v1/rollouts/rt-tree.f2/tools/read_file",
                                                    json=call("read_file", path="/tmp/mine"))).json()["output"]
        assert "no such file" in (await client.post("/v1/rollouts/rt-tree/tools/read_file",
                                                    json=call("read_file", path="/tmp/mine"))).json()["output"]
        # ending one rollout leaves the others running
        assert (await client.delete("/v1/rollouts/rt-tree.f1")).status_code == 204
        assert await tool(client, "rt-tree.f2", "shell", command="echo on") == "exit code 0\non\n"
        assert await tool(client, "rt-tree", "shell", command="echo on") == "exit code 0\non\n"
        named = await client.post("/v1/rollouts/rt-tree/fork", json={"count": 1, "rollout_ids": ["rt-tree.f2"]})
        assert named.status_code == 409
        sandbox_ids = [parent["sandbox_id"]] + [c["sandbox_id"] for c in children]
        for rollout_id in ("rt-tree", "rt-tree.f2"):
            assert (await client.delete(f"/v1/rollouts/{rollout_id}")).status_code == 204
    assert all(gone_from_host(config, sandbox_id) for sandbox_id in sandbox_ids)


async def test_a_rollout_is_reaped_at_its_deadline(server, config):
    async with http(server) as client:
        made = (await client.post("/v1/rollouts", json={"rollout_id": "rt-short", "deadline": 2})).json()
        await tool(client, "rt-short", "shell", command="sleep 1000 >/dev/null 2>&1 &")
        sandbox_id = (await client.get("/v1/rollouts/rt-short")).json()["sandbox_id"]
        give_up = time.monotonic() + 15
        while (await client.get("/v1/rollouts/rt-short")).json()["state"] != "expired":
            assert time.monotonic() < give_up, "the deadline passed unnoticed"
            await asyncio.sleep(0.1)
        assert time.time() >= made["deadline_at"]
        late = await client.post("/v1/rollouts/rt-short/tools/shell", json=call("shell", command="ls"))
        assert late.status_code == 410 and late.json()["kind"] == "sandbox_gone"
        while (await client.get(f"/v1/sandboxes/{sandbox_id}")).status_code != 404:
            assert time.monotonic() < give_up, "the sandbox outlived its rollout's deadline"
            await asyncio.sleep(0.1)
        assert (await client.delete("/v1/rollouts/rt-short")).status_code == 204
    assert gone_from_host(config, sandbox_id)


async def test_rollouts_and_their_sandboxes_survive_server_restarts(config, tmp_path):
    private = await asyncio.to_thread(start_server, config.state_dir, tmp_path)
    try:
        async with http(private) as client:
            await client.post("/v1/rollouts", json={"rollout_id": "rt-durable"})
            await client.post("/v1/rollouts", json={"rollout_id": "rt-later"})
            await tool(client, "rt-durable", "write_file", path="/tmp/kept", content="still here\n")
        os.kill(private.process.pid, signal.SIGKILL)
        private.process.wait()
        private = await asyncio.to_thread(start_server, config.state_dir, tmp_path)
        async with http(private) as client:
            assert await tool(client, "rt-durable", "read_file", path="/tmp/kept") == "still here\n"
            assert (await client.get("/v1/rollouts/rt-later")).json()["state"] == "pending"
        assert await asyncio.to_thread(stop_server, private) == 0
        private = await asyncio.to_thread(start_server, config.state_dir, tmp_path)
        async with http(private) as client:
            assert await tool(client, "rt-durable", "read_file", path="/tmp/kept") == "still here\n"
            assert await tool(client, "rt-later", "shell", command="echo fresh") == "exit code 0\nfresh\n"
            for rollout_id in ("rt-durable", "rt-later"):
                assert (await client.delete(f"/v1/rollouts/{rollout_id}")).status_code == 204
    finally:
        assert await asyncio.to_thread(stop_server, private) == 0


def test_the_rollout_store_adopts_what_an_older_server_kept_in_the_engines_database(tmp_path):
    from fanfold.web.rollout_store import RolloutStore

    old = sqlite3.connect(tmp_path / "fanfold.db")
    old.execute("CREATE TABLE rollouts (tenant TEXT NOT NULL, id TEXT NOT NULL, params TEXT NOT NULL, created_at REAL"
                " NOT NULL, deadline_at REAL NOT NULL, lease TEXT, sandbox_id TEXT, forked_from TEXT,"
                " PRIMARY KEY (tenant, id))")
    old.execute("INSERT INTO rollouts VALUES ('alice', 'rt-old', '{}', 1.0, 9e9, 'ls-1', 'sb-1', NULL)")
    old.commit()
    old.close()
    store = RolloutStore(tmp_path)
    try:
        row = store.get("alice", "rt-old")
        assert (row["lease"], row["sandbox_id"], row["deadline_at"]) == ("ls-1", "sb-1", 9e9)
        assert store.insert("alice", "rt-new", "{}", 9e9) and not store.insert("alice", "rt-new", "{}", 9e9)
        store.delete("alice", "rt-old")
    finally:
        store.close()
    reopened = RolloutStore(tmp_path)  # adopted once: a deleted rollout does not come back
    try:
        assert [r["id"] for r in reopened.of("alice")] == ["rt-new"]
    finally:
        reopened.close()
