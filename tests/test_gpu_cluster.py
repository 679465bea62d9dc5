"""GPU sandboxes on a Ray cluster: creates with ``gpus`` go to the nodes whose own stats list the GPU
shares for them, others keep off GPU nodes, and a cluster without a GPU says so.

First placement as pure logic over nodes' stats in the shape ``fanfold serve`` reports them; then a
real local Ray cluster (Ray's test utility) with a plain node and a node whose ``fanfold serve`` finds
a synthetic GPU (a character device named ``nvidia0``, /dev/null's numbers), with the real runtime.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from fanfold.cluster.merge import merge_stats
from fanfold.cluster.placement import NodeLoad, no_gpu_node, rank, split_pool

GB = 1024.0
UUID = "GPU-3f1c0a7e-0000-4000-8000-000000000000"


def gpu_stats(*used: int, shares: int = 2, uuids: tuple[str, ...] = (), committed: float = 0.0) -> dict:
    """A node's ``stats()`` with one GPU per entry of ``used`` (the shares its sandboxes hold)."""
    gpus = []
    for index, taken in enumerate(used):
        uuid = uuids[index] if index < len(uuids) else ""
        gpus.append({"id": uuid or str(index), "index": index, "names": [str(index), *([uuid] if uuid else [])],
                     "model": "NVIDIA H100", "shares": shares, "used": taken})
    return {"host": {"memory_committed_mb": committed, "cpus_committed": 0.0,
                     "memory_available_mb": 16 * GB - committed, "gpu_shares": shares, "gpu_inventory": gpus},
            "queue": {"creating": 0, "max_creating": 4, "waiting": 0}}


def load(tag: str, stats: dict, **extra) -> NodeLoad:
    return replace(NodeLoad.from_stats(tag, stats, memory_mb=16 * GB, cpus=8.0), **extra)


def order(nodes: list[NodeLoad], gpus: str | None = None, exclusive: bool = False, seed: int = 0) -> list[str]:
    ranked = rank(nodes, memory_mb=512, cpus=1.0, source=None, gpus=gpus, gpu_exclusive=exclusive,
                  rng=random.Random(seed))
    return [node.tag for node in ranked]


def test_a_gpu_create_goes_only_to_nodes_with_gpus_even_with_less_room():
    plain = load("plain", gpu_stats())
    gpu = load("gpu", gpu_stats(0, committed=12 * GB))
    assert order([plain, gpu], "1") == ["gpu"]
    assert order([plain, gpu], "all") == ["gpu"]
    assert order([plain], "1") == []


def test_a_create_without_gpus_keeps_off_gpu_nodes_unless_they_have_much_more_room():
    plain, gpu = load("plain", gpu_stats()), load("gpu", gpu_stats(0, 0))
    assert all(order([gpu, plain], seed=seed)[0] == "plain" for seed in range(20))
    fuller_plain = load("plain", gpu_stats(committed=8 * GB))  # half full: the GPU node's room wins
    assert all(order([gpu, fuller_plain], seed=seed)[0] == "gpu" for seed in range(20))


def test_the_node_with_the_most_free_shares_comes_first_and_busy_ones_last():
    one_free = load("one-free", gpu_stats(1, shares=2))
    four_free = load("four-free", gpu_stats(1, 1, 1, 1, shares=2, committed=10 * GB))
    busy = load("busy", gpu_stats(2, shares=2))
    assert all(order([busy, one_free, four_free], "1", seed=seed) == ["four-free", "one-free", "busy"]
               for seed in range(10))
    # every GPU taken: the create still has a node to queue on (the one with the most shares free first)
    assert order([busy, load("busier", gpu_stats(2, 2, shares=2))], "1") == ["busy", "busier"]


def test_equal_gpu_nodes_share_the_first_choice():
    nodes = [load(f"n{i}", gpu_stats(0, 0)) for i in range(4)]
    firsts = {order(nodes, "1", seed=seed)[0] for seed in range(40)}
    assert len(firsts) > 1, "drivers reading the same stats do not all pick one node"


def test_exclusive_needs_a_whole_gpu_and_a_count_needs_that_many_free():
    shared = load("shared", gpu_stats(1, 1, shares=4))  # 6 shares free, no whole GPU
    whole = load("whole", gpu_stats(4, 0, shares=4))  # 4 free, one whole GPU
    assert order([shared, whole], "1", exclusive=True) == ["whole", "shared"]
    assert order([shared, whole], "1", exclusive=False)[0] == "shared"
    assert order([shared, whole], "2", exclusive=True) == ["shared", "whole"], "neither now: the most free first"
    assert not whole.gives_gpus("2", exclusive=True) and not shared.gives_gpus("2", exclusive=True)
    assert shared.gives_gpus("2", exclusive=False) and not whole.gives_gpus("2", exclusive=False)
    assert order([shared, whole], "3") == [], "no node has three GPUs"


def test_device_ids_go_to_the_node_holding_them():
    a = load("a", gpu_stats(0, uuids=(UUID,)))
    b = load("b", gpu_stats(0, 0))
    assert order([a, b], f"device={UUID}") == ["a"]
    assert set(order([a, b], "device=0")) == {"a", "b"}, "an index names a GPU on every node that has it"
    assert order([a, b], "device=1") == ["b"]
    assert order([a, b], f"device=1,{UUID}") == []


def test_this_drivers_creates_in_flight_take_shares():
    node = load("gpu", gpu_stats(0, shares=2))
    assert node.gpu_free() == 2 and node.gives_gpus("1", False)
    two_sent = replace(node, inflight_gpus=(("1", False), ("1", False)))
    assert two_sent.gpu_free() == 0 and not two_sent.gives_gpus("1", False)
    other = load("other", gpu_stats(1, shares=2))
    assert order([two_sent, other], "1") == ["other", "gpu"]


def test_no_gpu_node_says_what_the_cluster_lacks():
    plain = [load("n1", gpu_stats()), load("n2", gpu_stats(), ray_gpus=1.0)]
    why = no_gpu_node(plain, "1")
    assert why.startswith("limit gpus=1: no node of the cluster has a GPU (2 nodes answering)")
    assert "Ray counts GPUs on n2, where fanfold finds no NVIDIA device node or CDI spec" in why
    assert "create the sandbox without gpus, or add a node with GPUs" in why
    assert "Ray counts" not in no_gpu_node(plain[:1], "all")
    two = [load("small", gpu_stats(0)), load("big", gpu_stats(0, 0))]
    assert no_gpu_node(two, "4") == ("limit gpus=4: no node of the cluster has 4 GPUs (the most: 2 on node big);"
                                     " ask for at most 2")
    why = no_gpu_node([load("a", gpu_stats(0, uuids=(UUID,)))], "device=GPU-nope")
    assert why == ("limit gpus=device=GPU-nope: no node of the cluster has all those GPUs"
                   f" (nodes with GPUs: a: 0 ({UUID}))")


def test_a_gpu_pool_is_split_over_gpu_nodes_by_their_shares():
    nodes = [load("plain", gpu_stats()), load("one", gpu_stats(0, shares=4)),
             load("three", gpu_stats(0, 0, 0, shares=4))]
    assert split_pool(8, nodes, gpus="1") == {"plain": 0, "one": 2, "three": 6}
    assert split_pool(4, nodes) == {"plain": 2, "one": 1, "three": 1}, "a pool without gpus: by memory, as before"
    assert split_pool(2, nodes, gpus="2") == {"plain": 0, "one": 0, "three": 2}


def test_merged_stats_list_every_nodes_gpus():
    merged = merge_stats({"a": gpu_stats(1), "b": gpu_stats(), "c": None})
    assert [(gpu["node"], gpu["id"], gpu["used"]) for gpu in merged["host"]["gpu_inventory"]] == [("a", "0", 1)]


# -- A real local Ray cluster: a plain node, then a node with a (synthetic) GPU ------------------------

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from conftest import STATE_DIR, leaks, settle  # noqa: E402
from fanfold import AsyncFleet, EngineConfig, ids  # noqa: E402
from fanfold.cluster.node import ClusterConfig, start_cluster, stop_cluster  # noqa: E402
from fanfold.errors import CapacityExceeded, InvalidRequest, Retryable  # noqa: E402

ROOT = STATE_DIR / "ray-gpu"
SHARES = 2


def _node_args(**extra: object) -> dict[str, object]:
    return {"num_cpus": 1, "resources": {"fanfold": 1}, "object_store_memory": 80 * 2**20, "memory": 4 * 2**30,
            **extra}


def _synthetic_gpu_env(where: Path) -> dict[str, str]:
    """FANFOLD_GPU_* settings under which ``fanfold serve`` finds one GPU: device nodes with /dev/null's numbers."""
    for name in ("dev", "cdi", "proc", "driver"):
        (where / name).mkdir(parents=True)
    for node in ("nvidia0", "nvidiactl", "nvidia-uvm"):
        subprocess.run(["mknod", "-m", "666", str(where / "dev" / node), "c", "1", "3"], check=True)
    return {"FANFOLD_GPU_DEV_DIR": str(where / "dev"), "FANFOLD_GPU_CDI_DIRS": str(where / "cdi"),
            "FANFOLD_GPU_PROC_DIR": str(where / "proc"), "FANFOLD_GPU_DRIVER_DIRS": str(where / "driver"),
            "FANFOLD_GPU_SHARES": str(SHARES)}


def _no_gpu_env(where: Path) -> dict[str, str]:
    """Settings under which ``fanfold serve`` finds no GPU, whatever the machine has."""
    (where / "empty").mkdir(parents=True)
    return {"FANFOLD_GPU_DEV_DIR": str(where / "empty"), "FANFOLD_GPU_CDI_DIRS": str(where / "empty")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head (no fanfold) and a plain fanfold node that Ray counts a GPU on (fanfold finds none there)."""
    for state_dir in sorted(ROOT.iterdir()) if ROOT.is_dir() else ():  # a run killed mid-cluster
        if state_dir.is_dir():
            settle(EngineConfig(state_dir=state_dir))
    shutil.rmtree(ROOT, ignore_errors=True)
    where = tmp_path_factory.mktemp("gpu-host")
    ray_cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 80 * 2**20, "include_dashboard": False})
    ray_cluster.add_node(**_node_args(num_gpus=1, env_vars=_no_gpu_env(where / "plain")))
    ray_cluster.wait_for_nodes()
    ray.init(address=ray_cluster.address, namespace="fanfold", log_to_driver=False)
    config = ClusterConfig(state_dir=str(ROOT / "{node_id}"), resource="fanfold", host="127.0.0.1")
    try:
        asyncio.run(start_cluster(config, address=None, nodes=1))
        yield ray_cluster, where
    finally:
        asyncio.run(stop_cluster(address=None))
        ray.shutdown()
        ray_cluster.shutdown()
    for state_dir in ROOT.iterdir():
        assert leaks(EngineConfig(state_dir=state_dir)) == {"mounts": 0, "cgroups": 0, "containers": 0}, state_dir
    shutil.rmtree(ROOT, ignore_errors=True)


@pytest.fixture(scope="module")
def gpu_node(cluster):
    """A node joined to the cluster whose ``fanfold serve`` finds one GPU of ``SHARES`` shares."""
    ray_cluster, where = cluster
    ray_cluster.add_node(**_node_args(num_gpus=1, env_vars=_synthetic_gpu_env(where / "gpu")))
    ray_cluster.wait_for_nodes()
    asyncio.run(start_cluster(address=None, nodes=2))  # the running controller: waits for the new node's server
    return ray_cluster


@pytest.fixture
async def fleet(cluster):
    async with AsyncFleet("ray://") as fleet:
        yield fleet


def _gpu_tags(fleet: AsyncFleet) -> set[str]:
    return {tag for tag, node in fleet._transport.nodes.items() if node.stats["host"]["gpu_inventory"]}


async def test_a_cluster_without_a_gpu_refuses_gpu_creates_clearly(fleet):
    """Runs before ``gpu_node`` joins (the module's tests run in order)."""
    assert len(fleet._transport.nodes) == 1 and not _gpu_tags(fleet)
    (tag,) = fleet._transport.nodes
    with pytest.raises(InvalidRequest) as refused:
        await fleet.create(memory_mb=128, gpus=1)
    assert str(refused.value).startswith("limit gpus=1: no node of the cluster has a GPU (1 node answering)")
    assert f"Ray counts GPUs on {tag}" in str(refused.value), "Ray's GPU count is a hint in the error"
    with pytest.raises(InvalidRequest, match="no node of the cluster has a GPU"):
        await fleet.pool("host", 1, memory_mb=128, gpus=1)
    async with await fleet.create(memory_mb=128) as box:  # creates without gpus are not held up
        assert (await box.exec("true")).ok


async def test_gpu_creates_land_on_the_gpu_node_and_see_its_device(gpu_node, fleet):
    (gpu_tag,) = _gpu_tags(fleet)
    assert fleet._transport.nodes[gpu_tag].stats["host"]["gpu_inventory"] == [
        {"id": "0", "index": 0, "names": ["0"], "model": "NVIDIA GPU", "shares": SHARES, "used": 0}]
    assert ray.available_resources().get("GPU") == 2, "the node servers take no GPU from Ray's accounting"
    boxes = [await fleet.create(memory_mb=128, gpus=1) for _ in range(SHARES)]
    try:
        for box in boxes:
            assert ids.node_of(box.id) == gpu_tag
            assert box.info.gpu_ids == ["0"]
            assert (await box.exec("test -c /dev/nvidia0 && test -c /dev/nvidiactl")).ok, "the GPU's nodes are inside"
        with pytest.raises(CapacityExceeded) as busy:  # both shares held: a retryable refusal once its wait is up
            await fleet.create(memory_mb=128, gpus=1, queue_timeout=0.5)
        assert isinstance(busy.value, Retryable) and "no GPUs free for gpus=1" in str(busy.value)
        waiting = asyncio.create_task(fleet.create(memory_mb=128, gpus=1, queue_timeout=120))
        await _until_queued(fleet, gpu_tag)
        await boxes.pop().kill()  # a share comes free: the queued create takes it
        boxes.append(await asyncio.wait_for(waiting, 60))
        assert ids.node_of(boxes[-1].id) == gpu_tag and boxes[-1].info.gpu_ids == ["0"]
        plain = [await fleet.create(memory_mb=128) for _ in range(2)]  # not blocked, and kept off the GPU node
        assert all(ids.node_of(box.id) != gpu_tag for box in plain)
        boxes += plain
    finally:
        for box in boxes:
            await box.kill()
    await fleet._transport.refresh()
    assert fleet._transport.nodes[gpu_tag].stats["host"]["gpu_inventory"][0]["used"] == 0, "the shares came back"


async def test_a_gpu_pool_warms_on_the_gpu_node_only(gpu_node, fleet):
    (gpu_tag,) = _gpu_tags(fleet)
    info = await fleet.pool("host", 1, memory_mb=128, gpus=1, wait=120)
    assert (info.size, info.ready) == (1, 1)
    assert [pool["node"] for pool in (await fleet.metrics())["pools"] if pool["ready"]] == [gpu_tag]
    async with await fleet.create(memory_mb=128, gpus=1) as box:
        assert ids.node_of(box.id) == gpu_tag and box.info.gpu_ids == ["0"]
        assert (await box.exec("test -c /dev/nvidia0")).ok
    assert (await fleet.pools())[0].handouts == 1, "the create came warm from the GPU node's pool"
    assert (await fleet.pool("host", 0, memory_mb=128, gpus=1)).ready == 0
    with pytest.raises(InvalidRequest, match="no node of the cluster has 2 GPUs"):
        await fleet.create(memory_mb=128, gpus=2)


async def _until_queued(fleet: AsyncFleet, tag: str, timeout: float = 30) -> None:
    """Return once the node's create queue holds a create (as its stats say)."""
    node = fleet._transport.nodes[tag]
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while (await node.http.stats(sandboxes=False))["queue"]["waiting"] < 1:
        assert loop.time() < end, "the create did not queue on the GPU node"
        await asyncio.sleep(0.05)  # polls the node's figures; nothing to wait on from here
