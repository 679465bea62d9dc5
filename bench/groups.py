"""Sandbox groups benchmark: a 3-member group's create, its fork into 4, name lookups between members.

    python bench/groups.py [--rounds 20] [--fork-rounds 5] [--state-dir DIR] [--json]

Measured on an embedded fleet: ``create`` of one sandbox (the unit the goal is stated in), then
``create_group`` of three members (``db``, ``cache``, ``app``: the host base, 128 MB each, all in
one wave) and its ``kill``; ``fork(4)`` of a running 3-member group (every member forked, each
copy wired to a network of its own); a name lookup between members (``socket.gethostbyname("db")``
from ``app``, 200 in a loop inside the sandbox, per lookup) and a TCP connect to ``db`` over the
group's network. The goal: a 3-member group starts in under 3x one sandbox's create
(``group_over_single``). Leaks are counted after the run. Progress goes to stderr; the last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import leaked, pct  # noqa: E402
from fanfold import AsyncFleet, CreateParams, EngineConfig, GroupMember, Limits  # noqa: E402

SMALL = CreateParams(limits=Limits(memory_mb=128))
MEMBERS = [GroupMember(name=name, params=SMALL) for name in ("db", "cache", "app")]
LOOKUPS = ("python3 -c \"import socket,time\nt=time.perf_counter()\nfor _ in range(200): socket.gethostbyname('db')\n"
           "print((time.perf_counter()-t)/200*1000)\"")
CONNECT = ("python3 -c \"import socket,time\nt=time.perf_counter()\n"
           "try:\n socket.create_connection(('db',9),2)\nexcept ConnectionRefusedError: pass\n"
           "print((time.perf_counter()-t)*1000)\"")
"""A connect to a port nothing listens on: the refusal comes back from db's own stack, over the group's network."""


def summary(values: list[float]) -> dict[str, float | None]:
    return {"p50": pct(values, 0.5), "p99": pct(values, 0.99), "n": len(values)}


async def run(args: argparse.Namespace) -> dict[str, object]:
    config = EngineConfig(state_dir=Path(args.state_dir))
    single, group, kill_ms, forks, lookups, connects = [], [], [], [], [], []
    async with AsyncFleet(config=config) as fleet:
        await (await fleet.create(memory_mb=128)).kill()  # warm: the disk, the image, the agent's binary
        for n in range(args.rounds):
            started = time.perf_counter()
            box = await fleet.create(memory_mb=128)
            single.append((time.perf_counter() - started) * 1000)
            await box.kill()
            started = time.perf_counter()
            made = await fleet.create_group(MEMBERS)
            group.append((time.perf_counter() - started) * 1000)
            lookups.append(float((await made["app"].exec(LOOKUPS)).stdout))
            connects.append(float((await made["app"].exec(CONNECT)).stdout))
            started = time.perf_counter()
            await made.kill()
            kill_ms.append((time.perf_counter() - started) * 1000)
            print(f"round {n + 1}/{args.rounds}: create {single[-1]:.1f} ms, group {group[-1]:.1f} ms", file=sys.stderr)
        for n in range(args.fork_rounds):
            async with await fleet.create_group(MEMBERS) as parent:
                started = time.perf_counter()
                copies = await parent.fork(4)
                forks.append((time.perf_counter() - started) * 1000)
                ok = all([(await c["app"].exec(f"{CONNECT} && getent hosts db")).ok for c in copies])
                await asyncio.gather(*(c.kill() for c in copies))
            print(f"fork round {n + 1}/{args.fork_rounds}: fork(4) {forks[-1]:.0f} ms, copies answer: {ok}",
                  file=sys.stderr)
    leaks = leaked(config)
    ratio = pct(group, 0.5) / pct(single, 0.5) if single and group else None
    return {
        "bench": "groups", "members": len(MEMBERS), "rounds": args.rounds,
        "create_single_ms": summary(single), "create_group3_ms": summary(group),
        "group_over_single": round(ratio, 2) if ratio else None, "goal_group_over_single": 3.0,
        "kill_group3_ms": summary(kill_ms), "fork_group3_into4_ms": summary(forks),
        "dns_lookup_ms": summary(lookups), "tcp_connect_ms": summary(connects),
        "leaks": {key: value for key, value in leaks.items() if value}, "leaks_total": sum(leaks.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="group creates (and single creates) measured")
    parser.add_argument("--fork-rounds", type=int, default=5, help="fork(4)s of a running group measured")
    parser.add_argument("--state-dir", default="/var/lib/fanfold-bench-groups")
    parser.add_argument("--json", action="store_true", help="only the JSON line on stdout (progress on stderr)")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    if not args.json:
        for key, value in report.items():
            print(f"{key}: {value}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
