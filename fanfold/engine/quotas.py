"""Per-tenant quotas of a server: live sandboxes, the memory and disk their limits add up to,
and the warm sandboxes the tenant's pools keep.

A tenant's warm sandboxes (its pools' ready ones and those filling) count against its
``memory_mb`` and ``disk_mb`` as live ones do: a pool is capacity held for the tenant alone.
A create that takes one from its own pool adds nothing to them (the warm one becomes live); a
pool is refused when what it plans to keep would not fit beside what the tenant holds, and
fills no further than the quota leaves room for.

A create is checked twice: before it queues (to fail fast) and again just before its row is
inserted, with no await between, so concurrent creates of one tenant never overshoot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import Quota
from ..errors import QuotaExceeded
from ..models import Limits
from . import db as dbmod


@dataclass(frozen=True)
class Use:
    """What some sandboxes add up to: how many, and their memory and disk limits."""

    sandboxes: int = 0
    memory_mb: int = 0
    disk_mb: int = 0

    @classmethod
    def of(cls, count: int, limits: Limits) -> Use:
        return cls(count, count * limits.memory_mb, count * limits.disk_mb)

    def __add__(self, other: Use) -> Use:
        return Use(self.sandboxes + other.sandboxes, self.memory_mb + other.memory_mb, self.disk_mb + other.disk_mb)


class Quotas:
    """The quotas of ``EngineConfig.quotas``, checked against the tenant's rows and warm sandboxes as they are now."""

    def __init__(self, quotas: tuple[tuple[str, Quota], ...], db: Callable[[], dbmod.Database],
                 warm: Callable[[str], Use]) -> None:
        self._quotas = dict(quotas)
        self._db = db
        self._warm = warm
        """The sandboxes a tenant's pools hold warm or are filling."""

    def usage(self, tenant: str) -> Use:
        """What ``tenant``'s live sandboxes hold now: how many, and the memory and disk their limits add up to."""
        used = Use()
        for row in self._db().rows():
            if row["tenant"] == tenant and row["state"] != "pooled":
                used += Use.of(1, dbmod.row_info(row).limits)
        return used

    def check_create(self, tenant: str, limits: Limits, *, claims_warm: bool = False) -> None:
        """QuotaExceeded when one more sandbox with ``limits`` would take ``tenant`` over a quota;
        ``claims_warm``: it is one of the tenant's own warm sandboxes, counted already."""
        quota = self._quotas.get(tenant)
        if quota is None:
            return
        live, warm = self.usage(tenant), self._warm(tenant)
        need = Use(1, 0, 0) if claims_warm else Use.of(1, limits)
        for name in ("sandboxes", "memory_mb", "disk_mb"):
            limit, held = getattr(quota, name), getattr(live, name) + (0 if name == "sandboxes" else getattr(warm, name))
            if limit is not None and held + getattr(need, name) > limit:
                raise QuotaExceeded(_message(tenant, name, held, limit, getattr(need, name), "create",
                                             warm=0 if name == "sandboxes" else getattr(warm, name)))

    def check_pools(self, tenant: str, planned: Use, need: int, limits: Limits) -> None:
        """QuotaExceeded when ``tenant``'s other pools (keeping ``planned``) and this one (``need`` sandboxes
        of ``limits``) would exceed its pools quota, or hold more memory or disk than its live sandboxes leave."""
        quota = self._quotas.get(tenant)
        if quota is None:
            return
        if quota.pools is not None and planned.sandboxes + need > quota.pools:
            raise QuotaExceeded(_message(tenant, "pools", planned.sandboxes, quota.pools, need, "pool"))
        live, wanted = self.usage(tenant), Use.of(need, limits)
        for name in ("memory_mb", "disk_mb"):
            limit, held = getattr(quota, name), getattr(live, name) + getattr(planned, name)
            if limit is not None and held + getattr(wanted, name) > limit:
                raise QuotaExceeded(_message(tenant, name, held, limit, getattr(wanted, name), "pool",
                                             warm=getattr(planned, name)))

    def fits_warm(self, tenant: str, limits: Limits) -> bool:
        """Whether one more warm sandbox with ``limits`` keeps ``tenant`` within its memory and disk quotas."""
        quota = self._quotas.get(tenant)
        if quota is None:
            return True
        held, more = self.usage(tenant) + self._warm(tenant), Use.of(1, limits)
        return all(getattr(quota, name) is None or getattr(held, name) + getattr(more, name) <= getattr(quota, name)
                   for name in ("memory_mb", "disk_mb"))


_UNITS = {"sandboxes": "sandboxes", "memory_mb": "MB of memory", "disk_mb": "MB of disk", "pools": "pooled sandboxes"}
_ADVICE = {
    "sandboxes": "destroy one or ask the operator to raise it",
    "memory_mb": "destroy a sandbox, shrink a pool, ask for less memory_mb, or ask the operator to raise it",
    "disk_mb": "destroy a sandbox, shrink a pool, ask for less disk_mb, or ask the operator to raise it",
    "pools": "shrink or remove a pool, or ask the operator to raise it",
}


def _message(tenant: str, name: str, used: int, limit: int, need: int, what: str, *, warm: int = 0) -> str:
    who = f"tenant {tenant}" if tenant else "the host's tenant"
    pooled = f", {warm} of it in its pools" if warm else ""
    wants = "" if name == "sandboxes" else f"; this {what} needs {need} more"
    return f"{who} has {used} of {limit} {_UNITS[name]} (quota {name}){pooled}{wants}: {_ADVICE[name]}"
