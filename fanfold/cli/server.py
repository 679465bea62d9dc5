"""Operator commands: ``doctor``, ``serve``, ``pool``, ``pools`` and ``top``: a host and its server."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..config import DEFAULT_SOCKET, parse_pool
from ..errors import FanfoldError
from .common import _config, _fleet, _join_ray, _resource_options, console

if TYPE_CHECKING:
    from ..host.doctor import Check


@click.command()
@click.option("--fix", is_flag=True, help="Apply the fixes that can be made safely (cgroup hybrid mode, cgroup2"
              " favordynmods, fanfold's entry in /etc/subuid and /etc/subgid).")
@click.pass_context
def doctor(ctx: click.Context, fix: bool) -> None:
    """Check the host; exit 0 only when sandboxes can run."""
    from ..host import doctor as doctor_checks
    from ..host import setup, subids

    if fix and setup.is_root():
        moved = setup.fix_hybrid_cgroups()  # doctor always checks this host, never a --url server
        setup.favor_dynamic_cgroups()
        with contextlib.suppress(FanfoldError):  # the uid ranges check says what stands in the way
            subids.ensure(_config(ctx).uid_ranges)
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


@click.command()
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True,
              help="Unix socket to serve on (mode 0600: root may call it without a token).")
@click.option("--no-socket", is_flag=True, help="Serve on TCP only.")
@click.option("--host", default="127.0.0.1", show_default=True, help="TCP address, with --port.")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="Also serve on TCP (a token is required there).")
@click.option("--token", "tokens", multiple=True, help="Accept this bearer token, as its own tenant (repeatable).")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="File of 'TENANT TOKEN' lines: one tenant each.")
@click.option("--ssh-keys", type=click.Path(exists=True, dir_okay=False), default=None,
              help="File of 'TENANT TYPE BASE64 [COMMENT]' lines: the SSH public keys each tenant's sandboxes"
                   " authorize when it enables sshd in them (`fanfold ssh --sshd`, docs/ssh.md).")
@click.option("--host-token", envvar="FANFOLD_HOST_TOKEN", default=None,
              help="Accept this bearer token as the host's own tenant, as root on the socket is "
                   "(a cluster's nodes and drivers use one; keep it secret).")
@click.option("--grace", type=float, default=10.0, show_default=True,
              help="Seconds calls in flight get to finish on shutdown before they are cancelled.")
@click.option("--pool", "pools", multiple=True, metavar="IMAGE=SIZE",
              help="Keep SIZE sandboxes of IMAGE (default limits) warm from the start (repeatable; FANFOLD_POOLS).")
@click.option("--registry", "registries", multiple=True, metavar="HOST[:PORT]",
              help="A registry tenants may pull from, at whatever address it has (repeatable;"
                   " FANFOLD_TENANT_REGISTRIES). Default: any registry at a public address.")
@click.option("--git-host", "git_hosts", multiple=True, metavar="HOST[:PORT]",
              help="A git host tenants' builds may clone from over https or http, at whatever address it has"
                   " (repeatable; FANFOLD_TENANT_GIT_HOSTS). Default: any host at a public address.")
@click.pass_context
def serve(ctx, socket_path, no_socket, host, port, tokens, tokens_file, ssh_keys, host_token, grace, pools,  # type: ignore[no-untyped-def]
          registries, git_hosts) -> None:
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
    from ..web.auth import new_token

    tenants = Tenants.from_file(tokens_file) if tokens_file else Tenants()
    for token in tokens:
        tenants.add(token)
    if ssh_keys:
        tenants.load_ssh_keys(ssh_keys)
    if host_token:
        from ..web.auth import LOCAL_TENANT

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
    if registries:
        config = dataclasses.replace(config, tenant_registries=config.tenant_registries + _hosts(registries, "--registry"))
    if git_hosts:
        config = dataclasses.replace(config, tenant_git_hosts=config.tenant_git_hosts + _hosts(git_hosts, "--git-host"))
    run_server(config, tenants=tenants, socket_path=None if no_socket else socket_path, host=host, port=port,
               grace_s=grace, announce=announce)


def _hosts(items: tuple[str, ...], option: str) -> tuple[str, ...]:
    """``HOST[:PORT]`` items of a repeatable option, checked."""
    from ..images.registry import is_registry_host

    for item in items:
        if not is_registry_host(item):
            raise click.BadParameter(f"{item!r} is not HOST[:PORT]", param_hint=option)
    return items


def _pool_sizes(items: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    try:
        return tuple(parse_pool(item) for item in items)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--pool") from None


@click.command()
@click.argument("image", default="host")
@click.option("--size", default=None, metavar="N|auto", required=True,
              help="Sandboxes to keep warm; 'auto' follows recent demand; 0 removes the pool.")
@_resource_options
@click.option("--wait", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Return only once the pool is full.")
@click.pass_context
def pool(ctx, image, size, wait, **limits) -> None:  # type: ignore[no-untyped-def]
    """Keep sandboxes of IMAGE warm on a server, for creates with the same limits (needs --url).

    A create served from the pool takes about a millisecond; the pool refills behind it.
    """
    if not ctx.obj["url"]:
        raise click.UsageError("a pool lives in a server's engine: pass --url or set FANFOLD_URL (see `fanfold serve --pool`)")
    if size != "auto" and not (size.isdigit()):
        raise click.BadParameter(f"{size!r} is not a whole number or 'auto'", param_hint="--size")
    with _fleet(ctx) as fleet:
        info = fleet.pool(image, None if size == "auto" else int(size), **limits, wait=wait)
    click.echo(f"{info.source}  ready={info.ready}/{info.target}  size={'auto' if info.size is None else info.size}")


@click.command()
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


@click.command()
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


COMMANDS = (doctor, serve, pool, pools, top)
