"""Commands as users: ``exec(user=)``, ``create(user=)``, an image's USER for execs and build steps,
su and runuser in the ``host`` base, and the agent's ``u`` frame, against real crun sandboxes,
embedded and over the unix socket, and the CLI."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fanfold import AsyncFleet, EngineConfig, EnvSpec, InvalidRequest
from fanfold._agent.build import agent_binary
from fanfold._agent.client import PROTOCOL_VERSION, AgentTooOld, ExecUser
from fanfold.images import users

import agents
from conftest import fleet_args, run_cli

OLD_AGENT_COMMIT = "a20f96d"  # the last agent of protocol 1, before the `u` frame


@pytest.fixture(params=["embedded", "unix"])
async def ufleet(request: pytest.FixtureRequest, config: EngineConfig):
    async with AsyncFleet(**fleet_args(request.param, request, config)) as fleet:
        yield fleet


async def test_exec_as_a_user_by_name_or_ids(ufleet):
    async with await ufleet.create() as sandbox:
        named = await sandbox.exec('id -u; id -g; echo "$HOME $USER $LOGNAME"', user="nobody")
        assert named.text == "65534\n65534\n/nonexistent nobody nobody\n"
        numeric = await sandbox.exec("id -u; id -g", user="65534:65534")
        assert numeric.text == "65534\n65534\n"
        unknown_uid = await sandbox.exec('id -u; id -g; echo "$HOME"', user="4321")  # no passwd entry: gid 0, home /
        assert unknown_uid.text == "4321\n0\n/\n"
        assert (await sandbox.exec("echo $HOME", user="nobody", env={"HOME": "/tmp"})).text == "/tmp\n"
        assert (await sandbox.exec("id -u")).text == "0\n"


async def test_create_user_is_the_default_and_an_exec_overrides_it(ufleet):
    async with await ufleet.create(user="nobody") as sandbox:
        assert sandbox.info.user == "nobody" and (await sandbox.refresh()).user == "nobody"
        assert (await sandbox.exec("id -u")).text == "65534\n"
        assert (await sandbox.exec("id -u", user="root")).text == "0\n"
        assert (await sandbox.exec("touch /tmp/mine; stat -c %U /tmp/mine")).text == "nobody\n"
        async with await sandbox.fork(1) as fork:  # children keep their parent's user
            assert fork.children[0].info.user == "nobody"
            assert (await fork.children[0].exec("id -u")).text == "65534\n"


async def test_unknown_users_are_clear_errors(ufleet):
    async with await ufleet.create() as sandbox:
        with pytest.raises(InvalidRequest, match=r"no user 'ghost' in the sandbox's /etc/passwd"):
            await sandbox.exec("true", user="ghost")
        with pytest.raises(InvalidRequest, match=r"no group 'ghosts' in the sandbox's /etc/group"):
            await sandbox.exec("true", user="nobody:ghosts")
        with pytest.raises(InvalidRequest, match="bad user"):
            await sandbox.exec("true", user="a b")
    before = {s.id for s in await ufleet.list()}
    with pytest.raises(InvalidRequest, match=r"no user 'ghost'"):
        await ufleet.create(user="ghost", labels={"test": "ghost-user"})
    assert not [s for s in await ufleet.list(labels={"test": "ghost-user"}) if s.id not in before]


async def test_an_image_user_runs_its_later_steps_and_its_execs(ufleet):
    spec = (EnvSpec("host").run("useradd -m -s /bin/sh app").user("app")
            .run("id -un > /home/app/who; touch /home/app/made"))
    image = await ufleet.build(spec)
    assert image.user == "app"
    async with await ufleet.create(image) as sandbox:
        assert sandbox.info.user == "app"
        shown = await sandbox.exec('id -un; echo "$HOME"; cat /home/app/who; stat -c %U /home/app/made')
        assert shown.text == "app\n/home/app\napp\napp\n"
        assert (await sandbox.exec("id -un", user="root")).text == "root\n"
    async with await ufleet.create(image, user="nobody") as sandbox:
        assert (await sandbox.exec("id -un")).text == "nobody\n"


async def test_an_unknown_image_user_fails_the_build_step_naming_it(ufleet):
    with pytest.raises(Exception, match=r"runs as user 'ghost'.*no user 'ghost' in the image's /etc/passwd"):
        await ufleet.build(EnvSpec("host").user("ghost").run("true"))


async def test_su_and_runuser_work_in_the_host_base(ufleet):
    async with await ufleet.create() as sandbox:
        assert (await sandbox.exec("runuser -u nobody -- id -u")).text == "65534\n"
        assert (await sandbox.exec("su -s /bin/sh nobody -c 'id -u'")).text == "65534\n"
        shadow = await sandbox.exec("cat /etc/shadow /etc/security/opasswd")
        assert "root:*:" in shadow.stdout.decode() and "opasswd: No such file" in shadow.stderr.decode()


def test_cli_user_flags():
    assert run_cli("run", "--user", "nobody", "--", "id", "-u").stdout == "65534\n"
    created = run_cli("create", "--user", "nobody", "--memory-mb", "128")
    assert created.returncode == 0, created.stderr
    sandbox_id = created.stdout.strip()
    try:
        assert run_cli("exec", sandbox_id, "--", "id", "-u").stdout == "65534\n"
        assert run_cli("exec", sandbox_id, "--user", "root", "--", "id", "-u").stdout == "0\n"
        failed = run_cli("exec", sandbox_id, "--user", "ghost", "--", "id")
        assert failed.returncode != 0 and "no user 'ghost'" in failed.stderr
    finally:
        assert run_cli("rm", sandbox_id).returncode == 0


# -- resolution and the agent's frame, below the engine ----------------------------------------


def test_resolution_never_follows_a_symlink_out_of_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (tmp_path / "passwd").write_text("app:x:1000:1000::/home/app:/bin/sh\n")
    (root / "etc/passwd").symlink_to(tmp_path / "passwd")  # absolute: resolved inside the root, where it is absent
    (root / "etc/group").write_text("app:x:1000:\nwheel:x:10:app,other\nbroken\n")
    with pytest.raises(InvalidRequest, match="no user 'app'"):
        users.resolve(root, "app")
    (root / "etc/passwd").unlink()
    (root / "etc/passwd").write_text("# comment\nbad line\napp:x:1000:1000::/home/app:/bin/sh\n")
    assert users.resolve(root, "app") == users.User(1000, 1000, (1000, 10), "/home/app", "app")
    assert users.resolve(root, "1000:wheel") == users.User(1000, 10, (10,), "/home/app", "app")
    assert users.resolve(root, "root").uid == 0  # root needs no passwd entry


@pytest.fixture
async def agent(tmp_path: Path):
    """A new agent run as a plain process (root here, so it can switch users)."""
    async with agents.running(agent_binary(tmp_path / "state"), tmp_path) as client:
        yield client


async def test_the_u_frame_switches_ids_and_groups(agent):
    raw = await agent.exec(["/bin/sh", "-c", "id -u; id -g; id -G"], env=["PATH=/usr/bin:/bin"], cwd="/",
                           timeout_ms=10_000, max_output=4096, user=ExecUser(65534, 65534, (65534, 100)))
    assert raw.stdout.decode().split("\n")[:3] == ["65534", "65534", "65534 100"]
    assert await agent.ping() == f"fanfold-agent {PROTOCOL_VERSION}"


async def test_an_unknown_frame_refuses_the_exec(agent):
    from fanfold._agent.client import _frame

    reader, writer = await asyncio.open_unix_connection(agent.socket_path)
    writer.write(_frame(b"a", b"/bin/true") + _frame(b"q", b"?") + _frame(b"x"))
    await writer.drain()
    header = await reader.readexactly(5)
    payload = await reader.readexactly(int.from_bytes(header[1:], "big"))
    writer.close()
    assert (chr(header[0]), payload.split()[0]) == ("f", b"22")  # EINVAL: nothing ran


async def test_an_agent_of_protocol_1_refuses_a_user_clearly_and_runs_nothing(tmp_path):
    async with agents.running(agents.agent_of(OLD_AGENT_COMMIT, tmp_path, 1), tmp_path) as old:
        assert await old.ping() == "fanfold-agent 1"
        marker = tmp_path / "ran"
        with pytest.raises(AgentTooOld):
            await old.exec(["/bin/touch", str(marker)], env=[], cwd="/", timeout_ms=10_000, max_output=4096,
                           user=ExecUser(65534, 65534))
        assert (await old.exec(["/bin/true"], env=[], cwd="/", timeout_ms=10_000, max_output=4096)).status["code"] == 0
        assert not marker.exists()


