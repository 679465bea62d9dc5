"""SWE-ReX's own ``RemoteRuntime`` calls on ``FanfoldDeployment``, over real sandboxes running
``swerex-remote`` (embedded, and through a server's port route with a tenant's token): sessions,
commands, files, uploads, timeouts, failed starts, and no sandbox left after ``stop``.

The first run builds the image that installs swe-rex (pip, from its index: about 20 s); later
runs on the same state directory find it cached.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("swerex")
from swerex.exceptions import (  # noqa: E402
    CommandTimeoutError, DeploymentNotStartedError, DeploymentStartupError,
)
from swerex.runtime.abstract import (  # noqa: E402
    BashAction, BashInterruptAction, CloseBashSessionRequest, Command, CreateBashSessionRequest, ReadFileRequest,
    UploadRequest, WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime  # noqa: E402

from conftest import leaks  # noqa: E402
from fanfold import AsyncFleet, EnvSpec, FanfoldError  # noqa: E402
from fanfold.integrations import swerex  # noqa: E402
from fanfold.integrations.swerex import (  # noqa: E402
    FanfoldDeployment, SwerexStartFailed, SwerexStartTimeout, with_swerex,
)

CLEAN = {"mounts": 0, "cgroups": 0, "containers": 0}


async def exercise(runtime: RemoteRuntime, tmp_path) -> None:
    """The calls SWE-agent makes: a bash session whose state persists, commands, files, an upload."""
    await runtime.create_session(CreateBashSessionRequest(session="main"))
    await runtime.run_in_session(BashAction(session="main", command="cd /tmp && export GREETING=persisted"))
    seen = await runtime.run_in_session(BashAction(session="main", command="pwd; echo $GREETING"))
    assert (seen.output, seen.exit_code) == ("/tmp\npersisted\n", 0)
    failed = await runtime.run_in_session(BashAction(session="main", command="ls /nope", check="silent"))
    assert failed.exit_code == 2 and "No such file" in failed.output

    done = await runtime.execute(Command(command=["sh", "-c", "echo out; echo err >&2; exit 3"]))
    assert (done.stdout, done.stderr, done.exit_code) == ("out\n", "err\n", 3)
    host = await runtime.execute(Command(command="uname -n", shell=True))
    assert host.stdout.startswith("sb-"), "the command ran outside a sandbox"

    await runtime.write_file(WriteFileRequest(path="/work/notes/a.txt", content="written\n"))
    assert (await runtime.read_file(ReadFileRequest(path="/work/notes/a.txt"))).content == "written\n"

    (tmp_path / "repo" / "pkg").mkdir(parents=True)
    (tmp_path / "repo" / "pkg" / "mod.py").write_text("X = 1\n")
    (tmp_path / "repo" / "README").write_text("uploaded\n")
    await runtime.upload(UploadRequest(source_path=str(tmp_path / "repo"), target_path="/testbed"))
    listed = await runtime.execute(Command(command="cd /testbed && cat README pkg/mod.py", shell=True))
    assert listed.stdout == "uploaded\nX = 1\n"

    await runtime.close_session(CloseBashSessionRequest(session="main"))


async def test_sessions_commands_and_files_in_an_embedded_sandbox(config, tmp_path):
    deployment = FanfoldDeployment(engine_config=config, limits={"memory_mb": 512})
    with pytest.raises(DeploymentNotStartedError):
        await deployment.is_alive()
    await deployment.start()
    try:
        assert await deployment.is_alive()
        sandbox_id = deployment.sandbox.id
        await exercise(deployment.runtime, tmp_path)
        await deployment.runtime.create_session(CreateBashSessionRequest())
        timed_out = "timeout after 0.5 seconds while running command 'sleep 30'"
        with pytest.raises(CommandTimeoutError, match=timed_out):
            await deployment.runtime.run_in_session(BashAction(command="sleep 30", timeout=0.5))
        await deployment.runtime.run_in_session(BashInterruptAction())  # as SWE-agent does after a timeout
        after = await deployment.runtime.run_in_session(BashAction(command="echo still here"))
        assert after.output == "still here\n"
    finally:
        await deployment.stop()
    with pytest.raises(DeploymentNotStartedError):
        await deployment.is_alive()
    with pytest.raises(DeploymentNotStartedError):
        deployment.runtime  # noqa: B018 - the property is what raises
    await deployment.stop()  # idempotent
    async with AsyncFleet(config=config) as fleet:
        assert sandbox_id not in [info.id for info in await fleet.list()]
    assert leaks(config) == CLEAN


async def test_through_a_server_with_a_tenants_token(server, tmp_path):
    token = server.tokens["alice"]
    deployment = FanfoldDeployment(url=server.tcp_url, token=token)
    await deployment.start()
    try:
        assert await deployment.is_alive()
        assert deployment.runtime._api_url.startswith(f"{server.tcp_url}/v1/sandboxes/")
        sandbox_id = deployment.sandbox.id
        await exercise(deployment.runtime, tmp_path)
        # the port route wants the fanfold token too: SWE-ReX's own key alone does not pass
        url, key = deployment.runtime._api_url, deployment.runtime._config.auth_token
        refused = await RemoteRuntime(host=url, auth_token=key, timeout=5).is_alive()
        assert not refused.is_alive and "Status code 401" in refused.message
    finally:
        await deployment.stop()
    assert not await deployment_alive(deployment)
    async with AsyncFleet(server.tcp_url, token=token) as remote:
        assert sandbox_id not in [info.id for info in await remote.list()]


async def test_a_server_fleet_without_the_token_for_its_port_route_says_so(server, monkeypatch):
    monkeypatch.delenv("FANFOLD_TOKEN", raising=False)
    async with AsyncFleet(server.tcp_url, token=server.tokens["alice"]) as fleet:
        deployment = FanfoldDeployment(fleet=fleet, labels={"case": "no-token"})  # token= forgotten
        with pytest.raises(SwerexStartFailed, match=r"refused the runtime's requests to the sandbox's port \(401\): "
                                                    "give FanfoldDeployment the fleet's token"):
            await deployment.start()
        assert await fleet.list(labels={"case": "no-token"}) == []


async def deployment_alive(deployment: FanfoldDeployment) -> bool:
    try:
        return bool(await deployment.is_alive())
    except DeploymentNotStartedError:
        return False


async def test_an_image_built_ahead_on_a_caller_owned_fleet_that_stays_open(config, monkeypatch):
    # and a key that looks like an option: one fresh key in 64 begins with "-"
    monkeypatch.setattr(swerex, "_auth_token", lambda: "-looks-like-an-option")
    async with AsyncFleet(config=config) as fleet:
        image = await fleet.build(with_swerex("host"))  # the steps start() would add, cached
        deployment = FanfoldDeployment(fleet=fleet, image=image.id, install=False)
        await deployment.start()
        assert deployment.sandbox.info.image_id == image.id
        assert deployment.runtime._config.auth_token == "-looks-like-an-option"
        assert await deployment.is_alive()
        sandbox_id = deployment.sandbox.id
        await (await fleet.get(sandbox_id)).kill()  # gone before stop(), as at its deadline
        await deployment.stop()
        assert sandbox_id not in [info.id for info in await fleet.list()]
        async with await fleet.create("host") as sandbox:
            assert (await sandbox.exec("echo open")).text == "open\n"


async def test_a_server_that_exits_fails_the_start_with_its_output(config):
    # install=False on an image without swe-rex: the launch finds no swerex-remote
    async with AsyncFleet(config=config) as fleet:
        deployment = FanfoldDeployment(fleet=fleet, install=False, labels={"case": "exits"})
        exited = ("swerex-remote exited in sandbox sb-.* before it answered; "
                  "its output:\n.*/opt/swerex/bin/swerex-remote: No such file or directory")
        with pytest.raises(SwerexStartFailed, match=exited) as raised:
            await deployment.start()
        assert isinstance(raised.value, DeploymentStartupError) and isinstance(raised.value, FanfoldError)
        assert await fleet.list(labels={"case": "exits"}) == []
        with pytest.raises(DeploymentNotStartedError):
            await deployment.is_alive()


async def test_a_server_that_never_answers_times_out(config):
    async with AsyncFleet(config=config) as fleet:
        mute = await fleet.build(EnvSpec("host").run("printf '#!/bin/sh\\necho listening soon\\nexec sleep 600\\n'"
                                                     " > /opt/mute && chmod +x /opt/mute"))
        deployment = FanfoldDeployment(fleet=fleet, image=mute.id, install=False, executable="/opt/mute",
                                       startup_timeout=1, labels={"case": "mute"})
        with pytest.raises(SwerexStartTimeout, match=r"did not answer on port 8000 of sandbox sb-\S+ within 1 s "
                                                     r"\(startup_timeout\).*its output:\nlistening soon") as raised:
            await deployment.start()
        assert isinstance(raised.value, TimeoutError) and isinstance(raised.value, DeploymentStartupError)
        assert await fleet.list(labels={"case": "mute"}) == []


async def test_a_failed_install_names_the_package(config):
    async with AsyncFleet(config=config) as fleet:
        deployment = FanfoldDeployment(fleet=fleet, package="/nonexistent/swe_rex-0-py3-none-any.whl",
                                       labels={"case": "install"})
        with pytest.raises(SwerexStartFailed, match="installing /nonexistent/swe_rex-0-py3-none-any.whl into image "
                                                    "'host' failed: .*nonexistent"):
            await deployment.start()
        assert await fleet.list(labels={"case": "install"}) == []


def test_without_swe_rex_the_import_names_the_extra():
    code = ("import sys\nsys.modules['swerex'] = None\n"
            "try:\n    import fanfold.integrations.swerex\n"
            "except ImportError as err:\n    print(type(err).__name__, err)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout == ("MissingExtra FanfoldDeployment needs swe-rex, which is not installed: "
                           "pip install 'fanfold[integrations]'\n"), done.stderr
