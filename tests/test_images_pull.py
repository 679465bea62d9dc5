"""Pulling images from a real registry on loopback, and importing them from files.

Every image here is built from plain trees, pushed with skopeo into Debian's reference registry,
and pulled through fanfold's ImageStore into a state dir of the test's own.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gzip
import json
import os
import stat
import time
from pathlib import Path

import pytest

from fanfold.errors import ImageCorrupt, ImageNotFound, InvalidRequest, RegistryDenied, RegistryUnavailable
from fanfold.images.oci import ImageStore, PullEvent
from fanfold.store.rootfs import mount_rootfs, unmount_rootfs
from fanfold.store.layers import LayerStore
from fanfold.runtime.fake import materialize

from registry import (
    OPAQUE, WHITEOUT, Registry, Relay, Symlink, push_image, push_multiarch, push_tree, random_tree, run_registry,
    Layout, layer_tar, write_docker_archive, write_oci_archive, write_oci_layout,
)

BASE = {"etc/os-release": "ID=fanfold-test\n", "etc/gone": "deleted above", "opt/app/old": "hidden by opaque",
        "bin/sh": Symlink("busybox"), "usr/share/keep": "kept"}
TOP = {"etc/gone": WHITEOUT, "opt/app": OPAQUE, "opt/app/new": "shown", "etc/added": "added"}
CONFIG = {"Env": ["PATH=/usr/bin:/bin", "GREETING=hello=world"], "WorkingDir": "/opt/app", "User": "1000:1000",
          "Entrypoint": ["/bin/sh", "-c"], "Cmd": ["echo hi"], "ExposedPorts": {"8000/tcp": {}, "53/udp": {}},
          "Labels": {"team": "rl"}, "Volumes": {"/data": {}},
          "Healthcheck": {"Test": ["CMD-SHELL", "true"], "Interval": 5_000_000_000, "Retries": 2},
          "history": [{"created_by": "ADD base /"}, {"created_by": "ENV GREETING", "empty_layer": True},
                      {"created_by": "COPY top /"}]}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory):
    with run_registry(tmp_path_factory.mktemp("registry")) as running:
        yield running
    assert running.process.poll() is not None


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory):
    """A registry with TLS (its own CA) and htpasswd auth."""
    with run_registry(tmp_path_factory.mktemp("secure"), tls=True, users={"alice": "s3cret-pass"}) as running:
        yield running
    assert running.process.poll() is not None


@pytest.fixture(scope="module")
def pushed(registry: Registry) -> str:
    """The two-layer test image, pushed as ``app:v1``; its ``host/app@digest``."""
    return push_image(registry, "app:v1", [BASE, TOP], config=CONFIG)


@pytest.fixture
def images(tmp_path: Path) -> ImageStore:
    return ImageStore(LayerStore(tmp_path / "state"), tmp_path / "state")


def storage_layers(images: ImageStore) -> list[dict]:
    path = images.storage.graphroot / "overlay-layers/layers.json"
    return json.loads(path.read_text()) if path.exists() else []


def assert_nothing_half_stored(images: ImageStore) -> None:
    """No record, no ref, no symlink, no temp file, no layer containers/storage marks incomplete."""
    assert images.store.images() == []
    assert images.store.refs() == {}
    assert [p.name for p in images.store.layers_dir.iterdir()] == []
    assert list(images.tmp_dir.iterdir()) == []
    assert not [layer for layer in storage_layers(images) if (layer.get("flags") or {}).get("incomplete")]
    assert not [p for p in images.storage.graphroot.glob("overlay/*") if p.is_dir() and p.name != "l" and not (p / "diff").is_dir()]


async def test_pull_by_tag_then_by_digest_stores_layers_once(images: ImageStore, registry: Registry, pushed: str) -> None:
    events: list[PullEvent] = []
    first = await images.pull(f"{registry.host}/app:v1", tls_verify=False, on_progress=events.append)
    assert first.id.startswith("img-") and len(first.id) == 20 and len(first.layers) == 2
    assert first.source == f"registry {registry.host}/app:v1" and first.digest == pushed.split("@")[1]
    assert {e.status for e in events} >= {"waiting", "done"}
    done = [e for e in events if e.status == "done"]
    assert [e.index for e in done] == [0, 1] and all(e.done_bytes == e.total_bytes > 0 for e in done)
    for layer in first.layers:
        assert images.store.layer_path(layer).is_symlink() and images.store.has_layer(layer)
    assert (images.store.layer_path(first.layers[0]) / "etc/os-release").read_text() == "ID=fanfold-test\n"

    events.clear()
    start = time.monotonic()
    again = await images.pull(pushed, tls_verify=False, on_progress=events.append)
    warm = time.monotonic() - start
    assert again.id == first.id and again.layers == first.layers
    assert [e.status for e in events] == ["exists", "exists"] and warm < 5.0
    assert images.store.resolve_ref(pushed) == first.id
    assert images.store.resolve_ref(f"{registry.host}/app:v1") == first.id
    assert len(storage_layers(images)) == 2


async def test_concurrent_pulls_of_one_ref_share_one_copy(images: ImageStore, registry: Registry, pushed: str) -> None:
    ref = f"{registry.host}/app:v1"
    seen: tuple[list[PullEvent], list[PullEvent]] = ([], [])
    one, two = await asyncio.gather(*(images.pull(ref, tls_verify=False, on_progress=events.append) for events in seen))
    assert one == two and len(storage_layers(images)) == 2
    # One pull fetched the layers; the other waited for it and found both stored.
    statuses = sorted(({e.status for e in events} for events in seen), key=len)
    assert statuses[0] == {"exists"} and "done" in statuses[1]


async def test_config_is_honoured(images: ImageStore, pushed: str) -> None:
    image = await images.pull(pushed, tls_verify=False)
    assert image.env == (("PATH", "/usr/bin:/bin"), ("GREETING", "hello=world"))
    assert image.workdir == "/opt/app" and image.user == "1000:1000"
    assert image.entrypoint == ("/bin/sh", "-c") and image.cmd == ("echo hi",)
    assert image.ports == ("53/udp", "8000/tcp") and image.host_dirs == ()
    assert image.labels == (("team", "rl"),) and image.volumes == ("/data",) and image.healthcheck is not None
    assert (image.healthcheck.test, image.healthcheck.interval_s, image.healthcheck.retries) == (("CMD-SHELL", "true"), 5.0, 2)
    assert [(step, layer) for step, layer, _ in image.history] == [
        ("ADD base /", image.layers[0]), ("ENV GREETING", ""), ("COPY top /", image.layers[1])]
    assert all(size > 0 for _, layer, size in image.history if layer)
    assert images.store.load_image(image.id) == image


async def test_whiteouts_and_opaque_dirs_through_overlay_and_the_fake_backend(
        images: ImageStore, pushed: str, tmp_path: Path) -> None:
    image = await images.pull(pushed, tls_verify=False)
    top = images.store.layer_path(image.layers[1])
    gone = os.lstat(top / "etc/gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0  # stored as overlayfs whiteouts
    target, scratch = tmp_path / "root", tmp_path / "scratch"
    scratch.mkdir()
    mount_rootfs(images.store, image.layers, (), target, scratch)
    try:
        assert not (target / "etc/gone").exists()
        assert sorted(os.listdir(target / "opt/app")) == ["new"]
        assert (target / "etc/added").read_text() == "added" and (target / "usr/share/keep").read_text() == "kept"
        assert os.readlink(target / "bin/sh") == "busybox"
    finally:
        unmount_rootfs(target)
    fake_root = tmp_path / "fake"
    materialize([images.store.layer_path(layer) for layer in image.layers], fake_root)
    assert not (fake_root / "etc/gone").exists() and sorted(os.listdir(fake_root / "opt/app")) == ["new"]


async def test_multiarch_index_resolves_to_this_platform(images: ImageStore, registry: Registry) -> None:
    ref = push_multiarch(registry, "multi:v1", {"amd64": [{"arch": "amd64"}], "arm64": [{"arch": "arm64"}]})
    amd = await images.pull(ref, tls_verify=False)
    assert (images.store.layer_path(amd.layers[0]) / "arch").read_text() == "amd64"
    assert amd.digest == ref.split("@")[1]  # the index's digest: what the user pinned
    arm = await images.pull(ref, tls_verify=False, platform="linux/arm64")
    assert arm.id != amd.id and (images.store.layer_path(arm.layers[0]) / "arch").read_text() == "arm64"
    assert images.store.resolve_ref(ref) == amd.id  # another platform's image does not take the name
    with pytest.raises(InvalidRequest, match="platform"):
        await images.pull(ref, tls_verify=False, platform="arm64")


async def test_auth_refused_then_login_lets_the_pull_through(
        secure: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = push_image(secure, "private:v1", [{"secret": "data"}])
    monkeypatch.setenv("FANFOLD_REGISTRY_CERTS", str(secure.certs_dir))
    monkeypatch.delenv("FANFOLD_REGISTRY_AUTH", raising=False)
    # The credentials of the user running fanfold, where containers/image would look: never used.
    home = tmp_path / "home"
    own = {"auths": {secure.host: {"auth": base64.b64encode(b"alice:s3cret-pass").decode()}}}
    for where in (home / ".docker/config.json", home / ".config/containers/auth.json"):
        where.parent.mkdir(parents=True)
        where.write_text(json.dumps(own))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(home / ".docker/config.json"))
    images = ImageStore(LayerStore(tmp_path / "state"), tmp_path / "state")
    with pytest.raises(RegistryDenied, match=f"fanfold login {secure.host}"):
        await images.pull(ref)
    with pytest.raises(RegistryDenied):
        await images.login(secure.host, "alice", "wrong-password")
    await images.login(secure.host, "alice", "s3cret-pass")
    auth = tmp_path / "state/auth.json"
    assert stat.S_IMODE(auth.stat().st_mode) == 0o600 and secure.host in json.loads(auth.read_text())["auths"]
    image = await images.pull(ref)
    assert (images.store.layer_path(image.layers[0]) / "secret").read_text() == "data"
    with pytest.raises(RegistryDenied):  # a server tenant's pull: the host's logins are the host's
        await images.pull(ref, host=False)
    await images.logout(secure.host)
    assert secure.host not in json.loads(auth.read_text()).get("auths", {})


async def test_a_tenants_pull_names_nothing_of_the_hosts(images: ImageStore, registry: Registry) -> None:
    ref = push_image(registry, "tenant-named:v1", [{"a": "1"}])
    image = await images.pull(ref, tls_verify=False, host=False)
    assert images.store.resolve_ref(ref) is None  # the catalog names it for the tenant alone
    assert (images.store.layer_path(image.layers[0]) / "a").read_text() == "1"


async def test_untrusted_tls_and_plain_http_say_what_to_configure(
        images: ImageStore, secure: Registry, registry: Registry, pushed: str) -> None:
    with pytest.raises(InvalidRequest, match="FANFOLD_REGISTRY_CERTS"):
        await images.pull(f"{secure.host}/private:v1")
    with pytest.raises(InvalidRequest, match="FANFOLD_INSECURE_REGISTRIES"):
        await images.pull(pushed)  # verifying TLS against a plain-HTTP registry


async def test_registry_dying_mid_pull_keeps_nothing_and_a_retry_succeeds(
        images: ImageStore, registry: Registry) -> None:
    big = os.urandom(4 << 20)  # incompressible: the transfer is long enough to cut
    ref = push_image(registry, "big:v1", [{"small": "x"}, {"data.bin": big}])
    with Relay(registry.host, cut_after=256 << 10) as relay:
        via = ref.replace(registry.host, relay.host)
        with pytest.raises(RegistryUnavailable, match=relay.host):
            await images.pull(via, tls_verify=False)
        assert relay.cuts >= 1
        assert_nothing_half_stored(images)
        relay.cut_after = None
        image = await images.pull(via, tls_verify=False)
    assert (images.store.layer_path(image.layers[1]) / "data.bin").read_bytes() == big


async def test_corrupt_layer_is_refused(images: ImageStore, registry: Registry, tmp_path: Path) -> None:
    ref = push_image(registry, "corrupt:v1", [{"file": os.urandom(64 << 10)}])
    manifest = json.loads(registry.blob_path(ref.split("@")[1]).read_bytes())
    blob = registry.blob_path(manifest["layers"][0]["digest"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size, another digest
    blob.write_bytes(bytes(data))
    with pytest.raises(ImageCorrupt, match="digest"):
        await images.pull(ref, tls_verify=False)
    assert_nothing_half_stored(images)


async def test_unknown_images_bad_refs_and_dead_registries(images: ImageStore, registry: Registry) -> None:
    with pytest.raises(ImageNotFound):
        await images.pull(f"{registry.host}/app:no-such-tag", tls_verify=False)
    with pytest.raises(ImageNotFound):
        await images.pull(f"{registry.host}/nobody/here:v1", tls_verify=False)
    for bad in ["UPPER/case", "app:", "app@sha256:123", "", "a b"]:
        with pytest.raises(InvalidRequest, match="not an image reference"):
            await images.pull(bad)
    with Relay(registry.host) as relay:
        dead = relay.host
    with pytest.raises(RegistryUnavailable, match=dead):
        await images.pull(f"{dead}/app:v1", tls_verify=False)
    assert_nothing_half_stored(images)


async def test_imports_of_docker_save_oci_layout_and_oci_archive(images: ImageStore, tmp_path: Path) -> None:
    layers = [BASE, TOP]
    write_docker_archive(tmp_path / "saved.tar", layers, config=CONFIG)
    write_oci_layout(tmp_path / "layout", layers, config=CONFIG)
    write_oci_archive(tmp_path / "archive.tar", layers, config=CONFIG)
    saved = await images.import_file(tmp_path / "saved.tar", ref="example.com/saved:v1")
    assert saved.source == f"file {tmp_path / 'saved.tar'}" and saved.cmd == ("echo hi",)
    assert images.store.resolve_ref("example.com/saved:v1") == saved.id
    assert (images.store.layer_path(saved.layers[1]) / "opt/app/new").read_text() == "shown"
    events: list[PullEvent] = []
    layout = await images.import_file(tmp_path / "layout", on_progress=events.append)
    archive = await images.import_file(tmp_path / "archive.tar")
    assert saved.id == layout.id == archive.id and saved.layers == layout.layers == archive.layers
    assert [e.status for e in events] == ["exists", "exists"]  # same layers, stored once
    assert len(storage_layers(images)) == 2
    gzipped = tmp_path / "saved.tar.gz"
    gzipped.write_bytes(gzip.compress((tmp_path / "saved.tar").read_bytes(), compresslevel=1))
    assert (await images.import_file(gzipped)).id == saved.id  # `docker save | gzip`
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all")
    with pytest.raises(InvalidRequest, match="not an image archive"):
        await images.import_file(tmp_path / "junk.tar")
    with pytest.raises(InvalidRequest, match="no such file"):
        await images.import_file(tmp_path / "missing.tar")


async def test_remove_and_gc_leave_no_storage_layers_or_links(images: ImageStore, registry: Registry, pushed: str) -> None:
    other_ref = push_image(registry, "other:v1", [BASE, {"other": "layer"}])
    app = await images.pull(pushed, tls_verify=False)
    other = await images.pull(other_ref, tls_verify=False)
    assert app.layers[0] == other.layers[0] and len(storage_layers(images)) == 3  # the base layer is shared
    await images.remove(app.id)
    assert images.store.resolve_ref(pushed) is None
    with pytest.raises(ImageNotFound):
        images.store.load_image(app.id)
    assert await images.gc(images.layers_in_use()) == [app.layers[1]]
    assert {layer["id"] for layer in storage_layers(images)} == set(other.layers)
    assert not images.store.layer_path(app.layers[1]).is_symlink() and images.store.has_layer(other.layers[0])
    await images.remove(other.id)
    assert sorted(await images.gc(images.layers_in_use())) == sorted(other.layers)
    assert storage_layers(images) == [] and list(images.store.layers_dir.iterdir()) == []
    assert json.loads((images.storage.graphroot / "overlay-images/images.json").read_text()) == []
    with pytest.raises(ImageNotFound):
        await images.remove(app.id)


async def test_a_pull_cancelled_mid_transfer_kills_skopeo_and_keeps_nothing(
        images: ImageStore, registry: Registry) -> None:
    ref = push_image(registry, "hang:v1", [{"data.bin": os.urandom(2 << 20)}])
    with Relay(registry.host, cut_after=256 << 10, stall=True) as relay:
        pull = asyncio.create_task(images.pull(ref.replace(registry.host, relay.host), tls_verify=False))
        deadline = time.monotonic() + 30
        while relay.cuts == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert relay.cuts == 1 and not pull.done()
        pull.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pull
    assert_nothing_half_stored(images)
    image = await images.pull(ref, tls_verify=False)
    assert images.store.has_layer(image.layers[0])


@pytest.mark.parametrize("progress", [True, False], ids=["followed", "unfollowed"])
async def test_a_registry_that_stalls_mid_blob_fails_the_pull_in_its_stall_time(
        images: ImageStore, registry: Registry, progress: bool) -> None:
    """A registry that stops sending (the connection open, silent) fails the pull with
    RegistryUnavailable once ``stall_s`` passes without a byte, and skopeo is gone with it."""
    ref = push_image(registry, f"stall-{str(progress).lower()}:v1", [{"data.bin": os.urandom(2 << 20)}])
    images.options = dataclasses.replace(images.options, stall_s=3.0)
    with Relay(registry.host, cut_after=256 << 10, stall=True) as relay:
        began = time.monotonic()
        with pytest.raises(RegistryUnavailable, match=r"sent nothing for 3s in the middle of a pull"):
            await asyncio.wait_for(images.pull(ref.replace(registry.host, relay.host), tls_verify=False,
                                               on_progress=[].append if progress else None), 60)
        assert relay.cuts == 1 and time.monotonic() - began < 30
        assert not skopeo_running(images), "the stalled skopeo was left running"
    assert_nothing_half_stored(images)


async def test_pulls_waiting_behind_one_that_finds_a_stall_fail_with_it(images: ImageStore, registry: Registry) -> None:
    """Three callers pull one image from a registry that stalls: the two that waited their turn fail
    as the first did, at once, rather than each waiting out the stall again."""
    ref = push_image(registry, "stall-shared:v1", [{"data.bin": os.urandom(2 << 20)}])
    images.options = dataclasses.replace(images.options, stall_s=3.0)
    with Relay(registry.host, cut_after=256 << 10, stall=True) as relay:
        pulls = [images.pull(ref.replace(registry.host, relay.host), tls_verify=False) for _ in range(3)]
        failed = await asyncio.wait_for(asyncio.gather(*pulls, return_exceptions=True), 60)
        assert all(isinstance(err, RegistryUnavailable) for err in failed), failed
        assert sum("this one waited for" in str(err) for err in failed) == 2
        assert relay.cuts == 1  # only the first reached the blob
    assert_nothing_half_stored(images)
    assert (await images.pull(ref, tls_verify=False)).layers  # the registry itself, later: fine


def skopeo_running(images: ImageStore) -> bool:
    """Whether a skopeo process works on this store's storage."""
    root = str(images.storage.graphroot).encode()
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if argv.split(b"\0")[0].endswith(b"skopeo") and root in argv:
            return True
    return False


async def test_an_image_pushed_from_trees_on_disk(images: ImageStore, registry: Registry, tmp_path: Path) -> None:
    lower = random_tree(tmp_path / "lower", 3 << 20, files=3)
    upper = tmp_path / "upper"
    (upper / "srv").mkdir(parents=True)
    (upper / "srv/run.sh").write_text("#!/bin/sh\necho up\n")
    (upper / "srv/run.sh").chmod(0o755)
    ref = push_tree(registry, "tree:v1", [lower, upper], config={"Cmd": ["/srv/run.sh"]})
    events: list[PullEvent] = []
    image = await images.pull(ref, tls_verify=False, on_progress=events.append)
    bottom, top = (images.store.layer_path(layer) for layer in image.layers)
    assert (bottom / "blob1.bin").read_bytes() == (lower / "blob1.bin").read_bytes()
    assert os.stat(top / "srv/run.sh").st_mode & 0o777 == 0o755 and image.cmd == ("/srv/run.sh",)
    big = [e for e in events if e.index == 0]
    assert big[0].status == "waiting" and big[-1].status == "done" and big[-1].total_bytes > 3 << 20


async def test_a_layout_of_several_images_imports_the_one_ref_names(images: ImageStore, tmp_path: Path) -> None:
    layout = Layout(tmp_path / "layout")
    for tag in ("one", "two"):
        layout.add(layout.image([layer_tar({"which": tag})])[0], tag)
    with pytest.raises(InvalidRequest, match="holds 2 images"):
        await images.import_file(layout.path)
    two = await images.import_file(layout.path, ref="example.com/pair:two")
    assert (images.store.layer_path(two.layers[0]) / "which").read_text() == "two"
    assert images.store.resolve_ref("example.com/pair:two") == two.id
