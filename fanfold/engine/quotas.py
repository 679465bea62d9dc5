"""Per-tenant quotas of a server: live sandboxes, the memory and disk their limits add up to,
and the warm sandboxes the tenant's pools keep.

A create is checked twice: before it queues (to fail fast) and again just before its row is
inserted, with no await between, so concurrent creates of one tenant never overshoot.
"""

from __future__ import annotations

from typing import Callable

from ..config import Quota
from ..errors import QuotaExceeded
from ..models import Limits
from . import db as dbmod


class Quotas:
    """The quotas of ``EngineConfig.quotas``, checked against the tenant's rows as they are now."""

    def __init__(self, quotas: tuple[tuple[str, Quota], ...], db: Callable[[], dbmod.Database]) -> None:
        self._quotas = dict(quotas)
        self._db = db

    def usage(self, tenant: str) -> dict[str, int]:
        """What ``tenant`` holds now: sandboxes, and the memory and disk their limits add up to."""
        used = {"sandboxes": 0, "memory_mb": 0, "disk_mb": 0}
        for row in self._db().rows():
            if row["tenant"] == tenant and row["state"] != "pooled":
                limits = dbmod.row_info(row).limits
                used["sandboxes"] += 1
                used["memory_mb"] += limits.memory_mb
                used["disk_mb"] += limits.disk_mb
        return used

    def check_create(self, tenant: str, limits: Limits) -> None:
        """QuotaExceeded when one more sandbox with ``limits`` would take ``tenant`` over a quota."""
        quota = self._quotas.get(tenant)
        if quota is None:
            return
        used = self.usage(tenant)
        for name, need in (("sandboxes", 1), ("memory_mb", limits.memory_mb), ("disk_mb", limits.disk_mb)):
            limit = getattr(quota, name)
            if limit is not None and used[name] + need > limit:
                raise QuotaExceeded(_message(tenant, name, used[name], limit, need, "create"))

    def check_pools(self, tenant: str, planned: int, need: int) -> None:
        """QuotaExceeded when pools keeping ``planned`` warm sandboxes, plus ``need``, exceed the pools quota."""
        quota = self._quotas.get(tenant)
        if quota is not None and quota.pools is not None and planned + need > quota.pools:
            raise QuotaExceeded(_message(tenant, "pools", planned, quota.pools, need, "pool"))


_UNITS = {"sandboxes": "sandboxes", "memory_mb": "MB of memory", "disk_mb": "MB of disk", "pools": "pooled sandboxes"}
_ADVICE = {
    "sandboxes": "destroy one or ask the operator to raise it",
    "memory_mb": "destroy a sandbox, ask for less memory_mb, or ask the operator to raise it",
    "disk_mb": "destroy a sandbox, ask for less disk_mb, or ask the operator to raise it",
    "pools": "shrink or remove a pool, or ask the operator to raise it",
}


def _message(tenant: str, name: str, used: int, limit: int, need: int, what: str) -> str:
    who = f"tenant {tenant}" if tenant else "the host's tenant"
    wants = "" if name == "sandboxes" else f"; this {what} needs {need} more"
    return f"{who} has {used} of {limit} {_UNITS[name]} (quota {name}){wants}: {_ADVICE[name]}"
