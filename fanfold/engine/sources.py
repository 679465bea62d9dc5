"""What sandboxes are made from: images (built on first use for base names) and snapshots."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from ..errors import ImageNotFound, InvalidRequest, SnapshotNotFound
from ..images import Image, LayerStore
from ..images.builder import DEFAULT_PATH, Builder, Network, OnStep
from ..models import NO_GPUS, Limits, SnapshotInfo
from ..spec import BASES, GPUS_LABEL, EnvSpec
from . import db as dbmod
from .snapshots import PREFIX as SNAPSHOT_PREFIX
from .snapshots import SnapshotStore

if TYPE_CHECKING:
    from ..images.git import Gate as GitGate


class Sources:
    """Images and snapshots, resolved to what a sandbox starts from."""

    def __init__(self, db: dbmod.Database, store: LayerStore, builder: Builder, snaps: SnapshotStore,
                 resolve: Callable[[str], Awaitable[Image]], tier: str = "oci",
                 clones: Callable[[], GitGate] | None = None) -> None:
        self.db, self.store, self.builder, self.snaps = db, store, builder, snaps
        self.tier = tier
        """The engine's backend: memory snapshots of another one cannot be restored here."""
        self.resolve = resolve
        """An image id or reference to its image (a reference never pulled is pulled)."""
        self._bases: dict[str, Image] = {}
        self._make_clones = clones
        self._clones: GitGate | None = None

    def clones(self) -> GitGate | None:
        """Where server tenants' repo steps may clone from (made on first use); None: as the host's git does."""
        if self._clones is None and self._make_clones is not None:
            self._clones = self._make_clones()
        return self._clones

    async def build(self, spec: EnvSpec, on_step: OnStep | None = None, *, network: Network = "isolated",
                    tenant: str = "") -> Image:
        """Build ``spec``; a server ``tenant``'s repo steps clone only where ``clones`` allows, and its
        ``run`` steps reach none of the ranges the egress proxy refuses (``Builder.build``'s ``confined``)."""
        if not isinstance(spec, EnvSpec):
            raise InvalidRequest(f"build() takes an EnvSpec, got {type(spec).__name__}")
        gated = bool(tenant) and self._make_clones is not None
        return await self.builder.build(spec, on_step, network=network, clones=self.clones if gated else None,
                                        confined=bool(tenant))

    async def image(self, ref: str | Image) -> Image:
        if isinstance(ref, Image):
            return ref
        if not isinstance(ref, str):
            raise ImageNotFound(f"an image is an Image, an image id, a reference or a base name, not {type(ref).__name__}")
        if ref in BASES:  # resolved once: a create from a warm pool must not wait on a build
            cached = self._bases.get(ref)
            if cached is None:
                cached = self._bases[ref] = await self.build(EnvSpec(ref))
            return cached
        return await self.resolve(ref)

    def resolve_snapshot(self, ref: str, tenant: str = "") -> str | None:
        """The snapshot a create's ``image`` names (its id, or a name ``tenant`` gave one), or None when it
        names an image. Each tenant names its own snapshots ("" is the host's): another tenant's name
        means nothing here, so an image of that name is meant.

        Base names and image ids always mean the image, whatever a snapshot is called.
        """
        if not isinstance(ref, str) or not ref or ref in BASES or ref.startswith("img-"):
            return None
        row = self.db.snapshot(ref, tenant)
        return None if row is None else row["id"]

    async def source(self, ref: str | Image | SnapshotInfo, tenant: str = "") -> tuple[str, Image, SnapshotInfo | None]:
        """What a sandbox of ``tenant`` is made from: (source id, root image, snapshot or None). A server
        tenant starts only from its own snapshots (another's id is SnapshotNotFound, as a missing one);
        the host's own tenant ("") from any, by id."""
        if isinstance(ref, SnapshotInfo):
            ref = ref.id
        snapshot_id = self.resolve_snapshot(ref, tenant)  # type: ignore[arg-type]
        if snapshot_id is not None or (isinstance(ref, str) and ref.startswith(SNAPSHOT_PREFIX)):
            row = self.snaps.row(snapshot_id or ref, tenant)  # type: ignore[arg-type]
            if tenant and row["tenant"] != tenant:
                raise SnapshotNotFound(f"no snapshot {ref!r}: it was never taken, or was deleted or collected")
            snapshot = dbmod.snapshot_info(row)
            return snapshot.id, self.store.load_image(snapshot.image_id), snapshot
        img = await self.image(ref)  # type: ignore[arg-type]
        return img.id, img, None

    async def source_limits(self, ref: str | Image | SnapshotInfo, limits: Limits | None,
                            tenant: str = "") -> tuple[str, Image, Limits]:
        """What a sandbox (of ``tenant``) is made from (source id, root image), and the limits it gets:
        a memory snapshot's processes keep the limits they were dumped with; else the image's GPUs
        (``image_gpus``) unless ``limits`` name some."""
        source, img, snapshot = await self.source(ref, tenant)
        if snapshot is not None and snapshot.memory:
            taken_by = self.snaps.memory_tier(snapshot.id)
            if taken_by != self.tier:
                raise InvalidRequest(
                    f"snapshot {snapshot.id} holds the memory of a sandbox of the {taken_by} backend, which this"
                    f" engine's {self.tier} backend cannot restore: create from it with an engine of that backend"
                    " (FANFOLD_RUNTIME), or take a disk snapshot (memory=False), which any backend starts from")
            if limits is not None and limits.gpus not in (None, NO_GPUS):
                raise InvalidRequest(
                    f"snapshot {snapshot.id} holds processes' memory, which cannot be given a GPU as they are restored:"
                    " create a GPU sandbox from an image or a disk snapshot (memory=False)")
            return source, img, limits_of(snapshot, limits)
        return source, img, image_gpus(limits, img) or Limits()

    def start_point(self, source: str) -> tuple[Image, Path | None]:
        """The image (with the snapshot's layers, for a snapshot) and memory images a source starts from."""
        if not source.startswith(SNAPSHOT_PREFIX):
            return self.store.load_image(source), None
        row = self.snaps.row(source)
        return self.image_of(row), self.snaps.memory_dir(source) if row["memory"] else None

    def image_of(self, row: Any) -> Image:
        """The image a sandbox or snapshot row was made from, with the row's own layers."""
        return dataclasses.replace(self.store.load_image(row["image_id"]), layers=dbmod.row_layers(row))


def base_env(img: Image, sandbox_id: str, extra: dict[str, str], defaults: dict[str, str] | None = None) -> list[str]:
    """A command's environment: fanfold's defaults (and ``defaults``), then the image's, then the caller's."""
    merged = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "HOSTNAME": sandbox_id, "TERM": "xterm"}
    merged.update(defaults or {})
    merged.update(dict(img.env))
    merged.update(extra)
    return [f"{key}={value}" for key, value in merged.items()]


def limits_of(snapshot: SnapshotInfo, asked: Limits | None) -> Limits:
    """A memory snapshot's processes keep the cpu, memory and pids limits they were dumped with."""
    base = snapshot.limits or Limits()
    return base if asked is None else Limits(cpus=base.cpus, memory_mb=base.memory_mb, pids=base.pids, disk_mb=asked.disk_mb)


def image_gpus(limits: Limits | None, img: Image) -> Limits | None:
    """``limits`` with the GPUs ``img`` asks for (``EnvSpec.gpus``, its ``fanfold.gpus`` label) where they name
    none: a create's own ``gpus`` and ``gpu_exclusive`` replace the image's, and ``gpus="none"`` is none."""
    asked = None if limits is None else limits.gpus
    if asked == NO_GPUS:
        return dataclasses.replace(limits, gpus=None)  # type: ignore[type-var]
    if asked is not None or img.gpus is None:
        return limits
    try:
        default = Limits(gpus=img.gpus, gpu_exclusive=img.gpu_exclusive)
    except (InvalidRequest, ValueError) as err:
        raise InvalidRequest(f"image {img.id}'s GPU labels ({GPUS_LABEL}={img.gpus}): {err}; a create's own gpus="
                             " overrides them") from None
    if default.gpus in (None, NO_GPUS):
        return limits
    return dataclasses.replace(limits or Limits(), gpus=default.gpus, gpu_exclusive=default.gpu_exclusive)


def check_gpus(check: Callable[[Limits], None], limits: Limits, asked: Limits | None, img: Image) -> None:
    """``check`` (``Gpus.check``) ``limits``; where their GPUs are the image's default, its error says so."""
    try:
        check(limits)
    except InvalidRequest as err:
        if limits.gpus is None or (asked is not None and asked.gpus is not None):
            raise
        raise InvalidRequest(f"image {img.id} asks for GPUs (label {GPUS_LABEL}={img.gpus}): {err}"
                             " (gpus=none makes a sandbox of it without)") from None
