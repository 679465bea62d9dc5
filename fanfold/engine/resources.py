"""Making and releasing the host resources of one sandbox: its disk, root, socket and container."""

from __future__ import annotations

import os
import signal
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from ..config import EngineConfig
from ..errors import InfrastructureError
from ..host import cgroups, mounts, setup
from ..images import Image, LayerStore
from ..images.rootfs import mount_rootfs
from ..models import Limits
from ..runtime import Bind, ContainerSpec, Runtime

AGENT_PATH = "/.fanfold/agent"


@dataclass(frozen=True)
class Paths:
    """Where one sandbox's pieces live on the host."""

    root: Path
    socket: Path

    @property
    def disk(self) -> Path:
        return self.root / "disk"

    @property
    def rootfs(self) -> Path:
        return self.root / "rootfs"

    @property
    def bundle(self) -> Path:
        return self.root / "bundle"


def paths(config: EngineConfig, sandbox_id: str) -> Paths:
    return Paths(config.state_dir / "sandboxes" / sandbox_id, config.run_dir / f"{sandbox_id}.sock")


async def provision(
    config: EngineConfig, store: LayerStore, runtime: Runtime, agent: Path,
    sandbox_id: str, image: Image, limits: Limits, env: list[str],
) -> int:
    """Mount the sandbox's disk and root, and start its agent; return the agent's host pid.

    The caller owns cleanup: on any failure it calls ``release``, which undoes whatever exists.
    """
    where = paths(config, sandbox_id)
    where.disk.mkdir(parents=True)
    # A tmpfs per sandbox caps its writes at disk_mb, charges them to its memory cgroup,
    # and makes destroy a single unmount.
    mounts.mount_tmpfs(where.disk, limits.disk_mb)
    mount_rootfs(store, image.layers, image.host_dirs, where.rootfs, where.disk)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(where.socket))
        listener.listen(512)
        args = [AGENT_PATH]
        for name, cmd, mode in image.services:
            args += [f"--{mode}", name, cmd]
        spec = ContainerSpec(
            id=sandbox_id, rootfs=where.rootfs, args=args, env=env, cwd="/", hostname=sandbox_id,
            limits=limits, binds=[Bind(str(agent), AGENT_PATH)],
            cgroup_path=f"/{config.cgroup_parent}/{sandbox_id}",
            oom_score_adj=-1000 if setup.can_protect_from_oom() else None,
        )
        return await runtime.start(spec, where.bundle, listener.fileno())
    finally:
        listener.close()  # the agent holds its own copy; once it dies, connects are refused


def _in_sandbox_cgroup(pid: int, cgroup: str) -> bool:
    """True when ``pid`` still is the sandbox's process (not a recycled pid)."""
    try:
        with open(f"/proc/{pid}/cgroup") as handle:
            return any(line.rstrip("\n").endswith(cgroup) for line in handle)
    except OSError:
        return False


async def release(config: EngineConfig, runtime: Runtime, sandbox_id: str, pid: int | None = None) -> None:
    """Release everything a sandbox may hold, in reverse order; safe on partial state."""
    where = paths(config, sandbox_id)
    # Killing PID 1 ourselves ends the whole pid namespace in well under a millisecond;
    # the runtime's own forced delete polls for the exit and takes ~10 ms longer.
    if pid and _in_sandbox_cgroup(pid, f"/{config.cgroup_parent}/{sandbox_id}"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    await setup.reap(pid)
    await runtime.delete(sandbox_id)
    for point in mounts.mounts_under(where.root):
        mounts.umount(point)
    cgroups.remove(config.cgroup_parent, sandbox_id)
    try:
        os.unlink(where.socket)
    except FileNotFoundError:
        pass
    if mounts.mounts_under(where.root):  # never recurse into a live mount
        raise InfrastructureError(f"sandbox {sandbox_id} still has mounts under {where.root}")
    shutil.rmtree(where.root, ignore_errors=True)
