"""Building EnvSpecs into cached layers, against the real runtime."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from fanfold import BuildFailed, EnvSpec, Fleet, ImageNotFound, InvalidRequest, InvalidSpec, ServiceFailed
from fanfold.host import census, cgroups, mounts
from fanfold.images import LayerStore
from fanfold.images.builder import StepEvent


def test_build_caches_every_step_and_rebuilds_only_what_changed(fleet, project, tmp_path):
    marker = f"m{time.time_ns()}"
    spec = (
        EnvSpec("host").workdir("/env").copy(str(project), "/env").env(GREETING="hi")
        .run(f"echo {marker} > /env/built.txt && python3 -m compileall -q /env")
    )
    events: list[StepEvent] = []
    first = fleet.build(spec, on_step=events.append)
    assert [e.status for e in events if e.status != "running"][-1] == "built"
    events.clear()
    started = time.perf_counter()
    second = fleet.build(spec, on_step=events.append)
    assert time.perf_counter() - started < 1.0
    assert second == first
    assert {e.status for e in events} <= {"cached", "running"} and "running" not in {e.status for e in events[1:]}
    assert events and events[-1].status == "cached"
    events.clear()
    changed = fleet.build(spec.run("echo extra > /env/extra.txt"), on_step=events.append)
    statuses = [e.status for e in events if e.status != "running"]
    assert statuses[:-1] == ["cached"] * (len(statuses) - 1) and statuses[-1] == "built"
    assert changed.layers[:-1] == first.layers
    with fleet.create(changed) as sandbox:
        result = sandbox.exec("cat built.txt extra.txt; echo $GREETING; pwd")
        assert result.text.split() == [marker, "extra", "hi", "/env"]


def test_every_step_reports_its_number_once_and_build_args_stay_out_of_the_image(fleet):
    marker = f"m{time.time_ns()}"
    spec = (EnvSpec("host").env(APP="demo").run("echo $VERSION $APP > /v", build_args={"VERSION": marker})
            .user("nobody").run("cat /v > /tmp/seen"))
    events: list[StepEvent] = []
    image = fleet.build(spec, on_step=events.append)
    ended = [e for e in events if e.status != "running"]
    assert [e.index for e in ended] == [0, 1, 2, 3, 4] and {e.total for e in events} == {5}
    assert [e.description for e in ended[1:]] == ["ENV APP=demo", "RUN echo $VERSION $APP > /v", "USER nobody",
                                                 "RUN cat /v > /tmp/seen"]
    assert [e.status for e in ended[1:]] == ["cached", "built", "built", "built"]
    assert "VERSION" not in dict(image.env)
    with fleet.create(image) as sandbox:
        assert sandbox.exec("cat /v; echo ${VERSION:-unset}").text.split() == [marker, "demo", "unset"]
    with pytest.raises(InvalidSpec, match="bad build arg"):
        EnvSpec("host").run("true", build_args={"1x": "y"})


def test_failed_step_names_step_code_and_tail_and_leaves_no_layer(fleet, config):
    layers_before = set(os.listdir(config.state_dir / "layers"))
    spec = EnvSpec("host").run(f"echo partial > /tmp/p-{time.time_ns()}; echo doomed-output; exit 7")
    with pytest.raises(BuildFailed) as info:
        fleet.build(spec)
    assert info.value.exit_code == 7
    assert "doomed-output" in info.value.output_tail and "RUN" in info.value.step
    assert "exit code 7" in str(info.value)
    assert set(os.listdir(config.state_dir / "layers")) == layers_before


def _processes_running(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker``."""
    return [pid for pid, argv in census.processes() if marker.encode() in b"\0".join(argv)]


async def _within(seconds: float, holds) -> bool:  # type: ignore[no-untyped-def]
    """Whether ``holds()`` comes true within ``seconds`` (polled: it is another process's doing)."""
    deadline = time.monotonic() + seconds
    while not holds():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_a_cancelled_build_ends_its_running_step_and_leaves_nothing(afleet, config):
    marker = f"step-{time.time_ns()}"
    build = asyncio.ensure_future(afleet.build(EnvSpec("host").run(f"sleep 600 # {marker}")))
    assert await _within(60, lambda: _processes_running(marker))
    step = _processes_running(marker)[0]
    container = Path(open(f"/proc/{step}/cgroup").read().splitlines()[0].split(":")[2]).name
    assert container.startswith("build-")
    build.cancel()
    with pytest.raises(asyncio.CancelledError):
        await build
    assert await _within(30, lambda: not _processes_running(marker)), "the step ran on after its build was cancelled"
    assert await _within(30, lambda: not (config.run_dir / config.runtime / container).exists())
    groups = [root / container for root in (*cgroups.v1_roots().values(), *cgroups.v2_roots())]
    assert not [group for group in groups if group.exists()]
    assert await _within(30, lambda: not [m for m in mounts.mounts_under(config.state_dir / "layers") if ".tmp-" in str(m)])


def test_run_steps_have_a_network_of_their_own_and_sandboxes_none(fleet):
    image = fleet.build(EnvSpec("host").run("ls /sys/class/net > /netdevs"))  # test_build_network.py: what it reaches
    with fleet.create(image) as sandbox:
        build_devices = sandbox.files.read("/netdevs").decode().split()
        sandbox_devices = sandbox.exec("ls /sys/class/net").stdout.split()
    assert sorted(build_devices) == ["eth0", "lo"]
    assert sandbox_devices == [b"lo"]


def test_writes_under_usr_in_a_build_stay_in_the_image(fleet):
    name = f"fanfold-test-{time.time_ns()}"
    image = fleet.build(EnvSpec("host").run(f"echo built > /usr/local/{name}"))
    assert not Path(f"/usr/local/{name}").exists()
    with fleet.create(image) as sandbox:
        assert sandbox.exec(f"cat /usr/local/{name}").text == "built\n"
    with fleet.create("host") as plain:
        assert plain.exec(f"test -e /usr/local/{name}").exit_code == 1


def make_repo(where: Path) -> tuple[Path, list[str]]:
    repo = where / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README").write_text("v1\n")
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "v1"], check=True)
    return repo, git


@pytest.fixture
def git_daemon(tmp_path):
    """A real git server on loopback (git://), so repo steps clone over the network."""
    repo, git = make_repo(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # `git daemon` is a `git` that runs `git-daemon` as its child, and killing that `git` orphaned
    # the server: run git-daemon itself, in a process group of its own, and end the whole group.
    exec_path = subprocess.run(["git", "--exec-path"], capture_output=True, text=True, check=True).stdout.strip()
    daemon = subprocess.Popen(
        [f"{exec_path}/git-daemon", "--export-all", "--reuseaddr", "--listen=127.0.0.1", f"--port={port}",
         f"--base-path={tmp_path}", str(tmp_path)], stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        url = f"git://127.0.0.1:{port}/repo"
        for _ in range(500):  # until it answers: it has no readiness signal of its own
            if subprocess.run(["git", "ls-remote", url], capture_output=True).returncode == 0:
                break
        yield repo, git, url
    finally:
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait()


def test_repo_step_clones_a_url_at_a_commit(fleet, git_daemon):
    repo, git, url = git_daemon
    if fleet.url is not None and fleet.url.startswith("http"):  # a server's tenant: over https or http only
        with pytest.raises(InvalidRequest, match="https or http only"):
            fleet.build(EnvSpec("host").repo(url, "/src"))
        return
    image = fleet.build(EnvSpec("host").repo(url, "/src"))
    (repo / "README").write_text("v2\n")
    subprocess.run(git + ["commit", "-qam", "v2"], check=True)
    image2 = fleet.build(EnvSpec("host").repo(url, "/src"))
    assert image.id != image2.id
    with fleet.create(image) as a, fleet.create(image2) as b:
        assert a.files.read("/src/README") == b"v1\n"
        assert b.exec("cat README && git log --oneline | wc -l", cwd="/src").text == "v2\n2\n"


def test_local_repos_clone_in_process_and_are_refused_by_a_server(fleet, tmp_path):
    repo, _ = make_repo(tmp_path)
    spec = EnvSpec("host").repo(str(repo), "/src")
    if fleet.url is not None:  # a server never reads its own host's paths for a client
        with pytest.raises(InvalidSpec, match="local path"):
            fleet.build(spec)
        return
    with fleet.create(fleet.build(spec)) as sandbox:
        assert sandbox.files.read("/src/README") == b"v1\n"


def test_services_start_at_create(fleet):
    spec = (
        EnvSpec("host")
        .service("prepare", "echo prepared > /tmp/prepared", mode="oneshot")
        .service("web", "cd /tmp && exec python3 -m http.server 8123 --bind 127.0.0.1")
    )
    image = fleet.build(spec)
    with fleet.create(image) as sandbox:
        assert sandbox.files.read("/tmp/prepared") == b"prepared\n"
        fetch = (
            "import time, urllib.request\n"
            "for _ in range(200):\n"
            "    try:\n        print(urllib.request.urlopen('http://127.0.0.1:8123/prepared').read().decode()); break\n"
            "    except OSError: time.sleep(0.05)\n"
        )
        assert sandbox.exec(["python3", "-c", fetch], timeout=30).text == "prepared\n\n"


def test_failing_oneshot_service_fails_create_cleanly_with_its_log(fleet):
    script = "for i in $(seq 100); do echo line $i; done; echo 'no such table: users' >&2; exit 3"
    image = fleet.build(EnvSpec("host").service("broken", script, mode="oneshot"))
    before = {s.id for s in fleet.list()}
    with pytest.raises(ServiceFailed, match="service 'broken' .* exited with code 3") as failed:
        fleet.create(image)
    assert {s.id for s in fleet.list()} == before
    err = failed.value
    assert (err.service, err.exit_code) == ("broken", 3)
    assert err.log_tail.splitlines() == [f"line {i}" for i in range(82, 101)] + ["no such table: users"]
    assert str(err).endswith("line 100\nno such table: users")


def test_host_base_exposes_no_host_secrets(fleet, monkeypatch):
    monkeypatch.setenv("FANFOLD_TEST_SECRET", "hunter2")
    with fleet.create("host") as sandbox:
        listing = sandbox.exec("ls -A /root /home; ls / ; env; cat /etc/shadow 2>&1; ls /etc/ssh 2>&1").text
    assert "hunter2" not in listing and "FANFOLD_TEST_SECRET" not in listing
    assert "work" not in listing.split() and "No such file" in listing


def test_bad_sources_and_unknown_images_get_clear_errors(fleet, tmp_path):
    with pytest.raises(InvalidSpec, match="does not exist"):
        fleet.build(EnvSpec("host").copy(str(tmp_path / "missing"), "/x"))
    with pytest.raises(ImageNotFound, match="no image 'img-0000000000000000' here"):
        fleet.create("img-0000000000000000")


@pytest.mark.slow
def test_debian_base_builds_once_and_runs(fleet):
    image = fleet.build(EnvSpec("debian:bookworm").run("echo baked > /etc/baked"))
    with fleet.create(image) as sandbox:
        result = sandbox.exec("cat /etc/debian_version /etc/baked && dpkg -l | grep -c '^ii'")
    lines = result.text.split()
    assert result.ok and lines[0].startswith("12.") and lines[1] == "baked" and int(lines[2]) > 50


def test_copy_chown_labels_volumes_healthcheck_and_history(fleet, tmp_path):
    (tmp_path / "owned").mkdir()
    (tmp_path / "owned" / "f.txt").write_text("x\n")
    (tmp_path / "one.txt").write_text("1\n")
    users = EnvSpec("host").run("echo 'app:x:4242:4343::/home/app:/bin/sh' >> /etc/passwd"
                                " && echo 'grp:x:4444:' >> /etc/group")
    spec = (
        users.copy(str(tmp_path / "owned"), "/srv/owned", chown="app:grp").copy(str(tmp_path / "one.txt"), "/srv/one.txt",
                                                                              chown="4242")
        .label(team="rl", **{"org.opencontainers.image.source": "here"}).volume("/data")
        .healthcheck(["true"], interval_s=5).workdir("/srv")
    )
    image = fleet.build(spec)
    with fleet.create(image) as sandbox:
        owners = sandbox.exec("stat -c '%u:%g %n' /srv/owned /srv/owned/f.txt /srv/one.txt").text.splitlines()
    assert owners == ["4242:4444 /srv/owned", "4242:4444 /srv/owned/f.txt", "4242:4242 /srv/one.txt"]
    assert image.labels == (("org.opencontainers.image.source", "here"), ("team", "rl"))
    assert image.volumes == ("/data",) and image.healthcheck is not None
    assert (image.healthcheck.test, image.healthcheck.interval_s, image.healthcheck.retries) == (("CMD", "true"), 5.0, 3)
    made = [step for step, _, _ in image.history]
    assert made[0] == "BASE host" and made[2].startswith("COPY --chown=app:grp ") and made[-1] == "WORKDIR /srv"
    assert "LABEL org.opencontainers.image.source=here team=rl" in made and "VOLUME /data" in made
    assert [layer for _, layer, _ in image.history if layer] == list(image.layers)
    assert image.history[2][2] > 0 and image.history[3][2] > 0 and image.history[4][1:] == ("", 0)
    with pytest.raises(BuildFailed, match="no user 'nobody-here'"):
        fleet.build(users.copy(str(tmp_path / "one.txt"), "/srv/one.txt", chown="nobody-here"))


TLS_PROBE = '''\
"""Serve TLS on loopback with a certificate of the test CA, and connect to it verifying as clients do."""
import socket, ssl, sys, threading

server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
server.load_cert_chain("/probe/server.pem", "/probe/server.key")
listener = socket.create_server(("127.0.0.1", 0))
threading.Thread(target=lambda: server.wrap_socket(listener.accept()[0], server_side=True).sendall(b"ok"),
                 daemon=True).start()
client = ssl.create_default_context()  # the default paths: SSL_CERT_FILE, else OpenSSL's (the system bundle)
with client.wrap_socket(socket.create_connection(listener.getsockname()), server_hostname="outside.test") as tls:
    print(tls.recv(2).decode(), sys.argv[1])
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    """A build context: a TLS probe and a server certificate whose CA (``ca.pem``, beside it) no image trusts."""
    from outside import make_certificates

    where = tmp_path_factory.mktemp("probe")
    make_certificates(where, ["outside.test"])
    context = where / "context"
    context.mkdir()
    for name in ("server.pem", "server.key"):
        (context / name).write_bytes((where / name).read_bytes())
    (context / "probe.py").write_text(TLS_PROBE)
    return where


def test_extra_cas_reach_build_steps_and_sandboxes_and_no_layer(config, probe):
    nonce = f"n{time.time_ns()}"
    spec = EnvSpec("host").copy(str(probe / "context"), "/probe").run(f"python3 /probe/probe.py {nonce}")
    with Fleet(config=config) as plain, Fleet(config=dataclasses.replace(config, extra_ca_file=str(probe / "ca.pem"))) as trusted:
        with pytest.raises(BuildFailed, match="CERTIFICATE_VERIFY_FAILED"):  # the image trusts its own CAs alone
            plain.build(spec)
        image = trusted.build(spec)
        with trusted.create(image) as sandbox:
            assert sandbox.exec(f"python3 /probe/probe.py {nonce}").text.split() == ["ok", nonce]
            # without the variables, through OpenSSL's own default: the system bundle, extended
            bare = sandbox.exec(f"env -u SSL_CERT_FILE python3 /probe/probe.py {nonce}")
            assert bare.text.split() == ["ok", nonce], bare.stderr
            assert sandbox.exec("echo $PIP_CERT $REQUESTS_CA_BUNDLE; readlink /etc/fanfold/trust.pem").text.split() == [
                "/etc/fanfold/trust.pem", "/etc/fanfold/trust.pem", "/etc/ssl/certs/ca-certificates.crt"]
        with plain.create(image) as untrusting:  # an engine without them: its sandboxes trust the image's CAs alone
            assert "CERTIFICATE_VERIFY_FAILED" in untrusting.exec(f"python3 /probe/probe.py {nonce}").stderr.decode()
    ca = (probe / "ca.pem").read_bytes().strip()
    for layer in image.layers:  # laid over roots at set-up, never stored
        tree = LayerStore(config.state_dir).layer_path(layer)
        assert not (tree / "etc/fanfold").exists()
        bundle = tree / "etc/ssl/certs/ca-certificates.crt"
        assert not bundle.exists() or ca not in bundle.read_bytes()


def test_the_extra_ca_layer_is_roots_even_when_a_mapped_root_makes_it(tmp_path):
    """A create under a user namespace makes the layer as its mapped host uid: its files must still be
    uid 0's on disk, or /etc and /etc/ssl show as nobody's in every later sandbox."""
    from fanfold.host import idmap
    from fanfold.store.trust import Trust

    rootfs = tmp_path / "rootfs"
    (rootfs / "etc/ssl/certs").mkdir(parents=True)
    trust = Trust(b"-----BEGIN CERTIFICATE-----\n", tmp_path / "trust")
    trust.cache_dir.mkdir()
    with idmap.as_mapped_root(1_000_000):
        trust._make(trust.cache_dir / "layer", rootfs, "/etc/ssl/certs/ca-certificates.crt", b"bundle\n")
    owners = {(p.relative_to(tmp_path).as_posix(), os.lstat(p).st_uid, os.lstat(p).st_gid)
              for p in [trust.cache_dir / "layer", *(trust.cache_dir / "layer").rglob("*")]}
    assert {(path, 0, 0) for path, _, _ in owners} == owners
    assert "trust/layer/etc/fanfold/trust.pem" in {path for path, _, _ in owners}
