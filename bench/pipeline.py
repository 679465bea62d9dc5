"""Pipelining benchmark: does the fleet keep a policy server busy while tools run?

    python bench/pipeline.py [--episodes 512] [--levels 1,8,64,256,1024] [--episodes-at-1 32] [--workers N] [--json]

A simulated policy server (its own process, OpenAI-compatible chat completions) answers one
request at a time, spending 3 ms on each; every answer is a tool call whose latency is drawn
from 300-500 ms and which runs as ``sleep`` in a real sandbox. Episodes are 6 steps, played by
``run_episode`` through ``OpenAIPolicy`` over HTTP, fanned out by ``fleet.map`` with N in
flight, each in a fresh sandbox (a warm pool of N, refilled as it is used; ``--pool``),
trajectories stored in SQLite.

For each N: the server's busy fraction (its time spent answering over the wall time), the
episodes per second, the ideal busy fraction of an overhead-free fleet, min(1, N x 3 / (3 + 400)),
and the CPU per episode (one create, six execs, one destroy) of the busiest engine process and of
them all (``busiest_process_cpu_ms_per_cycle``, ``total_cpu_ms_per_cycle``: common.cpu_per_cycle;
the policy server is not counted). A level runs 512 episodes, or twice N where that is more, so
every level reaches N in flight (1,024 in flight: 2,048 episodes, 3 minutes or more on 2 cores);
``--episodes`` sets one count for every level. N=1 is sequential, so by default it runs fewer
episodes (``--episodes-at-1``); ``--full`` runs it like the others. The last line is JSON, with
``busy_fraction_at_256`` and ``busy_fraction_at_1024`` where those levels ran.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fanfold import AsyncFleet, EnvSpec  # noqa: E402
from fanfold.rl import AsyncSandboxEnv, OpenAIPolicy, Tool, ToolOutcome, TrajectoryStore, run_episode  # noqa: E402
from common import add_workers_option, cpu_per_cycle, cpu_snapshot, engine_config, leaked, pct  # noqa: E402

POLICY_MS = 3.0
TOOL_S = (0.3, 0.5)
STEPS = 6
GOALS = {"busy_fraction_at_256": 0.85, "busy_fraction_at_1024": 0.9, "speedup_64_vs_1": 50, "busy_vs_ideal_min": 0.9}
DEFAULT_EPISODES = 512


# -- the simulated policy server (its own process) ------------------------------------------------

def serve_policy(port: int, ready: Any) -> None:
    """Chat completions, one at a time, 3 ms each: the answer is a ``work`` call of 300-500 ms."""
    from aiohttp import web

    rng = random.Random(0)
    busy = {"seconds": 0.0, "requests": 0}

    async def complete(request: web.Request) -> web.Response:
        body = await request.json()
        started = time.perf_counter()
        time.sleep(POLICY_MS / 1000)  # holds the loop: exactly one request at a time
        seconds = round(rng.uniform(*TOOL_S), 3)
        busy["seconds"] += time.perf_counter() - started
        busy["requests"] += 1
        call = {"id": f"call_{busy['requests']}", "type": "function",
                "function": {"name": "work", "arguments": json.dumps({"seconds": seconds})}}
        return web.json_response({
            "id": "sim", "object": "chat.completion", "model": body.get("model", "sim"),
            "choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": "", "tool_calls": [call]}}],
        })

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "sim"}]})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(busy)

    app = web.Application()
    app.add_routes([web.post("/v1/chat/completions", complete), web.get("/v1/models", models),
                    web.get("/stats", stats)])
    ready.set()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# -- the env: each step a tool that takes what the policy asked for ---------------------------------

class WorkEnv(AsyncSandboxEnv):
    """Six steps of ``work``: each runs ``sleep SECONDS`` in the sandbox."""

    name = "work"
    tools = (Tool("work", "Work for a while.", {"type": "object", "properties": {"seconds": {"type": "number"}},
                                                   "required": ["seconds"]}),)
    max_steps = STEPS + 1
    tool_seconds: list[float] = []

    @classmethod
    def env_spec(cls) -> EnvSpec:
        return EnvSpec("host").workdir("/work")

    async def begin(self, options: dict[str, Any]) -> str:
        return "Work six times."

    async def call(self, tool: Any) -> ToolOutcome:
        started = time.perf_counter()
        result = await self.sandbox.exec(["sleep", f"{float(tool.arguments['seconds']):.3f}"], timeout=10)
        WorkEnv.tool_seconds.append(time.perf_counter() - started)
        done = self.steps >= STEPS
        return ToolOutcome(result.outcome.value, reward=1.0 if done else 0.0, done=done)


# -- one level ----------------------------------------------------------------------------------------

async def level(fleet: AsyncFleet, image: Any, url: str, in_flight: int, episodes: int, db: Path,
                pool: str) -> dict[str, Any]:
    pool_size = in_flight if pool == "in-flight" else 0
    fill_started = time.perf_counter()
    if pool_size:
        await fleet.pool(image, size=pool_size, memory_mb=64, pids=32, wait=600)
    fill_s = time.perf_counter() - fill_started
    policy = OpenAIPolicy(url, model="sim", logprobs=False, max_in_flight=in_flight)
    store = TrajectoryStore(db)
    WorkEnv.tool_seconds = []

    async def rollout(seed: int) -> float:
        env = WorkEnv(fleet, image=image, limits={"memory_mb": 64, "pids": 32})
        try:
            [episode] = await run_episode(env, policy, seed=seed, store=store)
            return episode.total_reward
        finally:
            await env.close()

    before, cpu_before = await _server_stats(url), cpu_snapshot()
    started = time.perf_counter()
    results = [r async for r in fleet.map(rollout, range(episodes), concurrency=in_flight, progress=False)]
    wall = time.perf_counter() - started
    after, cpu_after = await _server_stats(url), cpu_snapshot()
    await policy.close()
    store.close()
    await fleet.pool(image, size=0, memory_mb=64, pids=32)
    busy = (after["seconds"] - before["seconds"]) / wall
    ideal = min(1.0, in_flight * POLICY_MS / (POLICY_MS + 1000 * sum(TOOL_S) / 2))
    return {
        "in_flight": in_flight, "episodes": episodes, "pool": pool_size, "pool_fill_s": round(fill_s, 2),
        "ok": sum(r.ok and r.value == 1.0 for r in results),
        "errors": sum(not r.ok for r in results), "wall_s": round(wall, 2),
        "episodes_per_s": round(episodes / wall, 3), "busy_fraction": round(busy, 3), "ideal": round(ideal, 3),
        "busy_vs_ideal": round(busy / ideal, 3), "policy_requests": after["requests"] - before["requests"],
        "tool_ms_mean": round(1000 * sum(WorkEnv.tool_seconds) / max(1, len(WorkEnv.tool_seconds)), 1),
        "tool_ms_p99": round(1000 * (pct(WorkEnv.tool_seconds, 0.99) or 0), 1),
        **cpu_per_cycle(cpu_before, cpu_after, episodes),
    }


async def _server_stats(url: str) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(url.removesuffix("/v1") + "/stats") as response:
        return await response.json()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    ready = multiprocessing.get_context("spawn").Event()
    server = multiprocessing.get_context("spawn").Process(target=serve_policy, args=(port, ready), daemon=True)
    server.start()
    ready.wait(30)
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(100):  # the port opens just after ready is set
        try:
            await _server_stats(url)
            break
        except OSError:
            await asyncio.sleep(0.05)
    levels = []
    try:
        async with AsyncFleet(config=engine_config(args.workers)) as fleet:
            image = await fleet.build(WorkEnv.env_spec())
            with tempfile.TemporaryDirectory() as tmp:
                for in_flight in args.levels:
                    count = episodes_at(in_flight, args)
                    result = await level(fleet, image, url, in_flight, count, Path(tmp) / f"traj-{in_flight}.db",
                                         args.pool)
                    levels.append(result)
                    if not args.json:
                        print(json.dumps(result), flush=True)
            config = fleet.config
    finally:
        server.terminate()
        server.join(10)
    by_n = {r["in_flight"]: r for r in levels}
    summary: dict[str, Any] = {"workers": config.workers, "levels": levels, "leaked": leaked(config), "goals": GOALS}
    for n in (256, 1024):
        if n in by_n:
            summary[f"busy_fraction_at_{n}"] = by_n[n]["busy_fraction"]
    if 64 in by_n and 1 in by_n:
        summary["speedup_64_vs_1"] = round(by_n[64]["episodes_per_s"] / by_n[1]["episodes_per_s"], 1)
    if 64 in by_n:
        summary["busy_vs_ideal_at_64"] = by_n[64]["busy_vs_ideal"]
    summary["busy_vs_ideal_min"] = min(r["busy_vs_ideal"] for r in levels)
    return summary


def episodes_at(in_flight: int, args: argparse.Namespace) -> int:
    """Episodes at one level: --episodes, else 512 or 2N; N=1 runs --episodes-at-1 unless --full."""
    count = args.episodes or max(DEFAULT_EPISODES, 2 * in_flight)
    return count if args.full or in_flight > 1 else min(count, args.episodes_at_1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, help="episodes at every level (default: 512, or 2N where more)")
    parser.add_argument("--episodes-at-1", type=int, default=32, help="episodes at N=1 unless --full (default 32)")
    parser.add_argument("--full", action="store_true", help="run N=1 like the other levels (~21 min more)")
    parser.add_argument("--levels", type=lambda text: [int(n) for n in text.split(",")], default=[1, 8, 64, 256, 1024],
                        help="rollouts in flight, comma-separated (default 1,8,64,256,1024)")
    parser.add_argument("--pool", choices=("in-flight", "none"), default="in-flight",
                        help="warm pool per level: N sandboxes, refilled as used (default), or none")
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")
    add_workers_option(parser)
    args = parser.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    summary = asyncio.run(run(args))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
