"""GPU figures for ``stats`` and the gauges: each GPU's use and how many sandboxes share it, and each
sandbox's GPU memory and SM utilisation (its processes' in NVML's sample, found by their cgroup)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any, Iterable

from prometheus_client.core import GaugeMetricFamily

from ..host.nvml import Sample, SandboxGpu

Row = sqlite3.Row


def held(row: Row) -> list[str]:
    """The GPUs a sandbox holds (``SandboxInfo.gpu_ids``)."""
    return json.loads(row["gpu_ids"] or "[]")


def panel(sample: Sample, rows: list[Row]) -> list[dict[str, Any]]:
    """Each GPU with NVML's figures and the sandboxes holding it (warm ones too); a GPU that sandboxes
    hold and NVML does not see (no NVML here) is listed with its figures None."""
    holders = [set(held(row)) for row in rows]
    out = []
    for gpu in sample.gpus:
        names = {gpu.id, str(gpu.index)}
        out.append({"id": gpu.id, "index": gpu.index, "name": gpu.name, "util_percent": gpu.util_percent,
                    "memory_used_bytes": gpu.memory_used_bytes, "memory_total_bytes": gpu.memory_total_bytes,
                    "sandboxes": sum(1 for ids in holders if ids & names)})
    seen = {name for gpu in sample.gpus for name in (gpu.id, str(gpu.index))}
    for gpu_id in sorted(set().union(*holders) - seen):
        out.append({"id": gpu_id, "index": int(gpu_id) if gpu_id.isdigit() else None, "name": None,
                    "util_percent": None, "memory_used_bytes": None, "memory_total_bytes": None,
                    "sandboxes": sum(1 for ids in holders if gpu_id in ids)})
    return out


def sandbox_fields(row: Row, usage: SandboxGpu | None, sample: Sample) -> dict[str, Any]:
    """A listed sandbox's GPU figures, for one that holds a GPU or runs on one; {} for the others.
    Without NVML the figures are None (unknown), with it 0 for a sandbox none of whose processes use a GPU."""
    ids = held(row)
    if not ids and usage is None:
        return {}
    nothing = 0 if sample.error is None else None
    return {"gpu_ids": ids, "gpu_memory_bytes": usage.memory_bytes if usage else nothing,
            "gpu_util_percent": usage.util_percent if usage else nothing}


def gauges(sample: Sample, usage: dict[str, SandboxGpu], rows: list[Row], tenant: str | None) -> Iterable[GaugeMetricFamily]:
    """Per sandbox (a server ``tenant``'s own only; never warm ones) and per GPU (the host's, for all);
    a family with no sample is left out, so a host without GPUs shows none of them."""
    memory = GaugeMetricFamily("fanfold_sandbox_gpu_memory_bytes", "GPU memory the sandbox's processes hold (NVML).",
                               labels=["sandbox"])
    util = GaugeMetricFamily("fanfold_sandbox_gpu_util_percent",
                             "SM utilisation of the sandbox's processes, summed, at most 100 per GPU (NVML).",
                             labels=["sandbox"])
    if sample.error is None:
        for row in rows:
            if row["state"] == "pooled" or (tenant is not None and row["tenant"] != tenant):
                continue
            fields = sandbox_fields(row, usage.get(row["id"]), sample)
            if fields:
                memory.add_metric([row["id"]], fields["gpu_memory_bytes"])
                if fields["gpu_util_percent"] is not None:
                    util.add_metric([row["id"]], fields["gpu_util_percent"])
    per_gpu = {
        "util_percent": GaugeMetricFamily("fanfold_gpu_util_percent", "Share of the last sample period a kernel "
                                          "ran on the GPU (NVML).", labels=["gpu"]),
        "memory_used_bytes": GaugeMetricFamily("fanfold_gpu_memory_used_bytes", "GPU memory in use (NVML).",
                                               labels=["gpu"]),
        "memory_total_bytes": GaugeMetricFamily("fanfold_gpu_memory_total_bytes", "GPU memory (NVML).",
                                                labels=["gpu"]),
        "sandboxes": GaugeMetricFamily("fanfold_gpu_sandboxes", "Sandboxes holding the GPU, warm ones included.",
                                       labels=["gpu"]),
    }
    for gpu in panel(sample, rows):
        for key, family in per_gpu.items():
            if gpu[key] is not None:
                family.add_metric([gpu["id"]], gpu[key])
    yield from (family for family in (memory, util, *per_gpu.values()) if family.samples)
