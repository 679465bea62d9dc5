"""The host's policies: idle sandboxes suspended or destroyed, sticky ones evicted for room."""

from __future__ import annotations

import logging
import shutil
from typing import Awaitable, Callable

from ..errors import FanfoldError
from ..models import SandboxInfo
from . import db as dbmod
from .admission import memory_available_mb
from .lifecycle import Lifecycle
from .pools import Pools

log = logging.getLogger("fanfold.engine")


class Policies:
    """Applied by the reaper once a second, and by admission when a create finds no room."""

    def __init__(self, life: Lifecycle, pools: Pools, suspend: Callable[[str], Awaitable[SandboxInfo]]) -> None:
        self.life, self.pools, self._suspend = life, pools, suspend

    async def apply(self) -> None:
        """Suspend (or destroy, if ephemeral) idle sandboxes; evict sticky ones under pressure.

        On a backend without memory checkpoints, or holding a GPU or containers (nested), an idle sticky
        or persistent sandbox stays running: suspending is how it would keep its processes, and it has
        no other way."""
        life, now = self.life, dbmod.now()
        can_suspend = life.backend.capabilities.memory != "none"
        for row in life.db.rows():
            mine = row["owner"] in (life.owner, "detached") and life.ours(row)
            idle = row["idle_timeout"] is not None and now - row["active_at"] > row["idle_timeout"]
            if not (mine and idle and row["state"] in ("running", "paused")) or life.gate(row["id"]).busy:
                continue
            if row["persistence"] == "ephemeral":
                await life.destroy(row["id"])
            elif can_suspend and row["gpu_ids"] == "[]" and not row["nested"] \
                    and life.db.claim(row["id"], life.claimer):
                try:
                    await self._suspend(row["id"])
                except FanfoldError as err:  # one sandbox's failure must not hold up the rest
                    log.warning("fanfold: idle sandbox %s: %s", row["id"], err)
                finally:
                    life.db.unclaim(row["id"])
        if self._under_pressure():
            victim = self.sticky_victim()
            if victim is not None:
                log.warning("fanfold: host under pressure; evicting sticky sandbox %s", victim)
                await life.destroy(victim)

    async def evict_for_room(self) -> bool:
        """Free room for a create: a warm sandbox first, then the lowest-priority idle sticky one."""
        victim = self.pools.evictable()
        if victim is None:
            victim = self.sticky_victim()
            if victim is None:
                return False
            log.warning("fanfold: host short of room; evicting sticky sandbox %s", victim)
        self.life.telemetry.sandboxes_reaped.labels(reason="evicted").inc()
        await self.life.destroy(victim)
        return True

    def sticky_victim(self) -> str | None:
        """The sticky sandbox to evict first: lowest priority, then longest idle; none in a call."""
        sticky = [r for r in self.life.db.rows() if r["persistence"] == "sticky"
                  and r["state"] in ("running", "paused", "suspended") and not self.life.gate(r["id"]).busy
                  and self.life.ours(r)]
        return min(sticky, key=lambda r: (r["priority"], r["active_at"]))["id"] if sticky else None

    def _under_pressure(self) -> bool:
        config = self.life.config
        disk = shutil.disk_usage(config.state_dir)
        return memory_available_mb() < config.pressure_memory_mb or disk.free < config.pressure_disk_mb << 20
