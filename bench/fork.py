"""Memory-state benchmark: fork, memory snapshots, suspend/resume, pause/unpause, reset.

    python bench/fork.py [--state-mb 256] [--rounds 10] [--json]

A sandbox runs a Python process holding ``--state-mb`` of live, touched memory. Measured:
``fork(8)`` (total, and how long the parent was frozen), ``snapshot(memory=True)`` (time
and size), ``create`` from that snapshot, ``suspend``/``resume``, ``pause``/``unpause``
and ``reset`` (of a sandbox made from the image). The peer is what you would do without
memory checkpoints: create a sandbox and rebuild the state (start Python, touch the
memory), measured in the same run. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import pct  # noqa: E402
from fanfold import AsyncFleet, EngineConfig  # noqa: E402

HOLDER = (
    "nohup python3 -c \"import time; state = bytearray({mb} << 20); "
    "[state.__setitem__(i, 1) for i in range(0, len(state), 4096)]; "
    "open('/tmp/ready', 'w').write('1'); time.sleep(1e9)\" >/dev/null 2>&1 &"
)
WAIT_READY = "while [ ! -f /tmp/ready ]; do sleep 0.01; done"


def summary(values: list[float]) -> dict[str, float | None]:
    return {"p50": pct(values, 0.5), "p99": pct(values, 0.99), "mean": round(statistics.fmean(values), 2) if values else None}


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000


async def holder(fleet: AsyncFleet, mb: int):  # type: ignore[no-untyped-def]
    """A sandbox whose Python process holds ``mb`` MiB of touched memory; and how long that took."""
    start = time.perf_counter()
    sandbox = await fleet.create(memory_mb=mb + 256)
    await sandbox.exec(HOLDER.format(mb=mb))
    await sandbox.exec(WAIT_READY, timeout=120)
    return sandbox, ms_since(start)


async def measure(fleet: AsyncFleet, mb: int, rounds: int, progress) -> dict[str, object]:  # type: ignore[no-untyped-def]
    times: dict[str, list[float]] = {k: [] for k in (
        "fork8_total", "fork8_parent_pause", "snapshot_memory", "create_from_memory", "suspend", "resume",
        "pause", "unpause", "reset", "cold_start",
    )}
    sizes: list[int] = []
    parent, cold = await holder(fleet, mb)
    times["cold_start"].append(cold)
    try:
        for _ in range(max(1, rounds // 3)):
            start = time.perf_counter()
            fork = await parent.fork(8)
            times["fork8_total"].append(ms_since(start))
            times["fork8_parent_pause"].append(fork.result.parent_pause_ms)
            checks = await asyncio.gather(*(c.exec("test -f /tmp/ready && pgrep -c python3") for c in fork.children))
            if not all(r.ok for r in checks):
                raise RuntimeError(f"a fork child lost its state: {checks}")
            await asyncio.gather(*(c.kill() for c in fork.children))
            progress()
        for _ in range(rounds):
            start = time.perf_counter()
            snapshot = await parent.snapshot(memory=True)
            times["snapshot_memory"].append(ms_since(start))
            sizes.append(snapshot.size_bytes)
            start = time.perf_counter()
            copy = await fleet.create(snapshot.id)
            times["create_from_memory"].append(ms_since(start))
            await copy.kill()
            await fleet.delete_snapshot(snapshot.id)
            for verb, key in ((parent.suspend, "suspend"), (parent.resume, "resume"),
                              (parent.pause, "pause"), (parent.unpause, "unpause")):
                start = time.perf_counter()
                await verb()
                times[key].append(ms_since(start))
            if not (await parent.exec("test -f /tmp/ready && pgrep -c python3")).ok:
                raise RuntimeError("the holder lost its state across suspend/resume")
            progress()
    finally:
        await parent.kill()
    plain = await fleet.create()
    try:
        for _ in range(rounds * 3):
            await plain.exec("echo dirty > /root/dirty")
            start = time.perf_counter()
            await plain.reset()
            times["reset"].append(ms_since(start))
    finally:
        await plain.kill()
    for _ in range(2):
        sandbox, cold = await holder(fleet, mb)
        times["cold_start"].append(cold)
        await sandbox.kill()
    return {"times": times, "sizes": sizes}


def report(mb: int, data: dict[str, object]) -> dict[str, object]:
    times: dict[str, list[float]] = data["times"]  # type: ignore[assignment]
    sizes: list[int] = data["sizes"]  # type: ignore[assignment]
    out: dict[str, object] = {"state_mb": mb}
    for key, values in times.items():
        out[key] = summary(values)
    out["snapshot_memory_size_mb"] = round(statistics.median(sizes) / (1 << 20), 1) if sizes else None
    resume = pct(times["resume"], 0.5)
    cold = pct(times["cold_start"], 0.5)
    out.update({
        "fork8_total_ms": pct(times["fork8_total"], 0.5),
        "fork8_parent_pause_ms": pct(times["fork8_parent_pause"], 0.5),
        "resume_p50_ms": resume,
        "unpause_p50_ms": pct(times["unpause"], 0.5),
        "reset_p50_ms": pct(times["reset"], 0.5),
        "cold_start_p50_ms": cold,
        "cold_start_over_resume": round(cold / resume, 2) if cold and resume else None,
    })
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mb", type=int, default=256, help="live memory the sandbox's process holds")
    parser.add_argument("--rounds", type=int, default=10, help="repetitions of each measurement")
    parser.add_argument("--state-dir", default=None, help="engine state directory (default: FANFOLD_STATE_DIR or /var/lib/fanfold)")
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")
    args = parser.parse_args()
    config = EngineConfig(state_dir=args.state_dir) if args.state_dir else EngineConfig()
    total = max(1, args.rounds // 3) + args.rounds
    done = 0

    def progress() -> None:
        nonlocal done
        done += 1
        if not args.json:
            print(f"  {done}/{total} rounds", file=sys.stderr, end="\r")

    async with AsyncFleet(config=config) as fleet:
        data = await measure(fleet, args.state_mb, args.rounds, progress)
    out = report(args.state_mb, data)
    if not args.json:
        for key, value in out.items():
            print(f"{key:28} {value}")
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
