"""One sandbox's life on this host: its row, its gate, bring-up, deadline, wake and release.

Every sandbox has one row in SQLite, written before any resource exists and removed after
the last is released, so an engine started after a crash can find and reap whatever a dead
owner left behind. The other parts (checkpoints, leases, execs, files, the reaper, pools)
act on sandboxes through this one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import secrets
import time
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

from .._agent.client import AgentUnreachable
from .. import ids
from ..config import EngineConfig
from ..errors import FanfoldError, InfrastructureError, InvalidRequest, SandboxGone, SandboxNotFound, ServiceFailed
from ..host import procs, safefs
from ..host.offload import host_errors
from ..images import Image
from ..images.builder import DEFAULT_PATH
from ..store.trust import trust_env
from ..models import Limits, SandboxInfo
from ..runtime import Backend, Handle, SandboxSpec
from . import db as dbmod
from .admission import Admission
from .gate import Gate
from .network import Network, NetworkPolicy, row_policy, wire_policy
from .snapshots import PREFIX as SNAPSHOT_PREFIX
from .snapshots import SnapshotStore
from .gpus import Gpus
from .sources import Sources, base_env
from .telemetry import Telemetry


log = logging.getLogger("fanfold.engine")


def owner_token() -> str:
    """This process, named so that a recycled pid is not mistaken for it."""
    return f"{os.getpid()}:{procs.stat_fields('self')[19]}:{secrets.token_hex(4)}"


def process_alive(owner: str) -> bool:
    """Whether the engine process an owner token names still runs."""
    pid, start = (owner.split(":") + [""])[:2]
    fields = procs.stat_fields(pid) if pid.isdigit() else []
    return len(fields) > 19 and fields[19] == start


async def _init_survives(backend: Backend, handle: Handle, within: float = 0.25) -> bool:
    """Whether PID 1 is alive a moment after its connection broke: a killed process drops
    its sockets while it exits, a little before it shows as dead."""
    give_up = time.monotonic() + within
    while backend.alive(handle):
        if time.monotonic() > give_up:
            return True
        await asyncio.sleep(0.01)
    return False


class Lifecycle:
    """Brings sandboxes up and releases them, and holds each one for the calls on it."""

    def __init__(
        self, config: EngineConfig, db: dbmod.Database, backend: Backend, sources: Sources, snaps: SnapshotStore,
        admission: Admission, telemetry: Telemetry, owner: str, shard: tuple[int, int] | None = None,
        claimer: str | None = None,
    ) -> None:
        self.config, self.db, self.backend, self.sources, self.snaps = config, db, backend, sources, snaps
        self.admission, self.telemetry, self.owner, self.shard = admission, telemetry, owner, shard
        self.claimer = claimer or owner
        """This process's token in ``claimed_by`` (and on its warm pools' rows): the owner may be a router,
        which outlives a worker that dies mid-create."""
        self.network = Network(config, backend)
        self.gpus = Gpus(config, db)
        self.backends = (backend.name,) if backend.name == "runsc" else (backend.name, "")
        """The values of a row's backend column that make it ours: rows from before backends were
        recorded have none, and are the oci backend's (or the fake's)."""
        self.trust_env = trust_env() if config.extra_ca_file and backend.capabilities.isolated else {}
        """What points tools at the extra CAs the backend lays over each root (``store.trust``)."""
        self.interrupters: list[Callable[[str], Awaitable[None]]] = []
        """Enders of a sandbox's long-lived calls (a server's E2B processes and code contexts), run
        before a checkpoint of it waits for its calls in flight."""
        self.closing = False
        self.forget: Callable[[str], None] = lambda sandbox_id: None
        """Told of every sandbox destroyed (the pools drop it from their ready lists)."""
        self.group_hook: Callable[[Any], Callable[[Handle], Awaitable[None]] | None] = lambda row: None
        """A group member's bring-up hook that joins it to its group's network (``groups.Groups.hook``)."""
        self.group_env: Callable[[Any, dict[str, str]], dict[str, str]] = lambda row, extra: {}
        self.group_addresses: Callable[[Any], tuple[str, ...]] = lambda row: ()
        self.group_gone: Callable[[str], Awaitable[None]] | None = None
        """Told of each group member destroyed: the group goes with its last."""
        self.destroying: dict[str, asyncio.Future[None]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._gates: dict[str, Gate] = {}
        self._calls = 0
        self._no_calls = asyncio.Event()
        self._no_calls.set()

    # -- rows and gates -------------------------------------------------------------------------

    def visible(self, sandbox_id: str) -> Any:
        """A sandbox's row, or None when there is none or it is warm in a pool (nobody's yet)."""
        row = self.db.get(sandbox_id) if isinstance(sandbox_id, str) else None
        return None if row is None or row["state"] == "pooled" else row

    def info(self, sandbox_id: str) -> SandboxInfo:
        """A sandbox as callers see it; SandboxNotFound when there is none (or it is warm in a pool)."""
        row = self.visible(sandbox_id)
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        return dbmod.row_info(row)

    def known(self, sandbox_id: str) -> Any:
        """The row of a live sandbox (running, paused or suspended)."""
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise SandboxNotFound(f"bad sandbox id {sandbox_id!r}")
        row = self.visible(sandbox_id)
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}: it never existed or was destroyed")
        if row["state"] not in ("running", "paused", "suspended"):
            raise SandboxGone(f"sandbox {sandbox_id} is {row['state']}")
        self.refuse_unless_ours(row)
        return row

    def ours(self, row: Any) -> bool:
        """Whether this engine runs the row's sandbox: engines of several backends (crun and gVisor,
        say) may share a state dir, each minding its own sandboxes, and a router's workers each mind
        their share (``mine``)."""
        return row["backend"] in self.backends and self.mine(row["id"])

    def mine(self, sandbox_id: str) -> bool:
        """Whether a sandbox id falls in this engine's share: every id, unless it is a router's worker."""
        return self.shard is None or ids.shard_of(sandbox_id, self.shard[1]) == self.shard[0]

    def refuse_unless_ours(self, row: Any) -> None:
        if not self.mine(row["id"]):
            raise InfrastructureError(f"sandbox {row['id']} is another engine worker's; call it through the router")
        if not self.ours(row):
            raise InvalidRequest(f"sandbox {row['id']} runs on the {row['backend'] or 'oci'} backend, this engine on"
                                 f" {self.backend.name}: use an engine (or server) of that backend on this state dir")

    def gate(self, sandbox_id: str) -> Gate:
        gate = self._gates.get(sandbox_id)
        if gate is None:
            gate = self._gates[sandbox_id] = Gate()
        return gate

    @asynccontextmanager
    async def changing(self, sandbox_id: str, *, wake: bool = True, interrupt: bool = False) -> AsyncIterator[Any]:
        """Hold the sandbox alone (no call in flight); with ``wake``, paused or suspended is woken first.
        With ``interrupt`` (a checkpoint: pause, suspend, fork, snapshot, reset), the ``interrupters``
        first end the long-lived calls they own, which would otherwise hold the change off for good."""
        self.known(sandbox_id)

        async def end_long_calls() -> None:
            for end_calls in list(self.interrupters):
                await end_calls(sandbox_id)

        # Counted as a call: a closing engine waits for a change (a suspend) to unwind before its database goes.
        with self._counted():
            async with self.gate(sandbox_id).change(end_long_calls if interrupt else None):
                row = self.known(sandbox_id)
                if wake and row["state"] != "running":
                    await self.wake_locked(row)
                    row = self.known(sandbox_id)
                self.db.touch(sandbox_id)
                yield row

    @contextmanager
    def _counted(self) -> Iterator[None]:
        """A call or change in flight, which ``close`` waits for."""
        self._calls += 1
        self._no_calls.clear()
        try:
            yield
        finally:
            self._calls -= 1
            if not self._calls:
                self._no_calls.set()

    @asynccontextmanager
    async def using(self, sandbox_id: str) -> AsyncIterator[Any]:
        """Hold the sandbox for a call, waking it first if paused or suspended.

        Activity is stamped as the call starts and as it ends, so a long command does not
        leave the sandbox looking idle the moment it finishes.
        """
        gate = self.gate(sandbox_id)
        with self._counted():
            for _ in range(3):
                async with gate.call():
                    # The common case in one statement: a running sandbox of ours, stamped and read.
                    row = self.db.touch_running(sandbox_id, self.backends) \
                        if isinstance(sandbox_id, str) and self.mine(sandbox_id) else None
                    if row is None:
                        row = self.known(sandbox_id)  # raises, or finds it paused or suspended
                    if row["state"] == "running":
                        await self._serve_network(row)
                        try:
                            yield row
                        finally:
                            self.db.touch(sandbox_id)
                        return
                async with self.changing(sandbox_id):
                    pass  # woken; take the call again
            raise SandboxGone(f"sandbox {sandbox_id} keeps being paused or suspended by other calls; try again")

    async def _serve_network(self, row: Any) -> None:
        """Attach a sandbox with a policy that an earlier engine made (the CLI's ``create``): its
        proxy died with that engine. One that another live engine serves (a server on this state
        dir) is left to it."""
        if row["network"] == '"none"' or self.network.holds(row["id"]) or self.network.served_elsewhere(row["id"]):
            return
        policy = row_policy(row)
        assert policy is not None  # the column says it has one
        try:
            await self.network.attach(dbmod.row_handle(row), policy, row["tenant"])
        except FanfoldError as err:  # its port taken (by the engine serving it, most likely): the call goes on
            self.network.elsewhere[row["id"]] = time.monotonic()
            log.warning("fanfold: sandbox %s's network is not served by this engine: %s", row["id"], err)

    async def serve_networks(self) -> None:
        """At start: attach every running sandbox of ours with a policy that no engine serves now."""
        for row in self.db.rows():
            if row["network"] != '"none"' and row["state"] == "running" and self.ours(row) \
                    and self.backend.alive(dbmod.row_handle(row)):
                await self._serve_network(row)  # what fails is logged there

    async def calls_done(self, timeout: float) -> None:
        """Wait (up to ``timeout`` s) until no call holds a sandbox: a closing engine's
        destroyed sandboxes end their calls, which still read the database as they unwind."""
        try:
            await asyncio.wait_for(self._no_calls.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def gone_if_dead(self, sandbox_id: str, pid: int | None, *, within: float = 0.0,
                           why: str | None = None) -> None:
        """Destroy the sandbox and raise SandboxGone if its PID 1 is dead (``within`` seconds
        to show it, after a broken connection): no retry can bring it back. ``why``: what failed."""
        if await _init_survives(self.backend, Handle(sandbox_id, pid), within):
            return
        self.telemetry.sandboxes_reaped.labels(reason="crashed").inc()
        lost = self.backend.lost_why(sandbox_id)
        await asyncio.shield(self.destroy(sandbox_id))
        if lost:
            raise SandboxGone(f"{lost}; the sandbox was destroyed")
        raise SandboxGone(f"sandbox {sandbox_id}'s init process died (killed from outside or crashed);"
                          " the sandbox was destroyed" + (f" ({why})" if why else ""))

    # -- bring-up -------------------------------------------------------------------------------

    async def bring_up(self, info: SandboxInfo, deadline: float | None, owner: str, env: dict[str, str], tenant: str,
                       *, state: str = "running") -> SandboxInfo:
        """Insert the row, then start the sandbox; on any failure release all it got."""
        sandbox_id = ids.new_id(ids.SANDBOX, self.config.node_tag, self.shard)
        now = dbmod.now()
        info = dataclasses.replace(
            info, id=sandbox_id, state="creating", created_at=now, deadline_at=now + deadline if deadline else None,
        )
        # claimed_by names the engine bringing it up: if that engine dies, any engine reaps the row.
        with self.gpus.claim(info.limits) as gpu_ids:
            info = dataclasses.replace(info, gpu_ids=gpu_ids)
            self.db.insert(info, owner=owner, env=env, layers=(), tenant=tenant, claimed_by=self.claimer,
                           backend=self.backend.name)
        try:
            with host_errors("creating sandbox failed"):
                facts = {"id": sandbox_id, "group_id": info.group_id, "member": info.member, "nested": info.nested}
                pid, layers = await self.start(sandbox_id, info.source, info.limits, info.seccomp,
                                               network=(wire_policy(info.network), tenant), gpu_ids=info.gpu_ids,
                                               row=facts)
        except BaseException as err:
            raced = sandbox_id in self.destroying or self.db.get(sandbox_id) is None
            await asyncio.shield(self.destroy(sandbox_id))
            if raced and not isinstance(err, asyncio.CancelledError):  # its deadline passed, or a kill came first
                raise SandboxGone(f"sandbox {sandbox_id} was destroyed while it was being created") from None
            raise
        if not self.db.update(sandbox_id, if_state="creating", state=state, pid=pid, layers=layers, claimed_by=None):
            await asyncio.shield(self.destroy(sandbox_id))  # killed or reaped while it was starting
            raise SandboxGone(f"sandbox {sandbox_id} was destroyed while it was being created")
        if deadline:
            self.arm_deadline(sandbox_id, deadline)
        return dataclasses.replace(info, state=state)

    def hand_out(self, sandbox_id: str, info: SandboxInfo, deadline: float | None, owner: str,
                 env: dict[str, str], tenant: str) -> SandboxInfo:
        """Give a warm sandbox the caller's owner, tenant, labels, env, user and deadline."""
        now = dbmod.now()
        info = dataclasses.replace(info, id=sandbox_id, created_at=now, deadline_at=now + deadline if deadline else None)
        if info.limits.gpus is not None:  # the GPUs it got as it warmed up
            row = self.db.get(sandbox_id)
            info = dataclasses.replace(info, gpu_ids=json.loads(row["gpu_ids"]) if row is not None else [])
        self.db.update(
            sandbox_id, state="running", owner=owner, tenant=tenant, labels=json.dumps(info.labels), env=json.dumps(env),
            created_at=now, active_at=now, deadline_at=info.deadline_at, detached=int(info.detached),
            persistence=info.persistence, priority=info.priority, idle_timeout=info.idle_timeout, exec_user=info.user,
            network=json.dumps(info.network),
        )
        if deadline:
            self.arm_deadline(sandbox_id, deadline)
        return info

    async def bring_up_pooled(self, source: str, limits: Limits) -> str:
        """A sandbox for a warm pool: up, owned by this engine, unreachable until handed out."""
        img_id = self.snaps.row(source)["image_id"] if source.startswith(SNAPSHOT_PREFIX) else source
        info = SandboxInfo(id="", state="pooled", image_id=img_id, limits=limits, source=source)
        async with self.admission.slot(self.config.queue_timeout_s, None, limits.disk_mb):
            made = await self.bring_up(info, None, self.claimer, {}, "", state="pooled")
        return made.id

    def warm(self, sandbox_id: str) -> bool | None:
        """Whether a pooled sandbox is still warm (its PID 1 alive); None when its row is gone."""
        row = self.db.get(sandbox_id)
        if row is None:
            return None
        return row["state"] == "pooled" and self.backend.alive(dbmod.row_handle(row))

    def arm_deadline(self, sandbox_id: str, deadline: float) -> None:
        """Destroy the sandbox ``deadline`` seconds from now (instead of at any earlier deadline)."""
        if (timer := self._timers.pop(sandbox_id, None)) is not None:
            timer.cancel()

        def expire() -> None:
            self.telemetry.sandboxes_reaped.labels(reason="deadline").inc()
            asyncio.ensure_future(self.destroy(sandbox_id))

        self._timers[sandbox_id] = asyncio.get_running_loop().call_later(deadline, expire)

    async def start(self, sandbox_id: str, source: str, limits: Limits, seccomp: str = "default", *,
                    network: tuple[NetworkPolicy | None, str] | None = None,
                    gpu_ids: list[str] | None = None, row: Any = None) -> tuple[int | None, tuple[str, ...]]:
        """Bring up a sandbox's disk and processes from its source; return PID 1 and its layers."""
        img, restore = self.sources.start_point(source)
        return await self.bring_up_from(sandbox_id, img, limits, restore, seccomp, network=network,
                                        gpu_ids=gpu_ids, row=row), img.layers

    async def bring_up_from(self, sandbox_id: str, img: Image, limits: Limits, restore: Path | None,
                            seccomp: str = "default", *, network: tuple[NetworkPolicy | None, str] | None = None,
                            gpu_ids: list[str] | None = None, row: Any = None) -> int | None:
        """Start the sandbox over ``img``'s layers (restoring ``restore``'s processes when given).
        ``network`` (its policy and tenant), ``gpu_ids`` and ``row`` (its group and ``nested``, as a mapping):
        when the caller has them at hand (a create: no query on its way); else its row says."""
        if row is None or network is None or gpu_ids is None:
            row = self.db.get(sandbox_id)
            if network is None:
                network = (None, "") if row is None else (row_policy(row), row["tenant"])
            if gpu_ids is None:
                gpu_ids = [] if row is None else json.loads(row["gpu_ids"])
        policy, tenant = network
        if gpu_ids and restore is not None:
            raise InvalidRequest(f"sandbox {sandbox_id} holds GPUs: its processes cannot be restored from a memory"
                                 " checkpoint (the GPU's memory is not in it); start it from an image or a disk snapshot")
        extra = {**self.gpus.env(gpu_ids, limits, dict(img.env), DEFAULT_PATH), **self.network.env(policy)}
        extra.update(self.group_env(row, extra))
        spec = SandboxSpec(
            id=sandbox_id, layers=img.layers, host_dirs=img.host_dirs, limits=limits,
            env=tuple(base_env(img, sandbox_id, extra, self.trust_env)), services=img.services, restore=restore,
            seccomp=seccomp, before_run=_both(self.group_hook(row), self.network.before_run(sandbox_id, policy, tenant)),
            devices=self.gpus.edits(gpu_ids, limits), addresses=self.group_addresses(row),
            nested=row is not None and bool(row["nested"]), init=img.init,
        )
        handle = await self.backend.bring_up(spec)
        if (img.services or img.init) and (restore is None or self.backend.capabilities.memory != "live"):
            await self._wait_services(handle, img)
        return handle.pid

    async def _wait_services(self, handle: Handle, img: Image) -> None:
        sandbox_id = handle.id
        try:
            answer = await self.backend.wait_ready(handle)
        except AgentUnreachable as err:
            raise InfrastructureError(f"sandbox {sandbox_id}'s agent died while starting services: {err}") from None
        if answer != "ok":
            # The sandbox is destroyed on the way out, its log with it: the tail goes in the error.
            _, name, code = answer.split()
            root = self.backend.root(sandbox_id)
            tail = await asyncio.to_thread(safefs.tail, root, f"/var/log/fanfold/{name}.log")
            raise ServiceFailed(
                f"service {name!r} of image {img.id} exited with code {code} as the sandbox started;"
                f" the end of its log:\n{tail}",
                service=name, exit_code=int(code), log_tail=tail,
            )

    async def wake_locked(self, row: Any) -> None:
        """Thaw a paused sandbox, or restore a suspended one where it stopped (its gate held)."""
        sandbox_id = row["id"]
        if row["state"] == "paused":
            try:
                await self.backend.thaw(dbmod.row_handle(row))
            except InfrastructureError:  # killed from outside?
                await self.gone_if_dead(sandbox_id, row["pid"])
                raise
            self.db.update(sandbox_id, state="running")
        elif row["state"] == "suspended":
            snapshot_id = row["suspended_to"]
            img = self.sources.image_of(row)
            with host_errors(f"resuming sandbox {sandbox_id} failed"):
                try:
                    pid = await self.bring_up_from(
                        sandbox_id, img, dbmod.row_info(row).limits, self.snaps.memory_dir(snapshot_id), row["seccomp"])
                except BaseException:
                    await asyncio.shield(self.network.detach(sandbox_id))
                    await asyncio.shield(self.backend.release(sandbox_id))
                    raise
            self.db.update(sandbox_id, state="running", pid=pid, suspended_to=None)
            self.snaps.drop_memory(snapshot_id)

    # -- release --------------------------------------------------------------------------------

    async def destroy(self, sandbox_id: str) -> None:
        """Destroy once: concurrent callers (kill, deadline, reaper) share one release."""
        task = self.destroying.get(sandbox_id)
        if task is None:
            task = asyncio.ensure_future(self._release(sandbox_id))
            self.destroying[sandbox_id] = task
            task.add_done_callback(lambda _: self.destroying.pop(sandbox_id, None))
        await asyncio.shield(task)

    async def _release(self, sandbox_id: str) -> None:
        timer = self._timers.pop(sandbox_id, None)
        if timer is not None:
            timer.cancel()
        self.forget(sandbox_id)
        row = self.db.update_returning(sandbox_id, state="destroying", claimed_by=self.claimer)
        self.network.unexpose(sandbox_id)
        await self.network.detach(sandbox_id)
        await self.backend.release(sandbox_id, dbmod.row_handle(row) if row is not None else None)
        self.db.delete(sandbox_id)
        self._gates.pop(sandbox_id, None)
        if row is not None and row["group_id"] and self.group_gone is not None:
            try:
                await self.group_gone(row["group_id"])
            except FanfoldError as err:  # the sandbox is gone all the same; an engine's start releases the rest
                log.warning("fanfold: releasing group %s after its last member failed: %s", row["group_id"], err)
        self.admission.released()
        # A sandbox's suspend images die with it, and so does a fork's snapshot with its last child.
        spent = self.own_suspends(sandbox_id)
        if row is not None and row["source"].startswith(SNAPSHOT_PREFIX):
            source = self.db.snapshot(row["source"])
            if source is not None and source["kind"] == "fork":
                spent.add(source["id"])
        await self.collect(spent)

    async def collect(self, candidates: set[str]) -> None:
        """Delete those of ``candidates`` nothing needs any more (most calls have none to offer)."""
        if candidates:
            await asyncio.to_thread(self.snaps.collect, candidates)

    def own_suspends(self, sandbox_id: str) -> set[str]:
        return self.db.snapshot_ids(kind="suspend", sandbox_id=sandbox_id)


def _both(first: Callable[[Handle], Awaitable[None]] | None,
          then: Callable[[Handle], Awaitable[None]] | None) -> Callable[[Handle], Awaitable[None]] | None:
    """One bring-up hook that awaits ``first`` and then ``then`` (either may be None)."""
    if first is None or then is None:
        return first or then

    async def both(handle: Handle) -> None:
        await first(handle)
        await then(handle)

    return both
