"""Sandbox disks on a real filesystem: a btrfs at ``<state>/disk`` with quota groups, one
subvolume per sandbox holding its overlay's upper and work dirs, capped at its ``disk_mb``.

Writes land in page cache that the kernel can write back and reclaim, so a sandbox's memory
limit counts only its memory (a tmpfs disk counted its files as memory too). A write past
the cap fails with EDQUOT ("Disk quota exceeded").

Why btrfs: it needs no quota support beyond its own (kernels built without
CONFIG_XFS_QUOTA or CONFIG_QFMT_V2 refuse XFS and ext4 project quotas), and a subvolume is
made, capped and deleted with one ioctl each (~0.1 ms); deleting one with files in it
returns at once and the filesystem frees its blocks and quota group in the background.

When the state dir's filesystem is not such a btrfs, ``ensure`` makes a sparse file
``<state>/disk.img`` (the state filesystem's size unless ``FANFOLD_DISK_SIZE_GB`` says
otherwise), formats it, and mounts it on a loop device. Each engine holds it (a shared lock)
while it runs; the last one to close unmounts it when no sandbox has a disk on it any more,
as with the cgroup parent, so a state dir that is thrown away leaves no mount behind.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import struct
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import HostNotReady
from . import mounts

_IOC_SUBVOL_CREATE = 0x5000940E  # _IOW(0x94, 14, struct btrfs_ioctl_vol_args)
_IOC_SNAP_DESTROY = 0x5000940F  # _IOW(0x94, 15, struct btrfs_ioctl_vol_args)
_IOC_SNAP_CREATE_V2 = 0x50009417  # _IOW(0x94, 23, struct btrfs_ioctl_vol_args_v2)
_IOC_QUOTA_CTL = 0xC0109428  # _IOWR(0x94, 40, struct btrfs_ioctl_quota_ctl_args)
_IOC_QGROUP_LIMIT = 0x8030942B  # _IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args)
_QUOTA_CTL_ENABLE = 1
_LIMIT_MAX_RFER = 1
_LIMIT_MAX_EXCL = 2
_LIMIT_CLEAR = (1 << 64) - 1  # a limit of this value removes it
_libc = ctypes.CDLL(None, use_errno=True)
_SUBVOLUME_INO = 256  # every subvolume's root directory has this inode number
LAYERS = "layers"


def disk_dir(state_dir: Path) -> Path:
    """Where the filesystem holding the sandboxes' disks is mounted."""
    return state_dir / "disk"


def sandbox_disk(state_dir: Path, sandbox_id: str) -> Path:
    """One sandbox's subvolume (it may not exist)."""
    return disk_dir(state_dir) / sandbox_id


def layers_dir(state_dir: Path) -> Path:
    """Where snapshots' layers taken by reference live: a subvolume each, ``<state>/disk/layers/<name>``."""
    return disk_dir(state_dir) / LAYERS


def ready(state_dir: Path) -> bool:
    """True when a btrfs is mounted at ``<state>/disk``."""
    return _fstype(disk_dir(state_dir)) == "btrfs"


class Hold:
    """One engine's hold on the mounted disk (a shared lock on ``disk.users``): ``close``
    unmounts it when this was the last engine on the state dir and no sandbox has a
    subvolume left."""

    def __init__(self, state_dir: Path, users: int) -> None:
        self.state_dir, self._users = state_dir, users

    def close(self) -> None:
        if self._users < 0:
            return
        try:
            with _locked(self.state_dir / "disk.lock"):  # no engine mounts or joins meanwhile
                fcntl.flock(self._users, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if not ids(self.state_dir):
                    mounts.umount(disk_dir(self.state_dir))  # the loop device goes with it (autoclear)
        except BlockingIOError:
            pass  # another engine holds it
        finally:
            os.close(self._users)
            self._users = -1


def ensure(state_dir: Path, size_bytes: int | None = None) -> Hold:
    """Make sure a btrfs with quotas is mounted at ``<state>/disk``, and hold it until ``close``.

    Idempotent, and serialised across processes by a lock, so engines starting at once
    mount it once. HostNotReady says what is missing when it cannot be made.
    """
    target = disk_dir(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    users = os.open(state_dir / "disk.users", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        with _locked(state_dir / "disk.lock"):
            fstype = _fstype(target)
            if fstype is None:
                _mount_image(state_dir, target, size_bytes)
            elif fstype != "btrfs":
                raise HostNotReady(f"{target} is a {fstype} mount, not btrfs: unmount it, or mount a btrfs there")
            _enable_quota(target)
            # At once: a closing engine takes this exclusively only while it holds disk.lock.
            fcntl.flock(users, fcntl.LOCK_SH)
    except BaseException:
        os.close(users)
        raise
    return Hold(state_dir, users)


def make(state_dir: Path, sandbox_id: str, disk_mb: int) -> Path:
    """A new subvolume for ``sandbox_id`` whose data and metadata may take ``disk_mb`` MiB."""
    parent = os.open(disk_dir(state_dir), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(parent, _IOC_SUBVOL_CREATE, _vol_args(sandbox_id))
    finally:
        os.close(parent)
    path = sandbox_disk(state_dir, sandbox_id)
    set_limit(path, _LIMIT_MAX_RFER, disk_mb << 20, 0)
    return path


def make_from(state_dir: Path, sandbox_id: str, layer: Path, disk_mb: int) -> Path:
    """A subvolume for ``sandbox_id`` that is a writable snapshot of ``layer`` (a snapshot's layer
    taken by reference), capped at ``disk_mb`` MiB of blocks it does not share: what it inherits
    costs it nothing until it rewrites it. The snapshot carries its source's limit, which goes."""
    path = sandbox_disk(state_dir, sandbox_id)
    snapshot(layer, path)
    set_limit(path, _LIMIT_MAX_RFER | _LIMIT_MAX_EXCL, _LIMIT_CLEAR, disk_mb << 20)
    return path


def sync(path: Path) -> None:
    """Write out the dirty pages of the filesystem ``path`` is on (syncfs(2): Python 3.11 has no binding)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def set_limit(path: Path, flags: int, max_rfer: int, max_excl: int) -> None:
    """Set the quota group limits of the subvolume at ``path`` (``flags``: which of the two apply)."""
    subvol = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # struct btrfs_qgroup_limit_args: qgroupid (0: the fd's subvolume), then btrfs_qgroup_limit
        # (flags, max_rfer, max_excl, rsv_rfer, rsv_excl)
        limit = struct.pack("=QQQQQQ", 0, flags, max_rfer, max_excl, 0, 0)
        fcntl.ioctl(subvol, _IOC_QGROUP_LIMIT, bytearray(limit))
    finally:
        os.close(subvol)


def remove(state_dir: Path, sandbox_id: str) -> None:
    """Delete a sandbox's subvolume, files and all; its quota group goes once the filesystem
    has freed its blocks (seconds later). A missing one is not an error."""
    remove_at(sandbox_disk(state_dir, sandbox_id))


def remove_at(path: Path) -> None:
    """Delete the subvolume at ``path`` (a plain dir there, made by hand, goes with rmtree); a missing
    one is not an error."""
    try:
        if not is_subvolume(path):
            shutil.rmtree(path, ignore_errors=True)  # a plain dir (made by hand): not ours to keep
            return
    except FileNotFoundError:
        return
    delete(path)


def is_subvolume(path: Path) -> bool:
    """True when ``path`` is the root of a btrfs subvolume (FileNotFoundError when it is missing)."""
    return os.lstat(path).st_ino == _SUBVOLUME_INO


def snapshot(source: Path, target: Path) -> None:
    """A writable snapshot of subvolume ``source`` at ``target`` (on the same btrfs): its tree as it
    is now, sharing every block, in one ioctl whose cost does not grow with what the tree holds (the
    filesystem writes out ``source``'s dirty pages first, and quotas account the new subvolume)."""
    source_fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parent = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # struct btrfs_ioctl_vol_args_v2: fd, transid, flags, 32 bytes unused, name[4040]
            args = struct.pack("=qQQ32x4040s", source_fd, 0, 0, target.name.encode())
            fcntl.ioctl(parent, _IOC_SNAP_CREATE_V2, bytearray(args))
        finally:
            os.close(parent)
    finally:
        os.close(source_fd)


def delete(path: Path) -> None:
    """Delete subvolume ``path``, files and all; the filesystem frees its blocks
    in the background. A missing one is not an error."""
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.ioctl(parent, _IOC_SNAP_DESTROY, _vol_args(path.name))
    except FileNotFoundError:
        pass
    finally:
        os.close(parent)


def ids(state_dir: Path) -> set[str]:
    """Sandbox ids that have a subvolume."""
    if not ready(state_dir):
        return set()
    return {p.name for p in disk_dir(state_dir).iterdir() if p.name.startswith("sb-")}


def default_size(state_dir: Path) -> int:
    """The image's size unless the config gives one: the state filesystem's (it is sparse:
    it takes only what sandboxes write, and what they free goes back with discard)."""
    stat = os.statvfs(state_dir)
    return stat.f_blocks * stat.f_frsize


def _mount_image(state_dir: Path, target: Path, size_bytes: int | None) -> None:
    image = state_dir / "disk.img"
    mkfs = shutil.which("mkfs.btrfs")
    if mkfs is None:
        raise HostNotReady("mkfs.btrfs is missing, needed for sandbox disks: apt-get install btrfs-progs")
    if not image.exists():
        staged = image.with_name(f".disk.img.{os.getpid()}")
        try:
            with open(staged, "wb") as handle:
                handle.truncate(size_bytes or default_size(state_dir))
            # single profiles: the image is scratch space, mirrored metadata would only double writes.
            _check([mkfs, "-q", "-f", "-K", "-m", "single", "-d", "single", "-L", "fanfold", str(staged)], "formatting")
            staged.rename(image)
        finally:
            staged.unlink(missing_ok=True)
    target.mkdir(exist_ok=True)
    # mount(8) sets the loop device up and frees it again on unmount (autoclear).
    _check(["mount", "-t", "btrfs", "-o", "loop,nodev,nosuid,noatime,discard=async", str(image), str(target)], "mounting")


def _enable_quota(target: Path) -> None:
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _IOC_QUOTA_CTL, bytearray(struct.pack("=QQ", _QUOTA_CTL_ENABLE, 0)))  # no-op when on
    except OSError as err:
        raise HostNotReady(f"enabling btrfs quotas on {target} failed: {err}") from None
    finally:
        os.close(fd)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _check(argv: list[str], what: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise HostNotReady(f"{what} the sandbox disk failed: {err}") from None
    if done.returncode != 0:
        raise HostNotReady(f"{what} the sandbox disk failed ({' '.join(argv)}): {done.stderr.strip()[-400:]}")


def _vol_args(name: str) -> bytearray:
    # A bytearray, not bytes: fcntl.ioctl copies at most 1024 bytes of an immutable argument.
    return bytearray(struct.pack("=q4088s", 0, name.encode()))


def _fstype(point: Path) -> str | None:
    """The type of the filesystem mounted exactly at ``point``, or None."""
    if not mounts.is_mount_point(point):
        return None
    want = str(point)
    found = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            fields = line.split()
            if fields[4] == want:
                found = fields[fields.index("-") + 1]  # the last mount on a point is the one seen
    return found
