"""The sync SDK: the async classes' twins, differing only by ``await``.

Each call runs on the fleet's private event loop thread (see ``_portal``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Iterable, Iterator, Sequence, TypeVar

from ..config import EngineConfig
from ..groups import GroupInfo, GroupMember, GroupParams, GroupSnapshotInfo
from ..images import Image
from ..images.builder import Network, OnStep
from ..models import ExecResult, FileEntry, ForkResult, OutputChunk, Persistence, PoolInfo, Pty, SandboxInfo, SnapshotInfo
from ..spec import EnvSpec
from ..ssh import SshAccess
from ._async import AsyncFiles, AsyncFleet, AsyncFork, AsyncSandbox
from ._fanout import AsyncRollouts, RolloutFn, RolloutResult, RolloutStats
from ._group import AsyncGroup
from ._portal import Portal
from ._process import AsyncProcess

if TYPE_CHECKING:
    from ..compose.up import OnProgress
    from ..images.oci import OnPull

OnOutputSync = Callable[[str, bytes], None]
T = TypeVar("T")


class Fleet:
    """A handle on one host's sandboxes: ``Fleet()`` embeds the engine in-process,
    ``Fleet(url, token=...)`` (or ``FANFOLD_URL``/``FANFOLD_TOKEN``) uses a server.

    Use it as ``with Fleet() as fleet:``; closing destroys the sandboxes it created
    (except ``detached`` ones). One left open closes when the program's main thread ends.
    """

    def __init__(self, url: str | None = None, *, token: str | None = None, config: EngineConfig | None = None) -> None:
        self._async = AsyncFleet(url, token=token, config=config)
        self.config = self._async.config
        self.url = self._async.url
        self._portal: Portal | None = None

    @classmethod
    def ray(cls, address: str | None = "auto", *, token: str | None = None) -> Fleet:
        """A fleet over every fanfold node of a Ray cluster; see ``AsyncFleet.ray``."""
        fleet = cls("ray://", token=token)
        fleet._async = AsyncFleet.ray(address, token=token)
        return fleet

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro):  # type: ignore[no-untyped-def]
        try:
            portal = self._started()
        except BaseException:
            coro.close()  # never run: no "never awaited" warning on top of the error
            raise
        return portal.call(coro)

    def _iterate(self, agen):  # type: ignore[no-untyped-def]
        return self._started().iterate(agen)

    def _started(self) -> Portal:
        if self._portal is None:
            self.start()
        assert self._portal is not None
        return self._portal

    def start(self) -> None:
        """Start the embedded engine (reaping what crashed owners left), or check the server and token."""
        if self._portal is not None:
            return
        self._portal = Portal(on_exit=self.close)  # an open fleet closes as the interpreter exits
        try:
            self._portal.call(self._async.start())
        except BaseException:
            self._portal.stop()
            self._portal = None
            raise

    def close(self) -> None:
        """Destroy this fleet's sandboxes (not detached ones) and stop its engine or connection."""
        if self._portal is None:
            return
        portal, self._portal = self._portal, None
        try:
            portal.call(self._async.close())
        finally:
            portal.stop()

    @property
    def started(self) -> bool:
        """Whether ``start`` ran (or a call started the fleet) and ``close`` did not since."""
        return self._portal is not None

    @property
    def aio(self) -> AsyncFleet:
        """The AsyncFleet this fleet drives, for async code that shares its sandboxes (an async env, say);
        run that code with ``call``."""
        return self._async

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` (async code on ``aio``) on this fleet's event loop and return its result, starting
        the fleet first if need be; Ctrl-C cancels it. ``AsyncFleet.call`` awaits it."""
        return self._call(coro)

    def build(self, spec: EnvSpec, *, on_step: OnStep | None = None, network: Network = "isolated",
              tag: str | None = None) -> Image:
        """Build ``spec`` into an image; cached layers make a rebuild almost free. Its ``run`` steps
        reach the outside through NAT but nothing of the host; ``network="host"`` (the host's own
        tenant only, on a server) gives them the host's network. ``tag`` names it (``myenv:v2``):
        creates and builds may then use that name, as ``docker build -t`` does."""
        return self._call(self._async.build(spec, on_step=on_step, network=network, tag=tag))

    def images(self) -> list[Image]:
        """Every image on the host: ``source`` says where each came from, ``names`` what names it."""
        return self._call(self._async.images())

    def pull(self, ref: str, *, platform: str | None = None, on_progress: OnPull | None = None) -> Image:
        """Pull an image from its registry; layers already on the host are not fetched again."""
        return self._call(self._async.pull(ref, platform=platform, on_progress=on_progress))

    def import_image(self, path: str | Path, *, ref: str | None = None, on_progress: OnPull | None = None) -> Image:
        """Import a ``docker save`` tarball, an OCI archive or an OCI layout directory."""
        return self._call(self._async.import_image(path, ref=ref, on_progress=on_progress))

    def remove_image(self, ref: str, *, force: bool = False) -> str:
        """Remove an image by id or reference (``ImageInUse`` while sandboxes or snapshots use it)."""
        return self._call(self._async.remove_image(ref, force=force))

    def share_image(self, ref: str, shared: bool = True) -> Image:
        """Publish an image to every tenant of the server (the host's own tenant only), or take it back."""
        return self._call(self._async.share_image(ref, shared))

    def login(self, registry: str, username: str, password: str) -> None:
        """Check credentials against ``registry`` and keep them for pulls."""
        self._call(self._async.login(registry, username, password))

    def logout(self, registry: str) -> None:
        self._call(self._async.logout(registry))

    def create(
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
    ) -> Sandbox:
        """Start a sandbox from an image, image id or base name, or a snapshot (or its id or name).

        The parameters are ``CreateParams``'s, each documented there; ``cpus``, ``memory_mb``, ``pids``,
        ``disk_mb``, ``gpus`` and ``gpu_exclusive`` make its ``Limits``. Every sandbox but a persistent one gets the host's default
        deadline (an hour unless configured); in a burst the create queues up to ``queue_timeout``
        seconds (default 300) before a retryable CapacityExceeded.
        """
        inner = self._call(self._async.create(
            image, cpus=cpus, memory_mb=memory_mb, pids=pids, disk_mb=disk_mb, gpus=gpus, gpu_exclusive=gpu_exclusive,
            env=env, labels=labels,
            deadline=deadline, detached=detached, persistence=persistence, priority=priority,
            idle_timeout=idle_timeout, queue_timeout=queue_timeout, user=user, seccomp=seccomp, network=network,
            nested=nested,
        ))
        return Sandbox(self, inner)

    def pool(
        self, image: str | Image | SnapshotInfo = "host", size: int | None = None, *, cpus: float = 1.0,
        memory_mb: int = 512, pids: int = 256, disk_mb: int = 1024, gpus: str | int | None = None,
        gpu_exclusive: bool = False, wait: float | None = None,
    ) -> PoolInfo:
        """Keep ``size`` sandboxes of ``image`` warm for creates with these limits (``None``: as many
        as recent demand asks, ``0``: none). With ``wait`` seconds, return once it is full."""
        return self._call(self._async.pool(
            image, size, cpus=cpus, memory_mb=memory_mb, pids=pids, disk_mb=disk_mb, gpus=gpus,
            gpu_exclusive=gpu_exclusive, wait=wait,
        ))

    def pools(self) -> list[PoolInfo]:
        """Every warm pool on the host (on a server: the tenant's own)."""
        return self._call(self._async.pools())

    def metrics(self) -> dict[str, Any]:
        """The host at a glance: sandboxes by state with their CPU and memory, the create queue,
        pools, create and exec latency percentiles, error and timeout rates, and alerts."""
        return self._call(self._async.metrics())

    def map(
        self, rollout_fn: RolloutFn, items: Iterable[Any], *, concurrency: int = 16, retries: int = 2,
        deadline: float | None = None, backoff: float = 0.5, progress: bool | None = None,
    ) -> Rollouts:
        """Run ``rollout_fn(item)`` for every item, ``concurrency`` at a time; iterate the
        ``RolloutResult``s as they finish.

        A ``Retryable`` error (the fleet's, not the rollout's) is retried up to ``retries``
        times with backoff, and reported as ``infra_error``, never as the rollout's failure.
        Each attempt gets ``deadline`` seconds. ``progress`` draws a bar on stderr (default:
        when stderr is a terminal). Leaving the loop early cancels what still runs.
        """
        return Rollouts(self, self._async.map(rollout_fn, items, concurrency=concurrency, retries=retries,
                                              deadline=deadline, backoff=backoff, progress=progress))

    def queue(
        self, rollout_fn: RolloutFn, *, concurrency: int = 16, retries: int = 2, deadline: float | None = None,
        backoff: float = 0.5, progress: bool | None = None, max_pending: int | None = None,
    ) -> Rollouts:
        """Like ``map`` for continuous training: ``q.put(item)`` over time (waiting while
        ``max_pending`` are queued), iterate results as they finish, ``q.close()`` when no
        more will come."""
        return Rollouts(self, self._async.queue(rollout_fn, concurrency=concurrency, retries=retries,
                                                deadline=deadline, backoff=backoff, progress=progress,
                                                max_pending=max_pending))

    def recordings(self) -> list[dict[str, Any]]:
        """Network recordings (``network={"record": NAME, ...}``): name, exchanges, bytes, created."""
        return self._call(self._async.recordings())

    def delete_recording(self, name: str) -> None:
        """Delete a recording that no sandbox records into or replays from now."""
        self._call(self._async.delete_recording(name))

    def get(self, sandbox_id: str) -> Sandbox:
        """A handle on an existing sandbox."""
        return Sandbox(self, self._call(self._async.get(sandbox_id)))

    def list(self, *, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        """Every sandbox on the host, optionally only those carrying ``labels``."""
        return self._call(self._async.list(labels=labels))

    def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot (of this tenant, on a server); ``parent`` links them into trees rooted at images."""
        return self._call(self._async.snapshots())

    def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return self._call(self._async.get_snapshot(snapshot_id))

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot; SnapshotInUse while sandboxes or later snapshots are made from it."""
        self._call(self._async.delete_snapshot(snapshot_id))

    def gc(self) -> list[str]:
        """Delete unnamed snapshots nothing needs and layers nothing uses; returns what went."""
        return self._call(self._async.gc())

    def create_group(
        self, members: Sequence[GroupMember] | GroupParams | None = None, *, source: str | GroupSnapshotInfo | None = None,
        network: Any = "none", labels: dict[str, str] | None = None, deadline: float | None = None,
        detached: bool = False,
    ) -> Group:
        """Start sandboxes on a private network of their own, reaching each other by member name
        (``AsyncFleet.create_group``)."""
        inner = self._call(self._async.create_group(members, source=source, network=network, labels=labels,
                                                    deadline=deadline, detached=detached))
        return Group(self, inner)

    def group(self, group_id: str) -> Group:
        """A handle on an existing group."""
        return Group(self, self._call(self._async.group(group_id)))

    def groups(self) -> list[GroupInfo]:
        """Every group on the host (of this tenant, on a server)."""
        return self._call(self._async.groups())

    def group_snapshots(self) -> list[GroupSnapshotInfo]:
        return self._call(self._async.group_snapshots())

    def delete_group_snapshot(self, snapshot_id: str) -> None:
        """Forget a group snapshot (its members' snapshots go with ``gc`` once nothing needs them)."""
        self._call(self._async.delete_group_snapshot(snapshot_id))

    def compose_up(
        self, path: str | Path, *, env: dict[str, str] | None = None, network: Any = "none",
        labels: dict[str, str] | None = None, deadline: float | None = None, detached: bool = False,
        on_progress: OnProgress | None = None,
    ) -> Group:
        """Bring the Compose file at ``path`` up as a group (``AsyncFleet.compose_up``); ``with`` kills it."""
        return Group(self, self._call(self._async.compose_up(path, env=env, network=network, labels=labels,
                                                             deadline=deadline, detached=detached,
                                                             on_progress=on_progress)))

    def compose_down(self, path: str | Path | None = None, *, project: str | None = None) -> list[str]:
        """Kill the groups brought up from the Compose file at ``path`` (or of project ``project``); their ids."""
        return self._call(self._async.compose_down(path, project=project))


class Rollouts:
    """What ``Fleet.map`` and ``Fleet.queue`` return: iterate it for ``RolloutResult``s as they finish."""

    def __init__(self, fleet: Fleet, inner: AsyncRollouts) -> None:
        self._fleet = fleet
        self._async = inner

    @property
    def stats(self) -> RolloutStats:
        return self._async.stats

    def __enter__(self) -> Rollouts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def __iter__(self) -> Iterator[RolloutResult]:
        return self._fleet._iterate(self._async.__aiter__())

    def put(self, item: Any) -> int:
        """Queue one item; returns its index (results carry it)."""
        return self._fleet._call(self._async.put(item))

    def close(self) -> None:
        """No more items: iteration ends once those already put are done."""
        self._fleet._call(self._async.close())

    def cancel(self) -> None:
        """Stop now: running rollouts are cancelled."""
        self._fleet._call(self._async.cancel())


class Sandbox:
    """One sandbox. ``with`` kills it on exit, whatever happened inside."""

    def __init__(self, fleet: Fleet, inner: AsyncSandbox) -> None:
        self._fleet = fleet
        self._async = inner
        self.files = Files(fleet, inner.files)

    @property
    def id(self) -> str:
        return self._async.id

    @property
    def info(self) -> SandboxInfo:
        return self._async.info

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.state}>"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def exec(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        on_output: OnOutputSync | None = None,
        user: str | None = None,
    ) -> ExecResult:
        """Run a shell string or argv list; ``on_output(stream, data)`` sees output as it comes.
        ``user`` runs it as that user (default: the sandbox's, see ``create``)."""
        return self._fleet._call(self._async.exec(
            cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output, on_output=on_output,
            user=user,
        ))

    def exec_stream(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        user: str | None = None,
    ) -> Iterator[OutputChunk | ExecResult]:
        """Yield output chunks as the command runs, then its ExecResult last."""
        stream = self._async.exec_stream(cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output,
                                         user=user)
        return self._fleet._iterate(stream)

    def spawn(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        user: str | None = None,
        pty: Pty | None = None,
    ) -> Process:
        """Start a command to talk to while it runs; see ``AsyncSandbox.spawn``."""
        return Process(self._fleet, self._fleet._call(self._async.spawn(
            cmd, cwd=cwd, env=env, timeout=timeout, max_output=max_output, user=user, pty=pty,
        )))

    def run_tool(self, name: str, arguments: str | dict[str, Any], *, timeout: float = 60.0,
                 max_output: int = 16384) -> str:
        """Run one of the generic agent tools with ``arguments`` and return its output for a model; see
        ``AsyncSandbox.run_tool``."""
        return self._fleet._call(self._async.run_tool(name, arguments, timeout=timeout, max_output=max_output))

    def kill(self) -> None:
        """Destroy the sandbox; killing one already gone is not an error."""
        self._fleet._call(self._async.kill())

    def refresh(self) -> SandboxInfo:
        """Reload and return what the engine knows of this sandbox."""
        return self._fleet._call(self._async.refresh())

    def snapshot(self, *, memory: bool = False, name: str | None = None) -> SnapshotInfo:
        """Snapshot the disk, and with ``memory`` the processes too; the sandbox runs on.

        Pass the result (or its ``name``) to ``fleet.create`` to start sandboxes from it.
        """
        return self._fleet._call(self._async.snapshot(memory=memory, name=name))

    def fork(self, count: int, *, cmd: str | list[str] | None = None, deadline: float | None = None) -> Fork:
        """``count`` running copies of this sandbox, processes and memory included.

        The parent is frozen only while it is checkpointed (``result.parent_pause_ms``).
        ``cmd`` runs in each child once it is restored, e.g. to reseed random state.
        The children end at the parent's deadline, or ``deadline`` seconds from now when given.
        """
        inner: AsyncFork = self._fleet._call(self._async.fork(count, cmd=cmd, deadline=deadline))
        children = [Sandbox(self._fleet, child) for child in inner.children]
        return Fork(children=children, result=inner.result, _fleet=self._fleet, _async=inner)

    def pause(self) -> SandboxInfo:
        """Freeze its processes; memory stays resident. Any later call wakes it."""
        return self._fleet._call(self._async.pause())

    def unpause(self) -> SandboxInfo:
        return self._fleet._call(self._async.unpause())

    def suspend(self) -> SandboxInfo:
        """Checkpoint its processes to disk and stop them, freeing memory. Any later call resumes it."""
        return self._fleet._call(self._async.suspend())

    def resume(self) -> SandboxInfo:
        return self._fleet._call(self._async.resume())

    def reset(self) -> SandboxInfo:
        """Return it to the image or snapshot it was made from: same id, fresh disk and processes."""
        return self._fleet._call(self._async.reset())

    def set_network(self, network: Any, *, cut: bool = False) -> SandboxInfo:
        """A new network policy, in force at once for new connections and later execs (``cut``: open
        connections end too); ``"none"`` closes the way out."""
        return self._fleet._call(self._async.set_network(network, cut=cut))

    def network_stats(self) -> dict[str, Any]:
        """Its traffic through the proxy: connections, requests, bytes up and down, denials and why."""
        return self._fleet._call(self._async.network_stats())

    def expose(self, port: int) -> str:
        """A URL that reaches ``port`` inside: ``http://127.0.0.1:N`` (any TCP) on an embedded fleet,
        the server's ``/v1/sandboxes/ID/ports/PORT/`` route (HTTP, with the token) on a remote one."""
        return self._fleet._call(self._async.expose(port))

    def enable_ssh(self, authorized_keys: list[str] | tuple[str, ...], *, port: int = 22) -> SshAccess:
        """Start sshd inside (or keep the one running) authorizing exactly these OpenSSH public keys
        (and, on a server, the tenant's registered ones); returns its host key and, on an embedded
        fleet or a server's unix socket, ``address``: ``127.0.0.1:N`` for ``ssh -p N``. See docs/ssh.md."""
        return self._fleet._call(self._async.enable_ssh(authorized_keys, port=port))


@dataclass(frozen=True)
class Fork:
    """What ``Sandbox.fork`` made. ``with`` kills the children on exit."""

    children: list[Sandbox]
    result: ForkResult
    _fleet: Fleet = field(repr=False, compare=False)
    _async: AsyncFork = field(repr=False, compare=False)

    def __enter__(self) -> Fork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def kill(self) -> None:
        """Destroy every child; the parent runs on."""
        self._fleet._call(self._async.kill())


class Process:
    """A command started by ``Sandbox.spawn``; see ``AsyncProcess``."""

    def __init__(self, fleet: Fleet, inner: AsyncProcess) -> None:
        self._fleet = fleet
        self._async = inner
        self.pty = inner.pty

    @property
    def pid(self) -> int | None:
        """The command's pid inside the sandbox, once started."""
        return self._async.pid

    def write(self, data: bytes | str) -> None:
        """Send ``data`` to the command's stdin (a terminal's input, keys included)."""
        self._fleet._call(self._async.write(data))

    def close_stdin(self) -> None:
        """End the command's stdin."""
        self._fleet._call(self._async.close_stdin())

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the command's process group."""
        self._fleet._call(self._async.signal(signum))

    def resize(self, rows: int, cols: int) -> None:
        """Give the command's terminal a new size (it gets SIGWINCH)."""
        self._fleet._call(self._async.resize(rows, cols))

    def kill(self) -> None:
        """SIGKILL the command's process group."""
        self._fleet._call(self._async.kill())

    def output(self) -> Iterator[OutputChunk]:
        """The output as it comes, until the command has ended and all of it was read."""
        return self._fleet._iterate(self._async.output())

    def wait(self) -> ExecResult:
        """The command's result once it has ended."""
        return self._fleet._call(self._async.wait())


class Files:
    """Files inside one sandbox; relative paths start at the image's workdir."""

    def __init__(self, fleet: Fleet, inner: AsyncFiles) -> None:
        self._fleet = fleet
        self._async = inner

    def read(self, path: str) -> bytes:
        return self._fleet._call(self._async.read(path))

    def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Write a file, creating parent directories."""
        self._fleet._call(self._async.write(path, data, mode=mode))

    def upload(self, local_path: str | Path, path: str) -> int:
        """Copy a host file in; returns bytes copied."""
        return self._fleet._call(self._async.upload(local_path, path))

    def download(self, path: str, local_path: str | Path) -> int:
        """Copy a file out to the host; returns bytes copied."""
        return self._fleet._call(self._async.download(path, local_path))

    def list(self, path: str = ".") -> list[FileEntry]:
        return self._fleet._call(self._async.list(path))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._fleet._call(self._async.remove(path, recursive=recursive))


class Group:
    """The sync twin of ``AsyncGroup``. ``with`` kills the whole group on exit."""

    def __init__(self, fleet: Fleet, inner: AsyncGroup) -> None:
        self._fleet = fleet
        self._async = inner
        self.members: dict[str, Sandbox] = {name: Sandbox(fleet, box) for name, box in inner.members.items()}
        """Member name -> its sandbox."""

    @property
    def id(self) -> str:
        return self._async.id

    @property
    def info(self) -> GroupInfo:
        return self._async.info

    def __getitem__(self, name: str) -> Sandbox:
        self._async[name]  # the same error for a name it lacks
        return self.members[name]

    def __repr__(self) -> str:
        return f"<Group {self.id} {sorted(self.members)}>"

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def refresh(self) -> GroupInfo:
        """The group as the host knows it now (members gone since drop out)."""
        return self._fleet._call(self._async.refresh())

    def snapshot(self, *, memory: bool = False, name: str | None = None) -> GroupSnapshotInfo:
        """Snapshot every member as one; ``fleet.create_group(source=snap)`` starts a copy of the group."""
        return self._fleet._call(self._async.snapshot(memory=memory, name=name))

    def fork(self, count: int) -> list[Group]:
        """``count`` live copies of the whole group, each on a private network of its own."""
        return [Group(self._fleet, inner) for inner in self._fleet._call(self._async.fork(count))]

    def kill(self) -> None:
        """Destroy every member and the group's network."""
        self._fleet._call(self._async.kill())
