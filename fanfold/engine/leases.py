"""Leases: a client's claim on its sandboxes, which die with it when it stops renewing."""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from ..errors import InvalidRequest, LeaseNotFound, SandboxNotFound
from ..models import LeaseInfo, SandboxInfo
from . import db as dbmod
from .api import MAX_LEASE_TTL_S
from .checks import check_deadline, check_labels
from .lifecycle import Lifecycle

log = logging.getLogger("fanfold.engine")
LEASE_PREFIX = "lease:"
"""Rows owned by a lease carry this before its id in ``owner``."""


class Leases:
    """Opens, renews, closes and reaps leases; sandboxes created with one are owned by it."""

    def __init__(self, life: Lifecycle) -> None:
        self.life = life
        self.opened: set[str] = set()
        """Leases opened through this engine: closing it ends them. A crash leaves them to expire."""


    async def open_lease(self, ttl: float | None = None, *, tenant: str = "",
                         outlive: bool = False) -> LeaseInfo:
        """A new lease: sandboxes created with it die when it is closed or not renewed within ``ttl`` s.

        Closing this engine closes the leases opened through it, unless ``outlive`` (a
        rollout's lease, which lasts to the rollout's deadline whatever becomes of the server).
        """
        ttl = self.life.config.lease_ttl_s if ttl is None else ttl
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 1 <= ttl <= MAX_LEASE_TTL_S:
            raise InvalidRequest(f"a lease ttl is 1 to {MAX_LEASE_TTL_S:g} seconds, got {ttl!r}")
        lease_id = "ls-" + secrets.token_hex(8)
        expires = self.life.db.insert_lease(lease_id, tenant, float(ttl))
        if not outlive:
            self.opened.add(lease_id)
        return LeaseInfo(id=lease_id, ttl=float(ttl), expires_at=expires)

    async def renew_lease(self, lease_id: str, *, tenant: str | None = None) -> LeaseInfo:
        """Keep a lease (and its sandboxes) alive for another ttl; LeaseNotFound once it expired."""
        row = self._row(lease_id, tenant)
        expires = self.life.db.renew_lease(lease_id)
        if expires is None:
            raise LeaseNotFound(f"lease {lease_id} expired and its sandboxes were reaped; open a new one")
        return LeaseInfo(id=lease_id, ttl=row["ttl"], expires_at=expires,
                         sandboxes=len(self.life.db.owned_by(LEASE_PREFIX + lease_id)))

    async def close_lease(self, lease_id: str, *, tenant: str | None = None) -> int:
        """End a lease now, destroying its sandboxes; returns how many there were."""
        self._row(lease_id, tenant)
        return await self.reap(lease_id, expired=False)

    def _row(self, lease_id: str, tenant: str | None) -> Any:
        row = self.life.db.lease(lease_id) if isinstance(lease_id, str) else None
        if row is None or (tenant is not None and row["tenant"] != tenant):
            raise LeaseNotFound(f"no lease {lease_id!r}: it expired (its sandboxes were reaped) or never existed")
        return row

    def owner_for(self, lease: str | None, tenant: str) -> str:
        """The owner a create's row gets: its lease, or this engine."""
        if lease is None:
            return self.life.owner
        row = self._row(lease, tenant)
        if row["expires_at"] <= dbmod.now():
            raise LeaseNotFound(f"lease {lease} expired and its sandboxes were reaped; open a new one")
        return LEASE_PREFIX + lease

    async def adopt(self, sandbox_id: str, lease: str, *, tenant: str = "",
                    labels: dict[str, str] | None = None, deadline: float | None = None) -> SandboxInfo:
        """Put a sandbox under another of its tenant's leases, with new ``labels`` and ``deadline``
        (seconds from now) when given: a rollout forked from another takes its child this way."""
        row = self.life.known(sandbox_id)
        if row["tenant"] != tenant:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        check_deadline(deadline)
        fields: dict[str, object] = {"owner": self.owner_for(lease, tenant)}
        if labels is not None:
            fields["labels"] = json.dumps(check_labels(labels))
        if deadline is not None:
            fields["deadline_at"] = dbmod.now() + deadline
        self.life.db.update(sandbox_id, **fields)
        if deadline is not None:
            self.life.arm_deadline(sandbox_id, deadline)
        return self.life.info(sandbox_id)

    async def reap(self, lease_id: str, *, expired: bool = True) -> int:
        owned = self.life.db.owned_by(LEASE_PREFIX + lease_id)
        if expired:
            self.life.telemetry.leases_reaped.inc()
            if owned:
                log.warning("fanfold: lease %s expired unrenewed; reaping its %d sandboxes", lease_id, len(owned))
        for sandbox_id in owned:
            if expired:
                self.life.telemetry.sandboxes_reaped.labels(reason="lease").inc()
            await self.life.destroy(sandbox_id)
        self.life.db.delete_lease(lease_id)
        self.opened.discard(lease_id)
        return len(owned)
