"""The operator's figures: the host at a glance (``stats``) and the gauges Prometheus scrapes."""

from __future__ import annotations

import json
from typing import Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..host import nvml
from . import admission, gpu_figures
from . import db as dbmod
from .gpus import Gpus
from .lifecycle import Lifecycle
from .pools import Pools


class Figures:
    """Counts read from the rows, pools, admission and the backend's counters."""

    def __init__(self, life: Lifecycle, pools: Pools) -> None:
        self.life, self.pools = life, pools

    async def stats(self, *, tenant: str | None = None, sandboxes: bool = True) -> dict[str, Any]:
        """The host at a glance: sandboxes by state (with their CPU, memory and GPU use), queue, pools,
        GPUs, create and exec latency percentiles, error and timeout rates, and alerts."""
        by_state = self.life.db.count_by_state()
        every = self.life.db.rows()
        rows = [r for r in every if r["state"] != "pooled" and (tenant is None or r["tenant"] == tenant)]
        gpus = await nvml.read()
        listed = []
        if sandboxes:
            on_gpus = nvml.by_sandbox(gpus, self.life.config.cgroup_parent)
            for row in rows:
                cpu_s, memory = self.life.backend.usage(dbmod.row_handle(row))
                labels = dbmod.row_info(row).labels
                net = self.life.network.figures.get(row["id"], {})
                listed.append({
                    "id": row["id"], "state": row["state"], "cpu_s": round(cpu_s, 3), "memory_bytes": memory,
                    "age_s": round(dbmod.now() - row["created_at"], 1), "rollout_id": labels.get("rollout_id"),
                    "source": row["source"], "network": json.loads(row["network"] or '"none"'),
                    "net_bytes_up": net.get("bytes_up", 0), "net_bytes_down": net.get("bytes_down", 0),
                    "net_requests": net.get("requests", 0), "net_denied": net.get("denied", 0),
                    "memory_pages": self.life.backend.page_counts(row["id"]),
                    **gpu_figures.sandbox_fields(row, on_gpus.get(row["id"]), gpus),
                })
        tasks, most_tasks = admission.kernel_tasks()
        live = [dbmod.row_info(r).limits for r in every if r["state"] not in ("destroying", "suspended")]
        return {
            "sandboxes_by_state": by_state,
            "queue": {"waiting": self.life.admission.waiting, "creating": self.life.admission.creating,
                      "max_creating": self.life.config.max_creating},
            "pools": [pool.to_dict() for pool in self.pools.infos(tenant)],
            "host": {"memory_available_mb": admission.memory_available_mb(), "kernel_tasks": tasks,
                     "kernel_tasks_max": most_tasks, "shortage": self.life.admission.shortage(),
                     "leases": self.life.db.count_leases(),
                     # the limits its sandboxes (pooled too) may take: a cluster places creates by what is left
                     "memory_committed_mb": sum(limits.memory_mb for limits in live),
                     "cpus_committed": round(sum(limits.cpus for limits in live), 3),
                     "nvml": gpus.error or "ok", **gpu_inventory(self.life.gpus)},
            "gpus": gpu_figures.panel(gpus, every),
            **self.life.telemetry.summary(),
            "network": self.life.network.totals(),
            "sandboxes": listed,
        }

    async def sample(self) -> None:
        """Read what the gauges show but cannot read on the event loop themselves: the GPUs."""
        await nvml.read()

    def gauges(self, tenant: str | None = None) -> Iterable[GaugeMetricFamily]:
        """The gauges read at scrape time (the GPUs' as ``sample`` last read them); a server ``tenant``'s
        pools and sandboxes only, for its token."""
        states = GaugeMetricFamily("fanfold_sandboxes", "Sandboxes on this host by state.", labels=["state"])
        counts = self.life.db.count_by_state()
        for state in ("creating", "running", "paused", "suspended", "destroying", "pooled"):
            states.add_metric([state], counts.get(state, 0))
        yield states
        yield GaugeMetricFamily("fanfold_queue_depth", "Creates waiting for a slot.", value=self.life.admission.waiting)
        yield GaugeMetricFamily("fanfold_creating", "Creates holding a slot.", value=self.life.admission.creating)
        ready = GaugeMetricFamily("fanfold_pool_ready", "Warm sandboxes ready per pool source.", labels=["source"])
        by_source: dict[str, int] = {}
        for pool in self.pools.infos(tenant):  # one series per source: pools of other limits add up
            by_source[pool.source] = by_source.get(pool.source, 0) + pool.ready
        for source, count in by_source.items():
            ready.add_metric([source], count)
        yield ready
        yield GaugeMetricFamily("fanfold_memory_available_bytes", "Host memory available (MemAvailable).",
                                value=admission.memory_available_mb() << 20)
        yield from network_counters(self.life.network.totals())
        gpus = nvml.latest()
        yield from gpu_figures.gauges(gpus, nvml.by_sandbox(gpus, self.life.config.cgroup_parent),
                                      self.life.db.rows(), tenant)


def gpu_inventory(gpus: Gpus) -> dict[str, Any]:
    """The host's GPUs and the shares its sandboxes hold of each (a cluster places GPU creates by them)."""
    used = gpus.used()
    return {"gpu_shares": gpus.config.gpu_shares, "gpu_inventory": [
        {"id": gpu.id, "index": gpu.index, "names": list(gpu.names), "model": gpu.model,
         "shares": gpus.config.gpu_shares, "used": used[gpu.id]} for gpu in gpus.host().gpus]}


NETWORK_COUNTERS = (
    ("requests", "fanfold_network_requests", "Requests sandboxes sent through the egress proxy (CONNECTs and plain HTTP)."),
    ("denied", "fanfold_network_denied", "Requests and connections the egress proxy refused by policy."),
    ("connections", "fanfold_network_connections", "Connections sandboxes opened to the egress proxy."),
    ("errors", "fanfold_network_errors", "Malformed requests and failed lookups or upstreams at the egress proxy."),
    ("cache_hits", "fanfold_network_cache_hits", "Downloads the shared cache answered without going out."),
    ("cache_misses", "fanfold_network_cache_misses", "Cacheable downloads fetched from outside (and kept)."),
    ("recorded", "fanfold_network_recorded", "Exchanges stored in recordings."),
    ("replayed", "fanfold_network_replayed", "Requests answered from recordings."),
    ("replay_misses", "fanfold_network_replay_misses", "Requests a replay found no recorded answer for."),
    ("idle_closed", "fanfold_network_idle_closed", "Tunnels the egress proxy closed after its idle timeout."),
)


def network_counters(totals: dict[str, int]) -> Iterable[CounterMetricFamily]:
    """The egress proxy's totals over every sandbox (per-sandbox figures are in ``stats``)."""
    for key, name, text in NETWORK_COUNTERS:
        yield CounterMetricFamily(name, text, value=totals.get(key, 0))
    moved = CounterMetricFamily("fanfold_network_bytes", "Bytes through the egress proxy and exposed ports.",
                                labels=["direction"])
    for key, direction in (("bytes_up", "out"), ("bytes_down", "in"), ("exposed_in", "exposed_in"),
                           ("exposed_out", "exposed_out"), ("cache_bytes", "from_cache")):
        moved.add_metric([direction], totals.get(key, 0))
    yield moved
