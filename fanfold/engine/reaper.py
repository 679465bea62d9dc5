"""The reaper: what dead owners, passed deadlines, expired leases and crashes leave, released.

``reconcile`` runs as an engine starts; ``run`` once a second after that, in one task.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from typing import Any

from ..errors import FanfoldError
from ..host import procs
from . import db as dbmod
from .leases import LEASE_PREFIX, Leases
from .lifecycle import Lifecycle, process_alive
from .policies import Policies
from .pools import Pools

log = logging.getLogger("fanfold.engine")
SWEEP_EVERY = 15
"""Reaper passes (seconds) between sweeps for resources no row names, e.g. from a runtime
command still finishing when the engine that ran it was killed."""


class Reaper:
    """Finds sandboxes nobody wants any more and destroys them; applies the idle policies."""

    def __init__(self, life: Lifecycle, leases: Leases, policies: Policies, pools: Pools) -> None:
        self.life, self.leases, self.policies, self.pools = life, leases, policies, pools
        self._dead_seen: set[str] = set()

    async def reconcile(self) -> dict[str, int]:
        """Reap sandboxes whose owner died or whose deadline passed, and resources with no sandbox."""
        life, reaped = self.life, 0
        rows = {row["id"]: row for row in life.db.rows()}
        for lease_id in life.db.expired_leases():
            reaped += await self.leases.reap(lease_id)
        alive = self._owners_alive({row["owner"] for row in rows.values()})
        for sandbox_id, row in rows.items():
            if not life.ours(row):
                continue  # another backend's: an engine of that backend reaps it
            dead = not alive[row["owner"]]
            expired = row["deadline_at"] is not None and row["deadline_at"] <= dbmod.now()
            busy = row["claimed_by"] and process_alive(row["claimed_by"])  # a live engine is suspending it
            broken = row["state"] in ("running", "pooled") and not busy and not life.backend.alive(dbmod.row_handle(row))
            if dead or expired or broken or self._orphaned(row):
                await life.destroy(sandbox_id)
                reaped += 1
            elif row["claimed_by"] and not process_alive(row["claimed_by"]):
                life.db.unclaim(sandbox_id)  # an engine died mid idle-suspend
        reaped += await self.sweep_leftovers()
        life.sources.store.discard_scratch()
        life.snaps.discard_orphans()
        for context in (life.config.state_dir / "bundles").glob("context-*"):  # a dead server's build uploads
            if not procs.running(context.name.split("-")[1]):
                shutil.rmtree(context, ignore_errors=True)
        return {"reaped": reaped}

    async def sweep_leftovers(self) -> int:
        """Release what the backend holds for sandboxes no row names (a dead engine's), what dead
        helpers and crashes left (``Backend.sweep(thorough=True)``), and suspend snapshots of
        sandboxes that are gone."""
        await self.life.backend.sweep(thorough=True)
        leftovers = await self.life.backend.list_ids()
        # Rows are written before resources exist: reading them after the scan keeps
        # another engine's create in flight from looking like a leftover.
        known = {row["id"] for row in self.life.db.rows()}
        released = 0
        for sandbox_id in {i for i in leftovers - known if self.life.mine(i)}:
            try:
                await self.life.backend.release(sandbox_id)
                released += 1
            except FanfoldError as err:  # one that will not go must not stop the rest, nor an engine's start
                log.warning("fanfold reaper: releasing leftover %s failed, retried on a later pass: %s", sandbox_id, err)
        # A sandbox's suspend snapshots go with it; an engine that died in between left them (those
        # a later snapshot stands on stay, as they do after any destroy).
        await self.life.collect({s for s, owner in self.life.db.stray_suspends().items() if self.life.mine(owner)})
        return released

    async def run(self) -> None:
        """A pass a second, for as long as the engine runs."""
        passes = 0
        while True:
            await asyncio.sleep(1.0)
            passes += 1
            try:
                await self._pass(sweep=passes % SWEEP_EVERY == 0)
            except Exception:  # noqa: BLE001 - the reaper must outlive any one failure
                log.exception("fanfold reaper: a pass failed; retrying in a second")

    async def _pass(self, *, sweep: bool) -> None:
        life = self.life
        if sweep:
            await self.sweep_leftovers()
        else:
            await life.backend.sweep()
        if life.admission.disks is not None:
            await life.admission.disks.rebalance()  # first: a disk filling up waits for nothing else
        for lease_id in life.db.expired_leases():
            await self.leases.reap(lease_id)
        rows = life.db.rows()
        alive = self._owners_alive({row["owner"] for row in rows} - {life.owner})
        for row in rows:
            reason = self._reap_reason(row, alive) if life.ours(row) else None  # another backend's engine reaps it
            if reason is None:
                continue
            if reason != "retry":
                life.telemetry.sandboxes_reaped.labels(reason=reason).inc()
            try:
                await life.destroy(row["id"])
            except FanfoldError as err:  # the row stays destroying; the next pass tries again
                log.warning("fanfold reaper: %s", err)
        await self.policies.apply()
        self.pools.maintain()
        await life.network.refresh()

    def _owners_alive(self, owners: set[str]) -> dict[str, bool]:
        """Whether each owner still wants its rows: detached, a live lease, or a live engine
        process; the leases in one query, each engine's process looked up once."""
        leases = self.life.db.live_lease_ids() if any(o.startswith(LEASE_PREFIX) for o in owners) else set()
        alive = {}
        for owner in owners:
            if owner.startswith(LEASE_PREFIX):
                alive[owner] = owner.removeprefix(LEASE_PREFIX) in leases
            else:
                alive[owner] = owner == "detached" or process_alive(owner)
        return alive

    def _crashed(self, row: Any) -> bool:
        """PID 1 of a running sandbox died, seen on two passes in a row: a suspend (of any
        engine) releases the processes a moment before the row says suspended."""
        busy = row["claimed_by"] and process_alive(row["claimed_by"])  # a live engine is suspending it
        if row["state"] not in ("running", "pooled") or busy or self.life.backend.alive(dbmod.row_handle(row)):
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
        return row["state"] in ("creating", "destroying") and bool(claimer) and not process_alive(claimer)

    def _reap_reason(self, row: Any, alive: dict[str, bool]) -> str | None:
        """Why the reaper destroys this row now, or None to leave it."""
        life = self.life
        if row["deadline_at"] is not None and row["deadline_at"] <= dbmod.now():
            return "deadline"
        if (row["owner"] != life.owner and not alive[row["owner"]]) or self._orphaned(row):
            return "owner"
        if self._crashed(row):
            return "crashed"
        if row["state"] == "destroying" and row["claimed_by"] == life.claimer and row["id"] not in life.destroying:
            return "retry"  # its release failed (a busy mount, a cgroup slow to empty): try again
        return None
