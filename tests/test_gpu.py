"""GPU sandboxes: the request, CDI specs, discovery, scheduling shares, quotas, refusals, and release.

There is no GPU here: a synthetic host stands in, with character devices the tests make under the
NVIDIA names (``/dev/null``'s numbers, and ``/dev/fuse``'s for one, whose opening only the sandbox's
device rule allows) and a driver tree with a stand-in ``nvidia-smi``. The sandboxes are real (crun).
The tests at the end run only where ``/dev/nvidia0`` exists.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fanfold import (AsyncFleet, CapacityExceeded, CreateParams, EngineConfig, HostNotReady, InvalidRequest, Limits,
                     QuotaExceeded)
from fanfold.config import Quota
from fanfold.host import gpus as hostgpus
from fanfold.host.cdi import load_specs

from conftest import leaks

UUIDS = ("GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000")
FUSE = (10, 229)  # /dev/fuse: crun's default rules do not allow it; opening it is harmless


def make_host(root: Path, *, proc: bool = True) -> dict[str, object]:
    """A synthetic GPU host under ``root``: two GPUs (nvidia0 as /dev/null, nvidia1 as /dev/fuse), the shared
    nodes, the driver's /proc files and a driver tree; returns the EngineConfig fields that point at it."""
    dev = root / "dev"
    (dev / "nvidia-caps").mkdir(parents=True, exist_ok=True)
    for name, (major, minor) in {"nvidia0": (1, 3), "nvidia1": FUSE, "nvidiactl": (1, 3), "nvidia-uvm": (1, 3),
                                 "nvidia-caps/nvidia-cap1": (1, 3)}.items():
        node = dev / name
        if not node.exists():
            os.mknod(node, 0o20666, os.makedev(major, minor))
            os.chmod(node, 0o666)
    if proc:
        for minor, uuid in enumerate(UUIDS):
            info = root / "proc" / "gpus" / f"0000:0{minor}:00.0" / "information"
            info.parent.mkdir(parents=True, exist_ok=True)
            info.write_text(f"Model: \t\t NVIDIA Test {minor}\nGPU UUID: \t {uuid}\nDevice Minor: \t {minor}\n")
    (root / "nvidia" / "lib64").mkdir(parents=True, exist_ok=True)
    (root / "nvidia" / "bin").mkdir(parents=True, exist_ok=True)
    smi = root / "nvidia" / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\nfor n in /dev/nvidia[0-9]*; do echo \"GPU ${n#/dev/nvidia}: fake\"; done\n")
    smi.chmod(0o755)
    (root / "cdi").mkdir(exist_ok=True)
    return {"gpu_dev_dir": str(dev), "gpu_cdi_dirs": (str(root / "cdi"),), "gpu_proc_dir": str(root / "proc"),
            "gpu_driver_dirs": (str(root / "nvidia"),)}


@pytest.fixture
def gpu_host(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpuhost")
    if "nodev" in subprocess.run(["findmnt", "-no", "OPTIONS", "-T", str(root)], capture_output=True, text=True).stdout:
        pytest.skip(f"{root} is on a nodev mount: device nodes there cannot be opened")
    return root


@pytest.fixture
def gpu_config(config: EngineConfig, gpu_host: Path) -> EngineConfig:
    return dataclasses.replace(config, gpu_shares=2, **make_host(gpu_host))  # type: ignore[arg-type]


def held(config: EngineConfig) -> int:
    """Rows holding GPUs in the state dir's database."""
    import sqlite3

    with sqlite3.connect(config.state_dir / "fanfold.db") as conn:
        return conn.execute("SELECT COUNT(*) FROM sandboxes WHERE gpu_ids != '[]'").fetchone()[0]


async def sh(sandbox, script: str) -> str:
    result = await sandbox.exec(["sh", "-c", script])
    assert result.exit_code == 0, result.stderr
    return result.stdout.decode()


# -- the request ------------------------------------------------------------------------------------

@pytest.mark.parametrize("given, written", [
    (None, None), ("", None), (0, "none"), ("none", "none"), (2, "2"), ("2", "2"), ("all", "all"),
    ("device=0,1", "device=0,1"),
    ([0, UUIDS[0]], f"device=0,{UUIDS[0]}"), (UUIDS[1], f"device={UUIDS[1]}"), ('"device=1"', "device=1"),
])
def test_a_gpu_request_has_one_written_form(given, written):
    assert Limits(gpus=given).gpus == written


@pytest.mark.parametrize("given, said", [
    ("many", "is not a GPU request"), ("device=zero", "'zero' is not a GPU index or UUID"),
    ("device=0,0", "each GPU may be named once"), (True, "must be all, a count"), (5000, "at most 1024"),
])
def test_a_bad_gpu_request_says_what_to_write(given, said):
    with pytest.raises(InvalidRequest, match=said):
        Limits(gpus=given)


# -- where devices come from -----------------------------------------------------------------------

def test_discovery_finds_each_gpu_its_uuid_the_shared_nodes_and_the_driver(gpu_host):
    fields = make_host(gpu_host)
    host = hostgpus.discover(cdi_dirs=fields["gpu_cdi_dirs"], cdi_kind="nvidia.com/gpu", dev_dir=fields["gpu_dev_dir"],
                             proc_dir=fields["gpu_proc_dir"], driver_dirs=fields["gpu_driver_dirs"])
    assert [(g.id, g.index, g.model) for g in host.gpus] == [(UUIDS[0], 0, "NVIDIA Test 0"), (UUIDS[1], 1, "NVIDIA Test 1")]
    assert host.find("1") is host.find(UUIDS[1]) is host.gpus[1]
    assert {n.path for n in host.common.nodes} == {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-caps/nvidia-cap1"}
    edits = host.edits([UUIDS[1]])
    assert [(n.path, n.major, n.minor) for n in edits.nodes if "nvidia1" in n.path] == [("/dev/nvidia1", *FUSE)]
    assert not any(n.path == "/dev/nvidia0" for n in edits.nodes)
    driver = str(gpu_host / "nvidia")
    assert [m.host_path for m in edits.mounts] == [driver] and "ro" in edits.mounts[0].options
    assert edits.env_dict() == {"LD_LIBRARY_PATH": f"{driver}/lib64", "PATH": f"{driver}/bin"}
    assert hostgpus.merged_env(edits, {"PATH": "/opt/x"}, "/bin")["PATH"] == f"{driver}/bin:/opt/x"


def test_a_host_without_nvidia_nodes_has_no_gpus_and_says_where_it_looked(tmp_path):
    host = hostgpus.discover(cdi_dirs=(str(tmp_path / "cdi"),), cdi_kind="nvidia.com/gpu", dev_dir=str(tmp_path),
                             proc_dir=str(tmp_path), driver_dirs=())
    assert host.gpus == () and f"no {tmp_path}/nvidia<N> device node" in host.source


CDI_SPEC = """\
cdiVersion: 0.6.0
kind: nvidia.com/gpu
devices:
  - name: "0"
    containerEdits:
      deviceNodes:
        - path: /dev/nvidia0
          hostPath: {dev}/nvidia0
  - name: {uuid}
    containerEdits:
      deviceNodes:
        - path: /dev/nvidia0
          hostPath: {dev}/nvidia0
  - name: all
    containerEdits:
      deviceNodes:
        - path: /dev/nvidia0
          hostPath: {dev}/nvidia0
containerEdits:
  env:
    - NVIDIA_VISIBLE_DEVICES=void
    - CDI_SAYS=hello
  deviceNodes:
    - path: /dev/nvidiactl
      hostPath: {dev}/nvidiactl
  mounts:
    - hostPath: {lib}
      containerPath: /usr/lib/cdi-driver
      options: [ro, nosuid, nodev, bind]
  hooks:
    - hookName: createRuntime
      path: {hook}
      args: [hook, {marker}]
"""


def write_cdi(root: Path) -> Path:
    """A CDI spec as ``nvidia-ctk cdi generate`` writes one (GPU 0 by index, by UUID, and ``all``), with a hook
    that writes the container state it is given to a marker file."""
    lib = root / "cdi-lib"
    lib.mkdir(exist_ok=True)
    (lib / "libcuda.so.1").write_text("not a library\n")
    hook = root / "hook.sh"
    hook.write_text("#!/bin/sh\ncat > \"$1\"\n")
    hook.chmod(0o755)
    spec = root / "cdi" / "nvidia.yaml"
    spec.write_text(CDI_SPEC.format(dev=root / "dev", uuid=UUIDS[0], lib=lib, hook=hook, marker=root / "hook-ran"))
    return spec


def test_a_cdi_spec_names_the_gpus_by_index_and_uuid_as_one(gpu_host):
    fields = make_host(gpu_host, proc=False)
    spec = write_cdi(gpu_host)
    host = hostgpus.discover(cdi_dirs=fields["gpu_cdi_dirs"], cdi_kind="nvidia.com/gpu", dev_dir=fields["gpu_dev_dir"],
                             proc_dir=fields["gpu_proc_dir"], driver_dirs=fields["gpu_driver_dirs"])
    assert host.source == f"cdi {spec}"
    assert [(g.id, g.index, g.names) for g in host.gpus] == [(UUIDS[0], 0, ("0", UUIDS[0]))]  # "all" is no GPU
    assert host.common.env_dict()["CDI_SAYS"] == "hello" and host.common.hooks[0].hook_name == "createRuntime"


def test_a_broken_cdi_spec_is_named_with_what_to_do(tmp_path):
    (tmp_path / "bad.json").write_text('{"cdiVersion": "0.6.0", "devices": []}')
    with pytest.raises(HostNotReady, match=r"bad.json cannot be used: it has no kind .*nvidia-ctk cdi generate"):
        load_specs((str(tmp_path),))


# -- sandboxes with GPUs (crun) ---------------------------------------------------------------------

async def test_a_gpu_sandbox_sees_its_gpu_the_driver_and_nothing_else(gpu_config):
    async with AsyncFleet(config=gpu_config) as fleet:
        first = await fleet.create(gpus=1)
        second = await fleet.create(gpus=f"device={UUIDS[1]}")
        plain = await fleet.create()
        assert first.info.gpu_ids == [UUIDS[0]] and second.info.gpu_ids == [UUIDS[1]]
        assert (await fleet.get(second.id)).info.gpu_ids == [UUIDS[1]]
        assert await sh(first, "nvidia-smi") == "GPU 0: fake\n"
        listed = await sh(second, "ls /dev | grep nvidia; ls /dev/nvidia-caps; test -c /dev/nvidia1"
                                  " && exec 3<>/dev/nvidia1 && echo opened")
        assert listed.split() == ["nvidia-caps", "nvidia-uvm", "nvidia1", "nvidiactl", "nvidia-cap1",
                                  "opened"]  # its device rule lets it open its node
        assert await sh(plain, "ls /dev | grep -c nvidia || true") == "0\n"
        driver = gpu_config.gpu_driver_dirs[0]
        said = await sh(first, f"echo $LD_LIBRARY_PATH; touch {driver}/x 2>&1 || true; echo x > /dev/nvidia0 && echo ok")
        assert said.splitlines() == [f"{driver}/lib64", f"touch: cannot touch '{driver}/x': Read-only file system", "ok"]
        # A sandbox with a GPU's node but no rule for it cannot open it: the rule is what lets it.
        assert "c 10:229 rwm" in devices_rules(second.id) and "c 10:229" not in devices_rules(first.id)
        for sandbox in (first, second, plain):
            await sandbox.kill()
    assert held(gpu_config) == 0


def devices_rules(sandbox_id: str) -> str:
    """The sandbox's device cgroup's rules (cgroup v1), read where its PID 1's cgroup file says."""
    for path in Path("/sys/fs/cgroup/devices").glob(f"fanfold-*/{sandbox_id}/devices.list"):
        return path.read_text()
    pytest.skip("no cgroup v1 devices controller here")


async def test_a_cdi_spec_gives_its_nodes_mounts_env_and_runs_its_hooks(gpu_config, gpu_host):
    write_cdi(gpu_host)
    async with AsyncFleet(config=gpu_config) as fleet:
        sandbox = await fleet.create(gpus="all")
        assert sandbox.info.gpu_ids == [UUIDS[0]]
        said = await sh(sandbox, "echo $CDI_SAYS $NVIDIA_VISIBLE_DEVICES; cat /usr/lib/cdi-driver/libcuda.so.1;"
                                 " ls /dev | grep nvidia")
        assert said.split("\n") == ["hello void", "not a library", "nvidia0", "nvidiactl", ""]
        state = json.loads((gpu_host / "hook-ran").read_text())  # the hook got the container's state
        assert state["id"] == sandbox.id
        await sandbox.kill()


async def test_shares_spread_over_the_gpus_wait_when_taken_and_come_back(gpu_config):
    async with AsyncFleet(config=gpu_config) as fleet:
        made = [await fleet.create(gpus=1) for _ in range(4)]  # two shares a GPU
        assert sorted(s.info.gpu_ids[0] for s in made) == sorted(UUIDS * 2)
        with pytest.raises(CapacityExceeded, match=r"no GPUs free for gpus=1 .*2/2 shares"):
            await fleet.create(gpus=1, queue_timeout=0.3)
        waiting = asyncio.create_task(fleet.create(gpus=1, queue_timeout=60))
        await made[0].kill()  # a share frees: the waiting create takes it
        late = await asyncio.wait_for(waiting, 60)
        assert late.info.gpu_ids == made[0].info.gpu_ids
        assert (await fleet.create()).id  # creates without GPUs never wait for them
        for sandbox in [*made[1:], late]:
            await sandbox.kill()
        alone = await fleet.create(gpus=2, gpu_exclusive=True)
        assert sorted(alone.info.gpu_ids) == sorted(UUIDS)
        with pytest.raises(CapacityExceeded, match="no GPUs free"):
            await fleet.create(gpus=1, queue_timeout=0.2)
        await alone.kill()
    assert held(gpu_config) == 0


async def test_requests_the_host_can_never_meet_are_refused_at_once(gpu_config, config):
    async with AsyncFleet(config=gpu_config) as fleet:
        with pytest.raises(InvalidRequest, match=r"gpus=3 is more than this host's 2 GPUs"):
            await fleet.create(gpus=3)
        with pytest.raises(InvalidRequest, match=rf"no GPU 'GPU-0'; its GPUs: {UUIDS[0]}, {UUIDS[1]}"):
            await fleet.create(gpus="device=GPU-0")
    bare = dataclasses.replace(config, gpu_dev_dir="/nonexistent", gpu_cdi_dirs=("/nonexistent",))
    async with AsyncFleet(config=bare) as fleet:
        with pytest.raises(InvalidRequest, match=r"this host has no GPU \(no CDI spec of kind nvidia.com/gpu in"
                                                 r" /nonexistent, and no /nonexistent/nvidia<N> device node\)"):
            await fleet.create(gpus="all")
        with pytest.raises(InvalidRequest, match="this host has no GPU"):
            await fleet.pool("host", 1, gpus=1)
    assert held(config) == 0


async def test_checkpoints_that_keep_memory_are_refused_before_anything_freezes(gpu_config):
    async with AsyncFleet(config=gpu_config) as fleet:
        sandbox = await fleet.create(gpus=1, persistence="sticky")
        await sh(sandbox, "sleep 1000 & echo $! > /tmp/pid")
        for call, what in ((lambda: sandbox.fork(2), "fork"), (lambda: sandbox.suspend(), "suspend"),
                           (lambda: sandbox.snapshot(memory=True), "a memory snapshot")):
            with pytest.raises(InvalidRequest, match=f"{what} of sandbox {sandbox.id} is refused: it holds a GPU"):
                await call()
            assert (await fleet.get(sandbox.id)).info.state == "running"
        assert await sh(sandbox, "kill -0 $(cat /tmp/pid) && echo alive") == "alive\n"  # never frozen or dumped
        disk = await sandbox.snapshot()  # its disk alone is fine
        child = await fleet.create(disk.id, gpus=1)
        assert child.info.gpu_ids == [UUIDS[1]]  # the GPU with the most shares free
        assert await sh(child, "test -f /tmp/pid && ls /dev/nvidia1") == "/dev/nvidia1\n"
        await child.kill()
        plain = await fleet.create()
        memory = await plain.snapshot(memory=True)
        with pytest.raises(InvalidRequest, match="holds processes' memory, which cannot be given a GPU"):
            await fleet.create(memory.id, gpus=1)
        reset = await sandbox.reset()  # back to its image, GPU and all
        assert reset.gpu_ids == sandbox.info.gpu_ids and await sh(sandbox, "ls /dev/nvidia0") == "/dev/nvidia0\n"
        for made in (sandbox, plain):
            await made.kill()
        for snap in (disk, memory):
            await fleet.delete_snapshot(snap.id)
    assert held(gpu_config) == 0


async def test_an_idle_gpu_sandbox_is_kept_running_not_suspended(gpu_config):
    async with AsyncFleet(config=gpu_config) as fleet:
        engine = fleet._transport  # type: ignore[attr-defined]
        sandbox = await fleet.create(gpus=1, persistence="persistent", idle_timeout=0.01)
        await asyncio.sleep(0.05)  # past its idle timeout; the policy pass below is what acts on it
        await engine.policies.apply()
        assert (await fleet.get(sandbox.id)).info.state == "running"
        await sandbox.kill()


async def test_a_tenants_gpu_quota_counts_shares_and_whole_gpus(gpu_config):
    quota = dataclasses.replace(gpu_config, quotas=(("dora", Quota(gpus=1)),))
    async with AsyncFleet(config=quota) as fleet:
        engine = fleet._transport  # type: ignore[attr-defined]
        shared = CreateParams(limits=Limits(gpus=1))
        made = [await engine.create(shared, tenant="dora") for _ in range(2)]  # two halves: one GPU's worth
        with pytest.raises(QuotaExceeded, match=r"tenant dora has 1 of 1 GPUs .*this create needs 0.5 more"):
            await engine.create(shared, tenant="dora")
        await engine.kill(made[0].id)
        with pytest.raises(QuotaExceeded, match=r"0.5 of 1 GPUs .*needs 1 more"):
            await engine.create(CreateParams(limits=Limits(gpus=1, gpu_exclusive=True)), tenant="dora")
        await engine.kill(made[1].id)
        alone = await engine.create(CreateParams(limits=Limits(gpus=1, gpu_exclusive=True)), tenant="dora")
        await engine.kill(alone.id)
    assert held(gpu_config) == 0


async def test_a_pool_keeps_gpu_sandboxes_warm_and_hands_them_out(gpu_config):
    async with AsyncFleet(config=gpu_config) as fleet:
        await fleet.pool("host", 2, gpus=1, wait=60)
        assert held(gpu_config) == 2  # warm ones hold their shares
        sandbox = await fleet.create(gpus=1)
        assert sandbox.info.gpu_ids and await sh(sandbox, "ls /dev/nvidia[0-9]") in ("/dev/nvidia0\n", "/dev/nvidia1\n")
        await fleet.pool("host", 0, gpus=1)
        await sandbox.kill()
    assert held(gpu_config) == 0
    assert leaks(gpu_config) == {"mounts": 0, "cgroups": 0, "containers": 0}


# -- on a machine with a GPU ------------------------------------------------------------------------

real_gpu = pytest.mark.skipif(not os.path.exists("/dev/nvidia0"), reason="no GPU on this machine (/dev/nvidia0)")


@real_gpu
async def test_nvidia_smi_lists_the_gpu_inside(config):
    async with AsyncFleet(config=config) as fleet:
        sandbox = await fleet.create(gpus="all")
        result = await sandbox.exec(["nvidia-smi", "-L"])
        assert result.exit_code == 0 and result.stdout.startswith(b"GPU 0:"), result.stderr
        await sandbox.kill()


@real_gpu
async def test_sixteen_sandboxes_share_one_gpu_running_cuda(config):
    torch = shutil.which("python3") and subprocess.run(["python3", "-c", "import torch; assert torch.cuda.is_available()"],
                                                       capture_output=True).returncode == 0
    if not torch:
        pytest.skip("the host's python3 has no CUDA-enabled torch")
    script = "import torch; x = torch.ones(512, 512, device='cuda'); print(float((x @ x).sum()))"
    async with AsyncFleet(config=dataclasses.replace(config, gpu_shares=16)) as fleet:
        made = await asyncio.gather(*(fleet.create(gpus=1, memory_mb=4096) for _ in range(16)))
        results = await asyncio.gather(*(s.exec(["python3", "-c", script]) for s in made))
        assert [r.stdout.strip() for r in results] == [str(512.0 ** 3).encode()] * 16, [r.stderr for r in results]
        await asyncio.gather(*(s.kill() for s in made))


async def test_engine_workers_share_one_ledger_of_gpu_shares(gpu_config):
    """Worker processes each claim shares in the one database: together they never give out more."""
    async with AsyncFleet(config=dataclasses.replace(gpu_config, workers=2)) as fleet:
        tries = await asyncio.gather(*(fleet.create(gpus=1, queue_timeout=0.5) for _ in range(6)),
                                     return_exceptions=True)
        made = [t for t in tries if not isinstance(t, BaseException)]
        assert len(made) == 4 and all(isinstance(t, CapacityExceeded) for t in tries if t not in made), tries
        assert sorted(s.info.gpu_ids[0] for s in made) == sorted(UUIDS * 2)
        await asyncio.gather(*(s.kill() for s in made))
    assert held(gpu_config) == 0
