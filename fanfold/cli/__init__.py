"""The ``fanfold`` command line: the top-level group and where each command lives.

Heavy imports (the engine, the HTTP client, rich, the RL layer) happen inside the commands that
need them: every call pays Python's start-up, and ``--help`` should pay little more.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import click

from ..errors import FanfoldError
from . import build, sandboxes, server, snapshots
from .common import _error


class _LazyCommand(click.Command):
    """Stands in for a command of another module in `fanfold --help`, so listing it imports nothing."""

    def __init__(self, name: str, target: str, short_help: str) -> None:
        super().__init__(name, short_help=short_help)
        self.target = target

    def load(self) -> click.Command:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


class FanfoldGroup(click.Group):
    """Turns fanfold's errors into one clear line and exit status 2, never a traceback;
    Ctrl-C into exit status 130 once the command has been cancelled and cleaned up."""

    lazy = {
        "traj": _LazyCommand("traj", "fanfold.cli.traj:traj",
                             "Trajectories of RL rollouts: list, show, export, dedupe, expire."),
        "pull": _LazyCommand("pull", "fanfold.cli.images:pull",
                             "Pull image REF from its registry (python:3.12-slim, host:5000/env@sha256:...); print its id."),
        "import": _LazyCommand("import", "fanfold.cli.images:import_", "Import an image from PATH: a `docker save`"
                               " tarball, an OCI archive or an OCI layout directory."),
        "images": _LazyCommand("images", "fanfold.cli.images:images",
                               "List images: their names, where they came from, layers and size on disk."),
        "rmi": _LazyCommand("rmi", "fanfold.cli.images:rmi",
                            "Remove images by id or name; `fanfold gc` then frees layers nothing uses."),
        "login": _LazyCommand("login", "fanfold.cli.images:login", "Log in to REGISTRY (host[:port]); pulls then use"
                              " the credentials, kept in the state dir (mode 0600)."),
        "logout": _LazyCommand("logout", "fanfold.cli.images:logout", "Forget the credentials kept for REGISTRY."),
        "network": _LazyCommand("network", "fanfold.cli.network:network", "Show a sandbox's network policy and"
                                " traffic through the proxy; change the policy (--allow, --deny, --network)."),
        "recordings": _LazyCommand("recordings", "fanfold.cli.network:recordings", "List network recordings (made"
                                   " with network={\"record\": NAME}); --rm deletes some."),
        "port": _LazyCommand("port", "fanfold.cli.network:port", "Reach a port inside a sandbox from the host: print"
                             " its URL (embedded: forward it until Ctrl-C)."),
        "group": _LazyCommand("group", "fanfold.cli.groups:group", "Sandbox groups on a private network of their"
                              " own: create, ls, rm, fork, snapshot, start, rm-snapshot."),
        "ssh": _LazyCommand("ssh", "fanfold.cli.ssh:ssh", "Log in to SANDBOX over fanfold's own channel, or start"
                            " a real sshd in it (--sshd)."),
        "compose": _LazyCommand("compose", "fanfold.cli.compose:compose", "Compose files as sandbox groups: up,"
                                " down, ps (each service a sandbox, reached by its name)."),
        "ray": _LazyCommand("ray", "fanfold.cli.ray:ray", "fanfold on a Ray cluster: start, status, stop, metrics"
                            " (a `fanfold serve` on every node)."),
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return self.lazy.get(name) or super().get_command(ctx, name)

    def resolve_command(self, ctx: click.Context, args: list[str]):  # type: ignore[no-untyped-def]
        name, command, rest = super().resolve_command(ctx, args)
        if isinstance(command, _LazyCommand):
            command = command.load()
        return name, command, rest

    def invoke(self, ctx: click.Context):  # type: ignore[no-untyped-def]
        try:
            return super().invoke(ctx)
        except FanfoldError as err:
            _error(f"{type(err).__name__}: {err}")
            sys.exit(2)
        except KeyboardInterrupt:  # the `with` blocks on the way here killed the command and its sandbox
            sys.exit(130)


@click.group(cls=FanfoldGroup)
@click.option("--state-dir", envvar="FANFOLD_STATE_DIR", default="/var/lib/fanfold", show_default=True,
              help="Where layers, images and sandboxes live.")
@click.option("--runtime", envvar="FANFOLD_RUNTIME", default="crun", show_default=True,
              type=click.Choice(["crun", "runc", "runsc"]),
              help="OCI runtime of the oci backend; runsc is gVisor: stronger isolation, slower (docs/security.md).")
@click.option("--backend", envvar="FANFOLD_BACKEND", default="oci", show_default=True, metavar="NAME",
              help="Isolation backend: oci (root; crun or runc), fake (no root and no isolation: for tests of engine"
                   " logic), or a 'module:Class' path.")
@click.option("--url", envvar="FANFOLD_URL", default=None, metavar="URL",
              help="Use a `fanfold serve` server (unix:///run/fanfold.sock, http://host:port) instead of an embedded engine.")
@click.option("--token", envvar="FANFOLD_TOKEN", default=None, help="Bearer token for --url.")
@click.version_option(package_name="fanfold")
@click.pass_context
def main(ctx: click.Context, state_dir: str, runtime: str, backend: str, url: str | None, token: str | None) -> None:
    """fanfold: isolated sandboxes for RL rollouts, built from golden environments."""
    ctx.obj = {"state_dir": Path(state_dir), "runtime": runtime, "backend": backend, "url": url, "token": token}


for _module in (build, sandboxes, snapshots, server):
    for _command in _module.COMMANDS:
        main.add_command(_command)
