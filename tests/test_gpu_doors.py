"""``gpus=`` at every door: the CLI, the HTTP bodies (create, pool, rollout), the RL layer, and images
whose ``EnvSpec.gpus`` (or a Dockerfile's ``LABEL fanfold.gpus``) gives their sandboxes GPUs.

The GPU host is synthetic: character devices with /dev/null's numbers named as NVIDIA's nodes, and
a driver tree whose ``nvidia-smi`` is a script. The session's server has no GPU at all.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from conftest import TOKENS, run_cli
from fanfold import AsyncFleet, EngineConfig, EnvSpec, InvalidRequest, InvalidSpec, Limits
from fanfold.rl.grading import pristine_sandbox

FAKE_UUID = "GPU-00000000-1111-2222-3333-444444444444"
FAKE_LINE = f"GPU 0: Fake (UUID: {FAKE_UUID})"


@pytest.fixture(scope="module")
def gpu_host(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One synthetic GPU: its device nodes, the driver's /proc file naming it, and a driver tree whose
    ``nvidia-smi`` names it too."""
    root = tmp_path_factory.mktemp("gpuhost")
    options = subprocess.run(["findmnt", "-n", "-o", "OPTIONS", "-T", str(root)], capture_output=True, text=True).stdout
    assert "nodev" not in options.split(","), f"{root} is on a nodev mount: its device nodes would not open"
    for sub in ("dev", "cdi", "nvidia/bin", "nvidia/lib64"):
        (root / sub).mkdir(parents=True)
    for name in ("nvidia0", "nvidiactl", "nvidia-uvm"):
        os.mknod(root / "dev" / name, 0o20666, os.makedev(1, 3))
        os.chmod(root / "dev" / name, 0o666)
    info = root / "proc/gpus/0000:00:1e.0/information"  # the driver's: nvidia0 is minor 0
    info.parent.mkdir(parents=True)
    info.write_text(f"Model: \t\t Fake\nGPU UUID: \t {FAKE_UUID}\nDevice Minor: \t 0\n")
    smi = root / "nvidia/bin/nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{FAKE_LINE}'\n")
    smi.chmod(0o755)
    return root


def gpu_env(root: Path) -> dict[str, str]:
    """The CLI's variables pointing its engine at ``root``'s GPUs (an empty dir: a host with none)."""
    return {"FANFOLD_GPU_DEV_DIR": str(root / "dev"), "FANFOLD_GPU_CDI_DIRS": str(root / "cdi"),
            "FANFOLD_GPU_PROC_DIR": str(root / "proc"), "FANFOLD_GPU_DRIVER_DIRS": str(root / "nvidia")}


def gpu_config(config: EngineConfig, root: Path) -> EngineConfig:
    return dataclasses.replace(config, gpu_dev_dir=str(root / "dev"), gpu_cdi_dirs=(str(root / "cdi"),),
                               gpu_proc_dir=str(root / "proc"), gpu_driver_dirs=(str(root / "nvidia"),))


@pytest.fixture
def no_gpu_host(tmp_path: Path) -> Path:
    """A host with no GPU, whatever this machine has."""
    return tmp_path


def test_gpus_none_or_zero_is_none_outright_and_unset_is_the_images():
    assert Limits().gpus is None and Limits(gpus="").gpus is None
    assert Limits(gpus=0).gpus == Limits(gpus="none").gpus == Limits(gpus=False).gpus == "none"
    assert Limits(gpus=2).gpus == "2" and Limits(gpus=[0, 1]).gpus == "device=0,1"


# -- the CLI -----------------------------------------------------------------------------------


def test_cli_run_with_gpus_runs_nvidia_smi_inside(gpu_host: Path):
    done = run_cli("run", "--gpus", "1", "--", "nvidia-smi", "-L", env=gpu_env(gpu_host))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == FAKE_LINE
    exclusive = run_cli("run", "--gpus", "all", "--gpu-exclusive", "--", "test", "-c", "/dev/nvidia0",
                        env=gpu_env(gpu_host))
    assert exclusive.returncode == 0, exclusive.stderr


def test_cli_create_holds_gpus_and_ls_shows_them(gpu_host: Path):
    env = gpu_env(gpu_host)
    made = run_cli("create", "--gpus", "device=0", "--gpu-exclusive", env=env)
    assert made.returncode == 0, made.stderr
    sandbox_id = made.stdout.strip()
    try:
        listed = run_cli("ls", env=env)
        header, *rows = [line.split("\t") for line in listed.stdout.splitlines()]
        assert header[-1] == "GPUS"
        assert next(row for row in rows if row[0] == sandbox_id)[-1] == f"{FAKE_UUID} (exclusive)"
    finally:
        assert run_cli("rm", sandbox_id, env=env).returncode == 0


def test_cli_on_a_host_without_gpus_says_so_in_one_line(no_gpu_host: Path, server):
    for args in (("run", "--gpus", "all", "--", "nvidia-smi", "-L"), ("create", "--gpus", "1"),
                 ("--url", server.unix_url, "pool", "--size", "1", "--gpus", "1")):
        done = run_cli(*args, env=gpu_env(no_gpu_host))
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "this host has no GPU" in done.stderr and "Traceback" not in done.stderr, done.stderr
    bad = run_cli("run", "--gpus", "lots", "--", "true", env=gpu_env(no_gpu_host))
    assert bad.returncode == 2 and "is not a GPU request" in bad.stderr and "Traceback" not in bad.stderr


# -- HTTP ----------------------------------------------------------------------------------------


def refused(response: httpx.Response, words: str) -> None:
    assert response.status_code == 422 and response.json()["kind"] == "invalid_request", response.text
    assert words in response.json()["message"], response.text


def test_http_bodies_take_gpus_and_a_host_without_any_refuses_them(server):
    auth = {"Authorization": f"Bearer {TOKENS['alice']}"}
    with httpx.Client(base_url=server.tcp_url, headers=auth, timeout=60) as http:
        for gpus in ("all", 1, "device=0", "2"):
            refused(http.post("/v1/sandboxes", json={"gpus": gpus}), "this host has no GPU")
        refused(http.put("/v1/pools", json={"size": 1, "gpus": "all", "gpu_exclusive": True}), "this host has no GPU")
        refused(http.post("/v1/rollouts", json={"limits": {"gpus": "all"}}), "this host has no GPU")
        for body in ({"gpus": True}, {"gpus": 1.5}, {"gpu_exclusive": "yes"}, {"gpu_exclusive": 1}):
            assert http.post("/v1/sandboxes", json=body).status_code == 422, body
        refused(http.post("/v1/sandboxes", json={"gpus": "lots"}), "is not a GPU request")
        made = http.post("/v1/sandboxes", json={"gpus": 0, "memory_mb": 128})  # none, outright: fine anywhere
        assert made.status_code == 201, made.text
        try:
            assert made.json()["gpu_ids"] == [] and made.json()["limits"]["gpus"] is None
        finally:
            http.delete(f"/v1/sandboxes/{made.json()['id']}")
        rollout = http.post("/v1/rollouts", json={"limits": {"gpus": "none"}})
        assert rollout.status_code == 201, rollout.text
        http.delete(f"/v1/rollouts/{rollout.json()['rollout_id']}")


# -- images that ask for GPUs ----------------------------------------------------------------------


async def has_gpu(sandbox) -> bool:  # type: ignore[no-untyped-def]
    return (await sandbox.exec(["test", "-c", "/dev/nvidia0"])).exit_code == 0


async def test_an_images_gpus_are_its_sandboxes_unless_the_create_names_others(config, gpu_host: Path):
    async with AsyncFleet(config=gpu_config(config, gpu_host)) as fleet:
        image = await fleet.build(EnvSpec("host").gpus(1, exclusive=True))
        assert (image.gpus, image.gpu_exclusive) == ("1", True)
        async with await fleet.create(image, memory_mb=128) as sandbox:
            assert sandbox.info.gpu_ids == [FAKE_UUID] and sandbox.info.limits.gpu_exclusive
            assert (await sandbox.exec(["nvidia-smi", "-L"])).stdout.decode().strip() == FAKE_LINE
        for none in (0, "none"):
            async with await fleet.create(image, memory_mb=128, gpus=none) as sandbox:
                assert sandbox.info.gpu_ids == [] and sandbox.info.limits.gpus is None
                assert not await has_gpu(sandbox)
        async with await fleet.create(image, memory_mb=128, gpus="all") as sandbox:  # the create's, not exclusive
            assert sandbox.info.gpu_ids == [FAKE_UUID] and not sandbox.info.limits.gpu_exclusive
        plain = await fleet.build(EnvSpec(image.id).gpus(None))  # a spec on it drops the default
        async with await fleet.create(plain, memory_mb=128) as sandbox:
            assert sandbox.info.gpu_ids == [] and not await has_gpu(sandbox)
        async with pristine_sandbox(fleet, image, limits={"memory_mb": 128}) as graded:  # the RL layer's creates
            assert graded.info.gpu_ids == [FAKE_UUID]
        async with pristine_sandbox(fleet, "host", limits={"memory_mb": 128, "gpus": 1}) as graded:
            assert graded.info.gpu_ids == [FAKE_UUID] and await has_gpu(graded)
        pool = await fleet.pool(image, 0)  # a pool's limits resolve the same way its creates' do
        assert pool.limits.gpus == "1" and pool.limits.gpu_exclusive


async def test_a_dockerfile_label_or_from_dockerfile_gpus_asks_for_gpus(config, gpu_host: Path, tmp_path: Path):
    (tmp_path / "Dockerfile").write_text("FROM host\nLABEL fanfold.gpus=all\nRUN test ! -e /dev/nvidia0\n")
    async with AsyncFleet(config=gpu_config(config, gpu_host)) as fleet:
        image = await fleet.build(EnvSpec.from_dockerfile(tmp_path / "Dockerfile"))  # its RUN saw no GPU
        assert image.gpus == "all" and not image.gpu_exclusive
        async with await fleet.create(image, memory_mb=128) as sandbox:
            assert sandbox.info.gpu_ids == [FAKE_UUID] and await has_gpu(sandbox)
        without = await fleet.build(EnvSpec.from_dockerfile(tmp_path / "Dockerfile", gpus=0))
        assert without.gpus == "none"
        async with await fleet.create(without, memory_mb=128) as sandbox:
            assert sandbox.info.gpu_ids == [] and not await has_gpu(sandbox)
    (tmp_path / "Dockerfile").write_text("FROM host\nLABEL fanfold.gpus=lots\n")
    with pytest.raises(InvalidSpec, match="label fanfold.gpus='lots' is not a GPU request"):
        EnvSpec.from_dockerfile(tmp_path / "Dockerfile")
    with pytest.raises(InvalidSpec, match="gpu_exclusive='yes' must be true or false"):
        EnvSpec("host").label(**{"fanfold.gpu_exclusive": "yes"})


async def test_a_gpu_image_on_a_host_without_gpus_says_whose_gpus_and_how_to_go_without(config, no_gpu_host: Path):
    async with AsyncFleet(config=gpu_config(config, no_gpu_host)) as fleet:
        image = await fleet.build(EnvSpec("host").gpus("all"))
        with pytest.raises(InvalidRequest, match=rf"image {image.id} asks for GPUs .*this host has no GPU.*gpus=none"):
            await fleet.create(image)
        async with await fleet.create(image, memory_mb=128, gpus="none") as sandbox:
            assert sandbox.info.gpu_ids == []
            snapshot = await sandbox.snapshot(memory=True)  # no GPU held: its memory may be checkpointed
        try:  # its processes come back as they were: the image's GPUs are not theirs
            async with await fleet.create(snapshot) as restored:
                assert restored.info.gpu_ids == []
        finally:
            await fleet.delete_snapshot(snapshot.id)
