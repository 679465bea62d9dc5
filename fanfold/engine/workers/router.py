"""The router: one host's engine as N worker processes, so its work spreads over the host's cores.

``EngineConfig(workers=N)`` (``FANFOLD_WORKERS``) makes the embedded fleet drive a ``Router``
instead of an ``Engine``: the same API, with every call carried to a worker process
(``worker.py``), each an ``Engine`` on the same state dir and database that mints, serves,
reaps and adopts only its share of the sandbox ids (``ids.shard_of``). A sandbox's calls go to
the worker its id names; creates go to the least busy worker; images, snapshots and lists to the
first (they are the database's and the disk's, the same for all); pools are shared out and
figures summed (``merge.py``).

The sandboxes are the router's (its token is their owner), not a worker's: a worker killed even
with SIGKILL is started again under the same index, adopts its share from the database as any
engine does at start, and reaps what that worker was half-way through; the calls it had in
flight fail with InfrastructureError (retryable). When the router's process ends, its workers
see the end of their socket and destroy what they made for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import logging
import math
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import ids
from ...config import EngineConfig
from ...errors import FanfoldError, InfrastructureError
from ..lifecycle import owner_token
from . import merge, wire

if TYPE_CHECKING:
    from ...images import Image
    from ...images.builder import Network, OnStep
    from ...images.oci import OnPull
    from ...groups import GroupInfo, GroupParams, GroupSnapshotInfo
    from ...models import CreateParams, ExecResult, FileEntry, ForkResult, Limits, PoolInfo, SandboxInfo, SnapshotInfo
    from ...spec import EnvSpec
    from ...ssh import SshAccess
    from ..api import OnOutput

log = logging.getLogger("fanfold.engine")
START_TIMEOUT_S = 120.0
"""How long a worker may take to start (its engine's start reconciles the host)."""
RESTART_DELAYS_S = (0.0, 0.5, 2.0, 5.0)
"""Waits before each try to start a worker that died again; then every last one."""


class _Worker:
    """The router's end of one worker: its process, channel and the calls in flight on it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: asyncio.subprocess.Process | None = None
        self.channel: wire.Channel | None = None
        self.calls: dict[int, asyncio.Future[tuple[Any, ...]] | asyncio.Queue[tuple[Any, ...]]] = {}
        """Each call's answer: a future, or a queue where the call relays callbacks too."""
        self.up = asyncio.Event()
        self.failed: FanfoldError | None = None
        """Why the last start failed: calls to this worker fail with it until a start succeeds."""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def send(self, message: tuple[Any, ...]) -> None:
        if self.channel is None or not self.channel.open or not self.up.is_set():
            raise InfrastructureError(f"engine worker {self.index} is restarting; try again")
        self.channel.send(wire.encode(message))

    def deliver(self, frame: tuple[Any, ...]) -> None:
        """A frame from the worker, to the call it answers."""
        waiting = self.calls.get(frame[1])
        if isinstance(waiting, asyncio.Queue):
            waiting.put_nowait(frame)
        elif waiting is not None and not waiting.done():
            waiting.set_result(frame)

    def end_calls(self, why: str) -> None:
        for waiting in list(self.calls.values()):
            if isinstance(waiting, asyncio.Queue):
                waiting.put_nowait((why,))
            elif not waiting.done():
                waiting.set_result((why,))


class Router:
    """An engine API over N worker processes (see the module's docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.workers < 1:
            raise ValueError("a Router needs workers >= 1; workers=0 is the in-process Engine")
        self.config = config
        self.owner = owner_token()
        self.workers = [_Worker(index) for index in range(config.workers)]
        self._serial = itertools.count(1)
        self._turn = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False
        self._closing = False

    # -- life of the workers ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker (the first alone: it readies the host for the rest), then the config's pools."""
        if self._started:
            return
        self._closing = False
        try:
            # Every process loads its code at once; the first engine readies the host before the rest start.
            spawned = [await self._spawn_process(worker) for worker in self.workers]
            await self._launch(self.workers[0], spawned[0])
            await asyncio.gather(*(self._launch(w, pair) for w, pair in zip(self.workers[1:], spawned[1:])))
        except BaseException:
            await self._stop_all()
            raise
        self._started = True
        for ref, size in self.config.pools:
            await self.set_pool(ref, size)

    async def close(self) -> None:
        """Close every worker: each destroys the sandboxes it made for this router (not detached ones)."""
        if not self._started:
            return
        self._started = False
        await self._stop_all()

    async def _stop_all(self) -> None:
        self._closing = True
        for task in list(self._tasks):  # watchers and restarts: no worker starts after this
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in self.workers:
            worker.up.clear()
            if worker.channel is not None:
                worker.channel.close()  # the end of its stream: the worker closes its engine and exits
            worker.end_calls("closed")
        await asyncio.gather(*(self._wait_exit(worker) for worker in self.workers))

    async def _wait_exit(self, worker: _Worker) -> None:
        if worker.process is not None and worker.process.returncode is None:
            await worker.process.wait()

    def worker_config(self) -> EngineConfig:
        """Each worker's engine: no workers of its own, its share of the create slots, no pools yet (the
        router shares them out once all are up)."""
        cfg = self.config
        return dataclasses.replace(cfg, workers=0, pools=(), max_creating=math.ceil(cfg.max_creating / cfg.workers))

    async def _spawn_process(self, worker: _Worker) -> asyncio.Future[tuple[Any, ...]]:
        """Start the worker's process, which waits for its first frame; returns the future of its answer to it."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            worker.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fanfold.engine.workers.worker", str(theirs.fileno()),
                pass_fds=(theirs.fileno(),), env=_worker_env(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        first: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()
        worker.channel = await wire.open_channel(ours, lambda frame: first.done() or first.set_result(frame))
        worker.channel.ended.add_done_callback(lambda _: first.done() or first.set_result(("ended",)))
        return first

    async def _launch(self, worker: _Worker, first: asyncio.Future[tuple[Any, ...]] | None = None) -> None:
        """Start the worker's engine (and its process, unless spawned already: ``first``) and wait for it
        to be up; InfrastructureError if it is not."""
        first = first or await self._spawn_process(worker)
        assert worker.process is not None and worker.channel is not None
        channel = worker.channel
        channel.send(wire.encode(("start", self.worker_config(), self.owner, (worker.index, len(self.workers)))))
        try:
            answer = await asyncio.wait_for(first, START_TIMEOUT_S)
        except asyncio.TimeoutError:
            answer = ("ended",)
        if answer[0] != "ready":
            channel.close()
            if answer[0] != "err":
                worker.process.kill()
            await worker.process.wait()
            if answer[0] == "err":
                raise answer[2]
            raise InfrastructureError(f"engine worker {worker.index} died as it started (exit status"
                                      f" {worker.process.returncode}); its log is on this process's stderr")
        channel.on_frame = worker.deliver
        worker.failed = None
        worker.up.set()
        self._spawn(self._watch(worker, channel))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, worker: _Worker, channel: wire.Channel) -> None:
        """At the end of the worker's stream: fail the calls left and start the worker again."""
        await channel.ended
        worker.up.clear()
        worker.end_calls("lost")
        if self._closing:
            return
        await self._wait_exit(worker)
        log.error("fanfold: engine worker %d (pid %s) died with status %s; starting it again",
                  worker.index, worker.pid, worker.process.returncode if worker.process else None)
        await self._restart(worker)

    async def _restart(self, worker: _Worker) -> None:
        for attempt in itertools.count():
            await asyncio.sleep(RESTART_DELAYS_S[min(attempt, len(RESTART_DELAYS_S) - 1)])
            if self._closing:
                return
            try:
                await self._launch(worker)
                return
            except (FanfoldError, OSError) as err:  # OSError: no process could be started (out of pids, memory)
                worker.failed = err if isinstance(err, FanfoldError) else InfrastructureError(
                    f"engine worker {worker.index} could not be started again: {err}")
                log.error("fanfold: engine worker %d did not start again: %s", worker.index, err)

    # -- calls -------------------------------------------------------------------------------------

    async def _call(self, index: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` on worker ``index``, relaying its callbacks; the worker's error is raised here."""
        worker = self.workers[index]
        if not worker.up.is_set():
            if worker.failed is not None or not self._started:
                raise worker.failed or InfrastructureError("the engine is not started: call start() first")
            try:
                await asyncio.wait_for(worker.up.wait(), START_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise InfrastructureError(f"engine worker {index} is not back; try again") from None
        callbacks = {name: kwargs[name] for name in wire.CALLBACKS if kwargs.get(name) is not None}
        kwargs.update({name: wire.Callback(name) for name in callbacks})
        call_id = next(self._serial)
        loop = asyncio.get_running_loop()
        waiting = asyncio.Queue() if callbacks else loop.create_future()
        worker.calls[call_id] = waiting
        try:
            worker.send(("call", call_id, method, args, kwargs))
            while True:
                frame = await (waiting.get() if isinstance(waiting, asyncio.Queue) else waiting)
                if frame[0] == "ok":
                    return frame[2]
                if frame[0] == "err":
                    raise frame[2]
                if frame[0] == "lost":
                    raise InfrastructureError(f"engine worker {index} died during {method}; it is being started"
                                              " again: try again")
                if frame[0] == "closed":
                    raise InfrastructureError(f"the engine closed during {method}")
                done = callbacks[frame[2]](*frame[3])
                if inspect.isawaitable(done):
                    await done
        except asyncio.CancelledError:
            if worker.up.is_set():
                try:
                    worker.send(("cancel", call_id))
                except InfrastructureError:
                    pass
            raise
        finally:
            worker.calls.pop(call_id, None)

    def _of(self, sandbox_id: str) -> int:
        return ids.shard_of(sandbox_id, len(self.workers))

    async def _on_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return list(await asyncio.gather(*(self._call(w.index, method, *args, **kwargs) for w in self.workers)))

    def _least_busy(self) -> int:
        """The worker with the fewest calls in flight (in turn among equals)."""
        turn = next(self._turn)
        count = len(self.workers)

        def load(index: int) -> int:
            worker = self.workers[index]
            return len(worker.calls) if worker.up.is_set() else 1 << 30  # a restarting one last

        return min(((turn + step) % count for step in range(count)), key=load)

    def pids(self) -> list[int]:
        """The worker processes' pids (for figures of their CPU)."""
        return [worker.pid for worker in self.workers if worker.pid is not None]

    # -- images: the first worker's (the disk and database are every worker's) -----------------------

    async def build(self, spec: EnvSpec, on_step: OnStep | None = None, *, network: Network = "isolated",
                    tag: str | None = None) -> Image:
        return await self._call(0, "build", spec, on_step=on_step, network=network, tag=tag)

    async def images(self) -> list[Image]:
        return await self._call(0, "images")

    async def pull(self, ref: str, *, platform: str | None = None, on_progress: OnPull | None = None) -> Image:
        return await self._call(0, "pull", ref, platform=platform, on_progress=on_progress)

    async def import_image(self, path: str | Path, *, ref: str | None = None,
                           on_progress: OnPull | None = None) -> Image:
        return await self._call(0, "import_image", str(Path(path).absolute()), ref=ref, on_progress=on_progress)

    async def remove_image(self, ref: str, *, force: bool = False) -> str:
        return await self._call(0, "remove_image", ref, force=force)

    async def share_image(self, ref: str, shared: bool = True) -> Image:
        return await self._call(0, "share_image", ref, shared)

    async def login(self, registry: str, username: str, password: str) -> None:
        await self._on_all("login", registry, username, password)

    async def logout(self, registry: str) -> None:
        await self._on_all("logout", registry)

    # -- sandboxes ---------------------------------------------------------------------------------

    async def create(self, params: CreateParams) -> SandboxInfo:
        return await self._call(self._least_busy(), "create", params)

    async def set_network(self, sandbox_id: str, network: Any, *, cut: bool = False) -> SandboxInfo:
        return await self._call(self._of(sandbox_id), "set_network", sandbox_id, network, cut=cut)

    async def network_stats(self, sandbox_id: str) -> dict[str, Any]:
        return await self._call(self._of(sandbox_id), "network_stats", sandbox_id)

    async def expose(self, sandbox_id: str, port: int) -> str:
        return await self._call(self._of(sandbox_id), "expose", sandbox_id, port)

    async def enable_ssh(self, sandbox_id: str, authorized_keys: list[str] | tuple[str, ...], *,
                         port: int = 22) -> SshAccess:
        from ..ssh import enable_ssh

        return await enable_ssh(self, sandbox_id, authorized_keys, port=port)

    async def recordings(self) -> list[dict[str, Any]]:
        return await self._call(0, "recordings")

    async def delete_recording(self, name: str) -> None:
        await self._call(0, "delete_recording", name)

    async def set_pool(self, image: str | Image, size: int | None, *, limits: Limits | None = None,
                       wait: float | None = None) -> PoolInfo:
        shares = merge.split(size, len(self.workers))
        infos = await asyncio.gather(*(self._call(w.index, "set_pool", image, share, limits=limits, wait=wait)
                                       for w, share in zip(self.workers, shares)))
        return merge.pools([[info] for info in infos])[0]

    async def pools_info(self) -> list[PoolInfo]:
        return merge.pools(await self._on_all("pools_info"))

    async def stats(self) -> dict[str, Any]:
        return merge.stats(await self._on_all("stats"))

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self._call(self._of(sandbox_id), "get", sandbox_id)

    async def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        return await self._call(0, "list", labels)

    async def kill(self, sandbox_id: str) -> None:
        await self._call(self._of(sandbox_id), "kill", sandbox_id)

    # -- groups: a group and its members are one worker's (its id names it); the rows are every worker's --

    async def create_group(self, params: GroupParams) -> GroupInfo:
        return await self._call(self._least_busy(), "create_group", params)

    async def get_group(self, group_id: str) -> GroupInfo:
        return await self._call(0, "get_group", group_id)

    async def list_groups(self) -> list[GroupInfo]:
        return await self._call(0, "list_groups")

    async def kill_group(self, group_id: str) -> None:
        await self._call(self._of(group_id), "kill_group", group_id)

    async def snapshot_group(self, group_id: str, *, memory: bool = False,
                             name: str | None = None) -> GroupSnapshotInfo:
        return await self._call(self._of(group_id), "snapshot_group", group_id, memory=memory, name=name)

    async def fork_group(self, group_id: str, count: int) -> list[GroupInfo]:
        return await self._call(self._of(group_id), "fork_group", group_id, count)

    async def group_snapshots(self) -> list[GroupSnapshotInfo]:
        return await self._call(0, "group_snapshots")

    async def delete_group_snapshot(self, snapshot_id: str) -> None:
        await self._call(0, "delete_group_snapshot", snapshot_id)

    # -- checkpoints: the sandbox's worker (a fork's children are its too) ------------------------------

    async def snapshot(self, sandbox_id: str, *, memory: bool = False, name: str | None = None) -> SnapshotInfo:
        return await self._call(self._of(sandbox_id), "snapshot", sandbox_id, memory=memory, name=name)

    async def fork(
        self, sandbox_id: str, count: int, *, cmd: str | list[str] | None = None, deadline: float | None = None,
    ) -> ForkResult:
        return await self._call(self._of(sandbox_id), "fork", sandbox_id, count, cmd=cmd, deadline=deadline)

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        return await self._call(self._of(sandbox_id), "pause", sandbox_id)

    async def unpause(self, sandbox_id: str) -> SandboxInfo:
        return await self._call(self._of(sandbox_id), "unpause", sandbox_id)

    async def suspend(self, sandbox_id: str) -> SandboxInfo:
        return await self._call(self._of(sandbox_id), "suspend", sandbox_id)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await self._call(self._of(sandbox_id), "resume", sandbox_id)

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        return await self._call(self._of(sandbox_id), "reset", sandbox_id)

    async def snapshots(self) -> list[SnapshotInfo]:
        return await self._call(0, "snapshots")

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return await self._call(0, "get_snapshot", snapshot_id)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._call(0, "delete_snapshot", snapshot_id)

    async def gc(self) -> list[str]:
        return await self._call(0, "gc")

    # -- commands and files: the sandbox's worker ----------------------------------------------------

    async def exec(
        self, sandbox_id: str, cmd: str | list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
        stdin: bytes | str | None = None, timeout: float | None = None, max_output: int | None = None,
        on_output: OnOutput | None = None, user: str | None = None,
    ) -> ExecResult:
        return await self._call(self._of(sandbox_id), "exec", sandbox_id, cmd, cwd=cwd, env=env, stdin=stdin,
                                timeout=timeout, max_output=max_output, on_output=on_output, user=user)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._call(self._of(sandbox_id), "read_file", sandbox_id, path)

    async def write_file(self, sandbox_id: str, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await self._call(self._of(sandbox_id), "write_file", sandbox_id, path, data, mode)

    async def upload(self, sandbox_id: str, local_path: str | Path, path: str) -> int:
        return await self._call(self._of(sandbox_id), "upload", sandbox_id, str(Path(local_path).absolute()), path)

    async def download(self, sandbox_id: str, path: str, local_path: str | Path) -> int:
        return await self._call(self._of(sandbox_id), "download", sandbox_id, path, str(Path(local_path).absolute()))

    async def list_files(self, sandbox_id: str, path: str = ".") -> list[FileEntry]:
        return await self._call(self._of(sandbox_id), "list_files", sandbox_id, path)

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self._call(self._of(sandbox_id), "remove_file", sandbox_id, path, recursive)


def _worker_env() -> dict[str, str]:
    """This process's environment, with this fanfold first on the import path: the workers run the same code."""
    root = str(Path(__file__).resolve().parents[3])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{path}" if path else root}
