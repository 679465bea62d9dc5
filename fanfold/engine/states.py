"""Changes of a sandbox's state: snapshot, fork, pause, suspend, resume, reset.

Mixed into Engine. Each runs with the sandbox's gate held alone (no command or file call
in flight), so what is frozen and copied is a state no host call is halfway through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import time
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointFailed, InfrastructureError, InvalidRequest, SandboxGone
from ..host.offload import host_errors, on_thread
from ..models import ExecResult, ForkResult, Limits, SandboxInfo, SnapshotInfo
from ..spec import BASES
from . import db as dbmod
from .admission import memory_available_mb
from .api import MAX_FORK
from .checks import check_deadline
from .execution import check_exec_args
from .host_ops import LEASE_PREFIX
from . import snapshots as snapmod

if TYPE_CHECKING:
    from .core import Engine

log = logging.getLogger("fanfold.engine")


class SandboxStates:
    """Snapshot, fork, pause/unpause, suspend/resume and reset, for Engine."""

    # -- snapshots ----------------------------------------------------------------------------

    async def snapshot(self: Engine, sandbox_id: str, *, memory: bool = False, name: str | None = None) -> SnapshotInfo:
        """Checkpoint the sandbox's disk (and with ``memory``, its processes); it keeps running."""
        if not isinstance(memory, bool):
            raise InvalidRequest(f"memory must be True or False, got {memory!r}")
        name = snapmod.check_name(name)
        if memory:
            self._check_memory_checkpoints("a memory snapshot")
        if name is not None and self.db.snapshot(name) is not None:
            raise InvalidRequest(f"a snapshot named {name!r} exists already: pick another name")
        async with self._changing(sandbox_id) as row:
            info, _ = await self._take(row, memory=memory, kind="snapshot", name=name, leave_running=True)
            return info

    async def _take(
        self: Engine, row: Any, *, memory: bool, kind: str, name: str | None = None, leave_running: bool
    ) -> tuple[SnapshotInfo, float]:
        """Freeze, copy the disk, maybe dump memory, thaw; return the snapshot and the pause in ms."""
        sandbox_id = row["id"]
        await self._gone_if_dead(sandbox_id, row["pid"])
        img = self.store.load_image(row["image_id"])
        snapshot_id = snapmod.new_id()
        staged = self.snaps.staging(snapshot_id)
        try:
            pause_ms = await self.backend.checkpoint(
                dbmod.row_handle(row), staged, img.host_dirs, memory=memory, leave_running=leave_running,
                frozen=row["state"] == "paused",
            )
            layers = tuple(json.loads(row["layers"]))
            info = SnapshotInfo(
                id=snapshot_id, parent=row["source"], image_id=row["image_id"], sandbox_id=sandbox_id, memory=memory,
                kind=kind, created_at=dbmod.now(), name=name, limits=dbmod.row_info(row).limits,
            )
            # Renames, a walk over every file for the size, and the row: off the event loop,
            # and waited for even when cancelled, since the cleanup below removes ``staged``.
            with host_errors(f"committing the snapshot of {sandbox_id} failed"):
                committed = await on_thread(
                    self.snaps.commit, staged, info, layers + (snapshot_id,), row["tenant"], executor=None)
            return committed, pause_ms
        except (CheckpointFailed, InfrastructureError):
            # PID 1 dying mid-dump shows as a missing /proc file or a failed dump: the sandbox is gone.
            await self._gone_if_dead(sandbox_id, row["pid"], within=0.25)
            raise
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def _check_memory_checkpoints(self: Engine, what: str) -> None:
        if self.backend.capabilities.memory == "none":
            raise InvalidRequest(f"{what} needs memory checkpoints, which the {self.backend.name} backend"
                                 " does not have: take a disk snapshot, or use the oci backend")

    async def snapshots(self: Engine, *, tenant: str | None = None) -> list[SnapshotInfo]:
        """Every snapshot (of ``tenant`` only, when given), oldest first; ``parent`` links the tree."""
        rows = self.db.snapshot_rows()
        return [dbmod.snapshot_info(r) for r in rows if tenant is None or r["tenant"] == tenant]

    async def get_snapshot(self: Engine, snapshot_id: str) -> SnapshotInfo:
        return dbmod.snapshot_info(self.snaps.row(snapshot_id))

    def resolve_snapshot(self: Engine, ref: str) -> str | None:
        """The snapshot a create's ``image`` names (its id or name), or None when it names an image.

        Base names and image ids always mean the image, whatever a snapshot is called.
        """
        if not isinstance(ref, str) or not ref or ref in BASES or ref.startswith("img-"):
            return None
        row = self.db.snapshot(ref)
        return None if row is None else row["id"]

    def snapshot_tenant(self: Engine, ref: str) -> str | None:
        row = self.db.snapshot(ref) if isinstance(ref, str) and ref else None
        return None if row is None else row["tenant"]

    async def delete_snapshot(self: Engine, snapshot_id: str) -> None:
        """Delete a snapshot no sandbox or later snapshot stands on."""
        await asyncio.to_thread(self.snaps.delete, snapshot_id)

    async def gc(self: Engine, *, tenant: str | None = None) -> list[str]:
        """Delete every snapshot that has no name and that no sandbox or kept snapshot needs."""
        return await asyncio.to_thread(self.snaps.collect, None, tenant)

    # -- fork ---------------------------------------------------------------------------------

    async def fork(
        self: Engine, sandbox_id: str, count: int, *, cmd: str | list[str] | None = None, deadline: float | None = None,
    ) -> ForkResult:
        """``count`` live copies of a running sandbox; it pauses only while its memory is dumped.

        Each child has its own disk copy, processes, pid and network namespaces, hostname,
        sandbox id and kernel randomness. ``cmd`` runs in each child right after the fork.
        Children end at the parent's deadline, or ``deadline`` seconds from now when given.
        """
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORK:
            raise InvalidRequest(f"count must be a whole number from 1 to {MAX_FORK}, got {count!r}")
        if cmd is not None:
            check_exec_args(cmd, None, None, None, 0)  # before any child exists to leak
        check_deadline(deadline)
        self._check_memory_checkpoints("fork")
        started = time.perf_counter()
        async with self._changing(sandbox_id) as row:
            snap, pause_ms = await self._take(row, memory=True, kind="fork", leave_running=True)
            parent = dbmod.row_info(row)
            env = json.loads(row["env"])
        if deadline is None and parent.deadline_at is not None:
            # A fresh default deadline would let the children outlive their parent's.
            deadline = max(parent.deadline_at - dbmod.now(), 0.001)  # past it, they are reaped at once
        made = await asyncio.gather(*(
            self.create(
                snap.id, limits=parent.limits, env=env, labels=parent.labels, deadline=deadline,
                detached=parent.detached, tenant=row["tenant"], persistence=parent.persistence,
                priority=parent.priority, idle_timeout=parent.idle_timeout, lease=_lease_of(row["owner"]),
            ) for _ in range(count)
        ), return_exceptions=True)
        children = [c for c in made if isinstance(c, SandboxInfo)]
        failed = [c for c in made if isinstance(c, BaseException)]
        if failed:
            await asyncio.gather(*(self._destroy(c.id) for c in children), return_exceptions=True)
            await self._collect({snap.id})
            raise failed[0]
        setup: tuple[ExecResult, ...] = ()
        if cmd is not None:
            try:
                setup = tuple(await asyncio.gather(*(self.exec(c.id, cmd) for c in children)))
            except BaseException:
                await asyncio.shield(asyncio.gather(*(self._destroy(c.id) for c in children), return_exceptions=True))
                raise
        return ForkResult(
            parent_id=sandbox_id, children=tuple(children), snapshot_id=snap.id, parent_pause_ms=round(pause_ms, 2),
            total_ms=round((time.perf_counter() - started) * 1000, 2), setup=setup,
        )

    # -- pause, suspend, resume, reset --------------------------------------------------------

    async def pause(self: Engine, sandbox_id: str) -> SandboxInfo:
        """Freeze every process; memory stays resident. The next call (or ``unpause``) thaws it."""
        async with self._changing(sandbox_id, wake=False) as row:
            if row["state"] == "running":
                await self._gone_if_dead(sandbox_id, row["pid"])  # a dead sandbox would freeze at once
                await self.backend.freeze(dbmod.row_handle(row))
                self.db.update(sandbox_id, state="paused")
            elif row["state"] == "suspended":
                raise InvalidRequest(f"sandbox {sandbox_id} is suspended: resume() it before pausing")
        return await self.get(sandbox_id)

    async def unpause(self: Engine, sandbox_id: str) -> SandboxInfo:
        """Thaw a paused sandbox (a running one is left as it is)."""
        async with self._changing(sandbox_id):
            pass  # waking is what _changing does
        return await self.get(sandbox_id)

    async def suspend(self: Engine, sandbox_id: str) -> SandboxInfo:
        """Checkpoint memory and disk to the state dir and release every process and byte of RAM."""
        self._check_memory_checkpoints("suspend")
        async with self._changing(sandbox_id, wake=False) as row:
            if row["state"] != "suspended":
                await self._suspend_locked(row)
        return await self.get(sandbox_id)

    async def _suspend_locked(self: Engine, row: Any) -> None:
        sandbox_id = row["id"]
        snap, _ = await self._take(row, memory=True, kind="suspend", leave_running=False)
        await self.backend.release(sandbox_id, dbmod.row_handle(row))
        self.db.update(sandbox_id, state="suspended", pid=None, suspended_to=snap.id, layers=_layers(row) + (snap.id,))

    async def resume(self: Engine, sandbox_id: str) -> SandboxInfo:
        """Bring a suspended (or paused) sandbox back, processes and all, where it stopped."""
        async with self._changing(sandbox_id):
            pass
        return await self.get(sandbox_id)

    async def _wake_locked(self: Engine, row: Any) -> None:
        sandbox_id = row["id"]
        if row["state"] == "paused":
            try:
                await self.backend.thaw(dbmod.row_handle(row))
            except InfrastructureError:  # killed from outside?
                await self._gone_if_dead(sandbox_id, row["pid"])
                raise
            self.db.update(sandbox_id, state="running")
        elif row["state"] == "suspended":
            snapshot_id = row["suspended_to"]
            img = self.store.load_image(row["image_id"])
            limits = dbmod.row_info(row).limits
            img = dataclasses.replace(img, layers=_layers(row))
            with host_errors(f"resuming sandbox {sandbox_id} failed"):
                try:
                    pid = await self._bring_up_from(sandbox_id, img, limits, self.snaps.memory_dir(snapshot_id))
                except BaseException:
                    await asyncio.shield(self.backend.release(sandbox_id))
                    raise
            self.db.update(sandbox_id, state="running", pid=pid, suspended_to=None)
            self.snaps.drop_memory(snapshot_id)

    async def reset(self: Engine, sandbox_id: str) -> SandboxInfo:
        """Back to exactly the image or snapshot the sandbox was made from: disk, processes, memory."""
        async with self._changing(sandbox_id, wake=False) as row:
            await self.backend.release(sandbox_id, dbmod.row_handle(row))
            self.db.update(sandbox_id, state="creating", pid=None, suspended_to=None, claimed_by=self.owner)
            try:
                with host_errors(f"resetting sandbox {sandbox_id} failed"):
                    pid, layers = await self._start(sandbox_id, row["source"], dbmod.row_info(row).limits)
            except BaseException:
                await asyncio.shield(self._destroy(sandbox_id))
                raise
            self.db.update(sandbox_id, state="running", pid=pid, layers=layers, claimed_by=None)
            await self._collect(self._own_suspends(sandbox_id))
        return await self.get(sandbox_id)

    async def _collect(self: Engine, candidates: set[str]) -> None:
        """Delete those of ``candidates`` nothing needs any more (most calls have none to offer)."""
        if candidates:
            await asyncio.to_thread(self.snaps.collect, candidates)

    def _own_suspends(self: Engine, sandbox_id: str) -> set[str]:
        return self.db.snapshot_ids(kind="suspend", sandbox_id=sandbox_id)

    # -- idle and pressure --------------------------------------------------------------------

    async def _apply_policies(self: Engine) -> None:
        """Suspend (or destroy, if ephemeral) idle sandboxes; evict sticky ones under pressure."""
        now = dbmod.now()
        for row in self.db.rows():
            mine = row["owner"] in (self.owner, "detached")
            idle = row["idle_timeout"] is not None and now - row["active_at"] > row["idle_timeout"]
            if not (mine and idle and row["state"] in ("running", "paused")) or self._gate(row["id"]).busy:
                continue
            if row["persistence"] == "ephemeral":
                await self._destroy(row["id"])
            elif self.db.claim(row["id"], self.owner):
                try:
                    await self.suspend(row["id"])
                except (SandboxGone, CheckpointFailed, InfrastructureError) as err:
                    log.warning("fanfold: idle sandbox %s: %s", row["id"], err)
                finally:
                    self.db.unclaim(row["id"])
        if self._under_pressure():
            victim = self._sticky_victim()
            if victim is not None:
                log.warning("fanfold: host under pressure; evicting sticky sandbox %s", victim)
                await self._destroy(victim)

    def _sticky_victim(self: Engine) -> str | None:
        """The sticky sandbox to evict first: lowest priority, then longest idle; none in a call."""
        sticky = [r for r in self.db.rows() if r["persistence"] == "sticky"
                  and r["state"] in ("running", "paused", "suspended") and not self._gate(r["id"]).busy]
        return min(sticky, key=lambda r: (r["priority"], r["active_at"]))["id"] if sticky else None

    def _under_pressure(self: Engine) -> bool:
        disk = shutil.disk_usage(self.config.state_dir)
        return memory_available_mb() < self.config.pressure_memory_mb or disk.free < self.config.pressure_disk_mb << 20


def _lease_of(owner: str) -> str | None:
    """Fork children belong to their parent's lease, if it has one."""
    return owner.removeprefix(LEASE_PREFIX) if owner.startswith(LEASE_PREFIX) else None


def _layers(row: Any) -> tuple[str, ...]:
    return tuple(json.loads(row["layers"]))


def _limits_of(snapshot: SnapshotInfo, asked: Limits | None) -> Limits:
    """A memory snapshot's processes keep the cpu, memory and pids limits they were dumped with."""
    base = snapshot.limits or Limits()
    return base if asked is None else Limits(cpus=base.cpus, memory_mb=base.memory_mb, pids=base.pids, disk_mb=asked.disk_mb)
