"""The sandboxes' disks against the space their filesystem really has.

Every sandbox may write up to its ``disk_mb``, and the disks share one filesystem (``host.disk``).
A create is admitted only while what the sandboxes may still write, its own ``disk_mb`` included,
fits in the real free space (``host.diskspace.room``: ``reserve_disk_mb`` kept for the engine's
state), times ``disk_overcommit``. The sum of the ``disk_mb`` of every sandbox (pooled, suspended
and destroying ones too) is one query; only when it does not fit is each disk's use read, so what
sandboxes already wrote is not counted twice.

Space can still run short after admission: memory snapshots and layers take it, so can anything
else on the state filesystem, and an overcommitted host counts on sandboxes writing little. Then
``rebalance`` (once a reaper pass) sets each sandbox's cap to what it holds plus its share of what
is left, so the sandbox that writes on meets its own quota error (EDQUOT) while the others keep
their shares and the engine's state its reserve; caps go back to ``disk_mb`` once there is room.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from ..config import EngineConfig
from ..host import diskspace
from . import db as dbmod

USAGE_TTL_S = 1.0
"""How long admission reuses the disks' use it read (creates near a full disk come in bursts)."""
log = logging.getLogger("fanfold.engine")


class DiskRoom:
    """Admission's disk check and the caps' rebalancing, for a backend whose disks have quotas."""

    def __init__(self, config: EngineConfig, db: Callable[[], dbmod.Database], quota: Callable[[], bool]) -> None:
        self.config = config
        self._db, self._quota = db, quota
        self._uses: tuple[float, dict[str, diskspace.Use]] = (0.0, {})
        self.capped: set[str] = set()
        """Sandboxes whose cap this engine set below their ``disk_mb``."""

    def shortage(self, need_mb: int) -> str | None:
        """Why the disks cannot promise ``need_mb`` more, or None when they can."""
        if not self._quota():
            return None
        cfg = self.config
        room = diskspace.room(cfg.state_dir, cfg.reserve_disk_mb << 20)
        fits = int(room.free * cfg.disk_overcommit) >> 20
        promised = self._db().disk_mb_total()
        if promised + need_mb <= fits:
            return None
        owed = self._owed_mb(self._db().disk_mb(), self._cached_uses())
        if owed + need_mb <= fits:
            return None
        over = f" x disk_overcommit={cfg.disk_overcommit:g}" if cfg.disk_overcommit != 1 else ""
        return (f"the sandboxes' disks may still write {owed} MB and this create asks for disk_mb={need_mb}, but"
                f" {room.bound} has {room.free >> 20} MB free{over} ({cfg.reserve_disk_mb} MB kept for the engine's"
                f" state): destroy sandboxes, ask for less disk_mb, or free space there")

    async def rebalance(self) -> None:
        """Shrink every sandbox's cap to its share of the space left when its writes could fill the disk;
        restore it to ``disk_mb`` once they cannot."""
        if not self._quota():
            return
        try:
            await self._rebalance()
        except OSError as err:  # the reaper's pass goes on; the next one tries again
            log.warning("fanfold: reading or setting the sandboxes' disk caps failed: %s", err)

    async def _rebalance(self) -> None:
        cfg, db = self.config, self._db()
        room = diskspace.room(cfg.state_dir, cfg.reserve_disk_mb << 20)
        if not self.capped and (db.disk_mb_total() << 20 <= room.free
                                or self._owed_mb(db.disk_mb(), self._cached_uses()) << 20 <= room.free):
            return  # counters as of the last commit count less written, so more owed: room either way
        uses = await asyncio.to_thread(diskspace.usage, cfg.state_dir)  # commits first: counters as of now
        self._uses = (time.monotonic(), uses)
        room = diskspace.room(cfg.state_dir, cfg.reserve_disk_mb << 20)
        promised = {i: mb << 20 for i, mb in db.disk_mb().items() if i in uses}
        wants = {i: max(0, full - uses[i].used) for i, full in promised.items()}
        owed = sum(wants.values())
        share = 1.0 if owed <= room.free else room.free / owed
        caps = {i: promised[i] if share == 1.0 else uses[i].used + int(want * share) for i, want in wants.items()}
        changed = {i: cap for i, cap in caps.items() if abs(cap - uses[i].limit) >= 1 << 20}
        if changed:
            await asyncio.to_thread(self._set_caps, changed, uses)
        was, self.capped = self.capped, {i for i, cap in caps.items() if cap < promised[i]}
        if self.capped and not was:
            log.warning("fanfold: %s has %d MB left for sandboxes' disks that may still write %d MB: their caps"
                        " shrink to what they hold plus their share of what is left", room.bound, room.free >> 20,
                        owed >> 20)
        elif was and not self.capped:
            log.warning("fanfold: %s has room again: the sandboxes' disks are capped at their disk_mb", room.bound)

    def _set_caps(self, caps: dict[str, int], uses: dict[str, diskspace.Use]) -> None:
        for sandbox_id, cap in caps.items():
            try:
                diskspace.cap(self.config.state_dir, sandbox_id, cap, exclusive=uses[sandbox_id].exclusive)
            except OSError:
                pass  # destroyed meanwhile

    def _cached_uses(self) -> dict[str, diskspace.Use]:
        at, uses = self._uses
        if time.monotonic() - at > USAGE_TTL_S:
            uses = diskspace.usage(self.config.state_dir, commit=False)  # a commit could wait on many writes
            self._uses = (time.monotonic(), uses)
        return uses

    @staticmethod
    def _owed_mb(promised_mb: dict[str, int], uses: dict[str, diskspace.Use]) -> int:
        """What the sandboxes may still write (MB): each one's ``disk_mb`` less what it holds."""
        return sum(max(0, mb - (uses[i].used >> 20 if i in uses else 0)) for i, mb in promised_mb.items())
