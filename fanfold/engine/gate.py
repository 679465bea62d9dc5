"""One sandbox's traffic light: calls (exec, files) share it; a change of state has it alone."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable


class Gate:
    """A readers-writer lock in which a waiting change goes before new calls.

    A checkpoint must see no command in flight (a host connection open in the agent
    cannot be carried into a copy), and no file half-written by the host: a change
    waits for calls in flight to end, and calls that arrive meanwhile wait for it.
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._calls = 0
        self._changing = False

    @property
    def busy(self) -> bool:
        """True while a call or a change is under way (the idle reaper leaves the sandbox alone)."""
        return self._calls > 0 or self._changing

    @asynccontextmanager
    async def call(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._changing)
            self._calls += 1
        try:
            yield
        finally:
            async with self._cond:
                self._calls -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def change(self, before_wait: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[None]:
        """Hold the sandbox alone. ``before_wait`` runs once no new call can start and before the wait
        for those in flight: it may end calls that would otherwise never end (without the lock held,
        so they can leave)."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._changing)
            self._changing = True
        try:
            if before_wait is not None:
                await before_wait()
            async with self._cond:
                await self._cond.wait_for(lambda: self._calls == 0)
        except BaseException:
            async with self._cond:
                self._changing = False
                self._cond.notify_all()
            raise
        try:
            yield
        finally:
            async with self._cond:
                self._changing = False
                self._cond.notify_all()
