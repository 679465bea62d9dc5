"""Chaos soak: many lifecycles of two tenants on a real server, under faults; nothing may be left,
no trajectory lost, no error untyped.

    python bench/soak.py [--cycles 10000] [--concurrency 16] [--faults all] [--fault-rate 0.1] [--json]

The soak makes its own state filesystem (an ext4 in a sparse file, mounted at ``--state-dir``, and
a btrfs for the sandboxes' disks at ``STATE/disk``), a
``fanfold serve`` on it with two tenants (alice and bob: tenants exist only on a server), an HTTP
origin on loopback that network policies allow, and a registry behind a relay that stalls mid-blob.
Each cycle is plain (create, exec, destroy), a network policy's fetch through netd, a lazy restore
from the tenant's memory snapshot, or a fork of two children; each records its trajectory step by
step in the state dir's trajectory store.

With probability ``--fault-rate`` a cycle is disturbed by one fault of ``--faults``: ``sigkill``
(the sandbox's PID 1), ``kill_race`` (``kill()`` racing an exec), ``disk_full`` (the sandbox writes
past its ``disk_mb``), ``state_full`` (the state filesystem filled for a moment, then freed),
``netd_kill`` (the egress proxy SIGKILLed mid-fetch), ``page_server_kill`` (the page server of a
lazy restore SIGKILLed: it serves every lazily restored sandbox, so those of other cycles it had not
finished end ``gone`` too), ``registry_stall`` (a pull from the stalling registry). ``engine_sigkill``: the
first half runs in a child process; the server is SIGKILLed at a random cycle, the child (its
clients and trajectory writer) a second later, and a new server on the same state dir reconciles
and serves the rest.

At the end, with the server stopped: the leak census (mounts, cgroups, containers, agents, network
namespaces, nftables tables, uid claims, page servers, rows, netd and skopeo processes) all 0, every
finished cycle's trajectory stored whole (``lost_trajectories``), and no error untyped or cycle hung
(``untyped``). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from fanfold import AsyncFleet, EngineConfig, NotFound  # noqa: E402
from fanfold.host import census  # noqa: E402
from fanfold.rl.store import TrajectoryStore  # noqa: E402
from common import leaked, pct  # noqa: E402
from registry import Relay, push_image, run_insecure_registry  # noqa: E402
from soak_cycles import FAULTS, TENANTS, Result, World, bad, run_cycles  # noqa: E402
import soak_world as world_  # noqa: E402

STALL_S = 15
"""The server's FANFOLD_PULL_STALL_S: a stalled pull must fail typed in this time (``--pull-wait`` is the soak's limit)."""
SERVER_TO_CLIENTS_S = 1.0
"""After the server's SIGKILL, how long the child's clients run on against no server before their own."""


class Tally:
    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet = total, quiet
        self.results: list[Result] = []
        self.kinds: Counter[str] = Counter()
        self.tenants: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.fault_outcomes: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.bad: list[str] = []
        self.samples: dict[str, str] = {}
        """One message of each error outcome, for the report."""
        self.times: list[float] = []

    def __call__(self, result: Result) -> None:
        self.results.append(result)
        self.kinds[result.kind] += 1
        self.tenants[result.tenant] += 1
        if result.fault == "none":
            self.outcomes[result.outcome] += 1
        else:
            self.faults[result.fault] += 1
            self.fault_outcomes[result.fault][result.outcome] += 1
        if result.note:
            self.samples.setdefault(result.outcome, result.note)
        if bad(result.outcome):
            self.bad.append(f"{result.kind}/{result.fault}: {result.outcome}: {result.note}")
        if result.kind == "plain" and result.fault == "none" and result.outcome == "ok":
            self.times.append(result.ms)
        if not self.quiet and len(self.results) % 100 == 0:
            print(f"  {len(self.results)}/{self.total} cycles, faults {dict(self.faults)}", file=sys.stderr)


async def prepare(server: world_.Server) -> dict[str, str]:
    """Each tenant's memory snapshot of a sandbox whose process lazy restores must bring back."""
    snapshots = {}
    for tenant in TENANTS:
        async with AsyncFleet(server.tcp_url, token=world_.TOKENS[tenant]) as fleet:
            async with await fleet.create("host", memory_mb=128, disk_mb=64) as sandbox:
                started = await sandbox.exec("nohup sleep 100000 >/dev/null 2>&1 & echo $! > /tmp/holder.pid")
                assert started.ok, started
                snapshots[tenant] = (await sandbox.snapshot(memory=True)).id
    return snapshots


def child_phase(world: World, args: argparse.Namespace) -> None:
    emit = lambda result: print(json.dumps(asdict(result)), flush=True)  # noqa: E731
    asyncio.run(run_cycles(world, args.cycles, args.concurrency, args.seed, 0, emit))


def crashed_first_half(args: argparse.Namespace, world: World, server: world_.Server, tally: Tally) -> dict[str, object]:
    """Run half the cycles in a child; at a random one SIGKILL the server, then the child."""
    half = args.cycles // 2
    target = random.Random(args.seed).randint(half // 3, max(half // 3, half - args.concurrency))
    child = subprocess.Popen(
        [sys.executable, __file__, "--phase", "child", "--cycles", str(half), "--concurrency", str(args.concurrency),
         "--seed", str(args.seed), "--world", json.dumps(asdict(world))], stdout=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, child.stdout), lines.put(None)], daemon=True).start()  # type: ignore[arg-type]
    done, live, deadline = 0, 0, None
    while True:
        try:
            line = lines.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        tally(Result(**json.loads(line)))
        done += 1
        if done == target:
            live = len(census.agent_pids(world.config))
            server.kill()
            deadline = time.monotonic() + SERVER_TO_CLIENTS_S
    child.send_signal(signal.SIGKILL)
    child.wait()
    while (line := lines.get()) is not None:  # what it wrote before it died
        tally(Result(**json.loads(line)))
        done += 1
    return {"child_cycles": done, "agents_live_at_crash": live, "crashed": done >= target}


async def count_left(config: EngineConfig, server: world_.Server) -> dict[str, int]:
    """What the new server's reconcile left of the dead one's sandboxes."""
    async with AsyncFleet(server.unix_url) as host:
        rows = len(await host.list())
    return {"agents": len(census.agent_pids(config)), "rows": rows}


def lost_trajectories(state_dir: Path, results: list[Result]) -> dict[str, int]:
    """Finished cycles whose trajectory is missing, unfinished or short of steps; and the others."""
    with TrajectoryStore(state_dir / "trajectories.db") as store:
        lost = 0
        for result in results:
            if result.episode is None:
                continue
            try:
                episode = store.get(result.episode)
            except NotFound:
                lost += 1
                continue
            lost += episode.outcome in ("running", "partial") or len(episode.steps) != result.steps
        partial = store.count(outcome="partial")
    return {"lost_trajectories": lost, "trajectories_unfinished": sum(r.episode is None for r in results),
            "trajectories_partial": partial}


def close_on_error(config: EngineConfig, server: world_.Server) -> None:
    """On the way out after a failure: stop the server, or release what a killed one left."""
    if server.process.poll() is None:
        server.stop()
    elif server.process.returncode != 0:
        asyncio.run(_reconcile(config))


async def _reconcile(config: EngineConfig) -> None:
    async with AsyncFleet(config=config):
        pass


def stray_tools(config: EngineConfig) -> int:
    """skopeo processes still working for this state dir (a pull its killed server began)."""
    state = str(config.state_dir).encode()
    found = 0
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        found += argv[0].endswith(b"skopeo") and any(state in arg for arg in argv)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--faults", default="all", help=f"comma-separated, of: {', '.join(FAULTS)} (default all)")
    parser.add_argument("--fault-rate", type=float, default=0.1, help="share of cycles disturbed by a fault")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--state-dir", default="/var/lib/fanfold-soak", help="where the soak mounts its state fs")
    parser.add_argument("--state-fs-gb", type=float, default=4.0, help="size of the soak's state filesystem")
    parser.add_argument("--pull-wait", type=float, default=60.0, help="seconds a stalled pull may take to fail")
    parser.add_argument("--phase", choices=("all", "child"), default="all", help=argparse.SUPPRESS)
    parser.add_argument("--world", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")
    args = parser.parse_args()
    if args.phase == "child":
        return child_phase(World(**json.loads(args.world)), args)
    faults = list(FAULTS) if args.faults == "all" else args.faults.split(",")
    if unknown := set(faults) - set(FAULTS):
        parser.error(f"unknown faults {sorted(unknown)}: pick from {', '.join(FAULTS)}")
    config = EngineConfig(state_dir=args.state_dir)
    claims_before = frozenset(census.orphan_claims())
    with ExitStack() as stack:
        state_fs = stack.enter_context(world_.StateFs(config.state_dir, args.state_fs_gb))
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fanfold-soak-")))
        registry = stack.enter_context(run_insecure_registry(work / "registry"))
        relay = stack.enter_context(Relay(registry.host, cut_after=256 << 10, stall=True))
        origin = world_.Origin()
        stack.callback(origin.close)
        ref = push_image(registry, "soak/stall:v1", [{"data.bin": os.urandom(2 << 20)}])
        env = {"FANFOLD_NET_HOSTS": f"{world_.ORIGIN_NAME}=127.0.0.1", "FANFOLD_NET_REACHABLE": "127.0.0.0/8",
               "FANFOLD_INSECURE_REGISTRIES": f"{registry.host},{relay.host}", "FANFOLD_PULL_STALL_S": str(STALL_S)}
        servers = [world_.start_server(config, work / "server1", env)]
        stack.callback(lambda: close_on_error(config, servers[-1]))
        world = World(str(config.state_dir), servers[0].unix_url, servers[0].tcp_url, asyncio.run(prepare(servers[0])),
                      origin.port, ref.replace(registry.host, relay.host), args.state_fs_gb, args.pull_wait, faults,
                      args.fault_rate)
        tally = Tally(args.cycles, args.json)
        start = time.perf_counter()
        crash: dict[str, object] = {}
        if "engine_sigkill" in faults:
            crash = crashed_first_half(args, world, servers[0], tally)
            state_fs.free()  # the child may have died with the filesystem full
            began = time.perf_counter()
            servers.append(world_.start_server(config, work / "server2", env))
            crash["reconcile_s"] = round(time.perf_counter() - began, 2)
            crash["left_after_reconcile"] = asyncio.run(count_left(config, servers[-1]))
            world.unix_url, world.tcp_url = servers[-1].unix_url, servers[-1].tcp_url
        rest = args.cycles - len(tally.results)
        asyncio.run(run_cycles(world, rest, args.concurrency, args.seed + 1, len(tally.results), tally))
        seconds = time.perf_counter() - start
        stopped = servers[-1].stop()
        trajectories = lost_trajectories(config.state_dir, tally.results)
        leaks = {**leaked(config, claims_before), "netd": len(world_.netd_pids(config)), "skopeo": stray_tools(config)}
    faults_seen = {**dict(tally.faults), **({"engine_sigkill": int(bool(crash.get("crashed")))} if crash else {})}
    out = {
        "cycles": len(tally.results),
        "ok": sum(r.outcome == "ok" for r in tally.results),
        "kinds": dict(tally.kinds),
        "tenants": dict(tally.tenants),
        "faults": faults_seen,
        "fault_outcomes": {fault: dict(outcomes) for fault, outcomes in tally.fault_outcomes.items()},
        "outcomes": dict(tally.outcomes),
        "untyped": len(tally.bad),
        "untyped_samples": tally.bad[:5],
        "error_samples": tally.samples,
        **trajectories,
        "engine": crash,
        "server_exit": stopped,
        "cycle_p50_ms": pct(tally.times, 0.5),
        "cycle_p99_ms": pct(tally.times, 0.99),
        "seconds": round(seconds, 1),
        "leaked": leaks,
        "leaks": sum(leaks.values()),
    }
    if not args.json:
        for key, value in out.items():
            print(f"{key:24} {value}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
