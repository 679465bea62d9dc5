"""GPUs under gVisor (``runsc --nvproxy``) against the real runsc: the bundle's devices, the refusals made
before anything exists, runsc's own failure on a host without an NVIDIA driver, and nothing left behind.

There is no GPU here: the devices are synthetic character nodes (``/dev/null``'s numbers under NVIDIA's
names) in a temporary dir, found by ``host.gpus.discover`` as it finds real ones. The tests at the end
run only where ``/dev/nvidia0`` exists.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from fanfold import AsyncFleet, EngineConfig, HostNotReady, InvalidRequest
from fanfold.engine import Engine
from fanfold.host import gpus
from fanfold.host.cdi import Edits, Hook
from fanfold.ids import new_id
from fanfold.models import Limits
from fanfold.runtime import SandboxSpec, nvproxy, oci_sandbox
from fanfold.runtime.runsc_backend import GPU_FILE, RunscBackend

from conftest import STATE_DIR
from test_gpu import held, make_host
from test_runsc import rfleet, runsc_leftovers, runsc_processes  # noqa: F401  (rfleet: a fixture, on this rconfig)

if shutil.which("runsc") is None:
    pytest.skip("gVisor's runsc is not installed (`make setup` installs it)", allow_module_level=True)

pytestmark = pytest.mark.asyncio(loop_scope="module")

NODES = ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
NULL = os.stat("/dev/null").st_rdev
PROBE = nvproxy.probe
ON_A_GPU = os.path.exists("/dev/nvidia0")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@pytest.fixture(scope="module")
def rconfig(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    """The suite's state dir under runsc, on a synthetic GPU host of one share a GPU (``test_gpu.make_host``)."""
    root = tmp_path_factory.mktemp("gpuhost")
    fields = make_host(root)
    return EngineConfig(state_dir=STATE_DIR, runtime="runsc", gpu_shares=1, **fields)  # type: ignore[arg-type]


@pytest.fixture
def engine(rfleet: AsyncFleet) -> Engine:
    found = rfleet._transport
    assert isinstance(found, Engine) and isinstance(found.backend, RunscBackend)
    return found


@pytest.fixture
def fake_host(tmp_path: Path) -> gpus.GpuHost:
    """A GPU host made of synthetic nodes (1:3 under NVIDIA's names) and a driver dir, on a mount that
    allows device nodes."""
    dev, driver = tmp_path / "dev", tmp_path / "nvidia"
    dev.mkdir()
    (driver / "lib64").mkdir(parents=True)
    (driver / "bin").mkdir()
    if os.statvfs(tmp_path).f_flag & os.ST_NODEV:
        pytest.skip(f"{tmp_path} is on a nodev mount")
    for name in NODES:
        os.mknod(dev / name, 0o666 | 0o020000, NULL)
    found = gpus.discover(cdi_dirs=(), cdi_kind="nvidia.com/gpu", dev_dir=str(dev), proc_dir=str(tmp_path / "proc"),
                          driver_dirs=(str(driver),))
    assert [gpu.index for gpu in found.gpus] == [0]
    return found


@pytest.fixture
def no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host's NVIDIA driver, as the refusals see it: none loaded (as here)."""
    monkeypatch.setattr(nvproxy, "DRIVER_VERSION_FILES", ())


async def gpu_spec(engine: Engine, edits: Edits) -> SandboxSpec:
    """A sandbox of the ``host`` base with ``edits``' devices, its environment as the engine makes it."""
    img = await engine.sources.image("host")
    env = {"PATH": DEFAULT_PATH, **dict(img.env), **gpus.merged_env(edits, dict(img.env), DEFAULT_PATH)}
    return SandboxSpec(id=new_id("sb-"), layers=img.layers, host_dirs=img.host_dirs, limits=Limits(),
                       env=tuple(f"{k}={v}" for k, v in env.items()), services=img.services, devices=edits)


def assert_nothing_left(engine: Engine, sandbox_id: str) -> None:
    assert runsc_leftovers(engine.config, sandbox_id) == {}
    assert runsc_processes(engine.config.run_dir / "runsc") == []


# -- what the bundle carries ---------------------------------------------------------------------


async def test_bundle_gives_nvproxy_the_nodes_it_serves_and_binds_the_driver(engine, fake_host):
    edits = fake_host.edits([gpu.id for gpu in fake_host.gpus])
    spec = await gpu_spec(engine, edits)
    config = engine.backend._config(spec, oci_sandbox.paths(engine.config, spec.id))
    devices = {d["path"]: (d["type"], d["major"], d["minor"]) for d in config["linux"]["devices"]}
    null = ("c", os.major(NULL), os.minor(NULL))
    # nvproxy serves these three; uvm-tools and modeset would be dead nodes in gVisor's /dev.
    assert devices == {"/dev/nvidia0": null, "/dev/nvidiactl": null, "/dev/nvidia-uvm": null}
    rules = [r for r in config["linux"]["resources"]["devices"] if r["allow"]]
    assert [(r["type"], r["major"], r["minor"]) for r in rules] == [null] * 3
    # No node is bound in (gVisor's gofer would refuse a device file); the driver dir is, read-only.
    binds = {m["destination"]: m for m in config["mounts"] if m["type"] == "bind"}
    assert not [path for path in binds if path.startswith("/dev/")]
    driver = str(Path(fake_host.common.mounts[0].host_path))
    assert binds[driver]["source"] == driver and "ro" in binds[driver]["options"]
    assert "hooks" not in config


async def test_a_hook_runsc_would_skip_is_refused_before_anything_is_made(engine, fake_host, no_driver, monkeypatch):
    monkeypatch.setattr(nvproxy, "_host_node_problem", lambda node: None)  # past the node check, to the hooks
    hook = Hook("createContainer", "/usr/bin/nvidia-cdi-hook", ("nvidia-cdi-hook", "update-ldcache"))
    edits = fake_host.edits([fake_host.gpus[0].id]) + Edits(hooks=(hook,))
    spec = await gpu_spec(engine, edits)
    with pytest.raises(HostNotReady, match=r"does not run the createContainer hook /usr/bin/nvidia-cdi-hook .*"
                                           r"runsc runs only createRuntime, poststart, poststop, prestart hooks"):
        await engine.backend.bring_up(spec)
    assert not oci_sandbox.paths(engine.config, spec.id).root.exists()
    assert_nothing_left(engine, spec.id)


# -- refusals before anything exists -------------------------------------------------------------


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this host has NVIDIA's nodes")
async def test_synthetic_nodes_are_refused_before_anything_is_made(engine, fake_host, no_driver):
    """nvproxy opens the host's /dev/nvidiactl itself, whatever node the sandbox was given."""
    spec = await gpu_spec(engine, fake_host.edits([fake_host.gpus[0].id]))
    with pytest.raises(HostNotReady) as refused:
        await engine.backend.bring_up(spec)
    message = str(refused.value)
    assert message.startswith(f"sandbox {spec.id} cannot have GPUs under gVisor: device node /dev/nvidiactl cannot be"
                              " read (No such file or directory) on this host; nvproxy opens the host's"
                              f" /dev/nvidiactl itself, whatever node the sandbox is given ({fake_host.common.nodes[0].host_path})"), message
    assert message.endswith("use the oci backend for GPU sandboxes (FANFOLD_RUNTIME=crun)")
    assert not oci_sandbox.paths(engine.config, spec.id).root.exists()
    assert spec.id not in await engine.backend.list_ids()
    assert_nothing_left(engine, spec.id)


async def test_a_driver_runsc_does_not_support_is_refused_before_anything_is_made(engine, fake_host, tmp_path,
                                                                                 monkeypatch):
    support = nvproxy.probe(shutil.which("runsc") or "runsc")
    if not support.nvproxy or support.drivers is None:
        pytest.skip(f"{support.version} tells no supported drivers")
    version = tmp_path / "version"  # as /proc/driver/nvidia/version reads on the H100 machine
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  999.1.2  Release Build"
                       "  (dvs-builder@U22)  Tue Sep 23 2025\nGCC version:  gcc version 12.3.0\n")
    monkeypatch.setattr(nvproxy, "DRIVER_VERSION_FILES", (str(version),))
    spec = await gpu_spec(engine, fake_host.edits([fake_host.gpus[0].id]))
    with pytest.raises(HostNotReady, match=rf"this host's NVIDIA driver 999\.1\.2 is not one that {support.version}'s"
                                           r" nvproxy supports \(.*\): install a gVisor release that supports it"):
        await engine.backend.bring_up(spec)
    assert not oci_sandbox.paths(engine.config, spec.id).root.exists()
    assert_nothing_left(engine, spec.id)


async def test_a_runsc_without_nvproxy_is_refused(engine, fake_host, tmp_path, monkeypatch):
    old = tmp_path / "runsc"  # a runsc of before nvproxy: knows no such flag, nor subcommand
    real = shutil.which("runsc")
    old.write_text(f"#!/bin/sh\n[ \"$1\" = flags ] && {{ {real} flags 2>&1 | grep -v nvproxy; exit 0; }}\n"
                   f"[ \"$1\" = --version ] && echo 'runsc version 0.0~20221219.0' && exit 0\nexit 1\n")
    old.chmod(0o755)
    backend = engine.backend
    monkeypatch.setattr(backend, "gpu_support", None)
    monkeypatch.setattr(backend, "argv", [str(old), *backend.argv[1:]])
    spec = await gpu_spec(engine, fake_host.edits([fake_host.gpus[0].id]))
    with pytest.raises(HostNotReady, match=r"runsc version 0\.0~20221219\.0 has no --nvproxy \(gVisor's GPU proxy\):"
                                           r" install a newer gVisor \(scripts/runsc.sh\), or use the oci backend"):
        await backend.bring_up(spec)
    assert not oci_sandbox.paths(engine.config, spec.id).root.exists()
    assert_nothing_left(engine, spec.id)


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this host has NVIDIA's nodes")
async def test_runsc_is_asked_what_it_can_do_once(engine, fake_host, no_driver, monkeypatch):
    asked = []
    monkeypatch.setattr(engine.backend, "gpu_support", None)
    monkeypatch.setattr(nvproxy, "probe", lambda binary: asked.append(binary) or PROBE(binary))
    for _ in range(2):
        with pytest.raises(HostNotReady, match="cannot have GPUs under gVisor"):
            await engine.backend.bring_up(await gpu_spec(engine, fake_host.edits([fake_host.gpus[0].id])))
    assert asked == [engine.backend.argv[0]]


# -- runsc --nvproxy itself, on a host without a driver -------------------------------------------


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this host has an NVIDIA driver")
async def test_runsc_nvproxy_without_a_driver_fails_typed_and_leaves_nothing(engine, fake_host, no_driver, monkeypatch):
    """Past fanfold's checks (the host's nodes), runsc itself starts with --nvproxy and fails: it asks
    the host's /dev/nvidiactl for the driver's version before anything of the sandbox runs."""
    monkeypatch.setattr(nvproxy, "_host_node_problem", lambda node: None)
    spec = await gpu_spec(engine, fake_host.edits([fake_host.gpus[0].id]))
    where = oci_sandbox.paths(engine.config, spec.id)
    try:
        with pytest.raises(HostNotReady) as failed:
            await engine.backend.bring_up(spec)
        assert (where.bundle / GPU_FILE).exists()
    finally:
        await engine.backend.release(spec.id)
    message = str(failed.value)
    assert message.startswith(f"gVisor's GPU proxy could not start sandbox {spec.id} (runsc run of sandbox {spec.id}"
                              " failed: "), message
    assert "failed to get Nvidia driver version: failed to open /dev/nvidiactl: no such file or directory" in message
    assert message.endswith("or use the oci backend for GPU sandboxes (FANFOLD_RUNTIME=crun)")
    assert spec.id not in await engine.backend.list_ids()
    assert_nothing_left(engine, spec.id)


async def test_a_sandbox_without_devices_starts_without_nvproxy(engine):
    img = await engine.sources.image("host")
    spec = SandboxSpec(id=new_id("sb-"), layers=img.layers, host_dirs=img.host_dirs, limits=Limits(),
                       env=("PATH=/usr/bin:/bin",), services=img.services)
    handle = await engine.backend.bring_up(spec)
    try:
        assert not (oci_sandbox.paths(engine.config, spec.id).bundle / GPU_FILE).exists()
        cmdline = Path(f"/proc/{handle.pid}/cmdline").read_bytes().split(b"\0")
        assert b"--nvproxy=true" not in cmdline and b"--nvproxy" not in cmdline
    finally:
        await engine.backend.release(spec.id, handle)
    assert_nothing_left(engine, spec.id)


# -- through the engine ------------------------------------------------------------------------------


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this host has NVIDIA's nodes")
async def test_a_gpu_create_under_runsc_is_refused_and_gives_its_share_back(rfleet, rconfig, no_driver):
    for _ in range(2):  # a share kept by the first refusal would make the second wait, not refuse
        with pytest.raises(HostNotReady, match=r"cannot have GPUs under gVisor: device node /dev/nvidiactl"):
            await rfleet.create(gpus="all")
    assert await rfleet.list() == [] and held(rconfig) == 0
    async with await rfleet.create() as plain:  # the backend still serves sandboxes without GPUs
        assert (await plain.exec("echo ok")).text == "ok\n"
    assert runsc_leftovers(rconfig) == {}


# -- on a GPU host ---------------------------------------------------------------------------------


def host_gpus() -> gpus.GpuHost:
    """This host's real GPUs, where the engine looks by default."""
    config = EngineConfig(state_dir=STATE_DIR)
    return gpus.discover(cdi_dirs=config.gpu_cdi_dirs, cdi_kind=config.gpu_cdi_kind, dev_dir=config.gpu_dev_dir,
                         proc_dir=config.gpu_proc_dir, driver_dirs=config.gpu_driver_dirs)


@pytest.mark.skipif(not ON_A_GPU, reason="no /dev/nvidia0: no GPU here")
async def test_nvidia_smi_lists_the_gpu_in_a_runsc_sandbox(engine):
    found = host_gpus()
    edits = found.edits([found.gpus[0].id])
    spec = await gpu_spec(engine, edits)
    support = nvproxy.probe(engine.backend.argv[0])
    why = nvproxy.refusal(support, nvproxy.host_driver_version(), edits)
    if why is not None:  # this runsc cannot: the refusal, before anything is made
        with pytest.raises(HostNotReady, match="cannot have GPUs under gVisor"):
            await engine.backend.bring_up(spec)
        assert_nothing_left(engine, spec.id)
        pytest.skip(f"runsc refuses this host's GPU, as it should: {why}")
    handle = await engine.backend.bring_up(spec)
    try:
        listed = await engine.backend.exec(handle, ["nvidia-smi", "-L"], env=list(spec.env), cwd="/",
                                           timeout_ms=60_000, max_output=1 << 16)
        assert listed.exit_code == 0, listed
        assert listed.stdout.decode().startswith("GPU 0: "), listed.stdout
        with pytest.raises(InvalidRequest, match="whose state gVisor's GPU proxy cannot save"):
            await engine.backend.checkpoint(handle, Path("/nonexistent"), (), memory=True, leave_running=True)
        assert engine.backend.alive(handle)
    finally:
        await engine.backend.release(spec.id, handle)
    assert_nothing_left(engine, spec.id)
