"""Scaling benchmark: lifecycle cycles per second as concurrency grows to 4x the host's cores.

    python bench/scale.py [--cycles 200] [--workers N] [--json]

On one embedded fleet, after a warm-up, runs create / exec `true` / destroy cycles (as
bench/lifecycle.py does) at concurrency 1, 2, 4, ... and 4x os.cpu_count() (the last level
even where it is no power of two). Each level runs --cycles cycles, or 4x its concurrency
where that is more, so every level runs several waves. The last line is one JSON object:
``cores``, ``workers``, ``cycles_per_s_by_concurrency`` and ``cycle_ms_by_concurrency``
(p50, p99) keyed by concurrency, ``best_concurrency``, ``scaling_efficiency`` = min(1, best
cycles/s / (single-stream cycles/s x cores)), ``busiest_process_cpu_ms_per_cycle`` and
``total_cpu_ms_per_cycle`` at the best concurrency (common.cpu_per_cycle: the own CPU of the
busiest engine process, this one or one worker process, and that of every process, crun and
the other children included; ``cpu_ms_per_cycle_by_concurrency`` has every level's), and
``leaked`` (common.leaked, after the fleet closes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import add_workers_option, cpu_per_cycle, cpu_snapshot, engine_config, leaked, pct  # noqa: E402
from fanfold import AsyncFleet  # noqa: E402
from lifecycle import fanfold_cycles  # noqa: E402


def concurrency_levels(cores: int) -> list[int]:
    """1, 2, 4, ... below 4x ``cores``, then 4x ``cores`` itself."""
    top, levels = 4 * cores, []
    while (1 << len(levels)) < top:
        levels.append(1 << len(levels))
    return [*levels, top]


async def measure(fleet: AsyncFleet, cycles: int, concurrency: int) -> dict[str, float | int]:
    """One level: its cycles per second, cycle p50/p99 and CPU per cycle."""
    before, started = cpu_snapshot(), time.perf_counter()
    times = await fanfold_cycles(fleet, cycles, concurrency)
    wall, after = time.perf_counter() - started, cpu_snapshot()
    return {"cycles": cycles, "cycles_per_s": round(cycles / wall, 1), "cycle_p50_ms": pct(times["cycle"], 0.5),
            "cycle_p99_ms": pct(times["cycle"], 0.99), **cpu_per_cycle(before, after, cycles)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=200, help="cycles per level, at least 4x its concurrency")
    parser.add_argument("--json", action="store_true", help="print only the final JSON line on stdout")
    add_workers_option(parser)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    levels = concurrency_levels(cores)
    config = engine_config(args.workers)
    by_level: dict[int, dict[str, float | int]] = {}
    async with AsyncFleet(config=config) as fleet:
        await (await fleet.create("host")).kill()  # the base is built and cached before timing
        await fanfold_cycles(fleet, 10, 1)  # warm-up: one stream, then the widest level once
        await fanfold_cycles(fleet, levels[-1], levels[-1])
        for concurrency in levels:
            by_level[concurrency] = await measure(fleet, max(args.cycles, 4 * concurrency), concurrency)
            if not args.json:
                print(f"concurrency {concurrency:4d} {by_level[concurrency]}", flush=True)
    best = max(levels, key=lambda n: by_level[n]["cycles_per_s"])
    single = by_level[1]["cycles_per_s"]
    result = {
        "cores": cores,
        "workers": config.workers,
        "cycles_per_s_by_concurrency": {str(n): by_level[n]["cycles_per_s"] for n in levels},
        "cycle_ms_by_concurrency": {str(n): {"p50": by_level[n]["cycle_p50_ms"], "p99": by_level[n]["cycle_p99_ms"]}
                                    for n in levels},
        "cpu_ms_per_cycle_by_concurrency": {
            str(n): {key: by_level[n][key] for key in ("busiest_process_cpu_ms_per_cycle", "total_cpu_ms_per_cycle")}
            for n in levels},
        "best_concurrency": best,
        "busiest_process_cpu_ms_per_cycle": by_level[best]["busiest_process_cpu_ms_per_cycle"],
        "total_cpu_ms_per_cycle": by_level[best]["total_cpu_ms_per_cycle"],
        "worker_processes": by_level[best]["worker_processes"],
        "scaling_efficiency": round(min(1.0, by_level[best]["cycles_per_s"] / (single * cores)), 3) if single else None,
        "leaked": leaked(config),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
