"""GPU utilisation and memory per sandbox in stats, /metrics and ``fanfold top``.

This machine has no GPU: NVML's place is taken by a stand-in sampler that reports GPU use for the
real pids of real processes in real sandboxes (crun), found through their cgroups, as NVML reports
host pids; the mapping from those pids to sandboxes, the tenant filtering and the HTTP server are
the real ones. The real ``pynvml`` is checked to say "no NVML" here without raising, and to see the
GPU where ``/dev/nvidia0`` exists.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from fanfold import AsyncFleet, EngineConfig
from fanfold.cli.top import render
from fanfold.host import cgroups, nvml
from fanfold.host.nvml import GpuSample, ProcessSample, Sample
from fanfold.server import create_app
from fanfold.web.auth import Tenants

from test_gpu import UUIDS, make_host

GPU = "GPU-5d1a2c3e-0000-4000-8000-00000000f00d"
GiB = 2**30
TOKENS = {"alice": "alice-gpu-token-0123456789", "bob": "bob-gpu-token-0123456789ab", "": "host-gpu-token-0123456789"}
HAS_GPU = Path("/dev/nvidia0").exists()
# a background sleep, returned once it is named sleep (a forked sh before its exec is not found by name)
SLEEPER = "sleep 600 >/dev/null 2>&1 & while [ \"$(cat /proc/$!/comm)\" != sleep ]; do :; done"


class StandIn:
    """Reports GPUs and, for each pid it is given, that process's GPU memory and SM share on the first."""

    def __init__(self) -> None:
        self.gpus = (GpuSample(GPU, 0, "Stand-in H100", 88, 7 * GiB, 80 * GiB),)
        self.uses: dict[int, tuple[int, int]] = {}  # pid -> (memory bytes, SM %)
        self.samples = 0

    def sample(self) -> Sample:
        self.samples += 1
        gpu = self.gpus[0].id
        return Sample(self.gpus, tuple(ProcessSample(pid, gpu, memory, sm) for pid, (memory, sm) in self.uses.items()))


@pytest.fixture
def stand_in():
    sampler = StandIn()
    previous = nvml.use(sampler)
    yield sampler
    nvml.use(previous)


def sandbox_pids(config: EngineConfig, sandbox_id: str) -> dict[str, int]:
    """The sandbox's processes by command name, as its cgroup lists them."""
    group = next(d for d in cgroups.sandbox_dirs(config.cgroup_parent, sandbox_id) if d.parent.parent.name == "pids")
    pids = [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
    return {Path(f"/proc/{pid}/comm").read_text().strip(): pid for pid in pids}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def frame(stats: dict) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(render(stats, source="test"))
    return console.file.getvalue()


# -- NVML itself ------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_GPU, reason="a GPU is here: NVML opens")
async def test_the_real_nvml_without_a_gpu_says_so_and_never_raises():
    sampler = nvml.NvmlSampler()
    first = sampler.sample()
    assert first.gpus == () and first.processes == ()
    assert first.error is not None and first.error.startswith("no NVML: "), first.error
    assert sampler.sample() == first  # opened once: the answer is kept
    reader = nvml.Reader(sampler)
    assert await reader.read() == first and reader.latest() == first


def test_without_nvidia_ml_py_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if not installed
    assert nvml.NvmlSampler().sample().error == ("no NVML: GPU metrics needs nvidia-ml-py, which is not installed: "
                                                 "pip install 'fanfold[gpu]'")


@pytest.mark.skipif(not HAS_GPU, reason="no /dev/nvidia0 here")
def test_the_real_nvml_reports_the_gpu():
    sample = nvml.NvmlSampler().sample()
    assert sample.error is None and sample.gpus, sample
    for gpu in sample.gpus:
        assert gpu.id and gpu.memory_total_bytes and gpu.memory_total_bytes > 0
        assert 0 <= (gpu.memory_used_bytes or 0) <= gpu.memory_total_bytes
        assert gpu.util_percent is None or 0 <= gpu.util_percent <= 100


async def test_one_sample_serves_every_reader_for_a_second():
    sampler = StandIn()
    reader = nvml.Reader(sampler, max_age_s=60)
    await asyncio.gather(*(reader.read() for _ in range(8)))
    assert sampler.samples == 1
    assert nvml.Reader(sampler, max_age_s=0).latest() == Sample()  # nothing sampled yet: empty


# -- the mapping, in an embedded fleet on a synthetic GPU host ----------------------------------------


@pytest.fixture
def gpu_config(config: EngineConfig, tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    """The synthetic GPU host of test_gpu.py (two GPUs, ``UUIDS``), each GPU shared by up to 2 sandboxes."""
    root = tmp_path_factory.mktemp("gpuhost")
    if "nodev" in subprocess.run(["findmnt", "-no", "OPTIONS", "-T", str(root)], capture_output=True, text=True).stdout:
        pytest.skip(f"{root} is on a nodev mount: device nodes there cannot be opened")
    return dataclasses.replace(config, gpu_shares=2, **make_host(root))  # type: ignore[arg-type]


async def test_a_sandboxs_processes_add_up_and_a_gpu_counts_its_holders(gpu_config, stand_in):
    stand_in.gpus = (GpuSample(UUIDS[0], 0, "Stand-in H100", 88, 7 * GiB, 80 * GiB),
                     GpuSample(UUIDS[1], 1, "Stand-in H100", 0, 0, 80 * GiB))
    async with AsyncFleet(config=gpu_config) as fleet:
        busy = await fleet.create(gpus=f"device={UUIDS[0]}")
        idle = await fleet.create(gpus=f"device={UUIDS[0]}")
        stray, plain = await fleet.create(), await fleet.create()  # no GPU held; NVML sees ``stray`` on one
        for sandbox in (busy, stray):
            await sandbox.exec(SLEEPER)
        pids = sandbox_pids(gpu_config, busy.id)
        stand_in.uses = {pids["sleep"]: (GiB, 70), pids["agent"]: (GiB // 2, 60), os.getpid(): (4 * GiB, 50),
                         sandbox_pids(gpu_config, stray.id)["sleep"]: (GiB // 4, 5)}
        stats = await fleet.metrics()
        rows = {row["id"]: {k: v for k, v in row.items() if k.startswith("gpu_")} for row in stats["sandboxes"]}
        assert rows[busy.id] == {"gpu_ids": [UUIDS[0]], "gpu_memory_bytes": 3 * GiB // 2,
                                 "gpu_util_percent": 100}  # 70 + 60 on one GPU: at most 100
        assert rows[idle.id] == {"gpu_ids": [UUIDS[0]], "gpu_memory_bytes": 0, "gpu_util_percent": 0}
        assert rows[stray.id] == {"gpu_ids": [], "gpu_memory_bytes": GiB // 4, "gpu_util_percent": 5}
        assert rows[plain.id] == {}  # no GPU, none used: no GPU fields
        assert stats["host"]["nvml"] == "ok"
        assert stats["gpus"] == [
            {"id": UUIDS[0], "index": 0, "name": "Stand-in H100", "util_percent": 88, "memory_used_bytes": 7 * GiB,
             "memory_total_bytes": 80 * GiB, "sandboxes": 2},
            {"id": UUIDS[1], "index": 1, "name": "Stand-in H100", "util_percent": 0, "memory_used_bytes": 0,
             "memory_total_bytes": 80 * GiB, "sandboxes": 0}]
        seen = samples((await fleet._transport.metrics_text()).decode())
        assert seen[("fanfold_sandbox_gpu_memory_bytes", (("sandbox", busy.id),))] == 3 * GiB // 2
        assert seen[("fanfold_sandbox_gpu_util_percent", (("sandbox", busy.id),))] == 100
        assert seen[("fanfold_sandbox_gpu_memory_bytes", (("sandbox", idle.id),))] == 0
        assert seen[("fanfold_sandbox_gpu_memory_bytes", (("sandbox", stray.id),))] == GiB // 4
        assert ("fanfold_sandbox_gpu_memory_bytes", (("sandbox", plain.id),)) not in seen
        assert seen[("fanfold_gpu_sandboxes", (("gpu", UUIDS[0]),))] == 2
        assert seen[("fanfold_gpu_memory_used_bytes", (("gpu", UUIDS[0]),))] == 7 * GiB
        out = frame(stats)
        for figure in ("GPUs", "Stand-in H100", "88%", "7.0 GB / 80.0 GB", "GPU %", "GPU MB", "100%", "1,536.0"):
            assert figure in out, (figure, out)
        for sandbox in (busy, idle, stray, plain):
            await sandbox.kill()
        assert [gpu["sandboxes"] for gpu in (await fleet.metrics())["gpus"]] == [0, 0]  # released


@pytest.mark.skipif(HAS_GPU, reason="a GPU is here: NVML opens")
async def test_without_nvml_a_gpu_sandbox_shows_its_gpu_with_unknown_figures(gpu_config):
    """The real sampler: the GPU a sandbox holds is listed, its use unknown (None, "-")."""
    async with AsyncFleet(config=gpu_config) as fleet:
        sandbox = await fleet.create(gpus=1)
        stats = await fleet.metrics()
        (gpu,) = sandbox.info.gpu_ids
        assert stats["host"]["nvml"].startswith("no NVML: ")
        assert stats["gpus"] == [{"id": gpu, "index": None, "name": None, "util_percent": None,
                                  "memory_used_bytes": None, "memory_total_bytes": None, "sandboxes": 1}]
        row = next(row for row in stats["sandboxes"] if row["id"] == sandbox.id)
        assert (row["gpu_ids"], row["gpu_memory_bytes"], row["gpu_util_percent"]) == ([gpu], None, None)
        text = (await fleet._transport.metrics_text()).decode()
        assert f'fanfold_gpu_sandboxes{{gpu="{gpu}"}} 1.0' in text and "fanfold_sandbox_gpu" not in text
        assert "GPUs (no NVML: " in frame(stats)
        await sandbox.kill()


def test_top_shows_no_gpu_panel_or_columns_without_gpus():
    stats = {"sandboxes": [{"id": "sb-1", "state": "running", "cpu_s": 0.1}], "gpus": []}
    out = frame(stats)
    assert "GPU" not in out and "sb-1" in out


# -- over HTTP, per tenant --------------------------------------------------------------------------


@pytest.fixture
def gpu_server(config, stand_in):
    """A real ``fanfold serve`` app with uvicorn in a thread of this process, where the stand-in is."""
    tenants = Tenants()
    for tenant, token in TOKENS.items():
        tenants.add(token, tenant)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(config, tenants), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]})
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            threading.Event().wait(0.05)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=120)
        listener.close()
    assert not thread.is_alive()


async def test_each_tenant_sees_its_own_sandboxes_gpu_use_over_http(config, stand_in, gpu_server):
    async with AsyncFleet(gpu_server, token=TOKENS["alice"]) as alice, \
            AsyncFleet(gpu_server, token=TOKENS["bob"]) as bob:
        mine, theirs = await alice.create(), await bob.create()
        await mine.exec(SLEEPER)
        await theirs.exec(SLEEPER)
        stand_in.uses = {sandbox_pids(config, mine.id)["sleep"]: (GiB, 40),
                         sandbox_pids(config, theirs.id)["sleep"]: (2 * GiB, 25)}
        stats = await alice.metrics()
        listed = {row["id"]: row for row in stats["sandboxes"]}
        assert theirs.id not in listed
        assert (listed[mine.id]["gpu_memory_bytes"], listed[mine.id]["gpu_util_percent"]) == (GiB, 40)
        assert [gpu["id"] for gpu in stats["gpus"]] == [GPU]
        async with httpx.AsyncClient(base_url=gpu_server) as client:
            def get(tenant: str, path: str = "/metrics"):
                return client.get(path, headers={"Authorization": f"Bearer {TOKENS[tenant]}"})

            for tenant, own, other, memory in (("alice", mine.id, theirs.id, GiB), ("bob", theirs.id, mine.id, 2 * GiB)):
                reply = await get(tenant)
                assert reply.status_code == 200
                seen = samples(reply.text)
                assert seen[("fanfold_sandbox_gpu_memory_bytes", (("sandbox", own),))] == memory
                assert other not in reply.text  # another tenant's sandbox is not named
                assert seen[("fanfold_gpu_memory_total_bytes", (("gpu", GPU),))] == 80 * GiB  # the host's, for all
            host = samples((await get("", "/v1/metrics")).text)
            assert host[("fanfold_sandbox_gpu_util_percent", (("sandbox", mine.id),))] == 40
            assert host[("fanfold_sandbox_gpu_util_percent", (("sandbox", theirs.id),))] == 25
        out = frame(stats)
        assert "GPU %" in out and "40%" in out and "1,024.0" in out and theirs.id not in out
        await mine.kill()
        await theirs.kill()
