"""Plain data of sandbox groups: sandboxes that share a private network and live and die as one.

A group's members reach each other by name (each member's /etc/hosts lists every member's
address on the group's own network); nothing outside the group reaches that network, and each
member's traffic out of it goes through the host's filtering proxy under the group's policy.
A group is created, leased, snapshotted, forked and destroyed as one, on one host.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .errors import InvalidRequest
from .models import DAY_S, CreateParams, Limits, bounds, check_bounds

MAX_MEMBERS = 32
"""The most members one group has."""
MEMBER_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
"""A member's name is a DNS label: what the others call it by."""


@dataclass(frozen=True, kw_only=True)
class HealthCheck:
    """A command run in a member until it exits 0: the member is healthy from then on."""

    cmd: str | list[str]
    """Run as an exec (a string through ``sh -c``)."""
    interval: float = field(default=0.5, metadata=bounds(gt=0, le=3600))
    """Seconds between tries."""
    timeout: float = field(default=30.0, metadata=bounds(gt=0, le=3600))
    """Seconds one try may take."""
    retries: int = field(default=60, metadata=bounds(ge=1, le=100_000))
    """Failed tries (after ``start_period``) before the group's create fails."""
    start_period: float = field(default=0.0, metadata=bounds(ge=0, le=3600))
    """Seconds after the member starts during which failed tries do not count."""

    def __post_init__(self) -> None:
        check_bounds(self, "health.")
        if not (isinstance(self.cmd, str) and self.cmd.strip() or isinstance(self.cmd, list) and self.cmd
                and all(isinstance(word, str) for word in self.cmd)):
            raise InvalidRequest(f"a health check needs a command: a shell string or a list of words, got {self.cmd!r}")


@dataclass(frozen=True, kw_only=True)
class GroupMember:
    """One sandbox of a group: its name on the group's network and how it is made."""

    name: str
    """A DNS label (``db``, ``agent-0``): the other members reach it by this name."""
    params: CreateParams = field(default_factory=CreateParams)
    """How the sandbox is made (image, limits, env, user, seccomp); its ``network`` must be left
    ``"none"``: the group's policy applies to every member."""
    after: tuple[str, ...] = ()
    """Members that must be up (and healthy, where they have a health check) before this one starts."""
    health: HealthCheck | None = None
    """When given, the group is ready only once this member passes it."""
    ports: tuple[int, ...] = ()
    """Ports exposed on the host (``expose``) once the group is up."""
    volumes: dict[str, str] = field(default_factory=dict)
    """A group volume's name -> where it is mounted in this member (every member naming it shares it)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not MEMBER_NAME.match(self.name):
            raise InvalidRequest(f"bad member name {self.name!r}: lower-case letters, digits and '-', at most 63")
        if not isinstance(self.params, CreateParams):
            raise InvalidRequest(f"member {self.name!r}: params must be a fanfold.CreateParams")
        if self.params.network != "none":
            raise InvalidRequest(f"member {self.name!r} names its own network: a group's network policy is the"
                                 " group's (create_group(..., network=...))")
        if isinstance(self.after, str) or not isinstance(self.volumes, dict):
            raise InvalidRequest(f"member {self.name!r}: after is a list of member names, volumes a name -> path map")
        object.__setattr__(self, "after", tuple(self.after))
        object.__setattr__(self, "ports", tuple(self.ports))
        for port in self.ports:
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise InvalidRequest(f"member {self.name!r}: a port is a whole number from 1 to 65535, got {port!r}")
        for volume, path in self.volumes.items():
            if not MEMBER_NAME.match(volume) or not isinstance(path, str) or not path.startswith("/") or path == "/":
                raise InvalidRequest(f"member {self.name!r}: volume {volume!r} at {path!r}: a volume is a DNS-label"
                                     " name mounted at an absolute path other than /")


@dataclass(frozen=True, kw_only=True)
class GroupParams:
    """What a group's create asks for."""

    members: tuple[GroupMember, ...] = ()
    """Its sandboxes, started in an order that honours each one's ``after``."""
    source: str | None = None
    """A group snapshot's id or name to start from instead of ``members`` (each member from its snapshot)."""
    network: Any = "none"
    """The egress policy of every member (as ``CreateParams.network``); members always reach each other."""
    labels: dict[str, str] = field(default_factory=dict)
    """Free-form tags, on the group and every member."""
    deadline: float | None = field(default=None, metadata=bounds(gt=0, le=365 * DAY_S))
    """Hard lifetime in seconds of the whole group."""
    detached: bool = False
    """Outlive the creating client (until killed or its deadline)."""

    def __post_init__(self) -> None:
        check_bounds(self)
        if not isinstance(self.labels, dict) or not isinstance(self.detached, bool):
            raise InvalidRequest("a group's labels are a name -> value map and detached is true or false")
        if self.source is not None and not isinstance(self.source, str):
            raise InvalidRequest(f"source is a group snapshot's id or name, got {self.source!r}")
        object.__setattr__(self, "members", tuple(self.members))
        if self.source is None and not self.members:
            raise InvalidRequest("a group needs members (or a group snapshot as its source)")
        if self.source is not None and self.members:
            raise InvalidRequest("a group comes from members or from a group snapshot, not both")
        if len(self.members) > MAX_MEMBERS:
            raise InvalidRequest(f"a group has at most {MAX_MEMBERS} members, got {len(self.members)}")
        names = [member.name for member in self.members]
        if len(set(names)) != len(names):
            raise InvalidRequest(f"member names must differ: {sorted(n for n in names if names.count(n) > 1)}")
        for member in self.members:
            unknown = [name for name in member.after if name not in names]
            if unknown:
                raise InvalidRequest(f"member {member.name!r} comes after unknown members {unknown}")
        start_order(self.members)  # refuses a cycle

    def with_members(self, members: tuple[GroupMember, ...]) -> GroupParams:
        return replace(self, members=members, source=None)


def start_order(members: tuple[GroupMember, ...]) -> list[list[GroupMember]]:
    """The members in waves: each wave's members start together, after every earlier wave is up."""
    left = {member.name: member for member in members}
    done: set[str] = set()
    waves = []
    while left:
        wave = [member for member in left.values() if set(member.after) <= done]
        if not wave:
            raise InvalidRequest(f"members {sorted(left)} wait on each other in a cycle: break it in their 'after'")
        waves.append(wave)
        for member in wave:
            done.add(member.name)
            del left[member.name]
    return waves


@dataclass(frozen=True, kw_only=True)
class GroupInfo:
    """What the engine knows of one group."""

    id: str
    members: dict[str, str]
    """Member name -> sandbox id."""
    addresses: dict[str, str]
    """Member name -> its address on the group's network."""
    state: str = "running"
    """``creating``, ``running`` or ``destroying``."""
    network: Any = "none"
    labels: dict[str, str] = field(default_factory=dict)
    created_at: float = 0.0
    deadline_at: float | None = None
    source: str = ""
    """The group snapshot it was made from, if any."""
    ports: dict[str, dict[int, str]] = field(default_factory=dict)
    """Member name -> port -> the host address it is exposed at."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class GroupSnapshotInfo:
    """An immutable checkpoint of a whole group: one snapshot per member, and how they were joined."""

    id: str
    group_id: str
    members: dict[str, str]
    """Member name -> the member's snapshot id."""
    memory: bool
    created_at: float
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def params_to_wire(params: GroupParams) -> dict[str, Any]:
    """GroupParams as JSON-ready data (``params_from_wire`` reads it back); a policy object in its wire form."""
    data = asdict(params)
    if hasattr(params.network, "to_wire"):  # a fanfold.net.policy.NetworkPolicy
        data["network"] = params.network.to_wire()
    return data


def params_from_wire(data: Any) -> GroupParams:
    """GroupParams from JSON data (a request body, a row); InvalidRequest names what is wrong."""
    if not isinstance(data, dict):
        raise InvalidRequest(f"a group's params are an object, got {type(data).__name__}")
    try:
        members = []
        for item in data.get("members") or ():
            if not isinstance(item, dict):
                raise InvalidRequest(f"a group member is an object (name, params, ...), got {item!r}")
            item = dict(item)
            create = dict(item.pop("params", None) or {})
            limits = create.pop("limits", None)
            health = item.pop("health", None)
            members.append(GroupMember(
                **item, params=CreateParams(**create, limits=None if limits is None else Limits(**limits)),
                health=None if health is None else HealthCheck(**health)))
        rest = {key: value for key, value in data.items() if key != "members"}
        return GroupParams(members=tuple(members), **rest)
    except (TypeError, ValueError, AttributeError) as err:
        raise InvalidRequest(f"bad group params: {err}") from None


def info_to_wire(info: GroupInfo) -> dict[str, Any]:
    return info.to_dict()


def info_from_wire(data: dict[str, Any]) -> GroupInfo:
    ports = {name: {int(port): url for port, url in urls.items()} for name, urls in data.get("ports", {}).items()}
    return GroupInfo(**{**data, "ports": ports})


def snapshot_to_wire(info: GroupSnapshotInfo) -> dict[str, Any]:
    return info.to_dict()


def snapshot_from_wire(data: dict[str, Any]) -> GroupSnapshotInfo:
    return GroupSnapshotInfo(**data)
