"""One host's figures from its engine workers' own: pools and ``stats`` summed or combined."""

from __future__ import annotations

from typing import Any

from ... import ids
from ...models import Limits, PoolInfo

RATES = (("infra_error_rate", "infra_errors", "creates"), ("timeout_rate", "timeouts", "execs"))


def split(size: int | None, count: int) -> list[int | None]:
    """A pool's size shared out over ``count`` workers (None, following demand, stays None for each)."""
    if size is None:
        return [None] * count
    return [size // count + (index < size % count) for index in range(count)]


def pools(per_worker: list[list[PoolInfo]]) -> list[PoolInfo]:
    """Each pool once: its workers' shares added up."""
    merged: dict[tuple[str, Any], PoolInfo] = {}
    for infos in per_worker:
        for info in infos:
            key = (info.source, info.limits)
            seen = merged.get(key)
            merged[key] = info if seen is None else pool_sum(seen, info)
    return list(merged.values())


def pool_sum(a: PoolInfo, b: PoolInfo) -> PoolInfo:
    return PoolInfo(
        source=a.source, limits=a.limits, size=None if a.size is None else a.size + (b.size or 0),
        target=a.target + b.target, ready=a.ready + b.ready, filling=a.filling + b.filling,
        handouts=a.handouts + b.handouts, misses=a.misses + b.misses, last_error=a.last_error or b.last_error,
    )


def stats(per_worker: list[dict[str, Any]]) -> dict[str, Any]:
    """The host's ``stats`` from each worker's: rows and host figures are the same database's and
    host's (the first worker's); queues, counts and network totals are added; each sandbox is listed
    by the worker that runs it (it alone knows its network figures); latency percentiles are the
    highest any worker saw (an upper bound); rates are recomputed from the summed counts."""
    count = len(per_worker)
    out = dict(per_worker[0])
    out["queue"] = {key: sum(s["queue"][key] for s in per_worker) for key in per_worker[0]["queue"]}
    out["pools"] = _pool_dicts([d for s in per_worker for d in s["pools"]])
    for key in ("creates", "infra_errors", "execs", "timeouts"):
        out[key] = sum(s[key] for s in per_worker)
    for rate, part, whole in RATES:
        out[rate] = round(out[part] / out[whole], 4) if out[whole] else 0.0
    for key in ("create_ms", "exec_ms"):
        out[key] = {q: _highest(s[key][q] for s in per_worker) for q in per_worker[0][key]}
    out["alerts"] = sorted({alert for s in per_worker for alert in s["alerts"]})
    out["network"] = {key: sum(s["network"].get(key, 0) for s in per_worker) for key in per_worker[0]["network"]}
    out["sandboxes"] = [row for index, s in enumerate(per_worker) for row in s["sandboxes"]
                        if ids.shard_of(row["id"], count) == index]
    out["workers"] = count
    return out


def _pool_dicts(shares: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``pools`` over ``stats``' pools, which are dicts."""
    infos = [PoolInfo(**{**share, "limits": Limits(**share["limits"])}) for share in shares]
    return [info.to_dict() for info in pools([infos])]


def _highest(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None
