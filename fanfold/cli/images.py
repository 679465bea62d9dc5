"""``fanfold pull``, ``import``, ``images`` (``images share``), ``rmi``, ``login`` and ``logout``: images from
registries and files."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn
from rich.table import Column, Table

from .common import _fleet, _size, _stdout_console, console

if TYPE_CHECKING:
    from ..images import Image
    from ..images.oci import OnPull, PullEvent

_STATUS = {"waiting": "waiting", "pulling": "pulling", "done": "[green]done[/green]", "exists": "[dim]exists[/dim]"}


@contextmanager
def _progress(quiet: bool) -> Iterator[OnPull | None]:
    """A bar per layer on a terminal; a line per finished layer otherwise; nothing with --quiet."""
    if quiet:
        yield None
        return
    err = Console(stderr=True)
    if not err.is_terminal:
        def plain(event: PullEvent) -> None:
            if event.status in ("done", "exists"):
                err.print(f"layer {event.index + 1}/{event.total} {event.layer[:19]} {event.status}", highlight=False)
        yield plain
        return
    bars: dict[str, TaskID] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TextColumn("{task.fields[status]}"))
    with Progress(*columns, console=err, transient=False) as progress:
        def show(event: PullEvent) -> None:
            task = bars.get(event.layer)
            if task is None:
                task = bars[event.layer] = progress.add_task(
                    f"{event.index + 1}/{event.total} {event.layer[:19]}", total=event.total_bytes or None, status="")
            done = event.total_bytes if event.status in ("done", "exists") and event.total_bytes else event.done_bytes
            progress.update(task, completed=done, total=event.total_bytes or None, status=_STATUS.get(event.status, ""))
        yield show


def _show(image: Image, as_json: bool) -> None:
    click.echo(image.to_json() if as_json else image.id)


@click.command()
@click.argument("ref")
@click.option("--platform", default=None, metavar="OS/ARCH", help="Take this platform from a multi-arch image"
              " (default: this host's), e.g. linux/arm64.")
@click.option("--quiet", "-q", is_flag=True, help="No progress, only the image id.")
@click.option("--json", "as_json", is_flag=True, help="Print the image as JSON.")
@click.pass_context
def pull(ctx: click.Context, ref: str, platform: str | None, quiet: bool, as_json: bool) -> None:
    """Pull image REF from its registry (python:3.12-slim, host:5000/env@sha256:...); print its id.

    Credentials come from `fanfold login`, or a Docker config.json named by FANFOLD_REGISTRY_AUTH.
    """
    with _fleet(ctx) as fleet, _progress(quiet) as report:
        image = fleet.pull(ref, platform=platform, on_progress=report)
    _show(image, as_json)


@click.command(name="import")
@click.argument("path", type=click.Path(exists=True))
@click.option("--ref", default=None, help="A name for the image, as a reference (default: none; it is known by its id).")
@click.option("--quiet", "-q", is_flag=True, help="No progress, only the image id.")
@click.option("--json", "as_json", is_flag=True, help="Print the image as JSON.")
@click.pass_context
def import_(ctx: click.Context, path: str, ref: str | None, quiet: bool, as_json: bool) -> None:
    """Import an image from PATH: a `docker save` tarball, an OCI archive or an OCI layout directory."""
    with _fleet(ctx) as fleet, _progress(quiet) as report:
        image = fleet.import_image(path, ref=ref, on_progress=report)
    _show(image, as_json)


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the images as JSON lines.")
@click.pass_context
def images(ctx: click.Context, as_json: bool) -> None:
    """List images: their names, where they came from, layers and size on disk.

    `fanfold images share REF` publishes an image to every tenant of a server; `unshare` takes it back."""
    if ctx.invoked_subcommand is not None:
        return
    with _fleet(ctx) as fleet:
        found = fleet.images()
    if as_json:
        for image in found:
            click.echo(image.to_json())
        return
    counts: dict[str, int] = {}
    for image in found:
        for layer in image.layers:
            counts[layer] = counts.get(layer, 0) + 1
    sizes = _sizes(ctx, found)
    header = ("IMAGE", "NAMES", "SOURCE", "LAYERS", "SHARED", "SIZE", "PUBLIC")
    rows = []
    for image in found:
        shared = sum(1 for layer in image.layers if counts[layer] > 1)
        size = sizes.get(image.id)
        rows.append((image.id, ",".join(image.names) or "-", image.source or image.base, str(len(image.layers)),
                     str(shared), "-" if size is None else _size(size), "yes" if image.shared else "-"))
    if not sys.stdout.isatty():  # a pipe or a file: whole names, one image a line, for cut and awk
        for row in (header, *rows):
            click.echo("\t".join(row))
        return
    table = Table(*(Column(name, no_wrap=name in ("IMAGE", "SIZE")) for name in header), box=None, header_style="bold")
    for row in rows:
        table.add_row(*row)
    _stdout_console().print(table)


@images.command()
@click.argument("refs", nargs=-1, required=True)
@click.pass_context
def share(ctx: click.Context, refs: tuple[str, ...]) -> None:
    """Publish images (id or name) to every tenant of the server; only the host's own tenant may."""
    with _fleet(ctx) as fleet:
        for ref in refs:
            click.echo(fleet.share_image(ref).id)


@images.command()
@click.argument("refs", nargs=-1, required=True)
@click.pass_context
def unshare(ctx: click.Context, refs: tuple[str, ...]) -> None:
    """Take images back from the other tenants; their sandboxes made from them keep running."""
    with _fleet(ctx) as fleet:
        for ref in refs:
            click.echo(fleet.share_image(ref, shared=False).id)


def _sizes(ctx: click.Context, found: list[Image]) -> dict[str, int]:
    """Sizes on disk, known to an embedded engine's state dir (a server's images show none)."""
    if ctx.obj["url"]:
        return {}
    from ..engine.catalog import layer_size
    from ..images import LayerStore

    store = LayerStore(ctx.obj["state_dir"])
    return {image.id: sum(layer_size(store, layer) for layer in image.layers) for image in found}


@click.command()
@click.argument("refs", nargs=-1, required=True)
@click.option("--force", "-f", is_flag=True, help="Drop the name even while sandboxes or snapshots use the image.")
@click.pass_context
def rmi(ctx: click.Context, refs: tuple[str, ...], force: bool) -> None:
    """Remove images by id or name; `fanfold gc` then frees layers nothing uses."""
    with _fleet(ctx) as fleet:
        for ref in refs:
            click.echo(fleet.remove_image(ref, force=force))


@click.command()
@click.argument("registry")
@click.option("--username", "-u", prompt=True, help="Registry user.")
@click.option("--password-stdin", is_flag=True, help="Read the password from stdin (else it is prompted for).")
@click.pass_context
def login(ctx: click.Context, registry: str, username: str, password_stdin: bool) -> None:
    """Log in to REGISTRY (host[:port]); pulls then use the credentials, kept in the state dir (mode 0600)."""
    if password_stdin:
        password = sys.stdin.readline().rstrip("\n")
    else:
        password = click.prompt("Password", hide_input=True)
    with _fleet(ctx) as fleet:
        fleet.login(registry, username, password)
    console.print(f"logged in to {registry}", highlight=False)


@click.command()
@click.argument("registry")
@click.pass_context
def logout(ctx: click.Context, registry: str) -> None:
    """Forget the credentials kept for REGISTRY."""
    with _fleet(ctx) as fleet:
        fleet.logout(registry)
    console.print(f"logged out of {registry}", highlight=False)
