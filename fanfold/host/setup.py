"""Fixes to the host that sandboxes need and that can be made safely at run time."""

from __future__ import annotations

import os
from pathlib import Path

from . import cgroups, mounts


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
        cgroups.v1_roots.cache_clear()
    return moved


def is_root() -> bool:
    return os.geteuid() == 0


def can_protect_from_oom() -> bool:
    """Lowering a process's oom_score_adj below ours needs CAP_SYS_RESOURCE (absent in some containers)."""
    with open("/proc/self/status") as handle:
        caps = next(line for line in handle if line.startswith("CapEff:")).split()[1]
    return bool(int(caps, 16) & (1 << 24))


def become_subreaper() -> None:
    """Adopt orphaned descendants (a detached runtime's PID 1s) so we can reap them, not init."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def reap(pid: int | None) -> None:
    """Collect a dead child's exit status so it leaves no zombie; not our child is fine."""
    if not pid:
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
