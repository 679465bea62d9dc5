"""GPU utilisation and memory per sandbox in stats, /metrics and ``fanfold top``.

This machine has no GPU: NVML's place is taken by a stand-in sampler that reports GPU use for the
real pids of real processes in real sandboxes (crun), found through their cgroups, as NVML reports
host pids; the mapping from those pids to sandboxes, the tenant filtering and the HTTP server are
the real ones. The real ``pynvml`` is checked to say "no NVML" here without raising, and to see the
GPU where ``/dev/nvidia0`` exists.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
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
from fanfold.engine import Engine
from fanfold.host import cgroups, nvml
from fanfold.host.nvml import GpuSample, ProcessSample, Sample
from fanfold.models import CreateParams
from fanfold.server import create_app
from fanfold.web.auth import Tenants

GPU = "GPU-5d1a2c3e-0000-4000-8000-00000000f00d"
GiB = 2**30
TOKENS = {"alice": "alice-gpu-token-0123456789", "bob": "bob-gpu-token-0123456789ab", "": "host-gpu-token-0123456789"}
HAS_GPU = Path("/dev/nvidia0").exists()


class StandIn:
    """Reports one GPU and, for each pid it is given, that process's GPU memory and SM share."""

    def __init__(self) -> None:
        self.uses: dict[int, tuple[int, int]] = {}  # pid -> (memory bytes, SM %)
        self.samples = 0

    def sample(self) -> Sample:
        self.samples += 1
        gpu = GpuSample(GPU, 0, "Stand-in H100", 88, 7 * GiB, 80 * GiB)
        return Sample((gpu,), tuple(ProcessSample(pid, GPU, memory, sm) for pid, (memory, sm) in self.uses.items()))


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


# -- the mapping, in an embedded engine ------------------------------------------------------------


async def test_a_sandboxs_processes_add_up_and_a_gpu_counts_its_holders(config, stand_in):
    engine = Engine(config)
    await engine.start()
    try:
        busy, held = await engine.create(CreateParams()), await engine.create(CreateParams())
        await engine.exec(busy.id, "sleep 600 >/dev/null 2>&1 &")
        pids = sandbox_pids(config, busy.id)
        stand_in.uses = {pids["sleep"]: (GiB, 70), pids["agent"]: (GiB // 2, 60), os.getpid(): (4 * GiB, 50)}
        # ``held`` holds the GPU (as admission records it) but runs nothing on it
        engine.life.db.update(held.id, gpu_ids=json.dumps([GPU]))
        try:
            stats = await engine.stats()
            rows = {row["id"]: row for row in stats["sandboxes"]}
            assert {k: rows[busy.id][k] for k in ("gpu_ids", "gpu_memory_bytes", "gpu_util_percent")} == \
                {"gpu_ids": [], "gpu_memory_bytes": 3 * GiB // 2, "gpu_util_percent": 100}  # 70 + 60, one GPU: 100
            assert {k: rows[held.id][k] for k in ("gpu_ids", "gpu_memory_bytes", "gpu_util_percent")} == \
                {"gpu_ids": [GPU], "gpu_memory_bytes": 0, "gpu_util_percent": 0}
            assert stats["host"]["nvml"] == "ok"
            assert stats["gpus"] == [{"id": GPU, "index": 0, "name": "Stand-in H100", "util_percent": 88,
                                      "memory_used_bytes": 7 * GiB, "memory_total_bytes": 80 * GiB, "sandboxes": 1}]
            seen = samples((await engine.metrics_text()).decode())
            assert seen[("fanfold_sandbox_gpu_memory_bytes", (("sandbox", busy.id),))] == 3 * GiB // 2
            assert seen[("fanfold_sandbox_gpu_util_percent", (("sandbox", busy.id),))] == 100
            assert seen[("fanfold_sandbox_gpu_memory_bytes", (("sandbox", held.id),))] == 0
            assert seen[("fanfold_gpu_sandboxes", (("gpu", GPU),))] == 1
            assert seen[("fanfold_gpu_memory_used_bytes", (("gpu", GPU),))] == 7 * GiB
            out = frame(stats)
            for figure in ("GPUs", "Stand-in H100", "88%", "7.0 GB / 80.0 GB", "GPU %", "GPU MB", "100%", "1,536.0"):
                assert figure in out, (figure, out)
        finally:
            engine.life.db.update(held.id, gpu_ids="[]")
        await engine.kill(busy.id)
        await engine.kill(held.id)
    finally:
        await engine.close()


async def test_without_nvml_a_gpu_sandbox_shows_unknown_figures(config):
    """The real sampler here: a sandbox holding a GPU shows it, with its use unknown (None, "-")."""
    engine = Engine(config)
    await engine.start()
    try:
        info = await engine.create(CreateParams())
        plain = await engine.create(CreateParams())
        engine.life.db.update(info.id, gpu_ids=json.dumps(["0"]))
        try:
            stats = await engine.stats()
            rows = {row["id"]: row for row in stats["sandboxes"]}
            if not HAS_GPU:
                assert stats["host"]["nvml"].startswith("no NVML: ")
                assert stats["gpus"] == [{"id": "0", "index": 0, "name": None, "util_percent": None,
                                          "memory_used_bytes": None, "memory_total_bytes": None, "sandboxes": 1}]
                assert rows[info.id]["gpu_memory_bytes"] is None and rows[info.id]["gpu_util_percent"] is None
                text = (await engine.metrics_text()).decode()
                assert 'fanfold_gpu_sandboxes{gpu="0"} 1.0' in text and "fanfold_sandbox_gpu" not in text
                assert "GPUs (no NVML: " in frame(stats)
            assert rows[info.id]["gpu_ids"] == ["0"]
            assert "gpu_ids" not in rows[plain.id]  # no GPU, none used: no GPU fields
        finally:
            engine.life.db.update(info.id, gpu_ids="[]")
        for sandbox in (info, plain):
            await engine.kill(sandbox.id)
    finally:
        await engine.close()


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
        await mine.exec("sleep 600 >/dev/null 2>&1 &")
        await theirs.exec("sleep 600 >/dev/null 2>&1 &")
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
