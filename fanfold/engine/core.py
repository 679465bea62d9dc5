"""The engine: creates, runs and destroys every sandbox on one host, and owns all it makes.

Every sandbox has one row in SQLite, written before any resource exists and removed
after the last is released, so an engine started after a crash can find and reap
whatever a dead owner left behind. Sandboxes made by a live engine belong to it and
die with it; ``detached`` ones (the CLI's ``create``) live until removed or their deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import secrets
import shutil
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from .._agent.client import AgentUnreachable
from ..config import EngineConfig
from ..errors import (
    CapacityExceeded, FanfoldError, HostNotReady, ImageNotFound, InfrastructureError, InvalidRequest, SandboxGone,
    SandboxNotFound, ServiceFailed,
)
from ..host import procs, safefs
from ..host.offload import host_errors
from ..images import Image, LayerStore
from ..images.builder import DEFAULT_PATH, Builder, OnStep
from ..models import ExecResult, Limits, Persistence, SandboxInfo, SnapshotInfo
from ..runtime import Backend, Handle, SandboxSpec, get_backend
from ..spec import BASES, EnvSpec
from . import db as dbmod
from .admission import Admission, check_fits_host
from .api import OnOutput
from .checks import check_deadline, check_labels, check_strings
from .host_ops import HostOperations, LEASE_PREFIX
from .execution import build_result, check_exec_args
from .files import SandboxFiles
from .gate import Gate
from .pools import Pools
from .snapshots import PREFIX as SNAPSHOT_PREFIX
from .snapshots import SnapshotStore
from .states import SandboxStates, _limits_of
from .telemetry import Telemetry

log = logging.getLogger("fanfold.engine")
SWEEP_EVERY = 15
"""Reaper passes (seconds) between sweeps for resources no row names, e.g. from a runtime
command still finishing when the engine that ran it was killed."""


def _owner_token() -> str:
    """This process, named so that a recycled pid is not mistaken for it."""
    return f"{os.getpid()}:{procs.stat_fields('self')[19]}:{secrets.token_hex(4)}"


def _process_alive(owner: str) -> bool:
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


def _pid_alive(pid: str) -> bool:
    return pid.isdigit() and os.path.exists(f"/proc/{pid}")




class Engine(SandboxFiles, SandboxStates, HostOperations):
    """The async core every client drives, in-process or through the server."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.owner = _owner_token()
        self._db: dbmod.Database | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._destroying: dict[str, asyncio.Future[None]] = {}
        self._gates: dict[str, Gate] = {}
        self._creating: set[asyncio.Task[object]] = set()
        self._in_exec: dict[str, int] = {}
        """Execs in flight per sandbox: a command alone in its sandbox gets its own peak memory."""
        self._leases: set[str] = set()
        """Leases opened through this engine: closing it ends them. A crash leaves them to expire."""
        self._bases: dict[str, Image] = {}
        self._dead_seen: set[str] = set()
        self._closing = False
        self._started = False

    # -- life of the engine -------------------------------------------------------------------

    async def start(self) -> None:
        """Check and prepare the host, open the database, and reap what dead owners left."""
        if self._started:
            return
        cfg = self.config
        try:
            (cfg.state_dir / "bundles").mkdir(parents=True, exist_ok=True)
            os.chmod(cfg.state_dir, 0o700)  # sandbox roots and layers are no business of other host users
        except OSError as err:
            raise HostNotReady(f"cannot use the state dir {cfg.state_dir}: {err}; run fanfold as root"
                               " or set FANFOLD_STATE_DIR to a directory of yours") from None
        self.store = LayerStore(cfg.state_dir)
        self.backend = get_backend(cfg, self.store)
        await self.backend.prepare()
        self.builder = Builder(
            self.store, self.backend.step_runtime, mirror=cfg.debian_mirror, scratch_run=cfg.state_dir / "bundles",
        )
        self._db = dbmod.Database(cfg.state_dir / "fanfold.db")
        self.snaps = SnapshotStore(cfg.state_dir, self.store, self._db)
        self.admission = Admission(cfg, self._db.count)
        self.telemetry = Telemetry(self._gauges)
        self.pools = Pools(self)
        self._started = True
        await self.reconcile()
        self._reaper = asyncio.create_task(self._reap_forever())
        for ref, size in cfg.pools:
            await self.set_pool(ref, size)

    async def close(self) -> None:
        """Destroy the sandboxes this engine owns (not detached ones) and stop."""
        if not self._started:
            return
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
        await self.pools.close()
        # Creates in flight finish (or fail) first, so none outlives the engine.
        await asyncio.gather(*list(self._creating), return_exceptions=True)
        for lease_id in list(self._leases):
            await self._reap_lease(lease_id, expired=False)
        for row in self.db.rows():
            if row["owner"] == self.owner:
                await self._destroy(row["id"])
        await asyncio.gather(*list(self._destroying.values()), return_exceptions=True)
        await self.backend.sweep()
        if not self.db.rows():  # a suspended sandbox's restore needs the parent cgroups as they are
            await self.backend.close()
        self.db.close()
        self._started = False

    @property
    def db(self) -> dbmod.Database:
        if self._db is None:
            raise InfrastructureError("the engine is not started: call start() first")
        return self._db

    async def reconcile(self) -> dict[str, int]:
        """Reap sandboxes whose owner died or whose deadline passed, and resources with no sandbox."""
        reaped = 0
        rows = {row["id"]: row for row in self.db.rows()}
        for lease_id in self.db.expired_leases():
            reaped += await self._reap_lease(lease_id)
        alive = self._owners_alive({row["owner"] for row in rows.values()})
        for sandbox_id, row in rows.items():
            dead = not alive[row["owner"]]
            expired = row["deadline_at"] is not None and row["deadline_at"] <= dbmod.now()
            broken = row["state"] in ("running", "pooled") and not self.backend.alive(dbmod.row_handle(row))
            if dead or expired or broken or self._orphaned(row):
                await self._destroy(sandbox_id)
                reaped += 1
            elif row["claimed_by"] and not _process_alive(row["claimed_by"]):
                self.db.unclaim(sandbox_id)  # an engine died mid idle-suspend
        reaped += await self._sweep_leftovers()
        self.store.discard_scratch()
        self.snaps.discard_orphans()
        for context in (self.config.state_dir / "bundles").glob("context-*"):  # a dead server's build uploads
            if not _pid_alive(context.name.split("-")[1]):
                shutil.rmtree(context, ignore_errors=True)
        return {"reaped": reaped}

    async def _sweep_leftovers(self) -> int:
        """Release what the backend holds for sandboxes no row names (a dead engine's)."""
        leftovers = await self.backend.list_ids()
        # Rows are written before resources exist: reading them after the scan keeps
        # another engine's create in flight from looking like a leftover.
        known = {row["id"] for row in self.db.rows()}
        for sandbox_id in leftovers - known:
            await self.backend.release(sandbox_id)
        return len(leftovers - known)

    def _owners_alive(self, owners: set[str]) -> dict[str, bool]:
        """Whether each owner still wants its rows: detached, a live lease, or a live engine
        process; the leases in one query, each engine's process looked up once."""
        leases = self.db.live_lease_ids() if any(o.startswith(LEASE_PREFIX) for o in owners) else set()
        alive = {}
        for owner in owners:
            if owner.startswith(LEASE_PREFIX):
                alive[owner] = owner.removeprefix(LEASE_PREFIX) in leases
            else:
                alive[owner] = owner == "detached" or _process_alive(owner)
        return alive

    def _crashed(self, row: Any) -> bool:
        """PID 1 of a running sandbox died, seen on two passes in a row: a suspend (of any
        engine) releases the processes a moment before the row says suspended."""
        if row["state"] not in ("running", "pooled") or self.backend.alive(dbmod.row_handle(row)):
            self._dead_seen.discard(row["id"])
            return False
        if row["id"] in self._dead_seen:
            self._dead_seen.discard(row["id"])
            return True
        self._dead_seen.add(row["id"])
        return False

    def _orphaned(self, row: Any) -> bool:
        """A row an engine that died was creating or destroying."""
        claimer = row["claimed_by"]
        return row["state"] in ("creating", "destroying") and bool(claimer) and not _process_alive(claimer)

    def _reap_reason(self, row: Any, alive: dict[str, bool]) -> str | None:
        """Why the reaper destroys this row now, or None to leave it."""
        if row["deadline_at"] is not None and row["deadline_at"] <= dbmod.now():
            return "deadline"
        if (row["owner"] != self.owner and not alive[row["owner"]]) or self._orphaned(row):
            return "owner"
        if self._crashed(row):
            return "crashed"
        if row["state"] == "destroying" and row["claimed_by"] == self.owner and row["id"] not in self._destroying:
            return "retry"  # its release failed (a busy mount, a cgroup slow to empty): try again
        return None

    async def _reap_forever(self) -> None:
        passes = 0
        while True:
            await asyncio.sleep(1.0)
            passes += 1
            try:
                if passes % SWEEP_EVERY == 0:
                    await self._sweep_leftovers()
                await self.backend.sweep()
                for lease_id in self.db.expired_leases():
                    await self._reap_lease(lease_id)
                rows = self.db.rows()
                alive = self._owners_alive({row["owner"] for row in rows} - {self.owner})
                for row in rows:
                    reason = self._reap_reason(row, alive)
                    if reason is None:
                        continue
                    if reason != "retry":
                        self.telemetry.sandboxes_reaped.labels(reason=reason).inc()
                    try:
                        await self._destroy(row["id"])
                    except FanfoldError as err:  # the row stays destroying; the next pass tries again
                        log.warning("fanfold reaper: %s", err)
                await self._apply_policies()
                self.pools.maintain()
            except Exception:  # noqa: BLE001 - the reaper must outlive any one failure
                log.exception("fanfold reaper: a pass failed; retrying in a second")

    # -- images -------------------------------------------------------------------------------

    async def build(self, spec: EnvSpec, on_step: OnStep | None = None) -> Image:
        """Build ``spec`` into an image, reusing every layer already built."""
        if not isinstance(spec, EnvSpec):
            raise InvalidRequest(f"build() takes an EnvSpec, got {type(spec).__name__}")
        return await self.builder.build(spec, on_step)

    async def image(self, ref: str | Image) -> Image:
        """An image from an Image, an image id, or a base name (``host``, ``debian:bookworm``)."""
        if isinstance(ref, Image):
            return ref
        if not isinstance(ref, str):
            raise ImageNotFound(f"an image is an Image, an image id or a base name, not {type(ref).__name__}")
        if ref in BASES:  # resolved once: a create from a warm pool must not wait on a build
            cached = self._bases.get(ref)
            if cached is None:
                cached = self._bases[ref] = await self.build(EnvSpec(ref))
            return cached
        return self.store.load_image(ref)

    async def images(self) -> list[Image]:
        return self.store.images()

    # -- sandboxes ----------------------------------------------------------------------------

    async def create(
        self,
        image: str | Image = "host",
        *,
        limits: Limits | None = None,
        env: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        deadline: float | None = None,
        detached: bool = False,
        tenant: str = "",
        persistence: str = "ephemeral",
        priority: int = 0,
        idle_timeout: float | None = None,
        lease: str | None = None,
        queue_timeout: float | None = None,
    ) -> SandboxInfo:
        """Start a sandbox from an image or a snapshot (id or name); it is running when this returns.

        From a memory snapshot it continues where the snapshot stopped, with the snapshot's
        cpu, memory and pids limits. ``tenant`` names the server token the sandbox belongs to
        ("" for local callers). Sticky and persistent sandboxes outlive their creator; a
        sandbox with a ``lease`` dies when the lease expires. A create waits up to
        ``queue_timeout`` seconds for a slot and for host headroom before CapacityExceeded.
        """
        if self._closing or not self._started:
            raise InfrastructureError("the engine is not running (closed or not started): start a fleet first")
        task = asyncio.current_task()
        if task is not None:
            self._creating.add(task)
        started = time.perf_counter()
        try:
            info, pooled = await self._create(
                image, limits, env, labels, deadline, detached, tenant, _persistence(persistence, priority, idle_timeout),
                self._owner_for(lease, tenant), _wait(queue_timeout, self.config.queue_timeout_s),
            )
        except (InfrastructureError, CapacityExceeded) as err:
            self.telemetry.create_failed_infra("capacity" if isinstance(err, CapacityExceeded) else "infra_error")
            raise
        finally:
            if task is not None:
                self._creating.discard(task)
        self.telemetry.created(info.source, time.perf_counter() - started, pooled=pooled)
        return info

    async def _create(self, image, limits, env, labels, deadline, detached, tenant, policy, owner, wait) -> tuple[SandboxInfo, bool]:  # type: ignore[no-untyped-def]
        if limits is not None and not isinstance(limits, Limits):
            raise InvalidRequest("limits must be a fanfold.Limits")
        env, labels = check_strings(env, "env"), check_labels(labels)
        check_deadline(deadline)
        source, img, limits = await self._source_limits(image, limits)
        check_fits_host(limits)
        persistence, priority, idle_timeout = policy
        if deadline is None and persistence != "persistent":
            deadline = self.config.default_deadline_s
        detached = detached or persistence != "ephemeral"
        if detached:
            owner = "detached"
        info = SandboxInfo(
            id="", state="running", image_id=img.id, limits=limits, labels=labels, created_at=0.0, detached=detached,
            source=source, persistence=persistence, priority=priority, idle_timeout=idle_timeout,
        )
        pooled_id = self.pools.take(source, limits)
        if pooled_id is not None:
            return self._hand_out(pooled_id, info, deadline, owner, env, tenant), True
        async with self.admission.slot(wait, self._evict_for_room):
            return await self._bring_up(info, deadline, owner, env, tenant), False

    async def _bring_up(self, info: SandboxInfo, deadline: float | None, owner: str, env: dict[str, str], tenant: str,
                        *, state: str = "running") -> SandboxInfo:
        """Insert the row, then start the sandbox; on any failure release all it got."""
        sandbox_id = "sb-" + secrets.token_hex(6)
        now = dbmod.now()
        info = dataclasses.replace(
            info, id=sandbox_id, state="creating", created_at=now, deadline_at=now + deadline if deadline else None,
        )
        # claimed_by names the engine bringing it up: if that engine dies, any engine reaps the row.
        self.db.insert(info, owner=owner, env=env, layers=(), tenant=tenant, claimed_by=self.owner)
        source, limits = info.source, info.limits
        try:
            with host_errors("creating sandbox failed"):
                pid, layers = await self._start(sandbox_id, source, limits)
        except BaseException as err:
            raced = sandbox_id in self._destroying or self.db.get(sandbox_id) is None
            await asyncio.shield(self._destroy(sandbox_id))
            if raced and not isinstance(err, asyncio.CancelledError):  # its deadline passed, or a kill came first
                raise SandboxGone(f"sandbox {sandbox_id} was destroyed while it was being created") from None
            raise
        row = self.db.get(sandbox_id)
        if row is None or row["state"] != "creating":  # killed or reaped while it was starting
            await asyncio.shield(self._destroy(sandbox_id))
            raise SandboxGone(f"sandbox {sandbox_id} was destroyed while it was being created")
        self.db.update(sandbox_id, state=state, pid=pid, layers=layers, claimed_by=None)
        if deadline:
            self._arm_deadline(sandbox_id, deadline)
        return dataclasses.replace(info, state=state)

    def _hand_out(self, sandbox_id: str, info: SandboxInfo, deadline: float | None, owner: str,
                  env: dict[str, str], tenant: str) -> SandboxInfo:
        """Give a warm sandbox the caller's owner, tenant, labels, env and deadline."""
        now = dbmod.now()
        info = dataclasses.replace(info, id=sandbox_id, created_at=now, deadline_at=now + deadline if deadline else None)
        self.db.update(
            sandbox_id, state="running", owner=owner, tenant=tenant, labels=json.dumps(info.labels), env=json.dumps(env),
            created_at=now, active_at=now, deadline_at=info.deadline_at, detached=int(info.detached),
            persistence=info.persistence, priority=info.priority, idle_timeout=info.idle_timeout,
        )
        if deadline:
            self._arm_deadline(sandbox_id, deadline)
        return info

    async def _bring_up_pooled(self, source: str, limits: Limits) -> str:
        """A sandbox for a warm pool: up, owned by this engine, unreachable until handed out."""
        img_id = self.snaps.row(source)["image_id"] if source.startswith(SNAPSHOT_PREFIX) else source
        info = SandboxInfo(id="", state="pooled", image_id=img_id, limits=limits, source=source)
        async with self.admission.slot(self.config.queue_timeout_s, None):
            made = await self._bring_up(info, None, self.owner, {}, "", state="pooled")
        return made.id

    def _arm_deadline(self, sandbox_id: str, deadline: float) -> None:
        """Destroy the sandbox ``deadline`` seconds from now (instead of at any earlier deadline)."""
        if (timer := self._timers.pop(sandbox_id, None)) is not None:
            timer.cancel()

        def expire() -> None:
            self.telemetry.sandboxes_reaped.labels(reason="deadline").inc()
            asyncio.ensure_future(self._destroy(sandbox_id))

        self._timers[sandbox_id] = asyncio.get_running_loop().call_later(deadline, expire)

    async def _source_limits(self, ref: str | Image | SnapshotInfo, limits: Limits | None) -> tuple[str, Image, Limits]:
        """What a sandbox is made from (source id, root image), and the limits it gets:
        a memory snapshot's processes keep the limits they were dumped with."""
        source, img, snapshot = await self._source(ref)
        if snapshot is not None and snapshot.memory:
            return source, img, _limits_of(snapshot, limits)
        return source, img, limits or Limits()

    async def _source(self, ref: str | Image | SnapshotInfo) -> tuple[str, Image, SnapshotInfo | None]:
        """What a sandbox is made from: (source id, root image, snapshot or None)."""
        if isinstance(ref, SnapshotInfo):
            ref = ref.id
        snapshot_id = self.resolve_snapshot(ref)  # type: ignore[arg-type]
        if snapshot_id is not None or (isinstance(ref, str) and ref.startswith(SNAPSHOT_PREFIX)):
            snapshot = dbmod.snapshot_info(self.snaps.row(snapshot_id or ref))  # type: ignore[arg-type]
            return snapshot.id, self.store.load_image(snapshot.image_id), snapshot
        img = await self.image(ref)  # type: ignore[arg-type]
        return img.id, img, None

    async def _start(self, sandbox_id: str, source: str, limits: Limits) -> tuple[int | None, tuple[str, ...]]:
        """Bring up a sandbox's disk and processes from its source; return PID 1 and its layers."""
        restore = None
        if source.startswith(SNAPSHOT_PREFIX):
            row = self.snaps.row(source)
            img = dataclasses.replace(self.store.load_image(row["image_id"]), layers=tuple(json.loads(row["layers"])))
            restore = self.snaps.memory_dir(source) if row["memory"] else None
        else:
            img = self.store.load_image(source)
        return await self._bring_up_from(sandbox_id, img, limits, restore), img.layers

    async def _bring_up_from(self, sandbox_id: str, img: Image, limits: Limits, restore: Path | None) -> int | None:
        """Start the sandbox over ``img``'s layers (restoring ``restore``'s processes when given)."""
        spec = SandboxSpec(
            id=sandbox_id, layers=img.layers, host_dirs=img.host_dirs, limits=limits,
            env=tuple(self._base_env(img, sandbox_id, {})), services=img.services, restore=restore,
        )
        handle = await self.backend.bring_up(spec)
        if img.services and (restore is None or self.backend.capabilities.memory != "live"):
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

    def _base_env(self, img: Image, sandbox_id: str, extra: dict[str, str]) -> list[str]:
        merged = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "HOSTNAME": sandbox_id, "TERM": "xterm"}
        merged.update(dict(img.env))
        merged.update(extra)
        return [f"{key}={value}" for key, value in merged.items()]

    def _known(self, sandbox_id: str) -> Any:
        """The row of a live sandbox (running, paused or suspended)."""
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise SandboxNotFound(f"bad sandbox id {sandbox_id!r}")
        row = self._visible(sandbox_id)
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}: it never existed or was destroyed")
        if row["state"] not in ("running", "paused", "suspended"):
            raise SandboxGone(f"sandbox {sandbox_id} is {row['state']}")
        return row

    def _gate(self, sandbox_id: str) -> Gate:
        gate = self._gates.get(sandbox_id)
        if gate is None:
            gate = self._gates[sandbox_id] = Gate()
        return gate

    @asynccontextmanager
    async def _changing(self, sandbox_id: str, *, wake: bool = True) -> AsyncIterator[Any]:
        """Hold the sandbox alone (no call in flight); with ``wake``, paused or suspended is woken first."""
        self._known(sandbox_id)
        async with self._gate(sandbox_id).change():
            row = self._known(sandbox_id)
            if wake and row["state"] != "running":
                await self._wake_locked(row)
                row = self._known(sandbox_id)
            self.db.touch(sandbox_id)
            yield row

    @asynccontextmanager
    async def _using(self, sandbox_id: str) -> AsyncIterator[Any]:
        """Hold the sandbox for a call, waking it first if paused or suspended.

        Activity is stamped as the call starts and as it ends, so a long command does not
        leave the sandbox looking idle the moment it finishes.
        """
        gate = self._gate(sandbox_id)
        for _ in range(3):
            async with gate.call():
                row = self._known(sandbox_id)
                if row["state"] == "running":
                    self.db.touch(sandbox_id)
                    try:
                        yield row
                    finally:
                        self.db.touch(sandbox_id)
                    return
            async with self._changing(sandbox_id):
                pass  # woken; take the call again
        raise SandboxGone(f"sandbox {sandbox_id} keeps being paused or suspended by other calls; try again")

    async def _gone_if_dead(self, sandbox_id: str, pid: int | None, *, within: float = 0.0) -> None:
        """Destroy the sandbox and raise SandboxGone if its PID 1 is dead (``within`` seconds
        to show it, after a broken connection): no retry can bring it back."""
        if await _init_survives(self.backend, Handle(sandbox_id, pid), within):
            return
        self.telemetry.sandboxes_reaped.labels(reason="crashed").inc()
        await asyncio.shield(self._destroy(sandbox_id))
        raise SandboxGone(f"sandbox {sandbox_id}'s init process died (killed from outside or crashed);"
                          " the sandbox was destroyed")

    def _visible(self, sandbox_id: str) -> Any:
        """A sandbox's row, or None when there is none or it is warm in a pool (nobody's yet)."""
        row = self.db.get(sandbox_id) if isinstance(sandbox_id, str) else None
        return None if row is None or row["state"] == "pooled" else row

    async def get(self, sandbox_id: str) -> SandboxInfo:
        row = self._visible(sandbox_id)
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        return dbmod.row_info(row)

    def tenant_of(self, sandbox_id: str) -> str | None:
        """The tenant a sandbox belongs to, or None when there is no such sandbox."""
        row = self._visible(sandbox_id)
        return None if row is None else row["tenant"]

    async def list(self, labels: dict[str, str] | None = None, *, tenant: str | None = None) -> list[SandboxInfo]:
        """Every sandbox (of ``tenant`` only, when given) that carries all of ``labels``."""
        rows = [row for row in self.db.rows() if row["state"] != "pooled"]
        infos = [dbmod.row_info(row) for row in rows if tenant is None or row["tenant"] == tenant]
        wanted = (labels or {}).items()
        return [info for info in infos if all(info.labels.get(k) == v for k, v in wanted)]

    async def kill(self, sandbox_id: str) -> None:
        """Destroy a sandbox and release everything it held."""
        if self._visible(sandbox_id) is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        await self._destroy(sandbox_id)

    async def _destroy(self, sandbox_id: str) -> None:
        """Destroy once: concurrent callers (kill, deadline, reaper) share one release."""
        task = self._destroying.get(sandbox_id)
        if task is None:
            task = asyncio.ensure_future(self._release(sandbox_id))
            self._destroying[sandbox_id] = task
            task.add_done_callback(lambda _: self._destroying.pop(sandbox_id, None))
        await asyncio.shield(task)

    async def _release(self, sandbox_id: str) -> None:
        timer = self._timers.pop(sandbox_id, None)
        if timer is not None:
            timer.cancel()
        self.pools.forget(sandbox_id)
        row = self.db.get(sandbox_id)
        if row is not None:
            self.db.update(sandbox_id, state="destroying", claimed_by=self.owner)
        await self.backend.release(sandbox_id, dbmod.row_handle(row) if row is not None else None)
        self.db.delete(sandbox_id)
        self._gates.pop(sandbox_id, None)
        self.admission.released()
        # A sandbox's suspend images die with it, and so does a fork's snapshot with its last child.
        spent = self._own_suspends(sandbox_id)
        if row is not None and row["source"].startswith(SNAPSHOT_PREFIX):
            source = self.db.snapshot(row["source"])
            if source is not None and source["kind"] == "fork":
                spent.add(source["id"])
        await self._collect(spent)

    # -- exec ---------------------------------------------------------------------------------

    async def exec(
        self,
        sandbox_id: str,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        on_output: OnOutput | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (a shell string or an argv list) in the sandbox and return its typed result."""
        argv, stdin_bytes, limit = check_exec_args(cmd, stdin, timeout, max_output, self.config.max_output_bytes)
        started = time.perf_counter()
        try:
            async with self._using(sandbox_id) as row:
                result = await self._exec(row, argv, cwd, env, stdin_bytes, timeout, limit, on_output)
        except InfrastructureError:
            self.telemetry.exec_failed_infra()
            raise
        self.telemetry.executed(time.perf_counter() - started, result.outcome.value)
        return result

    async def _exec(self, row, argv, cwd, env, stdin_bytes, timeout, limit, on_output) -> ExecResult:  # type: ignore[no-untyped-def]
        sandbox_id = row["id"]
        img = self.store.load_image(row["image_id"])
        workdir = safefs.normalize(cwd, img.workdir) if cwd is not None else img.workdir
        merged = {**json.loads(row["env"]), **check_strings(env, "env")}
        alone = not self._in_exec.get(sandbox_id)
        self._in_exec[sandbox_id] = self._in_exec.get(sandbox_id, 0) + 1
        handle = dbmod.row_handle(row)
        counters = self.backend.counters(handle)
        if alone:  # the peak then measures this command alone
            counters.reset_peak()
        before = counters.read()
        try:
            raw = await asyncio.wait_for(
                self.backend.exec(
                    handle, argv, env=self._base_env(img, sandbox_id, merged), cwd=workdir,
                    timeout_ms=0 if timeout is None else max(1, math.ceil(timeout * 1000)),
                    max_output=limit, stdin=stdin_bytes, on_chunk=on_output,
                ),
                None if timeout is None else timeout + 30,
            )
        except (AgentUnreachable, asyncio.TimeoutError) as err:
            if sandbox_id in self._destroying:
                await asyncio.shield(self._destroying[sandbox_id])
            now_row = self.db.get(sandbox_id)
            if now_row is None or now_row["state"] != "running":
                raise SandboxGone(f"sandbox {sandbox_id} was destroyed during the command") from None
            await self._gone_if_dead(sandbox_id, now_row["pid"], within=0.25)
            raise InfrastructureError(f"lost contact with sandbox {sandbox_id}'s agent: {err}") from None
        finally:
            left = self._in_exec.pop(sandbox_id, 1) - 1
            if left:
                self._in_exec[sandbox_id] = left
            after = counters.read()
            counters.close()
        return build_result(raw, argv, before, after, workdir)


def _wait(queue_timeout: float | None, default: float) -> float:
    if queue_timeout is None:
        return default
    if isinstance(queue_timeout, bool) or not isinstance(queue_timeout, (int, float)) or queue_timeout < 0:
        raise InvalidRequest(f"queue_timeout must be a non-negative number of seconds, got {queue_timeout!r}")
    return float(queue_timeout)


def _persistence(persistence: str, priority: int, idle_timeout: float | None) -> tuple[str, int, float | None]:
    names = [p.value for p in Persistence]
    value = persistence.value if isinstance(persistence, Persistence) else persistence
    if value not in names:
        raise InvalidRequest(f"persistence must be one of {', '.join(names)}, got {persistence!r}")
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 10:
        raise InvalidRequest(f"priority must be a whole number from 0 to 10, got {priority!r}")
    if idle_timeout is not None and (
        isinstance(idle_timeout, bool) or not isinstance(idle_timeout, (int, float)) or idle_timeout <= 0
    ):
        raise InvalidRequest(f"idle_timeout must be a positive number of seconds, got {idle_timeout!r}")
    return value, priority, None if idle_timeout is None else float(idle_timeout)
