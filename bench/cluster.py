"""Cluster benchmark: fanfold over a local Ray cluster of 1 and then 3 nodes, beside the embedded engine.

    python bench/cluster.py [--nodes 1,3] [--execs 300] [--creates 60] [--burst 500] [--map 256] [--quick] [--json]

Each node is a raylet started by Ray's ``Cluster`` on this machine (the head is one of them), with a
``fanfold`` resource and its own ``fanfold serve`` on its own state dir (real oci backend); the fleet is
``AsyncFleet("ray://")``. On one 2-core machine this measures what the cluster path costs, not a
speed-up. For each cluster size, in the same run:

- exec ``true`` and create (each then killed) through the cluster fleet and the embedded fleet
  (``AsyncFleet(config=...)``), interleaved call by call, with the floor this box imposes: an HTTP
  round trip that does nothing (GET /v1/whoami to the sandbox's node, through the fleet's own client)
  and a Ray actor ping on that node;
- a burst: ``--burst`` creates at once (asyncio.gather, default limits), then each killed;
- a ``map`` of ``--map`` rollouts (create, ``echo N``, check it, kill), 32 at a time, and how they
  spread over the nodes;
- after the cluster stops: mounts, cgroups, containers, agents and rows left in each node's state
  dir, its disk still mounted, and Ray or fanfold processes of this run still alive.

The last line is one JSON object: the largest cluster's figures, with the 1-node ones under
``one_node``. Every cluster, process, mount and state dir of the run is removed on every way out
(an error, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from fanfold import AsyncFleet, CreateParams, EngineConfig, FanfoldError, ids  # noqa: E402
from fanfold.cluster.node import TAG_FILE, ClusterConfig, start_cluster, stop_cluster  # noqa: E402
from fanfold.engine import Engine  # noqa: E402
from fanfold.host import disk, mounts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import leaked, pct  # noqa: E402

STATE_PREFIX = "/var/lib/fanfold-bench-cluster-"
EMBEDDED_DIR = Path(STATE_PREFIX + "embedded")
NODE_MEMORY = 64 * 2**30
"""Each node's Ray ``memory`` resource, the capacity placement shares out: room for the whole burst's limits."""
MARK = "FANFOLD_BENCH_CLUSTER_RUN"
"""Set in this process's environment, so every Ray and fanfold process of the run carries it."""
MAP_CONCURRENCY = 32
PROCESS_GRACE_S = 15.0


def log(message: str) -> None:
    print(f"[cluster bench] {message}", file=sys.stderr, flush=True)


# -- processes and state dirs ---------------------------------------------------------------


def marked_processes(*, only: str | None = None) -> dict[int, str]:
    """Live processes of this run (they carry ``MARK``), but this one; with ``only``, those whose
    command line contains it."""
    mark = f"{MARK}={os.environ[MARK]}".encode()
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        if int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if mark not in handle.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/stat") as handle:
                if handle.read().rpartition(")")[2].split()[0] == "Z":
                    continue  # exited, waiting for its parent to collect it
        except OSError:
            continue  # gone meanwhile
        if only is None or only in command:
            found[int(entry)] = command
    return found


def end_processes(only: str | None = None) -> int:
    """How many of this run's processes (matching ``only``) outlived their owners' shutdown;
    those still there after ``PROCESS_GRACE_S`` are killed by pid (all carry this run's mark)."""
    deadline = time.monotonic() + PROCESS_GRACE_S
    while (left := marked_processes(only=only)) and time.monotonic() < deadline:
        time.sleep(0.1)  # Ray's own processes exit on their own schedule after their raylet is gone
    for pid, command in left.items():
        log(f"killing a leftover process {pid}: {command[:160]}")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(left)


def dir_leaks(state_dir: Path) -> dict[str, int]:
    """What a stopped engine left in ``state_dir``: bench/common's count plus its disk, if still mounted."""
    if not (state_dir / "fanfold.db").exists():
        return {"mounts": 0, "cgroups": 0, "containers": 0, "agents": 0, "rows": 0, "disk": 0}
    return {**leaked(EngineConfig(state_dir=state_dir)), "disk": int(disk.ready(state_dir))}


async def reap(state_dir: Path) -> None:
    """Destroy whatever sandboxes ``state_dir`` still holds with an engine of its own (a failed stop)."""
    tag_file = state_dir / TAG_FILE
    tag = tag_file.read_text().strip() if tag_file.exists() else None
    engine = Engine(EngineConfig(state_dir=state_dir, node_tag=tag))
    await engine.start()
    try:
        for info in await engine.list():
            await engine.kill(info.id)
    finally:
        await engine.close()


async def remove_state(root: Path, state_dirs: list[Path]) -> None:
    """Remove ``root`` (holding ``state_dirs``), reaping first what any of them still holds; a dir
    with a mount left under it stays, so that nothing mounted is deleted through."""
    for state_dir in state_dirs:
        if any((left := dir_leaks(state_dir)).values()):
            log(f"reaping what {state_dir} still holds: {left}")
            serve_log = state_dir / "serve.log"
            if serve_log.exists():
                log("its server's last lines:\n" + "\n".join(serve_log.read_text().splitlines()[-12:]))
            try:
                await reap(state_dir)
            except FanfoldError as err:
                log(f"cannot reap {state_dir}: {err}")
        shutil.rmtree(EngineConfig(state_dir=state_dir).run_dir, ignore_errors=True)
    if mounts.mounts_under(root):
        log(f"{root} keeps {len(mounts.mounts_under(root))} mounts; not removed")
        return
    shutil.rmtree(root, ignore_errors=True)


def node_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


# -- the Ray cluster ------------------------------------------------------------------------


def node_args(head: bool = False) -> dict[str, Any]:
    args = {"num_cpus": 1, "resources": {"fanfold": 1}, "object_store_memory": 80 * 2**20, "memory": NODE_MEMORY}
    return {**args, "include_dashboard": False} if head else args


def start_ray(nodes: int) -> Cluster:
    """A local Ray cluster of ``nodes`` raylets, this process its driver."""
    cluster = Cluster(initialize_head=True, head_node_args=node_args(head=True))
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**node_args())
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="fanfold", log_to_driver=False, logging_level=logging.WARNING)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def stop_ray(cluster: Cluster) -> None:
    session = Path(cluster.head_node.get_session_dir_path()) if cluster.head_node else None
    ray.shutdown()
    cluster.shutdown()
    if session is not None:
        shutil.rmtree(session, ignore_errors=True)


def cancel_on_sigterm() -> None:
    """SIGTERM cancels the run as Ctrl-C does (``ray.init`` sets its own handler, which would exit at once)."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)


class Pinger:
    """A Ray actor that does nothing: the floor of an actor call."""

    async def ping(self) -> None:
        return None


# -- measurements ---------------------------------------------------------------------------


async def timed(call: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = await call()
    return (time.perf_counter() - started) * 1000, result


async def warm_up(fleet: AsyncFleet, embedded: AsyncFleet) -> None:
    """Every node (and the embedded engine) brings its base up once, before anything is timed."""
    nodes = list(fleet._transport.nodes.values())
    infos = await asyncio.gather(*(node.http.create(CreateParams()) for node in nodes))
    await asyncio.gather(*(node.http.kill(info.id) for node, info in zip(nodes, infos)))
    await (await embedded.create()).kill()


async def round_trips(fleet: AsyncFleet, embedded: AsyncFleet, calls: int) -> dict[str, list[float]]:
    """exec ``true`` on a cluster and an embedded sandbox, a whoami to the cluster sandbox's node and
    an actor ping there, one of each per round, their order rotating from round to round."""
    cluster_box, embedded_box = await asyncio.gather(fleet.create(), embedded.create())
    node = fleet._transport.nodes[ids.node_of(cluster_box.id)]
    pinger = ray.remote(Pinger).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote()
    calls_by_name: dict[str, Callable[[], Awaitable[Any]]] = {
        "cluster_exec": lambda: cluster_box.exec(["true"]),
        "embedded_exec": lambda: embedded_box.exec(["true"]),
        "http_floor": lambda: node.http._json("GET", "/v1/whoami"),
        "actor_ping": lambda: pinger.ping.remote(),
    }
    names = list(calls_by_name)
    times: dict[str, list[float]] = {name: [] for name in names}
    try:
        for n in range(calls + 20):  # the first 20 rounds warm connections and caches
            for name in names[n % 4:] + names[:n % 4]:
                ms, result = await timed(calls_by_name[name])
                if name.endswith("exec") and not result.ok:
                    raise RuntimeError(f"{name}: exec true failed: {result}")
                if n >= 20:
                    times[name].append(ms)
    finally:
        ray.kill(pinger)
        await asyncio.gather(cluster_box.kill(), embedded_box.kill())
    return times


async def creates(fleet: AsyncFleet, embedded: AsyncFleet, count: int) -> dict[str, list[float]]:
    """Create then kill, on the cluster and embedded by turns (which goes first alternates)."""
    fleets = {"cluster": fleet, "embedded": embedded}
    times: dict[str, list[float]] = {f"{name}_{what}": [] for name in fleets for what in ("create", "kill")}
    for n in range(count):
        for name in (["cluster", "embedded"] if n % 2 == 0 else ["embedded", "cluster"]):
            ms, box = await timed(fleets[name].create)
            times[f"{name}_create"].append(ms)
            ms, _ = await timed(box.kill)
            times[f"{name}_kill"].append(ms)
    return times


def error_counts(results: list[Any]) -> dict[str, int]:
    errors = [r for r in results if isinstance(r, BaseException)]
    for error in errors:
        if not isinstance(error, Exception):
            raise error  # a cancel or an interrupt, not a result
    return dict(Counter(f"{type(e).__name__}: {str(e)[:300]}" for e in errors))


async def burst(fleet: AsyncFleet, count: int) -> dict[str, Any]:
    """``count`` creates at once, then each sandbox made killed. One counts as ok when its create
    returned and the cluster still lists it once all have returned (a lapsed lease reaps made ones)."""
    started = time.perf_counter()
    results = await asyncio.gather(*(fleet.create() for _ in range(count)), return_exceptions=True)
    burst_s = time.perf_counter() - started
    errors = error_counts(results)
    boxes = [r for r in results if not isinstance(r, BaseException)]
    listed = {info.id for info in await fleet.list()}
    if gone := sum(box.id not in listed for box in boxes):
        errors["created, then gone before the burst ended"] = gone
    started = time.perf_counter()
    kills = await asyncio.gather(*(box.kill() for box in boxes), return_exceptions=True)
    return {
        "burst_ok": len(boxes) - gone, "burst_created": len(boxes), "burst_s": round(burst_s, 2),
        "burst_errors": errors,
        "burst_by_node": dict(Counter(ids.node_of(box.id) for box in boxes)),
        "burst_kill_s": round(time.perf_counter() - started, 2), "burst_kill_errors": error_counts(kills),
    }


async def rollouts(fleet: AsyncFleet, count: int) -> dict[str, Any]:
    """``fleet.map`` of ``count`` rollouts, each a sandbox that echoes its number; where they ran."""

    async def rollout(n: int) -> str | None:
        async with await fleet.create() as box:
            result = await box.exec(f"echo {n}")
            if result.stdout != f"{n}\n".encode():
                raise RuntimeError(f"rollout {n} read {result.stdout!r} (exit {result.exit_code})")
            return ids.node_of(box.id)

    started = time.perf_counter()
    async with fleet.map(rollout, range(count), concurrency=MAP_CONCURRENCY, progress=False) as run:
        results = [result async for result in run]
    return {
        "map_ok": sum(r.ok for r in results), "map_s": round(time.perf_counter() - started, 2),
        "map_infra_retries": sum(r.infra_errors for r in results),
        "map_errors": dict(Counter(f"{r.status}: {type(r.error).__name__}: {str(r.error)[:300]}"
                                   for r in results if not r.ok)),
        "map_by_node": dict(Counter(r.value for r in results if r.ok)),
    }


def latency_figures(trips: dict[str, list[float]], made: dict[str, list[float]]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for name, values in {**made, **trips}.items():
        figures[f"{name}_p50_ms"] = pct(values, 0.5)
        figures[f"{name}_p99_ms"] = pct(values, 0.99)
    figures["exec_overhead_p50_ms"] = round(figures["cluster_exec_p50_ms"] - figures["embedded_exec_p50_ms"], 3)
    figures["create_overhead_p50_ms"] = round(
        figures["cluster_create_p50_ms"] - figures["embedded_create_p50_ms"], 3)
    return figures


async def measure(embedded: AsyncFleet, args: argparse.Namespace) -> dict[str, Any]:
    async with AsyncFleet("ray://") as fleet:
        await warm_up(fleet, embedded)
        log("round trips")
        trips = await round_trips(fleet, embedded, args.execs)
        log("creates")
        made = await creates(fleet, embedded, args.creates)
        log(f"burst of {args.burst}")
        burst_figures = await burst(fleet, args.burst)
        log(f"map of {args.map}")
        map_figures = await rollouts(fleet, args.map)
    return {**latency_figures(trips, made), **burst_figures, **map_figures}


async def on_cluster(nodes: int, embedded: AsyncFleet, args: argparse.Namespace) -> dict[str, Any]:
    """Start a ``nodes``-node cluster with fanfold on every node, measure, stop it, count what it left."""
    root = Path(f"{STATE_PREFIX}{nodes}n")
    await remove_state(root, node_dirs(root))
    log(f"starting a {nodes}-node Ray cluster")
    started = time.perf_counter()
    cluster = start_ray(nodes)
    figures: dict[str, Any] = {"nodes": nodes}
    try:
        cancel_on_sigterm()
        config = ClusterConfig(state_dir=str(root / "{node_id}"), resource="fanfold", host="127.0.0.1")
        try:
            await start_cluster(config, address=None, nodes=nodes)
            figures["cluster_start_s"] = round(time.perf_counter() - started, 2)
            figures.update(await measure(embedded, args))
        finally:
            stopping = time.perf_counter()
            await stop_cluster(address=None)
            log(f"fanfold stopped on the cluster in {time.perf_counter() - stopping:.1f} s")
    finally:
        stop_ray(cluster)
        dirs = node_dirs(root)
        per_dir = [dir_leaks(state_dir) for state_dir in dirs]
        figures["leaks"] = {key: sum(d[key] for d in per_dir) for key in per_dir[0]} if per_dir else {}
        figures["leaks"]["processes"] = end_processes(only="ray") + end_processes(only=str(root))
        figures["leaks"]["state_dirs"] = len(dirs)
        await remove_state(root, dirs)
    return figures


async def run(args: argparse.Namespace) -> dict[str, Any]:
    cancel_on_sigterm()
    await remove_state(EMBEDDED_DIR, [EMBEDDED_DIR])
    started = time.perf_counter()
    by_size: dict[int, dict[str, Any]] = {}
    try:
        async with AsyncFleet(config=EngineConfig(state_dir=EMBEDDED_DIR)) as embedded:
            for nodes in args.nodes:
                by_size[nodes] = await on_cluster(nodes, embedded, args)
    finally:
        embedded_leaks = dir_leaks(EMBEDDED_DIR)
        await remove_state(EMBEDDED_DIR, [EMBEDDED_DIR])
    result = dict(by_size[max(by_size)])
    if 1 in by_size and max(by_size) != 1:
        result["one_node"] = by_size[1]
    result.update(execs=args.execs, creates=args.creates, burst=args.burst, map=args.map,
                  embedded_leaks=embedded_leaks, processes_left=end_processes(),
                  seconds=round(time.perf_counter() - started, 1))
    return result


def summary(result: dict[str, Any]) -> None:
    for figures in filter(None, (result.get("one_node"), result)):
        print(f"{figures['nodes']} node(s), started in {figures['cluster_start_s']} s")
        for what in ("create", "exec"):
            print(f"  {what:6s} p50 (p99) ms: cluster {figures[f'cluster_{what}_p50_ms']} "
                  f"({figures[f'cluster_{what}_p99_ms']}), embedded {figures[f'embedded_{what}_p50_ms']} "
                  f"({figures[f'embedded_{what}_p99_ms']}), overhead {figures[f'{what}_overhead_p50_ms']}")
        print(f"  floor  p50 (p99) ms: HTTP whoami {figures['http_floor_p50_ms']} ({figures['http_floor_p99_ms']}),"
              f" actor ping {figures['actor_ping_p50_ms']} ({figures['actor_ping_p99_ms']})")
        print(f"  burst  {figures['burst_ok']}/{result['burst']} ({figures['burst_created']} created) in"
              f" {figures['burst_s']} s, by node "
              f"{figures['burst_by_node']}, errors {figures['burst_errors'] or 'none'}")
        print(f"  map    {figures['map_ok']}/{result['map']} in {figures['map_s']} s, by node "
              f"{figures['map_by_node']}, errors {figures['map_errors'] or 'none'}")
        print(f"  leaks  {figures['leaks']}")
    print(f"embedded leaks {result['embedded_leaks']}, processes left {result['processes_left']},"
          f" {result['seconds']} s in all")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1,3", help="cluster sizes, in order (default 1,3)")
    parser.add_argument("--execs", type=int, default=300, help="exec round trips per fleet, and floor calls")
    parser.add_argument("--creates", type=int, default=60, help="creates (each killed) per fleet")
    parser.add_argument("--burst", type=int, default=500, help="creates at once through the cluster fleet")
    parser.add_argument("--map", type=int, default=256, help="rollouts in the map, %d at a time" % MAP_CONCURRENCY)
    parser.add_argument("--quick", action="store_true", help="small counts: 40 execs, 10 creates, burst 60, map 32")
    parser.add_argument("--json", action="store_true", help="print only the final JSON line on stdout")
    args = parser.parse_args()
    args.nodes = [int(n) for n in args.nodes.split(",")]
    if args.quick:
        args.execs, args.creates, args.burst, args.map = 40, 10, 60, 32
    return args


def main() -> None:
    args = parse_args()
    os.environ[MARK] = uuid.uuid4().hex
    try:
        result = asyncio.run(run(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        log("interrupted; everything of the run was stopped and removed")
        raise SystemExit(130) from None
    if not args.json:
        summary(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
