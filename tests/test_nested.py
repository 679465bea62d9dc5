"""Containers inside a sandbox (``nested=True``): rootless podman from the host's /usr runs ``podman run``,
pods and networks in a sandbox, against the real crun, CRIU and podman; without ``nested`` it cannot;
runsc refuses it; memory checkpoints of it are refused; nothing of it is left on the host.

No registry is reachable: the inner image is imported from a tarball of a few host binaries and
their libraries, made inside the sandbox (``TINY_IMAGE``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil

import pytest

from fanfold import AsyncFleet, EngineConfig, Fleet, InvalidRequest
from fanfold.host import cgroups
from fanfold.runtime import nested

from conftest import STATE_DIR, run_cli

if shutil.which("podman") is None:
    pytest.skip("podman is not installed (`make setup` installs it)", allow_module_level=True)

TINY_IMAGE = r"""
set -e
root=$(mktemp -d)
mkdir -p "$root/bin" "$root/proc" "$root/sys" "$root/dev" "$root/etc" "$root/tmp"
for tool in /bin/sh /bin/echo /bin/cat /bin/sleep; do
    cp "$tool" "$root/bin/"
    for lib in $(ldd "$tool" | grep -o '/[^ ]*'); do
        mkdir -p "$root$(dirname "$lib")"
        cp -n "$lib" "$root$lib"
    done
done
tar -C "$root" -c . | podman import --quiet - localhost/tiny
rm -rf "$root"
"""
"""A few host binaries and their libraries, imported as the image ``localhost/tiny``."""
HOST_PODMAN_PATHS = ("/var/lib/containers", "/run/containers", "/run/libpod")


def sh(sandbox, script: str, timeout: float = 120):
    return sandbox.exec(["sh", "-c", script], timeout=timeout)


def host_podman_state() -> dict[str, list[str]]:
    """What the host's own podman paths hold: a podman that ran inside a sandbox adds nothing here."""
    return {path: sorted(os.listdir(path)) if os.path.isdir(path) else [] for path in HOST_PODMAN_PATHS}


@pytest.fixture(scope="module")
def efleet(config: EngineConfig):
    with Fleet(config=config) as fleet:
        yield fleet


def sandbox_pids(config: EngineConfig, sandbox_id: str) -> set[int]:
    """Host pids of every process of a sandbox (its containers' too: they get no cgroups of their own)."""
    for folder in cgroups.sandbox_dirs(config.cgroup_parent, sandbox_id):
        if (folder / "cgroup.procs").exists():
            return {int(pid) for pid in (folder / "cgroup.procs").read_text().split()}
    return set()


def test_podman_runs_a_container_inside_a_nested_sandbox(efleet, config: EngineConfig):
    before = host_podman_state()
    with efleet.create(nested=True, memory_mb=1024, pids=1024, disk_mb=2048) as sandbox:
        assert sandbox.info.nested
        made = sh(sandbox, TINY_IMAGE)
        assert made.exit_code == 0, made.stderr
        ran = sh(sandbox, "podman run --rm localhost/tiny echo hi")
        assert (ran.exit_code, ran.stdout) == (0, b"hi\n"), ran.stderr
        # its own network (slirp4netns, through /dev/net/tun) and none
        quiet = sh(sandbox, "podman run --rm --network=none localhost/tiny echo quiet")
        assert quiet.stdout == b"quiet\n", quiet.stderr
        started = sh(sandbox, "podman run -d --name box localhost/tiny sleep 300")
        assert started.exit_code == 0, started.stderr
        listed = sh(sandbox, "podman ps -a --format '{{.Names}} {{.Status}}'")
        assert listed.stdout.decode().startswith("box Up"), listed.stdout
        inside = sh(sandbox, "podman exec box echo from-exec")
        assert inside.stdout == b"from-exec\n", inside.stderr
        removed = sh(sandbox, "podman rm -f -t 0 box && podman ps -a --format '{{.Names}}'")
        assert (removed.exit_code, removed.stdout) == (0, b"box\n"), removed.stderr  # rm names what it removed
        # what compose files become: a pod whose containers share a network, and a network of its own
        pod = sh(sandbox, "podman pod create --name app >/dev/null && podman run -d --pod app localhost/tiny sleep 300"
                          " >/dev/null && podman run --rm --pod app localhost/tiny echo in-pod")
        assert pod.stdout == b"in-pod\n", pod.stderr
        assert sh(sandbox, "podman pod rm -f -t 0 app").exit_code == 0
        net = sh(sandbox, "podman network create backend >/dev/null && podman run --rm --network backend"
                          " localhost/tiny echo on-network && podman network rm backend >/dev/null")
        assert net.stdout == b"on-network\n", net.stderr
        left = sh(sandbox, "podman ps -aq; podman pod ps -q")
        assert (left.exit_code, left.stdout) == (0, b""), left.stderr
        # PID 1 (the agent) stays out of reach of the unmasked /proc
        agent = sh(sandbox, "head -c 1 /proc/1/mem")
        assert agent.exit_code != 0 and b"Permission denied" in agent.stderr
        # killed with a container running: its conmon, fuse-overlayfs and slirp4netns go with it
        assert sh(sandbox, "podman run -d localhost/tiny sleep 300").exit_code == 0
        inner = sandbox_pids(config, sandbox.id)
        assert len(inner) >= 5, inner  # the agent, conmon, sleep, fuse-overlayfs, slirp4netns, podman's pause
    assert [pid for pid in inner if os.path.exists(f"/proc/{pid}")] == []
    assert host_podman_state() == before
    # The device nodes nested sandboxes get are open to all: only root may reach their folder.
    assert (STATE_DIR / "devices").stat().st_mode & 0o777 == 0o700


COMPOSE_UP = """
cat > /tmp/compose.yaml <<'YAML'
services:
  one:
    image: localhost/tiny
    command: ["sh", "-c", "echo one-says-hi; sleep 300"]
  two:
    image: localhost/tiny
    command: ["sh", "-c", "echo two-says-hi; sleep 300"]
    depends_on: [one]
YAML
cd /tmp && podman-compose -f compose.yaml up -d >/dev/null 2>&1 && podman ps --format '{{.Names}}' | sort && podman logs tmp_two_1
"""


@pytest.mark.skipif(shutil.which("podman-compose") is None, reason="podman-compose is not installed (`make setup`)")
def test_podman_compose_brings_a_project_up_and_down_inside(efleet):
    with efleet.create(nested=True, memory_mb=1024, pids=1024, disk_mb=2048) as sandbox:
        assert sh(sandbox, TINY_IMAGE).exit_code == 0
        up = sh(sandbox, COMPOSE_UP, timeout=300)
        assert (up.exit_code, up.stdout) == (0, b"tmp_one_1\ntmp_two_1\ntwo-says-hi\n"), up.stderr
        down = sh(sandbox, "cd /tmp && podman-compose -f compose.yaml down >/dev/null 2>&1 && podman ps -aq | wc -l")
        assert down.stdout == b"0\n", down.stderr


def test_podman_fails_clearly_without_nested(efleet):
    with efleet.create(memory_mb=512) as sandbox:
        assert not sandbox.info.nested
        for path, text in nested.FILES:  # what a nested sandbox gets: only the relaxations differ
            sandbox.files.write(path, text)
        ran = sh(sandbox, TINY_IMAGE + "podman run --rm localhost/tiny echo hi")
        assert ran.exit_code != 0 and ran.stdout == b""
        # rootless podman's first step, a user namespace of its own, is what the default profile refuses
        assert b"cannot clone: Operation not permitted" in ran.stderr, ran.stderr


def test_nested_travels_every_transport(fleet):
    """The create body and the sandbox record carry it: a plain sandbox may not make a user namespace,
    a nested one may."""
    probe = ["unshare", "--user", "--map-root-user", "--mount", "true"]
    with fleet.create(nested=True) as holder, fleet.create() as plain:
        assert (holder.info.nested, plain.info.nested) == (True, False)
        assert [i.nested for i in fleet.list() if i.id == holder.id] == [True]
        assert holder.exec(probe).exit_code == 0
        refused = plain.exec(probe)
        assert refused.exit_code != 0 and b"Operation not permitted" in refused.stderr


def test_memory_checkpoints_of_a_nested_sandbox_are_refused_disk_snapshots_work(efleet):
    """CRIU dumps no user namespace inside another (podman's) and no FUSE mount: fork, suspend and
    memory snapshots are refused up front, and the sandbox keeps running."""
    with efleet.create(nested=True, memory_mb=1024, pids=1024, disk_mb=2048) as sandbox:
        assert sh(sandbox, TINY_IMAGE).exit_code == 0
        for attempt in (lambda: sandbox.fork(1), sandbox.suspend, lambda: sandbox.snapshot(memory=True)):
            with pytest.raises(InvalidRequest, match="nested=True"):
                attempt()
        assert sandbox.exec(["true"]).exit_code == 0
        snap = sandbox.snapshot(memory=False)
        sandbox.reset()  # back to its image, nested still: no image, podman's files written again
        again = sh(sandbox, "podman images -q | wc -l; cat /etc/subuid")
        assert again.stdout == b"0\nroot:1:65535\n", again.stderr
    try:
        with efleet.create(snap.id, nested=True, memory_mb=1024, pids=1024, disk_mb=2048) as copy:
            ran = sh(copy, "podman run --rm localhost/tiny echo again")  # the image came with the disk
            assert ran.stdout == b"again\n", ran.stderr
    finally:
        efleet.delete_snapshot(snap.id)


async def test_an_idle_nested_sandbox_is_kept_running_not_suspended(config: EngineConfig, caplog):
    """As a GPU sandbox: the idle policy does not try a suspend that would be refused."""
    async with AsyncFleet(config=config) as fleet:
        engine = fleet._transport  # type: ignore[attr-defined]
        sandbox = await fleet.create(nested=True, persistence="persistent", idle_timeout=0.01)
        await asyncio.sleep(0.05)  # past its idle timeout; the policy pass below is what acts on it
        with caplog.at_level(logging.WARNING, logger="fanfold"):
            await engine.policies.apply()
        assert (await fleet.get(sandbox.id)).info.state == "running"
        assert [r.getMessage() for r in caplog.records if sandbox.id in r.getMessage()] == []
        await sandbox.kill()


async def test_nested_is_refused_without_user_namespaces(config: EngineConfig):
    """Podman would run as the host's root there."""
    async with AsyncFleet(config=dataclasses.replace(config, userns=False)) as fleet:
        with pytest.raises(InvalidRequest, match="needs user namespaces"):
            await fleet.create(nested=True)
        assert await fleet.list() == []


async def test_nested_is_refused_on_runsc():
    if shutil.which("runsc") is None:
        pytest.skip("gVisor's runsc is not installed")
    async with AsyncFleet(config=EngineConfig(state_dir=STATE_DIR, runtime="runsc")) as fleet:
        with pytest.raises(InvalidRequest, match="not supported by the runsc backend"):
            await fleet.create(nested=True)
        assert await fleet.list() == []


def test_cli_run_nested():
    probe = ["sh", "-c", "unshare --user --map-root-user true && echo inside"]
    done = run_cli("run", "--nested", "--", *probe)
    assert (done.returncode, done.stdout) == (0, "inside\n"), done.stderr
    plain = run_cli("run", "--", *probe)
    assert plain.returncode != 0 and "Operation not permitted" in plain.stderr
    assert "--nested" in run_cli("create", "--help").stdout
