"""mini-swe-agent's own ``DefaultAgent`` and scripted ``DeterministicModel`` on ``FanfoldEnvironment``,
over real sandboxes (embedded and through a server): the submit sentinel, timeouts, exit codes, cwd,
env, the template variables the default prompt reads, serialization and cleanup."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

# mini-swe-agent prints a banner and makes a global config dir on import: silence it, and keep it here.
CONFIG_DIR = tempfile.mkdtemp(prefix="fanfold-mswea-")
os.environ["MSWEA_SILENT_STARTUP"] = "1"
os.environ["MSWEA_GLOBAL_CONFIG_DIR"] = CONFIG_DIR

yaml = pytest.importorskip("yaml")
pytest.importorskip("minisweagent")
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import builtin_config_dir  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

from fanfold import Fleet  # noqa: E402
from fanfold.errors import SandboxNotFound  # noqa: E402
from fanfold.integrations.minisweagent import FanfoldEnvironment  # noqa: E402

CLASS_PATH = "fanfold.integrations.minisweagent.FanfoldEnvironment"
DEFAULT_CONFIG = yaml.safe_load((builtin_config_dir / "default.yaml").read_text())


@pytest.fixture(scope="module", autouse=True)
def config_dir_removed_at_end():
    yield
    shutil.rmtree(CONFIG_DIR, ignore_errors=True)


@pytest.fixture(scope="module")
def sync_fleet(config):
    with Fleet(config=config) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def env(sync_fleet):
    environment = FanfoldEnvironment(fleet=sync_fleet, env={"GREETING": "hi"}, timeout=20)
    yield environment
    environment.cleanup()


def test_the_default_agent_runs_its_commands_in_a_sandbox_and_submits(config):
    path = f"/tmp/mswea-{uuid.uuid4().hex}.txt"
    model = DeterministicModel(outputs=[
        make_output("Write the note.", [{"command": f"printf 'fixed by %s\\n' \"$PAGER\" > {path}"}]),
        make_output("Read it back.", [{"command": f"cat {path}"}]),
        make_output("Done.", [{"command": f"echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat {path}"}]),
    ])
    env = get_environment({**DEFAULT_CONFIG["environment"], "environment_class": CLASS_PATH, "image": "host",
                           "engine_config": config})
    try:
        assert isinstance(env, FanfoldEnvironment)
        agent = DefaultAgent(model, env, **DEFAULT_CONFIG["agent"])
        result = agent.run("Leave a note in /tmp.")
        uname = env.uname()
        sandbox_id = env.sandbox.id
    finally:
        env.cleanup()
    assert result == {"exit_status": "Submitted", "submission": "fixed by cat\n"}  # PAGER from default.yaml's env
    observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
    assert "<returncode>0</returncode>" in observations[0]
    assert "fixed by cat" in observations[1]
    # the default instance template shows the sandbox's uname, not the host's
    assert f"{uname['system']} {uname['release']} {uname['version']} {uname['machine']}" in agent.messages[1]["content"]
    assert uname["node"] == sandbox_id
    assert not Path(path).exists(), "the command ran on the host"
    assert agent.serialize()["info"]["config"]["environment_type"] == CLASS_PATH


def test_stdout_and_stderr_interleave_and_a_failure_keeps_its_exit_code(env):
    done = env.execute({"command": "echo one; echo two >&2; echo three; exit 3"})
    assert done == {"output": "one\ntwo\nthree\n", "returncode": 3, "exception_info": ""}


def test_a_timeout_is_returncode_minus_one_with_the_exception(env):
    done = env.execute({"command": "echo started; sleep 30"}, timeout=1)
    assert done["returncode"] == -1 and done["output"] == "started\n"
    message = "Command 'echo started; sleep 30' timed out after 1 seconds"
    assert done["exception_info"] == f"An error occurred while executing the command: {message}"
    assert done["extra"] == {"exception_type": "ExecTimeout", "exception": message}
    assert env.execute({"command": "echo still here"})["output"] == "still here\n"


def test_cwd_env_and_a_login_shell(env):
    assert env.execute({"command": "pwd"}, cwd="/tmp")["output"] == "/tmp\n"
    assert env.execute({"command": "pwd"})["output"] == "/\n"  # the image's working directory
    assert env.execute({"command": "echo $GREETING $0"})["output"] == "hi bash\n"
    assert env.execute({"command": "shopt -q login_shell && echo login"})["output"] == "login\n"


def test_forwarded_host_variables_yield_to_env(sync_fleet, monkeypatch):
    monkeypatch.setenv("FANFOLD_MSWEA_A", "from host")
    monkeypatch.setenv("GREETING", "from host")
    env = FanfoldEnvironment(fleet=sync_fleet, env={"GREETING": "hi"},
                             forward_env=["FANFOLD_MSWEA_A", "GREETING", "FANFOLD_MSWEA_UNSET"])
    try:
        done = env.execute({"command": 'echo "$FANFOLD_MSWEA_A/$GREETING/${FANFOLD_MSWEA_UNSET-unset}"'})
    finally:
        env.cleanup()
    assert done["output"] == "from host/hi/unset\n"


def test_the_sentinel_submits_only_first_and_on_success(env):
    with pytest.raises(Submitted) as raised:
        env.execute({"command": "echo; echo '  COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT'; printf 'a\\nb\\n'"})
    assert raised.value.messages == ({"role": "exit", "content": "a\nb\n",
                                      "extra": {"exit_status": "Submitted", "submission": "a\nb\n"}},)
    failed = env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; exit 1"})
    assert failed["returncode"] == 1
    later = env.execute({"command": "echo x; echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})
    assert later["returncode"] == 0


def test_serialize_and_template_vars(sync_fleet):
    env = FanfoldEnvironment(fleet=sync_fleet, token="secret-token", cwd="/tmp", limits={"memory_mb": 128})
    try:
        data = env.serialize()
        variables = env.get_template_vars(cwd="/override")
        host_name = env.execute({"command": "uname -n"})["output"].strip()
    finally:
        env.cleanup()
    assert data["info"]["config"]["environment_type"] == CLASS_PATH
    saved = data["info"]["config"]["environment"]
    assert saved["image"] == "host" and saved["cwd"] == "/tmp" and saved["limits"] == {"memory_mb": 128}
    assert "token" not in saved and "secret-token" not in repr(data)
    assert {"system", "release", "version", "machine"} <= variables.keys()
    assert variables["system"] == "Linux" and variables["node"] == host_name
    assert variables["timeout"] == 30 and variables["cwd"] == "/override"  # kwargs win, as theirs
    assert "token" not in variables


def test_cleanup_destroys_the_sandbox_and_the_fleet_it_made(config, sync_fleet):
    env = FanfoldEnvironment(engine_config=config)
    sandbox_id = env.sandbox.id
    assert sync_fleet.get(sandbox_id).info.state == "running"
    owned = env.fleet
    env.cleanup()
    env.cleanup()  # idempotent
    with pytest.raises(SandboxNotFound):
        sync_fleet.get(sandbox_id)
    assert owned._portal is None, "the embedded fleet it made is still running"
    with pytest.raises(RuntimeError, match="cleaned up"):
        env.execute({"command": "true"})


def test_a_caller_owned_fleet_stays_open(sync_fleet):
    env = FanfoldEnvironment(fleet=sync_fleet)
    sandbox_id = env.sandbox.id
    env.close()
    with pytest.raises(SandboxNotFound):
        sync_fleet.get(sandbox_id)
    with sync_fleet.create("host") as sandbox:
        assert sandbox.exec("echo open").text == "open\n"


def test_through_a_server(server):
    token = server.tokens["alice"]
    env = get_environment({"environment_class": CLASS_PATH, "url": server.tcp_url, "token": token})
    try:
        done = env.execute({"command": "echo remote; echo err >&2; false"})
        sandbox_id = env.sandbox.id
        assert token not in repr(env.serialize())
    finally:
        env.cleanup()
    assert done == {"output": "remote\nerr\n", "returncode": 1, "exception_info": ""}
    with Fleet(server.tcp_url, token=token) as remote:
        assert sandbox_id not in [info.id for info in remote.list()]


def test_without_mini_swe_agent_the_import_names_the_extra():
    code = ("import sys\nsys.modules['minisweagent'] = None\n"
            "try:\n    import fanfold.integrations.minisweagent\n"
            "except ImportError as err:\n    print(type(err).__name__, err)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout == ("MissingExtra FanfoldEnvironment needs mini-swe-agent, which is not installed: "
                           "pip install 'fanfold[integrations]'\n"), done.stderr
