"""The engine's images: pulled from registries, imported from files, listed, removed, and their
layers collected when nothing uses them. Pulling and unpacking are ``fanfold.images.oci``'s."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ImageInUse, ImageNotFound, InvalidRequest
from ..images import Image, LayerStore
from ..spec import BASES, is_image_id, is_image_ref
from . import db as dbmod

if TYPE_CHECKING:
    from ..images.oci import ImageStore, OnPull



class Catalog:
    """Every image this host holds, by id and by the references that named it."""

    def __init__(self, db: dbmod.Database, store: LayerStore, state_dir: Path, *, pull: str = "missing") -> None:
        self.db, self.store, self.state_dir = db, store, state_dir
        self.pull_policy = pull
        """``missing``: a reference never pulled here is pulled when used; ``never``: only by ``pull``."""
        self._oci: ImageStore | None = None

    @property
    def oci(self) -> ImageStore:
        """Registries and archives (skopeo and containers/storage), set up on first use."""
        if self._oci is None:
            from ..images.oci import ImageStore

            self._oci = ImageStore(self.store, self.state_dir)
        return self._oci

    async def pull(self, ref: str, *, platform: str | None = None, on_progress: OnPull | None = None) -> Image:
        """Fetch ``ref`` from its registry (again, to see whether its tag moved); layers already here are kept."""
        if not is_image_ref(ref):
            raise InvalidRequest(
                f"{ref!r} is not an image reference: give one like 'python:3.12-slim',"
                " 'registry.example.org/team/env:v1' or 'localhost:5000/env@sha256:<64 hex>'"
            )
        return self._named(await self.oci.pull(ref, platform=platform, on_progress=on_progress))

    async def import_file(self, path: str | Path, *, ref: str | None = None,
                          on_progress: OnPull | None = None) -> Image:
        """An image from a ``docker save`` tarball, an OCI archive or an OCI layout directory."""
        where = Path(path)
        if not where.exists():
            raise InvalidRequest(f"no file or directory {str(path)!r} to import")
        return self._named(await self.oci.import_file(where.absolute(), ref=ref, on_progress=on_progress))

    async def resolve(self, ref: str) -> Image:
        """The image a base or create names: a pulled reference (pulled now if it never was) or an id."""
        if is_image_id(ref):
            return self.store.load_image(ref)
        known = self.store.resolve_ref(ref)
        if known is not None:
            try:
                return self.store.load_image(known)
            except ImageNotFound:
                self.store.untag(ref)  # its image was removed meanwhile
        if not is_image_ref(ref):
            raise ImageNotFound(
                f"unknown image {ref!r}: use a base ({', '.join(BASES)}), an image id (img-...), a snapshot,"
                " or an image reference such as 'python:3.12-slim'"
            )
        if self.pull_policy == "never":
            raise ImageNotFound(f"image {ref!r} was never pulled here, and this host pulls only when asked"
                                f" (FANFOLD_PULL=never): run `fanfold pull {ref}` first")
        return await self.pull(ref)

    def _named(self, img: Image) -> Image:
        return dataclasses.replace(img, names=tuple(sorted(r for r, i in self.store.refs().items() if i == img.id)))

    def images(self) -> list[Image]:
        """Every image, with the references that name it now."""
        names: dict[str, list[str]] = {}
        for ref, image_id in sorted(self.store.refs().items()):
            names.setdefault(image_id, []).append(ref)
        return [dataclasses.replace(img, names=tuple(names.get(img.id, ()))) for img in self.store.images()]

    async def remove(self, ref: str, *, force: bool = False) -> str:
        """Remove an image (by id or a reference naming it); returns its id. Refused while a sandbox
        or snapshot uses it unless ``force`` (then only the name goes, and the image stays for them)."""
        image_id = ref if is_image_id(ref) else self.store.resolve_ref(ref)
        if image_id is None:
            raise ImageNotFound(f"no image {ref!r} here: `fanfold images` lists them")
        self.store.load_image(image_id)  # ImageNotFound for an unknown id
        users = self._users(image_id)
        if users and not force:
            raise ImageInUse(
                f"image {image_id} is used by {', '.join(sorted(users)[:5])}{' ...' if len(users) > 5 else ''}:"
                " remove those first, or pass force to drop only its name"
            )
        if not users:
            await self.oci.remove(image_id)  # the record, every name and the unpacked image
            return image_id
        for name, named in self.store.refs().items():  # forced: only the name(s) go, the image stays for its users
            if named == image_id and (name == ref or is_image_id(ref)):
                self.store.untag(name)
        return image_id

    def _users(self, image_id: str) -> set[str]:
        found = {row["id"] for row in self.db.rows() if row["image_id"] == image_id}
        found |= {row["id"] for row in self.db.snapshot_rows() if row["image_id"] == image_id}
        return found

    async def collect(self) -> list[str]:
        """Delete layers no image, snapshot or sandbox uses, and unpacked registry layers no image
        uses; return their names. No build or pull runs meanwhile, in any process."""
        async with self.store.collecting():
            used = await asyncio.to_thread(self._layers_in_use)
            removed = await asyncio.to_thread(self._collect_layers, used)
            return removed + await self.oci.gc(used)

    def _collect_layers(self, used: set[str]) -> list[str]:
        keep = {self.store.layer_path(layer).name for layer in used}
        removed = []
        for path in self.store.layers_dir.iterdir():
            if path.name.startswith(".") or path.name in keep:
                continue
            if path.is_symlink():
                path.unlink()
            else:
                shutil.rmtree(path, ignore_errors=True)
            (self.store.layers_dir / f".size-{path.name}").unlink(missing_ok=True)
            removed.append(path.name)
        return removed

    def _layers_in_use(self) -> set[str]:
        used: set[str] = set()
        for img in self.store.images():
            used.update(img.layers)
        for row in [*self.db.rows(), *self.db.snapshot_rows()]:
            used.update(json.loads(row["layers"] or "[]"))
            used.add(row["id"])  # a snapshot's own layer is named by its id
        return used



def layer_size(store: LayerStore, layer: str) -> int:
    """Bytes a layer takes on disk, counted once and remembered beside it (layers never change)."""
    cache = store.layers_dir / f".size-{layer[:32]}"
    try:
        return int(cache.read_text())
    except (OSError, ValueError):
        pass
    total = 0
    for top, _dirs, files in os.walk(store.layer_path(layer)):
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
