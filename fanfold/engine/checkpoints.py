"""Changes of a sandbox's state: snapshot, fork, pause, suspend, resume, reset.

Each runs with the sandbox's gate held alone (no command or file call in flight), so what
is frozen and copied is a state no host call is halfway through.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from ..errors import CheckpointFailed, CheckpointRaced, InfrastructureError, InvalidRequest, SandboxGone
from ..host.offload import host_errors, on_thread
from ..models import CreateParams, ExecResult, ForkResult, SandboxInfo, SnapshotInfo
from . import db as dbmod
from .api import MAX_FORK
from .checks import check_deadline
from .execution import check_exec_args
from .lifecycle import Lifecycle
from .leases import LEASE_PREFIX
from . import snapshots as snapmod

log = logging.getLogger("fanfold.engine")

RACED_RETRIES = 3
"""Dumps tried again when each met a moment that passes (``CheckpointRaced``)."""
RACED_WAIT_S = 0.01
"""The sandbox runs this long before the second try, four times longer before each next (10, 40, 160 ms)."""


class Checkpoints:
    """Snapshot, fork, pause/unpause, suspend/resume and reset."""

    def __init__(self, life: Lifecycle, create: Callable[..., Awaitable[SandboxInfo]],
                 exec_: Callable[..., Awaitable[ExecResult]]) -> None:
        self.life = life
        self._create, self._exec = create, exec_

    # -- snapshots ----------------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, *, memory: bool = False, name: str | None = None) -> SnapshotInfo:
        """Checkpoint the sandbox's disk (and with ``memory``, its processes); it keeps running."""
        if not isinstance(memory, bool):
            raise InvalidRequest(f"memory must be True or False, got {memory!r}")
        name = snapmod.check_name(name)
        if memory:
            self._check_memory_checkpoints("a memory snapshot", sandbox_id)
        if name is not None and (row := self.life.db.get(sandbox_id)) is not None \
                and self.life.db.snapshot(name, row["tenant"]) is not None:  # names are each tenant's own
            raise InvalidRequest(f"a snapshot named {name!r} exists already: pick another name")
        async with self.life.changing(sandbox_id, interrupt=True) as row:
            info, _ = await self._take(row, memory=memory, kind="snapshot", name=name, leave_running=True)
            return info

    async def _take(
        self,
        row: Any, *, memory: bool, kind: str, name: str | None = None, leave_running: bool
    ) -> tuple[SnapshotInfo, float]:
        """Freeze, copy the disk, maybe dump memory, thaw; return the snapshot and the pause in ms."""
        sandbox_id = row["id"]
        await self.life.gone_if_dead(sandbox_id, row["pid"])
        img = self.life.sources.store.load_image(row["image_id"])
        snapshot_id = snapmod.new_id(self.life.config.node_tag)
        with host_errors(f"staging the snapshot of {sandbox_id} failed"):
            staged = self.life.snaps.staging(snapshot_id)
        try:
            pause_ms = await self._checkpoint(row, staged, img.host_dirs, memory=memory, leave_running=leave_running)
            if (staged / "memory").is_dir():  # whose checkpoint it is: no other backend can restore it
                (staged / "memory" / snapmod.TIER_FILE).write_text(self.life.backend.name)
            layers = dbmod.row_layers(row)
            info = SnapshotInfo(
                id=snapshot_id, parent=row["source"], image_id=row["image_id"], sandbox_id=sandbox_id, memory=memory,
                kind=kind, created_at=dbmod.now(), name=name, limits=dbmod.row_info(row).limits,
            )
            # Renames, a walk over every file for the size, and the row: off the event loop,
            # and waited for even when cancelled, since the cleanup below removes ``staged``.
            with host_errors(f"committing the snapshot of {sandbox_id} failed"):
                committed = await on_thread(
                    self.life.snaps.commit, staged, info, layers + (snapshot_id,), row["tenant"], executor=None)
            return committed, pause_ms
        except (CheckpointFailed, InfrastructureError) as err:
            # PID 1 dying mid-dump shows as a missing /proc file or a failed dump: the sandbox is gone.
            await self.life.gone_if_dead(sandbox_id, row["pid"], within=0.25, why=str(err))
            raise
        finally:
            await on_thread(self.life.snaps.discard, staged, executor=None)  # and a layer taken by reference

    async def _checkpoint(self, row: Any, staged: Path, host_dirs: tuple[str, ...], *, memory: bool,
                          leave_running: bool) -> float:
        """The backend's checkpoint into ``staged``; the pause in ms. One that met a moment that passes
        (``CheckpointRaced``) is tried again, the sandbox running in between, unless its owner paused it."""
        paused = row["state"] == "paused"

        async def checkpoint() -> float:
            return await self.life.backend.checkpoint(
                dbmod.row_handle(row), staged, host_dirs, memory=memory, leave_running=leave_running, frozen=paused)

        for attempt in range(RACED_RETRIES):
            try:
                return await checkpoint()
            except CheckpointRaced as err:
                if paused:
                    raise
                log.info("%s: %s; trying again", row["id"], err)
            with host_errors(f"staging the snapshot of {row['id']} again failed"):
                await on_thread(self.life.snaps.discard, staged, executor=None)
                await on_thread(staged.mkdir, executor=None)
            await asyncio.sleep(RACED_WAIT_S * 4 ** attempt)  # the listener accepts meanwhile
        return await checkpoint()

    def _check_memory_checkpoints(self, what: str, sandbox_id: str) -> None:
        if self.life.backend.capabilities.memory == "none":
            raise InvalidRequest(f"{what} needs memory checkpoints, which the {self.life.backend.name} backend"
                                 " does not have: take a disk snapshot, or use the oci backend")
        row = self.life.db.get(sandbox_id)
        if row is not None and row["nested"]:
            # CRIU dumps no FUSE mount (podman's storage) nor a user namespace inside another.
            raise InvalidRequest(f"{what} of sandbox {sandbox_id} is refused: it was created with nested=True"
                                 " (containers inside), which memory checkpoints cannot hold; take a disk snapshot"
                                 " (memory=False), or create copies afresh with nested=True")
        if row is not None and row["gpu_ids"] != "[]":
            # Checked before anything is frozen. CRIU saves no GPU state: a restore would come back with
            # CUDA contexts pointing at device memory that is gone.
            raise InvalidRequest(f"{what} of sandbox {sandbox_id} is refused: it holds a GPU, whose memory a"
                                 " checkpoint cannot keep; take a disk snapshot (memory=False), or create the"
                                 " copies afresh from its image")

    async def snapshots(self, *, tenant: str | None = None) -> list[SnapshotInfo]:
        """Every snapshot (of ``tenant`` only, when given), oldest first; ``parent`` links the tree."""
        rows = self.life.db.snapshot_rows()
        return [dbmod.snapshot_info(r) for r in rows if tenant is None or r["tenant"] == tenant]

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return dbmod.snapshot_info(self.life.snaps.row(snapshot_id))

    def snapshot_tenant(self, ref: str) -> str | None:
        row = self.life.db.snapshot(ref) if isinstance(ref, str) and ref else None
        return None if row is None else row["tenant"]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot no sandbox or later snapshot stands on."""
        await asyncio.to_thread(self.life.snaps.delete, snapshot_id)

    async def gc(self, *, tenant: str | None = None) -> list[str]:
        """Delete every snapshot that has no name and that no sandbox or kept snapshot needs."""
        return await asyncio.to_thread(self.life.snaps.collect, None, tenant)

    # -- fork ---------------------------------------------------------------------------------

    async def fork(
        self,
        sandbox_id: str, count: int, *, cmd: str | list[str] | None = None, deadline: float | None = None,
        groups: list[tuple[str, str]] | None = None,
    ) -> ForkResult:
        """``count`` live copies of a running sandbox; it pauses only while its memory is dumped.

        Each child has its own disk copy, processes, pid and network namespaces, hostname,
        sandbox id and kernel randomness. ``cmd`` runs in each child right after the fork.
        Children end at the parent's deadline, or ``deadline`` seconds from now when given.
        ``groups``: the (group id, member name) each child joins (a group's fork), else none.
        """
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORK:
            raise InvalidRequest(f"count must be a whole number from 1 to {MAX_FORK}, got {count!r}")
        if cmd is not None:
            check_exec_args(cmd, None, None, None, 0)  # before any child exists to leak
        check_deadline(deadline)
        self._check_memory_checkpoints("fork", sandbox_id)
        if not groups and (row := self.life.db.get(sandbox_id)) is not None and row["group_id"]:
            raise InvalidRequest(f"sandbox {sandbox_id} is member {row['member']!r} of group {row['group_id']}: its"
                                 " copy would have no group to join; fork the whole group (group.fork(n))")
        started = time.perf_counter()
        async with self.life.changing(sandbox_id, interrupt=True) as row:
            snap, pause_ms = await self._take(row, memory=True, kind="fork", leave_running=True)
            parent = dbmod.row_info(row)
            env = json.loads(row["env"])
        if deadline is None and parent.deadline_at is not None:
            # A fresh default deadline would let the children outlive their parent's.
            deadline = max(parent.deadline_at - dbmod.now(), 0.001)  # past it, they are reaped at once
        params = CreateParams(
            image=snap.id, limits=parent.limits, env=env, labels=parent.labels, deadline=deadline,
            detached=parent.detached, persistence=parent.persistence, priority=parent.priority,
            idle_timeout=parent.idle_timeout, user=parent.user or None, seccomp=parent.seccomp, network=parent.network,
        )
        made = await asyncio.gather(*(
            self._create(params, tenant=row["tenant"], lease=_lease_of(row["owner"]),
                         **({"group": groups[n]} if groups else {})) for n in range(count)
        ), return_exceptions=True)
        children = [c for c in made if isinstance(c, SandboxInfo)]
        failed = [c for c in made if isinstance(c, BaseException)]
        if failed:
            await asyncio.gather(*(self.life.destroy(c.id) for c in children), return_exceptions=True)
            await self.life.collect({snap.id})
            raise failed[0]
        setup: tuple[ExecResult, ...] = ()
        if cmd is not None:
            try:
                setup = tuple(await asyncio.gather(*(self._exec(c.id, cmd) for c in children)))
            except BaseException:
                await asyncio.shield(asyncio.gather(*(self.life.destroy(c.id) for c in children), return_exceptions=True))
                raise
        return ForkResult(
            parent_id=sandbox_id, children=tuple(children), snapshot_id=snap.id, parent_pause_ms=round(pause_ms, 2),
            total_ms=round((time.perf_counter() - started) * 1000, 2), setup=setup,
        )

    # -- pause, suspend, resume, reset --------------------------------------------------------

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        """Freeze every process; memory stays resident. The next call (or ``unpause``) thaws it."""
        async with self.life.changing(sandbox_id, wake=False, interrupt=True) as row:
            if row["state"] == "running":
                await self.life.gone_if_dead(sandbox_id, row["pid"])  # a dead sandbox would freeze at once
                await self.life.backend.freeze(dbmod.row_handle(row))
                self.life.db.update(sandbox_id, state="paused")
            elif row["state"] == "suspended":
                raise InvalidRequest(f"sandbox {sandbox_id} is suspended: resume() it before pausing")
        return self.life.info(sandbox_id)

    async def unpause(self, sandbox_id: str) -> SandboxInfo:
        """Thaw a paused sandbox (a running one is left as it is)."""
        async with self.life.changing(sandbox_id):
            pass  # waking is what _changing does
        return self.life.info(sandbox_id)

    async def suspend(self, sandbox_id: str) -> SandboxInfo:
        """Checkpoint memory and disk to the state dir and release every process and byte of RAM."""
        self._check_memory_checkpoints("suspend", sandbox_id)
        async with self.life.changing(sandbox_id, wake=False, interrupt=True) as row:
            if row["state"] != "suspended":
                await self._suspend_locked(row)
        return self.life.info(sandbox_id)

    async def _suspend_locked(self, row: Any) -> None:
        sandbox_id = row["id"]
        # Claimed while its processes go (CRIU ends them): an engine that saw it running with a dead
        # PID 1 would destroy it as broken; and the row names the snapshot at once, so no collection
        # takes what it is to stand on. It is suspended once all it held is released.
        self.life.db.update(sandbox_id, claimed_by=self.life.claimer)
        try:
            snap, _ = await self._take(row, memory=True, kind="suspend", leave_running=False)
            if not self.life.db.update(sandbox_id, suspended_to=snap.id, layers=dbmod.row_layers(row) + (snap.id,)):
                raise SandboxGone(f"sandbox {sandbox_id} was destroyed while it was being suspended")
            await self.life.network.detach(sandbox_id)
            await self.life.backend.release(sandbox_id, dbmod.row_handle(row))
        finally:
            if not self.life.db.update(sandbox_id, claimed_by=None):
                # Destroyed meanwhile (a kill, its fleet's close as a script failed): its destroy
                # looked for its suspend snapshots before this one was recorded.
                await asyncio.shield(self.life.collect(self.life.own_suspends(sandbox_id)))
        self.life.db.update(sandbox_id, state="suspended", pid=None)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Bring a suspended (or paused) sandbox back, processes and all, where it stopped."""
        async with self.life.changing(sandbox_id):
            pass
        return self.life.info(sandbox_id)

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        """Back to exactly the image or snapshot the sandbox was made from: disk, processes, memory."""
        async with self.life.changing(sandbox_id, wake=False, interrupt=True) as row:
            await self.life.backend.release(sandbox_id, dbmod.row_handle(row))
            self.life.db.update(sandbox_id, state="creating", pid=None, suspended_to=None, claimed_by=self.life.claimer)
            try:
                with host_errors(f"resetting sandbox {sandbox_id} failed"):
                    info = dbmod.row_info(row)
                    pid, layers = await self.life.start(sandbox_id, row["source"], info.limits, info.seccomp)
            except BaseException:
                await asyncio.shield(self.life.destroy(sandbox_id))
                raise
            self.life.db.update(sandbox_id, state="running", pid=pid, layers=layers, claimed_by=None)
            await self.life.collect(self.life.own_suspends(sandbox_id))
        return self.life.info(sandbox_id)


def _lease_of(owner: str) -> str | None:
    """Fork children belong to their parent's lease, if it has one."""
    return owner.removeprefix(LEASE_PREFIX) if owner.startswith(LEASE_PREFIX) else None
