"""What an operator watches: Prometheus metrics and recent-window figures for ``fanfold top``.

Each engine has its own registry (tests run several engines in one process). Latency
percentiles and error rates for the live view come from a window of recent events,
not from histogram buckets, so they are exact for what the window holds.

A server's tenant sees the host's figures with nothing that names another tenant's things:
provisioning times summed over every source (the operator's are by source), and its own
pools alone.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric

WINDOW_S = 300.0
"""How far back ``fanfold top``'s percentiles and rates look."""
WINDOW_EVENTS = 20_000
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ALERTS = {"provision_p99_s": 10.0, "infra_error_rate": 0.01, "timeout_rate": 0.01}
"""Thresholds from the operators' guide: provisioning over 10 s, infra errors or timeouts over 1%."""


class _Window:
    """(time, value) pairs of the last WINDOW_S seconds."""

    def __init__(self) -> None:
        self._events: deque[tuple[float, float]] = deque(maxlen=WINDOW_EVENTS)

    def add(self, value: float) -> None:
        self._events.append((time.monotonic(), value))

    def values(self) -> list[float]:
        cutoff = time.monotonic() - WINDOW_S
        while self._events and self._events[0][0] < cutoff:
            self._events.popleft()
        return [value for _, value in self._events]


class Telemetry:
    def __init__(self, gauges: Callable[[str | None], Iterable[Metric]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        """The counters and histograms; the gauges are read at scrape time, for whoever scrapes."""
        self._gauges = gauges
        self.provision = Histogram(
            "fanfold_provision_seconds", "Time from a create call to a running sandbox, queueing included.",
            ["source"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.exec_latency = Histogram(
            "fanfold_exec_seconds", "Time of each exec call, the command's run included.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.creates = Counter("fanfold_creates", "Create calls by result.", ["result"], registry=self.registry)
        self.execs = Counter("fanfold_execs", "Exec calls by outcome.", ["outcome"], registry=self.registry)
        self.infra_errors = Counter(
            "fanfold_infra_errors", "Calls that failed for a reason not the caller's (retryable).", ["op"],
            registry=self.registry,
        )
        self.leases_reaped = Counter("fanfold_leases_reaped", "Leases that expired unrenewed.", registry=self.registry)
        self.sandboxes_reaped = Counter(
            "fanfold_sandboxes_reaped", "Sandboxes destroyed by the engine, not by their owner.", ["reason"],
            registry=self.registry,
        )
        self.pool_handouts = Counter(
            "fanfold_pool_handouts", "Creates served from a warm pool.", registry=self.registry,
        )
        self.create_ms = _Window()
        self.exec_ms = _Window()
        self.create_failed = _Window()  # 1.0 per infrastructure failure, 0.0 per success
        self.exec_timeouts = _Window()  # 1.0 per timed-out exec, 0.0 per other

    def created(self, source: str, seconds: float, *, pooled: bool) -> None:
        self.provision.labels(source=source).observe(seconds)
        self.creates.labels(result="pool" if pooled else "ok").inc()
        self.create_ms.add(seconds * 1000)
        self.create_failed.add(0.0)
        if pooled:
            self.pool_handouts.inc()

    def create_failed_infra(self, result: str) -> None:
        """A create failed for a reason not the caller's: ``infra_error`` or ``capacity``."""
        self.creates.labels(result=result).inc()
        self.infra_errors.labels(op="create" if result == "infra_error" else "capacity").inc()
        self.create_failed.add(1.0)

    def executed(self, seconds: float, outcome: str) -> None:
        self.exec_latency.observe(seconds)
        self.execs.labels(outcome=outcome).inc()
        self.exec_ms.add(seconds * 1000)
        self.exec_timeouts.add(1.0 if outcome == "timeout" else 0.0)

    def exec_failed_infra(self) -> None:
        self.infra_errors.labels(op="exec").inc()
        self.exec_timeouts.add(0.0)

    def exposition(self, tenant: str | None = None) -> bytes:
        """Every metric in Prometheus' text format: the operator's (``tenant`` None), or what a server
        ``tenant`` may see (no label naming another tenant's image, snapshot or pool)."""
        families = list(self.registry.collect())
        if tenant is not None:
            families = [_without_label(family, "source") for family in families]
        return generate_latest(_Families([*families, *self._gauges(tenant)]))

    def summary(self) -> dict[str, object]:
        """Percentiles and rates over the recent window, with the alerts they raise."""
        creates, execs = self.create_ms.values(), self.exec_ms.values()
        failed, timeouts = self.create_failed.values(), self.exec_timeouts.values()
        infra_rate = sum(failed) / len(failed) if failed else 0.0
        timeout_rate = sum(timeouts) / len(timeouts) if timeouts else 0.0
        create = percentiles(creates)
        alerts = []
        if (create["p99"] or 0) / 1000 > ALERTS["provision_p99_s"]:
            alerts.append(f"provisioning p99 {create['p99'] / 1000:.1f} s is over {ALERTS['provision_p99_s']:g} s")
        if infra_rate > ALERTS["infra_error_rate"]:
            alerts.append(f"infrastructure errors {infra_rate:.1%} of creates, over {ALERTS['infra_error_rate']:.0%}")
        if timeout_rate > ALERTS["timeout_rate"]:
            alerts.append(f"timeouts {timeout_rate:.1%} of execs, over {ALERTS['timeout_rate']:.0%}")
        return {
            "window_s": WINDOW_S, "create_ms": create, "exec_ms": percentiles(execs),
            "creates": len(failed), "infra_errors": int(sum(failed)), "infra_error_rate": round(infra_rate, 4),
            "execs": len(timeouts), "timeouts": int(sum(timeouts)), "timeout_rate": round(timeout_rate, 4),
            "alerts": alerts,
        }


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)
    pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": round(ordered[-1], 3)}


class _Families:
    """Metric families, shaped as the registry ``generate_latest`` reads."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def _without_label(family: Metric, label: str) -> Metric:
    """``family`` with ``label`` dropped and the samples it told apart added up (``_created``: the earliest)."""
    if not any(label in sample.labels for sample in family.samples):
        return family
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in family.samples:
        key = (sample.name, tuple((k, v) for k, v in sample.labels.items() if k != label))
        if sample.name.endswith("_created"):
            merged[key] = min(merged.get(key, sample.value), sample.value)
        else:
            merged[key] = merged.get(key, 0.0) + sample.value
    out = Metric(family.name, family.documentation, family.type, family.unit)
    for (name, labels), value in merged.items():
        out.add_sample(name, dict(labels), value)
    return out
