"""Assemble an image's layers into a writable root filesystem with overlayfs."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any, Callable

from ..errors import HostNotReady
from ..host import disk, mounts
from .layers import LayerStore
from .trust import Trust


LOWER_PREFIX = ".lower-"
"""In a disk made from a layer taken by reference: its copy of each such layer it stands on."""


def _upper_name(host_dir: str) -> str:
    return "host" + host_dir.replace("/", "-")


def mount_rootfs(
    store: LayerStore, layers: tuple[str, ...], host_dirs: tuple[str, ...], target: Path, scratch: Path, *,
    volatile: bool = False, remap: Callable[[Path], Path] | None = None, inherited: Path | None = None,
    top: Path | None = None, xino: bool = False,
) -> None:
    """Mount ``layers`` (bottom first) at ``target``, writes going to dirs under ``scratch``
    (``volatile``: never synced, see ``mounts.mount_overlay``).

    Each of ``host_dirs`` (the ``host`` base's /usr) gets an overlay of its own whose
    lowest layer is the host's directory itself, so writes there stay in the sandbox.
    On failure everything mounted so far is unmounted again. ``remap`` gives the directory to
    use in place of each lower one (an idmapped clone of it, for a sandbox in a user namespace).
    ``inherited``: a disk made by ``inherit_layer``, whose copies of layers taken by reference
    (``.lower-<name>``) stand in for the layers themselves. ``top``: a directory laid over the layers
    read-only, not one of them (``trust.Trust.layer``). ``xino``: as ``mounts.mount_overlay`` takes it.
    """
    same: Callable[[Path], Path] = lambda path: path  # noqa: E731
    mapped = remap or same
    lowers = ([top] if top is not None else []) + [_lower(store, d, inherited) for d in reversed(layers)]
    try:
        (scratch / "upper").mkdir(exist_ok=True)
        (scratch / "work").mkdir(exist_ok=True)
        target.mkdir(exist_ok=True)
        mounts.mount_overlay(target, [mapped(p) for p in lowers], scratch / "upper", scratch / "work",
                             volatile=volatile, xino=xino)
        for host_dir in host_dirs:
            name = _upper_name(host_dir)
            (scratch / f"{name}-upper").mkdir(exist_ok=True)
            (scratch / f"{name}-work").mkdir(exist_ok=True)
            rel = host_dir.lstrip("/")
            dir_lowers = [p / rel for p in lowers if (p / rel).is_dir() and not (p / rel).is_symlink()]
            dir_lowers = [p for p in dir_lowers if any(p.iterdir())] + [Path(host_dir)]
            mounts.mount_overlay(target / rel, [mapped(p) for p in dir_lowers], scratch / f"{name}-upper",
                                 scratch / f"{name}-work", volatile=volatile, xino=xino)
    except BaseException as err:
        unmount_rootfs(target)
        if isinstance(err, OSError):
            _explain_missing(lowers, err)
        raise


def mount_trusted(
    store: LayerStore, layers: tuple[str, ...], host_dirs: tuple[str, ...], target: Path, scratch: Path,
    trust: Trust | None, **options: Any,
) -> None:
    """``mount_rootfs`` with ``trust``'s layer on top (the first time a stack is seen, the root is mounted
    once without it, to read the image's own CA bundle)."""
    if trust is None:
        return mount_rootfs(store, layers, host_dirs, target, scratch, **options)
    stack = (*layers, "", *host_dirs)
    top = trust.known(stack)
    if top is None:
        mount_rootfs(store, layers, host_dirs, target, scratch, **options)
        try:
            top = trust.layer(target, stack)
        finally:
            unmount_rootfs(target)
            # a volatile overlay's work dir refuses a second mount until its marker goes; nothing was written
            for work in [scratch / "work", *(scratch / f"{_upper_name(d)}-work" for d in host_dirs)]:
                shutil.rmtree(work, ignore_errors=True)
    mount_rootfs(store, layers, host_dirs, target, scratch, top=top, **options)


def _lower(store: LayerStore, layer: str, inherited: Path | None) -> Path:
    """Where layer ``layer`` is read from: the disk's own copy of it, else the store's.

    overlayfs takes layers on one filesystem as one inode space, but each btrfs subvolume numbers
    its inodes from the same start: a layer taken by reference must be read from the disk's own
    subvolume, where the inode numbers of what the sandbox writes continue past the layers'."""
    if inherited is not None and (own := inherited / f"{LOWER_PREFIX}{layer}").is_dir():
        return own
    return store.layer_path(layer)


def inherit_layer(store: LayerStore, layers: tuple[str, ...], make_from: Callable[[Path], Path]) -> Path | None:
    """When the top of ``layers`` was taken by reference: the sandbox's disk made by ``make_from``
    (a writable snapshot of that layer's subvolume), its copy of the layer moved aside to
    ``.lower-<name>``, beside those the layer itself inherited; None for any other stack."""
    if not layers or (subvolume := store.referenced_subvolume(layers[-1])) is None:
        return None
    scratch = make_from(subvolume)
    os.rename(scratch / "upper", scratch / f"{LOWER_PREFIX}{layers[-1]}")
    return scratch


def _explain_missing(lowers: list[Path], err: OSError) -> None:
    """A mount that failed because a layer is not there: a snapshot's layer taken by reference is a
    subvolume of the sandboxes' btrfs, there only while an engine with ``disk="btrfs"`` has it mounted."""
    missing = [path.name for path in lowers if not path.is_dir()]
    if missing:
        raise HostNotReady(
            f"layers {', '.join(missing[:3])} are missing ({err.strerror}): a snapshot's layer taken from a"
            " btrfs disk lives on it (<state>/disk/layers), mounted while an engine with disk='btrfs' runs"
        ) from None


def unmount_rootfs(target: Path) -> None:
    for point in mounts.mounts_under(target):
        mounts.umount(point)


def fold_host_uppers(scratch: Path, host_dirs: tuple[str, ...]) -> Path:
    """Move the host dirs' writes into ``scratch/upper`` so it is one layer tree; return it."""
    upper = scratch / "upper"
    for host_dir in host_dirs:
        source = scratch / f"{_upper_name(host_dir)}-upper"
        if source.is_dir() and any(source.iterdir()):
            _merge(source, upper / host_dir.lstrip("/"))
    return upper


def copy_upper(scratch: Path, host_dirs: tuple[str, ...], target: Path) -> None:
    """Take a live sandbox's writes (``scratch`` uppers) as one layer tree at ``target``.

    Blocking: run it off the event loop, with the sandbox frozen so the tree is consistent.
    A disk that is a btrfs subvolume is taken by reference (``snapshot_upper``): ``target`` becomes
    a link to a snapshot of it, in a time that does not grow with what the sandbox wrote. Any other
    (a tmpfs) is copied with ``cp -a``, which keeps what makes a tree a layer: whiteout devices and
    opaque-dir xattrs.
    """
    if _by_reference(scratch):
        snapshot_upper(scratch, host_dirs, target)
        return
    copy_tree(scratch / "upper", target)
    for host_dir in host_dirs:
        source = scratch / f"{_upper_name(host_dir)}-upper"
        if source.is_dir() and any(source.iterdir()):
            staged = target.with_name(target.name + f".{_upper_name(host_dir)}")
            copy_tree(source, staged)
            _merge(staged, target / host_dir.lstrip("/"))
            shutil.rmtree(staged, ignore_errors=True)


def snapshot_upper(subvolume: Path, host_dirs: tuple[str, ...], target: Path) -> None:
    """Snapshot a sandbox's disk (``<state>/disk/<id>``) into ``<state>/disk/layers/.tmp-PID-…`` and
    link ``target`` to its ``upper``, the layer tree: the host dirs' writes are moved into it, and the
    overlays' work dirs removed (renames and a few empty dirs: the copy of the files is the
    filesystem's, by reference). ``LayerStore.commit`` gives the snapshot its layer's name."""
    home = subvolume.parent / disk.LAYERS
    home.mkdir(exist_ok=True)
    taken = home / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    disk.snapshot(subvolume, taken)
    try:
        fold_host_uppers(taken, host_dirs)
        for entry in taken.iterdir():  # work dirs and emptied host uppers: not the layer's
            if entry.name != "upper" and not entry.name.startswith(LOWER_PREFIX):  # those its children read
                shutil.rmtree(entry)
        os.utime(taken)  # dated now, not when the sandbox was made: discard_orphans goes by its age
        target.symlink_to(taken / "upper")
    except BaseException:
        disk.delete(taken)
        raise


def _by_reference(scratch: Path) -> bool:
    """Whether a sandbox's disk is a btrfs subvolume, whose snapshots are layers taken by reference."""
    try:
        return disk.is_subvolume(scratch)
    except FileNotFoundError:
        return False


def copy_tree(source: str | Path, target: Path) -> None:
    """``cp -a``: links copied as links (nothing in the tree is followed), whiteouts and xattrs kept;
    --reflink=auto: where source and target share a filesystem that can (btrfs), blocks are shared."""
    done = subprocess.run(["cp", "-a", "--reflink=auto", "--", str(source), str(target)], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"copying {source} failed: {done.stderr.strip()[-500:]}")


def _merge(source: Path, target: Path) -> None:
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
        return
    for child in source.iterdir():
        if child.is_dir() and not child.is_symlink() and (target / child.name).is_dir():
            _merge(child, target / child.name)
        else:
            os.replace(child, target / child.name)
