"""Content-addressed layers and image records on disk.

A layer is a directory in overlayfs' upper format (whiteouts included), written once
under a temporary name and renamed into place, so a crash never leaves a partial layer.
``layers/<name>`` is that directory, or a link to it: to a registry layer's unpacked tree, or to
the ``upper`` of a snapshot taken by reference, a subvolume ``<state>/disk/layers/<name>`` on the
sandboxes' btrfs (``rootfs.snapshot_upper``).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

from ..errors import ImageNotFound
from ..host import disk, mounts
from ..spec import BASES, GPU_EXCLUSIVE_LABEL, GPUS_LABEL, INIT_LABEL


@dataclass(frozen=True, kw_only=True)
class Healthcheck:
    """A HEALTHCHECK as an image records it (Docker's, in seconds); fanfold notes it and runs no probe."""

    test: tuple[str, ...]
    """``("CMD", argv...)``, ``("CMD-SHELL", command)``, or ``("NONE",)`` (an inherited one turned off)."""
    interval_s: float = 30.0
    timeout_s: float = 30.0
    start_period_s: float = 0.0
    retries: int = 3

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Healthcheck | None:
        if not data:
            return None
        return cls(test=tuple(data["test"]), interval_s=float(data.get("interval_s", 30.0)),
                   timeout_s=float(data.get("timeout_s", 30.0)), start_period_s=float(data.get("start_period_s", 0.0)),
                   retries=int(data.get("retries", 3)))


@dataclass(frozen=True, kw_only=True)
class Image:
    """A built EnvSpec: a stack of layers plus the config sandboxes start with."""

    id: str
    base: str
    layers: tuple[str, ...]
    """Layer digests, bottom first."""
    host_dirs: tuple[str, ...] = ()
    """Host directories the ``host`` base overlays read-only (``/usr``)."""
    env: tuple[tuple[str, str], ...] = ()
    workdir: str = "/"
    services: tuple[tuple[str, str, str], ...] = field(default=())
    """(name, command, mode) of each service, in start order."""
    user: str = ""
    """Who commands run as by default (name or uid, ``:group`` optional); empty: root."""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    """The default command: ``entrypoint + cmd`` is what ``fanfold run`` with no command runs."""
    ports: tuple[str, ...] = ()
    """Ports the image says it listens on (``8000/tcp``), noted, not published."""
    source: str = ""
    """Where it came from: ``build``, ``registry REF`` or ``file PATH``."""
    digest: str = ""
    """The manifest digest of a pulled or imported image (``sha256:...``)."""
    labels: tuple[tuple[str, str], ...] = ()
    """Metadata (a Dockerfile's LABEL, a pulled image's labels), sorted by key."""
    volumes: tuple[str, ...] = ()
    """Paths the image keeps data in (VOLUME), noted: a volume is a directory of the sandbox's own disk."""
    healthcheck: Healthcheck | None = None
    """How to probe its service (HEALTHCHECK), noted for tools that probe; fanfold runs none."""
    history: tuple[tuple[str, str, int], ...] = ()
    """(what made it, the layer it made or "" for a step of config alone, that layer's bytes on disk) of each
    step, bottom first; empty for images recorded before it was kept."""
    names: tuple[str, ...] = ()
    """The references that name it now (filled in by listings; not part of the stored record)."""
    shared: bool = False
    """Published by the host's tenant to every tenant of a server (filled in by listings, not stored)."""

    @property
    def gpus(self) -> str | None:
        """The GPUs its sandboxes get when their create names none (its ``fanfold.gpus`` label, as written)."""
        return dict(self.labels).get(GPUS_LABEL)

    @property
    def init(self) -> str:
        """What its sandboxes run as PID 1 besides the agent: ``systemd``, or ``""`` (the agent itself),
        from its ``fanfold.init`` label (a pulled image's may say anything: the create refuses what is unknown)."""
        value = dict(self.labels).get(INIT_LABEL, "fanfold")
        return "" if value == "fanfold" else value

    @property
    def gpu_exclusive(self) -> bool:
        """Whether those GPUs are held alone (its ``fanfold.gpu_exclusive`` label); ValueError unless true or false."""
        value = dict(self.labels).get(GPU_EXCLUSIVE_LABEL, "false")
        if value.lower() not in ("true", "false"):
            raise ValueError(f"{GPU_EXCLUSIVE_LABEL}={value!r} is not true or false")
        return value.lower() == "true"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def stored(self) -> Image:
        """The record as saved: without the names a listing added."""
        return replace(self, names=(), shared=False)

    @classmethod
    def from_json(cls, text: str) -> Image:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> Image:
        """An image from its JSON form; records written before a field existed get its default."""
        return cls(
            id=data["id"], base=data["base"], layers=tuple(data["layers"]), host_dirs=tuple(data["host_dirs"]),
            env=tuple(tuple(kv) for kv in data["env"]), workdir=data["workdir"],
            services=tuple(tuple(s) for s in data["services"]), user=data.get("user", ""),
            entrypoint=tuple(data.get("entrypoint", ())), cmd=tuple(data.get("cmd", ())),
            ports=tuple(data.get("ports", ())), source=data.get("source", ""), digest=data.get("digest", ""),
            labels=tuple(tuple(kv) for kv in data.get("labels", ())), volumes=tuple(data.get("volumes", ())),
            healthcheck=Healthcheck.from_dict(data.get("healthcheck")), history=tuple(tuple(h) for h in data.get("history", ())),
            names=tuple(data.get("names", ())), shared=bool(data.get("shared", False)),
        )

    def layer_history(self) -> list[tuple[str, str, int | None]]:
        """(what made it, layer, bytes or None when unknown) of each layer, bottom first: from ``history``,
        or for an image recorded without one, its layers with no step named."""
        if self.history:
            return [(made_by, layer, size) for made_by, layer, size in self.history if layer]
        return [("", layer, None) for layer in self.layers]


class LayerStore:
    """The ``layers/`` and ``images/`` directories of one state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.layers_dir = state_dir / "layers"
        self.images_dir = state_dir / "images"
        self.locks_dir = state_dir / "locks"
        self.refs_dir = state_dir / "refs"
        self.referenced_dir = disk.layers_dir(state_dir)
        """Snapshots' layers taken by reference: subvolumes of the sandboxes' btrfs, there while it is mounted."""
        for directory in (self.layers_dir, self.images_dir, self.locks_dir, self.refs_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self._local_locks: dict[str, asyncio.Lock] = {}
        self._images: dict[str, Image] = {}

    def layer_path(self, digest: str) -> Path:
        return self.layers_dir / digest[:32]

    def has_layer(self, digest: str) -> bool:
        return self.layer_path(digest).is_dir()

    def layer_size(self, layer: str) -> int:
        """Bytes a layer takes on disk, counted once and remembered beside it (layers never change).
        Blocking (it walks the tree the first time): call off the event loop."""
        cache = self._size_path(layer)
        try:
            return int(cache.read_text())
        except (OSError, ValueError):
            pass
        total = 0
        for top, _dirs, files in os.walk(self.layer_path(layer)):
            for name in files:
                try:
                    total += os.lstat(os.path.join(top, name)).st_blocks * 512
                except OSError:
                    continue
        try:
            cache.write_text(str(total))
        except OSError:
            pass
        return total

    @contextmanager
    def lock(self, digest: str) -> Iterator[None]:
        """Serialise builders of one layer across processes (blocking: call off the event loop)."""
        with open(self.locks_dir / digest[:32], "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    @asynccontextmanager
    async def alock(self, digest: str) -> AsyncIterator[None]:
        """The same lock for async builders: in-process waiters queue on an asyncio.Lock, and
        the cross-process flock is tried without blocking, again every 20 ms while another
        process holds it (a build takes seconds), so no thread is held waiting for it."""
        local = self._local_locks.setdefault(digest, asyncio.Lock())
        async with local, self._flock(self.locks_dir / digest[:32], fcntl.LOCK_EX):
            yield

    @asynccontextmanager
    async def making(self) -> AsyncIterator[None]:
        """Held (shared, across processes) while a build or a pull makes layers that no image record
        names yet; layer gc takes it exclusively (``collecting``), so it never deletes one of them."""
        async with self._flock(self.locks_dir / "gc", fcntl.LOCK_SH):
            yield

    @asynccontextmanager
    async def collecting(self) -> AsyncIterator[None]:
        """Held (exclusively) while layers are collected: no build or pull runs meanwhile."""
        async with self._flock(self.locks_dir / "gc", fcntl.LOCK_EX):
            yield

    @asynccontextmanager
    async def _flock(self, path: Path, mode: int) -> AsyncIterator[None]:
        """``flock`` on ``path``, tried without blocking and again every 20 ms: no thread waits on it."""
        handle = open(path, "a")
        try:
            while True:  # polled, not blocked on in a thread: a cancelled waiter must not take it later
                try:
                    fcntl.flock(handle, mode | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.02)
            yield
        finally:
            handle.close()

    def scratch(self) -> Path:
        path = self.layers_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        return path

    def commit(self, tree: Path, digest: str) -> Path:
        """Move a finished tree into place as layer ``digest``; a link to a snapshot's ``upper``
        (``rootfs.snapshot_upper``) moves its subvolume to the layer's name, and links to that."""
        target = self.layer_path(digest)
        if not tree.is_symlink():
            tree.rename(target)
            return target
        subvolume = self.referenced_dir / target.name
        os.rename(Path(os.readlink(tree)).parent, subvolume)
        # Relative: the state dir may be reached by another path (a bind mount, a moved dir).
        target.symlink_to(os.path.relpath(subvolume / "upper", target.parent))
        tree.unlink()
        return target

    def _size_path(self, layer: str) -> Path:
        return self.layers_dir / f".size-{layer[:32]}"

    def forget_size(self, layer: str) -> None:
        """Drop what ``layer_size`` remembered of a layer that is gone."""
        self._size_path(layer).unlink(missing_ok=True)

    def remove_layer(self, digest: str) -> None:
        """Delete layer ``digest``: its tree, or its link and the snapshot it links to. A missing one is
        not an error. Blocking (a big tree takes a while to remove): call off the event loop."""
        path = self.layer_path(digest)
        if path.is_symlink():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
        self.forget_size(path.name)
        self.delete_referenced(path.name)

    def referenced(self, *, staged: bool = False) -> list[Path]:
        """The subvolumes of layers taken by reference, or with ``staged`` of those not yet committed
        (none while the sandboxes' btrfs is not mounted)."""
        try:
            return [p for p in self.referenced_dir.iterdir() if p.name.startswith(".tmp-") == staged]
        except FileNotFoundError:
            return []

    def referenced_subvolume(self, digest: str) -> Path | None:
        """The subvolume of layer ``digest`` when it was taken by reference and is there, else None."""
        path = self.layer_path(digest)
        if not path.is_symlink():
            return None
        subvolume = self.referenced_dir / path.name
        try:
            return subvolume if disk.is_subvolume(subvolume) else None
        except FileNotFoundError:
            return None

    def delete_referenced(self, name: str) -> None:
        """Delete ``<state>/disk/layers/<name>``, a snapshot's subvolume; a missing one is not an error."""
        disk.remove_at(self.referenced_dir / name)

    def discard_scratch(self) -> None:
        """Remove temporary trees left by builders that died, and snapshots by reference that their
        engine died before it committed them."""
        for path in self.layers_dir.glob(".tmp-*"):
            if _dead(path):
                for point in mounts.mounts_under(path):
                    mounts.umount(point)
                if not mounts.mounts_under(path):  # never delete through a live mount
                    shutil.rmtree(path, ignore_errors=True)
        for path in self.referenced(staged=True):
            if _dead(path):
                self.delete_referenced(path.name)

    def save_image(self, image: Image) -> None:
        tmp = self.images_dir / f".{image.id}.{uuid.uuid4().hex[:6]}"
        tmp.write_text(image.stored().to_json())
        tmp.rename(self.images_dir / f"{image.id}.json")

    def load_image(self, image_id: str) -> Image:
        """An image record; records are immutable, so each is read from disk once."""
        cached = self._images.get(image_id)
        if cached is not None:
            return cached
        path = self.images_dir / f"{image_id}.json"
        if "/" in image_id or len(image_id) > 128 or not path.is_file():
            raise ImageNotFound(
                f"no image {image_id!r} here: `fanfold images` lists the images here; or use a base:"
                f" {', '.join(BASES)}"
            )
        image = self._images[image_id] = Image.from_json(path.read_text())
        return image

    def drop_image(self, image_id: str) -> None:
        """Delete an image record (its layers stay for garbage collection)."""
        self._images.pop(image_id, None)
        if "/" not in image_id:
            (self.images_dir / f"{image_id}.json").unlink(missing_ok=True)

    def tag(self, ref: str, image_id: str, tenant: str = "") -> None:
        """Record that ``ref`` (as the user wrote it: a registry reference, a file) names ``image_id``
        for ``tenant`` (each server tenant has a namespace of its own; "" is the host's)."""
        path = self._ref_path(ref, tenant)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}")
        tmp.write_text(json.dumps({"ref": ref, "image": image_id, **({"tenant": tenant} if tenant else {})}))
        tmp.rename(path)

    def untag(self, ref: str, tenant: str = "") -> None:
        self._ref_path(ref, tenant).unlink(missing_ok=True)

    def resolve_ref(self, ref: str, tenant: str = "") -> str | None:
        """The image id ``ref`` named (for ``tenant``) when it was last pulled or imported, or None."""
        try:
            return json.loads(self._ref_path(ref, tenant).read_text())["image"]
        except (OSError, ValueError, KeyError):
            return None

    def refs(self, tenant: str = "") -> dict[str, str]:
        """Every reference recorded for ``tenant`` and the image id it names."""
        return {ref: image for owner, ref, image in self.all_refs() if owner == tenant}

    def all_refs(self) -> list[tuple[str, str, str]]:
        """(tenant, reference, image id) of every namespace."""
        found = []
        for path in self.refs_dir.glob("*.json"):
            try:
                data = json.loads(path.read_text())
                found.append((data.get("tenant", ""), data["ref"], data["image"]))
            except (OSError, ValueError, KeyError):
                continue
        return found

    def _ref_path(self, ref: str, tenant: str = "") -> Path:
        key = f"{tenant}\0{ref}" if tenant else ref  # the host's refs keep the names they always had
        return self.refs_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def images(self) -> list[Image]:
        return [Image.from_json(p.read_text()) for p in sorted(self.images_dir.glob("img-*.json"))]


def _dead(path: Path) -> bool:
    """Whether the process named in a ``.tmp-PID-…`` name is gone."""
    pid = path.name.split("-")[1]
    return pid.isdigit() and not Path(f"/proc/{pid}").exists()
