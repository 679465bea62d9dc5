"""The OCI backend: each sandbox a container of crun (or runc) on an overlayfs root over a disk
of its own (a btrfs subvolume with a quota, or a tmpfs), in its own cgroups and network
namespace, checkpointed with CRIU. Needs root.

``oci_sandbox`` makes and releases one sandbox's pieces; this file adds what the engine asks of
a live one: freeze and thaw (the cgroup freezer), checkpoints (the disk's upper layer, CRIU for
memory) and counters (the cgroups' files).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import time
from contextlib import AbstractContextManager
from pathlib import Path

from .._agent.build import agent_binary
from ..config import EngineConfig
from ..errors import CheckpointFailed, HostNotReady, InfrastructureError
from ..host import cgroups, disk, idmap, mounts, netns, procs, setup, subids
from ..host.offload import host_errors, on_thread
from ..store.rootfs import copy_upper
from . import get_runtime, lazy, oci_sandbox, seccomp, systemd
from .base import Backend, Capabilities, Handle, SandboxSpec
from .criu import Criu

FREEZE_TIMEOUT_S = 10.0
IDLE_DRAINS_AT_ONCE = 2
"""Idle page servers copying their rest in at once: a fork's children, idle together, take turns."""
CONNECT_TIMEOUT_S = 5.0
log = logging.getLogger("fanfold.engine")


class OciBackend(oci_sandbox.OnHost, Backend):
    """Sandboxes as OCI containers; memory checkpoints with CRIU."""

    name = "oci"
    capabilities = Capabilities(memory="live", exact_counters=True, isolated=True, network=True, nested=True)
    users: idmap.Namespaces
    """User namespaces for the idmaps of sandboxes' layers, one per uid range."""
    userns: bool = False
    """Whether new sandboxes get a user namespace (``config.userns``, where the host allows)."""
    pages: lazy.LazyPages
    """The engine's page server and lazy restores."""
    page_sources: dict[str, lazy.PageSource]
    """The page server's session of each sandbox restored lazily whose memory is not all in yet (``pages.sources``)."""
    lazy_starting: int
    """Lazy restores under way (they count against ``page_servers_max`` already)."""
    draining: set[asyncio.Task[None]]
    """Drains of idle page servers under way."""
    lost: dict[str, str]
    """Sandboxes this backend killed because their page server died, and why."""
    images_used: dict[str, float]
    """When a restore last read each memory snapshot's images (``lazy.cool_images``)."""
    images_cooled: set[str]
    systemd_services: dict[str, tuple[tuple[str, str, str], ...]]
    """The services of each sandbox started with systemd as init, until ``wait_ready`` has asked systemd."""

    async def prepare(self) -> None:
        if not setup.is_root():
            raise HostNotReady("the oci backend needs root (mounts, cgroups): run fanfold as root,"
                               " or use the fake backend (FANFOLD_BACKEND=fake) for tests of engine logic")
        self.prepare_host()
        cfg = self.config
        for passed in (cfg.run_dir.parent, cfg.run_dir):  # a sandbox's root reaches its channel dir through them
            os.chmod(passed, 0o755)
        self.runtime = self.step_runtime = get_runtime(cfg.runtime, str(cfg.run_dir / cfg.runtime))
        self.agent_path = await asyncio.to_thread(agent_binary, cfg.state_dir)
        self.criu = Criu(cfg.criu, lo_up=self.agent_path)
        self.pages = lazy.LazyPages(self.criu.binary, cfg.state_dir, cfg.run_dir, cfg.page_server_processes)
        self.page_sources, self.lost, self.images_used, self.images_cooled = self.pages.sources, {}, {}, set()
        self.lazy_starting, self.draining = 0, set()
        self.systemd_services = {}
        await asyncio.to_thread(seccomp.bpf, "default")  # HostNotReady now, not at the first create
        self.users = idmap.Namespaces()
        self.userns = cfg.userns and _reachable_from_userns(cfg.state_dir)
        if cfg.userns:  # restores of checkpoints made in user namespaces take ranges too
            self.users.slots = await asyncio.to_thread(subids.ensure, cfg.uid_ranges)
        self.disk_hold = await asyncio.to_thread(quota_disk, cfg)
        if self.userns:
            self.userns = await asyncio.to_thread(_idmaps_work, cfg, self.users, self.disk_hold is not None)

    async def close(self, *, idle: bool = True) -> None:
        for task in self.draining:  # let_go below has the daemon finish every drain on its own
            task.cancel()
        self.pages.let_go()  # sandboxes that outlive this engine: their memory all in
        await self.close_host(idle=idle)
        self.users.close()

    async def sweep(self, *, thorough: bool = False) -> None:
        await super().sweep(thorough=thorough)
        self._drain_idle()
        if thorough:
            self.images_cooled |= await asyncio.to_thread(
                lazy.cool_images, self.config.state_dir / "snapshots", dict(self.images_used), set(self.images_cooled),
                self.config.images_cold_s)
            live = {str(path) for path in (self.config.state_dir / "snapshots").glob("*/memory")}
            self.images_cooled &= live
            self.images_used = {key: at for key, at in self.images_used.items() if key in live}

    async def list_ids(self) -> set[str]:
        return {i for i in await self.runtime.list_ids() if i.startswith("sb-")} | self.host_ids()

    # -- one sandbox ----------------------------------------------------------------------------

    async def bring_up(self, spec: SandboxSpec) -> Handle:
        if spec.restore is not None:
            self.images_used[str(spec.restore)] = time.time()
            self.images_cooled.discard(str(spec.restore))
            # Past the cap this restore copies every page now, and keeps no page server.
            serving = len(self.page_sources) + self.lazy_starting
            lazy_ = self.config.lazy_restore and serving < self.config.page_servers_max
            self.lazy_starting += lazy_
            try:
                pid = await oci_sandbox.restore(self.config, self.store, self.criu, self.agent_path, spec,
                                                quota=self.quota, users=self.users,
                                                pages=self.pages if lazy_ else None)
            finally:
                self.lazy_starting -= lazy_
            if spec.id in self.page_sources:
                self.page_sources[spec.id].watch(lambda why: self._lose(spec.id, pid, why))
        else:
            pid = await oci_sandbox.provision(self.config, self.store, self.runtime, self.agent_path, spec,
                                              quota=self.quota, users=self.users if self.userns else None)
        if spec.init == systemd.INIT:
            self.systemd_services[spec.id] = spec.services
        return Handle(spec.id, pid)

    async def wait_ready(self, handle: Handle) -> str:
        """Where systemd is init, systemd says how its start and each service's unit went; else the agent."""
        services = self.systemd_services.pop(handle.id, None)
        if services is None:
            return await super().wait_ready(handle)

        async def run(argv: list[str]):
            return await self.exec(handle, argv, env=["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], cwd="/", timeout_ms=0,
                                   max_output=1 << 20)

        return await systemd.wait_ready(run, services)

    async def listen_inside(self, handle: Handle, port: int) -> socket.socket:
        assert handle.pid is not None
        return await on_thread(netns.listen_in, handle.pid, port, discard=socket.socket.close)

    async def capture_inside(self, handle: Handle, tcp_port: int, dns_port: int) -> tuple[socket.socket, socket.socket]:
        assert handle.pid is not None
        return await on_thread(netns.capture_in, handle.pid, tcp_port, dns_port, discard=_close_both)

    async def connect_inside(self, handle: Handle, port: int) -> socket.socket:
        assert handle.pid is not None
        sock = await on_thread(netns.socket_in, handle.pid, discard=socket.socket.close)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port)), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as err:
            sock.close()
            raise InfrastructureError(f"connecting to port {port} in sandbox {handle.id} failed:"
                                      f" {getattr(err, 'strerror', None) or 'timed out'}") from None
        except BaseException:
            sock.close()
            raise
        return sock

    async def release(self, sandbox_id: str, handle: Handle | None = None) -> None:
        with host_errors(f"releasing sandbox {sandbox_id} failed (the reaper tries again)"):
            source = self.page_sources.pop(sandbox_id, None)
            if source is not None:
                await source.stop()
            # one a crashed engine started is killed as the rest is released, and its dir removed
            await oci_sandbox.release(self.config, self.runtime, sandbox_id, handle.pid if handle else None)
        self.lost.pop(sandbox_id, None)
        self.systemd_services.pop(sandbox_id, None)

    def page_counts(self, sandbox_id: str) -> dict[str, int | str] | None:
        counts = lazy.read_counts(oci_sandbox.paths(self.config, sandbox_id).lazy)
        return counts.to_dict() if counts else None

    def lost_why(self, sandbox_id: str) -> str | None:
        return self.lost.get(sandbox_id)

    def _lose(self, sandbox_id: str, pid: int, why: str) -> None:
        """The page server of a lazily restored sandbox died: the pages it had not copied read as zeros
        now, so the sandbox ends at once, and its calls say why."""
        self.page_sources.pop(sandbox_id, None)
        self.lost[sandbox_id] = f"sandbox {sandbox_id} was ended: {why}"
        log.error("%s", self.lost[sandbox_id])
        oci_sandbox.kill_init(self.config, sandbox_id, pid)

    def _drain_idle(self) -> None:
        """Have each page server that copied nothing for ``page_server_idle_s`` copy the rest in and exit."""
        for sandbox_id, source in list(self.page_sources.items()):
            if len(self.draining) >= IDLE_DRAINS_AT_ONCE:
                return
            if not source.draining and source.idle_for() >= self.config.page_server_idle_s:
                task = asyncio.ensure_future(self._drain(sandbox_id, source))
                self.draining.add(task)
                task.add_done_callback(self.draining.discard)

    async def _drain(self, sandbox_id: str, source: lazy.PageSource) -> None:
        try:
            await source.drain()
        except CheckpointFailed as err:  # its watch ends the sandbox, unless it was stopped meanwhile
            if not source.stopping:
                log.warning("fanfold: sandbox %s's idle page server did not finish: %s", sandbox_id, err)
            return
        if self.page_sources.get(sandbox_id) is source:
            del self.page_sources[sandbox_id]

    async def _memory_all_in(self, sandbox_id: str) -> None:
        """Before a checkpoint: CRIU dumps only the pages a process has, so a lazily restored sandbox's
        page server first copies in the rest."""
        source = self.page_sources.get(sandbox_id)
        if source is not None:
            await source.drain()
            self.page_sources.pop(sandbox_id, None)
        else:
            await lazy.settle_orphan(oci_sandbox.paths(self.config, sandbox_id).lazy)

    def alive(self, handle: Handle) -> bool:
        return procs.running(handle.pid)

    async def freeze(self, handle: Handle) -> None:
        """Freeze at a point CRIU can dump: no process stuck in uninterruptible sleep.

        A vfork parent waits in that state until its child execs; if the child froze first,
        the parent can never be seized. Thawing for a moment lets the exec happen.
        """
        parent, sandbox_id = self.config.cgroup_parent, handle.id
        deadline = time.monotonic() + FREEZE_TIMEOUT_S
        with host_errors(f"freezing sandbox {sandbox_id} failed"):
            while True:
                poll = Path(cgroups.freeze_start(parent, sandbox_id))
                while not cgroups.is_frozen_text(poll.read_text()):
                    if time.monotonic() > deadline:
                        self._thaw_quietly(sandbox_id)
                        raise InfrastructureError(f"sandbox {sandbox_id} did not freeze within {FREEZE_TIMEOUT_S:.0f} s")
                    await asyncio.sleep(0.0005)
                if not cgroups.blocked_tasks(parent, sandbox_id):
                    return
                self._thaw_quietly(sandbox_id)
                if time.monotonic() > deadline:
                    raise CheckpointFailed(f"sandbox {sandbox_id} keeps processes in uninterruptible sleep; try again")
                await asyncio.sleep(0.002)

    async def thaw(self, handle: Handle) -> None:
        with host_errors(f"thawing sandbox {handle.id} failed"):
            cgroups.thaw(self.config.cgroup_parent, handle.id)

    def _thaw_quietly(self, sandbox_id: str) -> None:
        try:
            cgroups.thaw(self.config.cgroup_parent, sandbox_id)
        except OSError:
            pass  # the sandbox is gone: nothing left to thaw

    async def checkpoint(
        self, handle: Handle, dest: Path, host_dirs: tuple[str, ...], *, memory: bool, leave_running: bool,
        frozen: bool = False,
    ) -> float:
        where = oci_sandbox.paths(self.config, handle.id)
        await self._memory_all_in(handle.id)
        agent = systemd.agent_pid(handle.pid, oci_sandbox.AGENT_PATH) if handle.pid else None
        await _agent_settled(agent)
        if not frozen and where.subvolume.is_dir():
            # Snapshotting a subvolume first writes out its dirty pages: here, not in the pause.
            await on_thread(disk.sync, where.subvolume)
        frozen_at = time.monotonic()
        resumed_at: float | None = None
        try:
            if not frozen:
                await self.freeze(handle)
            try:
                await asyncio.to_thread(copy_upper, where.disk, host_dirs, dest / "layer")
                if memory:
                    resumed_at = await self._dump_memory(handle, where, dest / "memory", host_dirs, agent,
                                                         leave_running=leave_running, frozen=frozen)
            finally:
                if not frozen:
                    self._thaw_quietly(handle.id)
        except OSError as err:
            raise CheckpointFailed(f"snapshot of {handle.id} failed: {err}") from None
        return ((resumed_at or time.monotonic()) - frozen_at) * 1000

    async def _dump_memory(
        self, handle: Handle, where: oci_sandbox.Paths, images: Path, host_dirs: tuple[str, ...], agent: int | None,
        *, leave_running: bool, frozen: bool,
    ) -> float | None:
        """CRIU's dump of the frozen sandbox; when CRIU resumed it before writing its pages (copy-on-write:
        a running sandbox that goes on running), when that was. The agent is always dumped while frozen:
        its shadow would be a process the sandbox may read and write, which the agent itself is not."""
        images.mkdir()
        own_netns = idmap.base_of(handle.id) is not None
        if own_netns and not netns.has_inet_sockets(handle.pid or 0):
            # nothing to bind on lo as it is restored: it comes up after, without CRIU's action script
            (images / oci_sandbox.NO_INET_FILE).touch()
        # a sandbox paused by its owner stays frozen until unpaused: no copy-on-write, which resumes it
        copy_on_write = self.config.copy_on_write_dump and leave_running and not frozen
        parent = self.config.cgroup_parent
        raised = cgroups.make_room(parent, handle.id) if copy_on_write else []
        try:
            resumed = await self.criu.dump(
                handle.pid or 0, images, root=where.rootfs, mounts=oci_sandbox.criu_mounts(host_dirs),
                freezer=cgroups.freezer_dir(parent, handle.id), leave_running=leave_running,
                own_netns=own_netns, cgroup=f"/{parent}/{handle.id}", copy_on_write=copy_on_write,
                keep_frozen=(agent,) if agent else (),
            )
        finally:
            if raised:  # CRIU waited for the shadows to go: their pages are uncharged
                await asyncio.to_thread(cgroups.put_back, raised)
        if resumed is None:
            return None
        log.debug("%s: %d processes' memory written after the sandbox ran again", handle.id, resumed.shadows)
        return resumed.at

    def as_root(self, sandbox_id: str) -> AbstractContextManager[None]:
        return idmap.as_mapped_root(idmap.base_of(sandbox_id))


async def _agent_settled(pid: int | None, timeout: float = 5.0) -> None:
    """Wait until the agent holds no host connection but its listener.

    The agent closes a connection just after sending its last frame, so the host can be
    done with a call a moment before the agent is; CRIU cannot carry a connection whose
    peer is gone. With the engine's gate held no new call comes, so this only waits out that moment.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            return  # gone: the dump reports it
        if sum(link.startswith("socket:") for link in links) <= 1:
            return
        if time.monotonic() > deadline:
            raise CheckpointFailed("the sandbox's agent still holds a connection (a process in the sandbox"
                                   " connected to it?); try again")
        await asyncio.sleep(0.001)


def _reachable_from_userns(state_dir: Path) -> bool:
    """Whether a sandbox's root, an unprivileged host uid, can reach its root dir under ``state_dir``:
    every directory above it must let others through. If not, sandboxes go without user namespaces."""
    for parent in state_dir.resolve().parents:
        if not parent.stat().st_mode & 0o001:
            log.warning("sandboxes run without user namespaces: %s (above the state dir) is closed to other"
                        " users; `chmod o+x %s`, or use a state dir under one that is open", parent, parent)
            return False
    return True


def _idmaps_work(cfg: EngineConfig, users: idmap.Namespaces, quota: bool) -> bool:
    """Whether this kernel idmaps what a sandbox's root is made of: the layers' filesystem, the
    disks' (btrfs, or tmpfs from Linux 6.3), the host dirs'. If not, sandboxes go without user namespaces."""
    probe = cfg.run_dir / f".idmap-probe-{os.getpid()}"
    sources = [cfg.state_dir / "layers", Path("/usr"), cfg.state_dir / "disk" if quota else probe / "tmpfs"]
    try:
        probe.mkdir(exist_ok=True)
        if not quota:
            (probe / "tmpfs").mkdir(exist_ok=True)
            mounts.mount_tmpfs(probe / "tmpfs", 1)
        ns = users.fd(idmap.base_of_slot(users.slots[0]))
        for index, source in enumerate(sources):
            target = probe / str(index)
            target.mkdir(exist_ok=True)
            idmap.idmapped_bind(source, target, ns)
            mounts.umount(target)
        return True
    except (OSError, HostNotReady, InfrastructureError) as err:
        log.warning("sandboxes run without user namespaces: this host cannot idmap what their roots are made of"
                    " (%s); Linux 6.3 or later and layers on ext4, xfs or btrfs can", err)
        return False
    finally:
        for point in mounts.mounts_under(probe):
            mounts.umount(point)
        shutil.rmtree(probe, ignore_errors=True)


def quota_disk(cfg: EngineConfig) -> disk.Hold | None:
    """A hold on the btrfs for sandboxes' disks (``disk="btrfs"``, the default), or None for a tmpfs
    each (``tmpfs``); a host that cannot make the btrfs falls back to tmpfs with a warning."""
    if cfg.disk == "tmpfs":
        return None
    size = int(cfg.disk_size_gb * (1 << 30)) if cfg.disk_size_gb else None
    try:
        return disk.ensure(cfg.state_dir, size)
    except HostNotReady as err:
        log.warning("sandbox disks fall back to tmpfs, charged to each sandbox's memory limit: %s", err)
        return None


def _close_both(pair: tuple[socket.socket, socket.socket]) -> None:
    for sock in pair:
        sock.close()
