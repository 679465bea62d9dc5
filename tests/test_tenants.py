"""Tenants apart on a real ``fanfold serve``: images and pools are each tenant's own (the host's tenant
shares some), quotas refuse with a 429 that names them and leave nothing behind, and a file written
through the files API past the sandbox's disk fails cleanly.

The module runs its own server (quotas in its tokens file, tenants' pulls from two loopback registries
its operator lists, not from a third, and their clones from one loopback git host, not from a second)
on the session's state directory; alice and bob have no quota, carol has small ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import uuid

import httpx
import pytest

from conftest import TOKENS, Server, run_cli, start_server, stop_server
from fanfold import (AsyncFleet, EnvSpec, ImageNotFound, InvalidRequest, InvalidSpec, LimitExceeded, QuotaExceeded,
                     SandboxNotFound, SnapshotInfo, SnapshotNotFound, Unauthorized)
from fanfold.engine import db as dbmod
from fanfold.errors import FanfoldError
from fanfold.web.auth import Tenants
from gitserve import serve_git
from outside import PRIVATE_ADDRESS
from registry import push_image, run_registry

CAROL = "carol-token-0123456789abcdef"
QUOTA = "sandboxes=2 memory_mb=1024 disk_mb=3072 pools=1"


@pytest.fixture(scope="module")
def unlisted(tmp_path_factory):
    """A registry on loopback that the operator does not let tenants pull from."""
    with run_registry(tmp_path_factory.mktemp("unlisted")) as running:
        yield running


@pytest.fixture(scope="module")
def redirecting(registry, tmp_path_factory):
    """A registry tenants may pull from, serving ``registry``'s images, that sends blob downloads to a
    private address (where the outside answers, when it runs)."""
    with run_registry(tmp_path_factory.mktemp("redirecting"), storage=registry.storage,
                      redirect=f"http://{PRIVATE_ADDRESS}/") as running:
        yield running


@pytest.fixture(scope="module")
def git_listed(tmp_path_factory):
    """A git repository over http on loopback that the operator lets tenants clone from; its ``moved_url``
    redirects to a private address (where the outside answers, when it runs)."""
    with serve_git(tmp_path_factory.mktemp("git-listed"), redirect=f"http://{PRIVATE_ADDRESS}/") as served:
        yield served


@pytest.fixture(scope="module")
def git_unlisted(tmp_path_factory):
    """A git repository over http on loopback that the operator does not let tenants clone from."""
    with serve_git(tmp_path_factory.mktemp("git-unlisted")) as served:
        yield served


@pytest.fixture(scope="module")
def tserver(config, registry, redirecting, unlisted, git_listed, git_unlisted, tmp_path_factory):
    where = tmp_path_factory.mktemp("tenants")
    tokens = where / "quota-tokens"
    tokens.write_text(f"alice {TOKENS['alice']}\nbob {TOKENS['bob']}\n# small quotas\ncarol {CAROL} {QUOTA}\n")
    insecure = ",".join(r.host for r in (registry, redirecting, unlisted))
    running = start_server(config.state_dir, where, "--tokens-file", str(tokens), "--registry", registry.host,
                           "--registry", redirecting.host, env={"FANFOLD_INSECURE_REGISTRIES": insecure,
                                                                "FANFOLD_TENANT_GIT_HOSTS": f"127.0.0.1:{git_listed.port}"})
    running.tokens["carol"] = CAROL
    yield running
    assert stop_server(running) == 0


def fleet(server: Server, who: str | None) -> AsyncFleet:
    """``who``'s fleet over TCP, or the host's own tenant over the unix socket (None)."""
    return AsyncFleet(server.unix_url) if who is None else AsyncFleet(server.tcp_url, token=server.tokens[who])


def http(server: Server, who: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.tcp_url, headers={"Authorization": f"Bearer {server.tokens[who]}"},
                             timeout=60)


async def until(poll, wanted, timeout: float = 60) -> None:
    """Poll ``await poll()`` until it equals ``wanted``, failing after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while (got := await poll()) != wanted:
        assert loop.time() < give_up, f"still {got!r} after {timeout} s"
        await asyncio.sleep(0.1)


def rows_of(config, tenant: str) -> int:
    with sqlite3.connect(config.state_dir / "fanfold.db") as db:
        return db.execute("SELECT COUNT(*) FROM sandboxes WHERE tenant=?", (tenant,)).fetchone()[0]


async def test_another_tenants_image_is_a_404_everywhere(tserver):
    secret = f"alice-{uuid.uuid4().hex}"
    async with fleet(tserver, "alice") as alice, fleet(tserver, "bob") as bob:
        mine = await alice.build(EnvSpec("host").env(SECRET=secret))
        assert mine.id in {i.id for i in await alice.images()}
        assert mine.id not in {i.id for i in await bob.images()}
        async with http(tserver, "bob") as raw:
            listed = await raw.get("/v1/images")
            assert listed.status_code == 200 and secret not in listed.text
            made = await raw.post("/v1/sandboxes", json={"image": mine.id})
            never = await raw.post("/v1/sandboxes", json={"image": "img-" + "0" * 16})
        assert made.status_code == never.status_code == 404
        assert made.json()["kind"] == "image_not_found"
        assert made.json()["message"] == never.json()["message"].replace("img-" + "0" * 16, mine.id)
        assert "`fanfold images share NAME`" in made.json()["message"]  # how a host's image becomes visible
        with pytest.raises(ImageNotFound):
            await bob.pool(mine.id, 1)
        with pytest.raises(ImageNotFound):
            await bob.remove_image(mine.id)
        with pytest.raises(ImageNotFound):  # nor build on it, as a base or a copy source
            await bob.build(EnvSpec(mine.id).env(MORE="1"))
        with pytest.raises(ImageNotFound):
            await bob.build(EnvSpec("host").copy_from(mine.id, "/etc/hostname", "/stolen"))
        assert await bob.list() == []
        async with await alice.create(mine.id) as sandbox:
            assert (await sandbox.exec("echo $SECRET")).stdout.decode().strip() == secret

        # The same spec built by bob is his too (layers stay shared); his removing it leaves alice's.
        again = await bob.build(EnvSpec("host").env(SECRET=secret))
        assert again.id == mine.id and again.layers == mine.layers
        assert await bob.remove_image(again.id) == mine.id
        assert mine.id not in {i.id for i in await bob.images()}
        assert mine.id in {i.id for i in await alice.images()}
        async with await alice.create(mine.id):
            pass


async def test_the_hosts_shared_image_is_everyones_until_unshared(tserver):
    async with fleet(tserver, None) as host, fleet(tserver, "bob") as bob:
        image = await host.build(EnvSpec("host").env(TEAM=f"shared-{uuid.uuid4().hex}"))
        assert image.id not in {i.id for i in await bob.images()}
        with pytest.raises(Unauthorized):  # only the host's own tenant publishes
            await bob.share_image(image.id)
        shown = run_cli("--url", tserver.unix_url, "images", "share", image.id)
        assert shown.returncode == 0 and shown.stdout.strip() == image.id, shown.stderr
        seen = {i.id: i for i in await bob.images()}
        assert seen[image.id].shared
        async with await bob.create(image.id) as sandbox:
            with pytest.raises(Unauthorized, match="shared"):
                await bob.remove_image(image.id)
            assert not (await host.share_image(image.id, shared=False)).shared
            assert (await sandbox.exec("echo $TEAM")).stdout.decode().strip() == dict(image.env)["TEAM"]
            with pytest.raises(ImageNotFound):
                await bob.create(image.id)
        assert image.id in {i.id for i in await host.images()}
        await host.remove_image(image.id)


async def test_pools_are_the_tenants_own(tserver):
    async with fleet(tserver, "alice") as alice, fleet(tserver, "bob") as bob:
        image = await alice.build(EnvSpec("host").env(POOL=uuid.uuid4().hex))
        try:
            pool = await alice.pool(image.id, 1, memory_mb=160, wait=120)
            assert pool.ready == 1
            assert [p.source for p in await alice.pools()] == [image.id]
            assert image.id not in {p.source for p in await bob.pools()}
            with pytest.raises(ImageNotFound):  # bob can neither resize nor remove it
                await bob.pool(image.id, 0, memory_mb=160)
            async with http(tserver, "bob") as raw:
                stats = (await raw.get("/v1/stats")).json()
            assert image.id not in str(stats["pools"])
            async with await alice.create(image.id, memory_mb=160) as sandbox:
                assert (await alice.pools())[0].handouts == 1
                with pytest.raises(SandboxNotFound):  # a sandbox from alice's pool is alice's
                    await bob.get(sandbox.id)
                assert sandbox.id not in {info.id for info in await bob.list()}
                # Prometheus: bob's token sees the host's figures, none of them naming alice's image (her
                # pool, her creates' provisioning times); alice sees her pool; the host's own tenant, all.
                async with http(tserver, "bob") as raw:
                    for path in ("/metrics", "/v1/metrics", "/v1/stats"):
                        seen = await raw.get(path)
                        assert seen.status_code == 200 and image.id not in seen.text, path
                    assert "fanfold_provision_seconds_count " in (await raw.get("/metrics")).text  # summed
                async with http(tserver, "alice") as raw:
                    assert f'fanfold_pool_ready{{source="{image.id}"}}' in (await raw.get("/metrics")).text
                async with fleet(tserver, None) as host:
                    text = await host._transport.metrics_text()
                assert f'fanfold_pool_ready{{source="{image.id}"}}' in text
                assert f'fanfold_provision_seconds_count{{source="{image.id}"}} 1.0' in text
        finally:
            await alice.pool(image.id, 0, memory_mb=160)
        await until(lambda: alice.pools(), [])


async def test_the_hosts_pools_serve_every_tenant_as_its_own(tserver):
    """``fanfold serve --pool`` is the operator's warm capacity: a tenant's create of a base takes from it."""
    async with fleet(tserver, None) as host, fleet(tserver, "bob") as bob, fleet(tserver, "alice") as alice:
        try:
            await host.pool("host", 1, memory_mb=176, wait=120)
            assert not [p for p in await bob.pools() if p.limits.memory_mb == 176]
            async with await bob.create(memory_mb=176) as sandbox:
                [pool] = [p for p in await host.pools() if p.limits.memory_mb == 176]
                assert pool.handouts == 1
                assert sandbox.id in {info.id for info in await bob.list()}
                with pytest.raises(SandboxNotFound):
                    await alice.get(sandbox.id)
        finally:
            await host.pool("host", 0, memory_mb=176)
        await until(lambda: host.pools(), [])


async def test_the_hosts_own_tenant_sees_and_acts_on_every_tenants_sandboxes(tserver):
    """On the unix socket the host's tenant sees all, as the embedded SDK and CLI do; tenants still see their own."""
    async with fleet(tserver, None) as host, fleet(tserver, "alice") as alice, fleet(tserver, "bob") as bob:
        async with await alice.create(labels={"who": "alice"}) as sandbox:
            snapshot = await sandbox.snapshot()
            [listed] = [info for info in await host.list() if info.id == sandbox.id]
            assert (listed.tenant, listed.labels) == ("alice", {"who": "alice"})
            assert sandbox.id in {row["id"] for row in (await host.metrics())["sandboxes"]}
            assert snapshot.id in {snap.id for snap in await host.snapshots()}
            theirs = await host.get(sandbox.id)
            assert (await theirs.exec("echo hi")).stdout == b"hi\n"
            await theirs.pause()
            assert (await sandbox.refresh()).state == "paused"
            assert sandbox.id not in {info.id for info in await bob.list()}
            assert sandbox.id not in {row["id"] for row in (await bob.metrics())["sandboxes"]}
            with pytest.raises(SandboxNotFound):
                await bob.get(sandbox.id)
            assert snapshot.id not in {snap.id for snap in await bob.snapshots()}
            assert (await sandbox.exec("echo back")).stdout == b"back\n"
            # The CLI on the unix socket: a TENANT column, and alice's sandbox is one it may act on.
            listed = await asyncio.to_thread(run_cli, "--url", tserver.unix_url, "ls")
            rows = [line.split("\t") for line in listed.stdout.splitlines()]
            assert rows[0] == ["ID", "STATE", "IMAGE", "CPUS", "MEM MB", "TENANT", "LABELS"], listed.stderr
            assert [row[5:] for row in rows if row[0] == sandbox.id] == [["alice", "who=alice"]]
            done = await asyncio.to_thread(run_cli, "--url", tserver.unix_url, "exec", sandbox.id, "--", "echo", "cli")
            assert (done.returncode, done.stdout) == (0, "cli\n"), done.stderr
        await host.delete_snapshot(snapshot.id)


async def test_a_tenants_names_are_its_own(tserver, registry):
    """alice and bob pull the same tag at different times: each keeps the image it pulled."""
    ref = f"{registry.host}/tenants-{uuid.uuid4().hex[:8]}:v1"
    name = ref.partition("/")[2]
    async with fleet(tserver, "alice") as alice, fleet(tserver, "bob") as bob:
        push_image(registry, name, [{"marker": "first"}])
        first = await alice.pull(ref)
        push_image(registry, name, [{"marker": "second"}])
        second = await bob.pull(ref)
        assert first.id != second.id
        assert ref in next(i for i in await alice.images() if i.id == first.id).names
        assert first.id not in {i.id for i in await bob.images()}
        for who, marker in ((alice, b"first"), (bob, b"second")):
            async with await who.create(ref) as sandbox:
                assert await sandbox.files.read("/marker") == marker
        await alice.remove_image(ref)
        with pytest.raises(ImageNotFound):
            await alice.remove_image(first.id)
        async with await bob.create(ref):  # alice's removal took her name, not bob's
            pass
        await bob.remove_image(ref)


async def test_a_tenant_pulls_only_from_the_registries_the_operator_allows(tserver, registry, unlisted):
    name = f"allowed-{uuid.uuid4().hex[:8]}:v1"
    push_image(unlisted, name, [{"marker": "unlisted"}])
    push_image(registry, name, [{"marker": "listed"}])
    ref = f"{unlisted.host}/{name}"
    async with fleet(tserver, "alice") as alice, fleet(tserver, None) as host:
        for attempt in (alice.pull(ref), alice.create(ref), alice.build(EnvSpec(ref).env(A="1"))):
            with pytest.raises(InvalidRequest) as refused:
                await attempt
            assert unlisted.host in str(refused.value) and "fanfold serve --registry" in str(refused.value)
        assert name.partition(":")[0] not in str(await alice.images())
        listed = await alice.pull(f"{registry.host}/{name}")  # on loopback, listed: reached
        async with await alice.create(listed.id) as sandbox:
            assert await sandbox.files.read("/marker") == b"listed"
        pulled = await host.pull(ref)  # the operator pulls from anywhere, as before
        async with await host.create(pulled.id) as sandbox:
            assert await sandbox.files.read("/marker") == b"unlisted"
        await alice.remove_image(listed.id)
        await host.remove_image(pulled.id)


async def test_a_tenants_pull_is_not_sent_where_a_registry_redirects_to_a_private_address(
        tserver, registry, redirecting, outside):
    name = f"redirected-{uuid.uuid4().hex[:8]}:v1"
    push_image(registry, name, [{"marker": "redirected"}])
    ref = f"{redirecting.host}/{name}"
    seen = len(outside.requests())
    async with fleet(tserver, "alice") as alice, fleet(tserver, None) as host:
        with pytest.raises(InvalidRequest) as refused:
            await alice.pull(ref)
        said = str(refused.value)
        assert redirecting.host in said and f"{PRIVATE_ADDRESS}:80" in said and "a private address" in said, said
        assert "FANFOLD_NET_REACHABLE" in said
        assert outside.requests()[seen:] == []  # nothing of the pull reached it
        with pytest.raises(FanfoldError):  # the operator's pull follows the redirect, as before (to a 404 there)
            await host.pull(ref)
        assert [r["path"][:24] for r in outside.requests()[seen:]][:1] == ["/docker/registry/v2/blob"]


async def test_snapshot_names_are_each_tenants_own(tserver):
    """alice, bob and the host each hold a snapshot of one name: each sees, lists, starts from and deletes
    its own by that name; the host reaches a tenant's by id only, and another tenant's id is a 404."""
    name = f"Base-{uuid.uuid4().hex[:8]}"  # capitals: no image reference, so never pulled when unknown
    async with fleet(tserver, None) as host, fleet(tserver, "alice") as alice, fleet(tserver, "bob") as bob:
        taken = {}
        for who, label in ((alice, "alice"), (bob, "bob"), (host, "host")):
            async with await who.create() as sandbox:
                await sandbox.files.write("/root/who", label)
                taken[label] = await sandbox.snapshot(name=name)  # not refused: the name is each one's own
                with pytest.raises(InvalidRequest, match="exists already"):  # but once per tenant
                    await sandbox.snapshot(name=name)
        assert len({snap.id for snap in taken.values()}) == 3
        for who, label in ((alice, "alice"), (bob, "bob"), (host, "host")):
            assert (await who.get_snapshot(name)).id == taken[label].id
            async with await who.create(name) as sandbox:
                assert await sandbox.files.read("/root/who") == label.encode()
        assert [s.id for s in await bob.snapshots() if s.name == name] == [taken["bob"].id]
        assert {s.id for s in await host.snapshots() if s.name == name} == {snap.id for snap in taken.values()}

        # Another tenant's snapshot is a 404 by id, for every use, exactly like a missing one.
        for verb in (bob.get_snapshot, bob.create, bob.delete_snapshot, lambda ref: bob.pool(ref, 1)):
            with pytest.raises(SnapshotNotFound):
                await verb(taken["alice"].id)
        async with http(tserver, "bob") as raw:
            rollout = await raw.post("/v1/rollouts", json={"snapshot": taken["alice"].id})
            assert rollout.status_code == 404 and rollout.json()["kind"] == "snapshot_not_found"
        # The host starts from a tenant's snapshot by its id, never by a tenant's name.
        async with await host.create(taken["alice"].id) as sandbox:
            assert await sandbox.files.read("/root/who") == b"alice"
        await host.delete_snapshot(name)
        with pytest.raises(SnapshotNotFound):
            await host.get_snapshot(name)
        with pytest.raises(ImageNotFound):  # the tenants' names are not the host's
            await host.create(name)

        await alice.delete_snapshot(name)  # hers alone
        assert (await bob.get_snapshot(name)).id == taken["bob"].id
        with pytest.raises(SnapshotNotFound):
            await alice.get_snapshot(name)
        await bob.delete_snapshot(name)
        assert not [s for s in await host.snapshots() if s.name == name]


def test_an_older_database_moves_to_snapshot_names_per_tenant(tmp_path):
    """A database made when snapshot names were one namespace (``name TEXT UNIQUE``) keeps its rows and
    takes one name per tenant once an engine opens it."""
    path = tmp_path / "fanfold.db"
    with sqlite3.connect(path) as old:
        old.executescript(OLD_SNAPSHOTS)
        old.execute("INSERT INTO snapshots VALUES ('snap-old', 'host', 'img-1', 'sbx-1', '[]', 0, 'snapshot',"
                    " 'base', '{}', 7, 1.0, 'alice')")
    first, second = dbmod.Database(path), dbmod.Database(path)  # the second finds it moved
    try:
        made = SnapshotInfo(id="snap-new", parent="host", image_id="img-1", sandbox_id="sbx-2", memory=False,
                            kind="snapshot", created_at=2.0, name="base")
        second.insert_snapshot(made, layers=(), tenant="bob")  # refused while names were one namespace
        row = first.snapshot("base", "alice")
        assert (row["id"], row["size_bytes"], row["tenant"]) == ("snap-old", 7, "alice")
        assert first.snapshot("base") is None and first.snapshot("snap-old")["id"] == "snap-old"
        with pytest.raises(sqlite3.IntegrityError):
            second.insert_snapshot(dataclasses.replace(made, id="snap-again"), layers=(), tenant="bob")
        assert second.snapshot("base", "bob")["id"] == "snap-new"
    finally:
        first.close()
        second.close()


OLD_SNAPSHOTS = """
CREATE TABLE snapshots (
    id TEXT PRIMARY KEY, parent TEXT NOT NULL, image_id TEXT NOT NULL, sandbox_id TEXT NOT NULL,
    layers TEXT NOT NULL, memory INTEGER NOT NULL, kind TEXT NOT NULL, name TEXT UNIQUE, limits TEXT NOT NULL,
    size_bytes INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, tenant TEXT NOT NULL DEFAULT ''
);
CREATE INDEX snapshots_sandbox ON snapshots(sandbox_id);
"""


async def test_a_tenants_pull_or_build_never_moves_the_hosts_names(tserver, registry):
    """The host pulled a tag and named a build; a tenant's later pull of that tag (moved meanwhile) and its
    build of that name set the tenant's own names, and the host's still name what they named."""
    ref = f"{registry.host}/hostnames-{uuid.uuid4().hex[:8]}:v1"
    tag = f"team/env-{uuid.uuid4().hex[:8]}:v1"
    async with fleet(tserver, None) as host, fleet(tserver, "alice") as alice:
        push_image(registry, ref.partition("/")[2], [{"marker": "host"}])
        pulled = await host.pull(ref)
        built = await host.build(EnvSpec("host").env(WHO="host"), tag=tag)
        push_image(registry, ref.partition("/")[2], [{"marker": "alice"}])
        theirs = await alice.pull(ref)
        her_build = await alice.build(EnvSpec("host").env(WHO="alice"), tag=tag)
        assert theirs.id != pulled.id and her_build.id != built.id
        named = {image.id: image.names for image in await host.images()}
        assert ref in named[pulled.id] and ref not in named[theirs.id]
        assert tag in named[built.id] and tag not in named[her_build.id]
        async with await host.create(ref) as sandbox:
            assert await sandbox.files.read("/marker") == b"host"
        async with await host.create(tag) as sandbox:
            assert (await sandbox.exec("echo $WHO")).stdout == b"host\n"
        async with await alice.create(ref) as sandbox:
            assert await sandbox.files.read("/marker") == b"alice"
        async with await alice.create(tag) as sandbox:
            assert (await sandbox.exec("echo $WHO")).stdout == b"alice\n"
        for name in (ref, tag):
            await alice.remove_image(name)
            await host.remove_image(name)

        # A rollout's image is resolved for its tenant when the rollout is made: pulled as hers, named hers.
        fresh = f"{registry.host}/rollout-{uuid.uuid4().hex[:8]}:v1"
        push_image(registry, fresh.partition("/")[2], [{"marker": "rollout"}])
        async with http(tserver, "alice") as raw:
            rollout = await raw.post("/v1/rollouts", json={"image": fresh})
            assert rollout.status_code == 201, rollout.text
            assert (await raw.delete(f"/v1/rollouts/{rollout.json()['rollout_id']}")).status_code == 204
        assert fresh not in {name for image in await host.images() for name in image.names}
        [hers] = [image for image in await alice.images() if fresh in image.names]
        await alice.remove_image(hers.id)


async def test_a_tenants_repo_step_clones_only_from_the_git_hosts_the_operator_allows(tserver, git_listed, git_unlisted):
    unlisted_commit = git_unlisted.commit("marker", "unlisted\n")
    refused = {  # what a tenant's repo step names: what its refusal says
        git_unlisted.url: f"127.0.0.1:{git_unlisted.port} is not one",
        f"http://localhost:{git_listed.port}/repo.git": f"localhost:{git_listed.port} is not one",
        f"http://{PRIVATE_ADDRESS}/repo.git": f"{PRIVATE_ADDRESS} is not one",
        "http://169.254.169.254/latest/meta-data": "169.254.169.254 is not one",
        f"git://127.0.0.1:{git_unlisted.port}/repo.git": "https or http only",
        f"ssh://git@127.0.0.1:{git_unlisted.port}/repo.git": "https or http only",
        "git@127.0.0.1:repo.git": "https or http only",
    }
    async with fleet(tserver, "alice") as alice, fleet(tserver, None) as host:
        for url, said in refused.items():
            for ref in ("HEAD", unlisted_commit):  # a commit asks nothing of the remote, and is refused as well
                with pytest.raises(InvalidRequest) as refusal:
                    await alice.build(EnvSpec("host").repo(url, "/src", ref=ref))
                assert said in str(refusal.value), (url, str(refusal.value))
                assert "--git-host" in str(refusal.value) or "https or http only" in said
        with pytest.raises(InvalidSpec, match="local path"):  # file:// is a local path, which no client may name
            await alice.build(EnvSpec("host").repo("file:///root", "/src"))
        listed = await alice.build(EnvSpec("host").repo(git_listed.url, "/src"))  # on loopback, listed: cloned
        async with await alice.create(listed.id) as sandbox:
            assert await sandbox.files.read("/src/README") == b"v1\n"
        operators = await host.build(EnvSpec("host").repo(git_unlisted.url, "/src"))  # from anywhere, as before
        async with await host.create(operators.id) as sandbox:
            assert await sandbox.files.read("/src/marker") == b"unlisted\n"
        await alice.remove_image(listed.id)
        await host.remove_image(operators.id)


async def test_a_tenants_clone_is_not_sent_where_a_git_host_redirects_to_a_private_address(
        tserver, git_listed, outside):
    seen = len(outside.requests())
    async with fleet(tserver, "alice") as alice, fleet(tserver, None) as host:
        with pytest.raises(InvalidRequest) as refused:
            await alice.build(EnvSpec("host").repo(git_listed.moved_url, "/src"))
        said = str(refused.value)
        assert git_listed.moved_url in said and f"{PRIVATE_ADDRESS}:80" in said and "a private address" in said, said
        assert "FANFOLD_NET_REACHABLE" in said
        assert outside.requests()[seen:] == []  # nothing of the clone reached it
        with pytest.raises(FanfoldError):  # the operator's git follows the redirect, as before (to a 404 there)
            await host.build(EnvSpec("host").repo(git_listed.moved_url, "/src"))
        assert [r["path"] for r in outside.requests()[seen:]][:1] == ["/repo.git/info/refs?service=git-upload-pack"]


async def test_a_quota_is_a_429_that_names_it_and_leaves_nothing(tserver, config):
    async with fleet(tserver, "carol") as carol:
        made = [await carol.create(memory_mb=256, disk_mb=256) for _ in range(2)]
        with pytest.raises(QuotaExceeded, match=r"tenant carol has 2 of 2 sandboxes \(quota sandboxes\)"):
            await carol.create(memory_mb=256, disk_mb=256)
        async with http(tserver, "carol") as raw:
            refused = await raw.post("/v1/sandboxes", json={"image": "host"})
        assert refused.status_code == 429 and refused.json()["kind"] == "quota_exceeded"
        assert "retry-after" not in refused.headers  # waiting does not lift a quota
        assert rows_of(config, "carol") == 2
        await made[0].kill()
        with pytest.raises(QuotaExceeded, match=r"256 of 1024 MB of memory \(quota memory_mb\); this create needs 1024"):
            await carol.create(memory_mb=1024)
        with pytest.raises(QuotaExceeded, match=r"256 of 3072 MB of disk \(quota disk_mb\)"):
            await carol.create(memory_mb=256, disk_mb=3000)
        assert rows_of(config, "carol") == 1
        await made[1].kill()

        # Concurrent creates never overshoot: two of four get in.
        tries = await asyncio.gather(*(carol.create(memory_mb=128, disk_mb=128) for _ in range(4)),
                                     return_exceptions=True)
        assert sorted(type(t).__name__ for t in tries) == ["AsyncSandbox"] * 2 + ["QuotaExceeded"] * 2
        assert rows_of(config, "carol") == 2
        for sandbox in tries:
            if not isinstance(sandbox, BaseException):
                await sandbox.kill()

        with pytest.raises(QuotaExceeded, match=r"0 of 1 pooled sandboxes \(quota pools\); this pool needs 2"):
            await carol.pool("host", 2)
        with pytest.raises(QuotaExceeded, match="quota pools"):  # a demand-sized pool counts as its most
            await carol.pool("host", None)
        await carol.pool("host", 1, memory_mb=128)
        await carol.pool("host", 1, memory_mb=128)  # resizing the same pool counts it once
        with pytest.raises(QuotaExceeded, match=r"1 of 1 pooled sandboxes"):
            await carol.pool("host", 1, memory_mb=144)
        await carol.pool("host", 0, memory_mb=128)
        await until(lambda: carol.pools(), [])  # a fill in flight ends before its pool goes
    assert rows_of(config, "carol") == 0


async def test_warm_sandboxes_count_against_the_memory_and_disk_quotas_once(tserver, config):
    """carol's pool is capacity held for her: it counts against memory_mb as live sandboxes do, a pool
    past what her live ones leave is refused, a claim from it counts once, and it refills only into room."""
    async with fleet(tserver, "carol") as carol:
        live = await carol.create(memory_mb=512)
        with pytest.raises(QuotaExceeded, match=r"512 of 1024 MB of memory \(quota memory_mb\); this pool needs 768"):
            await carol.pool("host", 1, memory_mb=768)
        assert await carol.pools() == []
        await live.kill()
        try:
            await carol.pool("host", 1, memory_mb=768, wait=120)
            with pytest.raises(QuotaExceeded, match=r"768 of 1024 MB of memory \(quota memory_mb\), 768 of it in"
                                                    r" its pools; this create needs 512 more"):
                await carol.create(memory_mb=512)
            with pytest.raises(QuotaExceeded, match=r"1024 of 3072 MB of disk \(quota disk_mb\), 1024 of it in"):
                await carol.create(memory_mb=128, disk_mb=2500)
            async with await carol.create(memory_mb=768):  # the warm one, counted once
                [pool] = await carol.pools()
                assert (pool.handouts, pool.ready, pool.filling) == (1, 0, 0)  # no refill past the quota
                assert "quota" in pool.last_error
                with pytest.raises(QuotaExceeded, match="768 of 1024 MB of memory"):
                    await carol.create(memory_mb=512)
            async def held():
                return [(pool.ready, pool.last_error) for pool in await carol.pools()]

            await until(held, [(1, None)], timeout=120)  # room again: it refills
        finally:
            await carol.pool("host", 0, memory_mb=768)
        await until(lambda: carol.pools(), [])
    assert rows_of(config, "carol") == 0


async def test_files_past_the_disk_quota_fail_cleanly_and_the_sandbox_goes_on(tserver, config):
    if config.disk != "btrfs":
        pytest.skip("the disk quota tested here is the btrfs disk's")
    async with fleet(tserver, "alice") as alice, await alice.create(disk_mb=8) as sandbox:
        with pytest.raises(LimitExceeded, match="disk is full"):
            await sandbox.files.write("/big", b"x" * (16 << 20))
        async def chunks():  # streamed, as the SDK's upload sends it
            for _ in range(16):
                yield b"y" * (1 << 20)

        async with http(tserver, "alice") as raw:
            put = await raw.put(f"/v1/sandboxes/{sandbox.id}/files/content", params={"path": "/big2"},
                                content=chunks())
        assert put.status_code == 422 and put.json()["kind"] == "limit_exceeded", put.text
        assert "Traceback" not in put.text
        names = {entry.name for entry in await sandbox.files.list("/")}
        assert not {"big", "big2"} & names and not any(n.startswith(".") and "big" in n for n in names)
        await sandbox.files.write("/small", "still usable")
        assert await sandbox.files.read("/small") == b"still usable"
        assert (await sandbox.exec("echo ok")).stdout == b"ok\n"


def test_quotas_in_the_tokens_file(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"carol {CAROL} {QUOTA}\ncarol {CAROL}x\ndave dave-token-0123456789abcd\n")
    tenants = Tenants.from_file(tokens)
    assert tenants.quotas["carol"].sandboxes == 2 and tenants.quotas["carol"].pools == 1
    assert "dave" not in tenants.quotas
    tokens.write_text(f"carol {CAROL} sandboxes=two\n")
    with pytest.raises(FanfoldError, match=r"tokens:1: 'sandboxes=two' is not a quota"):
        Tenants.from_file(tokens)
    tokens.write_text(f"carol {CAROL} sandboxes=1\ncarol {CAROL}x sandboxes=2\n")
    with pytest.raises(FanfoldError, match="quotas on an earlier line"):
        Tenants.from_file(tokens)
