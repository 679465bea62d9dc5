"""mount(2) and umount2(2) through libc, and the kernel's view of what is mounted."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_BIND = 4096
MS_REMOUNT = 32
MNT_DETACH = 2
# Layers stay portable as lower dirs of later mounts only without redirects and an index.
OVERLAY_OPTIONS = "redirect_dir=off,index=off,xino=off,metacopy=off"


def mount(source: str, target: str | Path, fstype: str, flags: int = 0, data: str = "") -> None:
    rc = _libc.mount(source.encode(), str(target).encode(), fstype.encode(), flags, data.encode())
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target} ({data[:200]}): {os.strerror(err)}")


def umount(target: str | Path) -> None:
    """Detach a mount; a target that is not mounted is not an error."""
    rc = _libc.umount2(str(target).encode(), MNT_DETACH)
    if rc != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: gone already
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


def mount_tmpfs(target: Path, size_mb: int) -> None:
    mount("fanfold", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode=0755")


def mount_overlay(target: Path, lowers: list[Path], upper: Path, work: Path, *, volatile: bool = False,
                  xino: bool = False) -> None:
    """Overlay ``lowers`` (topmost first) under a writable ``upper``; with ``volatile`` no
    sync reaches the upper's filesystem (for uppers thrown away with the mount). ``xino``: every
    file's inode number and device as stat gives them are the ones its inotify watches carry, which
    CRIU needs to find a watched file by its path (``runtime.systemd``: systemd and dbus watch files)."""
    lower = ":".join(str(p) for p in lowers)
    # nosuid/nodev: a setuid binary or device node made inside must be inert when reached from the host.
    flags = MS_NOSUID | MS_NODEV
    extra = ",volatile" if volatile else ""
    options = OVERLAY_OPTIONS.replace("xino=off", "xino=on") if xino else OVERLAY_OPTIONS
    mount("overlay", target, "overlay", flags, f"lowerdir={lower},upperdir={upper},workdir={work},{options}{extra}")


def is_mount_point(path: Path) -> bool:
    """True when something is mounted on ``path`` (an existing directory), by its device
    differing from its parent's: every mount fanfold makes (tmpfs, overlay) has a device of its own."""
    try:
        return os.stat(path).st_dev != os.stat(path.parent).st_dev
    except FileNotFoundError:
        return False


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")


def mounts_under(prefix: Path) -> list[Path]:
    """Mount points at or below ``prefix``, deepest first (the order to unmount them)."""
    root = str(prefix).rstrip("/")
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            point = line.split(maxsplit=5)[4]
            if "\\" in point:  # only names with spaces, tabs, newlines or backslashes are escaped
                point = _unescape(point)
            if point == root or point.startswith(root + "/"):
                found.append(Path(point))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)
