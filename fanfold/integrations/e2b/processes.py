"""The processes envd clients run, per sandbox: pid -> the exec behind it, its live stdin and
signals (``ExecControl``), and the streams (``Start``, ``Connect``) that follow its output.

A process outlives the streams that watch it: a client that disconnects only stops watching.
It ends on its own, by a signal, with its sandbox, or when ``end_all`` ends it before the
sandbox is paused, forked or snapshotted: the engine waits for every exec to finish before it
checkpoints a sandbox, and a process fed from a host connection cannot be checkpointed, so
unlike E2B's, fanfold's processes do not survive a pause.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..._agent.client import ExecControl
from ...engine import Engine
from ...errors import FanfoldError
from ...models import ExecResult, Outcome
from .connect import RpcError, b64, rpc_error

log = logging.getLogger("fanfold.e2b")
UNLIMITED_OUTPUT = 1 << 60
"""Output streams to watchers and is not kept, so the agent need not cut it."""
MAX_BACKLOG_BYTES = 4 * 1024 * 1024
"""Bytes of output (as base64) a watcher's queue holds before the command waits for it to read: the
command's output then waits in the agent's buffer and the pipe, and the command blocks on its writes."""
REPLAY_BYTES = 1024 * 1024
"""Output (as base64) a process keeps to replay to a client that connects to it later: its latest."""
END_GRACE_S = 2.0
"""How long ``end_all`` waits for SIGKILLed processes before it cancels their execs."""

Event = dict[str, Any]


@dataclass(frozen=True)
class Ended:
    """The last item a watcher gets: the stream ends, with ``error`` or cleanly."""

    error: RpcError | None = None


Item = Event | Ended


class Backlog(asyncio.Queue[Item]):
    """A watcher's queue, which counts the output it holds; ``put_output`` waits while it holds
    ``MAX_BACKLOG_BYTES`` or more, until the watcher reads or leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 0
        self.left = False
        self._room = asyncio.Event()
        self._room.set()

    async def put_output(self, item: Event) -> None:
        while self.size >= MAX_BACKLOG_BYTES and not self.left:
            self._room.clear()
            await self._room.wait()
        if not self.left:
            self.put_nowait(item)

    def leave(self) -> None:
        """The watcher is gone: nothing waits on its queue any more."""
        self.left = True
        self._room.set()

    def _put(self, item: Item) -> None:
        self.size += _weight(item)
        super()._put(item)

    def _get(self) -> Item:
        item = super()._get()
        self.size -= _weight(item)
        if self.size < MAX_BACKLOG_BYTES:
            self._room.set()
        return item


def _weight(item: Item) -> int:
    data = item.get("data") if isinstance(item, dict) else None
    return sum(len(text) for text in data.values()) if isinstance(data, dict) else 0


@dataclass(eq=False)
class Process:
    """One running command and who watches it. Its output waits for its slowest watcher: a client
    that reads slowly slows the command down (backpressure) rather than losing output."""

    config: dict[str, Any]
    """Its ProcessConfig as the client sent it (cmd, args, envs, cwd), for ``List``."""
    tag: str | None
    control: ExecControl
    pid: int = 0
    task: asyncio.Task[ExecResult] | None = None
    watchers: set[Backlog] = field(default_factory=set)
    recent: collections.deque[Event] = field(default_factory=collections.deque)
    """Its latest output, up to ``REPLAY_BYTES``, for ``watch(replay=True)``."""
    recent_size: int = 0

    def watch(self, *, replay: bool = False) -> Backlog:
        """A queue of the output from now on; with ``replay``, from the latest output kept."""
        queue = Backlog()
        for item in self.recent if replay else ():
            queue.put_nowait(item)
        self.watchers.add(queue)
        return queue

    def unwatch(self, queue: Backlog) -> None:
        self.watchers.discard(queue)
        queue.leave()

    async def output(self, stream: str, data: bytes) -> None:
        """The exec's ``on_output``: the agent's stream is not read again until every watcher has room."""
        item = {"data": {stream: b64(data)}}
        self._keep(item)  # before any wait: a client connecting meanwhile gets it by replay
        for queue in list(self.watchers):
            await queue.put_output(item)

    def _keep(self, item: Event) -> None:
        self.recent.append(item)
        self.recent_size += _weight(item)
        while self.recent_size > REPLAY_BYTES and len(self.recent) > 1:
            self.recent_size -= _weight(self.recent.popleft())

    def finished(self, event: Event | None, error: RpcError | None) -> None:
        """What every watcher gets last: the end event (if any), then the stream's end."""
        for queue in list(self.watchers):
            if event is not None:
                queue.put_nowait(event)
            queue.put_nowait(Ended(error))


class Processes:
    """Every sandbox's running processes, started through one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._live: dict[str, dict[int, Process]] = {}
        self._all: dict[str, set[Process]] = {}
        """Started or starting, by sandbox: what ``end_all`` ends."""
        self._quiet: set[str] = set()
        """Sandboxes being paused or forked: no process may start in them."""

    async def start(self, sandbox_id: str, argv: list[str], *, config: dict[str, Any], tag: str | None,
                    env: dict[str, str] | None, cwd: str | None, user: str | None, stdin: bool,
                    timeout: float | None, pty: tuple[int, int] | None = None) -> tuple[Process, Backlog]:
        """Start ``argv`` and return it with a queue watching it from its first byte of output; the
        start failure (a missing program or cwd) as RpcError."""
        if sandbox_id in self._quiet:
            raise RpcError("unavailable", f"sandbox {sandbox_id} is being paused or forked")
        process = Process(config=config, tag=tag, control=ExecControl(keep_output=False, pty=pty))
        queue = process.watch()
        process.task = asyncio.create_task(self.engine.exec(
            sandbox_id, argv, cwd=cwd, env=env, timeout=timeout, max_output=UNLIMITED_OUTPUT,
            on_output=process.output, user=user, control=process.control,
        ))
        self._all.setdefault(sandbox_id, set()).add(process)
        process.control.started.add_done_callback(lambda _: self._register(sandbox_id, process))
        process.task.add_done_callback(lambda task: self._ended(sandbox_id, process, task))
        try:
            await asyncio.wait({process.task, process.control.started}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client left: the process runs on, unwatched
            process.unwatch(queue)
            raise
        if not process.pid:  # the exec ended before its command started
            process.unwatch(queue)
            raise _start_failure(process.task, sandbox_id)
        if not stdin:
            process.control.close_stdin()
        return process, queue

    def get(self, sandbox_id: str, selector: dict[str, Any]) -> Process:
        """The running process a ProcessSelector names (``pid`` or ``tag``); not_found otherwise."""
        live = self._live.get(sandbox_id, {})
        pid, tag = selector.get("pid"), selector.get("tag")
        found = live.get(pid) if isinstance(pid, int) else next(
            (p for p in live.values() if tag is not None and p.tag == tag), None)
        if found is None:
            raise RpcError("not_found", f"no running process {pid if tag is None else tag!r} in sandbox {sandbox_id}")
        return found

    def running(self, sandbox_id: str) -> list[Process]:
        return sorted(self._live.get(sandbox_id, {}).values(), key=lambda p: p.pid)

    async def end_all(self, sandbox_id: str) -> int:
        """SIGKILL every process of the sandbox and wait until their execs let go of it; returns how many."""
        ending = list(self._all.get(sandbox_id, ()))
        for process in ending:
            if process.control.started.done():
                process.control.signal(signal.SIGKILL)
        tasks = [p.task for p in ending if p.task is not None]
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=END_GRACE_S)
            for task in stuck:  # not started yet, or deaf: closing its connection kills it too
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        return len(ending)

    @contextlib.asynccontextmanager
    async def quiet(self, sandbox_id: str) -> AsyncIterator[None]:
        """End the sandbox's processes, and start none, while the body (a pause, a fork) runs."""
        self._quiet.add(sandbox_id)
        try:
            await self.end_all(sandbox_id)
            yield
        finally:
            self._quiet.discard(sandbox_id)

    async def close(self) -> None:
        """End every process (the app is shutting down)."""
        await asyncio.gather(*(self.end_all(sandbox_id) for sandbox_id in list(self._all)))

    def _register(self, sandbox_id: str, process: Process) -> None:
        started = process.control.started
        if started.cancelled() or started.exception() is not None:
            return
        process.pid = started.result()
        self._live.setdefault(sandbox_id, {})[process.pid] = process

    def _ended(self, sandbox_id: str, process: Process, task: asyncio.Task[ExecResult]) -> None:
        live = self._live.get(sandbox_id, {})
        if live.get(process.pid) is process:
            del live[process.pid]
        if not live:
            self._live.pop(sandbox_id, None)
        processes = self._all.get(sandbox_id, set())
        processes.discard(process)
        if not processes:
            self._all.pop(sandbox_id, None)
        if process.control.started.done():
            process.finished(*end_event(task, sandbox_id))
        elif not process.control.started.cancelled():
            process.control.started.cancel()  # nobody waits on it now


def end_event(task: asyncio.Task[ExecResult], sandbox_id: str) -> tuple[Event | None, RpcError | None]:
    """A finished exec as envd ends a process stream: the ``end`` event, or the stream's error."""
    if task.cancelled():
        return None, RpcError("unavailable", f"the process was ended as sandbox {sandbox_id} stopped")
    err = task.exception()
    if isinstance(err, FanfoldError):
        return None, rpc_error(err, sandbox_id)
    if err is not None:
        log.error("fanfold e2b: a process of sandbox %s failed", sandbox_id, exc_info=err)
        return None, RpcError("internal", f"fanfold bug: {type(err).__name__}: {err}")
    result = task.result()
    if result.outcome is Outcome.TIMEOUT:
        return None, RpcError("deadline_exceeded", "the command ran past its timeout and was killed")
    if result.outcome is Outcome.EXITED:
        code = result.exit_code or 0
        return {"end": {"exitCode": code, "exited": True, "status": f"exit status {code}"}}, None
    end: dict[str, Any] = {"exitCode": -1, "exited": False, "status": f"signal: {_signal_name(result.signal)}"}
    if result.outcome is Outcome.OOM:
        end["error"] = "the sandbox ran out of memory"
    return {"end": end}, None


def _signal_name(number: int | None) -> str:
    """As Go's os.ProcessState says it: ``killed``, ``terminated``, ..."""
    names = {signal.SIGKILL: "killed", signal.SIGTERM: "terminated", signal.SIGINT: "interrupt",
             signal.SIGHUP: "hangup", signal.SIGSEGV: "segmentation fault", signal.SIGPIPE: "broken pipe"}
    with contextlib.suppress(ValueError, TypeError):
        sig = signal.Signals(number)  # type: ignore[arg-type]
        return names.get(sig, sig.name)
    return f"signal {number}"


def _start_failure(task: asyncio.Task[ExecResult], sandbox_id: str) -> RpcError:
    """Why an exec ended before its command started: fanfold's error, or the agent's start failure."""
    if task.cancelled():
        return RpcError("unavailable", f"sandbox {sandbox_id} stopped before the command started")
    err = task.exception()
    if isinstance(err, FanfoldError):
        return rpc_error(err, sandbox_id)
    if err is not None:
        log.error("fanfold e2b: a start in sandbox %s failed", sandbox_id, exc_info=err)
        return RpcError("internal", f"fanfold bug: {type(err).__name__}: {err}")
    text = task.result().stderr.decode(errors="replace").strip()
    return RpcError("invalid_argument", text or "the command could not start")


def missing_program(err: RpcError) -> bool:
    """Whether a start failed because its program does not exist (errno 2 at exec)."""
    return err.code == "invalid_argument" and "No such file or directory" in err.message and "cannot run" in err.message
