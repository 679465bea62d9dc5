"""``fanfold compose``: a Compose file's services as a sandbox group (``up``, ``down``, ``ps``)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..errors import FanfoldError, InvalidRequest
from .common import _fleet, _pairs, console
from .netopts import network_options

if TYPE_CHECKING:
    from ..client import Group, Process
    from ..groups import GroupInfo

DEFAULT_FILES = ("compose.yaml", "compose.yml", "docker-compose.yaml", "docker-compose.yml")
"""Looked for in the current directory when no ``-f`` is given, in this order (as ``docker compose`` does)."""

_FILE = click.option("-f", "--file", "path", type=click.Path(dir_okay=False), default=None,
                     help=f"The Compose file (default: the first of {', '.join(DEFAULT_FILES)} here).")
_PROJECT = click.option("-p", "--project-name", "project", default=None,
                        help="The project (default: the Compose file's 'name', else its directory's name).")


@click.group()
def compose() -> None:
    """Compose files as sandbox groups: up, down, ps (each service a sandbox, reached by its name).

    Supported service keys: image, build, environment, command, entrypoint, depends_on, healthcheck,
    ports, volumes (named), working_dir, user; anything else is refused by name. An `image` is a
    fanfold base (host, debian:bookworm), a local image or a reference to pull.
    """


@compose.command()
@_FILE
@click.option("-d", "--detach", is_flag=True,
              help="Leave the group running and print its id; without it, wait for Ctrl-C, then remove the group.")
@click.option("--deadline", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Hard lifetime of the whole group.")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="Label of the group (repeatable).")
@network_options
@click.pass_context
def up(ctx: click.Context, path: str | None, detach: bool, deadline: float | None, labels: tuple[str, ...],
       network: object) -> None:
    """Build each service's image and start the services as one group, in depends_on order.

    A line per service as it builds, then one per member: its sandbox, address on the group's
    network and where each of its ports is exposed on this host; the group's id goes to stdout.
    Without -d each service's log follows on stdout, its lines prefixed with the service's name.
    """
    compose_file = _compose_file(path)
    with _fleet(ctx) as fleet:
        group = fleet.compose_up(compose_file, network=network or "none", labels=_pairs(labels, "--label"),
                                 deadline=deadline, detached=detach, on_progress=_progress)
        try:
            _show_members(group.info)
            click.echo(group.id)
            if detach:
                return
            console.print(f"group {group.id} is up; Ctrl-C stops and removes it", highlight=False)
            _follow(group)
            threading.Event().wait()  # until Ctrl-C: nothing sets it
        finally:
            if not detach:
                group.kill()


@compose.command()
@_FILE
@_PROJECT
@click.pass_context
def down(ctx: click.Context, path: str | None, project: str | None) -> None:
    """Remove the groups a project's `up -d` left; print their ids."""
    with _fleet(ctx) as fleet:
        for group_id in fleet.compose_down(None if project else _compose_file(path), project=project):
            click.echo(group_id)


@compose.command()
@_FILE
@_PROJECT
@click.option("-a", "--all", "every", is_flag=True, help="Every Compose project's groups.")
@click.option("--json", "as_json", is_flag=True, help="Print the groups as JSON, one a line.")
@click.pass_context
def ps(ctx: click.Context, path: str | None, project: str | None, every: bool, as_json: bool) -> None:
    """List a project's members: group, service, sandbox, address and exposed ports."""
    from ..compose import PROJECT_LABEL, load

    if not every and project is None:
        project = load(_compose_file(path)).name
    with _fleet(ctx) as fleet:
        groups = [info for info in fleet.groups() if PROJECT_LABEL in info.labels
                  and (every or info.labels[PROJECT_LABEL] == project)]
    for info in groups:
        if as_json:
            click.echo(json.dumps(info.to_dict()))
            continue
        for service, sandbox_id in info.members.items():
            ports = " ".join(f"{port}->{where}" for port, where in sorted(info.ports.get(service, {}).items()))
            click.echo(f"{info.labels[PROJECT_LABEL]}\t{info.id}\t{service}\t{sandbox_id}\t"
                       f"{info.addresses.get(service, '-')}\t{ports or '-'}")


def _compose_file(path: str | None) -> Path:
    if path is not None:
        return Path(path)
    for name in DEFAULT_FILES:
        if Path(name).is_file():
            return Path(name)
    raise click.UsageError(f"no Compose file here ({', '.join(DEFAULT_FILES)}): give one with -f FILE")


def _progress(service: str, what: str) -> None:
    console.print(f"{service}: {what}" if service else what, highlight=False, soft_wrap=True)


def _follow(group: Group) -> None:
    """Print each member's service log as it grows, as ``docker compose up`` does, until the group goes."""
    width = max(map(len, group.members))
    for name, sandbox in group.members.items():
        try:  # the agent appends a service's output to its log; a member without a service has none, and waits
            process = sandbox.spawn(["tail", "-n", "+1", "-F", f"/var/log/fanfold/{name}.log"], user="root")
        except InvalidRequest as err:  # a fleet that cannot spawn (a multi-worker or Ray one)
            console.print(f"not following the services' logs: {err}", highlight=False)
            return
        threading.Thread(target=_print_lines, args=(name.ljust(width), process), daemon=True).start()


def _print_lines(prefix: str, process: Process) -> None:
    pending = b""
    try:
        for chunk in process.output():
            if chunk.stream == "stdout":
                *lines, pending = (pending + chunk.data).split(b"\n")
                for line in lines:
                    click.echo(f"{prefix} | {line.decode(errors='replace')}")
    except FanfoldError:  # the group went (Ctrl-C): its logs end with it
        return


def _show_members(info: GroupInfo) -> None:
    for service, sandbox_id in info.members.items():
        ports = ", ".join(f"port {port} at {where}" for port, where in sorted(info.ports.get(service, {}).items()))
        console.print(f"{service}: running in {sandbox_id} at {info.addresses.get(service, '?')}"
                      f"{'; ' + ports if ports else ''}", highlight=False, soft_wrap=True)
