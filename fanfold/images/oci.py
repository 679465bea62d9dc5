"""Images from OCI/Docker v2 registries and from files, their layers stored once by digest.

skopeo fetches and verifies, containers/storage unpacks (see ``registry.py``); each unpacked
layer is then named in the LayerStore as ``layers/<chain id[:32]>``, a symlink to its diff dir,
so overlay mounts and the fake backend use it like any built layer. Images share layers by
chain id. A pull that fails leaves no image record, no symlink and no temp files; complete
layers it unpacked stay in storage for the retry to reuse, and ``gc`` deletes them otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Awaitable

from ..errors import ImageCorrupt, ImageNotFound, InvalidRequest, RegistryUnavailable
from .progress import LayerProgress, OnPull, PullEvent
from .registry import (
    Options, Route, Storage, chain_ids, choose_platform, decompress, file_transport, is_registry_host,
    parse_platform, parse_ref, skopeo, skopeo_copy,
)
from ..store import Image, LayerStore
from ..store.layers import Healthcheck

__all__ = ["ImageStore", "OnPull", "PullEvent"]

INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")


@dataclass(frozen=True)
class _Source:
    transport: str
    """What skopeo reads: ``docker://REF``, ``oci:DIR``, ``oci-archive:FILE``, ``docker-archive:FILE``."""
    registry: str
    """Who errors name: the registry host, or the file."""
    flags: tuple[str, ...]
    """Connection flags for ``skopeo inspect`` (copy takes the same with a ``src-`` prefix)."""
    base: str
    source: str
    refs: tuple[str, ...]
    """What the image gets tagged as in the store's ref index."""
    repository: str = ""
    """For a registry: the repository, whose ``repository@digest`` names the image too (with ``tag_digest``)."""
    tag_digest: bool = True
    route: Route | None = None
    """How skopeo goes out (a server tenant's pull); None: straight from the host."""

    @property
    def is_file(self) -> bool:
        return not self.transport.startswith("docker://")


class ImageStore:
    """Pulls and imports images into ``store``, with containers/storage under ``state_dir``."""

    def __init__(self, store: LayerStore, state_dir: Path) -> None:
        self.store = store
        self.storage = Storage(state_dir)
        self.options = Options.from_env(state_dir)
        self.tmp_dir = state_dir / "storage-tmp"
        self.tmp_dir.mkdir(exist_ok=True)
        self._active = 0
        self._pulls = asyncio.Condition()
        self._unavailable: dict[tuple[str, tuple[str, ...], str | None], tuple[float, RegistryUnavailable]] = {}
        """When a pull of a source last found its registry unavailable, and how (``_in_turn``)."""
        """Guards ``_active``; gc holds it while it deletes, so no pull starts meanwhile."""
        self.discard_tmp()

    # -- pulling and importing ------------------------------------------------------------------

    async def pull(self, ref: str, *, platform: str | None = None, tls_verify: bool | None = None,
                   on_progress: OnPull | None = None, host: bool = True, route: Route | None = None) -> Image:
        """Pull ``ref`` (tag or digest) from its registry; an index resolves to ``platform`` (default: this host's).
        ``host=False`` (a server tenant's pull): without the host's registry logins, and naming nothing in
        the host's names (the caller names it for the tenant); ``route``: how skopeo goes out."""
        parsed = parse_ref(ref)
        repo = ref.split("@")[0]
        if parsed.tag:
            repo = repo[: repo.rindex(":")]
        name = f"{repo}@{parsed.digest}" if parsed.digest else ref  # skopeo takes a tag or a digest, not both
        flags = tuple(self.options.flags(parsed.registry, tls_verify, anonymous=not host))
        # Another platform's image is known by its id only: the name keeps meaning what runs here.
        native = parse_platform(platform)[:2] == parse_platform(None)[:2] and host
        source = _Source(f"docker://{name}", parsed.registry, flags, ref, f"registry {ref}",
                         (ref,) if native else (), repo, tag_digest=native, route=route)
        return await self._fetch(source, platform, on_progress)

    async def import_file(self, path: Path, *, ref: str | None = None, on_progress: OnPull | None = None) -> Image:
        """Import a ``docker save`` tarball, an OCI layout dir or an OCI archive; it is named ``ref`` if given
        (else known by its id only)."""
        path = Path(path).absolute()
        if ref is not None:
            parse_ref(ref)  # an InvalidRequest that explains the grammar
        transport = await asyncio.to_thread(file_transport, path, ref)
        refs = (ref,) if ref else ()
        plain = self.tmp_dir / f"import-{os.getpid()}-{uuid.uuid4().hex[:8]}.tar"
        try:
            if transport.startswith("docker-archive:") and await asyncio.to_thread(decompress, path, plain):
                transport = f"docker-archive:{plain}"  # skopeo reads only uncompressed `docker save` files
            source = _Source(transport, str(path), (), ref or str(path), f"file {path}", refs)
            return await self._fetch(source, None, on_progress)
        finally:
            plain.unlink(missing_ok=True)

    async def _fetch(self, source: _Source, platform: str | None, on_progress: OnPull | None) -> Image:
        async with self.store.making():  # its layers are linked before its record names them
            return await self._fetch_made(source, platform, on_progress)

    async def _fetch_made(self, source: _Source, platform: str | None, on_progress: OnPull | None) -> Image:
        os_, arch, variant = parse_platform(platform)
        overrides = ["--override-os", os_, "--override-arch", arch] + (["--override-variant", variant] if variant else [])
        async with self._pulls:
            self._active += 1
        try:
            async with self._in_turn(source, platform):
                raw, config_raw = await _both(
                    self._skopeo(["inspect", "--raw", *source.flags, source.transport], source),
                    self._skopeo([*overrides, "inspect", "--config", "--raw", *source.flags, source.transport], source),
                )
                config = _json(config_raw, source)
                diff_ids = config.get("rootfs", {}).get("diff_ids") or []
                if not diff_ids:
                    raise ImageCorrupt(f"the image in {source.base} has no layers (its config lists no rootfs.diff_ids)")
                if _json(raw, source).get("mediaType") not in INDEX_TYPES and config.get("architecture") not in (None, arch):
                    raise InvalidRequest(f"{source.base} is for {config.get('os')}/{config.get('architecture')}, not"
                                         f" {os_}/{arch}: pick another tag or pass platform=")
                config_digest = hashlib.sha256(config_raw).hexdigest()
                chain = chain_ids(diff_ids)
                stored = self._stored_layers()
                if not all(layer in stored for layer in chain):
                    await self._copy(source, overrides, config_digest, chain, stored, on_progress, raw, (os_, arch, variant))
                    stored = self._stored_layers()
                    if not all(layer in stored for layer in chain):
                        raise ImageCorrupt(f"unpacking {source.base} did not yield the layers its config names")
                elif on_progress is not None:
                    for i, layer in enumerate(chain):
                        size = stored[layer].get("compressed-size") or 0
                        on_progress(PullEvent(layer, i, len(chain), size, size, "exists"))
                for layer in chain:
                    self._link(layer)
                image = await asyncio.to_thread(self._record, config, config_digest, chain, source,
                                                "sha256:" + hashlib.sha256(raw).hexdigest())
                digest_ref = (f"{source.repository}@{image.digest}",) if source.repository and source.tag_digest else ()
                for ref in source.refs + digest_ref:
                    self.store.tag(ref, image.id)
                return image
        finally:
            async with self._pulls:
                self._active -= 1
                self._pulls.notify_all()

    @contextlib.asynccontextmanager
    async def _in_turn(self, source: _Source, platform: str | None) -> AsyncIterator[None]:
        """One pull of a source at a time. One that waited behind a pull that found the registry
        unavailable (stalled, down) fails as it did, rather than waiting out the same stall again:
        N callers of a stalled registry wait one stall, not N."""
        key = (source.transport, source.flags, platform)
        started = time.monotonic()
        async with self.store.alock(hashlib.sha256(f"pull:{source.transport}".encode()).hexdigest()):
            failed = self._unavailable.get(key)
            if failed is not None and failed[0] >= started:
                raise RegistryUnavailable(f"{failed[1]} (found by a pull of the same image this one waited for)",
                                          reached=failed[1].reached)
            try:
                yield
            except RegistryUnavailable as err:
                self._unavailable[key] = (time.monotonic(), err)
                raise
            self._unavailable.pop(key, None)

    async def _copy(self, source: _Source, overrides: list[str], config_digest: str, chain: list[str],
                    stored: dict[str, dict], on_progress: OnPull | None, raw: bytes,
                    platform: tuple[str, str, str]) -> None:
        """Copy the image into storage, reporting per-layer progress; on any failure delete the temp files."""
        work = self.tmp_dir / f"pull-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        work.mkdir()
        src_flags = [f.replace("--", "--src-", 1) for f in source.flags]
        dest = self.storage.transport(f"localhost/fanfold/sha256-{config_digest}:latest")
        argv = ["--insecure-policy", "--tmpdir", str(work), *overrides, "copy", *src_flags, source.transport, dest]
        try:
            report = None if on_progress is None else \
                LayerProgress(chain, stored, await self._layer_blobs(source, raw, platform), on_progress)
            await skopeo_copy(argv, registry=source.registry, file=source.is_file,
                              on_blob=report.blob if report else _ignore, route=source.route,
                              stall_s=self.options.stall_s)
            if report is not None:
                report.finish(self._stored_layers())
        except BaseException:
            # skopeo killed while unpacking leaves a layer flagged incomplete; containers/storage
            # deletes such layers whenever it next opens the store for writing, as listing does.
            with contextlib.suppress(Exception):  # the pull's own failure is the one to report
                await asyncio.shield(self.storage.layers())
            raise
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)

    async def _layer_blobs(self, source: _Source, raw: bytes, platform: tuple[str, str, str]) -> list[tuple[str, int]]:
        """Each layer's blob digest and size from the manifest (an index resolved to ``platform``); [] if unknown."""
        manifest = _json(raw, source)
        if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
            chosen = choose_platform(manifest.get("manifests") or [], platform)
            if chosen is None:
                return []
            if source.transport.startswith("docker://"):
                name = f"docker://{source.repository}@{chosen}"
                manifest = _json(await self._skopeo(["inspect", "--raw", *source.flags, name], source), source)
            elif source.transport.startswith("oci:"):
                blob = Path(source.registry) / "blobs/sha256" / chosen.removeprefix("sha256:")
                manifest = _json(await asyncio.to_thread(blob.read_bytes), source) if blob.is_file() else {}
            else:
                return []
        return [(str(layer.get("digest") or ""), int(layer.get("size") or 0)) for layer in manifest.get("layers") or []]

    async def _skopeo(self, args: list[str], source: _Source) -> bytes:
        """One short skopeo call (an inspect): a registry that has not answered in ``stall_s`` is stalled."""
        return await skopeo(args, registry=source.registry, file=source.is_file, route=source.route,
                            timeout=self.options.stall_s)

    def _stored_layers(self) -> dict[str, dict]:
        """Complete layers in storage by id (read from its layers.json, which it replaces atomically)."""
        try:
            layers = json.loads((self.storage.graphroot / "overlay-layers/layers.json").read_text())
        except (OSError, ValueError):
            return {}
        return {layer["id"]: layer for layer in layers or []
                if not (layer.get("flags") or {}).get("incomplete") and self.storage.diff_dir(layer["id"]).is_dir()}

    def _link(self, layer: str) -> None:
        link = self.store.layer_path(layer)
        target = self.storage.diff_dir(layer)
        if link.is_symlink() and Path(os.readlink(link)) == target:
            return
        tmp = link.with_name(f".link-{uuid.uuid4().hex[:8]}")
        tmp.symlink_to(target)
        tmp.rename(link)

    def _record(self, config: dict, config_digest: str, chain: list[str], source: _Source, digest: str) -> Image:
        image_id = "img-" + config_digest[:16]
        try:
            return self.store.load_image(image_id)  # records are immutable: the first pull's stays
        except ImageNotFound:
            pass
        settings = config.get("config") or {}
        env = tuple(tuple(item.split("=", 1)) if "=" in item else (item, "") for item in settings.get("Env") or [])
        image = Image(
            id=image_id, base=source.base, layers=tuple(chain), host_dirs=(), env=env,
            workdir=settings.get("WorkingDir") or "/", user=settings.get("User") or "",
            entrypoint=tuple(settings.get("Entrypoint") or ()), cmd=tuple(settings.get("Cmd") or ()),
            ports=tuple(sorted(settings.get("ExposedPorts") or {})), source=source.source, digest=digest,
            labels=tuple(sorted((str(k), str(v)) for k, v in (settings.get("Labels") or {}).items())),
            volumes=tuple(sorted(settings.get("Volumes") or {})), healthcheck=_healthcheck(settings.get("Healthcheck")),
            history=self._history(config.get("history"), chain),
        )
        self.store.save_image(image)
        return image

    def _history(self, entries: object, chain: list[str]) -> tuple[tuple[str, str, int], ...]:
        """The config's history (the step that made each layer, and those that made none) with each layer's
        size; when it does not account for every layer, the layers alone."""
        steps = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
        if sum(1 for e in steps if not e.get("empty_layer")) != len(chain):
            steps = [{} for _ in chain]
        layers = iter(chain)
        history = []
        for entry in steps:
            made_by = str(entry.get("created_by") or entry.get("comment") or "")
            layer = "" if entry.get("empty_layer") else next(layers)
            history.append((made_by, layer, self.store.layer_size(layer) if layer else 0))
        return tuple(history)

    # -- credentials ----------------------------------------------------------------------------

    async def login(self, registry: str, username: str, password: str) -> None:
        """Check the credentials against ``registry`` and save them to the auth file (mode 0600)."""
        if not is_registry_host(registry):
            raise InvalidRequest(f"{registry!r} is not a registry host: write HOST[:PORT], e.g. ghcr.io or localhost:5000")
        auth = self.options.auth_file
        auth.parent.mkdir(parents=True, exist_ok=True)
        flags = self.options.flags(registry, None)
        read, write = os.pipe()
        try:
            os.write(write, password.encode())
            os.close(write)
            write = -1
            await skopeo(["login", *flags, "--username", username, "--password-stdin", registry],
                         registry=registry, fds={0: read})
        finally:
            os.close(read)
            if write >= 0:
                os.close(write)
        os.chmod(auth, 0o600)

    async def logout(self, registry: str) -> None:
        """Forget the saved credentials for ``registry`` (none saved: nothing to do)."""
        if not self.options.auth_file.exists():
            return
        data = json.loads(self.options.auth_file.read_text() or "{}")
        if registry in (data.get("auths") or {}):
            await skopeo(["logout", f"--authfile={self.options.auth_file}", registry], registry=registry)

    # -- removal and collection -----------------------------------------------------------------

    async def remove(self, image_id: str) -> None:
        """Delete an image's record, its refs and its storage image; its layers stay for ``gc``."""
        self.store.load_image(image_id)  # ImageNotFound if there is none
        for ref, named in self.store.refs().items():
            if named == image_id:
                self.store.untag(ref)
        self.store.drop_image(image_id)
        doomed = [i["id"] for i in await self.storage.images() if "img-" + i["id"][:16] == image_id]
        if doomed:
            await self.storage.cli("delete", *doomed)

    def layers_in_use(self) -> set[str]:
        """The layer ids of every image record on disk."""
        return {layer for image in self.store.images() for layer in image.layers}

    async def gc(self, keep: set[str]) -> list[str]:
        """Delete storage images without a record, and storage layers (with their symlinks) not in ``keep``
        (which names at least ``layers_in_use()``: every image record's layers).

        Waits for this process's pulls in flight (their layers have no record yet); the caller holds
        ``LayerStore.collecting``, which keeps other processes' pulls and builds out meanwhile.
        """
        if not (self.storage.graphroot / "overlay-layers").is_dir():
            return []  # nothing was ever pulled or imported here
        async with self._pulls:
            await self._pulls.wait_for(lambda: self._active == 0)
            return await self._collect(keep)

    async def _collect(self, keep: set[str]) -> list[str]:
        keep32 = {k[:32] for k in keep}
        records = {image.id for image in self.store.images()}
        orphans = [i["id"] for i in await self.storage.images() if "img-" + i["id"][:16] not in records]
        if orphans:
            await self.storage.cli("delete", *orphans)
        layers = {layer["id"]: layer for layer in await self.storage.layers()}
        kept = {lid for lid in layers if lid[:32] in keep32}
        for lid in list(kept):  # a kept layer's parents stay too
            parent = layers[lid].get("parent")
            while parent and parent in layers and parent not in kept:
                kept.add(parent)
                parent = layers[parent].get("parent")
        doomed = sorted(set(layers) - kept, key=lambda lid: -_depth(layers, lid))  # children first
        if doomed:
            await self.storage.cli("delete", *doomed)
        for link in self.store.layers_dir.iterdir():  # the doomed layers' links, and any whose layer is gone
            if link.is_symlink() and os.readlink(link).startswith(str(self.storage.graphroot)) and not link.exists():
                link.unlink()
                self.store.forget_size(link.name)
        return doomed

    def discard_tmp(self) -> None:
        """Remove temp files of pulls and imports whose process died (skopeo's partial blobs, decompressed archives)."""
        for path in [*self.tmp_dir.glob("pull-*"), *self.tmp_dir.glob("import-*")]:
            pid = path.name.split("-")[1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)


def _healthcheck(data: object) -> Healthcheck | None:
    """An OCI/Docker config's Healthcheck (durations in nanoseconds), or None when it has none."""
    if not isinstance(data, dict) or not isinstance(data.get("Test"), list) or not data["Test"]:
        return None
    seconds = {name: float(data.get(key) or default) / 1e9 for name, key, default in (
        ("interval_s", "Interval", 30e9), ("timeout_s", "Timeout", 30e9), ("start_period_s", "StartPeriod", 0))}
    return Healthcheck(test=tuple(str(t) for t in data["Test"]), retries=int(data.get("Retries") or 3), **seconds)


async def _both(first: Awaitable[bytes], second: Awaitable[bytes]) -> list[bytes]:
    """Await both to the end (a failed inspect makes its twin fail fast too), then raise the first failure."""
    results = await asyncio.gather(first, second, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _depth(layers: dict[str, dict], lid: str) -> int:
    depth = 0
    while (lid := layers.get(lid, {}).get("parent")) and depth < 1000:
        depth += 1
    return depth


def _json(data: bytes, source: _Source) -> dict:
    try:
        value = json.loads(data)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ImageCorrupt(f"{source.base} gave a manifest or config that is not a JSON object")
    return value


def _ignore(short: str, size: int, done: bool) -> None:
    """No one follows this copy's progress (its stall watch still does)."""
