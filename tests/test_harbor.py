"""Harbor's own CLI and classes on ``FanfoldEnvironment``, over real sandboxes: ``harbor run`` on a local
terminal-bench-style task with Harbor's oracle agent (reward 1) and its no-op agent (reward 0), embedded
and through ``fanfold serve``, the verifier's network phase in force; and start, exec, files, network
switches, stop and refusals through Harbor's environment factory.

Harbor needs Python >= 3.12, so it lives in a virtual environment of its own (``.venv-harbor``, made by
scripts/setup.sh where such a Python exists, or ``FANFOLD_HARBOR_VENV``), driven here as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARBOR_VENV = Path(os.environ.get("FANFOLD_HARBOR_VENV", ROOT / ".venv-harbor"))
HARBOR_PYTHON = HARBOR_VENV / "bin" / "python"
IMPORT_PATH = "fanfold.integrations.harbor:FanfoldEnvironment"


def _harbor_missing() -> str | None:
    if not HARBOR_PYTHON.exists():
        return (f"no Harbor virtual environment at {HARBOR_VENV}: Harbor needs Python >= 3.12, and scripts/setup.sh "
                "makes it only where python3.12 or later exists (pyenv or PATH)")
    probe = subprocess.run([str(HARBOR_PYTHON), "-c", "import harbor.environments.base"], capture_output=True,
                           text=True, timeout=120)
    return None if probe.returncode == 0 else f"Harbor does not import in {HARBOR_VENV}: {probe.stderr[-300:]}"


if (why := _harbor_missing()) is not None:
    pytest.skip(why, allow_module_level=True)

TASK_TOML = """\
version = "1.0"
[agent]
timeout_sec = 120.0
[verifier]
timeout_sec = 120.0
network_mode = "allowlist"
allowed_hosts = ["example.com", "*.example.org", "203.0.113.7", "2001:db8::/32"]
[environment]
build_timeout_sec = 300.0
cpus = 1
memory_mb = 1024
storage_mb = 2048
network_mode = "no-network"
"""
# Each phase writes down whether it had a way out: fanfold's proxy is in the environment only when a
# policy lets traffic out, so the agent's phase shows none and the verifier's allowlist shows the proxy.
SOLVE = '#!/bin/bash\necho "proxy=${HTTPS_PROXY:-none}" > /logs/agent/network.txt\necho fixed > /app/note.txt\n'
TEST = ('#!/bin/bash\necho "proxy=${HTTPS_PROXY:-none}" > /logs/verifier/network.txt\n'
        'if grep -qx fixed /app/note.txt; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n')


def write_task(root: Path, toml: str, solve: str, test: str) -> Path:
    """A terminal-bench-style task: an instruction, a Dockerfile on fanfold's offline base, tests, a solution."""
    for part in ("environment", "solution", "tests"):
        (root / part).mkdir(parents=True)
    (root / "instruction.md").write_text('Write the word "fixed" into /app/note.txt.\n')
    (root / "task.toml").write_text(toml)
    (root / "environment" / "Dockerfile").write_text("FROM host\nWORKDIR /app\nRUN echo broken > /app/note.txt\n")
    for path, text in ((root / "solution" / "solve.sh", solve), (root / "tests" / "test.sh", test)):
        path.write_text(text)
        path.chmod(0o755)
    return root


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_task(tmp_path_factory.mktemp("harbor") / "fix-note", TASK_TOML, SOLVE, TEST)


def harbor_env(**fanfold: str) -> dict[str, str]:
    """Harbor's environment: this tree first, none of the caller's FANFOLD_ variables but ``fanfold``'s."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith("FANFOLD_")}
    return {**kept, "PYTHONPATH": str(ROOT), "LITELLM_LOCAL_MODEL_COST_MAP": "True", **fanfold}


def harbor_run(task: Path, agent: str, jobs: Path, env: dict[str, str], trials: int = 1) -> Path:
    """``harbor run`` of a task (or a folder of ``trials`` tasks, run at once); returns the trial's directory."""
    done = subprocess.run(
        [str(HARBOR_VENV / "bin" / "harbor"), "run", "-p", str(task), "-a", agent, "-e", IMPORT_PATH,
         "-o", str(jobs), "--job-name", agent, "-n", str(trials), "-y", "-q"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = [p for p in (jobs / agent).iterdir() if (p / "result.json").is_file()]
    assert len(found) == trials, done.stdout[-3000:]
    return found[0] if trials == 1 else jobs / agent


def trial_outcome(trial: Path) -> tuple[float | None, object]:
    result = json.loads((trial / "result.json").read_text())
    rewards = (result.get("verifier_result") or {}).get("rewards") or {}
    return rewards.get("reward"), result.get("exception_info")


@pytest.mark.parametrize("where", ["embedded", "server"])
def test_harbor_run_with_the_oracle_gets_reward_1_and_each_phase_its_network(task, where, config, request, tmp_path):
    if where == "embedded":
        env = harbor_env(FANFOLD_STATE_DIR=str(config.state_dir))
    else:  # a tenant's token, as a trainer off the host has it
        server = request.getfixturevalue("server")
        env = harbor_env(FANFOLD_URL=server.tcp_url, FANFOLD_TOKEN=server.tokens["alice"])
    trial = harbor_run(task, "oracle", tmp_path / "jobs", env)
    assert trial_outcome(trial) == (1.0, None)
    assert (trial / "agent" / "network.txt").read_text() == "proxy=none\n"
    assert (trial / "verifier" / "network.txt").read_text().startswith("proxy=http://")


def test_harbor_run_with_the_nop_agent_gets_reward_0(task, config, tmp_path):
    trial = harbor_run(task, "nop", tmp_path / "jobs", harbor_env(FANFOLD_STATE_DIR=str(config.state_dir)))
    assert trial_outcome(trial) == (0.0, None)


def test_trials_run_at_once_share_one_embedded_engine(config, tmp_path):
    for name in ("first", "second"):
        write_task(tmp_path / "tasks" / name, TASK_TOML, SOLVE, TEST)
    job = harbor_run(tmp_path / "tasks", "oracle", tmp_path / "jobs",
                     harbor_env(FANFOLD_STATE_DIR=str(config.state_dir)), trials=2)
    outcomes = [trial_outcome(trial) for trial in job.iterdir() if (trial / "result.json").is_file()]
    assert outcomes == [(1.0, None), (1.0, None)]


def test_a_task_on_a_prebuilt_docker_image_pulls_it(registry, config, tmp_path, monkeypatch):
    """``[environment].docker_image`` and no Dockerfile: the image comes from a registry (a loopback one)."""
    import registry as images

    monkeypatch.setattr(images, "RUNNABLE_TOOLS", images.RUNNABLE_TOOLS + ("bash", "chmod", "grep"))
    tree = images.runnable_tree(tmp_path / "tree")
    (tree / "app").mkdir()
    (tree / "app" / "note.txt").write_text("broken\n")
    ref = images.push_tree(registry, "harbor-task:v1", [tree],
                           config={"Env": ["PATH=/usr/bin:/bin", "HOME=/root"], "WorkingDir": "/app"})
    toml = TASK_TOML.replace("[environment]\n", f'[environment]\ndocker_image = "{ref}"\n')
    task = write_task(tmp_path / "prebuilt", toml, SOLVE, TEST)
    (task / "environment" / "Dockerfile").unlink()
    env = harbor_env(FANFOLD_STATE_DIR=str(config.state_dir), FANFOLD_INSECURE_REGISTRIES=registry.host)
    assert trial_outcome(harbor_run(task, "oracle", tmp_path / "jobs", env)) == (1.0, None)


def test_a_task_that_asks_for_a_gpu_gets_one(config, tmp_path):
    """On a synthetic GPU host (tests/test_gpu.py's): the task's ``gpus = 1`` reaches the sandbox."""
    from test_gpu import make_host

    host = tmp_path / "gpuhost"
    host.mkdir()
    if "nodev" in subprocess.run(["findmnt", "-no", "OPTIONS", "-T", str(host)], capture_output=True, text=True).stdout:
        pytest.skip(f"{host} is on a nodev mount: device nodes there cannot be opened")
    made = make_host(host)
    gpu_env = {"FANFOLD_GPU_DEV_DIR": made["gpu_dev_dir"], "FANFOLD_GPU_PROC_DIR": made["gpu_proc_dir"],
               "FANFOLD_GPU_CDI_DIRS": ",".join(made["gpu_cdi_dirs"]),
               "FANFOLD_GPU_DRIVER_DIRS": ",".join(made["gpu_driver_dirs"])}
    toml = TASK_TOML.replace("storage_mb = 2048\n", "storage_mb = 2048\ngpus = 1\n")
    test = ("#!/bin/bash\nnvidia-smi > /logs/verifier/gpu.txt\n"
            "if test -c /dev/nvidia0; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n")
    task = write_task(tmp_path / "gpu-task", toml, "#!/bin/bash\ntrue\n", test)
    env = harbor_env(FANFOLD_STATE_DIR=str(config.state_dir), **gpu_env)
    trial = harbor_run(task, "oracle", tmp_path / "jobs", env)
    assert trial_outcome(trial) == (1.0, None)
    assert (trial / "verifier" / "gpu.txt").read_text().startswith("GPU ")


@pytest.fixture(scope="module")
def probed(task, config, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What tests/harbor_probe.py saw driving the environment through Harbor's factory (embedded)."""
    done = subprocess.run([str(HARBOR_PYTHON), str(ROOT / "tests" / "harbor_probe.py"), str(task),
                           str(tmp_path_factory.mktemp("probe"))],
                          env=harbor_env(FANFOLD_STATE_DIR=str(config.state_dir)), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_start_gives_the_sandbox_the_tasks_limits_network_and_image(probed):
    assert probed["type"] == "fanfold"
    assert probed["limits"] == {"cpus": 0.5, "memory_mb": 768, "disk_mb": 1536}
    assert probed["network_at_start"] == "none"
    first, second = probed["images"]
    assert first == second  # the second start found the task's image under its name


def test_exec_maps_harbors_arguments_and_results(probed):
    assert probed["exec"] == {"stdout": "/app\nfrom-task 1\nroot\n", "stderr": "oops\n", "return_code": 3}
    assert probed["exec_cwd"] == "/tmp\n"
    assert probed["exec_user"] == "nobody\n"
    assert probed["exec_uid"] == "65534\n"
    assert probed["timeout"] == "ExecTimeout"


def test_files_go_in_and_out_with_their_modes_and_directories(probed):
    assert probed["uploaded_runs"] == "ran\ndir\n"
    assert probed["big_file"] == f"640 {9 << 20}\n"
    assert probed["is_file"] is True
    assert probed["round_trip"] is True
    assert probed["downloaded_file"] == "#!/bin/sh\necho ran\n"


def test_network_policy_switches_live_with_every_allowlist_kind(probed):
    caps = probed["capabilities"]
    assert caps["dynamic_network_policy"] and caps["disable_internet"] and caps["gpus"]
    assert all(caps[k] for k in caps if k.startswith("network_allowlist"))
    assert not caps["docker_compose"] and not caps["mounted"] and not caps["windows"]
    assert probed["network_allowlist"] == {"allow": ["example.com", "*.example.org", "203.0.113.7", "2001:db8::1",
                                                     "198.51.100.0/24", "2001:db8::/32"], "deny": []}
    assert probed["proxy_in_allowlist"].startswith("http://")
    assert probed["network_back"] == "none"


def test_stop_destroys_the_sandbox_and_environments_share_one_fleet(probed):
    assert probed["shared_fleet"] is True
    assert probed["after_stop"] == "SandboxNotFound"


def test_what_fanfold_cannot_run_is_refused_with_the_reason(probed):
    refused = probed["refusals"]
    assert "does not run Docker Compose tasks" in refused["compose"]
    assert "drop [environment].gpu_types" in refused["gpu_types"]
    assert "does not support Windows" in refused["windows"]


def test_a_dockerfile_that_fails_to_build_is_harbors_build_failure(probed):
    assert probed["broken_build"].startswith("SandboxBuildFailedError: fanfold cannot build"), probed["broken_build"]
