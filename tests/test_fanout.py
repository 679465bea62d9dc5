"""fleet.map and fleet.queue against real sandboxes: results as they finish, infrastructure
errors retried and counted apart, deadlines, early exit, the sync twin."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from fanfold import AsyncFleet, Fleet
from fanfold.errors import InfrastructureError, InvalidRequest

from conftest import leaks


@pytest.fixture
async def embedded(config):
    async with AsyncFleet(config=config) as fleet:
        yield fleet


async def test_map_runs_concurrently_and_yields_as_finished(embedded):
    running, peak, created = 0, 0, 0
    first_four_created = asyncio.Event()

    async def rollout(item):
        nonlocal running, peak, created
        running += 1
        peak = max(peak, running)
        try:
            async with await embedded.create(labels={"rollout_id": f"map-{item}"}) as sandbox:
                created += 1
                if created == 4:
                    first_four_created.set()
                if item < 4:  # the first four sleep from the same instant, however long each create took
                    await first_four_created.wait()
                result = await sandbox.exec(f"sleep {0.15 * (4 - item % 4)}; echo {item}")
                return int(result.text)
        finally:
            running -= 1

    rollouts = embedded.map(rollout, range(8), concurrency=4, progress=False)
    results = [r async for r in rollouts]
    assert sorted(r.value for r in results) == list(range(8))
    assert all(r.ok and r.attempts == 1 and r.value == r.item for r in results)
    assert peak == 4
    # The first four start together: the shortest (item 3, 0.15 s, the next 0.3 s) finishes first.
    assert results[0].item == 3
    assert rollouts.stats.as_dict() | {} == {"submitted": 8, "done": 8, "in_flight": 0, "ok": 8, "failed": 0,
                                            "timeout": 0, "infra_error": 0, "infra_retries": 0}


async def test_infrastructure_errors_are_retried_and_counted_apart(embedded):
    attempts: dict[int, int] = {}

    async def rollout(item):
        attempts[item] = attempts.get(item, 0) + 1
        if item == 0 and attempts[item] == 1:
            raise InfrastructureError("the agent died")  # once: the retry succeeds
        if item == 1:
            raise InfrastructureError("always")
        if item == 2:
            raise ValueError("the rollout's own bug")
        async with await embedded.create() as sandbox:
            return (await sandbox.exec("echo fine")).text.strip()

    rollouts = embedded.map(rollout, range(4), retries=2, backoff=0.01, progress=False)
    results = {r.item: r async for r in rollouts}
    assert (results[0].status, results[0].attempts, results[0].infra_errors, results[0].value) == ("ok", 2, 1, "fine")
    assert (results[1].status, results[1].attempts, results[1].infra_errors) == ("infra_error", 3, 3)
    assert isinstance(results[1].error, InfrastructureError) and results[1].value is None
    assert (results[2].status, results[2].attempts) == ("failed", 1)  # never retried
    assert isinstance(results[2].error, ValueError)
    assert results[3].ok
    stats = rollouts.stats
    assert (stats.ok, stats.failed, stats.infra_error, stats.infra_retries) == (2, 1, 1, 3)


async def test_a_rollout_past_its_deadline_is_cancelled_and_its_sandbox_killed(embedded, config):
    made: list[str] = []

    async def rollout(item):
        async with await embedded.create() as sandbox:
            made.append(sandbox.id)
            await sandbox.exec("sleep 30")

    [result] = [r async for r in embedded.map(rollout, [0], deadline=1.0, progress=False)]
    assert result.status == "timeout" and result.attempts == 1 and 0.9 < result.duration_s < 10
    assert made and made[0] not in {s.id for s in await embedded.list()}
    assert leaks(config)["containers"] == len(await embedded.list())


async def test_leaving_the_loop_early_cancels_the_rest(embedded):
    started = []

    async def rollout(item):
        started.append(item)
        async with await embedded.create() as sandbox:
            await sandbox.exec("sleep 0.2" if item == 0 else "sleep 30")
        return item

    async with embedded.map(rollout, range(6), concurrency=3, progress=False) as rollouts:
        async for result in rollouts:
            assert result.item == 0
            break
    assert rollouts.stats.in_flight == 0 and len(started) <= 4
    assert await embedded.list() == []


async def test_queue_streams_results_of_items_put_over_time(embedded):
    async def rollout(item):
        async with await embedded.create() as sandbox:
            return (await sandbox.exec(f"expr {item} \\* 10")).text.strip()

    queue = embedded.queue(rollout, concurrency=2, progress=False)
    seen = []

    async def consume():
        async for result in queue:
            seen.append((result.index, result.value))

    consumer = asyncio.create_task(consume())
    for step in range(3):  # three "training steps", each adding a batch
        for i in range(2):
            await queue.put(step * 2 + i)
    await queue.close()
    await asyncio.wait_for(consumer, 60)
    assert sorted(seen) == [(i, str(i * 10)) for i in range(6)]
    with pytest.raises(InvalidRequest, match="closed"):
        await queue.put(99)


@pytest.mark.parametrize("kwargs", [{"concurrency": 0}, {"retries": -1}, {"deadline": 0}, {"concurrency": "8"}])
async def test_bad_arguments_are_refused(embedded, kwargs):
    with pytest.raises(InvalidRequest):
        embedded.map(lambda item: item, [1], **kwargs)


def test_sync_twin_runs_plain_and_async_functions(config):
    with Fleet(config=config) as fleet:
        def plain(item):
            with fleet.create() as sandbox:
                return sandbox.exec(f"echo {item}").text.strip()

        async def coroutine(item):
            return item * 2

        plain_results = list(fleet.map(plain, ["a", "b", "c"], concurrency=3, progress=False))
        assert sorted(r.value for r in plain_results) == ["a", "b", "c"]
        assert sorted(r.value for r in fleet.map(coroutine, [1, 2], progress=False)) == [2, 4]

        queue = fleet.queue(plain, concurrency=2, progress=False)
        queue.put("x")
        queue.put("y")
        queue.close()
        results = list(queue)
        assert sorted(r.value for r in results) == ["x", "y"] and queue.stats.ok == 2
        assert fleet.list() == []


SYNC_MAP_INTERRUPTED = """
import sys
from fanfold import Fleet

def rollout(i):
    with fleet.create("host", labels={"test": "map-sigint"}) as sandbox:
        sys.stdout.write(f"ready {sandbox.id}\\n")  # one write: print's two could interleave across threads
        sys.stdout.flush()
        return sandbox.exec(["sleep", "60"]).outcome

with Fleet() as fleet:
    for result in fleet.map(rollout, range(2), concurrency=2, progress=False):
        print("result", result, flush=True)
"""


def test_ctrl_c_in_sync_map_raises_keyboard_interrupt_alone_and_cleans_up(config, tmp_path):
    script = tmp_path / "interrupted_map.py"
    script.write_text(SYNC_MAP_INTERRUPTED)
    env = {**os.environ, "FANFOLD_STATE_DIR": str(config.state_dir), "PYTHONFAULTHANDLER": "1"}  # a crash says where
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = [process.stdout.readline() for _ in range(2)]  # both rollouts are in their sandboxes
        ids = [line.split()[1] for line in lines if line.startswith("ready ")]
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:  # a failed test still lets the script clean up its sandboxes
            process.send_signal(signal.SIGINT)
            process.communicate(timeout=60)
    assert len(ids) == 2, (lines, err)
    assert process.returncode == -signal.SIGINT, err
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    assert "RuntimeError" not in err and "During handling" not in err, err
    assert "result" not in out
    with Fleet(config=config) as fleet:
        alive = {info.id for info in fleet.list(labels={"test": "map-sigint"})}
    assert not alive & set(ids)
