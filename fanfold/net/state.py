"""What netd keeps for each attached sandbox (its policy, counters and open connections), and the byte
copier that counts into them."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Callable

from .policy import NetworkPolicy

CHUNK = 1 << 20  # reads take what is buffered, up to this: fewer, bigger copies
RECENT_DENIALS = 20


@dataclass
class NetStats:
    """Per-sandbox counters kept by the proxy; ``bytes_up`` is sandbox to outside."""

    connections: int = 0
    """Client connections the sandbox opened to the proxy."""
    requests: int = 0
    """Request heads read: CONNECTs and plain HTTP requests, refused ones included."""
    bytes_up: int = 0
    bytes_down: int = 0
    denied: int = 0
    errors: int = 0
    """Malformed requests, failed lookups and upstreams, connections broken midway."""
    exposed_in: int = 0
    """Bytes into the sandbox through exposed ports (counted by netd's splices)."""
    exposed_out: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_bytes: int = 0
    """Body bytes answered from the cache."""
    recorded: int = 0
    """Exchanges stored in a recording."""
    replayed: int = 0
    """Requests answered from a recording."""
    replay_misses: int = 0
    """Requests a replay found no recorded answer for (502, or out live)."""
    idle_closed: int = 0
    """Tunnels (CONNECT, upgrades, exposed ports, captured connections) closed after the idle timeout."""
    recent_denials: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=RECENT_DENIALS))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "recent_denials": list(self.recent_denials)}

    def deny(self, what: str, reason: str) -> None:
        self.denied += 1
        self.recent_denials.append(f"{what}: {reason}")


@dataclass
class SandboxNet:
    """What netd keeps for one attached sandbox."""

    id: str
    policy: NetworkPolicy
    """Replaced at run time; every new connection and request reads the current one."""
    stats: NetStats = field(default_factory=NetStats)
    open: set[asyncio.Task[Any]] = field(default_factory=set)
    """The connection tasks running now, so that they can be cut."""
    scope: str = ""
    """The tenant whose recordings this sandbox records into and replays from ("" for the host's)."""
    replayed: collections.Counter[tuple[str, Any]] = field(default_factory=collections.Counter)
    """How often each (recording, request key) has been answered: the next answer is the next recorded one."""

class Idle:
    """When a tunnel last moved a byte either way; ``watched`` closes it after ``timeout`` seconds of
    none, so that a sandbox cannot hold connections (and netd's descriptors) open forever."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout if timeout and timeout > 0 else None
        self.last = time.monotonic()
        self.fired = False

    def touch(self) -> None:
        self.last = time.monotonic()

    @contextlib.asynccontextmanager
    async def watched(self, stats: NetStats, close: Callable[[], None]) -> AsyncIterator[Idle]:
        """Run the block with a watchdog that calls ``close`` (and counts it) once the tunnel is idle."""
        watch = None if self.timeout is None else asyncio.ensure_future(self._watch(stats, close))
        try:
            yield self
        finally:
            if watch is not None:
                watch.cancel()

    async def _watch(self, stats: NetStats, close: Callable[[], None]) -> None:
        assert self.timeout is not None
        while (left := self.last + self.timeout - time.monotonic()) > 0:
            await asyncio.sleep(left)  # one timer per idle stretch, not one per chunk
        self.fired = True
        stats.idle_closed += 1
        close()


async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stats: NetStats, *, up: bool,
               idle: Idle | None = None) -> bool:
    """Copy until end of file, then half-close, counting bytes (``up``: sandbox to outside) and marking
    ``idle``; False when either end broke."""
    try:
        while data := await reader.read(CHUNK):
            if idle is not None:
                idle.touch()
            writer.write(data)
            if up:
                stats.bytes_up += len(data)
            else:
                stats.bytes_down += len(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        return True
    except OSError:
        return False
