"""systemd as a sandbox's init (``EnvSpec.init("systemd")``, ``LABEL fanfold.init=systemd``), against real
crun, systemd, CRIU and processes: its units, ``systemctl``, execs beside it, fork, suspend, resume and reset.

Each sandbox test runs embedded and over the unix socket; the session's leak check (conftest) covers
the groups systemd makes below each sandbox's own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fanfold import AsyncFleet, EngineConfig, EnvSpec, InvalidSpec, ServiceFailed
from fanfold.errors import InvalidRequest
from fanfold.host import cgroups
from fanfold.images import LayerStore
from fanfold.models import Limits
from fanfold.runtime import get_backend, systemd
from fanfold.runtime.base import SandboxSpec
from fanfold.spec import INIT_LABEL

from conftest import fleet_args

PORT = 8321
SPEC = (
    EnvSpec("host").init("systemd").env(GREETING="hello")
    .service("prepare", "echo prepared $GREETING > /root/prepared", mode="oneshot")
    .service("web", f"cd /root && exec python3 -m http.server {PORT} --bind 127.0.0.1")
)
# The service answers once it listens: systemd calls a simple unit started as soon as it forked.
FETCH = (
    "import time, urllib.request\n"
    "for _ in range(400):\n"
    "    try:\n"
    f"        print(urllib.request.urlopen('http://127.0.0.1:{PORT}/prepared').read().decode(), end=''); break\n"
    "    except OSError: time.sleep(0.05)\n"
)


@pytest.fixture(params=["embedded", "unix"])
async def sfleet(request: pytest.FixtureRequest, config: EngineConfig):
    async with AsyncFleet(**fleet_args(request.param, request, config)) as fleet:
        yield fleet


async def active(sandbox, *units: str) -> list[str]:
    return (await sandbox.exec(["systemctl", "is-active", *units])).text.split()


async def answers(sandbox) -> str:
    return (await sandbox.exec(["python3", "-c", FETCH], timeout=60)).text


async def test_a_systemd_image_runs_its_services_as_units_that_systemctl_manages(sfleet):
    image = await sfleet.build(SPEC)
    assert image.init == "systemd" and dict(image.labels)[INIT_LABEL] == "systemd"
    async with await sfleet.create(image) as sandbox:
        assert (await sandbox.exec("cat /proc/1/comm")).text == "systemd\n"
        # created once the oneshot ran and the simple one started: both active, the oneshot's file there
        assert await active(sandbox, "prepare", "web") == ["active", "active"]
        assert await answers(sandbox) == "prepared hello\n"
        status = (await sandbox.exec("systemctl status web --no-pager")).text
        assert "/etc/systemd/system/web.service; enabled" in status and "http.server" in status
        assert (await sandbox.exec(["systemctl", "stop", "web"])).ok
        assert await active(sandbox, "web") == ["inactive"]
        assert (await sandbox.exec(["systemctl", "start", "web"])).ok
        assert await answers(sandbox) == "prepared hello\n"
        # execs are the agent's children as ever: exit codes, the image's env, files
        done = await sandbox.exec("echo $GREETING; exit 7")
        assert (done.text, done.exit_code) == ("hello\n", 7)
        await sandbox.files.write("/root/note", "kept\n")
        assert (await sandbox.exec("cat /root/note")).text == "kept\n"
        assert (await sandbox.exec("systemctl is-system-running")).text == "running\n"


async def test_unit_commands_keep_quotes_dollars_percents_and_newlines(sfleet):
    odd = 'printf "%s|%s\\n" "$HOME" \'$GREETING "q" 100% \\back\' > /root/odd\necho second line >> /root/odd'
    image = await sfleet.build(EnvSpec("host").init("systemd").env(GREETING="x%iy").service("odd", odd, mode="oneshot"))
    async with await sfleet.create(image) as sandbox:
        assert (await sandbox.exec("cat /root/odd")).text == '/root|$GREETING "q" 100% \\back\nsecond line\n'
        assert (await sandbox.exec("systemctl show -p Environment odd")).text.count("GREETING=x%iy") == 1


async def test_a_failing_oneshot_unit_fails_the_create_with_its_log(sfleet):
    image = await sfleet.build(EnvSpec("host").init("systemd")
                               .service("broken", "echo 'no such table: users' >&2; exit 3", mode="oneshot")
                               .service("after", "sleep infinity"))
    before = {s.id for s in await sfleet.list()}
    with pytest.raises(ServiceFailed, match="service 'broken' .* exited with code 3") as failed:
        await sfleet.create(image)
    assert (failed.value.service, failed.value.exit_code) == ("broken", 3)
    assert failed.value.log_tail == "no such table: users"
    assert {s.id for s in await sfleet.list()} == before


async def test_fork_gives_children_whose_units_are_still_active(sfleet, config):
    async with await sfleet.create(await sfleet.build(SPEC)) as parent:
        await parent.exec("echo parent > /root/mark")
        async with await parent.fork(2) as fork:
            names = set()
            for child in fork.children:
                assert await active(child, "prepare", "web") == ["active", "active"]
                assert await answers(child) == "prepared hello\n"
                assert (await child.exec("cat /root/mark")).text == "parent\n"
                # systemd still makes groups for new units in the child's own tree, which its root owns
                assert (await child.exec("systemd-run --unit=late sleep infinity && systemctl is-active late")).ok
                names.add((await child.exec("hostname")).text)
            assert names == {f"{child.id}\n" for child in fork.children}
            async with await fork.children[0].fork(1) as again:  # a restored tree checkpoints again
                assert await active(again.children[0], "web", "late") == ["active", "active"]
            assert await active(parent, "web", "late") == ["active", "inactive"]
        assert await answers(parent) == "prepared hello\n"
        # the children's groups went with them, those systemd made below their own too
        assert not any(d.exists() for child in fork.children for d in cgroups.sandbox_dirs(config.cgroup_parent, child.id))


async def test_suspend_resume_and_reset_keep_the_units(sfleet):
    async with await sfleet.create(await sfleet.build(SPEC)) as sandbox:
        await sandbox.exec("systemd-run --unit=extra sleep infinity; echo dirty > /root/dirty")
        assert (await sandbox.suspend()).state == "suspended"
        assert (await sandbox.resume()).state == "running"
        assert await active(sandbox, "web", "extra") == ["active", "active"]
        assert await answers(sandbox) == "prepared hello\n"
        disk = await sandbox.snapshot()  # a disk snapshot's sandboxes boot afresh on the saved disk
        async with await sfleet.create(disk.id) as copy:
            assert (await copy.exec("cat /root/dirty")).text == "dirty\n"
            assert await active(copy, "web", "extra") == ["active", "inactive"]
        assert (await sandbox.reset()).state == "running"
        assert not (await sandbox.exec("cat /root/dirty")).ok
        assert await active(sandbox, "prepare", "web", "extra") == ["active", "active", "inactive"]
        assert await answers(sandbox) == "prepared hello\n"


# -- the image's word, checked before any sandbox ---------------------------------------------------


def test_init_is_a_label_that_a_dockerfile_sets_too(tmp_path):
    assert EnvSpec("host").init("systemd").steps[-1].arg("labels") == ((INIT_LABEL, "systemd"),)
    with pytest.raises(InvalidSpec, match="init must be one of fanfold, systemd"):
        EnvSpec("host").init("upstart")
    with pytest.raises(InvalidSpec, match="fanfold.init"):
        EnvSpec("host").label(**{INIT_LABEL: "runit"})
    (tmp_path / "Dockerfile").write_text("FROM host\nLABEL fanfold.init=systemd\n")
    spec = EnvSpec.from_dockerfile(tmp_path / "Dockerfile")
    assert spec.steps[-1].arg("labels") == ((INIT_LABEL, "systemd"),)
    unit = EnvSpec("host").systemd_service("seed", "echo seeded > /seeded")  # Freestyle's spelling
    assert [step.kind for step in unit.steps] == ["label", "service"]
    assert (unit.steps[0].arg("labels"), unit.steps[1].arg("mode")) == (((INIT_LABEL, "systemd"),), "oneshot")


async def test_backends_without_systemd_refuse_it(tmp_path: Path):
    backend = get_backend(EngineConfig(state_dir=tmp_path, backend="fake"), LayerStore(tmp_path))
    await backend.prepare()
    try:
        spec = SandboxSpec(id="sb-000000000001", layers=(), limits=Limits(), init="systemd")
        with pytest.raises(InvalidRequest, match="needs the oci backend"):
            await backend.bring_up(spec)
        assert await backend.list_ids() == set()
    finally:
        await backend.close()


def test_an_image_without_systemd_is_refused_naming_what_to_install(tmp_path: Path):
    (tmp_path / "lib").mkdir()
    with pytest.raises(InvalidRequest, match="apt-get install systemd"):
        systemd.find_init(tmp_path)
    with pytest.raises(InvalidRequest, match="unknown init 'runit'"):
        systemd.check_init("runit")
