"""Images from a real registry and from files, through the SDK (embedded and over HTTP) and the CLI.

A real registry (Debian's reference one) runs on loopback; images are runnable trees of the
host's shell and coreutils, pushed with skopeo. tests/test_images_pull.py covers the pull
machinery itself (auth, TLS, corrupt and broken transfers, whiteouts).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from fanfold import (
    AsyncFleet, EngineConfig, EnvSpec, ImageInUse, ImageNotFound, InvalidRequest, RegistryUnavailable, Unauthorized,
)
from fanfold.images import LayerStore

from conftest import run_cli
from registry import push_tree, runnable_tree, write_docker_archive, write_oci_layout

CONFIG = {"Env": ["PATH=/usr/bin:/bin", "GREETING=hello"], "WorkingDir": "/srv/app", "User": "app",
          "Entrypoint": ["/bin/sh", "-c"], "Cmd": ["echo from-cmd; id -u"], "ExposedPorts": {"8000/tcp": {}}}


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A runnable base and an app layer on top."""
    where = tmp_path_factory.mktemp("trees")
    base = runnable_tree(where / "base")
    app = where / "app"
    (app / "srv/app").mkdir(parents=True)
    (app / "srv/app/hello.txt").write_text("hi\n")
    return [base, app]


@pytest.fixture(scope="module")
def app(registry, trees: list[Path]) -> str:
    """``app:v1`` pushed; its ``host/app@sha256:...``."""
    return push_tree(registry, "app:v1", trees, config=CONFIG)


@pytest.fixture(params=["embedded", "unix"])
async def ifleet(request: pytest.FixtureRequest, config: EngineConfig, registry):
    args = {"config": config} if request.param == "embedded" else {"url": request.getfixturevalue("image_server").unix_url}
    async with AsyncFleet(**args) as fleet:
        yield fleet


async def test_a_pulled_image_runs_with_its_config(ifleet: AsyncFleet, registry, app: str) -> None:
    tag = f"{registry.host}/app:v1"
    events = []
    image = await ifleet.pull(tag, on_progress=events.append)
    assert image.source == f"registry {tag}" and tag in image.names and image.digest == app.partition("@")[2]
    assert (image.user, image.workdir, image.ports) == ("app", "/srv/app", ("8000/tcp",))
    assert (image.entrypoint, image.cmd) == (("/bin/sh", "-c"), ("echo from-cmd; id -u",))
    assert {e.layer for e in events} == set(image.layers) and {e.status for e in events} <= {"waiting", "pulling", "done", "exists"}
    async with await ifleet.create(tag) as sandbox:
        assert sandbox.info.image_id == image.id
        result = await sandbox.exec("pwd; echo $GREETING; id -u; cat hello.txt; echo $HOME")
        assert result.ok and result.text.split() == ["/srv/app", "hello", "1000", "hi", "/home/app"]
        assert (await sandbox.exec("id -u", user="root")).text == "0\n"
    listed = {i.id: i for i in await ifleet.images()}
    assert tag in listed[image.id].names and listed[image.id].source == image.source


async def test_specs_build_on_a_pulled_image_and_share_its_layers(ifleet: AsyncFleet, app: str) -> None:
    spec = EnvSpec(app).user("root").run("echo built > /srv/app/built").env(MORE="1")
    built = await ifleet.build(spec)
    base = await ifleet.pull(app)
    assert built.layers[:len(base.layers)] == base.layers and len(built.layers) == len(base.layers) + 1
    assert built.base == app and built.workdir == "/srv/app" and built.cmd == base.cmd
    steps = []
    assert (await ifleet.build(spec, on_step=steps.append)).id == built.id
    assert {s.status for s in steps if s.index > 0} == {"cached"}
    async with await ifleet.create(built) as sandbox:
        result = await sandbox.exec("cat built; echo $GREETING$MORE; id -u")
        assert result.text.split() == ["built", "hello1", "0"]


async def test_a_create_from_a_reference_never_pulled_pulls_it(config: EngineConfig, registry, trees) -> None:
    ref = push_tree(registry, "fresh:v1", trees, config=CONFIG)
    async with AsyncFleet(config=config) as fleet:
        assert ref not in {name for i in await fleet.images() for name in i.names}
        async with await fleet.create(ref) as sandbox:
            assert (await sandbox.exec("cat hello.txt")).text == "hi\n"
        assert ref in {name for i in await fleet.images() for name in i.names}


async def test_imports_of_files_over_both_transports(ifleet: AsyncFleet, tmp_path: Path) -> None:
    layers = [{"etc/passwd": "root:x:0:0::/root:/bin/sh\n", "data/one": "1\n"}, {"data/two": "2\n"}]
    saved = write_docker_archive(tmp_path / "saved.tar", layers, config={"Env": ["K=v"], "WorkingDir": "/data"},
                                 tag="example.com/saved:v1")
    first = await ifleet.import_image(tmp_path / "saved.tar")
    assert first.source.startswith("file ") and first.env == (("K", "v"),) and first.workdir == "/data"
    # the record is the archive's own image: its id from the config's digest, its first layer the first diff id
    assert first.id == "img-" + hashlib.sha256(saved).hexdigest()[:16]
    assert len(first.layers) == 2 and "sha256:" + first.layers[0] == json.loads(saved)["rootfs"]["diff_ids"][0]
    write_oci_layout(tmp_path / "layout", layers, config={"Env": ["K=v"], "WorkingDir": "/data"})
    second = await ifleet.import_image(tmp_path / "layout", ref="example.com/layout:v1")
    assert "example.com/layout:v1" in second.names and second.layers == first.layers  # layers stored once
    with pytest.raises(ImageNotFound):
        await ifleet.remove_image("example.com/never:v1")
    for image in {first.id, second.id}:
        assert await ifleet.remove_image(image) == image


async def test_an_unreachable_registry_is_retryable_over_both_transports(ifleet: AsyncFleet) -> None:
    with pytest.raises(RegistryUnavailable, match="127.0.0.1:1"):
        await ifleet.pull("127.0.0.1:1/none:v1")


async def test_a_host_that_never_pulls_refuses_a_reference_it_lacks(server, registry, app: str) -> None:
    async with AsyncFleet(server.unix_url) as fleet:  # the session's server runs with FANFOLD_PULL=never
        with pytest.raises(ImageNotFound, match="never pulled here.*fanfold pull"):
            await fleet.create(f"{registry.host}/never-pulled:v1")


async def test_tenants_may_not_name_images_nor_make_a_never_pulling_host_fetch(server, registry, tmp_path: Path) -> None:
    write_oci_layout(tmp_path / "layout", [{"data/one": "1\n"}])
    async with AsyncFleet(server.tcp_url, token=server.tokens["alice"]) as tenant:
        with pytest.raises(Unauthorized, match="name imported images"):  # else it could stand in for python:3.12
            await tenant.import_image(tmp_path / "layout", ref="python:3.12-slim")
        unnamed = await tenant.import_image(tmp_path / "layout")
        assert unnamed.names == () and unnamed.source.startswith("file ")
        with pytest.raises(Unauthorized, match="FANFOLD_PULL=never"):
            await tenant.pull(f"{registry.host}/app:v1")


async def test_remove_is_refused_while_used_and_gc_then_frees_the_layers(config: EngineConfig, registry,
                                                                         tmp_path: Path) -> None:
    own = tmp_path / "own"
    (own / "marker").mkdir(parents=True)
    (own / "marker/unique").write_text(f"{time.time_ns()}\n")  # a layer no other image has
    ref = push_tree(registry, "gc:v1", [runnable_tree(tmp_path / "base"), own], config=CONFIG)
    store = LayerStore(config.state_dir)
    async with AsyncFleet(config=config) as fleet:
        image = await fleet.pull(ref)
        unique = store.layer_path(image.layers[-1])
        async with await fleet.create(ref):
            with pytest.raises(ImageInUse, match="used by sb-"):
                await fleet.remove_image(ref)
        assert await fleet.remove_image(ref) == image.id
        assert image.id not in {i.id for i in await fleet.images()}
        target = unique.resolve()
        removed = await fleet.gc()
        assert f"layer:{unique.name}" in removed
        assert not os.path.lexists(unique) and not target.exists()


def test_the_cli_pulls_lists_runs_the_default_command_and_removes(registry, app: str) -> None:
    tag = f"{registry.host}/app:v1"
    pulled = run_cli("pull", "-q", tag)
    assert pulled.returncode == 0, pulled.stderr
    image_id = pulled.stdout.strip()
    assert image_id.startswith("img-")
    listing = run_cli("images")
    assert listing.returncode == 0 and image_id in listing.stderr + listing.stdout and tag in listing.stderr + listing.stdout
    ran = run_cli("run", "--image", tag)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["from-cmd", "1000"]
    as_root = run_cli("run", "--image", tag, "--user", "root", "--", "id -u")  # after its entrypoint, sh -c
    assert as_root.stdout == "0\n", as_root.stderr
    no_default = run_cli("run", "--image", "host")
    assert no_default.returncode == 2 and "no default command" in no_default.stderr
    removed = run_cli("rmi", tag)
    assert removed.returncode == 0 and removed.stdout.strip() == image_id, removed.stderr


@contextmanager
def failing_registry(status: int = 503) -> Iterator[str]:
    """A plain-HTTP server on loopback that answers every request with ``status``: a registry that is up and
    failing. Its ``host:port``, named in FANFOLD_INSECURE_REGISTRIES while it runs."""

    class Failing(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host = f"127.0.0.1:{server.server_address[1]}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FANFOLD_INSECURE_REGISTRIES", ",".join(filter(None, [os.environ.get("FANFOLD_INSECURE_REGISTRIES"), host])))
        try:
            yield host
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)


async def test_a_mistyped_name_is_not_found_and_names_what_was_meant(ifleet: AsyncFleet) -> None:
    name = f"localhost:1/typo-{os.getpid()}:v1"  # nothing listens on port 1: the registry cannot be reached
    built = await ifleet.build(EnvSpec("host").env(MARK="typo"), tag=name)
    assert name in built.names
    async with await ifleet.create(name) as sandbox:  # a build's name is used as a pulled reference's is
        assert (await sandbox.exec("echo $MARK")).text.strip() == "typo"
    started = time.monotonic()
    with pytest.raises(ImageNotFound, match=f"did you mean {re.escape(name)}") as typo:
        await ifleet.create(name.replace("typo-", "typ-"))
    assert "could not be reached" in str(typo.value) and "fanfold build -t NAME" in str(typo.value)
    with pytest.raises(ImageNotFound, match="never pulled") as shaped:  # id-shaped names never reach a registry
        await ifleet.create("img-deadbeef")
    assert "img-" in str(shaped.value) and time.monotonic() - started < 30
    with pytest.raises(ImageNotFound, match="did you mean debian:bookworm"):  # docker.io: unreachable, or a 404
        await ifleet.create("debian:bookwrom")
    with pytest.raises(InvalidRequest, match="never pulled"):
        await ifleet.pull("img-deadbeef")
    with pytest.raises(InvalidRequest, match="cannot name an image 'img-x'"):
        await ifleet.build(EnvSpec("host"), tag="img-x")
    assert await ifleet.remove_image(name) == built.id


async def test_a_failing_registry_is_retryable_only_for_a_name_that_is_no_near_miss(config: EngineConfig) -> None:
    with failing_registry(503) as host:
        async with AsyncFleet(config=config) as fleet:  # made after the env names the registry insecure
            near = f"{host}/service-{os.getpid()}:v1"
            built = await fleet.build(EnvSpec("host").env(MARK="near"), tag=near)
            with pytest.raises(RegistryUnavailable, match="503"):  # plausible: worth retrying
                await fleet.create(f"{host}/something-else-entirely:v7")
            with pytest.raises(ImageNotFound, match=f"did you mean {re.escape(near)}.*its registry failed"):
                await fleet.create(near.replace("service-", "servce-"))
            await fleet.remove_image(built.id)


def test_debootstrap_tries_again_when_the_archive_cannot_be_reached(tmp_path, monkeypatch):
    """A moment's network failure (the archive's Release file not fetched) is tried again from an empty
    tree; a failure on content is not, and says what debootstrap said."""
    from fanfold.errors import BuildFailed
    from fanfold.images import bases

    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "debootstrap"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n"
        f"echo x >> {calls}\n"
        f"if [ $(wc -l < {calls}) -lt 2 ]; then touch \"$3/partial\"; "
        "echo 'E: Failed getting release file http://deb.debian.org/debian/dists/bookworm/Release'; exit 1; fi\n"
        "if [ -e \"$3/partial\" ]; then echo 'E: not started from an empty tree'; exit 2; fi\n"
        "mkdir -p \"$3/etc\" \"$3/var/cache/apt/archives\"\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(bases, "DEBOOTSTRAP_PAUSE_S", 0)
    tree = tmp_path / "tree"
    tree.mkdir()
    bases._debootstrap(tree, "http://deb.debian.org/debian")
    assert calls.read_text().count("x") == 2 and (tree / "etc/hostname").read_text() == "sandbox\n"

    fake.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'E: Invalid Release file, no entry for main/binary-amd64'\nexit 1\n")
    calls.write_text("")
    with pytest.raises(BuildFailed, match="Invalid Release file"):
        bases._debootstrap(tmp_path / "tree", "http://deb.debian.org/debian")
    assert calls.read_text().count("x") == 1
