"""The ``fanfold`` command line.

Heavy imports (the engine, the HTTP client, rich, the RL layer) happen inside the commands that
need them: every call pays Python's start-up, and ``--help`` should pay little more.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..config import DEFAULT_SOCKET, EngineConfig, parse_pool
from ..errors import FanfoldError, InvalidSpec
from ..models import Persistence
from .netopts import network_options, network_value

if TYPE_CHECKING:
    from rich.tree import Tree

    from ..client import Fleet
    from ..host.doctor import Check
    from ..images.builder import StepEvent
    from ..client import Sandbox
    from ..models import ExecResult, SandboxInfo, SnapshotInfo
    from ..spec import EnvSpec


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
        from ..client._async import ray_address
        from ..cluster.joining import join

        join(ray_address(url))


def _resource_options(fn):  # type: ignore[no-untyped-def]
    for option in reversed([
        click.option("--cpus", type=float, default=1.0, show_default=True, help="CPU quota in cores."),
        click.option("--memory-mb", type=int, default=512, show_default=True, help="Memory limit."),
        click.option("--pids", type=int, default=256, show_default=True, help="Most processes at once."),
        click.option("--disk-mb", type=int, default=1024, show_default=True, help="Most bytes written to disk."),
    ]):
        fn = option(fn)
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


def _error(text: str) -> None:
    from rich.markup import escape

    console.print(f"[red]error:[/red] {escape(text)}", highlight=False, soft_wrap=True)


@click.group(cls=FanfoldGroup)
@click.option("--state-dir", envvar="FANFOLD_STATE_DIR", default="/var/lib/fanfold", show_default=True,
              help="Where layers, images and sandboxes live.")
@click.option("--runtime", envvar="FANFOLD_RUNTIME", default="crun", show_default=True,
              type=click.Choice(["crun", "runc", "runsc"]),
              help="OCI runtime of the oci backend; runsc is gVisor: stronger isolation, slower (README: Security model).")
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


@main.command()
@click.option("--fix", is_flag=True, help="Apply the fixes that can be made safely (cgroup hybrid mode, cgroup2"
              " favordynmods).")
@click.pass_context
def doctor(ctx: click.Context, fix: bool) -> None:
    """Check the host; exit 0 only when sandboxes can run."""
    from ..host import doctor as doctor_checks
    from ..host import setup

    if fix and setup.is_root():
        moved = setup.fix_hybrid_cgroups()  # doctor always checks this host, never a --url server
        setup.favor_dynamic_cgroups()
        if moved:
            console.print(f"fixed: moved {', '.join(moved)} from cgroup2 to cgroup v1")
    checks = doctor_checks.run_checks(ctx.obj["runtime"])
    if all(c.ok for c in checks if c.required):
        checks.append(_sandbox_check(ctx))
    for check in checks:
        mark = "[green]ok[/green]  " if check.ok else ("[red]FAIL[/red]" if check.required else "[yellow]warn[/yellow]")
        line = f"{mark} {check.name:<14} {check.detail}"
        if not check.ok and check.fix:
            line += f"  [dim]fix: {check.fix}[/dim]"
        console.print(line, highlight=False)
    sys.exit(0 if all(c.ok for c in checks if c.required) else 1)


def _sandbox_check(ctx: click.Context) -> Check:
    from ..host import doctor as doctor_checks

    try:
        with _fleet(ctx, local=True) as fleet, fleet.create("host") as sandbox:
            result = sandbox.exec(["/bin/echo", "ready"], timeout=30)
        ok = result.ok and result.stdout.strip() == b"ready"
        return doctor_checks.Check("sandbox", ok, "created a sandbox and ran a command in it" if ok else str(result),
                                   "see the lines above")
    except FanfoldError as err:
        return doctor_checks.Check("sandbox", False, f"{type(err).__name__}: {err}", "see the message")


@main.command()
@click.argument("specfile", required=False, type=click.Path(exists=True))
@click.option("-f", "--dockerfile", type=click.Path(exists=True, dir_okay=False),
              help="Build this Dockerfile; SPECFILE, if given, is then its build context directory.")
@click.option("--build-arg", "build_args", multiple=True, metavar="KEY=VALUE", help="Set a Dockerfile ARG (repeatable).")
@click.option("--target", help="The Dockerfile stage to build (default: the last).")
@click.option("--network", type=click.Choice(["isolated", "host"]), default="isolated", show_default=True,
              help="Where RUN steps are: isolated (egress through NAT, nothing of the host) or the host's network"
                   " (the host's own tenant only).")
@click.option("--json", "as_json", is_flag=True, help="Print the image as JSON.")
@click.pass_context
def build(ctx: click.Context, specfile: str | None, dockerfile: str | None, build_args: tuple[str, ...],
          target: str | None, network: str, as_json: bool) -> None:
    """Build the EnvSpec named `spec` in SPECFILE (a Python file), or a Dockerfile: SPECFILE named
    `Dockerfile`, `*.Dockerfile` or `Dockerfile.*`, a directory holding a `Dockerfile`, or `-f FILE`."""
    spec = _load_dockerfile(specfile, dockerfile, build_args, target)
    if spec is None:
        if specfile is None:
            raise click.UsageError("give a spec file (Python), a Dockerfile, or -f DOCKERFILE")
        if build_args or target:
            raise click.UsageError("--build-arg and --target apply to Dockerfiles; SPECFILE is a Python spec file")
        spec = _load_spec(specfile)

    def show(event: StepEvent) -> None:
        if event.status == "running":
            console.print(f"[{event.index + 1}/{event.total}] {event.description} ...", highlight=False)
        else:
            colour = {"cached": "dim", "built": "green", "failed": "red"}[event.status]
            console.print(f"[{event.index + 1}/{event.total}] {event.description} [{colour}]{event.status}[/{colour}]",
                          highlight=False)

    with _fleet(ctx) as fleet:
        image = fleet.build(spec, on_step=show, network=network)  # type: ignore[arg-type]
    click.echo(image.to_json() if as_json else image.id)


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


@main.command(context_settings={"ignore_unknown_options": True})
@_limits_options
@_TIMEOUT
@_CWD
@_USER
@_SECCOMP
@network_options
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run(ctx, image, cpus, memory_mb, pids, disk_mb, env, timeout, cwd, user, seccomp, network, allow, deny, cmd) -> None:  # type: ignore[no-untyped-def]
    """Create a sandbox, run CMD in it, print its output, destroy it; exit with CMD's status.

    With no CMD, runs the image's default command (its entrypoint and cmd). Our stdin goes to
    CMD when it is a pipe or a file. Ctrl-C kills CMD and the sandbox (exit 130).
    """
    with _fleet(ctx) as fleet:
        with fleet.create(image, cpus=cpus, memory_mb=memory_mb, pids=pids, disk_mb=disk_mb,
                          env=_pairs(env, "--env"), user=user, seccomp=_profile_path(seccomp),
                          network=network_value(network, allow, deny)) as sandbox:
            result = _exec(sandbox, cmd or _default_command(fleet, sandbox.info.image_id, image), timeout=timeout, cwd=cwd)
    _exit_with(result)


def _profile_path(seccomp: str) -> str:
    """A profile file given relative to here, made absolute: the engine reads it from its own cwd."""
    return seccomp if seccomp in ("default", "unconfined") else os.path.abspath(seccomp)


def _default_command(fleet: Fleet, image_id: str, asked: str) -> tuple[str, ...]:
    """The image's entrypoint and cmd: what `fanfold run IMAGE` runs with no command."""
    found = next((img for img in fleet.images() if img.id == image_id), None)
    argv = (*found.entrypoint, *found.cmd) if found is not None else ()
    if not argv:
        raise click.UsageError(f"image {asked!r} has no default command (no ENTRYPOINT or CMD): give one after the image")
    return argv


@main.command()
@_limits_options
@click.option("--deadline", type=float, default=None, help="Destroy it after this many seconds.")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="Label (repeatable).")
@click.option("--persistence", type=click.Choice([p.value for p in Persistence]), default="ephemeral",
              show_default=True, help="When idle: ephemeral is destroyed, sticky is suspended and may be evicted "
                                      "under pressure, persistent is suspended and kept.")
@click.option("--priority", type=click.IntRange(0, 10), default=0, show_default=True,
              help="Eviction order of sticky sandboxes under pressure: the lowest go first.")
@click.option("--idle-timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Suspend it (ephemeral: destroy it) after this long without a call.")
@_USER
@_SECCOMP
@network_options
@click.pass_context
def create(ctx, image, cpus, memory_mb, pids, disk_mb, env, deadline, labels,  # type: ignore[no-untyped-def]
           persistence, priority, idle_timeout, user, seccomp, network, allow, deny) -> None:
    """Create a sandbox that outlives this command; print its id.

    --image also takes a snapshot id or name, to start from a snapshot.
    """
    with _fleet(ctx) as fleet:
        sandbox = fleet.create(image, cpus=cpus, memory_mb=memory_mb, pids=pids, disk_mb=disk_mb,
                               env=_pairs(env, "--env"), labels=_pairs(labels, "--label"), deadline=deadline,
                               detached=True, persistence=persistence, priority=priority, idle_timeout=idle_timeout,
                               user=user, seccomp=_profile_path(seccomp), network=network_value(network, allow, deny))
    click.echo(sandbox.id)


@main.command(name="exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@_TIMEOUT
@_CWD
@click.option("--env", "env", multiple=True, metavar="KEY=VALUE", help="Environment variable for CMD (repeatable).")
@_USER
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def exec_(ctx, sandbox_id, timeout, cwd, env, user, cmd) -> None:  # type: ignore[no-untyped-def]
    """Run CMD in sandbox SANDBOX_ID, streaming its output; exit with its status.

    Our stdin goes to CMD when it is a pipe or a file. Ctrl-C kills CMD (exit 130).
    """
    with _fleet(ctx) as fleet:
        result = _exec(fleet.get(sandbox_id), cmd, timeout=timeout, cwd=cwd, env=_pairs(env, "--env"), user=user)
    _exit_with(result)


@main.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of sandboxes.")
@click.pass_context
def ls(ctx: click.Context, as_json: bool) -> None:
    """List sandboxes."""
    with _fleet(ctx) as fleet:
        infos = fleet.list()
    if as_json:
        click.echo(json.dumps([info.to_dict() for info in infos]))
        return
    header = ("ID", "STATE", "IMAGE", "CPUS", "MEM MB", "LABELS")
    rows = [(info.id, info.state, info.image_id, str(info.limits.cpus), str(info.limits.memory_mb),
             ",".join(f"{k}={v}" for k, v in info.labels.items())) for info in infos]
    if not sys.stdout.isatty():  # a pipe or a file: whole ids, one sandbox a line, for cut and awk
        for row in (header, *rows):
            click.echo("\t".join(row))
        return
    from rich.table import Column, Table

    table = Table(Column("ID", no_wrap=True), "STATE", Column("IMAGE", no_wrap=True), "CPUS", "MEM MB", "LABELS")
    for row in rows:
        table.add_row(*row)
    _stdout_console().print(table)


@main.command()
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


@main.command()
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


@main.command()
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


def _lifecycle_command(verb: str, summary: str) -> None:
    @click.pass_context
    def command(ctx: click.Context, sandbox_id: str) -> None:
        with _fleet(ctx) as fleet:
            info: SandboxInfo = getattr(fleet.get(sandbox_id), verb)()
        click.echo(f"{info.id} {info.state}")

    command.__doc__ = summary
    main.command(name=verb)(click.argument("sandbox_id", metavar="SANDBOX")(command))


for _verb, _summary in {
    "pause": "Freeze SANDBOX's processes; memory stays resident. Any later call wakes it.",
    "unpause": "Thaw paused SANDBOX.",
    "suspend": "Checkpoint SANDBOX's processes to disk and stop them, freeing memory. Any later call resumes it.",
    "resume": "Restore suspended SANDBOX's processes from disk.",
    "reset": "Return SANDBOX to the image or snapshot it was made from (same id, fresh disk and processes).",
}.items():
    _lifecycle_command(_verb, _summary)


@main.command()
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


def _size(size: float) -> str:
    if size < 1024:
        return f"{size:.0f} B"
    for unit in ("KiB", "MiB"):
        size /= 1024
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} GiB"


@main.command(name="rm-snapshot")
@click.argument("snapshot_ids", metavar="SNAPSHOT...", nargs=-1, required=True)
@click.pass_context
def rm_snapshot(ctx: click.Context, snapshot_ids: tuple[str, ...]) -> None:
    """Delete snapshots by id or name; one still in use by sandboxes or later snapshots is refused."""
    with _fleet(ctx) as fleet:
        for snapshot_id in snapshot_ids:
            fleet.delete_snapshot(snapshot_id)
            click.echo(snapshot_id)


@main.command()
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


@main.command()
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True,
              help="Unix socket to serve on (mode 0600: root may call it without a token).")
@click.option("--no-socket", is_flag=True, help="Serve on TCP only.")
@click.option("--host", default="127.0.0.1", show_default=True, help="TCP address, with --port.")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="Also serve on TCP (a token is required there).")
@click.option("--token", "tokens", multiple=True, help="Accept this bearer token, as its own tenant (repeatable).")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="File of 'TENANT TOKEN' lines: one tenant each.")
@click.option("--host-token", envvar="FANFOLD_HOST_TOKEN", default=None,
              help="Accept this bearer token as the host's own tenant, as root on the socket is "
                   "(a cluster's nodes and drivers use one; keep it secret).")
@click.option("--grace", type=float, default=10.0, show_default=True,
              help="Seconds calls in flight get to finish on shutdown before they are cancelled.")
@click.option("--pool", "pools", multiple=True, metavar="IMAGE=SIZE",
              help="Keep SIZE sandboxes of IMAGE (default limits) warm from the start (repeatable; FANFOLD_POOLS).")
@click.pass_context
def serve(ctx, socket_path, no_socket, host, port, tokens, tokens_file, host_token, grace, pools) -> None:  # type: ignore[no-untyped-def]
    """Serve the HTTP API for this host's sandboxes until SIGINT or SIGTERM.

    Each token is a tenant that sees only its own sandboxes. On shutdown the server stops
    accepting, lets calls in flight finish for --grace seconds, and destroys the sandboxes
    it owns (detached ones stay).

    Beside fanfold's API (/v1) it answers E2B's SDK (E2B_API_URL=URL/e2b,
    E2B_SANDBOX_URL=URL/e2b/envd, E2B_API_KEY=a token), OpenEnv's client (URL/openenv/ENV,
    the token as the URL's password) and Agent RFT (URL/v1/rft/...).
    """
    from ..server import Tenants
    from ..server import serve as run_server
    from ..server.auth import new_token

    tenants = Tenants.from_file(tokens_file) if tokens_file else Tenants()
    for token in tokens:
        tenants.add(token)
    if host_token:
        from ..server.auth import LOCAL_TENANT

        tenants.add(host_token, LOCAL_TENANT)
    if port is not None and not len(tenants):
        token = new_token()
        tenants.add(token, "default")
        console.print(f"token (shown once; clients pass it as FANFOLD_TOKEN): {token}", highlight=False, soft_wrap=True)

    def announce(urls: list[str]) -> None:
        click.echo(f"fanfold serve: listening on {' '.join(urls)}")
        sys.stdout.flush()

    config = _config(ctx)
    if pools:
        config = dataclasses.replace(config, pools=config.pools + _pool_sizes(pools))
    run_server(config, tenants=tenants, socket_path=None if no_socket else socket_path, host=host, port=port,
               grace_s=grace, announce=announce)


def _pool_sizes(items: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    try:
        return tuple(parse_pool(item) for item in items)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--pool") from None


@main.command()
@click.argument("image", default="host")
@click.option("--size", default=None, metavar="N|auto", required=True,
              help="Sandboxes to keep warm; 'auto' follows recent demand; 0 removes the pool.")
@_resource_options
@click.option("--wait", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Return only once the pool is full.")
@click.pass_context
def pool(ctx, image, size, cpus, memory_mb, pids, disk_mb, wait) -> None:  # type: ignore[no-untyped-def]
    """Keep sandboxes of IMAGE warm on a server, for creates with the same limits (needs --url).

    A create served from the pool takes about a millisecond; the pool refills behind it.
    """
    if not ctx.obj["url"]:
        raise click.UsageError("a pool lives in a server's engine: pass --url or set FANFOLD_URL (see `fanfold serve --pool`)")
    if size != "auto" and not (size.isdigit()):
        raise click.BadParameter(f"{size!r} is not a whole number or 'auto'", param_hint="--size")
    with _fleet(ctx) as fleet:
        info = fleet.pool(image, None if size == "auto" else int(size), cpus=cpus, memory_mb=memory_mb, pids=pids,
                          disk_mb=disk_mb, wait=wait)
    click.echo(f"{info.source}  ready={info.ready}/{info.target}  size={'auto' if info.size is None else info.size}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON array of pools.")
@click.pass_context
def pools(ctx: click.Context, as_json: bool) -> None:
    """List a server's warm pools (needs --url)."""
    if not ctx.obj["url"]:
        raise click.UsageError("pools live in a server's engine: pass --url or set FANFOLD_URL")
    with _fleet(ctx) as fleet:
        found = fleet.pools()
    if as_json:
        click.echo(json.dumps([p.to_dict() for p in found]))
        return
    for info in found:
        click.echo(f"{info.source}  ready={info.ready}/{info.target}  handouts={info.handouts}  misses={info.misses}"
                   + (f"  error={info.last_error}" if info.last_error else ""))


@main.command()
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True, help="Seconds between frames.")
@click.option("--once", is_flag=True, help="Print one frame and exit (for scripts and captures).")
@click.option("--limit", type=click.IntRange(min=0), default=20, show_default=True, help="Sandboxes listed.")
@click.pass_context
def top(ctx: click.Context, interval: float, once: bool, limit: int) -> None:
    """A live view of a server's host: sandboxes by state with their CPU and memory, the create
    queue, pools, create and exec latency percentiles, error and timeout rates, and alerts.

    Watches --url, or the local server's socket when there is one.
    """
    from ..client import Fleet
    from .top import watch

    url = ctx.obj["url"]
    if url is None and Path(DEFAULT_SOCKET).exists():
        url = f"unix://{DEFAULT_SOCKET}"
    if url is None:
        raise click.UsageError("fanfold top watches a server: start `fanfold serve`, or pass --url / FANFOLD_URL")
    _join_ray(url)
    with Fleet(url, token=ctx.obj["token"]) as fleet:
        watch(fleet, source=url, interval=interval, once=once, limit=limit)

