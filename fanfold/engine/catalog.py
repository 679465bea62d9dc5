"""The engine's images: pulled from registries, imported from files, listed, removed, and their
layers collected when nothing uses them. Pulling and unpacking are ``fanfold.images.oci``'s."""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import (
    FanfoldError, ImageInUse, ImageNotFound, InvalidRequest, RegistryDenied, RegistryUnavailable, Unauthorized,
)
from ..images import Image, LayerStore
from ..images.registry import parse_platform, parse_ref
from ..refs import is_id_shaped
from ..spec import BASES, EnvSpec, Step, is_image_id, is_image_ref
from . import db as dbmod

if TYPE_CHECKING:
    from ..images.oci import ImageStore, OnPull
    from ..net.pulls import PullGate


class Catalog:
    """Every image this host holds, by id and by the references that named it.

    On a server each image belongs to the tenants that built, pulled or imported it; a tenant
    sees those, the ones the host's own tenant ("") shared, and fanfold's bare bases, each
    under its own namespace of references. Another tenant's image is ImageNotFound, exactly
    like one that does not exist. The host's tenant sees every image. Layers stay shared.
    """

    def __init__(self, db: dbmod.Database, store: LayerStore, state_dir: Path, *, pull: str = "missing",
                 gate: Callable[[], PullGate] | None = None) -> None:
        self.db, self.store, self.state_dir = db, store, state_dir
        self.pull_policy = pull
        """``missing``: a reference never pulled here is pulled when used; ``never``: only by ``pull``."""
        self._oci: ImageStore | None = None
        self._make_gate = gate
        self._gate: PullGate | None = None

    @property
    def gate(self) -> PullGate | None:
        """Where server tenants' pulls may go (made on first use); None: they go out as the host's do."""
        if self._gate is None and self._make_gate is not None:
            self._gate = self._make_gate()
        return self._gate

    @property
    def oci(self) -> ImageStore:
        """Registries and archives (skopeo and containers/storage), set up on first use."""
        if self._oci is None:
            from ..images.oci import ImageStore

            self._oci = ImageStore(self.store, self.state_dir)
        return self._oci

    async def pull(self, ref: str, *, platform: str | None = None, on_progress: OnPull | None = None,
                   tenant: str = "") -> Image:
        """Fetch ``ref`` from its registry (again, to see whether its tag moved); layers already here are kept."""
        if is_id_shaped(ref):
            raise InvalidRequest(f"{ref!r} is shaped like a local image id (img-...), and ids are never pulled:"
                                 " `fanfold images` lists the images here")
        if not is_image_ref(ref):
            raise InvalidRequest(
                f"{ref!r} is not an image reference: give one like 'python:3.12-slim',"
                " 'registry.example.org/team/env:v1' or 'localhost:5000/env@sha256:<64 hex>'"
            )
        # A tenant pulls as nobody (the host's logins are the host's), only where the operator allows
        # (``net.pulls``), and names it for itself alone.
        gate = self.gate if tenant else None
        if gate is None:
            img = await self.oci.pull(ref, platform=platform, on_progress=on_progress, host=not tenant)
        else:
            async with gate.route(parse_ref(ref).registry) as route:
                try:
                    img = await self.oci.pull(ref, platform=platform, on_progress=on_progress, host=False, route=route)
                except FanfoldError as err:
                    raise route.explain(err) from None
        if tenant and parse_platform(platform)[:2] == parse_platform(None)[:2]:  # another platform's: by id only
            self.store.tag(ref, img.id, tenant)
        return self.own(img, tenant)

    async def import_file(self, path: str | Path, *, ref: str | None = None,
                          on_progress: OnPull | None = None, tenant: str = "") -> Image:
        """An image from a ``docker save`` tarball, an OCI archive or an OCI layout directory."""
        where = Path(path)
        if not where.exists():
            raise InvalidRequest(f"no file or directory {str(path)!r} to import")
        if tenant and ref is not None:
            raise InvalidRequest("only the host's own tenant names imported images; import without a ref")
        return self.own(await self.oci.import_file(where.absolute(), ref=ref, on_progress=on_progress), tenant)

    def name(self, tag: str, img: Image, tenant: str = "") -> Image:
        """Name ``img`` ``tag`` for ``tenant`` (a build's ``-t``): a later create or build of that name
        uses it, as a pulled reference's name does; the name moves off any image it named before."""
        self.store.tag(check_tag(tag), img.id, tenant)
        return self._named(img, tenant)

    def own(self, img: Image, tenant: str) -> Image:
        """Record that ``tenant`` made ``img`` (built, pulled or imported it); the image as it sees it."""
        if tenant:
            self.db.grant_image(img.id, tenant)
        return self._named(img, tenant)

    async def resolve(self, ref: str, tenant: str = "") -> Image:
        """The image a base or create names: a pulled reference (pulled now if it never was) or an id;
        for a server tenant, only among the images it may see.

        A name shaped like an id (``img-...``) is never pulled. A name that is not here and cannot be
        pulled is ImageNotFound (not retried), naming the local images it may have meant; it is
        RegistryUnavailable (retried) only when the registry was reached and failed (a 5xx, a
        timeout) and the name is no near miss of a local one (``near_misses``)."""
        if is_id_shaped(ref):
            img = self._local_id(ref, tenant)
            if img is None:
                raise ImageNotFound(self._unknown(ref, tenant, "a name starting img- is a local image's id, and is"
                                                              " never pulled"))
            return img
        for namespace in dict.fromkeys((tenant, "")):
            known = self.store.resolve_ref(ref, namespace)
            if known is None:
                continue
            try:
                img = self.store.load_image(known)
            except ImageNotFound:
                self.store.untag(ref, namespace)  # its image was removed meanwhile
                continue
            if namespace == tenant or img.id in self.db.shared_images():
                return img
        if not is_image_ref(ref):
            raise ImageNotFound(self._unknown(ref, tenant, "it is neither a base, an image id, a snapshot nor an image"
                                                           " reference such as 'python:3.12-slim'"))
        if self.pull_policy == "never":
            raise ImageNotFound(self._unknown(ref, tenant, "it was never pulled here, and this host pulls only when"
                                                           f" asked (FANFOLD_PULL=never): run `fanfold pull {ref}` first"))
        try:
            return await self.pull(ref, tenant=tenant)
        except RegistryUnavailable as err:
            if err.reached and not self.near_misses(ref, tenant):
                raise
            raise ImageNotFound(self._unknown(ref, tenant, _unpulled(ref, err))) from None
        except (ImageNotFound, RegistryDenied) as err:
            raise type(err)(self._unknown(ref, tenant, str(err))) from None

    def near_misses(self, ref: str, tenant: str = "") -> list[str]:
        """Local names (references, ids, bases) ``tenant`` may use that ``ref`` looks like a typo of: the
        closest few, each at least 80% alike (``difflib``'s ratio)."""
        return difflib.get_close_matches(ref, self._local_names(tenant), n=3, cutoff=NEAR_MISS)

    def _local_names(self, tenant: str) -> list[str]:
        visible = self.images(tenant)
        names = {name for img in visible for name in img.names} | {img.id for img in visible}
        return sorted(names | set(BASES))

    def _local_id(self, ref: str, tenant: str) -> Image | None:
        if not is_image_id(ref):
            return None
        try:
            img = self.store.load_image(ref)
        except ImageNotFound:
            return None
        return img if self.visible(img, tenant) else None

    def _unknown(self, ref: str, tenant: str, why: str) -> str:
        """What an ImageNotFound says: why, the local names ``ref`` may have meant, and where to look."""
        # A well-formed id was copied, not typed: what ids are near it would only hint at what others hold.
        near = [] if is_image_id(ref) else difflib.get_close_matches(ref, self._local_names(tenant), n=3,
                                                                      cutoff=SUGGEST)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        where = (f" `fanfold images` lists the images here (bases: {', '.join(BASES)});"
                 " `fanfold build -t NAME` names a build.")
        if tenant:  # said whether or not the host has such an image: no tenant learns what others hold
            where += (" An image of the host's own tenant is seen here once its operator shares it"
                      " (`fanfold images share NAME`).")
        return f"no image {ref!r} here{hint}: {why}.{where}"

    def visible(self, img: Image, tenant: str) -> bool:
        """Whether ``tenant`` may see ``img``: its own, a shared one, or a bare base; the host sees all."""
        return (not tenant or _bare_base(img) or img.id in self.db.shared_images()
                or tenant in self.db.image_grants().get(img.id, ()))

    async def scoped(self, spec: EnvSpec, tenant: str) -> EnvSpec:
        """``spec`` with each image it builds on (its base, a ``copy --from`` image) resolved among
        ``tenant``'s images to an id, so its build reads no other tenant's image, whatever it is named."""
        if not tenant:
            return spec
        steps = []
        for step in spec.steps:
            source = step.arg("source") if step.kind == "copy_from" else None
            if isinstance(source, EnvSpec):
                source = await self.scoped(source, tenant)
            elif isinstance(source, str):
                source = await self._scoped_base(source, tenant)
            args = tuple((k, source if k == "source" and source is not None else v) for k, v in step.args)
            steps.append(Step(step.kind, args) if args != step.args else step)
        return dataclasses.replace(spec, base=await self._scoped_base(spec.base, tenant), steps=tuple(steps))

    async def _scoped_base(self, ref: str, tenant: str) -> str:
        return ref if ref in BASES else (await self.resolve(ref, tenant)).id

    def share(self, ref: str, shared: bool = True) -> Image:
        """Publish an image (by id or the host's reference) to every tenant, or take it back."""
        img = self.store.load_image(self._host_id(ref))
        self.db.share_image(img.id, shared)
        return self._named(img, "")

    def _host_id(self, ref: str) -> str:
        image_id = ref if is_image_id(ref) else self.store.resolve_ref(ref)
        if image_id is None:
            raise ImageNotFound(f"no image {ref!r} here: `fanfold images` lists them")
        return image_id

    def _named(self, img: Image, tenant: str, shared: set[str] | None = None) -> Image:
        shared = self.db.shared_images() if shared is None else shared
        names = {r for r, i in self.store.refs(tenant).items() if i == img.id}
        if tenant and img.id in shared:
            names |= {r for r, i in self.store.refs().items() if i == img.id}
        return dataclasses.replace(img, names=tuple(sorted(names)), shared=img.id in shared)

    def images(self, tenant: str = "") -> list[Image]:
        """Every image ``tenant`` may see (the host's tenant: every image), with the references that name it."""
        shared, grants = self.db.shared_images(), self.db.image_grants()
        names: dict[str, set[str]] = {}
        for owner, ref, image_id in self.store.all_refs():
            if owner == tenant or (owner == "" and image_id in shared):
                names.setdefault(image_id, set()).add(ref)
        return [
            dataclasses.replace(img, names=tuple(sorted(names.get(img.id, ()))), shared=img.id in shared)
            for img in self.store.images()
            if not tenant or img.id in shared or tenant in grants.get(img.id, ()) or _bare_base(img)
        ]

    async def remove(self, ref: str, *, force: bool = False, tenant: str = "") -> str:
        """Remove an image (by id or a reference naming it); returns its id. Refused while a sandbox
        or snapshot uses it unless ``force`` (then only the name goes, and the image stays for them).

        A server tenant removes only its own images: its claim and its names go, and the image
        itself once no tenant, name or share keeps it."""
        if tenant:
            return await self._remove_own(ref, force, tenant)
        image_id = self._host_id(ref)
        self.store.load_image(image_id)  # ImageNotFound for an unknown id
        users = self._users(image_id)
        if users and not force:
            raise ImageInUse(_in_use(image_id, users))
        if not users:
            await self._drop(image_id)
            return image_id
        for name, named in self.store.refs().items():  # forced: only the name(s) go, the image stays for its users
            if named == image_id and (name == ref or is_image_id(ref)):
                self.store.untag(name)
        return image_id

    async def _remove_own(self, ref: str, force: bool, tenant: str) -> str:
        image_id = ref if is_image_id(ref) else self.store.resolve_ref(ref, tenant)
        if image_id is None or tenant not in self.db.image_grants().get(image_id, ()):
            if image_id is not None and image_id in self.db.shared_images():
                raise Unauthorized(f"image {ref!r} is shared by the host's tenant: only it may remove it")
            raise ImageNotFound(f"no image {ref!r} here: `fanfold images` lists them")
        users = self._users(image_id, tenant)
        if users and not force:
            raise ImageInUse(_in_use(image_id, users))
        for name, named in self.store.refs(tenant).items():
            if named == image_id and (name == ref or is_image_id(ref)):
                self.store.untag(name, tenant)
        if users:
            return image_id
        self.db.revoke_image(image_id, tenant)
        for name, named in self.store.refs(tenant).items():
            if named == image_id:
                self.store.untag(name, tenant)
        orphan = not self.db.image_grants().get(image_id) and image_id not in self.db.shared_images()
        if orphan and image_id not in self.store.refs().values() and not self._users(image_id):
            await self._drop(image_id)
        return image_id

    async def _drop(self, image_id: str) -> None:
        """The record, every name in every namespace, every claim and share, and the unpacked image."""
        for owner, name, named in self.store.all_refs():
            if named == image_id and owner:
                self.store.untag(name, owner)
        self.db.revoke_image(image_id)
        await self.oci.remove(image_id)

    def _users(self, image_id: str, tenant: str | None = None) -> set[str]:
        rows = [*self.db.rows(), *self.db.snapshot_rows()]
        return {row["id"] for row in rows if row["image_id"] == image_id and tenant in (None, row["tenant"])}

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
            self.store.remove_layer(path.name)  # a link to a layer taken by reference takes its subvolume
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


def check_tag(tag: str) -> str:
    """A name a build may give its image: a reference (``myenv``, ``team/env:v2``), not a base nor id-shaped."""
    if not isinstance(tag, str) or tag in BASES or is_id_shaped(tag) or not is_image_ref(tag):
        raise InvalidRequest(
            f"cannot name an image {tag!r}: give a name like 'myenv' or 'team/env:v2' (lower case; not a base"
            f" ({', '.join(BASES)}) nor starting with img-, which is how image ids look)"
        )
    return tag


def _bare_base(img: Image) -> bool:
    """A fanfold base with no steps (``host``, ``debian:bookworm``): every tenant may use one."""
    return img.base in BASES and len(img.layers) == 1 and img.id == "img-" + img.layers[0][:16]


NEAR_MISS = 0.8
"""How alike (``difflib``'s ratio) a name must be to a local one to count as a typo of it."""
SUGGEST = 0.6
"""How alike a local name must be to be offered as what was meant."""
def _unpulled(ref: str, err: RegistryUnavailable) -> str:
    """Why a name that is not here counts as missing although pulling it failed, the rule said in full."""
    said = str(err).split(": ", 1)[-1]
    what = ("its registry could not be reached to look for it" if not err.reached
            else "its registry failed, and the name is a near miss of a local one")
    return (f"{what} ({said}). A name not here is RegistryUnavailable (worth a retry) only when its registry was"
            f" reached and failed and the name is no near miss of a local one; if {ref!r} is right, `fanfold pull"
            f" {ref}` once the registry answers")


def _in_use(image_id: str, users: set[str]) -> str:
    return (f"image {image_id} is used by {', '.join(sorted(users)[:5])}{' ...' if len(users) > 5 else ''}:"
            " remove those first, or pass force to drop only its name")

