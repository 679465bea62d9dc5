"""Fan-out: run many rollouts at once and stream their results as they finish.

``AsyncRollouts`` is both ``fleet.map`` (a fixed list of items) and ``fleet.queue`` (items
put over time). Infrastructure errors (``Retryable``) are retried with backoff and counted
apart from a rollout's own failures, so they are never mistaken for a zero reward; each
attempt has a deadline.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

from ..errors import InvalidRequest, Retryable

RolloutFn = Callable[[Any], Awaitable[Any] | Any]


@dataclass
class RolloutResult:
    """One rollout's end: ``value`` when ``status`` is ``ok``, else ``error``.

    ``failed`` and ``timeout`` are the rollout's own doing; ``infra_error`` means the fleet
    failed it ``attempts`` times in a row, and it must not be scored.
    """

    index: int
    item: Any
    status: str
    value: Any = None
    error: BaseException | None = None
    attempts: int = 1
    infra_errors: int = 0
    started_at: float = 0.0
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class RolloutStats:
    """Counts so far; ``infra_retries`` are attempts lost to the fleet and then retried."""

    submitted: int = 0
    done: int = 0
    in_flight: int = 0
    ok: int = 0
    failed: int = 0
    timeout: int = 0
    infra_error: int = 0
    infra_retries: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class AsyncRollouts:
    """Rollouts running ``concurrency`` at a time; ``async for result in rollouts`` yields
    each as it finishes. ``put`` adds items (waiting while ``max_pending`` wait already);
    ``close`` says no more will come, after which iteration ends once all are done.
    ``async with`` cancels what still runs on leaving the block (a loop left by ``break``
    does so too, but only once the iterator is collected)."""

    def __init__(
        self, rollout_fn: RolloutFn, *, concurrency: int = 16, retries: int = 2, deadline: float | None = None,
        backoff: float = 0.5, progress: bool | None = None, total: int | None = None,
        max_pending: int | None = None, items: Iterable[Any] | None = None,
    ) -> None:
        _check(concurrency=concurrency, retries=retries, deadline=deadline, backoff=backoff)
        self._fn, self._retries, self._deadline, self._backoff = rollout_fn, retries, deadline, backoff
        self._concurrency = concurrency
        self._inbox: asyncio.Queue[tuple[int, Any] | None] = asyncio.Queue(max_pending or 2 * concurrency)
        self._outbox: asyncio.Queue[RolloutResult | None] = asyncio.Queue()
        self._workers: list[asyncio.Task[None]] = []
        self._items, self._feeder = items, None
        self._threads: ThreadPoolExecutor | None = None
        self._closed = self._cancelled = False
        self.stats = RolloutStats()
        self._progress = _Progress("rollouts", total) if _want_progress(progress) else None

    async def put(self, item: Any) -> int:
        """Queue one item; returns its index (results carry it)."""
        if self._closed:
            raise InvalidRequest("this rollout queue is closed; make a new one to run more")
        self._start()
        index = self.stats.submitted
        self.stats.submitted += 1
        await self._inbox.put((index, item))
        return index

    async def close(self) -> None:
        """No more items: iteration ends once those already put are done."""
        if not self._closed:
            self._closed = True
            self._start()
            for _ in self._workers:
                await self._inbox.put(None)

    async def cancel(self) -> None:
        """Stop now: running rollouts are cancelled (their ``async with`` sandboxes die)."""
        self._closed = True
        tasks = [*self._workers, *([self._feeder] if self._feeder else [])]
        if not self._cancelled:  # once: a second cancel would cut short the cleanups the first started
            self._cancelled = True
            for task in tasks:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        if self._progress:
            self._progress.stop()

    async def __aenter__(self) -> AsyncRollouts:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cancel()

    async def __aiter__(self) -> AsyncIterator[RolloutResult]:
        self._start()
        finished = 0
        try:
            while True:
                result = await self._outbox.get()
                if result is None:
                    finished += 1
                    if finished == len(self._workers):
                        return
                    continue
                yield result
        finally:
            await self.cancel()

    def _start(self) -> None:
        if self._workers:
            return
        self._workers = [asyncio.create_task(self._work()) for _ in range(self._concurrency)]
        if self._items is not None:
            self._feeder = asyncio.create_task(self._feed(self._items))

    async def _feed(self, items: Iterable[Any]) -> None:
        for item in items:
            await self.put(item)
        await self.close()

    async def _work(self) -> None:
        try:
            while (entry := await self._inbox.get()) is not None:
                self.stats.in_flight += 1
                try:
                    result = await self._run(*entry)
                finally:
                    self.stats.in_flight -= 1
                self._count(result)
                self._outbox.put_nowait(result)
        finally:
            self._outbox.put_nowait(None)

    async def _run(self, index: int, item: Any) -> RolloutResult:
        started, infra = time.time(), 0
        for attempt in range(1, self._retries + 2):
            status, value, error = await self._attempt(item)
            if status != "infra_error" or attempt > self._retries:
                break
            infra += 1
            self.stats.infra_retries += 1
            await asyncio.sleep(self._backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
        return RolloutResult(index=index, item=item, status=status, value=value, error=error, attempts=attempt,
                             infra_errors=infra + (status == "infra_error"), started_at=started,
                             duration_s=time.time() - started)

    async def _attempt(self, item: Any) -> tuple[str, Any, BaseException | None]:
        try:
            return "ok", await asyncio.wait_for(self._call(item), self._deadline), None
        except asyncio.TimeoutError as exc:
            return "timeout", None, exc
        except Retryable as exc:
            return "infra_error", None, exc
        except Exception as exc:  # the rollout's own failure: reported, never raised into the loop
            return "failed", None, exc

    async def _call(self, item: Any) -> Any:
        if inspect.iscoroutinefunction(self._fn):
            return await self._fn(item)
        # A plain function runs on a thread of its own; past its deadline it is abandoned, not stopped.
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self._concurrency, thread_name_prefix="fanfold-rollout")
        value = await asyncio.get_running_loop().run_in_executor(self._threads, self._fn, item)
        return await value if inspect.isawaitable(value) else value

    def _count(self, result: RolloutResult) -> None:
        self.stats.done += 1
        setattr(self.stats, result.status, getattr(self.stats, result.status) + 1)
        if self._progress:
            self._progress.update(self.stats)


def _check(*, concurrency: int, retries: int, deadline: float | None, backoff: float) -> None:
    if not isinstance(concurrency, int) or not 1 <= concurrency <= 100_000:
        raise InvalidRequest(f"concurrency must be an integer from 1 to 100000, got {concurrency!r}")
    if not isinstance(retries, int) or not 0 <= retries <= 100:
        raise InvalidRequest(f"retries must be an integer from 0 to 100, got {retries!r}")
    if deadline is not None and not deadline > 0:
        raise InvalidRequest(f"deadline must be a positive number of seconds or None, got {deadline!r}")
    if not backoff >= 0:
        raise InvalidRequest(f"backoff must be >= 0 seconds, got {backoff!r}")


def _want_progress(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


class _Progress:
    """A rich progress bar on stderr: done of total, with ok / failed / infra counts."""

    def __init__(self, description: str, total: int | None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[counts]}"), TimeElapsedColumn(),
                             console=Console(stderr=True), transient=False)
        self._task = self._bar.add_task(description, total=total, counts="")
        self._bar.start()

    def update(self, stats: RolloutStats) -> None:
        counts = f"ok {stats.ok} failed {stats.failed} timeout {stats.timeout} infra {stats.infra_error}"
        if stats.infra_retries:
            counts += f" (retried {stats.infra_retries})"
        self._bar.update(self._task, completed=stats.done, counts=counts)

    def stop(self) -> None:
        self._bar.stop()
