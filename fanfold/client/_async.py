"""The async SDK. With no address the fleet runs an engine in this process (the default);
with one (``unix:///run/fanfold.sock``, ``http://host:port``) it talks to ``fanfold serve``."""

from __future__ import annotations

import asyncio
import functools
import inspect
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence, TypeVar

from ..config import EngineConfig, env_lease_ttl, env_token, env_url
from ..errors import InvalidRequest, SandboxNotFound
from ..groups import GroupInfo, GroupMember, GroupParams, GroupSnapshotInfo
from ..models import (
    CreateParams, ExecResult, FileEntry, ForkResult, Limits, OutputChunk, Persistence, PoolInfo, Pty, SandboxInfo,
    SnapshotInfo,
)
from ..spec import EnvSpec
from ..tools import run_tool
from ._fanout import AsyncRollouts, RolloutFn
from ._group import AsyncGroup, group_params
from ._process import AsyncProcess, spawn

if TYPE_CHECKING:  # the transports are imported when a fleet picks one: a remote client never loads the engine
    from ..compose.up import OnProgress
    from ..engine.api import OnOutput
    from ..images import Image
    from ..images.builder import Network, OnStep
    from ..images.oci import OnPull
    from ..engine.api import EngineAPI as Transport
    from ..ssh import SshAccess

T = TypeVar("T")
RAY_TRANSPORT = "fanfold.cluster.transport:RayTransport"
"""The transport of a ``ray://`` fleet, loaded by name: ``fanfold.cluster`` builds on this SDK (its
RayTransport drives an HttpTransport per node), so the SDK names it instead of importing it."""


class AsyncFleet:
    """A handle on one host's sandboxes: ``AsyncFleet()`` embeds the engine in-process,
    ``AsyncFleet(url, token=...)`` (or ``FANFOLD_URL``/``FANFOLD_TOKEN``) uses a server, and
    ``AsyncFleet("ray://auto")`` every fanfold node of a Ray cluster.

    Use it as ``async with AsyncFleet() as fleet:``; closing destroys the sandboxes it
    created (except ``detached`` ones).
    """

    def __init__(self, url: str | None = None, *, token: str | None = None, config: EngineConfig | None = None) -> None:
        self.url = url or env_url()
        self._started = False
        self._transport: Transport
        if self.url is None:
            from ..engine import Engine
            from ..engine.workers import Router

            config = config or EngineConfig()
            engine = Router(config) if config.workers else Engine(config)
            self._transport, self.config = engine, engine.config
        elif config is not None:
            raise InvalidRequest("config= sets up an embedded engine; a remote fleet uses its server's")
        elif self.url.startswith("ray://"):
            from .._extras import require

            require("ray", "a fleet on a Ray cluster (ray://)")
            module, _, name = RAY_TRANSPORT.partition(":")
            ray_transport = getattr(import_module(module), name)
            self._transport = ray_transport(ray_address(self.url), token=token, lease_ttl=env_lease_ttl())
            self.config = None
        else:
            from ._http import HttpTransport

            self._transport, self.config = HttpTransport(self.url, token or env_token(), lease_ttl=env_lease_ttl()), None

    @classmethod
    def ray(cls, address: str | None = "auto", *, token: str | None = None) -> AsyncFleet:
        """A fleet over every fanfold node of a Ray cluster (``fanfold ray start``): ``address`` is
        Ray's (``auto`` on the cluster, the head's ``HOST:6379``, ``ray://head:10001`` from outside
        through Ray Client, None for this process's Ray connection). ``ray()`` is ``AsyncFleet("ray://auto")``."""
        fleet = cls("ray://", token=token)
        fleet._transport.address = address  # type: ignore[attr-defined] - a RayTransport: the GCS's HOST:PORT too
        return fleet

    async def __aenter__(self) -> AsyncFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start the embedded engine (reaping what crashed owners left), or check the server and token."""
        await self._transport.start()
        self._started = True

    async def close(self) -> None:
        """Destroy this fleet's sandboxes (not detached ones) and stop its engine or connection."""
        self._started = False
        await self._transport.close()

    @property
    def started(self) -> bool:
        """Whether ``start`` ran and ``close`` did not since."""
        return self._started

    @property
    def aio(self) -> AsyncFleet:
        """This fleet: ``Fleet.aio`` is the AsyncFleet a sync fleet drives, so code given either twin
        reaches the async one as ``fleet.aio``."""
        return self

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro``: the twin of ``Fleet.call``, which runs async code on a sync fleet's loop."""
        return await coro

    async def build(self, spec: EnvSpec, *, on_step: OnStep | None = None, network: Network = "isolated",
                    tag: str | None = None) -> Image:
        """Build ``spec`` into an image; cached layers make a rebuild almost free. Its ``run`` steps
        reach the outside through NAT but nothing of the host; ``network="host"`` (the host's own
        tenant only, on a server) gives them the host's network. ``tag`` names it (``myenv:v2``):
        creates and builds may then use that name, as ``docker build -t`` does."""
        return await self._transport.build(spec, on_step, network=network, tag=tag)

    async def images(self) -> list[Image]:
        """Every image on the host (on a server: the tenant's own and shared ones): ``source`` says where
        each came from, ``names`` what names it."""
        return await self._transport.images()

    async def pull(self, ref: str, *, platform: str | None = None, on_progress: OnPull | None = None) -> Image:
        """Pull an image from its registry (``python:3.12-slim``, ``ghcr.io/org/env@sha256:...``).

        Layers already on the host are not fetched again; ``platform`` (``linux/arm64``) picks from a
        multi-arch index (default: this host's); ``on_progress`` gets a ``PullEvent`` per layer."""
        return await self._transport.pull(ref, platform=platform, on_progress=on_progress)

    async def import_image(self, path: str | Path, *, ref: str | None = None,
                           on_progress: OnPull | None = None) -> Image:
        """Import a ``docker save`` tarball, an OCI archive or an OCI layout directory (sent to a server)."""
        return await self._transport.import_image(path, ref=ref, on_progress=on_progress)

    async def remove_image(self, ref: str, *, force: bool = False) -> str:
        """Remove an image by id or reference; returns its id. Refused (``ImageInUse``) while sandboxes
        or snapshots use it, unless ``force``, which drops only the name. ``gc()`` frees its layers."""
        return await self._transport.remove_image(ref, force=force)

    async def share_image(self, ref: str, shared: bool = True) -> Image:
        """Publish an image to every tenant of the server (the host's own tenant only), or with
        ``shared=False`` take it back; other tenants never see an image that is not theirs or shared."""
        return await self._transport.share_image(ref, shared)

    async def login(self, registry: str, username: str, password: str) -> None:
        """Check credentials against ``registry`` (``host[:port]``) and keep them for pulls."""
        await self._transport.login(registry, username, password)

    async def logout(self, registry: str) -> None:
        await self._transport.logout(registry)

    async def create(
        self,
        image: str | Image | SnapshotInfo = "host",
        *,
        cpus: float = 1.0,
        memory_mb: int = 512,
        pids: int = 256,
        disk_mb: int = 1024,
        gpus: str | int | None = None,
        gpu_exclusive: bool = False,
        env: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        deadline: float | None = None,
        detached: bool = False,
        persistence: Persistence | str = Persistence.EPHEMERAL,
        priority: int = 0,
        idle_timeout: float | None = None,
        queue_timeout: float | None = None,
        user: str | None = None,
        seccomp: str = "default",
        network: Any = "none",
        nested: bool = False,
    ) -> AsyncSandbox:
        """Start a sandbox from an image, image id or base name, or a snapshot (or its id or name).

        The parameters are ``CreateParams``'s, each documented there; ``cpus``, ``memory_mb``, ``pids``,
        ``disk_mb``, ``gpus`` and ``gpu_exclusive`` make its ``Limits``. Every sandbox but a persistent one gets the host's default
        deadline (an hour unless configured); in a burst the create queues up to ``queue_timeout``
        seconds (default 300) before a retryable CapacityExceeded.
        """
        params = CreateParams(
            image=image if isinstance(image, str) else image.id,
            limits=Limits(cpus=cpus, memory_mb=memory_mb, pids=pids, disk_mb=disk_mb, gpus=gpus,
                             gpu_exclusive=gpu_exclusive), env=env or {},
            labels=labels or {}, deadline=deadline, detached=detached, persistence=persistence, priority=priority,
            idle_timeout=idle_timeout, queue_timeout=queue_timeout, user=user, seccomp=seccomp, network=network,
            nested=nested,
        )
        return AsyncSandbox(self, await self._transport.create(params))

    async def pool(
        self, image: str | Image | SnapshotInfo = "host", size: int | None = None, *, cpus: float = 1.0,
        memory_mb: int = 512, pids: int = 256, disk_mb: int = 1024, gpus: str | int | None = None,
        gpu_exclusive: bool = False, wait: float | None = None,
    ) -> PoolInfo:
        """Keep ``size`` sandboxes of ``image`` warm for creates with these limits (``None``: as many
        as recent demand asks, ``0``: none). With ``wait`` seconds, return once it is full."""
        limits = Limits(cpus=cpus, memory_mb=memory_mb, pids=pids, disk_mb=disk_mb, gpus=gpus,
                             gpu_exclusive=gpu_exclusive)
        source = image.id if isinstance(image, SnapshotInfo) else image
        return await self._transport.set_pool(source, size, limits=limits, wait=wait)

    async def pools(self) -> list[PoolInfo]:
        """Every warm pool on the host (on a server: the tenant's own)."""
        return await self._transport.pools_info()

    async def metrics(self) -> dict[str, Any]:
        """The host at a glance: sandboxes by state with their CPU and memory, the create queue,
        pools, create and exec latency percentiles, error and timeout rates, and alerts."""
        return await self._transport.stats()

    def map(
        self, rollout_fn: RolloutFn, items: Iterable[Any], *, concurrency: int = 16, retries: int = 2,
        deadline: float | None = None, backoff: float = 0.5, progress: bool | None = None,
    ) -> AsyncRollouts:
        """Run ``rollout_fn(item)`` for every item, ``concurrency`` at a time; ``async for`` the
        ``RolloutResult``s as they finish.

        A ``Retryable`` error (the fleet's, not the rollout's) is retried up to ``retries``
        times with backoff, and reported as ``infra_error``, never as the rollout's failure.
        Each attempt gets ``deadline`` seconds. ``progress`` draws a bar on stderr (default:
        when stderr is a terminal). Leaving the loop early cancels what still runs.
        """
        total = len(items) if hasattr(items, "__len__") else None
        return AsyncRollouts(rollout_fn, items=items, total=total, concurrency=concurrency, retries=retries,
                             deadline=deadline, backoff=backoff, progress=progress)

    def queue(
        self, rollout_fn: RolloutFn, *, concurrency: int = 16, retries: int = 2, deadline: float | None = None,
        backoff: float = 0.5, progress: bool | None = None, max_pending: int | None = None,
    ) -> AsyncRollouts:
        """Like ``map`` for continuous training: ``await q.put(item)`` over time (waiting while
        ``max_pending`` are queued), ``async for`` results as they finish, ``await q.close()``
        when no more will come."""
        return AsyncRollouts(rollout_fn, concurrency=concurrency, retries=retries, deadline=deadline,
                             backoff=backoff, progress=progress, max_pending=max_pending)

    async def recordings(self) -> list[dict[str, Any]]:
        """Network recordings (``network={"record": NAME, ...}``): name, exchanges, bytes, created."""
        return await self._transport.recordings()

    async def delete_recording(self, name: str) -> None:
        """Delete a recording that no sandbox records into or replays from now."""
        await self._transport.delete_recording(name)

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on an existing sandbox."""
        return AsyncSandbox(self, await self._transport.get(sandbox_id))

    async def list(self, *, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        """Every sandbox on the host, optionally only those carrying ``labels``."""
        return await self._transport.list(labels)

    async def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot (of this tenant, on a server); ``parent`` links them into trees rooted at images."""
        return await self._transport.snapshots()

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return await self._transport.get_snapshot(snapshot_id)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot; SnapshotInUse while sandboxes or later snapshots are made from it."""
        await self._transport.delete_snapshot(snapshot_id)

    async def gc(self) -> list[str]:
        """Delete the snapshots that are unnamed and that nothing needs, and (for the host's own
        callers) layers no image, snapshot or sandbox uses; returns what went."""
        return await self._transport.gc()

    # -- groups ---------------------------------------------------------------------------------

    async def create_group(
        self, members: Sequence[GroupMember] | GroupParams | None = None, *, source: str | GroupSnapshotInfo | None = None,
        network: Any = "none", labels: dict[str, str] | None = None, deadline: float | None = None,
        detached: bool = False,
    ) -> AsyncGroup:
        """Start sandboxes on a private network of their own: each reaches the others by member name,
        nothing else reaches them, and ``network`` (as ``create``'s) is every member's way out.

        ``members`` start in the order their ``after`` asks (each wave at once), each healthy before
        the next wave when it has a ``health`` check; ``source`` (a group snapshot) starts a copy of a
        snapshotted group instead. The group is running when this returns; ``kill`` ends it whole.
        """
        params = group_params(members, source, network, labels, deadline, detached)
        return await self._group_of(await self._transport.create_group(params))

    async def group(self, group_id: str) -> AsyncGroup:
        """A handle on an existing group."""
        return await self._group_of(await self._transport.get_group(group_id))

    async def _group_of(self, info: GroupInfo) -> AsyncGroup:
        """The handle on a group the host reported, with each member's own record."""
        infos = await asyncio.gather(*(self._transport.get(sandbox_id) for sandbox_id in info.members.values()))
        return AsyncGroup(self, info, {name: AsyncSandbox(self, got) for name, got in zip(info.members, infos)})

    async def groups(self) -> list[GroupInfo]:
        """Every group on the host (of this tenant, on a server)."""
        return await self._transport.list_groups()

    async def group_snapshots(self) -> list[GroupSnapshotInfo]:
        return await self._transport.group_snapshots()

    async def delete_group_snapshot(self, snapshot_id: str) -> None:
        """Forget a group snapshot (its members' snapshots go with ``gc`` once nothing needs them)."""
        await self._transport.delete_group_snapshot(snapshot_id)

    # -- Compose --------------------------------------------------------------------------------

    async def compose_up(
        self, path: str | Path, *, env: dict[str, str] | None = None, network: Any = "none",
        labels: dict[str, str] | None = None, deadline: float | None = None, detached: bool = False,
        on_progress: OnProgress | None = None,
    ) -> AsyncGroup:
        """Bring the Compose file at ``path`` up as a group (docs/compose.md): each service's image built
        (cached by layers), the services started in ``depends_on`` order, each reaching the others by its
        service name. ``env`` gives ``${VAR}`` its values (default: this process's environment over the
        file's ``.env``); ``on_progress(service, what)`` hears each step. A key fanfold cannot honour
        is an InvalidSpec naming it."""
        from ..compose.up import up

        return await up(self, path, env=env, network=network, labels=labels, deadline=deadline, detached=detached,
                        on_progress=on_progress)

    async def compose_down(self, path: str | Path | None = None, *, project: str | None = None) -> list[str]:
        """Kill the groups brought up from the Compose file at ``path`` (or of the project named
        ``project``); returns their ids."""
        from ..compose.up import in_project, project_name

        name = project_name(path, project)
        killed = [info.id for info in await self.groups() if in_project(info, name)]
        for group_id in killed:
            await self._transport.kill_group(group_id)
        return killed


def ray_address(url: str) -> str | None:
    """Ray's address for a ``ray://`` fleet URL: ``ray://auto`` is ``auto``, a bare ``ray://`` this
    process's Ray connection (or ``auto``), ``ray://host:port`` Ray Client's."""
    rest = url.removeprefix("ray://")
    if rest in ("", "auto"):
        return rest or None
    return url


class AsyncSandbox:
    """One sandbox. ``async with`` kills it on exit, whatever happened inside."""

    def __init__(self, fleet: AsyncFleet, info: SandboxInfo) -> None:
        self._fleet = fleet
        self._transport = fleet._transport
        self.info = info
        self.files = AsyncFiles(self)

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.info.state}>"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()

    async def exec(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        on_output: OnOutput | None = None,
        user: str | None = None,
    ) -> ExecResult:
        """Run a shell string or argv list; ``on_output(stream, data)`` sees output as it comes.
        ``user`` runs it as that user (default: the sandbox's, see ``create``)."""
        return await self._transport.exec(
            self.id, cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output, on_output=on_output,
            user=user,
        )

    async def exec_stream(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        user: str | None = None,
    ) -> AsyncIterator[OutputChunk | ExecResult]:
        """Yield output chunks as the command runs, then its ExecResult last."""
        # Unbounded is safe: the agent caps each stream at max_output.
        queue: asyncio.Queue[OutputChunk | None] = asyncio.Queue()

        async def push(stream: str, data: bytes) -> None:
            queue.put_nowait(OutputChunk(stream=stream, data=data))

        task = asyncio.create_task(
            self.exec(cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output, on_output=push,
                      user=user)
        )
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (item := await queue.get()) is not None:
                yield item
            yield await task
        finally:
            task.cancel()

    async def spawn(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        user: str | None = None,
        pty: Pty | None = None,
    ) -> AsyncProcess:
        """Start a command to talk to while it runs: live stdin, signals, and with ``pty=Pty(rows, cols)``
        a terminal (resizable); returns once it has started. ``max_output`` caps its output in all."""
        if "control" not in inspect.signature(self._transport.exec).parameters:
            raise InvalidRequest("spawn needs an embedded fleet or a fanfold server (not a multi-worker or Ray one)")
        return await spawn(functools.partial(self._transport.exec, self.id), cmd, pty=pty, env=env, cwd=cwd,
                           timeout=timeout, max_output=max_output, user=user)

    async def run_tool(self, name: str, arguments: str | dict[str, Any], *, timeout: float = 60.0,
                       max_output: int = 16384) -> str:
        """Run one of the generic agent tools (``shell``, ``read_file``, ``write_file``, ``search``: see
        ``fanfold.tools.TOOLS``) with ``arguments`` (a dict, or its JSON) and return its output for a model.

        A misuse that is the model's (an unknown tool, bad arguments, a missing file) raises ToolError,
        whose message is for the model; ``timeout`` is the shell's when the model gives none, and
        ``max_output`` caps the text. Failures of the sandbox or the host raise as they are."""
        return await run_tool(self._transport, self.id, name, arguments, timeout=timeout, max_output=max_output)

    async def kill(self) -> None:
        """Destroy the sandbox; killing one already gone is not an error."""
        try:
            await self._transport.kill(self.id)
        except SandboxNotFound:
            pass

    async def refresh(self) -> SandboxInfo:
        """Reload and return what the engine knows of this sandbox."""
        self.info = await self._transport.get(self.id)
        return self.info

    async def snapshot(self, *, memory: bool = False, name: str | None = None) -> SnapshotInfo:
        """Snapshot the disk, and with ``memory`` the processes too; the sandbox runs on.

        Pass the result (or its ``name``) to ``fleet.create`` to start sandboxes from it.
        """
        return await self._transport.snapshot(self.id, memory=memory, name=name)

    async def fork(self, count: int, *, cmd: str | list[str] | None = None, deadline: float | None = None) -> AsyncFork:
        """``count`` running copies of this sandbox, processes and memory included.

        The parent is frozen only while it is checkpointed (``result.parent_pause_ms``).
        ``cmd`` runs in each child once it is restored, e.g. to reseed random state.
        The children end at the parent's deadline, or ``deadline`` seconds from now when given.
        """
        result = await self._transport.fork(self.id, count, cmd=cmd, deadline=deadline)
        return AsyncFork(children=[AsyncSandbox(self._fleet, info) for info in result.children], result=result)

    async def pause(self) -> SandboxInfo:
        """Freeze its processes; memory stays resident. Any later call wakes it."""
        return await self._life(self._transport.pause)

    async def unpause(self) -> SandboxInfo:
        return await self._life(self._transport.unpause)

    async def suspend(self) -> SandboxInfo:
        """Checkpoint its processes to disk and stop them, freeing memory. Any later call resumes it."""
        return await self._life(self._transport.suspend)

    async def resume(self) -> SandboxInfo:
        return await self._life(self._transport.resume)

    async def reset(self) -> SandboxInfo:
        """Return it to the image or snapshot it was made from: same id, fresh disk and processes."""
        return await self._life(self._transport.reset)

    async def set_network(self, network: Any, *, cut: bool = False) -> SandboxInfo:
        """A new network policy, in force at once for new connections and later execs (``cut``: open
        connections end too); ``"none"`` closes the way out."""
        self.info = await self._transport.set_network(self.id, network, cut=cut)
        return self.info

    async def network_stats(self) -> dict[str, Any]:
        """Its traffic through the proxy: connections, requests, bytes up and down, denials and why."""
        return await self._transport.network_stats(self.id)

    async def expose(self, port: int) -> str:
        """A URL that reaches ``port`` inside: ``http://127.0.0.1:N`` (any TCP) on an embedded fleet,
        the server's ``/v1/sandboxes/ID/ports/PORT/`` route (HTTP, with the token) on a remote one."""
        return await self._transport.expose(self.id, port)

    async def enable_ssh(self, authorized_keys: list[str] | tuple[str, ...], *, port: int = 22) -> SshAccess:
        """Start sshd inside (or keep the one running) authorizing exactly these OpenSSH public keys
        (and, on a server, the tenant's registered ones); returns its host key and, on an embedded
        fleet or a server's unix socket, ``address``: ``127.0.0.1:N`` for ``ssh -p N``. See docs/ssh.md."""
        return await self._transport.enable_ssh(self.id, authorized_keys, port=port)

    async def _life(self, verb: Callable[[str], Awaitable[SandboxInfo]]) -> SandboxInfo:
        self.info = await verb(self.id)
        return self.info


@dataclass(frozen=True)
class AsyncFork:
    """What ``AsyncSandbox.fork`` made. ``async with`` kills the children on exit."""

    children: list[AsyncSandbox]
    result: ForkResult

    async def __aenter__(self) -> AsyncFork:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()

    async def kill(self) -> None:
        """Destroy every child; the parent runs on."""
        await asyncio.gather(*(child.kill() for child in self.children))


class AsyncFiles:
    """Files inside one sandbox; relative paths start at the image's workdir."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox
        self._transport = sandbox._transport

    async def read(self, path: str) -> bytes:
        return await self._transport.read_file(self._sandbox.id, path)

    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Write a file, creating parent directories."""
        await self._transport.write_file(self._sandbox.id, path, data, mode)

    async def upload(self, local_path: str | Path, path: str) -> int:
        """Copy a host file in; returns bytes copied."""
        return await self._transport.upload(self._sandbox.id, local_path, path)

    async def download(self, path: str, local_path: str | Path) -> int:
        """Copy a file out to the host; returns bytes copied."""
        return await self._transport.download(self._sandbox.id, path, local_path)

    async def list(self, path: str = ".") -> list[FileEntry]:
        return await self._transport.list_files(self._sandbox.id, path)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._transport.remove_file(self._sandbox.id, path, recursive)
