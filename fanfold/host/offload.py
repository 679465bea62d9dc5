"""Slow host calls off the event loop, and their OSErrors turned into fanfold's errors."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Awaitable, Callable, Iterator, TypeVar

from ..errors import InfrastructureError, host_full

T = TypeVar("T")
# Threads of their own: mounts and releases never queue behind file copies and other thread work.
# Sixteen, as a release waits on one for its sandbox's PID 1 to end: with 8, a 500-create burst
# ran 10% slower here (creates queued behind those waits).
_HOST_THREADS = ThreadPoolExecutor(max_workers=16, thread_name_prefix="fanfold-host")


@contextmanager
def host_errors(what: str) -> Iterator[None]:
    """An OSError from mounts, cgroups or the runtime's files leaves as the retryable
    InfrastructureError (CapacityExceeded for a full filesystem), saying ``what`` failed, never as
    a raw traceback to a client."""
    try:
        yield
    except OSError as err:
        raise host_full(err, what) or InfrastructureError(f"{what}: {err}") from None


async def on_thread(
    fn: Callable[..., T], *args: Any, executor: ThreadPoolExecutor | None = _HOST_THREADS,
    discard: Callable[[T], object] | None = None,
) -> T:
    """``fn(*args)`` on a thread (of ``executor``; None: the loop's default), so slow syscalls
    leave the loop free. A thread cannot be stopped: on cancellation this waits for it to end
    before raising, so the caller's cleanup sees everything it made (a mount made after the
    cleanup ran would leak), and ``discard`` releases what it returned, which no one else will."""
    done = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        while not done.done():
            try:
                await asyncio.shield(done)
            except asyncio.CancelledError:
                pass
        if discard is not None and done.exception() is None:
            discard(done.result())
        raise


async def to_the_end(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even when cancelled meanwhile, then raise the cancellation: for
    cleanup that must not be cut off (a build step's container left running). Under the server an
    anyio cancel scope cancels every await again, not just the one it found running."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


async def read_once(fd: int, size: int = 16) -> bytes:
    """The first bytes on ``fd`` (b"" at end of file), without blocking the loop."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[bytes] = loop.create_future()

    def readable() -> None:
        if not got.done():
            got.set_result(os.read(fd, size))

    loop.add_reader(fd, readable)
    try:
        return await got
    finally:
        loop.remove_reader(fd)
