"""Admission: creates queue for a bounded number of slots and for real host headroom.

A burst of creates never fails because it is a burst. At most ``max_creating`` sandboxes
come up at once (more only thrash two cores); the rest wait in arrival order. A create
that holds a slot also waits, if it must, for memory, disk, kernel tasks and the
sandbox count to allow one more, and for the sandboxes' disks to have room for its
``disk_mb`` (``diskroom``); only when its ``queue_timeout`` runs out does it fail,
with a retryable CapacityExceeded that says what ran short.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from contextlib import asynccontextmanager
from functools import lru_cache
from typing import AsyncIterator, Awaitable, Callable

from ..config import EngineConfig
from ..errors import CapacityExceeded, InvalidRequest
from ..host import procs
from ..models import Limits
from .diskroom import DiskRoom

HEADROOM_POLL_S = 0.25
"""How often a create short of headroom looks again when no sandbox is released meanwhile."""


class Admission:
    def __init__(self, config: EngineConfig, count_sandboxes: Callable[[], int], disks: DiskRoom | None = None) -> None:
        self.config = config
        self._count = count_sandboxes
        self.disks = disks
        self._slots = asyncio.Semaphore(config.max_creating)
        self._freed = asyncio.Event()
        self.waiting = 0
        """Creates queued for a slot."""
        self.creating = 0
        """Creates holding a slot."""

    def released(self) -> None:
        """A sandbox was destroyed: creates short of headroom look again."""
        self._freed.set()

    @asynccontextmanager
    async def slot(self, wait: float, evict: Callable[[], Awaitable[bool]] | None = None,
                   disk_mb: int = 0, also: Callable[[], str | None] | None = None) -> AsyncIterator[None]:
        """Hold one create slot with headroom for one more sandbox whose disk may take ``disk_mb``,
        waiting up to ``wait`` seconds. The caller inserts the sandbox's row before it next awaits,
        so the next create counts its disk.

        ``evict`` frees room (a pooled or sticky sandbox) and says whether it did; ``also`` says what
        else the sandbox lacks (its GPUs' shares), or None.
        """
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait
        if self.waiting >= self.config.max_queued:
            raise CapacityExceeded(
                f"the create queue is full ({self.waiting} waiting, max_queued={self.config.max_queued}); retry later"
            )
        self.waiting += 1
        try:
            if also is not None:  # waiting for GPUs holds no slot from creates that need none
                while (short := also()) is not None:
                    await self._until_freed(give_up - loop.time(), short, wait)
            async with asyncio.timeout(max(give_up - loop.time(), 0)):
                await self._slots.acquire()
        except TimeoutError:
            raise CapacityExceeded(
                f"no create slot came free within {wait:g} s ({self.creating} creates in flight, {self.waiting - 1}"
                " more queued); retry, or pass a longer queue_timeout"
            ) from None
        finally:
            self.waiting -= 1
        self.creating += 1
        try:
            while True:
                room = self.shortage(disk_mb)
                short = room or (also() if also is not None else None)
                if short is None:
                    break
                if room is not None and evict is not None and await evict():
                    continue
                await self._until_freed(give_up - loop.time(), short, wait)
            yield
        finally:
            self.creating -= 1
            self._slots.release()

    async def _until_freed(self, left: float, short: str, wait: float) -> None:
        """Wait for a sandbox's release (or the next look), or raise CapacityExceeded when time is up."""
        if left <= 0:
            raise CapacityExceeded(f"the host cannot hold another sandbox: {short} (waited {wait:g} s)")
        self._freed.clear()
        try:
            async with asyncio.timeout(min(left, HEADROOM_POLL_S)):
                await self._freed.wait()
        except TimeoutError:
            pass

    def shortage(self, disk_mb: int = 0) -> str | None:
        """What the host lacks for one more sandbox whose disk may take ``disk_mb``, or None when it has room."""
        cfg = self.config
        count = self._count()
        if count >= cfg.max_sandboxes:
            return f"{count} sandboxes live, the most this host takes (max_sandboxes={cfg.max_sandboxes})"
        available_mb = memory_available_mb()
        if available_mb < cfg.reserve_memory_mb:
            return f"{available_mb} MB of memory available, {cfg.reserve_memory_mb} MB kept in reserve"
        free_mb = shutil.disk_usage(cfg.state_dir).free >> 20
        if free_mb < cfg.reserve_disk_mb:
            return f"{free_mb} MB free in {cfg.state_dir}, {cfg.reserve_disk_mb} MB kept in reserve"
        tasks, most = kernel_tasks()
        if tasks + cfg.reserve_pids > most:
            return f"{tasks} kernel tasks of at most {most}, {cfg.reserve_pids} kept in reserve"
        return self.disks.shortage(disk_mb) if self.disks is not None else None


def memory_available_mb() -> int:
    return _meminfo_mb("MemAvailable:")


@lru_cache(maxsize=1)
def memory_total_mb() -> int:
    """The host's memory, read once: every create checks its limits against it."""
    return _meminfo_mb("MemTotal:")


def _meminfo_mb(field: str) -> int:
    for line in procs.read_small("/proc/meminfo").decode().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) >> 10
    return 0


def host_cores() -> int:
    return os.cpu_count() or 1


def check_fits_host(limits: Limits) -> None:
    """Refuse limits no sandbox on this host could ever use: they would be accepted as
    written and then never hold (a memory limit the host cannot back is no limit)."""
    total_mb, cores = memory_total_mb(), host_cores()
    if limits.memory_mb > total_mb:
        raise InvalidRequest(
            f"limit memory_mb={limits.memory_mb} is more than this host's memory ({total_mb} MB):"
            f" ask for at most {total_mb}"
        )
    if limits.cpus > cores:
        raise InvalidRequest(
            f"limit cpus={limits.cpus:g} is more than this host's {cores} cores: ask for at most {cores}"
        )


def kernel_tasks() -> tuple[int, int]:
    """Threads alive on the host, and the most the kernel allows (threads-max, pid_max)."""
    tasks = int(procs.read_small("/proc/loadavg").split()[3].split(b"/")[1])
    return tasks, _task_limit(int(time.monotonic() // TASK_LIMIT_TTL_S))


TASK_LIMIT_TTL_S = 10.0


@lru_cache(maxsize=1)
def _task_limit(_period: int) -> int:
    """The kernel's task limit, read again each ``TASK_LIMIT_TTL_S`` (an admin may raise it), not per create."""
    return min(_read_int("/proc/sys/kernel/threads-max"), _read_int("/proc/sys/kernel/pid_max"))


def _read_int(path: str) -> int:
    try:
        with open(path) as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return 1 << 22
