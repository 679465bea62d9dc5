"""The engine's host-wide verbs: leases, warm pools, and the operator's figures.

A mixin of Engine, kept apart so core.py stays about one sandbox's life.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import TYPE_CHECKING, Any, Iterable

from prometheus_client.core import GaugeMetricFamily

from ..errors import InvalidRequest, LeaseNotFound, SandboxNotFound
from ..images import Image
from ..models import LeaseInfo, Limits, PoolInfo, SandboxInfo, SnapshotInfo
from . import admission
from .api import MAX_LEASE_TTL_S, MAX_POOL
from .checks import check_deadline, check_labels
from . import db as dbmod

if TYPE_CHECKING:
    from .core import Engine

log = logging.getLogger("fanfold.engine")
LEASE_PREFIX = "lease:"
"""Rows owned by a lease carry this before its id in ``owner``."""


class HostOperations:
    # -- leases -------------------------------------------------------------------------------

    async def open_lease(self: Engine, ttl: float | None = None, *, tenant: str = "",
                         outlive: bool = False) -> LeaseInfo:
        """A new lease: sandboxes created with it die when it is closed or not renewed within ``ttl`` s.

        Closing this engine closes the leases opened through it, unless ``outlive`` (a
        rollout's lease, which lasts to the rollout's deadline whatever becomes of the server).
        """
        ttl = self.config.lease_ttl_s if ttl is None else ttl
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 1 <= ttl <= MAX_LEASE_TTL_S:
            raise InvalidRequest(f"a lease ttl is 1 to {MAX_LEASE_TTL_S:g} seconds, got {ttl!r}")
        lease_id = "ls-" + secrets.token_hex(8)
        expires = self.db.insert_lease(lease_id, tenant, float(ttl))
        if not outlive:
            self._leases.add(lease_id)
        return LeaseInfo(id=lease_id, ttl=float(ttl), expires_at=expires)

    async def renew_lease(self: Engine, lease_id: str, *, tenant: str | None = None) -> LeaseInfo:
        """Keep a lease (and its sandboxes) alive for another ttl; LeaseNotFound once it expired."""
        row = self._lease_row(lease_id, tenant)
        expires = self.db.renew_lease(lease_id)
        if expires is None:
            raise LeaseNotFound(f"lease {lease_id} expired and its sandboxes were reaped; open a new one")
        return LeaseInfo(id=lease_id, ttl=row["ttl"], expires_at=expires,
                         sandboxes=len(self.db.owned_by(LEASE_PREFIX + lease_id)))

    async def close_lease(self: Engine, lease_id: str, *, tenant: str | None = None) -> int:
        """End a lease now, destroying its sandboxes; returns how many there were."""
        self._lease_row(lease_id, tenant)
        return await self._reap_lease(lease_id, expired=False)

    def _lease_row(self: Engine, lease_id: str, tenant: str | None) -> Any:
        row = self.db.lease(lease_id) if isinstance(lease_id, str) else None
        if row is None or (tenant is not None and row["tenant"] != tenant):
            raise LeaseNotFound(f"no lease {lease_id!r}: it expired (its sandboxes were reaped) or never existed")
        return row

    def _owner_for(self: Engine, lease: str | None, tenant: str) -> str:
        """The owner a create's row gets: its lease, or this engine."""
        if lease is None:
            return self.owner
        row = self._lease_row(lease, tenant)
        if row["expires_at"] <= dbmod.now():
            raise LeaseNotFound(f"lease {lease} expired and its sandboxes were reaped; open a new one")
        return LEASE_PREFIX + lease

    async def adopt(self: Engine, sandbox_id: str, lease: str, *, tenant: str = "",
                    labels: dict[str, str] | None = None, deadline: float | None = None) -> SandboxInfo:
        """Put a sandbox under another of its tenant's leases, with new ``labels`` and ``deadline``
        (seconds from now) when given: a rollout forked from another takes its child this way."""
        row = self._known(sandbox_id)
        if row["tenant"] != tenant:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        check_deadline(deadline)
        fields: dict[str, object] = {"owner": self._owner_for(lease, tenant)}
        if labels is not None:
            fields["labels"] = json.dumps(check_labels(labels))
        if deadline is not None:
            fields["deadline_at"] = dbmod.now() + deadline
        self.db.update(sandbox_id, **fields)
        if deadline is not None:
            self._arm_deadline(sandbox_id, deadline)
        return await self.get(sandbox_id)

    async def _reap_lease(self: Engine, lease_id: str, *, expired: bool = True) -> int:
        owned = self.db.owned_by(LEASE_PREFIX + lease_id)
        if expired:
            self.telemetry.leases_reaped.inc()
            if owned:
                log.warning("fanfold: lease %s expired unrenewed; reaping its %d sandboxes", lease_id, len(owned))
        for sandbox_id in owned:
            if expired:
                self.telemetry.sandboxes_reaped.labels(reason="lease").inc()
            await self._destroy(sandbox_id)
        self.db.delete_lease(lease_id)
        self._leases.discard(lease_id)
        return len(owned)

    # -- warm pools ---------------------------------------------------------------------------

    async def set_pool(
        self: Engine, image: str | Image | SnapshotInfo, size: int | None, *, limits: Limits | None = None,
        wait: float | None = None,
    ) -> PoolInfo:
        """Keep ``size`` sandboxes of ``image`` (an image or snapshot) warm, with ``limits``.

        ``size=None`` follows recent demand; ``0`` empties and removes the pool. With
        ``wait`` (seconds), return once the pool is full.
        """
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_POOL):
            raise InvalidRequest(f"a pool size is a whole number from 0 to {MAX_POOL}, or None to follow demand")
        if limits is not None and not isinstance(limits, Limits):
            raise InvalidRequest("limits must be a fanfold.Limits")
        source, _, limits = await self._source_limits(image.id if isinstance(image, SnapshotInfo) else image, limits)
        admission.check_fits_host(limits)
        pool = self.pools.configure(source, limits, size)
        if wait:
            await self.pools.wait_full(pool, wait)
        return self.pools.info(pool)

    async def pools_info(self: Engine) -> list[PoolInfo]:
        """Every warm pool: its target, what is ready, hand-outs and misses."""
        return self.pools.infos()

    async def _evict_for_room(self: Engine) -> bool:
        """Free room for a create: a warm sandbox first, then the lowest-priority idle sticky one."""
        victim = self.pools.evictable()
        if victim is None:
            victim = self._sticky_victim()
            if victim is None:
                return False
            log.warning("fanfold: host short of room; evicting sticky sandbox %s", victim)
        self.telemetry.sandboxes_reaped.labels(reason="evicted").inc()
        await self._destroy(victim)
        return True

    # -- figures ------------------------------------------------------------------------------

    def metrics_text(self: Engine) -> bytes:
        """Every metric in Prometheus' text format."""
        return self.telemetry.exposition()

    async def stats(self: Engine, *, tenant: str | None = None, sandboxes: bool = True) -> dict[str, Any]:
        """The host at a glance: sandboxes by state (with their CPU and memory), queue, pools,
        create and exec latency percentiles, error and timeout rates, and alerts."""
        by_state = self.db.count_by_state()
        rows = [r for r in self.db.rows() if r["state"] != "pooled" and (tenant is None or r["tenant"] == tenant)]
        listed = []
        if sandboxes:
            for row in rows:
                cpu_s, memory = self.backend.usage(dbmod.row_handle(row))
                labels = dbmod.row_info(row).labels
                listed.append({
                    "id": row["id"], "state": row["state"], "cpu_s": round(cpu_s, 3), "memory_bytes": memory,
                    "age_s": round(dbmod.now() - row["created_at"], 1), "rollout_id": labels.get("rollout_id"),
                    "source": row["source"],
                })
        tasks, most_tasks = admission.kernel_tasks()
        return {
            "sandboxes_by_state": by_state,
            "queue": {"waiting": self.admission.waiting, "creating": self.admission.creating,
                      "max_creating": self.config.max_creating},
            "pools": [pool.to_dict() for pool in self.pools.infos()],
            "host": {"memory_available_mb": admission.memory_available_mb(), "kernel_tasks": tasks,
                     "kernel_tasks_max": most_tasks, "shortage": self.admission.shortage(),
                     "leases": self.db.count_leases()},
            **self.telemetry.summary(),
            "sandboxes": listed,
        }

    def _gauges(self: Engine) -> Iterable[GaugeMetricFamily]:
        states = GaugeMetricFamily("fanfold_sandboxes", "Sandboxes on this host by state.", labels=["state"])
        counts = self.db.count_by_state()
        for state in ("creating", "running", "paused", "suspended", "destroying", "pooled"):
            states.add_metric([state], counts.get(state, 0))
        yield states
        yield GaugeMetricFamily("fanfold_queue_depth", "Creates waiting for a slot.", value=self.admission.waiting)
        yield GaugeMetricFamily("fanfold_creating", "Creates holding a slot.", value=self.admission.creating)
        ready = GaugeMetricFamily("fanfold_pool_ready", "Warm sandboxes ready per pool.", labels=["source"])
        for pool in self.pools.infos():
            ready.add_metric([pool.source], pool.ready)
        yield ready
        yield GaugeMetricFamily("fanfold_memory_available_bytes", "Host memory available (MemAvailable).",
                                value=admission.memory_available_mb() << 20)
