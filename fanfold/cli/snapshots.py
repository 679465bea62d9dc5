"""Snapshot commands: ``snapshot``, ``fork``, ``snapshots``, ``rm-snapshot`` and ``gc``."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import click

from .common import _fleet, _size, _stdout_console, console

if TYPE_CHECKING:
    from rich.tree import Tree

    from ..models import ExecResult, SnapshotInfo


@click.command()
@click.argument("sandbox_id", metavar="SANDBOX")
@click.option("--memory", is_flag=True, help="Also checkpoint the running processes (CRIU), not only the disk.")
@click.option("--name", default=None, help="Name it: gc keeps it, and --image takes the name. Letters, digits, _.- "
                                          "(up to 128, not starting with snap-).")
@click.option("--json", "as_json", is_flag=True, help="Print the snapshot as JSON.")
@click.pass_context
def snapshot(ctx: click.Context, sandbox_id: str, memory: bool, name: str | None, as_json: bool) -> None:
    """Snapshot SANDBOX (it runs on); print the snapshot's id.

    Start sandboxes from it with `fanfold create --image ID` (or its name).
    """
    with _fleet(ctx) as fleet:
        taken = fleet.get(sandbox_id).snapshot(memory=memory, name=name)
    click.echo(json.dumps(taken.to_dict()) if as_json else taken.id)


@click.command()
@click.argument("sandbox_id", metavar="SANDBOX")
@click.option("-n", "--count", type=click.IntRange(min=1), default=1, show_default=True,
              help="How many children (the engine caps it, and says so).")
@click.option("--cmd", default=None, help="Shell command to run in each child once it is restored (e.g. to reseed).")
@click.pass_context
def fork(ctx: click.Context, sandbox_id: str, count: int, cmd: str | None) -> None:
    """Fork running SANDBOX, memory and processes included; print the children's ids, one a line.

    The parent is frozen only while it is checkpointed; how long goes to stderr, with each
    child's --cmd output, every line labelled with the child's id. Exit 1 when --cmd failed
    in any child (the children stay). Children live as their parent does: those of a
    `fanfold create` sandbox outlive this command.
    """
    with _fleet(ctx) as fleet:
        made = fleet.get(sandbox_id).fork(count, cmd=cmd)
    for child in made.children:
        click.echo(child.id)
    console.print(f"parent paused {made.result.parent_pause_ms:.1f} ms; {count} children in "
                  f"{made.result.total_ms:.0f} ms", highlight=False)
    for child, result in zip(made.children, made.result.setup):
        _show_setup(child.id, result)
    sys.exit(0 if all(result.ok for result in made.result.setup) else 1)


def _show_setup(child_id: str, result: ExecResult) -> None:
    """A child's --cmd output on stderr, each line labelled `ID stdout:` or `ID stderr:`, then its status if it failed."""
    for stream, data in (("stdout", result.stdout), ("stderr", result.stderr)):
        for line in data.decode("utf-8", "replace").splitlines():
            click.echo(f"{child_id} {stream}: {line}", err=True)
    if not result.ok:
        status = f"exit code {result.exit_code}" if result.outcome.value == "exited" else result.outcome.value
        click.echo(f"{child_id}: --cmd failed ({status})", err=True)


@click.command()
@click.option("--tree", is_flag=True, help="Show the lineage: images at the roots, each snapshot below its parent.")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of snapshots.")
@click.pass_context
def snapshots(ctx: click.Context, tree: bool, as_json: bool) -> None:
    """List snapshots."""
    with _fleet(ctx) as fleet:
        found = sorted(fleet.snapshots(), key=lambda s: s.created_at)
    if as_json:
        click.echo(json.dumps([s.to_dict() for s in found]))
        return
    from rich.table import Column, Table

    if tree:
        _stdout_console().print(_lineage(found))
        return
    # Whole ids, for copying, in 80 columns; the sandbox each was taken from is in --tree and --json.
    table = Table(Column("ID", no_wrap=True), Column("NAME", overflow="fold"), Column("PARENT", no_wrap=True), "KIND",
                  "MEM", Column("SIZE", no_wrap=True, justify="right"), box=None, pad_edge=False)
    for s in found:
        table.add_row(s.id, s.name or "", s.parent, s.kind, "yes" if s.memory else "no", _size(s.size_bytes))
    _stdout_console().print(table)


def _lineage(found: list[SnapshotInfo]) -> Tree:
    """Snapshots below their parents; a parent that is not a listed snapshot is an image, at a root."""
    from rich.tree import Tree

    top = Tree("[bold]snapshots[/bold]", hide_root=True)
    nodes: dict[str, Tree] = {}
    for s in found:  # oldest first, so a parent is placed before its children
        parent = nodes.get(s.parent)
        if parent is None:
            parent = nodes[s.parent] = top.add(f"[bold]{s.parent}[/bold]")
        label = f"{s.id}" + (f" [cyan]{s.name}[/cyan]" if s.name else "")
        label += f" [dim]{s.kind}{', memory' if s.memory else ''}, {_size(s.size_bytes)}, from {s.sandbox_id}[/dim]"
        nodes[s.id] = parent.add(label)
    return top


@click.command(name="rm-snapshot")
@click.argument("snapshot_ids", metavar="SNAPSHOT...", nargs=-1, required=True)
@click.pass_context
def rm_snapshot(ctx: click.Context, snapshot_ids: tuple[str, ...]) -> None:
    """Delete snapshots by id or name; one still in use by sandboxes or later snapshots is refused."""
    with _fleet(ctx) as fleet:
        for snapshot_id in snapshot_ids:
            fleet.delete_snapshot(snapshot_id)
            click.echo(snapshot_id)


@click.command()
@click.pass_context
def gc(ctx: click.Context) -> None:
    """Delete unnamed snapshots no sandbox or later snapshot needs, and layers no image, snapshot or
    sandbox uses; print what went."""
    with _fleet(ctx) as fleet:
        removed = fleet.gc()
    for item in removed:
        click.echo(item)
    layers = sum(1 for item in removed if item.startswith("layer:"))
    snapshots = len(removed) - layers
    console.print(f"removed {snapshots} snapshot{'' if snapshots == 1 else 's'} and {layers}"
                  f" layer{'' if layers == 1 else 's'}", highlight=False)


COMMANDS = (snapshot, fork, snapshots, rm_snapshot, gc)
