"""Group commands: ``fanfold group create|ls|rm|fork|snapshot|start|rm-snapshot``: sandboxes on a private network of their own."""

from __future__ import annotations

import json

import click

from .common import _fleet, _pairs, _stdout_console
from .netopts import network_options


@click.group()
def group() -> None:
    """Sandbox groups on a private network of their own: create, ls, rm, fork, snapshot, start, rm-snapshot.

    Members reach each other by name. `fanfold compose up` makes a group from a compose file; `group create`
    from member names and images.
    """


@group.command()
@click.argument("members", metavar="NAME=IMAGE...", nargs=-1, required=True)
@click.option("--after", "after", multiple=True, metavar="NAME:FIRST",
              help="Start member NAME once member FIRST is up (repeatable).")
@click.option("--memory-mb", type=click.IntRange(min=16), default=512, show_default=True, help="Each member's memory.")
@click.option("--deadline", type=float, default=None, metavar="SECONDS", help="The whole group's hard lifetime.")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="Label of the group and its members.")
@network_options
@click.option("--json", "as_json", is_flag=True, help="Print the group as JSON.")
@click.pass_context
def create(ctx: click.Context, members: tuple[str, ...], after: tuple[str, ...], memory_mb: int,
           deadline: float | None, labels: tuple[str, ...], network: object, as_json: bool) -> None:
    """Create a group that outlives this command: one member per NAME=IMAGE (IMAGE: a base, image or
    snapshot); print its id. Members reach each other as NAME; --network is every member's way out."""
    from ..groups import GroupMember
    from ..models import CreateParams, Limits

    firsts: dict[str, list[str]] = {}
    for item in after:
        name, sep, first = item.partition(":")
        if not sep or not name or not first:
            raise click.UsageError(f"--after {item!r} is not NAME:FIRST")
        firsts.setdefault(name, []).append(first)
    made = []
    for item in members:
        name, sep, image = item.partition("=")
        if not sep or not name or not image:
            raise click.UsageError(f"member {item!r} is not NAME=IMAGE")
        made.append(GroupMember(name=name, params=CreateParams(image=image, limits=Limits(memory_mb=memory_mb)),
                                after=tuple(firsts.pop(name, ()))))
    if firsts:
        raise click.UsageError(f"--after names members not given: {', '.join(sorted(firsts))}")
    with _fleet(ctx) as fleet:
        made_group = fleet.create_group(made, network=network or "none", labels=_pairs(labels, "--label"),
                                        deadline=deadline, detached=True)
    click.echo(json.dumps(made_group.info.to_dict()) if as_json else made_group.id)


@group.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of groups.")
@click.pass_context
def ls(ctx: click.Context, as_json: bool) -> None:
    """List groups: id, state, and each member's name, address and sandbox."""
    with _fleet(ctx) as fleet:
        found = fleet.groups()
    if as_json:
        click.echo(json.dumps([info.to_dict() for info in found]))
        return
    from rich.table import Table

    table = Table("GROUP", "STATE", "MEMBERS", box=None)
    for info in found:
        members = ", ".join(f"{name} {info.addresses[name]} {sandbox_id}" for name, sandbox_id in info.members.items())
        table.add_row(info.id, info.state, members)
    _stdout_console().print(table)


@group.command()
@click.argument("group_ids", metavar="GROUP...", nargs=-1, required=True)
@click.pass_context
def rm(ctx: click.Context, group_ids: tuple[str, ...]) -> None:
    """Destroy groups: every member and the group's network."""
    with _fleet(ctx) as fleet:
        for group_id in group_ids:
            fleet.group(group_id).kill()
            click.echo(group_id)


@group.command()
@click.argument("group_id", metavar="GROUP")
@click.option("-n", "--count", type=click.IntRange(min=1), default=1, show_default=True, help="How many copies.")
@click.pass_context
def fork(ctx: click.Context, group_id: str, count: int) -> None:
    """Fork running GROUP whole (memory and processes), each copy on a network of its own; print the copies' ids."""
    with _fleet(ctx) as fleet:
        for copy in fleet.group(group_id).fork(count):
            click.echo(copy.id)


@group.command()
@click.argument("group_id", metavar="GROUP")
@click.option("--memory", is_flag=True, help="Also checkpoint every member's processes, not only the disks.")
@click.option("--name", default=None, help="Name it: `group start NAME` and the SDK's source= take the name.")
@click.pass_context
def snapshot(ctx: click.Context, group_id: str, memory: bool, name: str | None) -> None:
    """Snapshot every member of GROUP as one group snapshot; print its id."""
    with _fleet(ctx) as fleet:
        click.echo(fleet.group(group_id).snapshot(memory=memory, name=name).id)


@group.command()
@click.argument("snapshot", metavar="SNAPSHOT")
@click.pass_context
def start(ctx: click.Context, snapshot: str) -> None:
    """Start a copy of a snapshotted group from SNAPSHOT (its id or name); print the new group's id."""
    with _fleet(ctx) as fleet:
        click.echo(fleet.create_group(source=snapshot, detached=True).id)


@group.command(name="rm-snapshot")
@click.argument("snapshots", metavar="SNAPSHOT...", nargs=-1, required=True)
@click.pass_context
def rm_snapshot(ctx: click.Context, snapshots: tuple[str, ...]) -> None:
    """Forget group snapshots (their members' snapshots go with `fanfold gc` once nothing needs them)."""
    with _fleet(ctx) as fleet:
        for snapshot in snapshots:
            fleet.delete_group_snapshot(snapshot)
            click.echo(snapshot)
