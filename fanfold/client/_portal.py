"""An event loop on a background thread, so the sync SDK drives the async core without asyncio.run per call.

A portal still running when the main thread ends has its owner closed (a ``Fleet`` destroys its
sandboxes) while threads still work. ``atexit`` is too late: Python shuts every ``concurrent.futures``
pool (``asyncio.to_thread``'s, the engine's host threads) before its ``atexit`` hooks run, so a
close from there fails and leaves its sandboxes behind. Threading's own exit hooks run before that
shutdown, the last registered first: ours is registered after the pools' own. Once exit has begun
no portal starts (its loop thread would be frozen by exit, and a late ``__del__`` hang on it). Work
a thread still awaits on a portal that stops is cancelled, so that thread wakes (and exit's join of
it ends) instead of waiting on a stopped loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread  # noqa: F401 - registers the pools' exit hook before ours (see above)
import os
import sys
import threading
from typing import Any, AsyncIterator, Callable, Coroutine, Iterator, TypeVar

from ..errors import FanfoldError

T = TypeVar("T")
_DONE = object()


class Portal:
    """Runs coroutines on a private loop thread and hands back their results.

    ``on_exit`` is called if the interpreter exits while the portal runs (its owner's close, which stops it)."""

    def __init__(self, on_exit: Callable[[], None] | None = None) -> None:
        with _exit.lock:  # exit's close_all sees every portal that started, or none starts
            if _exit.begun:
                raise FanfoldError("the interpreter is exiting: its fleets are closed and none can start now;"
                                   " close fleets and sandboxes before the program ends (e.g. `with Fleet() as fleet:`)")
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name="fanfold-loop", daemon=True)
            self._thread.start()
            _exit.running[self] = on_exit

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        task, settled = self._start(coro)
        try:
            settled.wait()
        except BaseException:
            # Ctrl-C in the caller cancels the work instead of orphaning it, and waits for its
            # cleanups to end, so what the caller does next (an aclose, a close) never runs beside them.
            self.loop.call_soon_threadsafe(task.cancel)
            settled.wait()
            raise
        return task.result()

    def _start(self, coro: Coroutine[Any, Any, T]) -> tuple[asyncio.Task[T], threading.Event]:
        settled = threading.Event()

        async def start() -> asyncio.Task[T]:
            task = self.loop.create_task(coro)
            task.add_done_callback(lambda _: settled.set())
            return task

        return asyncio.run_coroutine_threadsafe(start(), self.loop).result(), settled

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        async def step() -> Any:
            try:
                return await agen.__anext__()
            except StopAsyncIteration:
                return _DONE

        try:
            while (item := self.call(step())) is not _DONE:
                yield item
        finally:
            closer = getattr(agen, "aclose", None)
            if closer is not None:
                self.call(closer())

    def stop(self) -> None:
        with _exit.lock:
            _exit.running.pop(self, None)
        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self.loop).result(timeout=STOP_GRACE_S)
            except TimeoutError:
                pass  # work that will not end: the loop stops under it
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
        if not self.loop.is_running():
            self.loop.close()


STOP_GRACE_S = 10.0


async def _cancel_the_rest() -> None:
    """Cancel every other task on this loop and wait for them: their waiters wake."""
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in others:
        task.cancel()
    if others:
        await asyncio.wait(others)


class _Exit:
    """The portals still running, and whether the interpreter has begun to exit."""

    def __init__(self) -> None:
        self.running: dict[Portal, Callable[[], None] | None] = {}
        self.begun = False
        self.lock = threading.Lock()

    def close_all(self) -> None:
        with self.lock:
            self.begun = True
            running = list(self.running.items())
        for portal, on_exit in reversed(running):  # the newest first, as atexit would
            try:
                if on_exit is not None:
                    on_exit()
            except Exception as exc:  # one owner's failure must not leave the others' sandboxes behind
                print(f"fanfold: closing at exit failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            finally:
                portal.stop()

    def forget(self) -> None:
        # A forked child has none of its parent's loop threads: waiting on them at its exit would hang.
        self.running.clear()
        self.lock = threading.Lock()  # another thread may have held it at the fork


_exit = _Exit()
threading._register_atexit(_exit.close_all)  # type: ignore[attr-defined] - see the module docstring
os.register_at_fork(after_in_child=_exit.forget)
