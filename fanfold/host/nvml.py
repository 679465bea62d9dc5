"""The host's GPUs as NVML sees them (``nvidia-ml-py``): each GPU's utilisation and memory, and each
process's GPU memory and SM utilisation by host pid, mapped to the sandbox whose cgroup holds it.

NVML is opened once, lazily, by the first sample. Where it cannot be (the package or the driver's
``libnvidia-ml`` missing, no driver loaded), a sample holds nothing and says why: GPU figures are an
observation, never a reason for the engine to fail. Samples are taken in a thread and kept for
``MAX_AGE_S``, so any number of readers costs one NVML round a second. ``use()`` puts another
sampler in NVML's place (a machine without GPUs tests the mapping with one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Protocol

from .. import _extras
from . import cgroups

MAX_AGE_S = 1.0
"""How long a sample serves before the next read takes a new one."""
NO_NVML = "no NVML"
"""How a sample's ``error`` starts where NVML cannot be opened at all (for good: it is not tried again)."""
UTIL_WINDOW_US = 5_000_000
"""How far back a process's SM utilisation is read: NVML keeps samples of a process only while it
runs kernels, so one idle for longer counts 0."""


@dataclass(frozen=True)
class GpuSample:
    """One GPU's figures; a figure NVML would not give is None."""

    id: str
    """Its UUID (``GPU-...``), or its index where NVML tells none."""
    index: int
    name: str
    util_percent: int | None
    """The share of the last sample period in which a kernel ran."""
    memory_used_bytes: int | None
    memory_total_bytes: int | None


@dataclass(frozen=True)
class ProcessSample:
    """A process using a GPU, by host pid."""

    pid: int
    gpu: str
    """The ``GpuSample.id`` it runs on."""
    memory_bytes: int | None
    """GPU memory it holds (None where the driver does not say, as under some virtualisation)."""
    sm_percent: int | None
    """Its share of the GPU's SMs over the last few seconds (None where the GPU cannot tell)."""


@dataclass(frozen=True)
class Sample:
    gpus: tuple[GpuSample, ...] = ()
    processes: tuple[ProcessSample, ...] = ()
    error: str | None = None
    """Why there are no figures (``no NVML: ...``), or None."""
    groups: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Each process's cgroups, read with the sample: a pid reused after its exit maps to no sandbox."""


@dataclass(frozen=True)
class SandboxGpu:
    """What one sandbox's processes use of the GPUs."""

    memory_bytes: int
    util_percent: int | None
    """SM utilisation summed over its processes, at most 100 on each GPU (None: no GPU of its says)."""
    gpus: tuple[str, ...]
    """The GPUs its processes run on."""


class Sampler(Protocol):
    """Reads the GPUs once; never raises (a failure is a ``Sample`` with ``error``)."""

    def sample(self) -> Sample: ...


class NvmlSampler:
    """The real sampler, through ``pynvml``."""

    def __init__(self) -> None:
        self._nvml: ModuleType | None = None
        self._error: str | None = None

    def _open(self) -> ModuleType | None:
        if self._nvml is None and self._error is None:
            try:
                (pynvml,) = _extras.require("gpu", "GPU metrics", "pynvml")
            except _extras.MissingExtra as err:
                self._error = f"{NO_NVML}: {err}"
                return None
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as err:  # no libnvidia-ml, no driver loaded
                self._error = f"{NO_NVML}: {err}"
            else:
                self._nvml = pynvml
        return self._nvml

    def sample(self) -> Sample:
        nvml = self._open()
        if nvml is None:
            return Sample(error=self._error)
        try:
            count = nvml.nvmlDeviceGetCount()
            gpus, processes = [], []
            for index in range(count):
                gpu, used = _device(nvml, index)
                gpus.append(gpu)
                processes += used
        except nvml.NVMLError as err:  # a GPU lost, the driver unloaded under us
            return Sample(error=f"NVML: {err}")
        return Sample(tuple(gpus), tuple(processes))


def _device(nvml: ModuleType, index: int) -> tuple[GpuSample, list[ProcessSample]]:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    get = _getter(nvml)
    uuid, name = get(nvml.nvmlDeviceGetUUID, handle), get(nvml.nvmlDeviceGetName, handle)
    rates, memory = get(nvml.nvmlDeviceGetUtilizationRates, handle), get(nvml.nvmlDeviceGetMemoryInfo, handle)
    gpu = GpuSample(
        id=_text(uuid) or str(index), index=index, name=_text(name) or "NVIDIA GPU",
        util_percent=rates.gpu if rates is not None else None,
        memory_used_bytes=memory.used if memory is not None else None,
        memory_total_bytes=memory.total if memory is not None else None,
    )
    held: dict[int, int | None] = {}
    for running in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
        for process in get(running, handle) or ():
            seen, now = held.get(process.pid), process.usedGpuMemory
            held[process.pid] = now if seen is None else max(seen, now or 0)
    sm = _sm_percents(nvml, handle)
    pids = list(held) + [pid for pid in (sm or {}) if pid not in held]
    return gpu, [ProcessSample(pid, gpu.id, held.get(pid), None if sm is None else sm.get(pid, 0)) for pid in pids]


def _sm_percents(nvml: ModuleType, handle: Any) -> dict[int, int] | None:
    """Each process's latest SM utilisation of the window; None where the GPU does not sample it."""
    since = time.time_ns() // 1000 - UTIL_WINDOW_US  # NVML stamps samples with the CPU clock, in µs
    try:
        samples = nvml.nvmlDeviceGetProcessUtilization(handle, since)
    except nvml.NVMLError_NotFound:  # no process ran a kernel in the window
        return {}
    except nvml.NVMLError:  # NotSupported (older GPUs, vGPU), or no permission
        return None
    latest: dict[int, tuple[int, int]] = {}
    for sample in samples:
        if sample.pid not in latest or sample.timeStamp >= latest[sample.pid][0]:
            latest[sample.pid] = (sample.timeStamp, sample.smUtil)
    return {pid: util for pid, (_, util) in latest.items()}


def _getter(nvml: ModuleType) -> Callable[..., Any]:
    """A call whose failure means one figure missing (NotSupported on this GPU), not the sample."""
    def get(call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_NoPermission, nvml.NVMLError_FunctionNotFound):
            return None
    return get


def _text(value: str | bytes | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")  # older pynvml gives bytes


class Reader:
    """A sampler's samples, one at a time in a thread, each kept for ``max_age_s``."""

    def __init__(self, sampler: Sampler, max_age_s: float = MAX_AGE_S) -> None:
        self.sampler, self.max_age_s = sampler, max_age_s
        self._lock = threading.Lock()  # not asyncio's: engines of several loops may share a reader
        self._last = Sample()
        self._at = float("-inf")

    async def read(self) -> Sample:
        """A sample no older than ``max_age_s``, taken off the event loop where it must be taken."""
        if time.monotonic() - self._at < self.max_age_s or (self._last.error or "").startswith(NO_NVML):
            return self._last  # NVML missing stays missing: no thread each second to hear it again
        return await asyncio.to_thread(self._refresh)

    def latest(self) -> Sample:
        """The last sample taken (empty before the first), without sampling."""
        return self._last

    def _refresh(self) -> Sample:
        with self._lock:  # callers that came together wait for one sample
            if time.monotonic() - self._at >= self.max_age_s:
                taken = self.sampler.sample()
                groups = {p.pid: cgroups.paths_of(p.pid) for p in taken.processes}
                self._last, self._at = dataclasses.replace(taken, groups=groups), time.monotonic()
            return self._last


_reader = Reader(NvmlSampler())


async def read() -> Sample:
    """The host's GPUs now (within ``MAX_AGE_S``)."""
    return await _reader.read()


def latest() -> Sample:
    """The host's GPUs as last read, without reading them."""
    return _reader.latest()


def use(sampler: Sampler) -> Sampler:
    """Sample with ``sampler`` from now on (the cached sample dropped); returns the one it replaces."""
    global _reader
    previous, _reader = _reader.sampler, Reader(sampler)
    return previous


def by_sandbox(sample: Sample, parent: str) -> dict[str, SandboxGpu]:
    """Each sandbox's share of ``sample``: its processes are those in a group under ``/PARENT/ID``."""
    memory: dict[str, int] = {}
    util: dict[str, dict[str, int | None]] = {}  # sandbox -> GPU -> SM % (None: the GPU does not say)
    for process in sample.processes:
        sandbox = cgroups.sandbox_in(sample.groups.get(process.pid, ()), parent)
        if sandbox is None:
            continue
        memory[sandbox] = memory.get(sandbox, 0) + (process.memory_bytes or 0)
        on = util.setdefault(sandbox, {})
        if process.sm_percent is None:
            on.setdefault(process.gpu, None)
        else:
            on[process.gpu] = (on.get(process.gpu) or 0) + process.sm_percent
    out = {}
    for sandbox, used in memory.items():
        known = [min(100, share) for share in util[sandbox].values() if share is not None]
        out[sandbox] = SandboxGpu(used, sum(known) if known else None, tuple(util[sandbox]))
    return out
