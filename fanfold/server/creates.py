"""Idempotent creates and forks: one ``X-Request-ID`` per tenant gives one sandbox (or one
set of fork children), however often it is retried.

A create runs apart from the request that started it, so a client that drops the
connection and retries with the same ID gets the sandboxes the first call made. Sandboxes
whose creator vanished and never came back for them are killed after a grace period.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from ..engine import Engine
from ..errors import InvalidRequest
from ..models import ForkResult, SandboxInfo

Made = SandboxInfo | ForkResult

KEEP_S = 3600.0
"""How long a request ID is remembered."""
UNCLAIMED_GRACE_S = 60.0
"""How long a sandbox whose creator disconnected waits for a retry to claim it."""


@dataclass
class _Entry:
    fingerprint: str
    future: asyncio.Future[Made]
    started: float = field(default_factory=time.monotonic)
    claimed: bool = False
    reaping: bool = False
    reaper: asyncio.TimerHandle | None = None


class CreateRegistry:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._entries: dict[tuple[str, str], _Entry] = {}

    def start(self, tenant: str, request_id: str | None, params: dict[str, Any],
              run: Callable[[], Awaitable[Made]]) -> _Entry:
        """The entry for this request ID, starting the create if it is the first call."""
        self._prune()
        fingerprint = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
        key = (tenant, request_id) if request_id else None
        entry = self._entries.get(key) if key else None
        if entry is not None and entry.reaping:
            del self._entries[key]  # came back too late: its sandbox is being killed; make a new one
            entry = None
        if entry is not None:
            if entry.fingerprint != fingerprint:
                raise InvalidRequest(f"X-Request-ID {request_id!r} was already used for a different create")
            if entry.reaper is not None:
                entry.reaper.cancel()
                entry.reaper = None
            return entry
        entry = _Entry(fingerprint, asyncio.ensure_future(run()))
        if key is not None:
            self._entries[key] = entry
            # A failed create is forgotten, so a retry with the same ID tries again.
            entry.future.add_done_callback(lambda f: self._forget_failed(key, entry))
        return entry

    def _forget_failed(self, key: tuple[str, str], entry: _Entry) -> None:
        if (entry.future.cancelled() or entry.future.exception() is not None) and self._entries.get(key) is entry:
            del self._entries[key]

    def claimed(self, entry: _Entry) -> None:
        entry.claimed = True

    def abandoned(self, entry: _Entry, request_id: str | None) -> None:
        """The creator disconnected before the answer: kill unless a retry claims it soon."""
        if entry.claimed or entry.future.cancelled() or entry.future.exception() is not None:
            return
        delay = UNCLAIMED_GRACE_S if request_id else 0.0
        entry.reaper = asyncio.get_running_loop().call_later(delay, self._start_reaping, entry)

    def _start_reaping(self, entry: _Entry) -> None:
        if not entry.claimed:
            entry.reaping = True  # set now, so a retry arriving before the kill runs starts afresh
            asyncio.ensure_future(self._reap(entry))

    async def _reap(self, entry: _Entry) -> None:
        for key in [k for k, e in self._entries.items() if e is entry]:
            del self._entries[key]
        made = entry.future.result()
        children = made.children if isinstance(made, ForkResult) else (made,)
        for info in children:
            try:
                await self._engine.kill(info.id)
            except Exception:  # noqa: BLE001 - already gone is fine
                pass

    def _prune(self) -> None:
        # Entries are kept in the order they started: stop at the first too young to go, so
        # a create costs the entries it expires, not a scan of every one of the last hour.
        cutoff, stale = time.monotonic() - KEEP_S, []
        for key, entry in self._entries.items():
            if entry.started > cutoff:
                break
            if entry.future.done():
                stale.append(key)
        for key in stale:
            del self._entries[key]

    async def close(self) -> None:
        for entry in self._entries.values():
            if entry.reaper is not None:
                entry.reaper.cancel()
        await asyncio.gather(*(e.future for e in self._entries.values()), return_exceptions=True)
        self._entries.clear()
