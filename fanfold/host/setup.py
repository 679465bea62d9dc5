"""Fixes to the host that sandboxes need and that can be made safely at run time."""

from __future__ import annotations

import asyncio
import ctypes
import os
import select
from functools import lru_cache
from pathlib import Path

from . import cgroups, mounts, procs, spawn


def unified_controllers() -> list[str]:
    """Controllers attached to a cgroup2 hierarchy that also has v1 hierarchies (hybrid mode)."""
    if cgroups.is_v2_only():
        return []
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        points = [line.split()[4] for line in handle if " - cgroup2 " in line]
    found: list[str] = []
    for point in points:
        try:
            found += Path(point, "cgroup.controllers").read_text().split()
        except OSError:
            pass
    return found


def fix_hybrid_cgroups() -> list[str]:
    """crun refuses hybrid mode while a controller is left on cgroup2: give each its own v1 mount.

    Returns the controllers moved. A controller moves to v1 only while no cgroup2 group uses it,
    which holds on a host whose cgroup2 tree is only a compatibility mount.
    """
    moved = []
    for controller in unified_controllers():
        target = Path("/sys/fs/cgroup") / controller
        try:
            target.mkdir(exist_ok=True)
            mounts.mount("cgroup", target, "cgroup", 0, controller)
            moved.append(controller)
        except OSError:
            continue
    if moved:
        cgroups.forget_roots()
    return moved


def favor_dynamic_cgroups() -> bool:
    """Remount cgroup2 with ``favordynmods`` (Linux 6.0+), once per host; True when it is on.

    Moving a task into a cgroup takes the kernel's global threadgroup lock for writing, which by
    default waits for an RCU grace period: ~10 ms of each sandbox's create, whichever hierarchy
    the runtime attaches it to. With the option (global once set on any hierarchy) the lock stays
    in its slow-reader mode, attaching takes ~0.2 ms, and forks and exits cost an atomic more.
    """
    targets = cgroups.v2_roots()
    if any("favordynmods" in mount_options(target)[1] for target in targets):
        return True
    for target in targets:
        # A remount sets the whole flag set: keep the mount's flags and the hierarchy's options.
        per_mount, options = mount_options(target)
        flags = mounts.MS_REMOUNT
        for name in per_mount:
            flags |= MOUNT_FLAGS.get(name, 0)
        data = ",".join([o for o in options if o not in ("rw", "ro")] + ["favordynmods"])
        try:
            mounts.mount("cgroup2", target, "cgroup2", flags, data)
            return True
        except OSError:
            continue  # an older kernel, or not ours to remount
    return False


MOUNT_FLAGS = {"ro": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048,
               "relatime": 1 << 21, "strictatime": 1 << 24}
"""Per-mount options as mountinfo shows them, and their MS_ flags."""


def mount_options(target: Path) -> tuple[list[str], list[str]]:
    """The per-mount options and the superblock options of what is mounted at ``target``."""
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        for line in handle:
            pre, _, post = line.partition(" - ")
            fields = pre.split()
            if fields[4] == str(target):
                return fields[5].split(","), post.split()[2].split(",")
    return [], []


def is_root() -> bool:
    return os.geteuid() == 0


@lru_cache(maxsize=1)
def can_protect_from_oom() -> bool:
    """Lowering a process's oom_score_adj below ours needs CAP_SYS_RESOURCE (absent in some containers)."""
    with open("/proc/self/status") as handle:
        caps = next(line for line in handle if line.startswith("CapEff:")).split()[1]
    return bool(int(caps, 16) & (1 << 24))


def become_subreaper() -> None:
    """Adopt orphaned descendants (a detached runtime's PID 1s) so we can reap them, not init."""
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _exit_fd(pid: int) -> int | bool:
    """A pidfd to wait on for ``pid``'s exit; True when it was already collected here, False when
    it is no child of ours or gone."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return True
        return os.pidfd_open(pid)
    except (ChildProcessError, ProcessLookupError):
        return False


async def reap(pid: int | None, timeout: float = 5.0) -> bool:
    """Wait for a dead child and collect its status so it leaves no zombie; not our child is fine.
    True when this collected it: it has exited, and so has every process of a pid namespace it was PID 1 of."""
    pidfd = _exit_fd(pid) if pid else False
    if isinstance(pidfd, bool):
        return pidfd
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    try:
        async with asyncio.timeout(timeout):
            await exited
        return bool(os.waitpid(pid, os.WNOHANG)[0])
    except (TimeoutError, ChildProcessError):
        return False
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


def reap_blocking(pid: int, timeout: float = 5.0) -> bool:
    """``reap`` for a thread: waits (up to ``timeout`` s) by blocking it, not the loop."""
    pidfd = _exit_fd(pid)
    if isinstance(pidfd, bool):
        return pidfd
    try:
        exited = select.poll()
        exited.register(pidfd, select.POLLIN)
        exited.poll(timeout * 1000)
        return bool(os.waitpid(pid, os.WNOHANG)[0])
    except ChildProcessError:
        return False
    finally:
        os.close(pidfd)


RUNTIME_NAMES = {"crun", "runc", "agent", "fanfold-agent"}
"""Process names (comm) of the runtime's processes; a runtime run from a sealed copy adds its own."""


def reap_orphans(names: set[str] | frozenset[str] = RUNTIME_NAMES) -> int:
    """Reap dead runtime processes reparented to us as subreaper (crun's detach helper, agents).

    Only zombies with these names are collected, so an asyncio or subprocess watcher
    waiting on a child of its own never loses that child's status.
    """
    reaped = 0
    for task in os.listdir("/proc/self/task"):  # a reaper pass runs this once a second: no pathlib
        try:
            pids = procs.read_small(f"/proc/self/task/{task}/children").split()
        except OSError:
            continue
        for pid in pids:
            if int(pid) in spawn.WAITING or spawn.spawning():
                continue
            try:
                head, _, rest = procs.read_small(f"/proc/{int(pid)}/stat").decode(errors="replace").rpartition(")")
            except OSError:
                continue
            if rest.split()[0] == "Z" and head.partition("(")[2] in names:
                try:
                    os.waitpid(int(pid), os.WNOHANG)
                    reaped += 1
                except ChildProcessError:
                    pass
    return reaped
