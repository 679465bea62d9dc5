"""Sandbox commands: ``run``, ``create``, ``exec``, ``ls``, ``rm`` and the lifecycle verbs (``pause``,
``unpause``, ``suspend``, ``resume``, ``reset``)."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

import click

from ..models import CreateParams, Persistence
from ..refs import BASES
from .common import _fleet, _limits_options, _pairs, _stdout_console, console, model_option
from .netopts import network_options
from .terminal import INTERACTIVE, TTY, check_tty, exit_code, interact

HOST_TENANT = "(host)"
"""How ``ls`` shows the host's own tenant (its name is empty)."""

if TYPE_CHECKING:
    from ..client import Fleet, Sandbox
    from ..models import ExecResult, SandboxInfo


class _Output:
    """Streams a command's output to ours as it comes, counting what it streamed."""

    def __init__(self) -> None:
        self.streamed = {"stdout": 0, "stderr": 0}

    def __call__(self, stream: str, data: bytes) -> None:
        self.streamed[stream] += len(data)
        _write(stream, data)

    def rest(self, result: ExecResult) -> None:
        """What the result holds that never streamed, e.g. the engine's `cannot run 'x'` line."""
        for stream, data in (("stdout", result.stdout), ("stderr", result.stderr)):
            if data and not self.streamed[stream]:
                _write(stream, data)


def _write(stream: str, data: bytes) -> None:
    target = sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer
    target.write(data)
    target.flush()


def _stdin() -> bytes | None:
    """Our stdin for the command when it is a pipe or a file; a terminal is never read."""
    if sys.stdin is None or sys.stdin.isatty():
        return None
    return sys.stdin.buffer.read() or None


def _exec(sandbox: Sandbox, cmd: tuple[str, ...], **kwargs: Any) -> ExecResult:
    output = _Output()
    result = sandbox.exec(list(cmd), stdin=_stdin(), on_output=output, **kwargs)
    output.rest(result)
    return result


def _exit_with(result: ExecResult) -> None:
    if result.stdout_truncated or result.stderr_truncated:
        console.print("[yellow]output truncated[/yellow]")
    if result.outcome.value != "exited":
        console.print(f"[red]{result.outcome.value}[/red] after {result.duration_s:.2f}s", highlight=False)
        sys.exit(124 if result.outcome.value == "timeout" else 137)
    sys.exit(result.exit_code)


_CWD = click.option("--cwd", default=None, metavar="DIR", help="Working directory inside the sandbox (default: the image's).")
_TIMEOUT = click.option("--timeout", type=float, default=None, help="Kill the command after this many seconds.")
_USER = click.option("-u", "--user", default=None, metavar="USER[:GROUP]",
                     help="Run as this user (a name or uid, resolved in the sandbox's /etc/passwd); default: the image's USER, else root.")
_SECCOMP = click.option("--seccomp", default="default", show_default=True, metavar="default|unconfined|PATH",
                        help="The sandbox's syscall filter: fanfold's default, none, or an OCI seccomp profile file.")
_NESTED = model_option(CreateParams, "nested")


@click.command(context_settings={"ignore_unknown_options": True})
@_limits_options
@_TIMEOUT
@_CWD
@_USER
@_SECCOMP
@_NESTED
@click.option("--entrypoint", default=None, metavar="PROGRAM",
              help="Run PROGRAM in place of the image's entrypoint (\"\" for none), without the image's cmd.")
@network_options
@INTERACTIVE
@TTY
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run(ctx, image, env, timeout, cwd, user, seccomp, nested, entrypoint, network,  # type: ignore[no-untyped-def]
        interactive, tty, cmd, **limits) -> None:
    """Create a sandbox, run CMD in it, print its output, destroy it; exit with CMD's status.

    As `docker run` does: CMD goes after the image's entrypoint, as its arguments, in place of the
    image's cmd; with no CMD the image's cmd does. Our stdin goes to the command when it is a pipe or
    a file. Ctrl-C kills it and the sandbox (exit 130). With -i our stdin goes to it live; with -t
    it runs on a terminal (ours, in raw mode: `fanfold run -it -- bash`).
    """
    check_tty(tty)
    with _fleet(ctx) as fleet:
        with fleet.create(image, **limits, env=_pairs(env, "--env"), user=user, seccomp=_profile_path(seccomp),
                          network=network or "none", nested=nested) as sandbox:
            argv = _command(fleet, sandbox.info.image_id, image, entrypoint, cmd)
            if interactive or tty:
                result = interact(sandbox, argv, tty=tty, timeout=timeout, cwd=cwd)
            else:
                result = _exec(sandbox, argv, timeout=timeout, cwd=cwd)
    if interactive or tty:
        sys.exit(exit_code(result))
    _exit_with(result)


def _profile_path(seccomp: str) -> str:
    """A profile file given relative to here, made absolute: the engine reads it from its own cwd."""
    return seccomp if seccomp in ("default", "unconfined") else os.path.abspath(seccomp)


def _command(fleet: Fleet, image_id: str, asked: str, entrypoint: str | None, cmd: tuple[str, ...]) -> tuple[str, ...]:
    """What `fanfold run` runs, as `docker run` composes it: the entrypoint (the image's, or --entrypoint's),
    then CMD, or with none given the image's cmd (which --entrypoint drops)."""
    if entrypoint is not None:
        argv = ((entrypoint,) if entrypoint else ()) + cmd
    else:
        found = None if asked in BASES else next((img for img in fleet.images() if img.id == image_id), None)
        start, default = (found.entrypoint, found.cmd) if found is not None else ((), ())
        argv = (*start, *(cmd or default))
    if not argv:
        raise click.UsageError(f"image {asked!r} has no default command (no ENTRYPOINT or CMD): give one after the image")
    return argv


@click.command()
@_limits_options
@model_option(CreateParams, "deadline", metavar="SECONDS")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="Label (repeatable).")
@model_option(CreateParams, "persistence", type=click.Choice([p.value for p in Persistence]))
@model_option(CreateParams, "priority")
@model_option(CreateParams, "idle_timeout", metavar="SECONDS")
@_USER
@_SECCOMP
@_NESTED
@network_options
@click.pass_context
def create(ctx, image, env, deadline, labels, persistence, priority,  # type: ignore[no-untyped-def]
           idle_timeout, user, seccomp, nested, network, **limits) -> None:
    """Create a sandbox that outlives this command; print its id.

    --image also takes a snapshot id or name, to start from a snapshot.
    """
    with _fleet(ctx) as fleet:
        sandbox = fleet.create(image, **limits, env=_pairs(env, "--env"), labels=_pairs(labels, "--label"),
                               deadline=deadline, detached=True, persistence=persistence, priority=priority,
                               idle_timeout=idle_timeout, user=user, seccomp=_profile_path(seccomp),
                               network=network or "none", nested=nested)
    click.echo(sandbox.id)


@click.command(name="exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@_TIMEOUT
@_CWD
@click.option("--env", "env", multiple=True, metavar="KEY=VALUE", help="Environment variable for CMD (repeatable).")
@_USER
@INTERACTIVE
@TTY
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def exec_(ctx, sandbox_id, timeout, cwd, env, user, interactive, tty, cmd) -> None:  # type: ignore[no-untyped-def]
    """Run CMD in sandbox SANDBOX_ID, streaming its output; exit with its status.

    Our stdin goes to CMD when it is a pipe or a file. Ctrl-C kills CMD (exit 130). With -i our stdin
    goes to CMD live, and Ctrl-C to CMD as SIGINT; with -t CMD runs on a terminal: ours, in raw mode,
    its size followed. `fanfold exec -it ID` starts a shell (bash if the image has it, else sh).
    """
    check_tty(tty)
    if not cmd and not tty:
        raise click.UsageError("give a command to run (only -it starts a shell by default)")
    with _fleet(ctx) as fleet:
        sandbox = fleet.get(sandbox_id)
        if interactive or tty:
            result = interact(sandbox, cmd, tty=tty, timeout=timeout, cwd=cwd, env=_pairs(env, "--env"), user=user)
        else:
            result = _exec(sandbox, cmd, timeout=timeout, cwd=cwd, env=_pairs(env, "--env"), user=user)
    if interactive or tty:
        sys.exit(exit_code(result))
    _exit_with(result)


@click.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of sandboxes.")
@click.pass_context
def ls(ctx: click.Context, as_json: bool) -> None:
    """List sandboxes: the host's own tenant (embedded, or a server's unix socket) sees every tenant's."""
    with _fleet(ctx) as fleet:
        infos = fleet.list()
    if as_json:
        click.echo(json.dumps([info.to_dict() for info in infos]))
        return
    header: tuple[str, ...] = ("ID", "STATE", "IMAGE", "CPUS", "MEM MB", "TENANT", "LABELS")
    rows = [(info.id, info.state, info.image_id, str(info.limits.cpus), str(info.limits.memory_mb),
             info.tenant or HOST_TENANT, ",".join(f"{k}={v}" for k, v in info.labels.items())) for info in infos]
    if any(info.gpu_ids for info in infos):  # last, so that the other columns keep their places for cut
        header += ("GPUS",)
        rows = [(*row, _gpus(info)) for row, info in zip(rows, infos)]
    if not sys.stdout.isatty():  # a pipe or a file: whole ids, one sandbox a line, for cut and awk
        for row in (header, *rows):
            click.echo("\t".join(row))
        return
    from rich.table import Column, Table

    table = Table(*(Column(name, no_wrap=name in ("ID", "IMAGE")) for name in header))
    for row in rows:
        table.add_row(*row)
    _stdout_console().print(table)


def _gpus(info: SandboxInfo) -> str:
    """The GPUs a sandbox holds, and whether alone: ``GPU-1f...,GPU-2a... (exclusive)``; ``-`` for none."""
    if not info.gpu_ids:
        return "-"
    return ",".join(info.gpu_ids) + (" (exclusive)" if info.limits.gpu_exclusive else "")


@click.command()
@click.argument("sandbox_ids", nargs=-1)
@click.option("--all", "everything", is_flag=True, help="Remove every sandbox.")
@click.pass_context
def rm(ctx: click.Context, sandbox_ids: tuple[str, ...], everything: bool) -> None:
    """Destroy sandboxes."""
    if not sandbox_ids and not everything:
        raise click.UsageError("name sandboxes to remove, or pass --all")
    with _fleet(ctx) as fleet:
        targets = [info.id for info in fleet.list()] if everything else list(sandbox_ids)
        for sandbox_id in targets:
            fleet.get(sandbox_id).kill()
            click.echo(sandbox_id)


def _lifecycle_command(verb: str, summary: str) -> click.Command:
    @click.pass_context
    def command(ctx: click.Context, sandbox_id: str) -> None:
        with _fleet(ctx) as fleet:
            info: SandboxInfo = getattr(fleet.get(sandbox_id), verb)()
        click.echo(f"{info.id} {info.state}")

    command.__doc__ = summary
    return click.command(name=verb)(click.argument("sandbox_id", metavar="SANDBOX")(command))


_LIFECYCLE = tuple(_lifecycle_command(verb, summary) for verb, summary in {
    "pause": "Freeze SANDBOX's processes; memory stays resident. Any later call wakes it.",
    "unpause": "Thaw paused SANDBOX.",
    "suspend": "Checkpoint SANDBOX's processes to disk and stop them, freeing memory. Any later call resumes it.",
    "resume": "Restore suspended SANDBOX's processes from disk.",
    "reset": "Return SANDBOX to the image or snapshot it was made from (same id, fresh disk and processes).",
}.items())

COMMANDS = (run, create, exec_, ls, rm, *_LIFECYCLE)
