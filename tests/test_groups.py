"""Sandbox groups against the real runtime: members on a private network reach each other by name and
nothing else reaches them; health checks order the start; a group snapshots, forks and dies as one."""

from __future__ import annotations

import asyncio
import json

import pytest

from fanfold import (
    AsyncFleet, CreateParams, EnvSpec, Fleet, GroupMember, GroupNotFound, GroupParams, HealthCheck, InvalidRequest, Limits,
    ServiceFailed,
)
from fanfold.host import groupnet

from conftest import leaks, run_cli

SMALL = CreateParams(limits=Limits(memory_mb=128))
FETCH = "python3 -c \"import sys,urllib.request;sys.stdout.write(urllib.request.urlopen(sys.argv[1],timeout=5).read().decode())\""
UP = HealthCheck(cmd=["python3", "-c", "import socket; socket.create_connection(('127.0.0.1', 8000), 1)"],
                 interval=0.05, retries=400)


DB = EnvSpec("host").run("mkdir -p /srv && echo original > /srv/value").service(
    "db", "cd /srv && exec python3 -m http.server 8000 --bind 0.0.0.0")
"""An image whose service serves its /srv on port 8000: the group's "database"."""


@pytest.fixture(scope="module")
def db_image(config):
    with Fleet(config=config) as fleet:
        return fleet.build(DB).id


def app_and_db(db_image: str) -> list[GroupMember]:
    return [GroupMember(name="db", params=CreateParams(image=db_image, limits=Limits(memory_mb=128)), health=UP),
            GroupMember(name="app", params=SMALL, after=("db",))]


async def tenant_image(fleet: AsyncFleet) -> str:
    """The db image as this fleet's tenant sees it (built again from cached layers)."""
    return (await fleet.build(DB)).id


async def test_members_reach_each_other_by_name_and_nothing_else_reaches_them(afleet, config):
    async with await afleet.create_group(app_and_db(await tenant_image(afleet)), labels={"task": "t1"}) as group:
        assert set(group.members) == {"db", "app"} and group.info.addresses["db"] == groupnet.address(0)
        fetched = await group["app"].exec(f"{FETCH} http://db:8000/value")
        assert fetched.ok and fetched.stdout == b"original\n", fetched.stderr
        assert (await group["app"].exec("getent hosts db app")).stdout.split() == [
            b"10.250.0.2", b"db", b"10.250.0.3", b"app"]
        assert group["db"].info.labels["task"] == "t1" and group["db"].info.member == "db"
        async with await afleet.create(memory_mb=128) as outsider:  # not a member: no name, no route
            assert not (await outsider.exec("getent hosts db")).ok
            assert not (await outsider.exec(f"{FETCH} http://10.250.0.2:8000/value")).ok
        assert [g.id for g in await afleet.groups()] == [group.id]
    with pytest.raises(GroupNotFound):
        await afleet.group(group.id)
    assert await afleet.list() == []
    if afleet._transport.__class__.__name__ == "Engine":
        assert leaks(config) == {"mounts": 0, "cgroups": 0, "containers": 0}


async def test_a_fork_copies_the_whole_group_each_on_a_network_of_its_own(afleet):
    async with await afleet.create_group(app_and_db(await tenant_image(afleet))) as group:
        copies = await group.fork(2)
        try:
            first, second = copies
            assert set(first.members) == {"db", "app"} and first.id != second.id
            await first["db"].files.write("/srv/value", "first copy\n")
            assert (await first["app"].exec(f"{FETCH} http://db:8000/value")).stdout == b"first copy\n"
            assert (await second["app"].exec(f"{FETCH} http://db:8000/value")).stdout == b"original\n"
            assert (await group["app"].exec(f"{FETCH} http://db:8000/value")).stdout == b"original\n"
        finally:
            await asyncio.gather(*(copy.kill() for copy in copies))
    assert await afleet.groups() == []


async def test_a_group_snapshot_starts_copies_of_the_group(config, db_image):
    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create_group(app_and_db(db_image)) as group:
            await group["db"].files.write("/srv/value", "saved\n")
            snap = await group.snapshot(name="app-and-db")
        assert set(snap.members) == {"db", "app"}
        async with await fleet.create_group(source="app-and-db") as again:
            assert (await again["app"].exec(f"{FETCH} http://db:8000/value")).stdout == b"saved\n"
            assert again.info.source == snap.id
        await fleet.delete_group_snapshot(snap.id)
        assert snap.id not in [s.id for s in await fleet.group_snapshots()]
        await fleet.gc()


async def test_a_member_suspended_and_resumed_is_back_on_the_network(config, db_image):
    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create_group(app_and_db(db_image)) as group:
            await group["db"].suspend()
            await group["db"].resume()
            assert (await group["app"].exec(f"{FETCH} http://db:8000/value")).stdout == b"original\n"
            await group["app"].reset()
            assert (await group["app"].exec(f"{FETCH} http://db:8000/value")).stdout == b"original\n"


async def test_the_group_goes_with_its_last_member(config):
    async with AsyncFleet(config=config) as fleet:
        group = await fleet.create_group([GroupMember(name="a", params=SMALL), GroupMember(name="b", params=SMALL)])
        await group["a"].kill()
        assert list((await group.refresh()).members) == ["b"]
        await group["b"].kill()
        assert await fleet.groups() == []
    assert leaks(config) == {"mounts": 0, "cgroups": 0, "containers": 0}


async def test_a_failing_health_check_fails_the_create_and_leaves_nothing(config):
    async with AsyncFleet(config=config) as fleet:
        never = HealthCheck(cmd="exit 3", interval=0.01, retries=3)
        with pytest.raises(ServiceFailed, match="'db' of the group failed its health check 3 times"):
            await fleet.create_group([GroupMember(name="db", params=SMALL, health=never),
                                      GroupMember(name="app", params=SMALL, after=("db",))])
        assert await fleet.list() == [] and await fleet.groups() == []
    assert leaks(config) == {"mounts": 0, "cgroups": 0, "containers": 0}


@pytest.mark.parametrize("make, match", [
    (lambda: GroupParams(members=(GroupMember(name="a", after=("b",)), GroupMember(name="b", after=("a",)))),
     "cycle"),
    (lambda: GroupParams(members=(GroupMember(name="a"), GroupMember(name="a"))), "must differ"),
    (lambda: GroupParams(members=(GroupMember(name="a", after=("z",)),)), "unknown members"),
    (lambda: GroupMember(name="Bad_Name"), "bad member name"),
    (lambda: GroupMember(name="a", params=CreateParams(network="open")), "group's network policy"),
    (lambda: GroupParams(), "needs members"),
    (lambda: HealthCheck(cmd=""), "needs a command"),
])
def test_bad_groups_are_refused_by_name(make, match):
    with pytest.raises(InvalidRequest, match=match):
        make()


async def test_a_tenant_sees_only_its_own_groups(server):
    alice = AsyncFleet(server.tcp_url, token=server.tokens["alice"])
    bob = AsyncFleet(server.tcp_url, token=server.tokens["bob"])
    async with alice, bob:
        async with await alice.create_group([GroupMember(name="solo", params=SMALL)]) as group:
            assert await bob.groups() == []
            with pytest.raises(GroupNotFound):
                await bob.group(group.id)
            with pytest.raises(GroupNotFound):
                await bob._transport.kill_group(group.id)
            assert [g.id for g in await alice.groups()] == [group.id]


def test_the_cli_creates_lists_forks_snapshots_and_removes_groups():
    made = run_cli("group", "create", "db=host", "app=host", "--after", "app:db", "--memory-mb", "128")
    assert made.returncode == 0, made.stderr
    group_id = made.stdout.strip()
    listed = json.loads(run_cli("group", "ls", "--json").stdout)
    assert [(g["id"], list(g["members"])) for g in listed] == [(group_id, ["db", "app"])]
    copies = run_cli("group", "fork", group_id, "-n", "2").stdout.split()
    snap = run_cli("group", "snapshot", group_id, "--name", "cli-group").stdout.strip()
    started = run_cli("group", "start", "cli-group").stdout.strip()
    assert snap.startswith("gsnap-") and len(copies) == 2 and started.startswith("grp-")
    assert run_cli("group", "rm", group_id, started, *copies).returncode == 0
    assert run_cli("group", "rm-snapshot", "cli-group").stdout.split() == ["cli-group"]
    assert json.loads(run_cli("group", "ls", "--json").stdout) == []
    bad = run_cli("group", "create", "db=host", "--after", "db:nowhere")
    assert bad.returncode == 2 and "comes after unknown members ['nowhere']" in bad.stderr


ECHO_SERVER = """nohup python3 -c "
import socketserver
class Echo(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile: self.wfile.write(b'echo ' + line)
socketserver.ThreadingTCPServer(('0.0.0.0', 7000), Echo).serve_forever()
" >/dev/null 2>&1 &"""
HOLDER = """nohup python3 -c "
import os, socket
conn = socket.create_connection(('db', 7000)).makefile('rwb', buffering=0)
os.mkfifo('/tmp/say')
while True:
    with open('/tmp/say') as said: word = said.read()
    conn.write(word.encode() + b'\\n')
    with open('/tmp/heard', 'wb') as heard: heard.write(conn.readline())
" >/dev/null 2>&1 &"""
SAY = "while [ ! -p /tmp/say ]; do sleep 0.01; done; echo -n {word} > /tmp/say && while [ ! -s /tmp/heard ]; do sleep 0.01; done && cat /tmp/heard && rm /tmp/heard"


async def test_a_connection_open_between_members_goes_on_in_each_copy_of_a_fork(config):
    """A member's socket bound to its group address is restored (the address stands in on lo until it
    rejoins), and with the group's traffic held during the checkpoints both ends of it agree."""
    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create_group([GroupMember(name="db", params=SMALL),
                                             GroupMember(name="app", params=SMALL)]) as group:
            await group["db"].exec(ECHO_SERVER)
            assert (await group["app"].exec("until python3 -c \"import socket; socket.create_connection(('db',"
                                             " 7000), 1)\" 2>/dev/null; do sleep 0.05; done")).ok
            await group["app"].exec(HOLDER)
            assert (await group["app"].exec(SAY.format(word="before"), timeout=30)).stdout == b"echo before\n"
            copies = await group.fork(2)
            try:
                for n, copy in enumerate(copies):
                    said = await copy["app"].exec(SAY.format(word=f"copy{n}"), timeout=30)
                    assert said.stdout == f"echo copy{n}\n".encode(), said
            finally:
                await asyncio.gather(*(copy.kill() for copy in copies))
            assert (await group["app"].exec(SAY.format(word="parent"), timeout=30)).stdout == b"echo parent\n"


async def test_a_group_snapshot_survives_gc_and_a_member_is_forked_only_with_its_group(config):
    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create_group([GroupMember(name="a", params=SMALL),
                                             GroupMember(name="b", params=SMALL)]) as group:
            snap = await group.snapshot()
            await fleet.gc()  # the members' snapshots are unnamed, but the group snapshot holds them
            with pytest.raises(InvalidRequest, match="fork the whole group"):
                await group["a"].fork(1)
            with pytest.raises(InvalidRequest, match="memory must be True or False"):
                await group.snapshot(memory="yes")
            await group["b"].kill()
            with pytest.raises(InvalidRequest, match=r"has lost members \['b'\]"):
                await group.fork(1)
        async with await fleet.create_group(source=snap.id) as again:
            assert sorted(again.members) == ["a", "b"]
        with pytest.raises(Exception, match="in use by gsnap-"):
            await fleet.delete_snapshot(snap.members["a"])
        await fleet.delete_group_snapshot(snap.id)
        await fleet.gc()


@pytest.mark.parametrize("body, match", [
    ({"members": ["x"]}, "a group member is an object"),
    ({"members": [{"name": "a", "volumes": 5}]}, "volumes a name -> path map"),
    ({"members": [{"name": "a"}], "labels": 5}, "labels are a name -> value map"),
    ({"members": [{"name": "a"}], "detached": "no"}, "detached is true or false"),
    ({"members": [{"name": "a", "health": {"cmd": 5}}]}, "needs a command"),
    ({"members": [{"name": "a", "params": {"memory_mb": 5}}]}, "bad group params"),
])
def test_a_bad_group_body_is_a_clear_invalid_request(body, match):
    from fanfold.groups import params_from_wire

    with pytest.raises(InvalidRequest, match=match):
        params_from_wire(body)
