"""The engine: creates, runs and destroys every sandbox on one host, and owns all it makes.

A thin facade over its parts, each in a file of its own: ``lifecycle`` (rows, gates, bring-up,
release), ``sources`` (images and snapshots), ``execs``, ``files``, ``checkpoints`` (snapshot,
fork, pause, suspend, reset), ``leases``, ``pools``, ``policies`` (idle, eviction), ``reaper``
and ``figures``; the isolation itself is the backend's (``fanfold.runtime``). Sandboxes made by
a live engine belong to it and die with it; ``detached`` ones (the CLI's ``create``) live until
removed or their deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterable, AsyncIterator, Awaitable, Callable

from .._agent.client import ExecControl
from ..config import EngineConfig
from ..errors import (
    CapacityExceeded, FanfoldError, HostNotReady, InfrastructureError, InvalidRequest, LeaseNotFound,
    PortUnreachable, SandboxNotFound,
)
from ..images import Image, LayerStore, users
from ..store import trust
from ..groups import GroupInfo, GroupParams, GroupSnapshotInfo
from ..images.builder import Builder, Network, OnStep
from ..models import (
    CreateParams, ExecResult, FileEntry, ForkResult, LeaseInfo, Limits, PoolInfo, SandboxInfo, SnapshotInfo,
)
from ..runtime import SECCOMP_PROFILES as PROFILES, check_seccomp, get_backend
from ..spec import BASES, EnvSpec, check_user
from . import db as dbmod
from .admission import Admission, check_fits_host
from .diskroom import DiskRoom
from .catalog import Catalog, check_tag
from .api import MAX_FORK, MAX_POOL, OnOutput
from .checkpoints import Checkpoints
from .checks import check_deadline, check_labels, check_strings
from .execs import Execs
from .groups import Groups
from .figures import Figures
from .files import Files, FileStream
from .leases import Leases
from .lifecycle import Lifecycle, owner_token
from .network import build_refused, git_gate, pull_gate, to_column
from .policies import Policies
from .pools import Pools
from .quotas import Quotas
from .reaper import Reaper
from .snapshots import PREFIX as SNAPSHOT_PREFIX
from .snapshots import SnapshotStore
from .sources import Sources, check_gpus
from .telemetry import Telemetry
from .transfer import Transfers

if TYPE_CHECKING:
    from ..images.oci import OnPull
    from ..ssh import SshAccess


class Engine:
    """The async core every client drives, in-process or through the server."""

    def __init__(self, config: EngineConfig | None = None, *, owner: str | None = None,
                 shard: tuple[int, int] | None = None) -> None:
        self.config = config or EngineConfig()
        self.claimer = owner_token()
        """This process, in the rows it is creating, destroying or suspending: if it dies, any engine reaps them."""
        self.owner = owner or self.claimer
        """Who owns the sandboxes this engine makes: this process, or the router whose worker it is."""
        self.shard = shard
        """(index, count) when this engine is one of a router's workers (``engine.workers``): it mints
        ids of its own share and reaps, times out and adopts only those."""
        self._db: dbmod.Database | None = None
        self._reaper_task: asyncio.Task[None] | None = None
        self._creating: set[asyncio.Task[object]] = set()
        self._started = False

    # -- life of the engine -------------------------------------------------------------------

    async def start(self) -> None:
        """Check and prepare the host, open the database, and reap what dead owners left."""
        if self._started:
            return
        cfg = self.config
        try:
            (cfg.state_dir / "bundles").mkdir(parents=True, exist_ok=True)
            _private_state(cfg.state_dir)
        except OSError as err:
            raise HostNotReady(f"cannot use the state dir {cfg.state_dir}: {err}; run fanfold as root"
                               " or set FANFOLD_STATE_DIR to a directory of yours") from None
        trust.load(cfg.extra_ca_file, cfg.state_dir)  # HostNotReady now, not at the first create
        self.store = LayerStore(cfg.state_dir)
        self.backend = get_backend(cfg, self.store)
        await self.backend.prepare()
        self._db = db = dbmod.Database(cfg.state_dir / "fanfold.db")
        _private_files(cfg.state_dir)  # the disk and the database exist now
        self.catalog = Catalog(db, self.store, cfg.state_dir, pull=cfg.pull, gate=functools.partial(pull_gate, cfg))
        builder = Builder(self.store, self.backend.step_runtime, mirror=cfg.debian_mirror,
                          scratch_run=cfg.state_dir / "bundles", tag=cfg.tag,
                          resolve_base=self.catalog.resolve, extra_ca_file=cfg.extra_ca_file,
                          confined_refused=build_refused(cfg))
        self.snaps = SnapshotStore(cfg.state_dir, self.store, db)
        self.admission = Admission(cfg, db.count, DiskRoom(cfg, lambda: self.db, lambda: self.backend.quota))
        self.telemetry = Telemetry(lambda tenant: self.figures.gauges(tenant))
        self.sources = Sources(db, self.store, builder, self.snaps, self.catalog.resolve, tier=self.backend.name,
                               clones=functools.partial(git_gate, cfg))
        self.life = life = Lifecycle(cfg, db, self.backend, self.sources, self.snaps, self.admission, self.telemetry,
                                     self.owner, self.shard, self.claimer)
        self.pools = Pools(cfg, self.admission, self.telemetry, life,
                           fits=lambda tenant, limits: self.quotas.fits_warm(tenant, limits), gpu_weight=life.gpus.weight)
        life.forget = self.pools.forget
        self.execs = Execs(life)
        self.files = Files(life)
        self.checkpoints = Checkpoints(life, self.create, self.exec)
        self.groups = Groups(life, self.create, self.exec, self.checkpoints.snapshot, self.checkpoints.fork,
                             self.expose)
        self.leases = Leases(life)
        self.policies = Policies(life, self.pools, self.checkpoints.suspend)
        self.reaper = Reaper(life, self.leases, self.policies, self.pools)
        self.figures = Figures(life, self.pools)
        self.quotas = Quotas(cfg.quotas, lambda: self.db, self.pools.warm, life.gpus)
        self._started = True
        try:
            await self.reaper.reconcile()
            await self.groups.reconcile()
        except BaseException:  # an engine that never started lets go of the host and the database again
            self._started = False
            await self.backend.close(idle=False)
            db.close()
            raise
        self._reaper_task = asyncio.create_task(self.reaper.run())
        await self.life.serve_networks()  # detached sandboxes with a policy get their proxy back at once
        for ref, size in cfg.pools:
            await self.set_pool(ref, size)

    async def close(self) -> None:
        """Destroy the sandboxes this engine owns (not detached ones) and stop."""
        if not self._started:
            return
        self.life.closing = True
        if self._reaper_task is not None:
            self._reaper_task.cancel()
        await self.pools.close()
        # Creates in flight finish (or fail) first, so none outlives the engine.
        await asyncio.gather(*list(self._creating), return_exceptions=True)
        for lease_id in list(self.leases.opened):
            await self.leases.reap(lease_id, expired=False)
        for row in self.db.rows():
            if row["owner"] in (self.owner, self.claimer) and self.life.ours(row):  # the claimer's: warm pools
                await self.life.destroy(row["id"])
        await asyncio.gather(*list(self.life.destroying.values()), return_exceptions=True)
        await self.life.calls_done(timeout=10)
        await self.backend.sweep()
        await self.life.network.close()
        # Host-wide state goes only with the last sandbox: a suspended one's restore needs the parent cgroups.
        await self.backend.close(idle=not self.db.rows())
        self.db.close()
        self._started = False

    @property
    def db(self) -> dbmod.Database:
        if self._db is None:
            raise InfrastructureError("the engine is not started: call start() first")
        return self._db

    async def reconcile(self) -> dict[str, int]:
        """Reap sandboxes whose owner died or whose deadline passed, and resources with no sandbox."""
        return await self.reaper.reconcile()

    # -- images -------------------------------------------------------------------------------

    async def build(self, spec: EnvSpec, on_step: OnStep | None = None, *, network: Network = "isolated",
                    tag: str | None = None, tenant: str = "") -> Image:
        """Build ``spec`` into an image, reusing every layer already built. Its ``run`` steps reach the
        outside through NAT but nothing of the host, unless ``network="host"``; a server ``tenant``'s
        reach no range the egress proxy refuses either (``net_reachable`` aside). ``tag`` names the image
        (``myenv``, ``myenv:v2``) for ``tenant`` (a server's tenant: in its own namespace of names)."""
        if tag is not None:
            check_tag(tag)
        built = self.catalog.own(await self.sources.build(spec, on_step, network=network, tenant=tenant), tenant)
        return built if tag is None else self.catalog.name(tag, built, tenant)

    async def image(self, ref: str | Image, *, tenant: str = "") -> Image:
        """An image from an Image, an image id, a base name (``host``, ``debian:bookworm``) or a
        reference (pulled from its registry the first time); for a server ``tenant``, only among the
        images it may see, and a reference it pulls is pulled as it and named for it alone."""
        if tenant and isinstance(ref, str) and ref not in BASES:
            return await self.catalog.resolve(ref, tenant)
        return await self.sources.image(ref)

    async def images(self, *, tenant: str = "") -> list[Image]:
        """Every image on this host (a server tenant's: its own and shared ones), with the references that name it."""
        return self.catalog.images(tenant)

    async def pull(self, ref: str, *, platform: str | None = None, on_progress: OnPull | None = None,
                   tenant: str = "") -> Image:
        """Pull ``ref`` from its registry (``python:3.12-slim``, ``host:5000/env@sha256:...``)."""
        return await self.catalog.pull(ref, platform=platform, on_progress=on_progress, tenant=tenant)

    async def import_image(self, path: str | Path, *, ref: str | None = None,
                           on_progress: OnPull | None = None, tenant: str = "") -> Image:
        """Import a ``docker save`` tarball, an OCI archive or an OCI layout directory on this host."""
        return await self.catalog.import_file(path, ref=ref, on_progress=on_progress, tenant=tenant)

    async def remove_image(self, ref: str, *, force: bool = False, tenant: str = "") -> str:
        """Remove an image by id or reference; refused while sandboxes or snapshots use it."""
        return await self.catalog.remove(ref, force=force, tenant=tenant)

    async def share_image(self, ref: str, shared: bool = True) -> Image:
        """Publish an image (id or reference) to every tenant of a server, or with ``shared=False`` take it back;
        sandboxes already made from it keep running."""
        return self.catalog.share(ref, shared)

    async def login(self, registry: str, username: str, password: str) -> None:
        """Check credentials against ``registry`` and keep them for later pulls."""
        await self.catalog.oci.login(registry, username, password)

    async def logout(self, registry: str) -> None:
        await self.catalog.oci.logout(registry)

    # -- sandboxes ----------------------------------------------------------------------------

    async def create(self, params: CreateParams, *, tenant: str = "", lease: str | None = None,
                     group: tuple[str, str] | None = None) -> SandboxInfo:
        """Start a sandbox as ``params`` say (see ``CreateParams``); it is running when this returns.

        ``tenant`` names the server token the sandbox belongs to ("" for local callers); a sandbox
        with a ``lease`` dies when the lease expires. Sticky and persistent sandboxes outlive their
        creator. A create from a memory snapshot continues where the snapshot stopped, with its
        cpu, memory and pids limits and the seccomp filters its processes had. ``set_network``
        changes the network policy while the sandbox runs. ``group`` (group id, member name): the
        group it joins (``create_group`` makes members so).
        """
        if not isinstance(params, CreateParams):
            raise InvalidRequest(f"create takes a fanfold.CreateParams, got {params!r}")
        if not self._started or self.life.closing:
            raise InfrastructureError("the engine is not running (closed or not started): start a fleet first")
        task = asyncio.current_task()
        if task is not None:
            self._creating.add(task)
        started = time.perf_counter()
        try:
            info, pooled = await self._create(params, tenant, self.leases.owner_for(lease, tenant), group)
        except (InfrastructureError, CapacityExceeded) as err:
            self.telemetry.create_failed_infra("capacity" if isinstance(err, CapacityExceeded) else "infra_error")
            raise
        finally:
            if task is not None:
                self._creating.discard(task)
        if lease is not None and self.life.db.lease(lease) is None:  # closed or reaped while this create waited
            await asyncio.shield(self.life.destroy(info.id))
            raise LeaseNotFound(f"lease {lease} ended while this create waited; its sandbox was destroyed")
        self.telemetry.created(info.source, time.perf_counter() - started, pooled=pooled)
        return info

    async def _scoped(self, image: str | Image, tenant: str) -> str | Image:
        """What a server tenant's create or pool names, as an image id when it is an image: its own or a
        shared one (another tenant's is ImageNotFound). Bases and snapshots pass as they are."""
        if not tenant or not isinstance(image, str) or image in BASES or self.sources.resolve_snapshot(image, tenant):
            return image
        return image if image.startswith(SNAPSHOT_PREFIX) else (await self.catalog.resolve(image, tenant)).id

    async def _create(self, params: CreateParams, tenant: str, owner: str,
                      group: tuple[str, str] | None = None) -> tuple[SandboxInfo, bool]:
        net = self.life.network.check(params.network, tenant)
        seccomp = params.seccomp
        if seccomp not in PROFILES:  # a profile file, read off the loop
            seccomp = await asyncio.to_thread(check_seccomp, seccomp)
        if params.user:
            check_user(params.user)
        if params.nested and not self.backend.capabilities.nested:
            raise InvalidRequest(f"nested=True (containers inside a sandbox) is not supported by the"
                                 f" {self.backend.name} backend: create the sandbox on the oci backend (crun)")
        env, labels = check_strings(params.env, "env"), check_labels(params.labels)
        wait = self.config.queue_timeout_s if params.queue_timeout is None else params.queue_timeout
        source, img, limits = await self.sources.source_limits(await self._scoped(params.image, tenant),
                                                               params.limits, tenant)
        check_fits_host(limits)
        check_gpus(self.life.gpus.check, limits, params.limits, img)
        deadline, persistence = params.deadline, params.persistence
        if deadline is None and persistence != "persistent":
            deadline = self.config.default_deadline_s
        detached = params.detached or persistence != "ephemeral"
        if detached:
            owner = "detached"
        info = SandboxInfo(
            id="", state="running", image_id=img.id, limits=limits, labels=labels, created_at=0.0, detached=detached,
            source=source, persistence=persistence, priority=params.priority, idle_timeout=params.idle_timeout,
            user=params.user or img.user, seccomp=seccomp, network="none" if net is None else net.to_wire(),
            group_id=group[0] if group else "", member=group[1] if group else "", nested=params.nested,
        )
        # Each quota check runs with no await before the row it counts is in: creates never overshoot.
        # A warm sandbox of the tenant's own pool counts already: taking it adds no memory or disk.
        pooling = seccomp == "default" and group is None and not params.nested  # a warm one: no group, not nested
        self.quotas.check_create(tenant, limits, claims_warm=pooling and self.pools.has_ready(source, limits, tenant))
        # The refill starts once the row handed out counts as the tenant's (its quota leaves room or not),
        # and after a policy's attach: both want the CPU.
        pooled_id = self.pools.take(source, limits, tenant, refill=False) if pooling else None
        if pooled_id is not None:
            made, pooled = self.life.hand_out(pooled_id, info, deadline, owner, env, tenant), True
            if net is None:
                self.pools.maintain()
            else:  # a warm sandbox gets its listener now: its services run without the proxy's env
                try:
                    await self.life.network.attach(dbmod.row_handle(self.db.get(made.id)), net, tenant)
                except BaseException:
                    await asyncio.shield(self.life.destroy(made.id))
                    raise
                finally:
                    self.pools.maintain()
        else:
            gpus = None if limits.gpus is None else lambda: self.life.gpus.shortage(limits)
            async with self.admission.slot(wait, self.policies.evict_for_room, limits.disk_mb, also=gpus):
                self.quotas.check_create(tenant, limits)
                made, pooled = await self.life.bring_up(info, deadline, owner, env, tenant), False
        if made.user:  # a user the sandbox does not know fails its create, not its first exec
            try:
                await asyncio.to_thread(users.resolve, self.backend.root(made.id), made.user)
            except BaseException:
                await asyncio.shield(self.life.destroy(made.id))
                raise
        return made, pooled

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self.life.info(sandbox_id)

    def tenant_of(self, sandbox_id: str) -> str | None:
        """The tenant a sandbox belongs to, or None when there is no such sandbox."""
        row = self.life.visible(sandbox_id)
        return None if row is None else row["tenant"]

    async def list(self, labels: dict[str, str] | None = None, *, tenant: str | None = None) -> list[SandboxInfo]:
        """Every sandbox (of ``tenant`` only, when given) that carries all of ``labels``."""
        rows = [row for row in self.db.rows() if row["state"] != "pooled"]
        infos = [dbmod.row_info(row) for row in rows if tenant is None or row["tenant"] == tenant]
        wanted = (labels or {}).items()
        return [info for info in infos if all(info.labels.get(k) == v for k, v in wanted)]

    async def set_network(self, sandbox_id: str, network: Any, *, cut: bool = False, tenant: str = "") -> SandboxInfo:
        """Change a sandbox's network policy while it runs (a setup phase with installs, then a locked
        one): new connections and requests follow it at once, and so do the proxy variables of later
        execs; with ``cut``, connections already open end too. From ``"none"`` the proxy's port opens
        inside the sandbox now; to ``"none"`` it closes."""
        life = self.life
        policy = life.network.check(network, tenant)
        async with life.changing(sandbox_id, wake=False) as row:
            life.db.update(sandbox_id, network=to_column(policy))
            if row["state"] == "suspended":
                pass  # attached as it resumes
            elif policy is None:
                await life.network.detach(sandbox_id)
            elif life.network.holds(sandbox_id) and policy.transparent == life.network.policies[sandbox_id].transparent:
                await life.network.set_policy(sandbox_id, policy, cut=cut)
            elif life.network.holds(sandbox_id):  # capture on or off: its sockets change, so it is attached anew
                before = life.network.policies[sandbox_id]
                await life.network.detach(sandbox_id)
                try:
                    await life.network.attach(dbmod.row_handle(row), policy, row["tenant"])
                except BaseException:  # the policy it had, served again
                    life.db.update(sandbox_id, network=row["network"])
                    with contextlib.suppress(FanfoldError):
                        await life.network.attach(dbmod.row_handle(row), before, row["tenant"])
                    raise
            else:
                try:
                    await life.network.attach(dbmod.row_handle(row), policy, row["tenant"])
                except BaseException:
                    life.db.update(sandbox_id, network=row["network"])
                    raise
        return life.info(sandbox_id)

    async def network_stats(self, sandbox_id: str) -> dict[str, Any]:
        """What a sandbox's traffic through the proxy came to: connections, requests, bytes up and
        down, denials and the latest denial reasons (counted since this engine attached it)."""
        self.life.known(sandbox_id)
        return await self.life.network.sandbox_stats(sandbox_id)

    async def expose(self, sandbox_id: str, port: int) -> str:
        """A URL on this host's loopback (``http://127.0.0.1:PORT``) that reaches ``port`` inside the
        sandbox, any TCP protocol; it lasts as long as the sandbox. A connection to it is a call: it
        wakes a paused or suspended sandbox first."""
        life = self.life
        port = _port(port, self.config.proxy_port)
        row = life.known(sandbox_id)
        if not life.backend.capabilities.network:
            raise InvalidRequest(f"the {life.backend.name} backend cannot reach into sandboxes: exposed ports need"
                                 " the oci backend with crun or runc")
        host_port = await life.network.expose(row["id"], port, lambda: self.connect_port(row["id"], port))
        return f"http://127.0.0.1:{host_port}"

    async def enable_ssh(self, sandbox_id: str, authorized_keys: list[str] | tuple[str, ...], *,
                         port: int = 22) -> SshAccess:
        """Start sshd in the sandbox, authorizing exactly these public keys, and expose its port
        (``fanfold.ssh``)."""
        from .ssh import enable_ssh

        return await enable_ssh(self, sandbox_id, authorized_keys, port=port)

    async def connect_port(self, sandbox_id: str, port: int) -> Any:
        """A connected, non-blocking socket to ``port`` inside the sandbox (the server's port route)."""
        life = self.life
        port = _port(port, self.config.proxy_port)
        async with life.using(sandbox_id) as row:
            try:
                return await life.backend.connect_inside(dbmod.row_handle(row), port)
            except NotImplementedError:
                raise InvalidRequest(f"the {life.backend.name} backend cannot reach into sandboxes") from None
            except InfrastructureError as err:
                raise PortUnreachable(f"nothing answers on port {port} inside sandbox {sandbox_id}: {err}") from None

    async def recordings(self, *, tenant: str = "") -> list[dict[str, Any]]:
        """Network recordings (``network={"record": NAME, ...}``) of ``tenant``: name, exchanges, bytes, created."""
        return await asyncio.to_thread(self.life.network.recordings, tenant)

    async def delete_recording(self, name: str, *, tenant: str = "") -> None:
        """Delete a recording that no sandbox records into or replays from now."""
        await asyncio.to_thread(self.life.network.delete_recording, tenant, name)

    def before_checkpoint(self, end_calls: Callable[[str], Awaitable[None]]) -> Callable[[], None]:
        """Have ``end_calls(sandbox_id)`` end the long-lived calls its caller runs in a sandbox (live
        processes, code contexts) before a pause, suspend, fork, snapshot or reset of it, which waits
        for every call in flight. Returns the function that unregisters it."""
        self.life.interrupters.append(end_calls)
        return lambda: self.life.interrupters.remove(end_calls)

    async def set_deadline(self, sandbox_id: str, deadline: float) -> SandboxInfo:
        """Destroy the sandbox ``deadline`` seconds from now instead of at its old deadline (E2B's set_timeout)."""
        check_deadline(deadline)
        if deadline is None:
            raise InvalidRequest("deadline must be a positive number of seconds, got None")
        self.life.known(sandbox_id)
        self.db.update(sandbox_id, deadline_at=dbmod.now() + deadline)
        self.life.arm_deadline(sandbox_id, deadline)
        return self.life.info(sandbox_id)

    async def kill(self, sandbox_id: str) -> None:
        """Destroy a sandbox and release everything it held."""
        row = self.life.visible(sandbox_id)
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        self.life.refuse_unless_ours(row)
        await self.life.destroy(sandbox_id)

    # -- exec and files -----------------------------------------------------------------------

    async def exec(
        self,
        sandbox_id: str,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        on_output: OnOutput | None = None,
        user: str | None = None,
        control: ExecControl | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (a shell string or an argv list) in the sandbox and return its typed result.

        ``user`` (``name[:group]`` or ``uid[:gid]``) runs it as that user, with their HOME, USER and
        LOGNAME unless ``env`` sets them; by default as the sandbox's user (see ``create``).
        ``control`` (embedded only) keeps stdin open for live input and sends signals while it runs."""
        return await self.execs.exec(sandbox_id, cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout,
                                     max_output=max_output, on_output=on_output, user=user, control=control)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self.files.read_file(sandbox_id, path)

    async def write_file(self, sandbox_id: str, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await self.files.write_file(sandbox_id, path, data, mode)

    async def upload(self, sandbox_id: str, local_path: str | Path, path: str) -> int:
        return await self.files.upload(sandbox_id, local_path, path)

    async def download(self, sandbox_id: str, path: str, local_path: str | Path) -> int:
        return await self.files.download(sandbox_id, path, local_path)

    async def open_file(self, sandbox_id: str, path: str) -> FileStream:
        """A sandbox file to stream out in chunks; close it (or read it to the end)."""
        return await self.files.open_file(sandbox_id, path)

    async def write_stream(self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes], mode: int = 0o644) -> int:
        """Stream ``chunks`` into a file that appears whole, or not at all; returns its size."""
        return await self.files.write_stream(sandbox_id, path, chunks, mode)

    async def list_files(self, sandbox_id: str, path: str = ".") -> list[FileEntry]:
        return await self.files.list_files(sandbox_id, path)

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self.files.remove_file(sandbox_id, path, recursive)

    # -- snapshots, fork, pause, suspend, reset -----------------------------------------------

    async def snapshot(self, sandbox_id: str, *, memory: bool = False, name: str | None = None) -> SnapshotInfo:
        """Checkpoint the sandbox's disk (and with ``memory``, its processes); it keeps running."""
        return await self.checkpoints.snapshot(sandbox_id, memory=memory, name=name)

    async def fork(
        self, sandbox_id: str, count: int, *, cmd: str | list[str] | None = None, deadline: float | None = None,
    ) -> ForkResult:
        """``count`` live copies of a running sandbox; it pauses only while its memory is dumped."""
        return await self.checkpoints.fork(sandbox_id, count, cmd=cmd, deadline=deadline)

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        """Freeze every process; memory stays resident. The next call (or ``unpause``) thaws it."""
        return await self.checkpoints.pause(sandbox_id)

    async def unpause(self, sandbox_id: str) -> SandboxInfo:
        """Thaw a paused sandbox (a running one is left as it is)."""
        return await self.checkpoints.unpause(sandbox_id)

    async def suspend(self, sandbox_id: str) -> SandboxInfo:
        """Checkpoint memory and disk to the state dir and release every process and byte of RAM."""
        return await self.checkpoints.suspend(sandbox_id)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Bring a suspended (or paused) sandbox back, processes and all, where it stopped."""
        return await self.checkpoints.resume(sandbox_id)

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        """Back to exactly the image or snapshot the sandbox was made from: disk, processes, memory."""
        return await self.checkpoints.reset(sandbox_id)

    async def snapshots(self, *, tenant: str | None = None) -> list[SnapshotInfo]:
        """Every snapshot (of ``tenant`` only, when given), oldest first; ``parent`` links the tree."""
        return await self.checkpoints.snapshots(tenant=tenant)

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return await self.checkpoints.get_snapshot(snapshot_id)

    def resolve_snapshot(self, ref: str, *, tenant: str = "") -> str | None:
        """The snapshot a create's ``image`` names (its id, or a name ``tenant`` gave one: each tenant
        names its own, "" the host), or None when it names an image."""
        return self.sources.resolve_snapshot(ref, tenant)

    def snapshot_tenant(self, ref: str) -> str | None:
        return self.checkpoints.snapshot_tenant(ref)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot no sandbox or later snapshot stands on."""
        await self.checkpoints.delete_snapshot(snapshot_id)

    # -- groups ---------------------------------------------------------------------------------

    async def create_group(self, params: GroupParams, *, tenant: str = "", lease: str | None = None) -> GroupInfo:
        """Start sandboxes on a private network of their own, reaching each other by name
        (``fanfold.groups``); they are running (and healthy, where checked) when this returns."""
        if not self._started or self.life.closing:
            raise InfrastructureError("the engine is not running (closed or not started): start a fleet first")
        task = asyncio.current_task()
        if task is not None:
            self._creating.add(task)
        try:
            return await self.groups.create(params, tenant=tenant, lease=lease)
        finally:
            if task is not None:
                self._creating.discard(task)

    async def get_group(self, group_id: str, *, tenant: str | None = None) -> GroupInfo:
        return self.groups.info(group_id, tenant)

    async def list_groups(self, *, tenant: str | None = None) -> list[GroupInfo]:
        return self.groups.list(tenant)

    async def kill_group(self, group_id: str, *, tenant: str | None = None) -> None:
        """Destroy every member of the group, and its network."""
        await self.groups.kill(group_id, tenant=tenant)

    async def snapshot_group(self, group_id: str, *, memory: bool = False, name: str | None = None,
                             tenant: str | None = None) -> GroupSnapshotInfo:
        """Snapshot every member as one group snapshot, which ``create_group(source=...)`` starts from."""
        return await self.groups.snapshot(group_id, memory=memory, name=name, tenant=tenant)

    async def fork_group(self, group_id: str, count: int, *, tenant: str | None = None) -> list[GroupInfo]:
        """``count`` live copies of the whole group, each on its own private network."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORK:
            raise InvalidRequest(f"count must be a whole number from 1 to {MAX_FORK}, got {count!r}")
        return await self.groups.fork(group_id, count, tenant=tenant)

    async def group_snapshots(self, *, tenant: str | None = None) -> list[GroupSnapshotInfo]:
        return self.groups.snapshots(tenant)

    async def delete_group_snapshot(self, snapshot_id: str, *, tenant: str | None = None) -> None:
        """Forget a group snapshot (its members' snapshots stay until ``gc`` or ``delete_snapshot``)."""
        await self.groups.delete_snapshot(snapshot_id, tenant=tenant)

    async def gc(self, *, tenant: str | None = None) -> list[str]:
        """Delete every snapshot that has no name and that no sandbox or kept snapshot needs; for the
        host's own callers (no tenant) also every layer no image, snapshot or sandbox uses."""
        removed = await self.checkpoints.gc(tenant=tenant)
        if tenant is None or tenant == "":
            removed += [f"layer:{name}" for name in await self.catalog.collect()]
        return removed

    async def export_snapshot(self, ref: str, *, have: set[str], tenant: str | None = None) -> AsyncIterator[bytes]:
        """A tar stream of snapshot ``ref`` (of ``tenant``, when given) for another engine's ``import_snapshot``:
        its row, the rows, image and layers it stacks on (less the layers named in ``have``) and its memory."""
        return await Transfers(self.db, self.store, self.snaps).export(ref, have=have, tenant=tenant)

    async def import_snapshot(self, source_url: str, snapshot_id: str, *, token: str | None = None,
                              tenant: str = "") -> SnapshotInfo:
        """Fetch snapshot ``snapshot_id`` from the server at ``source_url`` (its export route, with ``token``)
        and keep it here under the same id and name, owned by ``tenant``; one already here is returned."""
        return await Transfers(self.db, self.store, self.snaps).pull(source_url, snapshot_id, token=token, tenant=tenant)

    # -- leases -------------------------------------------------------------------------------

    async def open_lease(self, ttl: float | None = None, *, tenant: str = "", outlive: bool = False) -> LeaseInfo:
        """A new lease: sandboxes created with it die when it is closed or not renewed within ``ttl`` s."""
        return await self.leases.open_lease(ttl, tenant=tenant, outlive=outlive)

    async def renew_lease(self, lease_id: str, *, tenant: str | None = None) -> LeaseInfo:
        """Keep a lease (and its sandboxes) alive for another ttl; LeaseNotFound once it expired."""
        return await self.leases.renew_lease(lease_id, tenant=tenant)

    async def close_lease(self, lease_id: str, *, tenant: str | None = None) -> int:
        """End a lease now, destroying its sandboxes; returns how many there were."""
        return await self.leases.close_lease(lease_id, tenant=tenant)

    async def adopt(self, sandbox_id: str, lease: str, *, tenant: str = "",
                    labels: dict[str, str] | None = None, deadline: float | None = None) -> SandboxInfo:
        """Put a sandbox under another of its tenant's leases, with new ``labels`` and ``deadline``."""
        return await self.leases.adopt(sandbox_id, lease, tenant=tenant, labels=labels, deadline=deadline)

    # -- warm pools and figures ---------------------------------------------------------------

    async def set_pool(
        self, image: str | Image | SnapshotInfo, size: int | None, *, limits: Limits | None = None,
        wait: float | None = None, tenant: str = "",
    ) -> PoolInfo:
        """Keep ``size`` sandboxes of ``image`` (an image or snapshot) warm, with ``limits``.

        ``size=None`` follows recent demand; ``0`` empties and removes the pool. With
        ``wait`` (seconds), return once the pool is full. A server ``tenant``'s pools are its own:
        only its creates take from them, and their sizes count against its ``pools`` quota.
        """
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_POOL):
            raise InvalidRequest(f"a pool size is a whole number from 0 to {MAX_POOL}, or None to follow demand")
        if limits is not None and not isinstance(limits, Limits):
            raise InvalidRequest("limits must be a fanfold.Limits")
        ref = image.id if isinstance(image, SnapshotInfo) else image
        asked = limits
        source, img, limits = await self.sources.source_limits(await self._scoped(ref, tenant), limits, tenant)
        check_fits_host(limits)
        check_gpus(self.life.gpus.check, limits, asked, img)
        need = self.config.pool_auto_max if size is None else size
        self.quotas.check_pools(tenant, self.pools.planned(tenant, but=(source, limits)), need, limits)
        pool = self.pools.configure(source, limits, size, tenant)
        if wait:
            await self.pools.wait_full(pool, wait)
        return self.pools.info(pool)

    async def pools_info(self, *, tenant: str | None = None) -> list[PoolInfo]:
        """Every warm pool (only ``tenant``'s, when given): its target, what is ready, hand-outs and misses."""
        return self.pools.infos(tenant)

    async def stats(self, *, tenant: str | None = None, sandboxes: bool = True) -> dict[str, Any]:
        """The host at a glance: sandboxes by state (with their CPU and memory), queue, pools,
        create and exec latency percentiles, error and timeout rates, and alerts."""
        return await self.figures.stats(tenant=tenant, sandboxes=sandboxes)

    async def metrics_text(self, *, tenant: str | None = None) -> bytes:
        """Every metric in Prometheus' text format (for a server ``tenant``: none that names another's things)."""
        await self.figures.sample()
        return self.telemetry.exposition(tenant)


def _private_state(state_dir: Path) -> None:
    """Layers, images, snapshots and the database are no business of other host users. The state
    dir itself is only traversable: a sandbox's own root (a host uid of its user namespace) must
    reach its root dir, which is its own (mode 0700), and the agent's binary."""
    os.chmod(state_dir, 0o711)
    for name in ("layers", "images", "refs", "snapshots", "bundles", "locks"):
        (state_dir / name).mkdir(mode=0o700, exist_ok=True)  # private before anything lands in it
        os.chmod(state_dir / name, 0o700)
    for name in ("bin", "sandboxes"):  # passed through by sandboxes' roots: the agent, their own root dir
        (state_dir / name).mkdir(exist_ok=True)
        os.chmod(state_dir / name, 0o711)
    _private_files(state_dir)


def _private_files(state_dir: Path) -> None:
    """What other parts make in the state dir (registry storage, the disks, the database): private too."""
    for name in ("storage", "disk"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(state_dir / name, 0o700)
    for name in ("fanfold.db", "fanfold.db-wal", "fanfold.db-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(state_dir / name, 0o600)


def _port(port: int, proxy_port: int) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidRequest(f"a port is a whole number from 1 to 65535, got {port!r}")
    if port == proxy_port:
        raise InvalidRequest(f"port {port} inside a sandbox is its egress proxy's, not a service of its own")
    return port


