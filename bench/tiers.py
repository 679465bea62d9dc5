"""The isolation tiers side by side: crun (the default) and gVisor (``runtime="runsc"``).

    python bench/tiers.py [--cycles 30] [--fork 4] [--rounds 3] [--json]

For each runtime, on the same state dir and image (``host``), in the same run: create (to the
agent answering), exec ``true``, an exec-heavy command (100 ``/bin/true`` from a shell loop),
destroy, fork into ``--fork`` children of a sandbox holding a 64 MB process (total and the
parent's pause), suspend and resume of that sandbox, and the host memory an idle sandbox costs
(its cgroup's usage). The last line is one JSON object with each runtime's medians and p99, and
runsc/crun ratios. A runtime that cannot run here is reported as null.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import leaked, pct  # noqa: E402
from fanfold import AsyncFleet, EngineConfig  # noqa: E402
from fanfold.errors import FanfoldError  # noqa: E402
from fanfold.host import cgroups  # noqa: E402

LOOP = "for i in $(seq 100); do /bin/true; done"
HOLDER = ("nohup python3 -c \"import time; s = bytearray(64 << 20);"
          " [s.__setitem__(i, 1) for i in range(0, len(s), 4096)];"
          " open('/tmp/ready', 'w').write('1'); time.sleep(1e9)\" >/dev/null 2>&1 &"
          " while [ ! -f /tmp/ready ]; do sleep 0.01; done")


def ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def stats(values: list[float]) -> dict[str, float | None]:
    return {"p50": pct(values, 0.5), "p99": pct(values, 0.99)}


async def measure(runtime: str, state_dir: Path, cycles: int, fork: int, rounds: int) -> dict[str, object]:
    config = EngineConfig(state_dir=state_dir, runtime=runtime)
    times: dict[str, list[float]] = {k: [] for k in (
        "create", "exec_true", "exec_loop", "destroy", "fork_total", "fork_pause", "suspend", "resume")}
    idle_mb: list[float] = []
    async with AsyncFleet(config=config) as fleet:
        warm = await fleet.create("host")  # first create compiles the agent, caches the image
        await warm.kill()
        for _ in range(cycles):
            t = time.perf_counter()
            sandbox = await fleet.create("host")
            times["create"].append(ms(t))
            t = time.perf_counter()
            assert (await sandbox.exec(["true"])).ok
            times["exec_true"].append(ms(t))
            t = time.perf_counter()
            assert (await sandbox.exec(["sh", "-c", LOOP])).ok
            times["exec_loop"].append(ms(t))
            idle_mb.append(cgroups.usage(config.cgroup_parent, sandbox.id)[1] / 2**20)
            t = time.perf_counter()
            await sandbox.kill()
            times["destroy"].append(ms(t))
        for _ in range(rounds):
            parent = await fleet.create("host")
            assert (await parent.exec(["sh", "-c", HOLDER])).ok
            t = time.perf_counter()
            forked = await parent.fork(fork)
            times["fork_total"].append(ms(t))
            times["fork_pause"].append(forked.result.parent_pause_ms)
            for child in forked.children:
                assert (await child.exec(["test", "-f", "/tmp/ready"])).ok
                await child.kill()
            t = time.perf_counter()
            await parent.suspend()
            times["suspend"].append(ms(t))
            t = time.perf_counter()
            await parent.resume()
            times["resume"].append(ms(t))
            assert (await parent.exec(["test", "-f", "/tmp/ready"])).ok
            await parent.kill()
    result: dict[str, object] = {k: stats(v) for k, v in times.items()}
    result["idle_memory_mb"] = pct(idle_mb, 0.5)
    result["leaked"] = leaked(config)
    return result


def ratio(runsc: dict[str, object] | None, crun: dict[str, object] | None, key: str) -> float | None:
    if not runsc or not crun:
        return None
    a, b = runsc[key], crun[key]
    if isinstance(a, dict) and isinstance(b, dict) and a["p50"] and b["p50"]:
        return round(a["p50"] / b["p50"], 2)
    if isinstance(a, float) and isinstance(b, float) and b:
        return round(a / b, 1)
    return None


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--fork", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--state-dir", type=Path, default=Path("/var/lib/fanfold-bench-tiers"))
    parser.add_argument("--json", action="store_true", help="only the final JSON line")
    args = parser.parse_args()
    out: dict[str, object] = {}
    for runtime in ("crun", "runsc"):
        if shutil.which(runtime) is None:
            out[runtime] = None
            continue
        try:
            out[runtime] = await measure(runtime, args.state_dir, args.cycles, args.fork, args.rounds)
        except FanfoldError as err:
            print(f"{runtime}: {err}", file=sys.stderr)
            out[runtime] = None
        if not args.json:
            print(runtime, json.dumps(out[runtime]))
    crun, runsc = out.get("crun"), out.get("runsc")
    keys = ("create", "exec_true", "exec_loop", "destroy", "fork_total", "fork_pause", "suspend", "resume",
            "idle_memory_mb")
    out["runsc_over_crun"] = {k: ratio(runsc, crun, k) for k in keys}  # type: ignore[arg-type]
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
