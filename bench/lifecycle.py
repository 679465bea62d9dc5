"""Sandbox lifecycle benchmark: create, exec `true`, destroy, against peers on the same host.

    python bench/lifecycle.py [--cycles 200] [--concurrency 8] [--workers N] [--json] [--profile FILE]

Runs the cycles sequentially and at the given concurrency on a cached image, then the
same cycle for plain subprocess `true`, `bwrap --unshare-all true` and `podman run --rm`
(a peer that cannot run here is reported as null). The last line is one JSON object;
its engine_cpu_ms_per_cycle is the CPU (user + system, from getrusage) of this process,
which runs the embedded engine, plus its reaped children (crun, CRIU), per concurrent
cycle; with --workers that is the router's alone. busiest_process_cpu_ms_per_cycle and
total_cpu_ms_per_cycle (common.cpu_per_cycle) count the engine's worker processes too: the
busiest single process's own CPU, and everything's. --profile writes a cProfile of this
process in the concurrent phase to FILE.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import BWRAP_TRUE, add_workers_option, cpu_per_cycle, cpu_snapshot, engine_config, leaked, pct  # noqa: E402
from fanfold import AsyncFleet  # noqa: E402


def summary(values: list[float]) -> dict[str, float | None]:
    return {"p50": pct(values, 0.5), "p99": pct(values, 0.99), "mean": round(statistics.fmean(values), 3) if values else None}


async def fanfold_cycles(fleet: AsyncFleet, cycles: int, concurrency: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"create": [], "exec": [], "destroy": [], "cycle": []}
    gate = asyncio.Semaphore(concurrency)

    async def cycle() -> None:
        async with gate:
            t0 = time.perf_counter()
            sandbox = await fleet.create("host")
            t1 = time.perf_counter()
            result = await sandbox.exec(["true"])
            t2 = time.perf_counter()
            await sandbox.kill()
            t3 = time.perf_counter()
            if not result.ok:
                raise RuntimeError(f"exec failed: {result}")
            for key, value in (("create", t1 - t0), ("exec", t2 - t1), ("destroy", t3 - t2), ("cycle", t3 - t0)):
                times[key].append(value * 1000)

    await asyncio.gather(*(cycle() for _ in range(cycles)))
    return times


def time_command(argv: list[str], cycles: int) -> list[float] | None:
    samples = []
    for _ in range(cycles):
        start = time.perf_counter()
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        samples.append((time.perf_counter() - start) * 1000)
        if done.returncode != 0:
            print(f"peer {argv[0]} failed: {done.stderr.decode()[-300:]}", file=sys.stderr)
            return None
    return samples


def podman_image(workdir: Path) -> str | None:
    """Import a one-file rootfs (a static `true`) as a podman image: no registry is needed."""
    if shutil.which("podman") is None or shutil.which("cc") is None:
        return None
    (workdir / "true.c").write_text("int main(void) { return 0; }\n")
    rootfs = workdir / "rootfs"
    rootfs.mkdir()
    subprocess.run(["cc", "-static", "-O2", "-o", str(rootfs / "true"), str(workdir / "true.c")], check=True)
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(workdir / "rootfs.tar"), "."], check=True)
    done = subprocess.run(["podman", "import", str(workdir / "rootfs.tar"), "fanfold-bench-true"], capture_output=True)
    return "fanfold-bench-true" if done.returncode == 0 else None


PODMAN = ["podman", "run", "--rm", "--cgroup-manager", "cgroupfs", "--network", "none",
          "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]


def peers(cycles: int) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    out["subprocess_cycle_p50_ms"] = pct(time_command(["true"], cycles) or [], 0.5)
    bwrap = shutil.which("bwrap")
    samples = time_command([bwrap, *BWRAP_TRUE], cycles) if bwrap else None
    out["bwrap_cycle_p50_ms"] = pct(samples or [], 0.5)
    with tempfile.TemporaryDirectory() as tmp:
        image = podman_image(Path(tmp))
        samples = time_command(PODMAN + [image, "/true"], max(20, cycles // 5)) if image else None
    out["podman_cycle_p50_ms"] = pct(samples or [], 0.5)
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print only the final JSON line on stdout")
    parser.add_argument("--no-peers", action="store_true", help="skip the peer measurements")
    parser.add_argument("--profile", metavar="FILE", help="write a cProfile of the concurrent phase here")
    add_workers_option(parser)
    args = parser.parse_args()
    config = engine_config(args.workers)
    async with AsyncFleet(config=config) as fleet:
        await fleet.create("host")  # build the base once; it is destroyed with the fleet
        await fanfold_cycles(fleet, 10, 1)  # warm-up
        sequential = await fanfold_cycles(fleet, args.cycles, 1)
        profile = cProfile.Profile() if args.profile else None
        cpu_before, concurrent_start = cpu_snapshot(), time.perf_counter()
        if profile:
            profile.enable()
        concurrent = await fanfold_cycles(fleet, args.cycles, args.concurrency)
        if profile:
            profile.disable()
            profile.dump_stats(args.profile)
        concurrent_wall, cpu_after = time.perf_counter() - concurrent_start, cpu_snapshot()  # workers exit at close
    own_ms = (cpu_after.bench.own_ms - cpu_before.bench.own_ms) / args.cycles
    children_ms = (cpu_after.bench.reaped_children_ms - cpu_before.bench.reaped_children_ms) / args.cycles
    leaks = leaked(config)
    peer = {} if args.no_peers else peers(args.cycles)
    cycle_p50 = pct(sequential["cycle"], 0.5)
    result = {
        "cycles": args.cycles,
        "workers": config.workers,
        "create_p50_ms": pct(sequential["create"], 0.5),
        "create_p99_ms": pct(sequential["create"], 0.99),
        "exec_p50_ms": pct(sequential["exec"], 0.5),
        "exec_p99_ms": pct(sequential["exec"], 0.99),
        "destroy_p50_ms": pct(sequential["destroy"], 0.5),
        "destroy_p99_ms": pct(sequential["destroy"], 0.99),
        "cycle_p50_ms": cycle_p50,
        "cycle_p99_ms": pct(sequential["cycle"], 0.99),
        "concurrent": {
            "concurrency": args.concurrency,
            **{f"{k}_{s}_ms": v for k, vals in concurrent.items() for s, v in summary(vals).items() if s != "mean"},
            "cycles_per_s": round(args.cycles / concurrent_wall, 1),
        },
        "engine_cpu_ms_per_cycle": round(own_ms + children_ms, 2),
        "engine_cpu_split_ms": {"engine": round(own_ms, 2), "runtime_children": round(children_ms, 2)},
        **cpu_per_cycle(cpu_before, cpu_after, args.cycles),
        "peers": peer,
        "podman_vs_fanfold_cycle": round(peer["podman_cycle_p50_ms"] / cycle_p50, 2)
        if peer.get("podman_cycle_p50_ms") and cycle_p50 else None,
        "leaked": leaks,
    }
    if not args.json:
        for key in ("create", "exec", "destroy", "cycle"):
            print(f"sequential {key:8s} {summary(sequential[key])}")
            print(f"concurrent {key:8s} {summary(concurrent[key])}")
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
