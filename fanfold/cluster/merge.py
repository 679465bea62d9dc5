"""A cluster's figures from its nodes': one ``stats()`` dict, and one Prometheus exposition.

The merged stats have a single node's shape (so ``fanfold top`` renders them) plus a ``nodes`` list.
Counts add up; latency percentiles do not (the p50 of a union is not a sum or a mean of p50s), so
the cluster's are the worst node's, and each node's p50s are in ``nodes``.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

COUNTS = ("creates", "infra_errors", "execs", "timeouts")
RATES = {"infra_error_rate": ("infra_errors", "creates"), "timeout_rate": ("timeouts", "execs")}
HOST_SUMS = ("memory_available_mb", "kernel_tasks", "kernel_tasks_max", "leases", "memory_committed_mb")
QUEUE_SUMS = ("waiting", "creating", "max_creating")
LATENCIES = ("create_ms", "exec_ms")


def merge_stats(per_node: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """One stats dict for the cluster from each node's (``None`` for a node that did not answer).

    Counts, queue, host and network figures are summed and the rates recomputed from the summed
    counts; latency percentiles are the max over nodes, since percentiles do not add; pools,
    GPUs, sandboxes and alerts are concatenated, each naming its node.
    """
    live = {tag: stats for tag, stats in per_node.items() if stats is not None}
    merged: dict[str, Any] = {
        "sandboxes_by_state": _sum_dicts(stats.get("sandboxes_by_state") for stats in live.values()),
        "queue": _sum_keys((stats.get("queue") or {} for stats in live.values()), QUEUE_SUMS),
        "pools": _tagged(live, "pools"),
        "host": _host(live),
    }
    windows = [stats["window_s"] for stats in live.values() if "window_s" in stats]
    if windows:
        merged["window_s"] = max(windows)
    for key in LATENCIES:
        merged[key] = _worst([stats.get(key) or {} for stats in live.values()])
    merged.update(_counts_and_rates(list(live.values())))
    merged["alerts"] = [f"{tag}: {alert}" for tag, stats in live.items() for alert in stats.get("alerts") or []]
    merged["alerts"] += [f"{tag}: node not answering" for tag, stats in per_node.items() if stats is None]
    merged["network"] = _sum_dicts(stats.get("network") for stats in live.values())
    merged["gpus"] = _tagged(live, "gpus")
    merged["sandboxes"] = _tagged(live, "sandboxes")
    merged["nodes"] = [_node_row(tag, stats) for tag, stats in per_node.items()]
    return merged


def _sum_dicts(dicts: Any) -> dict[str, Any]:
    total: Counter[str] = Counter()
    for figures in dicts:
        total.update({key: value for key, value in (figures or {}).items() if isinstance(value, (int, float))})
    return dict(total)


def _sum_keys(dicts: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    dicts = list(dicts)
    return {key: sum(figures.get(key) or 0 for figures in dicts) for key in keys}


def _tagged(live: dict[str, dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [{**entry, "node": tag} for tag, stats in live.items() for entry in stats.get(key) or []]


def _host(live: dict[str, dict[str, Any]]) -> dict[str, Any]:
    hosts = {tag: stats.get("host") or {} for tag, stats in live.items()}
    host = _sum_keys(hosts.values(), HOST_SUMS)
    host["cpus_committed"] = round(sum(h.get("cpus_committed") or 0.0 for h in hosts.values()), 3)
    shortages = [f"{tag}: {h['shortage']}" for tag, h in hosts.items() if h.get("shortage") is not None]
    host["shortage"] = "; ".join(shortages) or None
    host["gpu_inventory"] = [{**gpu, "node": tag} for tag, h in hosts.items() for gpu in h.get("gpu_inventory") or ()]
    return host


def _worst(percentiles: list[dict[str, float | None]]) -> dict[str, float | None]:
    keys = dict.fromkeys(key for figures in percentiles for key in figures) or dict.fromkeys(("p50", "p90", "p99", "max"))
    worst = {}
    for key in keys:
        values = [figures[key] for figures in percentiles if figures.get(key) is not None]
        worst[key] = max(values) if values else None
    return worst


def _counts_and_rates(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Summed counts; each rate from its summed counts where the nodes gave them, else the worst rate."""
    merged: dict[str, Any] = {key: sum(stats.get(key) or 0 for stats in nodes) for key in COUNTS}
    for rate, (part, whole) in RATES.items():
        if all(whole in stats and part in stats for stats in nodes):
            merged[rate] = round(merged[part] / merged[whole], 4) if merged[whole] else 0.0
        else:
            merged[rate] = max((stats.get(rate) or 0.0 for stats in nodes), default=0.0)
    return merged


def _node_row(tag: str, stats: dict[str, Any] | None) -> dict[str, Any]:
    if stats is None:
        return {"node": tag, "alive": False}
    host, queue = stats.get("host") or {}, stats.get("queue") or {}
    sandboxes = sum(n for state, n in (stats.get("sandboxes_by_state") or {}).items() if state != "pooled")
    return {
        "node": tag, "sandboxes": sandboxes,
        "memory_committed_mb": host.get("memory_committed_mb"), "memory_available_mb": host.get("memory_available_mb"),
        "creating": queue.get("creating"), "waiting": queue.get("waiting"),
        "create_p50_ms": (stats.get("create_ms") or {}).get("p50"), "exec_p50_ms": (stats.get("exec_ms") or {}).get("p50"),
        "alive": True,
    }


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<rest>.*)$")
_COMMENT = re.compile(r"^#\s*(?P<kind>HELP|TYPE)\s+(?P<name>\S+)")


def label_metrics(text: str, node: str) -> str:
    """Prometheus text exposition with ``node="<node>"`` added to every sample (comments kept).

    Assumes the samples carry no ``node`` label already (fanfold's do not).
    """
    label = f'node="{_escape(node)}"'
    return "".join(_label_line(line, label) for line in text.splitlines(keepends=True))


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def _label_line(line: str, label: str) -> str:
    body = line.rstrip("\r\n")
    match = _SAMPLE.match(body)
    if not match:  # a comment or a blank line
        return line
    name, rest, ending = match["name"], match["rest"], line[len(body):]
    if rest.startswith("{"):
        inner = rest[1:].lstrip()
        return f"{name}{{{label}{'' if inner.startswith('}') else ','}{inner}{ending}"
    return f"{name}{{{label}}}{rest}{ending}"


def merge_metrics(per_node: dict[str, str]) -> str:
    """Nodes' expositions as one, each sample labelled with its node; each family's HELP and TYPE
    appear once, followed by its samples from every node (the format forbids a family split)."""
    families: dict[str, dict[str, list[str]]] = {}
    for node, text in per_node.items():
        current: str | None = None
        for line in label_metrics(text, node).splitlines():
            if not line.strip() or line.startswith("# EOF"):
                continue
            comment = _COMMENT.match(line)
            if comment:
                current = comment["name"]
                header = families.setdefault(current, {"header": [], "samples": []})["header"]
                if not any(seen.startswith(f"# {comment['kind']} ") for seen in header):
                    header.append(line)
            elif line.startswith("#"):
                continue  # other comments carry nothing a scraper reads
            else:
                family = current or _family_of(line, families)
                families.setdefault(family, {"header": [], "samples": []})["samples"].append(line)
    lines = [line for family in families.values() for line in family["header"] + family["samples"]]
    return "\n".join(lines) + "\n" if lines else ""


def _family_of(sample: str, families: dict[str, Any]) -> str:
    """The family a sample with no HELP/TYPE before it belongs to: a known one it extends, or its own name."""
    name = _SAMPLE.match(sample)["name"]  # type: ignore[index]
    known = [family for family in families if name == family or name.startswith(family + "_")]
    return max(known, key=len, default=name)
