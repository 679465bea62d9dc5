"""What every command shares: the stderr console, the fleet a command talks to, the sandbox resource
options, KEY=VALUE pairs and byte sizes. Cheap to import: rich loads on first use."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

import click

from ..config import EngineConfig

if TYPE_CHECKING:
    from ..client import Fleet


class _Stderr:
    """rich's Console on stderr, made on first use, so that `--help` never imports rich."""

    @functools.cached_property
    def _console(self):  # type: ignore[no-untyped-def]
        from rich.console import Console

        return Console(stderr=True)

    def print(self, *args: Any, **kwargs: Any) -> None:
        self._console.print(*args, **kwargs)


console = _Stderr()


def _stdout_console():  # type: ignore[no-untyped-def]
    from rich.console import Console

    return Console()


def _config(ctx: click.Context) -> EngineConfig:
    return EngineConfig(state_dir=ctx.obj["state_dir"], backend=ctx.obj["backend"], runtime=ctx.obj["runtime"])


def _fleet(ctx: click.Context, *, local: bool = False) -> Fleet:
    """The server's fleet when --url/FANFOLD_URL is given, else an embedded engine."""
    from ..client import Fleet

    if ctx.obj["url"] and not local:
        _join_ray(ctx.obj["url"])
        return Fleet(ctx.obj["url"], token=ctx.obj["token"])
    return Fleet(config=_config(ctx))


def _join_ray(url: str) -> None:
    """For a ray:// URL, join its cluster now, in the main thread: no cluster there is then one line."""
    if url.startswith("ray://"):
        from ..client import ray_address
        from ..cluster.joining import join

        join(ray_address(url))


def model_option(cls: type, name: str, **extra: Any) -> Callable[[Any], Any]:
    """A ``--NAME`` option for field ``name`` of model ``cls`` (``Limits``, ``CreateParams``): its type,
    default, help (its docstring) and range (its bounds, which the model itself enforces, so a bad
    value is the same one-line error as from any transport) are the model's, never a copy."""
    from dataclasses import MISSING, fields

    from ..models import field_docs

    spec = next(f for f in fields(cls) if f.name == name)
    meta, kind = spec.metadata, str(spec.type).split(" |")[0]
    low, high = meta.get("ge", meta.get("gt")), meta.get("le")
    help_text = field_docs(cls).get(name, "").replace("``", "")
    if low is not None and high is not None:
        help_text += f" [{'above ' if 'gt' in meta else ''}{_number(low)} to {_number(high)}]"
    default = None if spec.default is MISSING else spec.default
    options: dict[str, Any] = {"type": {"int": int, "float": float}.get(kind), "default": default,
                               "show_default": default is not None, "help": help_text}
    if kind == "bool":  # a switch, off unless given (no --x/--no-x pair: the model's default is off)
        options.update(is_flag=True, type=None, show_default=False)
    return click.option(f"--{name.replace('_', '-')}", **{**options, **extra})


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _resource_options(fn):  # type: ignore[no-untyped-def]
    """An option per ``Limits`` field; the command takes them as ``**limits`` and hands them on whole."""
    from dataclasses import fields

    from ..models import Limits

    for spec in reversed(fields(Limits)):
        extra = {"metavar": "all|N|device=ID,...|none"} if spec.name == "gpus" else {}
        fn = model_option(Limits, spec.name, **extra)(fn)
    return fn


def _limits_options(fn):  # type: ignore[no-untyped-def]
    fn = click.option("--env", "env", multiple=True, metavar="KEY=VALUE", help="Environment variable (repeatable).")(fn)
    fn = _resource_options(fn)
    return click.option("--image", default="host", show_default=True,
                        help="Image: a base (host, debian:bookworm), an image id, a reference (python:3.12-slim,"
                             " pulled on first use), or a snapshot id or name.")(fn)


def _pairs(items: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=what)
        out[key] = value
    return out


def _error(text: str) -> None:
    from rich.markup import escape

    console.print(f"[red]error:[/red] {escape(text)}", highlight=False, soft_wrap=True)


def _size(size: float) -> str:
    if size < 1024:
        return f"{size:.0f} B"
    for unit in ("KiB", "MiB"):
        size /= 1024
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} GiB"
