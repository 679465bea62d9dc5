"""Burst benchmark: N simultaneous create, exec, destroy cycles, as at a training-step boundary.

    python bench/burst.py [--count 500] [--workers N] [--json] [--no-peers]

Runs the burst twice on an embedded engine: without a warm pool (every create queues for
a slot and brings its sandbox up) and with a pool of N filled beforehand. Then the same
burst of N simultaneous `bwrap --unshare-all true` runs as a peer. The last line is one
JSON object; create times are measured from the call, so they include queueing. The burst
without a pool also reports busiest_process_cpu_ms_per_cycle and total_cpu_ms_per_cycle
(common.cpu_per_cycle): the own CPU of the busiest engine process (this one, or one worker
process with --workers), and that of every process, crun and the other children included.
engine_peak_rss_mb is this process's (with --workers, the router's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fanfold import AsyncFleet, FanfoldError, InfrastructureError  # noqa: E402
from common import BWRAP_TRUE, add_workers_option, cpu_per_cycle, cpu_snapshot, engine_config, leaked, pct  # noqa: E402

GOALS = {"ok": "all", "infra_errors": 0, "create_p99_ms_without_pool": 1000, "create_p99_ms_with_pool": 10,
         "engine_peak_rss_mb": 300}


class RssWatch:
    """The highest resident set of this process (the engine runs in it) while a burst runs."""

    def __init__(self) -> None:
        self.peak_kb = 0
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        while True:
            self.peak_kb = max(self.peak_kb, _rss_kb())
            await asyncio.sleep(0.02)

    def __enter__(self) -> RssWatch:
        self.peak_kb = _rss_kb()
        self._task = asyncio.get_running_loop().create_task(self._watch())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def _rss_kb() -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))


async def burst(fleet: AsyncFleet, count: int) -> dict[str, object]:
    creates: list[float] = []
    errors: dict[str, int] = {"infra": 0, "other": 0}

    async def cycle() -> bool:
        started = time.perf_counter()
        try:
            sandbox = await fleet.create("host")
            creates.append((time.perf_counter() - started) * 1000)
            result = await sandbox.exec(["true"])
            await sandbox.kill()
            return result.ok
        except InfrastructureError:
            errors["infra"] += 1
        except FanfoldError as err:
            print(f"burst: {type(err).__name__}: {err}", file=sys.stderr)
            errors["other"] += 1
        return False

    with RssWatch() as rss:
        started = time.perf_counter()
        ok = sum(await asyncio.gather(*(cycle() for _ in range(count))))
        wall = time.perf_counter() - started
    return {
        "ok": ok, "infra_errors": errors["infra"], "other_errors": errors["other"],
        "create_p50_ms": pct(creates, 0.5), "create_p99_ms": pct(creates, 0.99),
        "create_max_ms": round(max(creates), 3) if creates else None,
        "sandboxes_per_s": round(count / wall, 1), "seconds": round(wall, 2),
        "engine_peak_rss_mb": round(rss.peak_kb / 1024, 1),
    }


def bwrap_burst(count: int) -> dict[str, object] | None:
    """N simultaneous bubblewrap sandboxes running `true`: the lower bound of a namespace sandbox."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None
    argv = [bwrap, *BWRAP_TRUE]
    started = time.perf_counter()
    children = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(count)]
    ok = sum(child.wait() == 0 for child in children)
    wall = time.perf_counter() - started
    return {"ok": ok, "sandboxes_per_s": round(count / wall, 1), "seconds": round(wall, 2)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=500, help="simultaneous cycles per burst")
    parser.add_argument("--json", action="store_true", help="print only the final JSON line on stdout")
    parser.add_argument("--no-peers", action="store_true", help="skip the bubblewrap burst")
    add_workers_option(parser)
    args = parser.parse_args()
    config = engine_config(args.workers)
    async with AsyncFleet(config=config) as fleet:
        await (await fleet.create("host")).kill()  # the base is built and cached before timing
        cpu_before = cpu_snapshot()
        without = await burst(fleet, args.count)
        without.update(cpu_per_cycle(cpu_before, cpu_snapshot(), args.count))
        fill_started = time.perf_counter()
        await fleet.pool("host", args.count, wait=600)
        fill_s = time.perf_counter() - fill_started
        with_pool = await burst(fleet, args.count)
        with_pool["pool_fill_seconds"] = round(fill_s, 2)
        await fleet.pool("host", 0)
    peer = None if args.no_peers else bwrap_burst(args.count)
    result = {
        "count": args.count, "workers": config.workers, "without_pool": without, "with_pool": with_pool, "bwrap": peer,
        "bwrap_vs_fanfold_rate": round(peer["sandboxes_per_s"] / without["sandboxes_per_s"], 2) if peer else None,
        "goals": GOALS,
        "met": {
            "ok": without["ok"] == with_pool["ok"] == args.count,
            "infra_errors": without["infra_errors"] == with_pool["infra_errors"] == 0,
            "create_p99_without_pool": (without["create_p99_ms"] or 1e9) <= GOALS["create_p99_ms_without_pool"],
            "create_p99_with_pool": (with_pool["create_p99_ms"] or 1e9) <= GOALS["create_p99_ms_with_pool"],
            "engine_peak_rss": max(without["engine_peak_rss_mb"], with_pool["engine_peak_rss_mb"])
            <= GOALS["engine_peak_rss_mb"],
        },
        "leaked": leaked(config),
    }
    if not args.json:
        for mode in ("without_pool", "with_pool"):
            print(f"{mode:13s} {result[mode]}")
        print(f"bwrap         {peer}")
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
