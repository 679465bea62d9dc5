"""Per-tenant quotas of a server: live sandboxes, the memory and disk their limits add up to,
the GPUs they hold, and the warm sandboxes the tenant's pools keep.

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
from .gpus import Gpus


@dataclass(frozen=True)
class Use:
    """What some sandboxes add up to: how many, their memory and disk limits, and the GPUs' worth they hold."""

    sandboxes: int = 0
    memory_mb: int = 0
    disk_mb: int = 0
    gpus: float = 0.0

    @classmethod
    def of(cls, count: int, limits: Limits, gpus_each: float = 0.0) -> Use:
        return cls(count, count * limits.memory_mb, count * limits.disk_mb, count * gpus_each)

    def __add__(self, other: Use) -> Use:
        return Use(self.sandboxes + other.sandboxes, self.memory_mb + other.memory_mb, self.disk_mb + other.disk_mb,
                   self.gpus + other.gpus)


HELD = ("memory_mb", "disk_mb", "gpus")
"""What warm sandboxes hold as live ones do."""
SLACK = 1e-9
"""Shares of a GPU add up as floats: 16 sixteenths are 1."""


class Quotas:
    """The quotas of ``EngineConfig.quotas``, checked against the tenant's rows and warm sandboxes as they are now."""

    def __init__(self, quotas: tuple[tuple[str, Quota], ...], db: Callable[[], dbmod.Database],
                 warm: Callable[[str], Use], gpus: Gpus) -> None:
        self._quotas = dict(quotas)
        self._db = db
        self._warm = warm
        """The sandboxes a tenant's pools hold warm or are filling."""
        self._gpus = gpus

    def usage(self, tenant: str) -> Use:
        """What ``tenant``'s live sandboxes hold now: how many, the memory and disk their limits add up to, and GPUs."""
        used = Use()
        for row in self._db().rows():
            if row["tenant"] == tenant and row["state"] != "pooled":
                used += Use.of(1, dbmod.row_info(row).limits, self._gpus.row_weight(row))
        return used

    def _need(self, count: int, limits: Limits) -> Use:
        return Use.of(count, limits, self._gpus.weight(limits) if limits.gpus is not None else 0.0)

    def check_create(self, tenant: str, limits: Limits, *, claims_warm: bool = False) -> None:
        """QuotaExceeded when one more sandbox with ``limits`` would take ``tenant`` over a quota;
        ``claims_warm``: it is one of the tenant's own warm sandboxes, counted already."""
        quota = self._quotas.get(tenant)
        if quota is None:
            return
        live, warm = self.usage(tenant), self._warm(tenant)
        need = Use(1, 0, 0) if claims_warm else self._need(1, limits)
        for name in ("sandboxes", *HELD):
            limit, held = getattr(quota, name), getattr(live, name) + (0 if name == "sandboxes" else getattr(warm, name))
            if limit is not None and held + getattr(need, name) > limit + SLACK:
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
        live, wanted = self.usage(tenant), self._need(need, limits)
        for name in HELD:
            limit, held = getattr(quota, name), getattr(live, name) + getattr(planned, name)
            if limit is not None and held + getattr(wanted, name) > limit + SLACK:
                raise QuotaExceeded(_message(tenant, name, held, limit, getattr(wanted, name), "pool",
                                             warm=getattr(planned, name)))

    def fits_warm(self, tenant: str, limits: Limits) -> bool:
        """Whether one more warm sandbox with ``limits`` keeps ``tenant`` within its memory and disk quotas."""
        quota = self._quotas.get(tenant)
        if quota is None:
            return True
        held, more = self.usage(tenant) + self._warm(tenant), self._need(1, limits)
        return all(getattr(quota, name) is None
                   or getattr(held, name) + getattr(more, name) <= getattr(quota, name) + SLACK for name in HELD)


_UNITS = {"sandboxes": "sandboxes", "memory_mb": "MB of memory", "disk_mb": "MB of disk", "pools": "pooled sandboxes",
          "gpus": "GPUs (a shared one counts a share)"}
_ADVICE = {
    "sandboxes": "destroy one or ask the operator to raise it",
    "memory_mb": "destroy a sandbox, shrink a pool, ask for less memory_mb, or ask the operator to raise it",
    "disk_mb": "destroy a sandbox, shrink a pool, ask for less disk_mb, or ask the operator to raise it",
    "pools": "shrink or remove a pool, or ask the operator to raise it",
    "gpus": "destroy a GPU sandbox, shrink a GPU pool, share GPUs rather than hold them alone, or ask the operator"
            " to raise it",
}


def _message(tenant: str, name: str, used: float, limit: int, need: float, what: str, *, warm: float = 0) -> str:
    who = f"tenant {tenant}" if tenant else "the host's tenant"
    used, need, warm = (round(value, 3) for value in (used, need, warm))
    pooled = f", {warm:g} of it in its pools" if warm else ""
    wants = "" if name == "sandboxes" else f"; this {what} needs {need:g} more"
    return f"{who} has {used:g} of {limit} {_UNITS[name]} (quota {name}){pooled}{wants}: {_ADVICE[name]}"
