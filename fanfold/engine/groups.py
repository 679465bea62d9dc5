"""Sandbox groups: members on a private network, created, snapshotted, forked and destroyed as one.

A group is a row (``groups``) and a hub network (``host.groupnet``); its members are ordinary
sandboxes whose rows name the group. A member joins the hub as its bring-up's ``before_run``
(``Lifecycle.bring_up_from`` asks ``hook``), so it is on the network before any of its code
runs, at create and at every restore (resume, reset, a fork's child). The group goes when its
last member goes, however that member went (kill, deadline, lease, reaper).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from contextlib import AbstractContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from .. import ids
from ..errors import FanfoldError, GroupNotFound, InvalidRequest, ServiceFailed
from ..groups import GroupInfo, GroupMember, GroupParams, GroupSnapshotInfo, HealthCheck, start_order
from ..groups import params_from_wire, params_to_wire
from ..host import groupnet, safefs
from ..models import CreateParams, ExecResult, SandboxInfo
from . import db as dbmod
from .lifecycle import process_alive
from .snapshots import check_name

if TYPE_CHECKING:
    from ..runtime import Handle
    from .lifecycle import Lifecycle

log = logging.getLogger("fanfold.engine")
Create = Callable[..., Awaitable[SandboxInfo]]
Exec = Callable[..., Awaitable[ExecResult]]


class Groups:
    """The groups of one engine: their rows, hubs and members."""

    def __init__(self, life: Lifecycle, create: Create, exec_: Exec, snapshot: Callable[..., Awaitable[Any]],
                 fork: Callable[..., Awaitable[Any]], expose: Callable[[str, int], Awaitable[str]]) -> None:
        self.life, self.db = life, life.db
        self._create, self._exec, self._snapshot, self._fork, self._expose = create, exec_, snapshot, fork, expose
        self._ending: dict[str, asyncio.Future[None]] = {}
        self._holds: dict[str, asyncio.Lock] = {}
        life.group_hook = self.hook
        life.group_addresses = self.addresses
        life.group_env = self.env
        life.group_gone = self.member_gone

    # -- rows -----------------------------------------------------------------------------------

    def _pin(self, group_id: str) -> Path:
        return self.life.config.state_dir / "groups" / f"{group_id}.net"

    def _row(self, group_id: str, tenant: str | None = None) -> Any:
        row = self.db.conn.execute("SELECT * FROM groups WHERE id = ?", (group_id,)).fetchone() \
            if isinstance(group_id, str) else None
        if row is None or (tenant is not None and row["tenant"] != tenant):
            raise GroupNotFound(f"no group {group_id!r}")
        return row

    def members(self, group_id: str) -> dict[str, str]:
        rows = self.db.conn.execute("SELECT member, id FROM sandboxes WHERE group_id = ?", (group_id,)).fetchall()
        return {row["member"]: row["id"] for row in rows}

    def info(self, group_id: str, tenant: str | None = None) -> GroupInfo:
        row = self._row(group_id, tenant)
        params = params_from_wire(json.loads(row["params"]))
        members = self.members(group_id)
        order = [m.name for m in params.members]
        return GroupInfo(
            id=row["id"], members={name: members[name] for name in order if name in members},
            addresses=json.loads(row["addresses"]), state=row["state"], network=params.network, labels=params.labels,
            created_at=row["created_at"], deadline_at=row["deadline_at"], source=row["source"],
            ports={name: {int(port): url for port, url in urls.items()}
                   for name, urls in json.loads(row["ports"]).items()},
        )

    def list(self, tenant: str | None = None) -> list[GroupInfo]:
        rows = self.db.conn.execute("SELECT id, tenant FROM groups ORDER BY created_at").fetchall()
        return [self.info(row["id"]) for row in rows if tenant is None or row["tenant"] == tenant]

    def _mine(self, group_id: str) -> bool:
        shard = self.life.shard
        return shard is None or ids.shard_of(group_id, shard[1]) == shard[0]

    # -- create ---------------------------------------------------------------------------------

    async def create(self, params: GroupParams, *, tenant: str = "", lease: str | None = None) -> GroupInfo:
        """Start every member (in ``after`` order, each wave at once), wait for their health checks,
        expose their ports; on any failure, destroy what was made."""
        if not isinstance(params, GroupParams):
            raise InvalidRequest(f"create_group takes a fanfold.GroupParams, got {params!r}")
        source = ""
        if params.source is not None:
            source, params = self._from_snapshot(params, tenant)
        for member in params.members:
            if member.volumes:
                raise InvalidRequest(f"member {member.name!r} names volumes: a group's volumes are not supported on"
                                     " this host yet; keep shared data in one member and reach it over the network")
        group_id = ids.new_id(ids.GROUP, self.life.config.node_tag, self.life.shard)
        addresses = {member.name: groupnet.address(index) for index, member in enumerate(params.members)}
        now = dbmod.now()
        self.db.conn.execute(
            "INSERT INTO groups (id, tenant, state, params, addresses, created_at, deadline_at, source, claimed_by)"
            " VALUES (?, ?, 'creating', ?, ?, ?, ?, ?, ?)",
            (group_id, tenant, json.dumps(params_to_wire(params)), json.dumps(addresses), now,
             now + params.deadline if params.deadline else None, source, self.life.claimer))
        try:
            await asyncio.to_thread(groupnet.make_hub, self._pin(group_id))
            for wave in start_order(params.members):
                await _all(self._start_member(group_id, member, params, tenant, lease) for member in wave)
            ports = {}
            for member in params.members:
                if member.ports:
                    sandbox_id = self.members(group_id)[member.name]
                    ports[member.name] = {port: await self._expose(sandbox_id, port) for port in member.ports}
            self.db.conn.execute("UPDATE groups SET state = 'running', ports = ? WHERE id = ?",
                                 (json.dumps(ports), group_id))
        except BaseException:
            await asyncio.shield(self.destroy(group_id))
            raise
        return self.info(group_id)

    async def _start_member(self, group_id: str, member: GroupMember, params: GroupParams, tenant: str,
                            lease: str | None) -> None:
        made = dataclasses.replace(
            member.params, labels={**params.labels, **member.params.labels, "fanfold.group": group_id},
            deadline=params.deadline if params.deadline is not None else member.params.deadline,
            detached=params.detached or member.params.detached, network=params.network)
        info = await self._create(made, tenant=tenant, lease=lease, group=(group_id, member.name))
        if member.health is not None:
            await self._healthy(info.id, member.name, member.health)

    async def _healthy(self, sandbox_id: str, name: str, check: HealthCheck) -> None:
        """Return once ``check`` passes in the member; ServiceFailed once it has failed ``retries`` times."""
        loop = asyncio.get_running_loop()
        counting_from = loop.time() + check.start_period
        failures, last = 0, None
        while True:
            last = await self._exec(sandbox_id, check.cmd, timeout=check.timeout)
            if last.ok:
                return
            if loop.time() >= counting_from:
                failures += 1
                if failures >= check.retries:
                    tail = (last.stdout + last.stderr).decode(errors="replace")[-2000:]
                    raise ServiceFailed(f"member {name!r} of the group failed its health check {failures} times"
                                        f" (last: {last.outcome.value}, exit code {last.exit_code}):\n{tail}",
                                        service=name, exit_code=last.exit_code, log_tail=tail)
            await asyncio.sleep(check.interval)  # the check's own period: nothing to wait on but time

    def _from_snapshot(self, params: GroupParams, tenant: str) -> tuple[str, GroupParams]:
        row = self.db.conn.execute(
            "SELECT * FROM group_snapshots WHERE (id = ? OR name = ?) AND tenant = ?",
            (params.source, params.source, tenant)).fetchone()
        if row is None:
            raise GroupNotFound(f"no group snapshot {params.source!r}")
        saved = params_from_wire(json.loads(row["params"]))
        images = json.loads(row["members"])
        members = tuple(dataclasses.replace(m, params=dataclasses.replace(m.params, image=images[m.name]))
                        for m in saved.members)
        return row["id"], dataclasses.replace(
            saved, members=members, source=None, labels={**saved.labels, **params.labels},
            deadline=params.deadline if params.deadline is not None else saved.deadline,
            detached=params.detached or saved.detached, network=saved.network if params.network == "none"
            else params.network)

    # -- the bring-up hook ----------------------------------------------------------------------

    def hook(self, row: Any) -> Callable[[Handle], Awaitable[None]] | None:
        """What joins a member to its group's hub as it comes up (None for a sandbox in no group)."""
        if row is None or not row["group_id"]:
            return None
        group_id, name = row["group_id"], row["member"]
        addresses = json.loads(self._row(group_id)["addresses"])
        index = list(addresses).index(name)
        pin, backend, sandbox_id = self._pin(group_id), self.life.backend, row["id"]

        async def join(handle: Handle) -> None:
            await asyncio.to_thread(_join, pin, backend.root(sandbox_id), backend.as_root(sandbox_id),
                                    handle.pid or 0, index, addresses)

        return join

    def addresses(self, row: Any) -> tuple[str, ...]:
        """A member's own address on its group's network (none for a sandbox in no group)."""
        if row is None or not row["group_id"]:
            return ()
        names = list(json.loads(self._row(row["group_id"])["addresses"]))
        return (groupnet.restore_address(names.index(row["member"])),)

    def env(self, row: Any, extra: dict[str, str]) -> dict[str, str]:
        """The proxy's ``no_proxy`` widened to the group's names and subnet, so members talk directly."""
        if row is None or not row["group_id"] or "no_proxy" not in extra:
            return {}
        names = ",".join(json.loads(self._row(row["group_id"])["addresses"]))
        value = f"{extra['no_proxy']},{names},{groupnet.SUBNET}"
        return {"no_proxy": value, "NO_PROXY": value}

    # -- snapshot and fork ------------------------------------------------------------------------

    async def snapshot(self, group_id: str, *, memory: bool = False, name: str | None = None,
                       tenant: str | None = None) -> GroupSnapshotInfo:
        """A snapshot of every member at once, kept as one: ``create_group(source=...)`` starts a copy."""
        if not isinstance(memory, bool):
            raise InvalidRequest(f"memory must be True or False, got {memory!r}")
        row = self._row(group_id, tenant)
        name = check_name(name)
        if name is not None and self.db.conn.execute("SELECT 1 FROM group_snapshots WHERE name = ? AND tenant = ?",
                                                     (name, row["tenant"])).fetchone():
            raise InvalidRequest(f"a group snapshot named {name!r} exists already: pick another name")
        members = self._whole(row)
        async with self._held(group_id, memory):
            made = await asyncio.gather(*(self._snapshot(sandbox_id, memory=memory) for sandbox_id in members.values()),
                                        return_exceptions=True)
        failed = [item for item in made if isinstance(item, BaseException)]
        if failed:  # the members' snapshots taken go again: none of them is a group snapshot's
            await self.life.collect({item.id for item in made if not isinstance(item, BaseException)})
            raise failed[0]
        snapshot_id = ids.new_id(ids.GROUP_SNAPSHOT, self.life.config.node_tag)
        taken = {member: snap.id for member, snap in zip(members, made)}
        now = dbmod.now()
        self.db.conn.execute(
            "INSERT INTO group_snapshots (id, tenant, group_id, name, members, params, memory, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (snapshot_id, row["tenant"], group_id, name, json.dumps(taken), row["params"], int(memory), now))
        return GroupSnapshotInfo(id=snapshot_id, group_id=group_id, members=taken, memory=memory, created_at=now,
                                 name=name)

    @asynccontextmanager
    async def _held(self, group_id: str, hold: bool = True) -> AsyncIterator[None]:
        """No traffic between the members inside: their memory checkpoints, taken one by one, then hold
        both ends of each connection between them at the same point, and a copy's connections go on."""
        if not hold:
            yield
            return
        async with self._holds.setdefault(group_id, asyncio.Lock()):  # one checkpointing of a group at a time
            await asyncio.to_thread(groupnet.hold_traffic, self._pin(group_id), True)
            try:
                yield
            finally:
                try:
                    await asyncio.to_thread(groupnet.hold_traffic, self._pin(group_id), False)
                except FanfoldError as err:  # the group went meanwhile: the error that matters is the caller's
                    log.warning("fanfold: letting group %s's traffic go again failed: %s", group_id, err)

    def _whole(self, row: Any) -> dict[str, str]:
        """A running group's members, all of them (a group with one gone is snapshotted or forked no more)."""
        if row["state"] != "running":
            raise InvalidRequest(f"group {row['id']} is {row['state']}: only a running group is snapshotted or forked")
        members = self.members(row["id"])
        names = [member.name for member in params_from_wire(json.loads(row["params"])).members]
        missing = [name for name in names if name not in members]
        if missing:
            raise InvalidRequest(f"group {row['id']} has lost members {missing} (killed on their own): it can no"
                                 " longer be snapshotted or forked whole; start a new group")
        return {name: members[name] for name in names}

    def snapshots(self, tenant: str | None = None) -> list[GroupSnapshotInfo]:
        rows = self.db.conn.execute("SELECT * FROM group_snapshots ORDER BY created_at").fetchall()
        return [GroupSnapshotInfo(id=r["id"], group_id=r["group_id"], members=json.loads(r["members"]),
                                  memory=bool(r["memory"]), created_at=r["created_at"], name=r["name"])
                for r in rows if tenant is None or r["tenant"] == tenant]

    async def fork(self, group_id: str, count: int, *, tenant: str | None = None,
                   lease: str | None = None) -> list[GroupInfo]:
        """``count`` live copies of the whole group, each on a private network of its own with the
        members' names and addresses; every member pauses only while its memory is dumped."""
        row = self._row(group_id, tenant)
        params = params_from_wire(json.loads(row["params"]))
        members = self._whole(row)
        copies = []
        now = dbmod.now()
        try:
            for _ in range(count):
                copy_id = ids.new_id(ids.GROUP, self.life.config.node_tag, self.life.shard)
                self.db.conn.execute(
                    "INSERT INTO groups (id, tenant, state, params, addresses, created_at, deadline_at, source,"
                    " claimed_by) VALUES (?, ?, 'creating', ?, ?, ?, ?, ?, ?)",
                    (copy_id, row["tenant"], row["params"], row["addresses"], now, row["deadline_at"], group_id,
                     self.life.claimer))
                copies.append(copy_id)
                await asyncio.to_thread(groupnet.make_hub, self._pin(copy_id))
            async with self._held(group_id):
                await _all(self._fork(sandbox_id, count, groups=[(copy, name) for copy in copies])
                           for name, sandbox_id in members.items())
            for copy_id in copies:
                ports = {}
                for member in params.members:
                    if member.ports and member.name in members:
                        child = self.members(copy_id)[member.name]
                        ports[member.name] = {port: await self._expose(child, port) for port in member.ports}
                self.db.conn.execute("UPDATE groups SET state = 'running', ports = ? WHERE id = ?",
                                     (json.dumps(ports), copy_id))
        except BaseException:
            await asyncio.shield(asyncio.gather(*(self.destroy(c) for c in copies), return_exceptions=True))
            raise
        return [self.info(copy_id) for copy_id in copies]

    # -- release --------------------------------------------------------------------------------

    async def kill(self, group_id: str, *, tenant: str | None = None) -> None:
        self._row(group_id, tenant)
        await self.destroy(group_id)

    async def destroy(self, group_id: str) -> None:
        """Destroy every member, then the hub and the row; once, whoever asks."""
        task = self._ending.get(group_id)
        if task is None:
            task = asyncio.ensure_future(self._release(group_id))
            self._ending[group_id] = task
            task.add_done_callback(lambda _: self._ending.pop(group_id, None))
        await asyncio.shield(task)

    async def _release(self, group_id: str) -> None:
        self._holds.pop(group_id, None)
        self.db.conn.execute("UPDATE groups SET state = 'destroying', claimed_by = ? WHERE id = ?",
                             (self.life.claimer, group_id))
        await asyncio.gather(*(self.life.destroy(s) for s in self.members(group_id).values()), return_exceptions=True)
        await asyncio.to_thread(groupnet.release_hub, self._pin(group_id))
        self.db.conn.execute("DELETE FROM groups WHERE id = ?", (group_id,))

    async def member_gone(self, group_id: str) -> None:
        """A member was destroyed: the group goes with its last one (unless it is still being made)."""
        row = self.db.conn.execute("SELECT state FROM groups WHERE id = ?", (group_id,)).fetchone()
        if row is not None and row["state"] == "running" and not self.members(group_id):
            await self.destroy(group_id)

    async def reconcile(self) -> int:
        """At start: release each group of this engine's with no member left, and pins no group owns."""
        rows = self.db.conn.execute("SELECT id, state, claimed_by FROM groups").fetchall()
        # with no member left, or left half made or half destroyed by an engine that died
        gone = [row["id"] for row in rows if self._mine(row["id"]) and (
            not self.members(row["id"]) and row["state"] == "running"
            or row["state"] != "running" and not process_alive(row["claimed_by"]))]
        for group_id in gone:
            await self.destroy(group_id)
        known = {row["id"] for row in self.db.conn.execute("SELECT id FROM groups").fetchall()}
        pins = self.life.config.state_dir / "groups"
        for pin in pins.glob("*.net") if pins.is_dir() else ():
            if pin.stem not in known and self._mine(pin.stem):
                await asyncio.to_thread(groupnet.release_hub, pin)
        return len(gone)

    async def delete_snapshot(self, snapshot_id: str, *, tenant: str | None = None) -> None:
        rows = self.db.conn.execute("SELECT * FROM group_snapshots WHERE id = ? OR name = ?",
                                    (snapshot_id, snapshot_id)).fetchall()
        # an id is anyone's (the host's tenant sees all); a name is each tenant's own ("" the host's)
        row = next((r for r in rows if r["id"] == snapshot_id and (tenant is None or r["tenant"] == tenant)), None) \
            or next((r for r in rows if r["tenant"] == (tenant or "")), None)
        if row is None:
            raise GroupNotFound(f"no group snapshot {snapshot_id!r}")
        self.db.conn.execute("DELETE FROM group_snapshots WHERE id = ?", (row["id"],))


def _join(pin: Path, rootfs: Path, as_root: AbstractContextManager[None], pid: int, index: int,
          addresses: dict[str, str]) -> None:
    """Name every member in the sandbox's /etc/hosts (as its own root: the image owns /etc), then join."""
    root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with as_root:
            try:
                existing = safefs.read(root, "/etc/hosts").decode(errors="replace")
            except FanfoldError:
                existing = ""
            safefs.write(root, "/etc/hosts", groupnet.hosts_file(existing, addresses).encode())
    finally:
        os.close(root)
    groupnet.join(pin, pid, index)


async def _all(calls: Any) -> list[Any]:
    """Run ``calls`` at once; on a failure, wait for the rest and raise the first error."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)

