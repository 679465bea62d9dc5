"""Drives ``FanfoldEnvironment`` through Harbor's own classes, in Harbor's interpreter (Python >= 3.12):
run as ``python harbor_probe.py TASK_DIR WORK_DIR``, it prints one JSON object of what it saw.

test_harbor.py runs it as a subprocess, since Harbor does not install into the test suite's Python."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from harbor.environments.factory import EnvironmentFactory
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

IMPORT_PATH = "fanfold.integrations.harbor:FanfoldEnvironment"


def make(task_dir: Path, work: Path, name: str, **config):
    return EnvironmentFactory.create_environment_from_import_path(
        IMPORT_PATH, environment_dir=task_dir / "environment", environment_name=name,
        session_id=f"{name}__probe__env", trial_paths=TrialPaths(work / name),
        task_env_config=EnvironmentConfig(**config),
        network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK),
        phase_network_policies=[NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["example.com"])])


async def probe(task_dir: Path, work: Path) -> dict:
    seen: dict = {}
    env = make(task_dir, work, "probe", cpus=0.5, memory_mb=768, storage_mb=1536, env={"TASK_VAR": "from-task"})
    seen["type"] = env.type()
    seen["capabilities"] = env.capabilities.model_dump()
    await env.start(force_build=False)
    sandbox = env._sandbox
    info = await sandbox.refresh()
    seen["limits"] = {"cpus": info.limits.cpus, "memory_mb": info.limits.memory_mb, "disk_mb": info.limits.disk_mb}
    seen["network_at_start"] = _network(info)
    run = await env.exec("pwd; echo $TASK_VAR $ONE; id -un; echo oops >&2; exit 3", env={"ONE": "1"})
    seen["exec"] = run.model_dump()
    seen["exec_cwd"] = (await env.exec("pwd", cwd="/tmp")).stdout
    seen["exec_user"] = (await env.exec("id -un", user="nobody")).stdout
    seen["exec_uid"] = (await env.exec("id -u", user=65534)).stdout
    try:
        await env.exec("sleep 30", timeout_sec=1)
        seen["timeout"] = "returned"
    except Exception as err:  # what Harbor sees of a command that ran out of time
        seen["timeout"] = type(err).__name__
    source = work / "up"
    (source / "sub" / "empty").mkdir(parents=True)
    (source / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (source / "run.sh").chmod(0o755)
    (source / "sub" / "data.bin").write_bytes(bytes(range(256)) * 64)
    (source / "big.bin").write_bytes(b"x" * (9 << 20))  # past UPLOAD_IN_MEMORY: streamed, then its mode set
    (source / "big.bin").chmod(0o640)
    await env.upload_dir(source, "/srv/in")
    seen["big_file"] = (await env.exec("stat -c '%a %s' /srv/in/big.bin")).stdout
    seen["uploaded_runs"] = (await env.exec("/srv/in/run.sh && test -d /srv/in/sub/empty && echo dir")).stdout
    await env.upload_file(source / "run.sh", "/srv/one/run.sh")
    seen["is_file"] = await env.is_file("/srv/one/run.sh")
    await env.download_dir("/srv/in", work / "down")
    seen["round_trip"] = (work / "down" / "sub" / "data.bin").read_bytes() == bytes(range(256)) * 64
    await env.download_file("/srv/in/run.sh", work / "one" / "run.sh")
    seen["downloaded_file"] = (work / "one" / "run.sh").read_text()
    await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.ALLOWLIST,
                                               allowed_hosts=["example.com", "*.example.org", "203.0.113.7",
                                                              "2001:db8::1", "198.51.100.0/24", "2001:db8::/32"]))
    seen["network_allowlist"] = _network(await sandbox.refresh())
    seen["proxy_in_allowlist"] = (await env.exec("echo ${HTTPS_PROXY:-none}")).stdout.strip()
    await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))
    seen["network_back"] = _network(await sandbox.refresh())
    again = make(task_dir, work, "probe")  # the same task: its image is found by its name
    await again.start(force_build=False)
    seen["shared_fleet"] = again._fleet is env._fleet
    seen["images"] = [info.image_id, (await again._sandbox.refresh()).image_id]
    await env.stop(delete=True)
    try:
        await again._fleet.get(sandbox.id)
        seen["after_stop"] = "alive"
    except Exception as err:
        seen["after_stop"] = type(err).__name__
    await again.stop(delete=True)
    seen["refusals"] = refusals(task_dir, work)
    broken = work / "broken-task" / "environment"
    broken.mkdir(parents=True)
    (broken / "Dockerfile").write_text("FROM host\nRUN exit 7\n")
    try:
        await make(work / "broken-task", work, "broken").start(force_build=False)
        seen["broken_build"] = "started"
    except Exception as err:
        seen["broken_build"] = f"{type(err).__name__}: {err}"
    return seen


def refusals(task_dir: Path, work: Path) -> dict:
    said = {}
    compose = work / "compose-task" / "environment"
    compose.mkdir(parents=True)
    (compose / "docker-compose.yaml").write_text("services: {main: {image: debian}}\n")
    for what, build in (
        ("compose", lambda: make(work / "compose-task", work, "compose")),
        ("gpu_types", lambda: make(task_dir, work, "gpus", gpus=1, gpu_types=["H100"])),
        ("windows", lambda: make(task_dir, work, "windows", os="windows")),
    ):
        try:
            build()
            said[what] = "accepted"
        except Exception as err:
            said[what] = f"{type(err).__name__}: {err}"
    return said


def _network(info) -> object:
    policy = info.network
    return policy if isinstance(policy, (str, type(None))) else json.loads(json.dumps(policy, default=str))


if __name__ == "__main__":
    print(json.dumps(asyncio.run(probe(Path(sys.argv[1]), Path(sys.argv[2]))), default=str))
