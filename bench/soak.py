"""Soak: many create -> exec -> destroy lifecycles, random outside kills, one engine crash.

    python bench/soak.py [--cycles 10000] [--concurrency 16] [--json]

The first half runs in a child process that is SIGKILLed at a random cycle while it has
sandboxes live; a new fleet on the same state dir (its start reconciles what the dead one
left) runs the rest. About 5% of cycles are killed from outside mid-life: SIGKILL of the
sandbox's PID 1 (its agent), or ``kill()`` racing an exec. At the end nothing may be left:
mounts, cgroups, runtime state, agent processes or rows. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fanfold import AsyncFleet, CapacityExceeded, EngineConfig, InfrastructureError, SandboxGone, SandboxNotFound  # noqa: E402
from common import agent_pids, leaked, pct  # noqa: E402

KILL_RATE = 0.05


def classify(exc: BaseException) -> str:
    kind = "gone" if isinstance(exc, (SandboxGone, SandboxNotFound)) else \
        "infra" if isinstance(exc, (InfrastructureError, CapacityExceeded)) else "other"
    return f"{kind}:{type(exc).__name__}"


async def cycle(fleet: AsyncFleet, rng: random.Random) -> tuple[str, str, float]:
    """One lifecycle; returns (how it was disturbed, outcome, ms)."""
    roll = rng.random()
    fault = "none" if roll >= KILL_RATE else ("sigkill" if roll < KILL_RATE / 2 else "kill_race")
    start, sandbox = time.perf_counter(), None
    try:
        sandbox = await fleet.create("host", memory_mb=64, deadline=600)
        if fault == "none":
            result = await sandbox.exec(["true"])
            outcome = "ok" if result.ok else "failed"
        else:
            running = asyncio.ensure_future(sandbox.exec(["sleep", "0.3"]))
            await asyncio.sleep(rng.uniform(0, 0.2))
            if fault == "sigkill":
                os.kill(fleet._transport.db.get(sandbox.id)["pid"], signal.SIGKILL)
            else:
                await sandbox.kill()
            result = await running
            outcome = "ok" if result.ok else f"exit_{result.status}"
    except Exception as exc:  # noqa: BLE001 - every failure is an outcome we count
        outcome = classify(exc)
    finally:
        if sandbox is not None:
            try:
                await sandbox.kill()
            except Exception as exc:  # noqa: BLE001
                outcome = f"destroy_{classify(exc)}"
    return fault, outcome, (time.perf_counter() - start) * 1000


async def run_cycles(fleet: AsyncFleet, count: int, concurrency: int, seed: int, record) -> None:  # type: ignore[no-untyped-def]
    rng, gate = random.Random(seed), asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            record(*await cycle(fleet, rng))

    await asyncio.gather(*(one() for _ in range(count)))


async def in_new_fleet(config: EngineConfig, *args) -> None:  # type: ignore[no-untyped-def]
    async with AsyncFleet(config=config) as fleet:
        await run_cycles(fleet, *args)


class Tally:
    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet = total, quiet
        self.faults: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.times: list[float] = []

    def __call__(self, fault: str, outcome: str, ms: float) -> None:
        self.faults[fault] += 1
        self.outcomes[outcome if fault == "none" else f"{fault}->{outcome}"] += 1
        if fault == "none" and outcome == "ok":
            self.times.append(ms)
        done = sum(self.faults.values())
        if not self.quiet and done % 500 == 0:
            print(f"  {done}/{self.total} cycles {dict(self.outcomes)}", file=sys.stderr)


def child_phase(args: argparse.Namespace, config: EngineConfig) -> None:
    emit = lambda *cycle: print(json.dumps(cycle), flush=True)  # noqa: E731
    asyncio.run(in_new_fleet(config, args.cycles, args.concurrency, args.seed, emit))


def crashed_first_half(args: argparse.Namespace, config: EngineConfig, tally: Tally) -> dict[str, object]:
    """Run up to half the cycles in a child and SIGKILL it at a random cycle; return what it left."""
    half = args.cycles // 2
    target = random.Random(args.seed).randint(half // 3, max(half // 3, half - args.concurrency))
    child = subprocess.Popen(
        [sys.executable, __file__, "--phase", "child", "--cycles", str(half), "--concurrency", str(args.concurrency),
         "--seed", str(args.seed), "--state-dir", str(config.state_dir)], stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout is not None
    done = live = 0
    for line in child.stdout:  # after the kill: cycles that finished before it landed
        tally(*json.loads(line))
        done += 1
        if done == target:
            live = len(agent_pids(config))
            child.send_signal(signal.SIGKILL)
    child.wait()
    return {"child_cycles": done, "agents_live_at_crash": live}


async def second_half(args: argparse.Namespace, config: EngineConfig, count: int, tally: Tally) -> dict[str, object]:
    start = time.perf_counter()
    async with AsyncFleet(config=config) as fleet:
        reconcile_s = time.perf_counter() - start
        after_reconcile = {"agents": len(agent_pids(config)), "rows": len(await fleet.list())}
        await run_cycles(fleet, count, args.concurrency, args.seed + 1, tally)
    return {"reconcile_s": round(reconcile_s, 2), "left_after_reconcile": after_reconcile}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--state-dir", default="/tmp/fanfold-bench-soak", help="private engine state dir")
    parser.add_argument("--phase", choices=("all", "child"), default="all", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")
    args = parser.parse_args()
    config = EngineConfig(state_dir=args.state_dir)
    if args.phase == "child":
        return child_phase(args, config)
    asyncio.run(in_new_fleet(config, 1, 1, 0, lambda *_: None))  # build the base before timing
    tally = Tally(args.cycles, args.json)
    start = time.perf_counter()
    crash = crashed_first_half(args, config, tally)
    restart = asyncio.run(second_half(args, config, args.cycles - crash["child_cycles"], tally))
    seconds = time.perf_counter() - start
    outcomes = tally.outcomes
    out = {
        "cycles": sum(tally.faults.values()),
        "ok": outcomes["ok"],
        "killed": tally.faults["sigkill"] + tally.faults["kill_race"],
        "infra_errors": sum(n for k, n in outcomes.items() if "infra:" in k),
        "infra_errors_unprovoked": sum(n for k, n in outcomes.items() if "infra:" in k and "->" not in k),
        "gone_errors": sum(n for k, n in outcomes.items() if "gone:" in k),
        "outcomes": dict(outcomes),
        "engine_restarts": 1,
        **crash, **restart,
        "cycle_p50_ms": pct(tally.times, 0.5),
        "cycle_p99_ms": pct(tally.times, 0.99),
        "seconds": round(seconds, 1),
        "leaked": leaked(config),
    }
    if not args.json:
        for key, value in out.items():
            print(f"{key:24} {value}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
