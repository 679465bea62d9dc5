"""``fanfold build``: an image from a Python spec file or a Dockerfile."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

import click

from ..errors import InvalidSpec
from .common import _fleet, _pairs, console

if TYPE_CHECKING:
    from ..images.builder import StepEvent
    from ..spec import EnvSpec


@click.command()
@click.argument("specfile", required=False, type=click.Path(exists=True))
@click.option("-f", "--dockerfile", type=click.Path(exists=True, dir_okay=False),
              help="Build this Dockerfile; SPECFILE, if given, is then its build context directory.")
@click.option("--build-arg", "build_args", multiple=True, metavar="KEY=VALUE", help="Set a Dockerfile ARG (repeatable).")
@click.option("--target", help="The Dockerfile stage to build (default: the last).")
@click.option("--network", type=click.Choice(["isolated", "host"]), default="isolated", show_default=True,
              help="Where RUN steps are: isolated (egress through NAT, nothing of the host) or the host's network"
                   " (the host's own tenant only).")
@click.option("-t", "--tag", default=None, metavar="NAME[:TAG]",
              help="Name the image (myenv, team/env:v2): create, run and build take the name as they take an id.")
@click.option("--json", "as_json", is_flag=True, help="Print the image as JSON.")
@click.pass_context
def build(ctx: click.Context, specfile: str | None, dockerfile: str | None, build_args: tuple[str, ...],
          target: str | None, network: str, tag: str | None, as_json: bool) -> None:
    """Build the EnvSpec named `spec` in SPECFILE (a Python file), or a Dockerfile: SPECFILE named
    `Dockerfile`, `*.Dockerfile` or `Dockerfile.*`, a directory holding a `Dockerfile`, or `-f FILE`.
    Prints the image's id; `-t NAME` names it too."""
    spec = _load_dockerfile(specfile, dockerfile, build_args, target)
    if spec is None:
        if specfile is None:
            raise click.UsageError("give a spec file (Python), a Dockerfile, or -f DOCKERFILE")
        if build_args or target:
            raise click.UsageError("--build-arg and --target apply to Dockerfiles; SPECFILE is a Python spec file")
        spec = _load_spec(specfile)

    with _fleet(ctx) as fleet:
        image = fleet.build(spec, on_step=StepPrinter(console.print), network=network, tag=tag)  # type: ignore[arg-type]
    click.echo(image.to_json() if as_json else image.id)


class StepPrinter:
    """One line a step: ``[3/6] RUN make ...`` as it starts, its status appended as it ends (a cached
    or config step ends at once). Only a command's first line is shown."""

    COLOURS = {"cached": "dim", "built": "green", "failed": "red"}

    def __init__(self, print_: Callable[..., None]) -> None:
        self.print, self.started = print_, None

    def __call__(self, event: StepEvent) -> None:
        from rich.text import Text

        line = f"[{event.index + 1}/{event.total}] {_first_line(event.description)}"
        if event.status == "running":
            self._end_open_line()
            self.print(Text(line + " ..."), end="", highlight=False)
            self.started = event
            return
        status = Text(event.status, style=self.COLOURS.get(event.status, ""))
        if self.started is not None and (self.started.index, self.started.description) == (event.index, event.description):
            self.print(Text(" ").append_text(status), highlight=False)
        else:
            self._end_open_line()
            self.print(Text(line + " ").append_text(status), highlight=False)
        self.started = None

    def _end_open_line(self) -> None:
        if self.started is not None:
            self.print("")
            self.started = None


def _first_line(description: str) -> str:
    lines = description.strip().splitlines() or [""]
    return lines[0] if len(lines) == 1 else f"{lines[0]} … (+{len(lines) - 1} lines)"


def _load_dockerfile(specfile: str | None, dockerfile: str | None, build_args: tuple[str, ...],
                     target: str | None) -> EnvSpec | None:
    """The spec of the Dockerfile the arguments name, or None when SPECFILE is a Python spec file."""
    from ..spec import EnvSpec

    context = None
    if dockerfile is None and specfile is not None and Path(specfile).is_dir():
        dockerfile, context = str(Path(specfile) / "Dockerfile"), specfile
        if not Path(dockerfile).is_file():
            raise click.UsageError(f"directory {specfile} holds no Dockerfile: name one with -f")
    elif dockerfile is not None:
        if specfile is not None and not Path(specfile).is_dir():
            raise click.UsageError(f"with -f, SPECFILE is the build context and must be a directory: {specfile}")
        context = specfile
    elif specfile is None or not _is_dockerfile_name(Path(specfile).name):
        return None
    else:
        dockerfile = specfile
    return EnvSpec.from_dockerfile(dockerfile, context=context, build_args=_pairs(build_args, "--build-arg"),
                                   target=target)


def _is_dockerfile_name(name: str) -> bool:
    return name == "Dockerfile" or name.endswith(".Dockerfile") or name.startswith("Dockerfile.")


def _load_spec(specfile: str) -> EnvSpec:
    """Run SPECFILE and return its `spec`; an error in it is one line naming the file, line and error."""
    import runpy

    from ..spec import EnvSpec

    try:
        namespace = runpy.run_path(specfile)
    except SyntaxError as err:  # its own file and line: the spec's, or a module the spec imports
        where = f"{err.filename or specfile}" + (f":{err.lineno}" if err.lineno else "")
        raise InvalidSpec(f"{where}: {type(err).__name__}: {err.msg}") from None
    except Exception as err:
        raise InvalidSpec(f"{_where_in(specfile, err)}: {type(err).__name__}: {err}") from None
    spec = namespace.get("spec")
    if not isinstance(spec, EnvSpec):
        raise click.UsageError(f"{specfile} must define `spec = EnvSpec(...)`")
    return spec if spec.context is not None else spec.with_context(Path(specfile).resolve().parent)


def _where_in(specfile: str, err: BaseException) -> str:
    """``SPECFILE:LINE``, LINE being the deepest frame of the error in that file (none if it failed before running)."""
    import traceback

    target = Path(specfile).resolve()
    lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if Path(f.filename).resolve() == target]
    return f"{specfile}:{lines[-1]}" if lines else specfile


COMMANDS = (build,)
