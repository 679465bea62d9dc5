"""Warm pools: sandboxes brought up ahead of need, handed out by a create in about a millisecond.

A pool is keyed by its tenant (on a server; "" for the host's own), what its sandboxes are
made from (an image or snapshot id) and their limits: a tenant sees and resizes only its own
pools, and takes from its own first, then from the host's (``fanfold serve --pool``: the
operator's warm capacity, of bases and shared images the tenant may use anyway). Its sandboxes are rows in state ``pooled``, owned by the engine: no call can
reach one by id, so a sandbox is handed out exactly as it came up, never used. A
handed-out sandbox takes the caller's owner, tenant, labels, env and deadline, and the
pool refills in the background, giving way to creates that wait in the queue. A tenant's
warm sandboxes count against its memory and disk quotas (``quotas``): its pool fills only
as far as they leave room.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ..config import EngineConfig
from ..errors import CapacityExceeded, FanfoldError, InfrastructureError
from ..models import Limits, PoolInfo
from .admission import Admission
from .quotas import Use
from .telemetry import Telemetry

log = logging.getLogger("fanfold.pools")
FILL_BACKOFF_S = 5.0
"""Pause after a failed fill before trying again."""

PoolKey = tuple[str, str, Limits]


@dataclass
class _Pool:
    source: str
    limits: Limits
    size: int | None
    """Sandboxes kept warm, or None to follow recent demand."""
    tenant: str = ""
    ready: deque[str] = field(default_factory=deque)
    filling: int = 0
    demand: deque[float] = field(default_factory=deque)
    handouts: int = 0
    misses: int = 0
    failed_at: float = 0.0
    last_error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class PoolHooks(Protocol):
    """What pools need of the engine's sandboxes (its Lifecycle)."""

    closing: bool

    def warm(self, sandbox_id: str) -> bool | None:
        """Whether a pooled sandbox is still warm; None when it is gone."""

    async def bring_up_pooled(self, source: str, limits: Limits) -> str:
        """A new warm sandbox of ``source``; its id."""

    async def destroy(self, sandbox_id: str) -> None: ...


class Pools:
    """Every warm pool of one engine."""

    def __init__(self, config: EngineConfig, admission: Admission, telemetry: Telemetry, hooks: PoolHooks,
                 fits: Callable[[str, Limits], bool] = lambda tenant, limits: True,
                 gpu_weight: Callable[[Limits], float] = lambda limits: 0.0) -> None:
        self._config, self._admission, self._telemetry, self._hooks = config, admission, telemetry, hooks
        self._fits = fits
        """Whether one more warm sandbox of these limits keeps the tenant within its quotas."""
        self._gpu_weight = gpu_weight
        """GPUs' worth a sandbox of these limits holds (``Gpus.weight``)."""
        self._pools: dict[PoolKey, _Pool] = {}
        self._fills: set[asyncio.Task[None]] = set()

    def target(self, pool: _Pool) -> int:
        if pool.size is not None:
            return pool.size
        cutoff = time.monotonic() - self._config.pool_window_s
        while pool.demand and pool.demand[0] < cutoff:
            pool.demand.popleft()
        return min(self._config.pool_auto_max, len(pool.demand))

    def configure(self, source: str, limits: Limits, size: int | None, tenant: str = "") -> _Pool:
        """Set a pool's size (None: follow demand; 0: remove it) and start filling or shrinking it."""
        key = (tenant, source, limits)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(source, limits, size, tenant)
        pool.size = size
        self.maintain()
        return pool

    def has_ready(self, source: str, limits: Limits, tenant: str) -> bool:
        """Whether ``tenant``'s own pool of ``source`` and ``limits`` holds a warm sandbox, which ``take`` hands out first."""
        pool = self._pools.get((tenant, source, limits))
        return pool is not None and bool(pool.ready)

    def take(self, source: str, limits: Limits, tenant: str = "", *, refill: bool = True) -> str | None:
        """A warm sandbox's id, removed from the tenant's pool (else the host's), or None when both are
        empty or absent. The caller checked that ``tenant`` may use ``source``. With ``refill=False``
        the caller starts the refill (``maintain``) once its own work on the sandbox is done."""
        keys = [(tenant, source, limits)] + ([("", source, limits)] if tenant else [])
        pools = [self._pools[key] for key in keys if key in self._pools]
        if not pools:
            return None
        pool = next((p for p in pools if p.ready), pools[0])  # a miss counts against the tenant's own
        pool.demand.append(time.monotonic())
        while pool.ready:
            sandbox_id = pool.ready.popleft()
            warm = self._hooks.warm(sandbox_id)
            if warm:
                pool.handouts += 1
                if refill:
                    self.maintain()
                return sandbox_id
            if warm is not None:
                asyncio.ensure_future(self._hooks.destroy(sandbox_id))  # died while warm
        pool.misses += 1
        self.maintain()
        return None

    def forget(self, sandbox_id: str) -> None:
        """A pooled sandbox is being destroyed (shrink, eviction, engine close)."""
        for pool in self._pools.values():
            if sandbox_id in pool.ready:
                pool.ready.remove(sandbox_id)
                pool.changed.set()

    def evictable(self) -> str | None:
        """A warm sandbox to give up when the host runs short, from the largest pool."""
        pools = [p for p in self._pools.values() if p.ready]
        return max(pools, key=lambda p: len(p.ready)).ready.pop() if pools else None

    def maintain(self) -> None:
        """Start fills up to each pool's target and destroy what is over it."""
        if self._hooks.closing:
            return
        for key, pool in list(self._pools.items()):
            target = self.target(pool)
            while len(pool.ready) > target:
                asyncio.ensure_future(self._hooks.destroy(pool.ready.pop()))
            if pool.size == 0 and not pool.ready and not pool.filling:
                del self._pools[key]
                continue
            if time.monotonic() - pool.failed_at < FILL_BACKOFF_S:
                continue
            room = max(1, self._config.max_creating // 2) - pool.filling
            for _ in range(min(room, target - len(pool.ready) - pool.filling)):
                if not self._fits(pool.tenant, pool.limits):  # the next pass fills it once there is room
                    if not pool.filling:
                        pool.last_error = (f"holds {len(pool.ready)} of {target}: more would take tenant"
                                           f" {pool.tenant} over its memory_mb or disk_mb quota")
                    break
                pool.filling += 1
                task = asyncio.ensure_future(self._fill(pool))
                self._fills.add(task)
                task.add_done_callback(self._fills.discard)

    async def _fill(self, pool: _Pool) -> None:
        try:
            while self._admission.waiting:  # callers' creates go first
                await asyncio.sleep(0.05)
            sandbox_id = await self._hooks.bring_up_pooled(pool.source, pool.limits)
            pool.ready.append(sandbox_id)
            pool.last_error = None
        except (FanfoldError, OSError) as err:
            pool.failed_at, pool.last_error = time.monotonic(), str(err)
            if not isinstance(err, CapacityExceeded):
                self._telemetry.infra_errors.labels(op="pool").inc()
            if not isinstance(err, (CapacityExceeded, InfrastructureError)):
                log.warning("fanfold: filling the pool of %s failed: %s", pool.source, err)
        finally:
            pool.filling -= 1
            pool.changed.set()
        self.maintain()

    async def wait_full(self, pool: _Pool, timeout: float) -> None:
        """Wait until the pool holds its target, or its fills fail, or ``timeout`` passes."""
        give_up = time.monotonic() + timeout
        while len(pool.ready) < self.target(pool):
            if pool.last_error is not None and not pool.filling:
                raise CapacityExceeded(f"the pool of {pool.source} stopped filling at {len(pool.ready)}: {pool.last_error}")
            left = give_up - time.monotonic()
            if left <= 0:
                raise CapacityExceeded(
                    f"the pool of {pool.source} holds {len(pool.ready)} of {self.target(pool)} after {timeout:g} s"
                )
            pool.changed.clear()
            try:
                async with asyncio.timeout(min(left, 1.0)):
                    await pool.changed.wait()
            except TimeoutError:
                self.maintain()

    def info(self, pool: _Pool) -> PoolInfo:
        return PoolInfo(
            source=pool.source, limits=pool.limits, size=pool.size, target=self.target(pool), ready=len(pool.ready),
            filling=pool.filling, handouts=pool.handouts, misses=pool.misses, last_error=pool.last_error,
        )

    def infos(self, tenant: str | None = None) -> list[PoolInfo]:
        """Every pool (only ``tenant``'s, when given)."""
        return [self.info(pool) for pool in self._pools.values() if tenant is None or pool.tenant == tenant]

    def planned(self, tenant: str, *, but: tuple[str, Limits] | None = None) -> Use:
        """Warm sandboxes ``tenant``'s pools may hold (a demand-sized one: its most), ``but`` one of them."""
        total = Use()
        for (owner, source, limits), pool in self._pools.items():
            if owner == tenant and (source, limits) != but:
                total += Use.of(self._config.pool_auto_max if pool.size is None else pool.size, limits,
                                self._gpu_weight(limits) if limits.gpus is not None else 0.0)
        return total

    def warm(self, tenant: str) -> Use:
        """The sandboxes ``tenant``'s pools hold warm or are filling now."""
        total = Use()
        for pool in self._pools.values():
            if pool.tenant == tenant:
                total += Use.of(len(pool.ready) + pool.filling, pool.limits,
                                self._gpu_weight(pool.limits) if pool.limits.gpus is not None else 0.0)
        return total

    async def close(self) -> None:
        for task in list(self._fills):
            task.cancel()
        await asyncio.gather(*self._fills, return_exceptions=True)

