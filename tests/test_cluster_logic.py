"""Placement, pool splitting and the merge of nodes' figures: pure logic, no Ray, no network."""

from __future__ import annotations

import copy
import random
from collections import Counter

from prometheus_client import CollectorRegistry, Counter as PromCounter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fanfold.cluster.merge import label_metrics, merge_metrics, merge_stats
from fanfold.cluster.placement import NodeLoad, rank, split_pool

GB = 1024.0


def node(tag: str, *, committed: float = 0.0, memory: float = 16 * GB, available: float | None = None, **figures) -> NodeLoad:
    """A node of 16 GB and 8 CPUs with ``committed`` MB of limits placed."""
    available = memory - committed if available is None else available
    return NodeLoad(tag=tag, memory_mb=memory, cpus=8.0, memory_committed_mb=committed, cpus_committed=0.0,
                    memory_available_mb=available, **figures)


def first(nodes: list[NodeLoad], source: str | None = None, memory_mb: float = 512, seed: int = 0) -> str:
    return rank(nodes, memory_mb=memory_mb, cpus=1.0, source=source, rng=random.Random(seed))[0].tag


def test_more_headroom_wins():
    nodes = [node("busy", committed=12 * GB), node("idle", committed=1 * GB)]
    assert all(first(nodes, seed=seed) == "idle" for seed in range(20))
    assert [n.tag for n in rank(nodes, memory_mb=512, cpus=1.0, source=None)] == ["idle", "busy"]


def test_holding_the_source_wins_over_modestly_more_headroom_only():
    holder = node("holder", committed=6 * GB, images=frozenset({"img-abc", "python:3.12"}))
    roomier = node("roomier", committed=3 * GB)
    for source in ("img-abc", "python:3.12"):
        assert all(first([roomier, holder], source, seed=seed) == "holder" for seed in range(20))
        assert all(first([roomier, holder, node("third", committed=3 * GB)], source, seed=seed) == "holder"
                   for seed in range(20))
    crowded_holder = node("crowded", committed=12 * GB, images=frozenset({"img-abc"}))
    assert all(first([node("empty"), crowded_holder], "img-abc", seed=seed) == "empty" for seed in range(20))
    snap = node("snap", committed=6 * GB, snapshots=frozenset({"snap-n1-0123456789ab"}))
    assert first([roomier, snap], "snap-n1-0123456789ab") == "snap"
    assert first([roomier, snap], "snap-other") == "roomier"


def test_a_holder_the_create_does_not_fit_comes_after_one_it_fits():
    holder = node("holder", committed=15.8 * GB, images=frozenset({"img-abc"}))
    other = node("other", committed=14 * GB)
    assert [n.tag for n in rank([holder, other], memory_mb=512, cpus=1.0, source="img-abc")] == ["other", "holder"]
    # fits under capacity but the host has no memory free beyond the reserve
    starved = node("starved", committed=0, available=600, images=frozenset({"img-abc"}))
    assert first([starved, other], "img-abc") == "other"


def test_when_nothing_fits_the_least_full_comes_first():
    nodes = [node("a", committed=16 * GB), node("b", committed=15.9 * GB), node("c", committed=17 * GB)]
    assert [n.tag for n in rank(nodes, memory_mb=512, cpus=1.0, source=None)] == ["b", "a", "c"]


def test_dead_nodes_are_left_out():
    nodes = [node("dead", alive=False), node("busy", committed=8 * GB)]
    assert [n.tag for n in rank(nodes, memory_mb=512, cpus=1.0, source=None)] == ["busy"]
    assert rank([node("dead", alive=False)], memory_mb=512, cpus=1.0, source=None) == []
    assert NodeLoad.from_stats("gone", None, memory_mb=GB, cpus=1.0).alive is False


def test_creates_in_flight_count():
    quiet, sent_to = node("quiet"), node("sent", inflight=3, inflight_memory_mb=1536)
    assert all(first([quiet, sent_to], seed=seed) == "quiet" for seed in range(20))
    # in-flight memory alone can make a create not fit
    full = node("full", committed=15 * GB, inflight=1, inflight_memory_mb=768)
    assert [n.tag for n in rank([full, node("x", committed=15.4 * GB)], memory_mb=512, cpus=1.0, source=None)] == ["x", "full"]
    assert node("q").sent(512) == node("q", inflight=1, inflight_memory_mb=512)


def test_cpus_and_creating_slots_count_in_headroom():
    cpu_bound = NodeLoad("cpu", memory_mb=16 * GB, cpus=8.0, memory_committed_mb=0, cpus_committed=7.5,
                         memory_available_mb=16 * GB)
    slots_taken = node("slots", creating=4, waiting=2)
    assert first([cpu_bound, node("free")]) == "free"
    assert first([slots_taken, node("free")]) == "free"


def test_the_first_choice_is_seeded_and_spreads_over_equal_nodes():
    nodes = [node(f"n{i}") for i in range(8)]
    orders = [[n.tag for n in rank(nodes, memory_mb=512, cpus=1.0, source=None, rng=random.Random(7))] for _ in range(3)]
    assert orders[0] == orders[1] == orders[2]
    rng = random.Random(1)
    picks = Counter(rank(nodes, memory_mb=512, cpus=1.0, source=None, rng=rng)[0].tag for _ in range(800))
    assert set(picks) == {n.tag for n in nodes}
    assert max(picks.values()) < 200, picks  # 100 each expected: no herd on one node
    ranked = rank(nodes, memory_mb=512, cpus=1.0, source=None, rng=random.Random(3))
    assert sorted(n.tag for n in ranked) == sorted(n.tag for n in nodes)  # each node once


def test_from_stats_reads_the_figures():
    stats = {"host": {"memory_available_mb": 9000, "memory_committed_mb": 2048, "cpus_committed": 3.5},
             "queue": {"waiting": 2, "creating": 1, "max_creating": 8}}
    load = NodeLoad.from_stats("n1", stats, memory_mb=12000, cpus=16, images=["img-1"], snapshots={"snap-x"})
    assert load == NodeLoad("n1", 12000, 16, 2048, 3.5, 9000, creating=1, max_creating=8, waiting=2,
                            images=frozenset({"img-1"}), snapshots=frozenset({"snap-x"}))


def test_split_pool_follows_memory_and_sums_exactly():
    nodes = [node("big", memory=64 * GB), node("mid", memory=32 * GB), node("small", memory=4 * GB)]
    assert split_pool(0, nodes) == {"big": 0, "mid": 0, "small": 0}
    assert split_pool(100, nodes) == {"big": 64, "mid": 32, "small": 4}
    for size in range(0, 60):
        split = split_pool(size, nodes)
        assert sum(split.values()) == size, (size, split)
        if size >= 3:
            assert min(split.values()) >= 1, (size, split)
        assert split["big"] >= split["mid"] >= split["small"] or size < 3
    assert split_pool(3, nodes) == {"big": 1, "mid": 1, "small": 1}
    assert split_pool(2, nodes) == {"big": 1, "mid": 1, "small": 0}


def test_split_pool_skips_dead_nodes():
    nodes = [node("a"), node("b", alive=False), node("c")]
    assert split_pool(5, nodes) == {"a": 3, "b": 0, "c": 2}
    assert split_pool(4, [node("z", alive=False)]) == {"z": 0}


NODE_STATS = {
    "sandboxes_by_state": {"running": 2, "pooled": 1},
    "queue": {"waiting": 1, "creating": 2, "max_creating": 4},
    "pools": [{"source": "img-a", "size": 1, "target": 1, "ready": 1, "filling": 0}],
    "host": {"memory_available_mb": 1000, "kernel_tasks": 50, "kernel_tasks_max": 1000, "shortage": None, "leases": 1,
             "memory_committed_mb": 1536, "cpus_committed": 3.0},
    "window_s": 300.0,
    "create_ms": {"p50": 10.0, "p90": 20.0, "p99": 30.0, "max": 40.0},
    "exec_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0, "max": 4.0},
    "creates": 10, "infra_errors": 1, "infra_error_rate": 0.1, "execs": 100, "timeouts": 0, "timeout_rate": 0.0,
    "alerts": ["infrastructure errors 10.0% of creates, over 1%"],
    "network": {"requests": 5, "bytes_up": 100, "bytes_down": 1000},
    "sandboxes": [{"id": "sb-n1-000000000001", "state": "running"}, {"id": "sb-n1-000000000002", "state": "running"}],
}


def _second_node() -> dict:
    stats = copy.deepcopy(NODE_STATS)
    stats["create_ms"] = {"p50": 5.0, "p90": 50.0, "p99": 60.0, "max": 70.0}
    stats["exec_ms"] = {"p50": None, "p90": None, "p99": None, "max": None}
    stats["creates"], stats["infra_errors"], stats["infra_error_rate"] = 30, 0, 0.0
    stats["execs"], stats["timeouts"] = 0, 0
    stats["alerts"] = []
    stats["host"]["shortage"] = "memory: 100 MB available"
    stats["sandboxes"] = [{"id": "sb-n2-000000000003", "state": "paused"}]
    stats["sandboxes_by_state"] = {"paused": 1}
    return stats


def test_merge_stats_sums_counts_and_takes_the_worst_percentiles():
    merged = merge_stats({"n1": NODE_STATS, "n2": _second_node()})
    assert merged["sandboxes_by_state"] == {"running": 2, "pooled": 1, "paused": 1}
    assert merged["queue"] == {"waiting": 2, "creating": 4, "max_creating": 8}
    assert merged["host"] == {"memory_available_mb": 2000, "kernel_tasks": 100, "kernel_tasks_max": 2000, "leases": 2,
                              "memory_committed_mb": 3072, "cpus_committed": 6.0,
                              "shortage": "n2: memory: 100 MB available", "gpu_inventory": []}
    assert merged["create_ms"] == {"p50": 10.0, "p90": 50.0, "p99": 60.0, "max": 70.0}
    assert merged["exec_ms"] == {"p50": 1.0, "p90": 2.0, "p99": 3.0, "max": 4.0}
    assert (merged["creates"], merged["infra_errors"], merged["infra_error_rate"]) == (40, 1, 0.025)
    assert (merged["execs"], merged["timeouts"], merged["timeout_rate"]) == (100, 0, 0.0)
    assert merged["network"] == {"requests": 10, "bytes_up": 200, "bytes_down": 2000}
    assert merged["window_s"] == 300.0
    assert [(sb["node"], sb["id"]) for sb in merged["sandboxes"]] == [
        ("n1", "sb-n1-000000000001"), ("n1", "sb-n1-000000000002"), ("n2", "sb-n2-000000000003")]
    assert [(pool["node"], pool["source"]) for pool in merged["pools"]] == [("n1", "img-a"), ("n2", "img-a")]
    assert merged["alerts"] == ["n1: infrastructure errors 10.0% of creates, over 1%"]
    assert merged["nodes"] == [
        {"node": "n1", "sandboxes": 2, "memory_committed_mb": 1536, "memory_available_mb": 1000, "creating": 2,
         "waiting": 1, "create_p50_ms": 10.0, "exec_p50_ms": 1.0, "alive": True},
        {"node": "n2", "sandboxes": 1, "memory_committed_mb": 1536, "memory_available_mb": 1000, "creating": 2,
         "waiting": 1, "create_p50_ms": 5.0, "exec_p50_ms": None, "alive": True},
    ]
    assert "node" not in NODE_STATS["sandboxes"][0]  # the nodes' dicts are not changed


def test_merge_stats_lists_a_node_down_with_an_alert():
    merged = merge_stats({"n1": NODE_STATS, "n9": None})
    assert merged["nodes"][1] == {"node": "n9", "alive": False}
    assert "n9: node not answering" in merged["alerts"]
    assert merged["creates"] == 10 and merged["host"]["memory_available_mb"] == 1000
    nothing = merge_stats({"n9": None})
    assert nothing["create_ms"] == {"p50": None, "p90": None, "p99": None, "max": None}
    assert nothing["sandboxes"] == [] and nothing["creates"] == 0 and nothing["infra_error_rate"] == 0.0


def test_merge_stats_keeps_a_rate_whose_counts_are_missing():
    partial = {"n1": {"timeout_rate": 0.2}, "n2": {"timeout_rate": 0.05}}
    assert merge_stats(partial)["timeout_rate"] == 0.2


def _exposition(creates: int, queue: float) -> str:
    registry = CollectorRegistry()
    counter = PromCounter("fanfold_creates", "Create calls by result.", ["result"], registry=registry)
    counter.labels(result="ok").inc(creates)
    histogram = Histogram("fanfold_exec_seconds", "Time of each exec call.", buckets=(0.1, 1.0), registry=registry)
    histogram.observe(0.5)
    Gauge("fanfold_queue_depth", "Creates waiting for a slot.", registry=registry).set(queue)
    return generate_latest(registry).decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_label_metrics_adds_the_node_to_every_sample():
    text = label_metrics(_exposition(3, 2) + 'fanfold_empty{} 1\n', "n1")
    samples = _samples(text)
    assert samples[("fanfold_creates_total", (("node", "n1"), ("result", "ok")))] == 3
    assert samples[("fanfold_queue_depth", (("node", "n1"),))] == 2
    assert samples[("fanfold_exec_seconds_bucket", (("le", "0.1"), ("node", "n1")))] == 0
    assert samples[("fanfold_empty", (("node", "n1"),))] == 1
    assert all(dict(labels).get("node") == "n1" for _, labels in samples)
    assert text.count("# HELP") == _exposition(3, 2).count("# HELP")


def test_merge_metrics_gives_each_family_once_with_every_node():
    text = merge_metrics({"n1": _exposition(3, 2), "n2": _exposition(5, 0)})
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert text.count("# HELP fanfold_creates_total ") == 1 and text.count("# TYPE fanfold_exec_seconds ") == 1
    assert {s.labels["node"]: s.value for s in families["fanfold_creates"].samples if s.name == "fanfold_creates_total"} \
        == {"n1": 3, "n2": 5}
    assert {s.labels["node"]: s.value for s in families["fanfold_queue_depth"].samples} == {"n1": 2, "n2": 0}
    assert families["fanfold_exec_seconds"].type == "histogram"
    assert len([s for s in families["fanfold_exec_seconds"].samples if s.name.endswith("_count")]) == 2
    assert merge_metrics({}) == ""
