"""``fanfold pull``, ``import``, ``images`` (``images share``, ``inspect``, ``history``), ``rmi``, ``login`` and
``logout``: images from registries and files."""

from __future__ import annotations

import difflib
import json
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn
from rich.table import Column, Table
from rich.text import Text

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

    `fanfold images inspect IMAGE` shows one image's config and layers, `history IMAGE` the step behind each;
    `fanfold images share REF` publishes an image to every tenant of a server, `unshare` takes it back."""
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


@images.command()
@click.argument("ref", metavar="IMAGE")
@click.option("--json", "as_json", is_flag=True, help="Print the image as JSON.")
@click.pass_context
def inspect(ctx: click.Context, ref: str, as_json: bool) -> None:
    """Show IMAGE (an id or a name): its config (labels, env, workdir, user, entrypoint and cmd, ports,
    volumes, healthcheck, services) and its layers, each with its size and the step that made it."""
    image = _find(ctx, ref)
    if as_json:
        click.echo(image.to_json())
        return
    made = _layers(ctx, image)
    fields = [
        ("id", image.id), ("names", ", ".join(image.names) or "-"), ("source", image.source or image.base),
        ("digest", image.digest or "-"), ("user", image.user or "root"), ("workdir", image.workdir),
        ("entrypoint", json.dumps(list(image.entrypoint))), ("cmd", json.dumps(list(image.cmd))),
        ("env", "\n".join(f"{k}={v}" for k, v in image.env) or "-"),
        ("labels", "\n".join(f"{k}={v}" for k, v in image.labels) or "-"), ("ports", " ".join(image.ports) or "-"),
        ("volumes", " ".join(image.volumes) + " (directories of the sandbox's own disk)" if image.volumes else "-"),
        ("healthcheck", _healthcheck(image)),
        ("services", "\n".join(f"{name} ({mode}): {cmd}" for name, cmd, mode in image.services) or "-"),
        ("gpus", _gpus(image)),
        ("shared", "yes" if image.shared else "no"),
    ]
    table = Table(Column("field", style="bold", no_wrap=True), Column("value"), box=None, show_header=False)
    for name, value in fields:
        table.add_row(name, Text(value))  # as written: no markup, no :emoji: codes
    layers = Table("#", Column("LAYER", no_wrap=True), Column("SIZE", justify="right", no_wrap=True), "MADE BY",
                   box=None, header_style="bold")
    for number, (step, layer, size) in enumerate(made, start=1):
        layers.add_row(str(number), layer[:12], "-" if size is None else _size(size), Text(step or "-"))
    total = None if any(size is None for _, _, size in made) else sum(size for _, _, size in made)  # type: ignore[misc]
    table.add_row("size", "-" if total is None else _size(total))
    out = _stdout_console()
    out.print(table, highlight=False)
    out.print(layers, highlight=False)


def _gpus(image: Image) -> str:
    """The GPUs its sandboxes get unless their create names others (``EnvSpec.gpus``)."""
    if image.gpus in (None, "none"):
        return "-"
    try:
        alone = " (exclusive)" if image.gpu_exclusive else ""
    except ValueError as err:
        alone = f" ({err})"
    return f"{image.gpus}{alone}, unless a create names its own"


@images.command()
@click.argument("ref", metavar="IMAGE")
@click.pass_context
def history(ctx: click.Context, ref: str) -> None:
    """The steps that made IMAGE, first to last: each one's layer and size (- for a step of config alone)."""
    image = _find(ctx, ref)
    steps = list(image.history) or [(step, layer, size) for step, layer, size in _layers(ctx, image)]
    header = ("STEP", "LAYER", "SIZE", "CREATED BY")
    rows = [(str(number), layer[:12] or "-", "-" if size is None or not layer else _size(size), step or "-")
            for number, (step, layer, size) in enumerate(steps, start=1)]
    if not sys.stdout.isatty():  # a pipe or a file: one step a line, whole, for cut and awk
        for row in (header, *rows):
            click.echo("\t".join(row))
        return
    table = Table("STEP", Column("LAYER", no_wrap=True), Column("SIZE", justify="right", no_wrap=True), "CREATED BY",
                  box=None, header_style="bold")
    for row in rows:
        table.add_row(*row[:3], Text(row[3]))
    _stdout_console().print(table, highlight=False)


def _find(ctx: click.Context, ref: str) -> Image:
    """The image ``ref`` names (its id or one of its names) among those the caller sees."""
    from ..errors import ImageNotFound

    with _fleet(ctx) as fleet:
        found = fleet.images()
    for image in found:
        if ref == image.id or ref in image.names:
            return image
    known = [image.id for image in found] + [name for image in found for name in image.names]
    near = ", ".join(difflib.get_close_matches(ref, known, n=3, cutoff=0.6))
    raise ImageNotFound(f"no image {ref!r} here{f' (did you mean {near}?)' if near else ''}: `fanfold images` lists them")


def _layers(ctx: click.Context, image: Image) -> list[tuple[str, str, int | None]]:
    """Each layer's step and size: as the image recorded them, else sized here (embedded) or unknown."""
    made = image.layer_history()
    if ctx.obj["url"] or all(size is not None for _, _, size in made):
        return made
    from ..images import LayerStore

    store = LayerStore(ctx.obj["state_dir"])
    return [(step, layer, store.layer_size(layer)) for step, layer, _ in made]


def _healthcheck(image: Image) -> str:
    check = image.healthcheck
    if check is None:
        return "-"
    test = " ".join(check.test[1:]) if check.test[0] == "CMD-SHELL" else json.dumps(list(check.test[1:]))
    return (f"{test} (every {check.interval_s:g}s, timeout {check.timeout_s:g}s, start period {check.start_period_s:g}s,"
            f" {check.retries} retries; recorded, fanfold runs no probe)")


def _sizes(ctx: click.Context, found: list[Image]) -> dict[str, int]:
    """Sizes on disk, known to an embedded engine's state dir (a server's images show none)."""
    if ctx.obj["url"]:
        return {}
    from ..images import LayerStore

    store = LayerStore(ctx.obj["state_dir"])
    return {image.id: sum(store.layer_size(layer) for layer in image.layers) for image in found}


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
