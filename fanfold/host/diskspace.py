"""How much the sandboxes' disks (``host.disk``: a btrfs subvolume each, capped by a quota group)
can really still take, what each has taken against its cap, and tightening or restoring a cap.

The btrfs is often a sparse file on the state filesystem (``disk.img``): it believes it has the
size it was made with, but every block a sandbox writes takes one from the state filesystem, where
the engine's database lives too. Its real room is the lesser of the two filesystems' free space,
and a btrfs that writes past the state filesystem's end loses its writes (I/O errors: the kernel
forces it read-only, and every sandbox on it fails at once).

Reading the room is two ``statvfs`` calls (microseconds). Reading each sandbox's usage searches the
filesystem's quota and root trees (``BTRFS_IOC_TREE_SEARCH``: a few ioctls per thousand subvolumes);
the counters move at each transaction commit, so ``usage`` commits one first when asked.
"""

from __future__ import annotations

import fcntl
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from . import disk

_IOC_TREE_SEARCH = 0xD0009411  # _IOWR(0x94, 17, struct btrfs_ioctl_search_args), 4096 bytes
_KEY = struct.Struct("=7Q4I4Q")  # struct btrfs_ioctl_search_key
_HEADER = struct.Struct("=3Q2I")  # struct btrfs_ioctl_search_header: transid, objectid, offset, type, len
_ROOT_TREE, _QUOTA_TREE, _FS_TREE = 1, 8, 5
_ROOT_REF, _QGROUP_INFO, _QGROUP_LIMIT = 156, 242, 244
_TOP_DIR = 256  # the inode of the top-level subvolume's root dir, where sandboxes' subvolumes are
_LIMIT_MAX_RFER, _LIMIT_MAX_EXCL = 1, 2
_U64 = (1 << 64) - 1
_Key = tuple[int, int, int]  # a btrfs item's key: objectid, type, offset


@dataclass(frozen=True)
class Room:
    """Bytes the sandboxes' disks may still take, and the filesystem that bounds it."""

    free: int
    bound: str


@dataclass(frozen=True)
class Use:
    """One sandbox's disk as its quota group counts it."""

    used: int
    """Bytes counted against its cap (referenced, or exclusive for a disk that inherits a layer)."""
    limit: int
    """Its cap now (bytes; 0: none)."""
    exclusive: bool
    """Whether the cap is on exclusive bytes (``disk.make_from``) rather than referenced ones."""


def room(state_dir: Path, reserve: int) -> Room:
    """What the disks may still take, ``reserve`` bytes kept back: the btrfs's free space, and when
    the btrfs is a file on the state filesystem, no more than that filesystem's free space."""
    btrfs = os.statvfs(disk.disk_dir(state_dir))
    free, bound = btrfs.f_bavail * btrfs.f_frsize, str(disk.disk_dir(state_dir))
    if (state_dir / "disk.img").exists():
        host = os.statvfs(state_dir)
        if host.f_bavail * host.f_frsize < free:
            free, bound = host.f_bavail * host.f_frsize, str(state_dir)
    return Room(max(0, free - reserve), bound)


def usage(state_dir: Path, *, commit: bool = True) -> dict[str, Use]:
    """Each sandbox disk's use and cap (sandbox id to ``Use``); ``commit`` first brings the counters
    up to date with the writes so far."""
    top = disk.disk_dir(state_dir)
    if commit:
        disk.sync(top)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        names = {}
        for _, offset, data in _search(fd, _ROOT_TREE, (_FS_TREE, _ROOT_REF, 0), (_FS_TREE, _ROOT_REF, _U64)):
            dirid, _, name_len = struct.unpack_from("=QQH", data)
            name = data[18:18 + name_len].decode(errors="replace")
            if dirid == _TOP_DIR and name.startswith("sb-"):
                names[offset] = name
        infos: dict[int, tuple[int, int]] = {}
        limits: dict[int, tuple[int, int, int]] = {}
        for kind, offset, data in _search(fd, _QUOTA_TREE, (0, _QGROUP_INFO, 0), (0, _QGROUP_LIMIT, _U64)):
            if offset >> 48:
                continue  # a higher-level group, not a subvolume's
            if kind == _QGROUP_INFO:
                _, rfer, _, excl, _ = struct.unpack_from("=5Q", data)
                infos[offset] = (rfer, excl)
            elif kind == _QGROUP_LIMIT:
                flags, max_rfer, max_excl, _, _ = struct.unpack_from("=5Q", data)
                limits[offset] = (flags, max_rfer, max_excl)
    finally:
        os.close(fd)
    uses = {}
    for subvolume, name in names.items():
        rfer, excl = infos.get(subvolume, (0, 0))
        flags, max_rfer, max_excl = limits.get(subvolume, (0, 0, 0))
        exclusive = bool(flags & _LIMIT_MAX_EXCL)
        if exclusive:
            uses[name] = Use(excl, max_excl, True)
        else:
            uses[name] = Use(rfer, max_rfer if flags & _LIMIT_MAX_RFER else 0, False)
    return uses


def cap(state_dir: Path, sandbox_id: str, limit: int, *, exclusive: bool) -> None:
    """Set a sandbox disk's cap to ``limit`` bytes, of the kind it has (FileNotFoundError: it is gone)."""
    path = disk.sandbox_disk(state_dir, sandbox_id)
    if exclusive:
        disk.set_limit(path, _LIMIT_MAX_EXCL | _LIMIT_MAX_RFER, _U64, limit)
    else:
        disk.set_limit(path, _LIMIT_MAX_RFER, limit, 0)


def _search(fd: int, tree: int, low: _Key, high: _Key) -> Iterator[tuple[int, int, bytes]]:
    """(type, offset, data) of every item of ``tree`` whose key is from ``low`` to ``high``."""
    objectid, kind, offset = low
    while True:
        key = _KEY.pack(tree, objectid, high[0], offset, high[2], 0, _U64, kind, high[1], 4096, 0, 0, 0, 0, 0)
        args = bytearray(key.ljust(4096, b"\0"))
        fcntl.ioctl(fd, _IOC_TREE_SEARCH, args)
        found = _KEY.unpack_from(args)[9]  # nr_items: how many the kernel wrote
        if not found:
            return
        at = _KEY.size
        for _ in range(found):
            _, objectid, offset, kind, length = _HEADER.unpack_from(args, at)
            at += _HEADER.size
            yield kind, offset, bytes(args[at:at + length])
            at += length
        if offset < _U64:  # the next search starts just past the last key found
            offset += 1
        elif kind < 255:
            kind, offset = kind + 1, 0
        else:
            objectid, kind, offset = objectid + 1, 0, 0
        if (objectid, kind, offset) > high:
            return
