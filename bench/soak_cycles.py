"""The soak's lifecycles: one of each kind (plain, network policy, lazy restore, fork, pull) for
one of two tenants, maybe disturbed by one fault, each recording its trajectory step by step.

A cycle's outcome is ``ok``, how a command ended (``exit_*``), or the error that ended the cycle
as ``group:Type``; an error that is no typed ``FanfoldError`` (or the bare root, or ``Retryable``)
is ``untyped:Type``, and a cycle that outlives its time is ``hung``: both must never happen.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from fanfold import AsyncFleet, EngineConfig, FanfoldError, LimitExceeded, NotFound, Retryable, SandboxGone
from fanfold.rl.store import TrajectoryStore
from fanfold.rl.trajectory import Episode, Step
import soak_world as world_

TENANTS = ("alice", "bob")
KINDS = ("plain", "net", "lazy", "fork")
"""Kinds an undisturbed cycle picks from; ``pull`` and ``state_full`` come only with their fault."""
FAULT_KIND = {"sigkill": "plain", "kill_race": "plain", "disk_full": "plain", "state_full": "plain",
              "netd_kill": "net", "page_server_kill": "lazy", "registry_stall": "pull"}
"""Each per-cycle fault and the kind of cycle it disturbs."""
FAULTS = (*FAULT_KIND, "engine_sigkill")
DISK_MB = 64
CYCLE_TIMEOUT_S = 180.0
FULL_HOLD_S = (0.5, 2.0)
"""How long the state filesystem stays full (uniform): long enough for other cycles to meet it."""


@dataclass
class World:
    """What a process running cycles needs: where the server is, and what was prepared on it."""

    state_dir: str
    unix_url: str
    tcp_url: str
    snapshots: dict[str, str]
    """Each tenant's memory snapshot (lazy restores start from it)."""
    origin_port: int
    stall_ref: str
    """An image behind a registry relay that stalls mid-blob."""
    state_fs_gb: float
    pull_wait_s: float
    faults: list[str]
    fault_rate: float

    @property
    def config(self) -> EngineConfig:
        return EngineConfig(state_dir=self.state_dir)


@dataclass
class Result:
    kind: str
    tenant: str
    fault: str
    outcome: str
    ms: float
    episode: str | None
    """The trajectory's id once finished in the store; None when the store could not finish it."""
    steps: int
    note: str = ""
    """An untyped error's or a hang's message, for the report."""


@dataclass
class Cycle:
    """One lifecycle in progress: its fleet, its trajectory, the sandboxes it must release."""

    world: World
    fleet: AsyncFleet
    store: TrajectoryStore
    episode: str
    rng: random.Random
    tenant: str
    live: list[Any] = field(default_factory=list)
    steps: int = 0

    async def create(self, image: Any = "host", **options: Any) -> Any:
        options.setdefault("memory_mb", 128)
        sandbox = await self.fleet.create(image, disk_mb=DISK_MB, deadline=600, **options)
        self.live.append(sandbox)
        return sandbox

    def step(self, call: str, result: str, reward: float = 0.0) -> None:
        """Record one tool call and what came back (the store writes it before returning)."""
        self.store.add_step(self.episode, Step(index=self.steps, model_output=f"step {self.steps}",
                                               tool_call={"name": call}, tool_result=result[-200:], reward=reward))
        self.steps += 1

    async def run(self, sandbox: Any, cmd: str | list[str], **options: Any) -> Any:
        result = await sandbox.exec(cmd, **options)
        self.step("exec", f"{result.outcome.value} {result.exit_code} {result.text}", 1.0 if result.ok else 0.0)
        return result

    async def release(self) -> str | None:
        """Kill every sandbox the cycle made (already gone is fine); the first destroy error, if any."""
        failed = None
        for sandbox in self.live:
            try:
                await sandbox.kill()
            except (SandboxGone, NotFound):
                pass
            except Exception as exc:  # noqa: BLE001 - counted as the cycle's outcome
                failed = failed or f"destroy_{classify(exc)}"
        return failed


def ended(result: Any) -> str:
    return "ok" if result.ok else f"exit_{result.outcome.value}_{result.exit_code}"


# -- the kinds ----------------------------------------------------------------------------------


async def plain(c: Cycle, fault: str) -> str:
    if fault == "state_full":
        return await state_full(c)
    sandbox = await c.create()
    if fault == "none":
        return ended(await c.run(sandbox, ["true"]))
    if fault == "disk_full":
        return await disk_full(c, sandbox)
    running = asyncio.ensure_future(c.run(sandbox, ["sleep", "0.3"]))
    await asyncio.sleep(c.rng.uniform(0, 0.2))
    if fault == "sigkill":
        world_.kill(world_.sandbox_pid(c.world.config, sandbox.id))
    else:
        await sandbox.kill()
    return ended(await running)


async def disk_full(c: Cycle, sandbox: Any) -> str:
    """The sandbox writes past its disk: the write fails with the quota's error, the sandbox goes on."""
    filled = await c.run(sandbox, f"dd if=/dev/zero of=/fill bs=1M count={4 * DISK_MB} 2>&1; echo rc=$?", timeout=120)
    if "rc=0" in filled.text or not any(s in filled.text for s in ("quota exceeded", "No space left")):
        return f"not_full:{filled.text.strip()[-80:]}"
    try:
        await sandbox.files.write("/more", os.urandom(1 << 20))
        return "files_write_passed_a_full_disk"
    except LimitExceeded:
        c.step("write_file", "limit_exceeded")
    return ended(await c.run(sandbox, "rm -f /fill && echo after > /after && cat /after"))


async def state_full(c: Cycle) -> str:
    """Fill the state filesystem for a moment while a create runs; the create waits for room (or
    fails typed), and every cycle meanwhile goes on or fails typed."""
    state_fs = world_.StateFs(world_.Path(c.world.state_dir), c.world.state_fs_gb)
    await asyncio.to_thread(state_fs.fill)
    try:
        creating = asyncio.ensure_future(c.create())
        await asyncio.wait({creating}, timeout=c.rng.uniform(*FULL_HOLD_S))
    finally:
        state_fs.free()
    sandbox = await creating
    return ended(await c.run(sandbox, "echo x > /x && cat /x"))


async def net(c: Cycle, fault: str) -> str:
    """Fetch from the origin through the policy's proxy; with ``netd_kill``, netd dies meanwhile."""
    sandbox = await c.create(network={"allow": [f"{world_.ORIGIN_NAME}:{c.world.origin_port}"]})
    url = f"http://{world_.ORIGIN_NAME}:{c.world.origin_port}/"
    fetching = asyncio.ensure_future(c.run(sandbox, f"curl -sS --max-time 30 {url}", timeout=60))
    if fault == "netd_kill":
        await asyncio.sleep(c.rng.uniform(0, 0.05))
        if not any([world_.kill(pid) for pid in world_.netd_pids(c.world.config)]):
            fetching.cancel()
            return "no_netd"
    result = await fetching
    return ended(result) if not result.ok or result.text == "soak ok" else f"wrong_body:{result.text[:40]}"


async def lazy(c: Cycle, fault: str) -> str:
    """Create from the tenant's memory snapshot (a lazy restore); with ``page_server_kill``, its page
    server dies and the sandbox must end with the reason."""
    sandbox = await c.create(c.world.snapshots[c.tenant])
    if fault == "none":
        return ended(await c.run(sandbox, 'test -d "/proc/$(cat /tmp/holder.pid)"'))
    if not world_.kill(world_.page_server_pid(c.world.config, sandbox.id)):
        return "no_page_server"
    for _ in range(600):  # the engine ends it as soon as it sees its page server's end
        await c.run(sandbox, ["true"])
        await asyncio.sleep(0.05)
    return "survived_its_page_server"


async def fork(c: Cycle, fault: str) -> str:
    sandbox = await c.create()
    await c.run(sandbox, "echo parent > /who")
    forked = await sandbox.fork(2)
    c.live += forked.children
    results = [await c.run(child, "cat /who") for child in forked.children]
    bad = [r for r in results if not r.ok or r.text.strip() != "parent"]
    return ended(bad[0]) if bad else ended(await c.run(sandbox, ["true"]))


async def pull(c: Cycle, fault: str) -> str:
    """Pull through a registry that stalls mid-blob: the pull must fail typed, in its time."""
    try:
        await asyncio.wait_for(c.fleet.pull(c.world.stall_ref), c.world.pull_wait_s)
    except asyncio.TimeoutError:
        return f"hung:pull still waiting after {c.world.pull_wait_s:.0f} s"
    return "pulled_from_a_stalled_registry"


RUNNERS = {"plain": plain, "net": net, "lazy": lazy, "fork": fork, "pull": pull}


# -- running one ------------------------------------------------------------------------------


def classify(exc: BaseException) -> str:
    if not isinstance(exc, FanfoldError) or type(exc) in (FanfoldError, Retryable):
        return f"untyped:{type(exc).__name__}"
    group = "gone" if isinstance(exc, (SandboxGone, NotFound)) else "infra" if isinstance(exc, Retryable) else \
        "limit" if isinstance(exc, LimitExceeded) else "error"
    return f"{group}:{type(exc).__name__}"


def pick(world: World, rng: random.Random) -> tuple[str, str]:
    """(kind, fault) of the next cycle."""
    faults = [f for f in world.faults if f in FAULT_KIND]
    if faults and rng.random() < world.fault_rate:
        fault = rng.choice(faults)
        return FAULT_KIND[fault], fault
    return rng.choice(KINDS), "none"


def trajectory_outcome(outcome: str) -> str:
    return "success" if outcome == "ok" else "infra_error" if outcome.startswith("infra:") else "failure"


async def cycle(world: World, fleets: dict[str, AsyncFleet], store: TrajectoryStore, rng: random.Random,
                index: int) -> Result:
    kind, fault = pick(world, rng)
    tenant = rng.choice(TENANTS)
    fleet = fleets["host"] if kind == "pull" else fleets[tenant]
    start, note = time.perf_counter(), ""
    try:
        episode = store.begin(Episode(task=f"soak-{kind}", seed=index, metadata={"fault": fault, "tenant": tenant}))
    except FanfoldError as exc:
        return Result(kind, tenant, fault, f"store_{classify(exc)}", 0.0, None, 0, str(exc)[:200])
    c = Cycle(world, fleet, store, episode, rng, tenant)
    try:
        outcome = await asyncio.wait_for(RUNNERS[kind](c, fault), CYCLE_TIMEOUT_S)
    except asyncio.TimeoutError:
        outcome, note = "hung", f"{kind}/{fault} still running after {CYCLE_TIMEOUT_S:.0f} s"
    except Exception as exc:  # noqa: BLE001 - every failure is an outcome we count
        outcome, note = classify(exc), f"{type(exc).__name__}: {exc}"[:300]
    if outcome.startswith("hung:"):
        outcome, note = "hung", outcome[5:]
    outcome = await c.release() or outcome
    ms = (time.perf_counter() - start) * 1000
    try:
        store.finish(episode, trajectory_outcome(outcome), error=None if outcome == "ok" else outcome)
    except FanfoldError as exc:
        return Result(kind, tenant, fault, f"store_{classify(exc)}", ms, None, c.steps, str(exc)[:200])
    return Result(kind, tenant, fault, outcome, ms, episode, c.steps, note)


def bad(outcome: str) -> bool:
    """Whether an outcome is one that must never happen: an untyped error or a hang."""
    return "untyped:" in outcome or outcome == "hung"


async def run_cycles(world: World, count: int, concurrency: int, seed: int, first: int, record) -> None:  # type: ignore[no-untyped-def]
    """``count`` cycles, ``concurrency`` at once, over fleets of this process; ``record(result)`` each."""
    rng, gate = random.Random(seed), asyncio.Semaphore(concurrency)
    store = TrajectoryStore(os.path.join(world.state_dir, "trajectories.db"))
    fleets = {"host": AsyncFleet(world.unix_url),
              **{t: AsyncFleet(world.tcp_url, token=world_.TOKENS[t]) for t in TENANTS}}

    async def one(index: int) -> None:
        async with gate:
            record(await cycle(world, fleets, store, rng, index))

    try:
        for fleet in fleets.values():
            await fleet.start()
        await asyncio.gather(*(one(first + i) for i in range(count)))
    finally:
        for fleet in fleets.values():
            await fleet.close()
        store.close()


def to_json(result: Result) -> dict[str, Any]:
    return asdict(result)
