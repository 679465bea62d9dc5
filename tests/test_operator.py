"""The operator's view over real HTTP: /metrics, /v1/stats, fanfold top, pool and pools."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import run_cli
from fanfold import AsyncFleet


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_prometheus_metrics_need_a_token_and_count_the_work(server):
    headers = {"Authorization": f"Bearer {server.tokens['bob']}"}
    async with httpx.AsyncClient(base_url=server.tcp_url) as client:
        before = _samples((await client.get("/metrics", headers=headers)).text)
    async with AsyncFleet(server.tcp_url, token=server.tokens["alice"]) as fleet:
        sandbox = await fleet.create()
        await sandbox.exec("true")
        await sandbox.exec("sleep 5", timeout=0.2)
    async with httpx.AsyncClient(base_url=server.tcp_url) as client:
        assert (await client.get("/metrics")).status_code == 401
        headers = {"Authorization": f"Bearer {server.tokens['bob']}"}
        for path in ("/metrics", "/v1/metrics"):
            reply = await client.get(path, headers=headers)
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
            text = reply.text
            for name in ("fanfold_provision_seconds_bucket", "fanfold_exec_seconds_count", 'fanfold_sandboxes{state="running"}',
                         "fanfold_queue_depth", "fanfold_leases_reaped_total", 'fanfold_execs_total{outcome="timeout"}'):
                assert name in text, name
            after = _samples(text)
            grew = {key: after[key] - before.get(key, 0.0) for key in after}
            assert grew[("fanfold_exec_seconds_count", ())] >= 2
            assert grew[("fanfold_execs_total", (("outcome", "timeout"),))] >= 1


async def test_stats_show_only_the_callers_sandboxes_with_host_figures(server):
    async with AsyncFleet(server.tcp_url, token=server.tokens["alice"]) as alice, \
            AsyncFleet(server.tcp_url, token=server.tokens["bob"]) as bob:
        mine = await alice.create(labels={"rollout_id": "r-7"})
        theirs = await bob.create()
        await mine.exec("true")
        stats = await alice.metrics()
        ids = {item["id"] for item in stats["sandboxes"]}
        assert mine.id in ids and theirs.id not in ids
        row = next(item for item in stats["sandboxes"] if item["id"] == mine.id)
        assert row["rollout_id"] == "r-7" and row["memory_bytes"] > 0
        assert stats["exec_ms"]["p50"] is not None and stats["queue"]["max_creating"] >= 1
        assert stats["host"]["memory_available_mb"] > 0 and stats["host"]["leases"] >= 2


async def test_top_prints_a_frame_of_the_server(server):
    async with AsyncFleet(server.unix_url) as fleet:
        sandbox = await fleet.create(labels={"rollout_id": "r-top"})
        await sandbox.exec("true")
        done = await asyncio.to_thread(run_cli, "top", "--once", env={"FANFOLD_URL": server.unix_url, "COLUMNS": "160"})
    assert done.returncode == 0, done.stderr
    for word in ("create", "exec", "running", "infra errors", sandbox.id, "r-top"):
        assert word in done.stdout, (word, done.stdout)


def test_top_and_pool_refuse_without_a_server():
    for args in (["pool", "--size", "2"], ["pools"]):
        done = run_cli(*args, env={"FANFOLD_URL": ""})
        assert done.returncode == 2 and "FANFOLD_URL" in done.stderr, done.stderr


@pytest.mark.parametrize("size", ["2", "auto"])
def test_pool_cli_against_a_server(server, size):
    env = {"FANFOLD_URL": server.unix_url}
    done = run_cli("pool", "host", "--size", size, "--memory-mb", "96", *(["--wait", "60"] if size != "auto" else []), env=env)
    assert done.returncode == 0, done.stderr
    assert "ready=" in done.stdout and ("size=auto" in done.stdout if size == "auto" else "ready=2/2" in done.stdout)
    listed = run_cli("pools", env=env)
    assert listed.returncode == 0 and "handouts=" in listed.stdout
    assert run_cli("pool", "host", "--size", "0", "--memory-mb", "96", env=env).returncode == 0
