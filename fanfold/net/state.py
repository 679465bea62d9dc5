"""What netd keeps for each attached sandbox (its policy, counters and open connections), and the byte
copier that counts into them."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import asdict, dataclass, field
from typing import Any

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

async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stats: NetStats, *, up: bool) -> bool:
    """Copy until end of file, then half-close, counting bytes (``up``: sandbox to outside); False when
    either end broke."""
    try:
        while data := await reader.read(CHUNK):
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
