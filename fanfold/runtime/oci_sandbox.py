"""The OCI backend's sandbox: its disk (a btrfs subvolume with a quota, or a tmpfs), root
(overlayfs over the layers), agent channel and container, made and released."""

from __future__ import annotations

import array
import asyncio
import functools
import itertools
import fcntl
import os
import re
import signal
import socket
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from ..config import EngineConfig
from ..errors import FanfoldError, InfrastructureError, InvalidRequest
from .._agent.client import AgentClient
from ..host import cgroups, disk, idmap, mounts, procs, safefs, setup, stepnet
from ..host.offload import on_thread, read_once, to_the_end
from ..store import LayerStore, trust
from ..store.rootfs import inherit_layer, mount_trusted
from ..models import Limits
from ..host.netns import alias_lo, new_netns, raise_lo, set_hostname
from ..host.spawn import log_tail
from . import criu_images, lazy, nested, seccomp, systemd
from .base import Handle, SandboxSpec
from .container import Bind, ContainerSpec, Runtime
from .criu import AGENT_KEY, CHANNEL_KEY, Criu, Mounts, host_dir_key

FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10
BUNDLE_MB = 16
"""The tmpfs on a sandbox's root when its disk is a subvolume: the bundle and logs only."""
AGENT_PATH = "/.fanfold/agent"
NO_INET_FILE = "fanfold-no-inet"
"""In a memory checkpoint of a sandbox in a user namespace: it held no IP socket, so its restore
brings lo up after CRIU is done rather than through CRIU's action script."""
CHANNEL_PATH = "/.fanfold/run"
BUILD_STEP = re.compile(r"build-(\d+)-[0-9a-f]{8}")
"""A build step's container and cgroup name (``images.builder``), its builder's pid first."""


@dataclass(frozen=True)
class Paths:
    """Where one sandbox's pieces live on the host."""

    root: Path
    channel: Path
    """A host dir mounted into the sandbox at CHANNEL_PATH, where the agent binds its socket."""

    @property
    def socket(self) -> Path:
        return self.channel / "agent.sock"

    @property
    def lazy(self) -> Path:
        """Where a lazy restore's CRIU and page server meet (its socket), and the page server's log, pid
        file and counters: beside the channel dir, since the page server starts before the root exists."""
        return self.channel.with_name(f"lazy-{self.channel.name}")

    @property
    def subvolume(self) -> Path:
        """The sandbox's disk on the quota filesystem, ``<state>/disk/<id>``, when it has one."""
        return disk.sandbox_disk(self.root.parent.parent, self.root.name)

    @property
    def disk(self) -> Path:
        """Where the overlay's upper and work dirs are: the sandbox's subvolume when it exists,
        else the tmpfs on ``root`` itself. ``root`` always is a tmpfs, holding the root's mount
        point and the bundle (ext4 slows down allocating inodes under create/destroy churn), so
        one lazy unmount of it releases every mount the sandbox has."""
        return self.subvolume if self.subvolume.is_dir() else self.root

    @property
    def rootfs(self) -> Path:
        return self.root / "rootfs"

    @property
    def bundle(self) -> Path:
        return self.root / "bundle"


def paths(config: EngineConfig, sandbox_id: str) -> Paths:
    return _paths(config.state_dir, config.run_dir, sandbox_id)


@lru_cache(maxsize=1024)
def _paths(state_dir: Path, run_dir: Path, sandbox_id: str) -> Paths:
    """Kept for the sandboxes in use: each create, exec and release asks, and pathlib is slow to join."""
    return Paths(state_dir / "sandboxes" / sandbox_id, run_dir / sandbox_id)


class OnHost:
    """What the backends whose sandboxes are made here share (oci, runsc): the host's set-up and
    sweeps, the ids of what is held, counters and usage from the sandbox's cgroups, its root on the
    host and its agent's socket."""

    config: EngineConfig
    step_runtime: Runtime | None
    disk_hold: disk.Hold | None = None
    """The btrfs holding sandboxes' disks (``prepare`` made sure of it), else each has a tmpfs."""

    @property
    def quota(self) -> bool:
        """Whether new sandboxes get a subvolume with a quota as their disk (else a tmpfs)."""
        return self.disk_hold is not None

    def prepare_host(self) -> None:
        """Ready the host once per engine start (the caller checked it runs as root)."""
        setup.fix_hybrid_cgroups()
        setup.favor_dynamic_cgroups()  # ~10 ms off each create
        setup.become_subreaper()
        (self.config.state_dir / "sandboxes").mkdir(parents=True, exist_ok=True)
        self.config.run_dir.mkdir(parents=True, exist_ok=True)

    async def close_host(self, *, idle: bool) -> None:
        # Only empty groups go (rmdir), and the runtime recreates the parent on the next create,
        # so another engine on the same state dir is unaffected. The run dir stays: removing it
        # would race another engine binding a socket there.
        if idle:
            cgroups.remove_parent(self.config.cgroup_parent)
        if self.disk_hold is not None:  # unmounted only when no engine holds it and no sandbox has a disk
            await asyncio.to_thread(self.disk_hold.close)
            self.disk_hold = None

    def host_ids(self) -> set[str]:
        """Ids of the sandboxes that have anything here but the runtime's own state."""
        cfg = self.config
        ids = {p.name for p in (cfg.state_dir / "sandboxes").iterdir()}
        ids |= cgroups.leftover_ids(cfg.cgroup_parent)
        ids |= disk.ids(cfg.state_dir)  # a crashed engine's subvolumes
        ids |= {p.name.removesuffix(".sock") for p in cfg.run_dir.glob("sb-*")}  # .sock: before 0.4
        return ids

    async def sweep(self, *, thorough: bool = False) -> None:
        setup.reap_orphans()
        if not thorough:
            return
        await on_thread(idmap.sweep)  # what a crash left of a uid range's claim, host-wide
        await on_thread(discard_restore_copies, self.config.state_dir)
        if self.step_runtime is None:
            return
        for container in await self.step_runtime.list_ids():
            if _dead_builders_step(container):
                await self.step_runtime.delete(container)
        for group in await on_thread(cgroups.top_groups, "build-"):  # one its runtime never recorded
            if _dead_builders_step(group):
                await on_thread(cgroups.remove_group, group)
        await asyncio.to_thread(stepnet.sweep, self.config.tag)  # and that builder's network

    def agent(self, handle: Handle) -> AgentClient:
        return self.agent_of(handle.id)

    def agent_of(self, sandbox_id: str) -> AgentClient:
        return AgentClient(str(paths(self.config, sandbox_id).socket))

    def counters(self, handle: Handle) -> cgroups.CounterFiles:
        return cgroups.CounterFiles(self.config.cgroup_parent, handle.id)

    def usage(self, handle: Handle) -> tuple[float, int]:
        return cgroups.usage(self.config.cgroup_parent, handle.id) if handle.pid else (0.0, 0)

    def root(self, sandbox_id: str) -> Path:
        return paths(self.config, sandbox_id).rootfs


def _dead_builders_step(name: str) -> bool:
    """Whether ``name`` is a build step's (container or cgroup) whose builder is gone."""
    step = BUILD_STEP.fullmatch(name)
    return step is not None and not procs.running(step[1])


async def provision(
    config: EngineConfig, store: LayerStore, runtime: Runtime, agent: Path, spec: SandboxSpec, *, quota: bool = False,
    users: idmap.Namespaces | None = None,
) -> int:
    """Mount the sandbox's disk and root, and start its agent; return the agent's host pid.

    With ``quota`` its writes go to a subvolume of ``<state>/disk`` (``disk.ensure`` made it),
    else to a tmpfs. With ``users`` it gets a user namespace and a uid range of its own. The caller
    owns cleanup: on any failure it calls ``release``, which undoes whatever exists.
    """
    sandbox_id = spec.id
    # The agent binds its own socket (inside the sandbox, so a checkpoint carries it) and says
    # so on this socket; end of file first means it died. It starts services only once we
    # close our end, after the socket's directory is locked.
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        made: list[tuple[Paths, ContainerSpec, int]] = []
        try:
            where, container, launched = await on_thread(
                _make_root, config, store, runtime, agent, spec, quota, users, theirs.fileno(), discard=made.append)
        except asyncio.CancelledError:
            if made:  # the runtime is starting: the caller's release must come after it is done
                await to_the_end(on_thread(runtime.abandon, made[0][2]))
            raise
        theirs.close()  # the runtime has its copy
        pid = await runtime.started(sandbox_id, where.bundle, launched)
        async with asyncio.timeout(30):
            said = await read_once(ours.fileno())
        if said != b"r":
            raise InfrastructureError(f"sandbox {sandbox_id}'s agent died at start: {log_tail(where.bundle / 'runtime.log')}")
        set_immutable(where.channel, True)
        if container.systemd:  # the group crun made, before systemd starts in it
            await on_thread(systemd.delegate, config.cgroup_parent, sandbox_id, container.uid_base)
        if spec.before_run is not None:
            await spec.before_run(Handle(sandbox_id, pid))
    return pid


def _make_root(config: EngineConfig, store: LayerStore, runtime: Runtime, agent: Path, spec: SandboxSpec,
               quota: bool, users: idmap.Namespaces | None, pass_fd: int) -> tuple[Paths, ContainerSpec, int]:
    """The file system work of a create, in one go on a thread: a uid range claimed when ``users`` is
    given, the disk, root and channel mounted and made, the runtime's bundle written and the runtime
    started on it (``pass_fd`` its PID 1's fd 3); returns what ``Runtime.started`` waits for.

    The runtime starts as soon as the root is mounted, and what it does not need is done while it
    loads and makes the namespaces and cgroups (milliseconds): /etc/hostname is written (the agent
    starts no service, nor runs any command, before ``provision`` has this thread's answer)."""
    sandbox_id = spec.id
    if spec.nested and users is None:
        raise InvalidRequest(f"sandbox {sandbox_id} asks for nested=True, which needs user namespaces, and this"
                             " host runs sandboxes without them (FANFOLD_USERNS=0, or its kernel cannot)")
    systemd.check_init(spec.init)  # a pulled image's label may name anything
    base = idmap.claim(sandbox_id, users.slots) if users is not None else None
    where = mount_disk(config, store, sandbox_id, spec.layers, spec.host_dirs, spec.limits, quota, base, users,
                       xino=spec.init == systemd.INIT, named=False)
    if spec.nested:
        with idmap.as_mapped_root(base):
            nested.write_files(where.rootfs)
    args = [AGENT_PATH, "--listen", f"{CHANNEL_PATH}/agent.sock"]
    if spec.init == systemd.INIT:
        systemd.unified_dir(config.cgroup_parent, sandbox_id)  # HostNotReady without cgroup2
        args += ["--init", systemd.find_init(where.rootfs)]
        with idmap.as_mapped_root(base):  # its root owns its units, as it owns what it writes
            systemd.write_units(where.rootfs, spec.services, spec.env)
    else:
        for name, cmd, mode in spec.services:
            args += [f"--{mode}", name, cmd]
    container = ContainerSpec(
        id=sandbox_id, rootfs=where.rootfs, args=args, env=list(spec.env), cwd="/", hostname=sandbox_id,
        limits=spec.limits, binds=channel_binds(agent, where),
        cgroup_path=f"/{config.cgroup_parent}/{sandbox_id}",
        oom_score_adj=-1000 if setup.can_protect_from_oom() else None,
        seccomp_bpf=seccomp.bpf(spec.seccomp, nested=spec.nested), uid_base=base, devices=spec.devices,
        nested_nodes=nested.device_nodes(config.state_dir) if spec.nested else None,
        systemd=spec.init == systemd.INIT,
        # crun joins the range's kept namespace: making one costs it ~6 ms a create
        userns_path=None if users is None or base is None else f"/proc/{os.getpid()}/fd/{users.fd(base)}",
    )
    launched = runtime.launch(container, where.bundle, pass_fd)
    try:
        with idmap.as_mapped_root(base):
            name_host(where.rootfs, sandbox_id)
    except BaseException:
        runtime.abandon(launched)
        raise
    return where, container, launched


async def restore(
    config: EngineConfig, store: LayerStore, criu: Criu, agent: Path, spec: SandboxSpec, *, quota: bool = False,
    users: idmap.Namespaces, pages: lazy.LazyPages | None = None,
) -> int:
    """Mount a new disk and root over the spec's layers and restore its memory images into them.

    A checkpoint of a sandbox in a user namespace restores into a uid range of its own (its image
    rewritten to it), in an empty network namespace CRIU makes (``Criu.restore``): one made here
    would be owned by the host's user namespace, which the restored root cannot join.
    With ``pages``, the restore is lazy: the engine's page server (a ``lazy.PageSource`` session, kept
    in ``pages.sources`` under the sandbox's id) copies each page in when the sandbox first touches it.
    Returns the restored agent's host pid; as with ``provision``, the caller releases on failure.
    """
    sandbox_id, host_dirs, images = spec.id, spec.host_dirs, spec.restore
    assert images is not None
    in_userns = criu_images.has_userns(images)
    base = idmap.claim(sandbox_id, users.slots) if in_userns else None
    # A lazy restore's page server starts while the disk is mounted (it reads the images as they are:
    # a user namespace's rewritten map is none of its business).
    serving = asyncio.ensure_future(_serve_pages(images, paths(config, sandbox_id).lazy, sandbox_id, pages))
    try:
        where = await on_thread(functools.partial(
            mount_disk, config, store, sandbox_id, spec.layers, host_dirs, spec.limits, quota, base,
            users if in_userns else None, xino=spec.init == systemd.INIT))
    finally:
        await asyncio.wait([serving])  # started (kept in pages.sources, so released with the sandbox) or failed
    lazy_ = serving.result()
    work = where.lazy if lazy_ else where.bundle  # where CRIU's restore and the page server meet
    where.bundle.mkdir()
    binds = {AGENT_KEY: str(agent), CHANNEL_KEY: str(where.channel)}
    binds.update({host_dir_key(d): str(where.rootfs / d.lstrip("/")) for d in host_dirs})
    cgroup = f"/{config.cgroup_parent}/{sandbox_id}"
    await on_thread(cgroups.ensure_parent, config.cgroup_parent)  # a host's first sandbox may be a restore
    if base is not None:
        own = restore_copy(images, sandbox_id)
        # CRIU binds the root into the restored mount namespace without its submounts, which a
        # namespace of a user namespace holds locked (the host dirs' overlays): a bind of the root
        # alone, which has none, is what it may take.
        bare = where.root / "bare"
        bare.mkdir()
        mounts.mount(str(where.rootfs), bare, "", mounts.MS_BIND)
        lo_first = not (images / NO_INET_FILE).exists()
        try:
            await on_thread(criu_images.private_copy, images, own, base)
            pid = await criu.restore(own, work=work, root=bare, cgroup=cgroup, binds=binds, netns=None,
                                     lo_first=lo_first, lazy=lazy_, addresses=spec.addresses)
        finally:
            await on_thread(shutil.rmtree, own, True)
        if not lo_first:
            await on_thread(raise_lo, pid)  # still frozen: nothing of the sandbox sees lo down
    else:
        netns = await on_thread(new_netns, discard=os.close)  # unshare and raising lo take milliseconds
        if spec.addresses:
            await on_thread(alias_lo, netns, spec.addresses)
        try:
            pid = await criu.restore(images, work=work, root=where.rootfs, cgroup=cgroup, binds=binds, netns=netns,
                                     lazy=lazy_)
        finally:
            os.close(netns)  # the restored processes hold the namespace now
    if spec.init == systemd.INIT:  # CRIU made its groups as the host's root
        await on_thread(systemd.delegate, config.cgroup_parent, sandbox_id, base)
    if lazy_:
        await pages.sources[sandbox_id].opened()  # a resume removes the images next
    # The image holds the source's freezer state (frozen while it was dumped) and hostname: the
    # restored processes run only once thawed, after their channel dir (CRIU bound the agent's
    # socket in it again) is locked.
    set_immutable(where.channel, True)
    if spec.before_run is not None:
        await spec.before_run(Handle(sandbox_id, pid))
    cgroups.thaw(config.cgroup_parent, sandbox_id)
    await on_thread(set_hostname, pid, sandbox_id)
    return pid


def restore_copy(images: Path, sandbox_id: str) -> Path:
    """Where a restore into a uid range of its own rewrites ``images`` for ``sandbox_id`` (beside them:
    ``snapshots/<id>/memory.<sandbox>``), removed as the restore ends."""
    return images.with_name(f"{images.name}.{sandbox_id}")


def discard_restore_copies(state_dir: Path) -> int:
    """Remove the rewritten images a crash mid-restore left: those of a sandbox whose root is gone (a
    restore makes the root before the copy, and the sandbox's release removes it). Returns how many."""
    removed = 0
    for copy in (state_dir / "snapshots").glob("*/memory.*"):
        sandbox_id = copy.name.partition(".")[2]
        if sandbox_id.startswith("sb-") and not (state_dir / "sandboxes" / sandbox_id).exists():
            shutil.rmtree(copy, ignore_errors=True)
            removed += 1
    return removed


async def _serve_pages(images: Path, work: Path, sandbox_id: str, pages: lazy.LazyPages | None) -> bool:
    """Have the page server serve a lazy restore (kept in ``pages.sources``, whose owner stops it); False: eager."""
    if pages is None:
        return False
    await on_thread(_fresh_dir, work)
    await pages.serve(sandbox_id, images, work)
    return True


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700)


def mount_disk(
    config: EngineConfig, store: LayerStore, sandbox_id: str, layers: tuple[str, ...], host_dirs: tuple[str, ...],
    limits: Limits, quota: bool, base: int | None = None, users: idmap.Namespaces | None = None, *,
    xino: bool = False, named: bool = True,
) -> Paths:
    """The sandbox's disk, its root over ``layers``, and the empty channel dir; with ``base``, the
    layers and the disk idmapped into the range at ``base`` (``users`` has its namespace). ``named``:
    /etc/hostname says the sandbox's id (else the caller writes it, ``name_host``)."""
    where = paths(config, sandbox_id)
    where.root.mkdir(parents=True)
    if quota:
        # The subvolume's quota caps writes at disk_mb; its page cache is reclaimable memory.
        mounts.mount_tmpfs(where.root, BUNDLE_MB)
        inherited = inherit_layer(store, layers, lambda layer: disk.make_from(config.state_dir, sandbox_id, layer,
                                                                               limits.disk_mb))
        scratch = inherited or disk.make(config.state_dir, sandbox_id, limits.disk_mb)
    else:
        # A tmpfs caps writes at disk_mb too, but charges them to the memory cgroup as memory.
        mounts.mount_tmpfs(where.root, limits.disk_mb)
        scratch, inherited = where.root, None
    # volatile: a disk lives only as long as its sandbox, and unmounting a synced overlay
    # would commit the whole btrfs (~2.5 ms, and a wait on every other sandbox's writes).
    os.chmod(where.root, 0o700)  # the sandbox's files and its bundle are no other host user's business
    remap = None
    if base is not None:
        assert users is not None
        os.chown(where.root, base, base)  # its own root passes through to its rootfs
        remap = _idmapper(where.root / "mapped", users.fd(base))
        scratch = remap(scratch)
    with idmap.as_mapped_root(base):  # the overlay's dirs and copy-ups: uid 0 on disk, root inside
        mount_trusted(store, layers, host_dirs, where.rootfs, scratch, trust.load(config.extra_ca_file, config.state_dir),
                      volatile=quota, remap=remap, inherited=inherited, xino=xino)
        if named:
            name_host(where.rootfs, sandbox_id)
    where.channel.mkdir(mode=0o700)
    if base is not None:
        os.chown(where.channel, base, base)  # the agent, root of the namespace, binds its socket there
    return where


def _remove_dir(path: Path) -> None:
    """Remove a directory and what it holds: one rmdir when it is empty, as it usually is by now."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def _idmapper(under: Path, userns: int) -> Callable[[Path], Path]:
    """Gives each directory it is handed an idmapped clone under ``under`` (on the sandbox's root
    tmpfs, so the root's lazy unmount takes them all)."""
    under.mkdir()
    serial = itertools.count()

    def remap(path: Path) -> Path:
        clone = under / str(next(serial))
        clone.mkdir()
        idmap.idmapped_bind(path, clone, userns)
        return clone

    return remap


def name_host(rootfs: Path, sandbox_id: str) -> None:
    """Make /etc/hostname say the sandbox's id, as ``hostname`` does: images and snapshots
    carry a placeholder or their parent's id. Written through safefs: the image owns /etc."""
    root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        safefs.write(root, "/etc/hostname", f"{sandbox_id}\n".encode())
    except FanfoldError:
        pass  # an /etc/hostname that is a directory or a device: the kernel's name still holds
    finally:
        os.close(root)


def set_immutable(directory: Path, on: bool) -> None:
    """Lock the channel dir once the agent's socket is in it: root in the sandbox lacks
    CAP_LINUX_IMMUTABLE, so not even ``rm -rf /`` can cut the sandbox off from its host."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        flags[0] = flags[0] | FS_IMMUTABLE_FL if on else flags[0] & ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags)
    finally:
        os.close(fd)


def criu_mounts(host_dirs: tuple[str, ...]) -> Mounts:
    return Mounts(agent=AGENT_PATH, channel=CHANNEL_PATH, host_dirs=host_dirs)


def channel_binds(agent: Path, where: Paths) -> list[Bind]:
    """The agent binary and the channel dir, as every sandbox of this host sees them."""
    return [Bind(str(agent), AGENT_PATH), Bind(str(where.channel), CHANNEL_PATH, readonly=False)]


def in_sandbox_cgroup(pid: int, cgroup: str) -> bool:
    """True when ``pid`` still is the sandbox's process (not a recycled pid)."""
    try:
        lines = procs.read_small(f"/proc/{pid}/cgroup").decode(errors="replace").splitlines()
    except OSError:
        return False
    return any(line.endswith(cgroup) for line in lines)


def kill_init(config: EngineConfig, sandbox_id: str, pid: int | None) -> str:
    """SIGKILL the sandbox's PID 1, which ends its whole pid namespace, if ``pid`` still is it (a
    recycled pid is in another cgroup); returns the sandbox's cgroup."""
    cgroup = f"/{config.cgroup_parent}/{sandbox_id}"
    if pid and in_sandbox_cgroup(pid, cgroup):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return cgroup


async def release(config: EngineConfig, runtime: Runtime, sandbox_id: str, pid: int | None = None) -> None:
    """Release everything a sandbox may hold, in reverse order; safe on partial state."""
    where = paths(config, sandbox_id)
    # Ending PID 1, unmounts, cgroup rmdirs and rmtree are slow syscalls: on a thread, in one hop
    # when its processes are gone, while the loop serves execs meanwhile.
    if await on_thread(_end_and_release, config, runtime.forget, sandbox_id, where, pid):
        return
    await runtime.delete(sandbox_id)  # processes of it may be left: the runtime ends them
    await on_thread(release_host, config, sandbox_id, where)


def _end_and_release(config: EngineConfig, forget: Callable[[str], None], sandbox_id: str, where: Paths,
                     pid: int | None) -> bool:
    """Kill PID 1 and reap it; once that has ended every process of the sandbox, release the rest too
    (the runtime's state with ``forget``) and return True; else release nothing and return False."""
    # Killing PID 1 ourselves ends the whole pid namespace in well under a millisecond;
    # the runtime's own forced delete polls for the exit and takes ~10 ms longer.
    cgroup = kill_init(config, sandbox_id, pid)
    # PID 1 gone means its whole pid namespace is: the runtime has nothing left to kill.
    if not pid or not (setup.reap_blocking(pid) or not in_sandbox_cgroup(pid, cgroup)):
        return False
    release_host(config, sandbox_id, where, forget)
    return True


def release_host(config: EngineConfig, sandbox_id: str, where: Paths,
                 forget: Callable[[str], None] | None = None) -> None:
    """Release what a sandbox holds on the host (blocking); ``forget`` first drops the runtime's state
    of a sandbox whose processes are all gone."""
    if forget is not None:
        forget(sandbox_id)
    # The mounts a sandbox has are the ones mount_disk made, all on its root: a lazy
    # unmount takes the whole tree (the disk of sandboxes made before the disk moved onto
    # the root is a dir of its own). Only when one is still a mount point afterwards is the
    # kernel's mount table read: it grows with every live sandbox.
    points = (where.rootfs, where.root / "disk", where.root)
    for point in points:
        mounts.umount(point)
    stuck = False
    if any(mounts.is_mount_point(point) for point in points):
        for point in mounts.mounts_under(where.root):
            mounts.umount(point)
        stuck = bool(mounts.mounts_under(where.root))
    cgroups.remove(config.cgroup_parent, sandbox_id)
    if where.channel.is_dir():
        set_immutable(where.channel, False)
        where.socket.unlink(missing_ok=True)
        _remove_dir(where.channel)
    where.channel.with_name(f"{sandbox_id}.sock").unlink(missing_ok=True)  # where older versions put the socket
    if stuck:  # never recurse into a live mount
        raise InfrastructureError(f"sandbox {sandbox_id} still has mounts under {where.root}")
    _remove_dir(where.root)  # the mount point of its tmpfs, empty once that is unmounted
    mounts.umount(where.subvolume)  # one stacked on it would make deleting it fail (EBUSY)
    disk.remove(config.state_dir, sandbox_id)  # after the overlay on it is gone
    shutil.rmtree(where.lazy, ignore_errors=True)
    idmap.release(sandbox_id)  # last: no process or file of the sandbox is left to use its range
