"""A command that runs while its caller talks to it: live stdin, signals, a terminal's size."""

from __future__ import annotations

import asyncio
import signal as signals
from typing import Any, AsyncIterator

from .._agent.client import ExecControl
from ..errors import CapacityExceeded, InvalidRequest
from ..models import ExecResult, OutputChunk, Pty


class AsyncProcess:
    """A command started by ``AsyncSandbox.spawn``. Its output comes from ``output()`` (the result of
    ``wait()`` keeps none); with a ``pty`` it is one stream, stdout, and Ctrl-C is ``write(b"\\x03")``."""

    def __init__(self, control: ExecControl, task: asyncio.Task[ExecResult],
                 chunks: asyncio.Queue[OutputChunk | None], pty: Pty | None) -> None:
        self._control, self._task, self._chunks = control, task, chunks
        self.pty = pty
        """The terminal it runs on, or None (pipes)."""

    @property
    def pid(self) -> int | None:
        """The command's pid inside the sandbox, once started."""
        return self._control.pid

    async def write(self, data: bytes | str) -> None:
        """Send ``data`` to the command's stdin (a terminal's input, keys included)."""
        try:
            self._control.write(data.encode() if isinstance(data, str) else bytes(data))
        except ValueError as err:
            raise InvalidRequest(str(err)) from None
        except BufferError as err:
            raise CapacityExceeded(f"{err}: write again once it reads") from None

    async def close_stdin(self) -> None:
        """End the command's stdin (on a terminal, nothing: send ``b"\\x04"`` for end of file)."""
        self._control.close_stdin()

    async def signal(self, signum: int) -> None:
        """Send ``signum`` to the command's process group."""
        self._control.signal(int(signum))

    async def resize(self, rows: int, cols: int) -> None:
        """Give the command's terminal a new size (it gets SIGWINCH)."""
        try:
            self._control.resize(rows, cols)
        except ValueError as err:
            raise InvalidRequest(str(err)) from None

    async def kill(self) -> None:
        """SIGKILL the command's process group."""
        self._control.signal(signals.SIGKILL)

    async def output(self) -> AsyncIterator[OutputChunk]:
        """The output as it comes, until the command has ended and all of it was read."""
        while (chunk := await self._chunks.get()) is not None:
            yield chunk
        self._chunks.put_nowait(None)  # a later call ends at once

    async def wait(self) -> ExecResult:
        """The command's result once it has ended (its output is ``output()``'s, not kept here)."""
        return await asyncio.shield(self._task)

    async def _cancel(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def spawn(exec_call: Any, cmd: str | list[str], *, pty: Pty | None, env: dict[str, str] | None,
                **kwargs: Any) -> AsyncProcess:
    """Start ``cmd`` through ``exec_call`` (a transport's ``exec`` that takes a ``control``) and return
    once it runs (or has ended: a program that could not start gives a result of 126 or 127)."""
    if pty is not None and not isinstance(pty, Pty):
        raise InvalidRequest(f"pty is a fanfold.Pty(rows, cols), got {pty!r}")
    control = ExecControl(keep_output=False, pty=None if pty is None else (pty.rows, pty.cols))
    if pty is not None:
        env = {"TERM": pty.term, **(env or {})}
    chunks: asyncio.Queue[OutputChunk | None] = asyncio.Queue()  # bounded by the agent's max_output

    def push(stream: str, data: bytes) -> None:
        chunks.put_nowait(OutputChunk(stream=stream, data=data))

    task = asyncio.ensure_future(exec_call(cmd, env=env, on_output=push, control=control, **kwargs))
    task.add_done_callback(lambda _: chunks.put_nowait(None))
    task.add_done_callback(lambda done: done.cancelled() or done.exception())  # raised by wait(), if asked
    started = asyncio.ensure_future(asyncio.shield(control.started))
    try:
        await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        started.cancel()
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc] - what the exec raised (one that could not start: 126/127)
    return AsyncProcess(control, task, chunks, pty)
