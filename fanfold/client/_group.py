"""Sandbox groups in the SDK: ``AsyncGroup`` (its sync twin ``Group`` is in ``_sync``; see ``fanfold.groups``)."""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from ..errors import InvalidRequest
from ..groups import GroupInfo, GroupMember, GroupParams, GroupSnapshotInfo


def group_params(members: Sequence[GroupMember] | GroupParams | None, source: Any, network: Any,
                 labels: dict[str, str] | None, deadline: float | None, detached: bool) -> GroupParams:
    """What ``create_group``'s arguments ask for: members (or whole GroupParams), or a group snapshot."""
    if isinstance(members, GroupParams):
        return members
    if source is not None and not isinstance(source, str):
        source = getattr(source, "id", source)  # a GroupSnapshotInfo
    if members is not None and (isinstance(members, (str, bytes)) or
                                not all(isinstance(m, GroupMember) for m in members)):
        raise InvalidRequest("create_group takes a list of fanfold.GroupMember (or a GroupParams)")
    return GroupParams(members=tuple(members or ()), source=source, network=network, labels=labels or {},
                       deadline=deadline, detached=detached)


class AsyncGroup:
    """Sandboxes on a private network of their own, reaching each other by member name.
    ``async with`` kills the whole group on exit."""

    def __init__(self, fleet: Any, info: GroupInfo, members: dict[str, Any]) -> None:
        """``fleet``: the AsyncFleet; ``members``: name -> AsyncSandbox (``AsyncFleet.create_group`` makes it)."""
        self._fleet = fleet
        self.info = info
        self.members = members
        """Member name -> its sandbox."""


    @property
    def id(self) -> str:
        return self.info.id

    def __getitem__(self, name: str) -> Any:
        """The member sandbox (an AsyncSandbox) called ``name``."""
        try:
            return self.members[name]
        except KeyError:
            raise KeyError(f"group {self.id} has no member {name!r}: it has {sorted(self.members)}") from None

    def __repr__(self) -> str:
        return f"<AsyncGroup {self.id} {sorted(self.members)}>"

    async def __aenter__(self) -> AsyncGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()

    async def refresh(self) -> GroupInfo:
        """The group as the host knows it now (members gone since drop out)."""
        self.info = await self._fleet._transport.get_group(self.id)
        return self.info

    async def snapshot(self, *, memory: bool = False, name: str | None = None) -> GroupSnapshotInfo:
        """Snapshot every member as one; ``fleet.create_group(source=snap)`` starts a copy of the group."""
        return await self._fleet._transport.snapshot_group(self.id, memory=memory, name=name)

    async def fork(self, count: int) -> list[AsyncGroup]:
        """``count`` live copies of the whole group (processes and memory), each on a private network of
        its own where the members keep their names and addresses."""
        made = await self._fleet._transport.fork_group(self.id, count)
        return list(await asyncio.gather(*(self._fleet._group_of(info) for info in made)))

    async def kill(self) -> None:
        """Destroy every member and the group's network."""
        await self._fleet._transport.kill_group(self.id)
