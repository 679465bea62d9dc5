"""fanfold on a real local Ray cluster: a head and two worker nodes (Ray's own test utility starts a
raylet per node on this machine), each running its ``fanfold serve`` on its own state dir with the real
runtime; the fleet is ``AsyncFleet("ray://")``, the same SDK as embedded and over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import sqlite3
import time
from pathlib import Path

import pytest

from conftest import STATE_DIR, leaks, run_cli, settle, stray_processes
from test_snapshots import COUNTER, advances

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from fanfold import AsyncFleet, EngineConfig, Fleet, ids  # noqa: E402
from fanfold.errors import InfrastructureError, SandboxNotFound  # noqa: E402
from fanfold.cluster.node import ClusterConfig, start_cluster, stop_cluster  # noqa: E402
from fanfold.engine import Engine  # noqa: E402
from fanfold.host import disk  # noqa: E402

NODE_MEMORY = 4 * 2**30
"""Each worker node's Ray ``memory`` resource: the capacity placement shares out."""
ROOT = STATE_DIR / "ray"


def _node_args(**extra: object) -> dict[str, object]:
    return {"num_cpus": 1, "resources": {"fanfold": 1}, "object_store_memory": 80 * 2**20, "memory": NODE_MEMORY,
            **extra}


def release_leftover_nodes() -> None:
    """A run killed mid-cluster leaves its node servers' state dirs (a mounted disk, parent cgroups) under
    node ids no later run reuses: an engine on each releases them before the dirs go."""
    for state_dir in sorted(ROOT.iterdir()) if ROOT.is_dir() else ():
        if state_dir.is_dir():
            settle(EngineConfig(state_dir=state_dir))
    shutil.rmtree(ROOT, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    """Head (no fanfold) plus two fanfold nodes; at the end every server, sandbox and Ray process is gone."""
    release_leftover_nodes()
    ray_cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 80 * 2**20, "include_dashboard": False})
    for _ in range(2):
        ray_cluster.add_node(**_node_args())
    ray_cluster.wait_for_nodes()
    ray.init(address=ray_cluster.address, namespace="fanfold", log_to_driver=False)
    config = ClusterConfig(state_dir=str(ROOT / "{node_id}"), resource="fanfold", host="127.0.0.1")
    try:
        asyncio.run(start_cluster(config, address=None, nodes=2))
        yield ray_cluster
    finally:
        asyncio.run(stop_cluster(address=None))
        ray.shutdown()
        ray_cluster.shutdown()
    for state_dir in ROOT.iterdir():
        node_config = EngineConfig(state_dir=state_dir)
        assert leaks(node_config) == {"mounts": 0, "cgroups": 0, "containers": 0}, state_dir
        assert not disk.ready(state_dir), f"{state_dir}'s disk is still mounted"
    # Ray's processes and the node servers (the session's own `fanfold serve` runs on elsewhere)
    assert not [line for line in stray_processes() if "ray" in line or str(ROOT) in line]
    shutil.rmtree(ROOT, ignore_errors=True)


@pytest.fixture
async def fleet(cluster, monkeypatch):
    monkeypatch.setenv("FANFOLD_LEASE_TTL", "3")  # a dead node's leases lapse within the test
    async with AsyncFleet("ray://") as fleet:
        yield fleet


def _tags(fleet: AsyncFleet) -> list[str]:
    return sorted(fleet._transport.nodes)


async def test_ids_name_their_node_and_calls_go_there(fleet):
    tags = _tags(fleet)
    assert len(tags) == 2
    boxes = [await fleet.create(memory_mb=256) for _ in range(4)]
    assert {ids.node_of(box.id) for box in boxes} == set(tags), "four equal creates spread over both nodes"
    for box in boxes:
        result = await box.exec("cat /etc/hostname")  # a sandbox's hostname is its id
        assert result.stdout.decode().strip() == box.id
        await box.files.write("where", box.id)
        assert await box.files.read("where") == box.id.encode()
    for tag in tags:  # each node's own server holds exactly the ones named for it
        node = fleet._transport.nodes[tag]
        async with AsyncFleet(node.url, token=fleet._transport._token) as direct:
            on_node = {info.id for info in await direct.list()}
        assert {box.id for box in boxes if ids.node_of(box.id) == tag} <= on_node
        assert not {box.id for box in boxes if ids.node_of(box.id) != tag} & on_node
    assert {info.id for info in await fleet.list()} >= {box.id for box in boxes}
    for box in boxes:
        await box.kill()
    assert not {info.id for info in await fleet.list()} & {box.id for box in boxes}


async def test_placement_follows_headroom(fleet):
    big = await fleet.create(memory_mb=3072)  # three quarters of a node's memory
    follow = [await fleet.create(memory_mb=512) for _ in range(3)]
    assert all(ids.node_of(box.id) != ids.node_of(big.id) for box in follow), "creates go where memory is left"
    for box in (big, *follow):
        await box.kill()


async def test_placement_prefers_the_node_holding_the_image(fleet):
    from fanfold import EnvSpec

    spec = EnvSpec(base="host").run("echo locality > /marker")
    image = await fleet.build(spec)
    holder = [tag for tag, node in fleet._transport.nodes.items() if image.id in node.images]
    assert len(holder) == 1, "a build runs on one node"
    boxes = [await fleet.create(image, memory_mb=256) for _ in range(3)]
    assert {ids.node_of(box.id) for box in boxes} == set(holder)
    assert (await boxes[0].exec("cat /marker")).stdout == b"locality\n"
    for box in boxes:
        await box.kill()


async def test_fork_and_memory_snapshot_stay_on_their_node(fleet):
    parent = await fleet.create(memory_mb=256)
    await parent.exec("echo parent > /state")
    fork = await parent.fork(2)
    async with fork:
        assert {ids.node_of(child.id) for child in fork.children} == {ids.node_of(parent.id)}
        for child in fork.children:
            assert (await child.exec("cat /state")).stdout == b"parent\n"
    await parent.exec(COUNTER)
    snap = await parent.snapshot(memory=True, name="cluster-snap")
    assert ids.node_of(snap.id) == ids.node_of(parent.id)
    assert (await fleet.get_snapshot("cluster-snap")).id == snap.id
    async with await fleet.create("cluster-snap", memory_mb=256) as restored:  # by name: found on its node
        assert ids.node_of(restored.id) == ids.node_of(parent.id), "locality: the holder has room"
        assert await advances(restored), "the loop runs on: memory was restored"
    await parent.kill()
    await fleet.delete_snapshot(snap.id)


async def test_a_group_lives_on_one_node_and_forks_there(fleet):
    from fanfold import CreateParams, GroupMember, Limits

    small = CreateParams(limits=Limits(memory_mb=128))
    group = await fleet.create_group([GroupMember(name="db", params=small), GroupMember(name="app", params=small)])
    try:
        node = ids.node_of(group.id)
        assert node in _tags(fleet) and {ids.node_of(box.id) for box in group.members.values()} == {node}
        assert (await group["app"].exec("getent hosts db")).stdout.split() == [b"10.250.0.2", b"db"]
        (copy,) = await group.fork(1)
        assert ids.node_of(copy.id) == node and (await copy["app"].exec("getent hosts db")).ok
        assert {g.id for g in await fleet.groups()} == {group.id, copy.id}
        await copy.kill()
    finally:
        await group.kill()
    assert await fleet.groups() == []


async def test_create_from_a_snapshot_taken_on_another_node(fleet):
    tags = _tags(fleet)
    parent = await fleet.create(memory_mb=256)
    await parent.exec("echo moved > /payload")
    snap = await parent.snapshot()
    holder = ids.node_of(snap.id)
    other = fleet._transport.nodes[next(tag for tag in tags if tag != holder)]
    # Fill the holder (directly on its server) so placement sends the create from the snapshot elsewhere.
    async with AsyncFleet(fleet._transport.nodes[holder].url, token=fleet._transport._token) as direct:
        filler = await direct.create(memory_mb=3584)
        assert ids.node_of(filler.id) == holder
        await fleet._transport.refresh()
        child = await fleet.create(snap, memory_mb=256)
        assert ids.node_of(child.id) == other.tag, "the holder was full"
        assert (await child.exec("cat /payload")).stdout == b"moved\n"
        async with AsyncFleet(other.url, token=fleet._transport._token) as on_other:
            assert snap.id in {info.id for info in await on_other.snapshots()}
        for box in (child, parent):
            await box.kill()
        await fleet.delete_snapshot(snap.id)  # on both nodes
        assert snap.id not in {info.id for info in await fleet.snapshots()}


async def test_map_spreads_rollouts_over_every_node(fleet):
    async def rollout(n: int) -> str:
        async with await fleet.create(memory_mb=128) as box:
            result = await box.exec(f"echo {n}")
            assert result.stdout == f"{n}\n".encode()
            return ids.node_of(box.id)

    results = [r async for r in fleet.map(rollout, range(24), concurrency=8)]
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert {r.value for r in results} == set(_tags(fleet))
    assert await fleet.list() == []


async def test_cluster_metrics_have_every_node_and_the_totals(fleet):
    boxes = [await fleet.create(memory_mb=256) for _ in range(2)]
    await asyncio.gather(*(box.exec("true") for box in boxes))
    stats = await fleet.metrics()
    assert {row["node"] for row in stats["nodes"]} == set(_tags(fleet))
    assert all(row["alive"] for row in stats["nodes"])
    assert stats["sandboxes_by_state"].get("running", 0) >= 2
    assert sum(row["sandboxes"] for row in stats["nodes"]) == len(stats["sandboxes"])
    assert {s["node"] for s in stats["sandboxes"]} >= {ids.node_of(box.id) for box in boxes}
    text = await fleet._transport.metrics_text()
    for tag in _tags(fleet):
        assert f'node="{tag}"' in text
    for box in boxes:
        await box.kill()


def test_the_sync_sdk_works_the_same_on_the_cluster(cluster):
    """The same calls as embedded and over HTTP, through ``Fleet.ray``: a user changes the address only."""
    with Fleet.ray(None) as fleet:
        box = fleet.create(memory_mb=256, labels={"task": "parity"})
        assert box.exec("echo $((6 * 7))").stdout == b"42\n"
        chunks = [item for item in box.exec_stream("echo out; echo err >&2")]
        assert chunks[-1].exit_code == 0 and len(chunks) >= 2
        box.files.write("notes/a.txt", "hello")
        assert [entry.name for entry in box.files.list("notes")] == ["a.txt"]
        assert box.suspend().state == "suspended"
        assert box.resume().state == "running"
        assert box.files.read("notes/a.txt") == b"hello"
        assert box.reset().state == "running"
        assert box.exec("test -e notes/a.txt").exit_code != 0, "reset: back to the image"
        assert [info.id for info in fleet.list(labels={"task": "parity"})] == [box.id]
        assert fleet.get(box.id).id == box.id
        box.kill()
        with pytest.raises(SandboxNotFound):
            fleet.get(box.id)


async def test_a_cluster_wide_pool_is_spread_over_the_nodes(fleet):
    info = await fleet.pool("host", 4, memory_mb=128, wait=120)
    assert (info.size, info.ready) == (4, 4)
    per_node = (await fleet.metrics())["pools"]
    assert {pool["node"] for pool in per_node if pool["ready"]} == set(_tags(fleet))
    box = await fleet.create(memory_mb=128)
    assert (await box.exec("true")).exit_code == 0
    await box.kill()
    (summed,) = await fleet.pools()
    assert summed.handouts == 1, "the create came warm from one node's share"
    info = await fleet.pool("host", 0, memory_mb=128)
    assert info.ready == 0 and all(pool.target == 0 for pool in await fleet.pools())


async def test_a_crashed_node_server_is_started_again_and_the_fleet_follows(fleet):
    tag = _tags(fleet)[0]
    old = fleet._transport.nodes[tag]
    info = next(i for i in await fleet._transport._controller.list_nodes.remote() if i["tag"] == tag)
    os.kill(info["pid"], signal.SIGKILL)  # the node's fanfold serve dies; its Ray node lives on
    loop = asyncio.get_running_loop()
    end = loop.time() + 120
    while tag not in fleet._transport.nodes or fleet._transport.nodes[tag].url == old.url:
        assert loop.time() < end, "the controller did not start the node's server again"
        await asyncio.sleep(0.2)  # polls the fleet's view, which refreshes itself every 2 s
        await fleet._transport.refresh()
    with pytest.raises(InfrastructureError):
        await old.http.stats()  # the old server's connection was given up
    box = await fleet.create(memory_mb=128)
    assert (await box.exec("true")).ok
    await box.kill()


async def test_a_controller_restart_costs_no_sandbox(fleet):
    box = await fleet.create(memory_mb=128)
    ray.kill(fleet._transport._controller, no_restart=False)  # Ray starts it again, with its settings
    await fleet._transport.refresh()  # through the restarted controller
    assert set(_tags(fleet)) and (await box.exec("echo alive")).stdout == b"alive\n"
    assert box.id in {info.id for info in await fleet.list()}
    await box.kill()


async def test_a_node_dying_mid_fan_out_is_retried_elsewhere_and_leaks_nothing(cluster, fleet):
    doomed = cluster.add_node(**_node_args())
    survivors = set(_tags(fleet))
    await _until_nodes(fleet, 3)  # the controller's watch starts a server on the node that joined
    (victim,) = [info for info in await fleet._transport._controller.list_nodes.remote()
                 if info["tag"] not in survivors]
    on_victim = asyncio.Event()

    async def rollout(n: int) -> str:
        async with await fleet.create(memory_mb=128) as box:
            if ids.node_of(box.id) == victim["tag"]:
                on_victim.set()
            await box.exec("sleep 2")
            return ids.node_of(box.id)

    run = fleet.map(rollout, range(12), concurrency=6, retries=3, backoff=0.1)
    collected: list = []

    async def collect() -> None:
        collected.extend([r async for r in run])

    task = asyncio.create_task(collect())
    await asyncio.wait_for(on_victim.wait(), 60)
    died_at = time.time()
    await asyncio.to_thread(cluster.remove_node, doomed)
    await asyncio.wait_for(task, 180)
    assert all(r.ok for r in collected), [(r.status, r.error) for r in collected if not r.ok]
    assert any(r.infra_errors for r in collected), "some rollouts were on the dead node"
    assert {r.value for r in collected} <= survivors | {victim["tag"]}
    assert victim["tag"] not in fleet._transport.nodes
    assert await fleet.list() == [], "nothing left on the survivors"
    # The dead node's sandboxes outlive its server; its engine, started again on its state dir once the
    # driver's lease there has lapsed, reaps them all.
    state_dir = Path(victim["state_dir"])
    await _leases_lapsed(state_dir, died_at)
    engine = Engine(EngineConfig(state_dir=state_dir, node_tag=victim["tag"]))
    await engine.start()
    try:
        assert await engine.list() == []
    finally:
        await engine.close()
    assert leaks(EngineConfig(state_dir=state_dir)) == {"mounts": 0, "cgroups": 0, "containers": 0}


async def _until_nodes(fleet: AsyncFleet, count: int, timeout: float = 120) -> None:
    """Wait until the fleet sees ``count`` nodes (a node's server starts in a few seconds)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while len(fleet._transport.nodes) != count:
        assert loop.time() < end, f"{len(fleet._transport.nodes)} nodes, not {count}, after {timeout} s"
        await asyncio.sleep(0.2)  # polls the fleet's view, which refreshes itself every 2 s
        await fleet._transport.refresh()


async def _leases_lapsed(state_dir: Path, since: float) -> None:
    """Return once every lease in the state dir's database has expired (they were renewed up to ``since``)."""
    with sqlite3.connect(state_dir / "fanfold.db") as db:
        latest = db.execute("SELECT MAX(expires_at) FROM leases").fetchone()[0] or since
    if latest > time.time():
        await asyncio.sleep(latest - time.time() + 0.1)  # a lease's expiry is a point in time: nothing to wait on


# -- The `fanfold ray` command line, run as a subprocess against the module's cluster ---------------------


from fanfold.cluster.node import controller  # noqa: E402

ZERO_LEAKS = {"mounts": 0, "cgroups": 0, "containers": 0}


def _ray_cli(cluster, *args: str) -> subprocess.CompletedProcess[str]:
    done = run_cli("ray", *args, "--address", cluster.address)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def _node_lines(out: str) -> dict[str, tuple[str, str]]:
    """`fanfold ray start`'s stdout, ``TAG  URL  STATE_DIR`` a node, by tag."""
    rows = [line.split() for line in out.splitlines()]
    return {tag: (url, state_dir) for tag, url, state_dir in rows}


def _alive_nodes() -> list[dict]:
    """The controller's node servers on nodes Ray has alive, as this (test) process sees them."""
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    return [info for info in ray.get(controller().list_nodes.remote()) if info["node_id"] in alive]


def test_cli_ray_status_lists_the_nodes_and_never_the_token(cluster):
    nodes = _alive_nodes()
    assert len(nodes) == 2
    as_json = _ray_cli(cluster, "status", "--json")
    assert as_json.returncode == 0, as_json.stderr
    listed = [info for info in json.loads(as_json.stdout)["nodes"] if info["alive"]]
    assert {info["tag"]: info["url"] for info in listed} == {info["tag"]: info["url"] for info in nodes}
    assert all(info["running"] and info["memory_mb"] == NODE_MEMORY / 2**20 and info["cpus"] == 1 for info in listed)
    done = _ray_cli(cluster, "status")
    assert done.returncode == 0, done.stderr
    for info in nodes:
        (row,) = [line for line in done.stdout.splitlines() if line.startswith(info["tag"])]
        assert row.split()[:4] == [info["tag"], info["node_id"][:12], info["url"], "running"]
    assert "resource=fanfold" in done.stdout
    token = ray.get(controller().token.remote())
    assert token not in done.stdout + as_json.stdout


def test_cli_ray_start_where_it_runs_changes_nothing_and_lists_the_nodes(cluster):
    before = {info["tag"]: (info["url"], info["state_dir"]) for info in _alive_nodes()}
    done = _ray_cli(cluster, "start", "--nodes", "2", "--port", "1")  # other settings: ignored, and said so
    assert done.returncode == 0, done.stderr
    assert _node_lines(done.stdout) == before, "the same servers, not new ones"
    assert "runs on this Ray cluster already" in done.stderr and 'AsyncFleet("ray://auto")' in done.stderr


def test_cli_ray_metrics_label_every_node(cluster):
    done = _ray_cli(cluster, "metrics")
    assert done.returncode == 0, done.stderr
    for info in _alive_nodes():
        samples = [line for line in done.stdout.splitlines() if f'node="{info["tag"]}"' in line]
        assert any(line.startswith("fanfold_sandboxes{") for line in samples), samples[:5]


def test_cli_top_on_the_cluster_shows_its_nodes(cluster):
    done = run_cli("--url", "ray://auto", "top", "--once", env={"RAY_ADDRESS": cluster.address, "COLUMNS": "120"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.strip() == "nodes" for line in lines), done.stdout
    for info in _alive_nodes():
        assert any(info["tag"] in line and "yes" in line for line in lines), done.stdout
    assert "Traceback" not in done.stderr, done.stderr


async def test_cli_ray_stop_ends_the_servers_and_their_sandboxes_and_start_brings_them_back(cluster):
    nodes = {info["tag"]: info for info in _alive_nodes()}
    async with AsyncFleet("ray://") as fleet:
        box = await fleet.create(memory_mb=128)
        assert (await box.exec("true")).exit_code == 0
        stopped = await asyncio.to_thread(_ray_cli, cluster, "stop")
        assert stopped.returncode == 0, stopped.stderr
        assert "stopped fanfold on 2 nodes" in stopped.stderr
    for info in nodes.values():  # each server destroyed its sandboxes as it stopped
        assert leaks(EngineConfig(state_dir=Path(info["state_dir"]))) == ZERO_LEAKS, info["tag"]
    not_started = _ray_cli(cluster, "status")
    assert not_started.returncode == 2
    assert not_started.stderr.startswith("error: InvalidRequest: fanfold is not started on this Ray cluster")
    again = _ray_cli(cluster, "stop")
    assert again.returncode == 0 and "not running" in again.stderr
    started = _ray_cli(cluster, "start", "--state-dir", str(ROOT / "{node_id}"), "--resource", "fanfold",
                       "--host", "127.0.0.1", "--nodes", "2", "--timeout", "120")
    assert started.returncode == 0, started.stderr
    lines = _node_lines(started.stdout)
    assert set(lines) == set(nodes), "each node keeps its tag (kept in its state dir)"
    assert {state_dir for _, state_dir in lines.values()} == {info["state_dir"] for info in nodes.values()}
    async with AsyncFleet("ray://") as fleet:
        box = await fleet.create(memory_mb=128)
        assert ids.node_of(box.id) in nodes
        await box.kill()


def test_cli_ray_with_no_cluster_at_the_address_is_one_line_at_once():
    started = time.monotonic()
    done = run_cli("ray", "status", "--address", "127.0.0.1:1", timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("error: InfrastructureError: no Ray cluster answers at 127.0.0.1:1"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "start one on this machine with `ray start --head`, then `fanfold ray start`" in done.stderr
    assert time.monotonic() - started < 30, "not Ray's own minutes of retries"


def test_joining_silences_rays_token_notice_and_nothing_else(tmp_path):
    """Ray logs that token authentication is on at every join of ``auto`` on a machine holding a token."""
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("a-token-of-this-test-0123456789abcdef\n")
    script = """if True:
        import sys
        from ray._private.authentication import authentication_token_setup as setup
        if sys.argv[1] == "quiet":
            from fanfold.cluster.node import quiet_token_notice
            quiet_token_notice()
        setup.maybe_enable_token_auth_if_token_available()
        setup._warn_token_auth_disabled()  # another warning of that logger still shows
    """
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    loud, quiet = (subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=60,
                                  env={**env, "HOME": str(tmp_path)}) for mode in ("loud", "quiet"))
    assert "Token authentication is enabled" in loud.stderr and "is disabled" in loud.stderr
    assert "Token authentication is enabled" not in quiet.stderr and "is disabled" in quiet.stderr, quiet.stderr


def test_cli_ray_without_ray_installed_names_the_extra():
    blocked = "import sys\nsys.modules['ray'] = None\nfrom fanfold.cli import main\nmain(prog_name='fanfold')"
    done = subprocess.run([sys.executable, "-c", blocked, "ray", "status"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: MissingExtra: fanfold on a Ray cluster needs ray, which is not installed:"
                                   " pip install 'fanfold[ray]'")
