"""Density benchmark: how many idle sandboxes one host holds, and what each one costs.

    python bench/density.py [--count 1000] [--concurrency 16] [--json]

Creates ``--count`` idle sandboxes (64 MB of memory and a 16 MB disk each: admission adds the
disks up against the real free space) at bounded concurrency on a private state dir, measures
host memory (MemTotal - MemAvailable, caches left alone) before and after, the summed RSS of
the in-sandbox agents and the mounts, checks a sample is alive (``exec true`` in every 50th),
destroys them all and counts what leaked. The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fanfold import AsyncFleet, EngineConfig  # noqa: E402
from common import agent_pids, leaked, pct  # noqa: E402
from fanfold.host import mounts  # noqa: E402

GOALS = {"idle_sandboxes": 1000, "overhead_mb_per_sandbox": 3}


def memory_used_kb() -> int:
    info = {}
    with open("/proc/meminfo") as handle:
        for line in handle:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0])
    return info["MemTotal"] - info["MemAvailable"]


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


async def fill(fleet: AsyncFleet, count: int, concurrency: int, quiet: bool) -> tuple[list, list[float], list[str]]:
    gate = asyncio.Semaphore(concurrency)
    sandboxes, times, errors = [], [], []

    async def one() -> None:
        async with gate:
            start = time.perf_counter()
            try:
                sandboxes.append(await fleet.create("host", memory_mb=64, disk_mb=16, deadline=3600))
            except Exception as exc:  # noqa: BLE001 - counted and reported, not fatal
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            times.append((time.perf_counter() - start) * 1000)
            if not quiet and len(sandboxes) % 100 == 0:
                print(f"  {len(sandboxes)}/{count} up, p50 of these {pct(times[-100:], 0.5)} ms", file=sys.stderr)

    await asyncio.gather(*(one() for _ in range(count)))
    return sandboxes, times, errors


async def run(args: argparse.Namespace) -> dict[str, object]:
    config = EngineConfig(state_dir=args.state_dir)
    async with AsyncFleet(config=config) as fleet:
        await (await fleet.create("host")).kill()  # build the base before the baseline
        await asyncio.sleep(1)
        before_kb = memory_used_kb()
        start = time.perf_counter()
        sandboxes, times, errors = await fill(fleet, args.count, args.concurrency, args.json)
        seconds = time.perf_counter() - start
        await asyncio.sleep(2)  # let the last agents settle
        after_kb = memory_used_kb()
        agents = agent_pids(config)
        agent_rss = sum(rss_kb(pid) for pid in agents)
        live_mounts = len(mounts.mounts_under(config.state_dir / "sandboxes"))
        listed = len(await fleet.list())
        sample = sandboxes[::50]
        checks = await asyncio.gather(*(sb.exec(["true"]) for sb in sample), return_exceptions=True)
        alive = sum(not isinstance(r, BaseException) and r.ok for r in checks)
        start = time.perf_counter()
        gate = asyncio.Semaphore(args.concurrency)

        async def kill(sb) -> None:  # type: ignore[no-untyped-def]
            async with gate:
                await sb.kill()

        await asyncio.gather(*(kill(sb) for sb in sandboxes))
        destroy_s = time.perf_counter() - start
    up = len(sandboxes)
    overhead = round((after_kb - before_kb) / 1024 / up, 2) if up else None
    out: dict[str, object] = {
        "count": args.count,
        "idle_sandboxes": up,
        "listed": listed,
        "overhead_mb_per_sandbox": overhead,
        "agent_rss_kb_per_sandbox": round(agent_rss / len(agents), 1) if agents else None,
        "agents_seen": len(agents),
        "mounts_live": live_mounts,
        "create_p50_ms": pct(times, 0.5),
        "create_p99_ms": pct(times, 0.99),
        "seconds_to_fill": round(seconds, 2),
        "seconds_to_destroy": round(destroy_s, 2),
        "sample_alive": f"{alive}/{len(sample)}",
        "create_errors": len(errors),
        "first_errors": errors[:3],
        "leaked": leaked(config),
        "goals": GOALS,
    }
    out["met"] = {
        "idle_sandboxes": up >= GOALS["idle_sandboxes"],
        "overhead_mb_per_sandbox": overhead is not None and overhead <= GOALS["overhead_mb_per_sandbox"],
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000, help="idle sandboxes to hold at once")
    parser.add_argument("--concurrency", type=int, default=16, help="creates in flight at once")
    parser.add_argument("--state-dir", default="/tmp/fanfold-bench-density", help="private engine state dir")
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")
    args = parser.parse_args()
    out = asyncio.run(run(args))
    if not args.json:
        for key, value in out.items():
            print(f"{key:28} {value}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
