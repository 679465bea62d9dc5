"""Assemble an image's layers into a writable root filesystem with overlayfs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from ..host import mounts
from .store import LayerStore


def _upper_name(host_dir: str) -> str:
    return "host" + host_dir.replace("/", "-")


def mount_rootfs(
    store: LayerStore, layers: tuple[str, ...], host_dirs: tuple[str, ...], target: Path, scratch: Path, *,
    volatile: bool = False, remap: Callable[[Path], Path] | None = None,
) -> None:
    """Mount ``layers`` (bottom first) at ``target``, writes going to dirs under ``scratch``
    (``volatile``: never synced, see ``mounts.mount_overlay``).

    Each of ``host_dirs`` (the ``host`` base's /usr) gets an overlay of its own whose
    lowest layer is the host's directory itself, so writes there stay in the sandbox.
    On failure everything mounted so far is unmounted again. ``remap`` gives the directory to
    use in place of each lower one (an idmapped clone of it, for a sandbox in a user namespace).
    """
    same: Callable[[Path], Path] = lambda path: path  # noqa: E731
    mapped = remap or same
    lowers = [store.layer_path(d) for d in reversed(layers)]
    try:
        (scratch / "upper").mkdir(exist_ok=True)
        (scratch / "work").mkdir(exist_ok=True)
        target.mkdir(exist_ok=True)
        mounts.mount_overlay(target, [mapped(p) for p in lowers], scratch / "upper", scratch / "work",
                             volatile=volatile)
        for host_dir in host_dirs:
            name = _upper_name(host_dir)
            (scratch / f"{name}-upper").mkdir(exist_ok=True)
            (scratch / f"{name}-work").mkdir(exist_ok=True)
            rel = host_dir.lstrip("/")
            dir_lowers = [p / rel for p in lowers if (p / rel).is_dir() and not (p / rel).is_symlink()]
            dir_lowers = [p for p in dir_lowers if any(p.iterdir())] + [Path(host_dir)]
            mounts.mount_overlay(target / rel, [mapped(p) for p in dir_lowers], scratch / f"{name}-upper",
                                 scratch / f"{name}-work", volatile=volatile)
    except BaseException:
        unmount_rootfs(target)
        raise


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
    """Copy a live sandbox's writes (``scratch`` uppers) into ``target`` as one layer tree.

    Blocking: run it off the event loop, with the sandbox frozen so the copy is consistent.
    ``cp -a`` keeps what makes a tree a layer: whiteout devices and opaque-dir xattrs.
    """
    copy_tree(scratch / "upper", target)
    for host_dir in host_dirs:
        source = scratch / f"{_upper_name(host_dir)}-upper"
        if source.is_dir() and any(source.iterdir()):
            staged = target.with_name(target.name + f".{_upper_name(host_dir)}")
            copy_tree(source, staged)
            _merge(staged, target / host_dir.lstrip("/"))
            shutil.rmtree(staged, ignore_errors=True)


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
