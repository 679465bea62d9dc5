"""``fanfold ray``: start, inspect and stop fanfold on a Ray cluster (a ``fanfold serve`` per node,
kept by one controller actor; see ``fanfold.cluster``).

Ray is imported only once a command runs, and through ``require`` so a missing extra is one line.
Ray retries an address where nothing answers for minutes; ``join`` checks it can reach one first.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import click

from ..config import parse_pool
from ..errors import InvalidRequest
from ..cluster.joining import join
from .common import _pairs, console

SHORT_ID = 12
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAISED = re.compile(r"(?:[a-z_]\w*\.)*[A-Z][a-z]\w*: .")
"""A line of a traceback naming the exception raised: ``RuntimeError: ...``, ``fanfold.errors.NotFound: ...``."""


def _address_option(fn):  # type: ignore[no-untyped-def]
    return click.option("--address", default="auto", show_default=True, metavar="ADDRESS",
                        help="The Ray cluster: auto (the one this machine belongs to, or $RAY_ADDRESS), the head's"
                             " HOST:PORT (6379), or ray://HOST:10001 (Ray Client).")(fn)


def _controller(address: str) -> Any:
    """The controller of the cluster at ``address`` (InvalidRequest when fanfold is not started there)."""
    join(address)
    from ..cluster import node

    return node.controller()


def _call(method: Any) -> Any:
    """A controller method's result, waited for here."""
    import ray

    return ray.get(method.remote())


@click.group()
def ray() -> None:
    """fanfold on a Ray cluster: start, status, stop, metrics (a `fanfold serve` on every node).

    Drivers find the node servers through Ray and call them over HTTP.

    \b
    fanfold ray start --address auto --port 8700   # as root, on a node of the cluster
    fanfold ray status
    fanfold --url ray://auto top
    # in the trainer, on the cluster: AsyncFleet("ray://auto") or Fleet.ray()
    """


@ray.command(short_help="Start fanfold on every node of the cluster (a no-op where it runs).")
@_address_option
@click.option("--state-dir", default="/var/lib/fanfold", show_default=True, metavar="PATH",
              help="Each node's state dir; {node_id} is replaced by the Ray node id (for several nodes on one"
                   " machine).")
@click.option("--resource", default=None, metavar="NAME",
              help="Only nodes offering this Ray custom resource get a server (default: every node).")
@click.option("--host", default=None, metavar="ADDR",
              help="The address node servers listen on (default: each node's address as Ray knows it).")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="The node servers' TCP port (0: any free one; fix one to open it in a firewall).")
@click.option("--backend", default=None, metavar="NAME", help="The node servers' isolation backend (default: oci).")
@click.option("--runtime", type=click.Choice(["crun", "runc", "runsc"]), default=None,
              help="The node servers' OCI runtime (default: crun).")
@click.option("--pool", "pools", multiple=True, metavar="IMAGE=SIZE",
              help="Keep SIZE sandboxes of IMAGE warm on every node from its start (repeatable).")
@click.option("--env", "env", multiple=True, metavar="KEY=VALUE",
              help="Environment of the node servers, e.g. FANFOLD_* settings (repeatable).")
@click.option("--nodes", type=click.IntRange(min=1), default=None, metavar="N",
              help="Wait until N node servers answer.")
@click.option("--timeout", type=click.FloatRange(min=0), default=120.0, show_default=True, metavar="SECONDS",
              help="How long to wait for them.")
@click.option("--show-token", is_flag=True, help="Also print the cluster's token (drivers on the cluster get it"
              " from Ray; others pass it as FANFOLD_TOKEN to a node's URL).")
def start(address: str, state_dir: str, resource: str | None, host: str | None, port: int, backend: str | None,
          runtime: str | None, pools: tuple[str, ...], env: tuple[str, ...], nodes: int | None, timeout: float,
          show_token: bool) -> None:
    """Start fanfold on the Ray cluster: a controller that keeps a `fanfold serve` on every node
    (nodes that join later get one too). Where it runs already this changes nothing and lists its
    nodes.

    Run it as root on a node of the cluster: the node servers need root, and they run as Ray's
    workers do. The cluster's token is made here and kept by the controller; it is every node
    server's host token.

    \b
    fanfold ray start --address auto --port 8700 --nodes 4
    fanfold ray start --state-dir '/var/lib/fanfold/{node_id}' --resource fanfold
    """
    config_fields = _config_fields(state_dir, resource, host, port, backend, runtime, pools, env)
    controller = _running_controller(address)
    from ..cluster import node

    if controller is not None:
        console.print("fanfold runs on this Ray cluster already, with the settings it was started with"
                      " (`fanfold ray stop` first to change them)", highlight=False, soft_wrap=True)
    try:
        infos = asyncio.run(node.start_cluster(node.ClusterConfig(**config_fields), address=None, nodes=nodes,
                                               timeout=timeout))
    except InvalidRequest:  # too few nodes in time: say why in a line each, not Ray's tracebacks
        raise InvalidRequest(_shortfall(nodes, timeout)) from None
    for info in infos:
        click.echo(f"{info['tag']}  {info['url']}  {info['state_dir']}")
    if show_token:
        click.echo(f"token: {_call(node.controller().token)}")
    console.print(f"fanfold runs on {len(infos)} node{'' if len(infos) == 1 else 's'}. From a driver on the cluster:"
                  ' AsyncFleet("ray://auto") or Fleet.ray(); watch it with `fanfold --url ray://auto top`.',
                  highlight=False, soft_wrap=True)


def _shortfall(wanted: int | None, timeout: float) -> str:
    from ..cluster import node

    report = _call(node.controller().status)
    errors = "".join(f"; node {node_id[:SHORT_ID]}: {_summary(error)}" for node_id, error in report["errors"].items())
    return (f"{len(report['nodes'])} of {wanted} fanfold nodes answered within {timeout:g} s{errors}"
            " (`fanfold ray status` shows them, `fanfold ray stop` stops them)")


def _summary(error: str) -> str:
    """A node's start error in one line: the last exception raised in it (Ray's text holds tracebacks)."""
    lines = [line.strip() for line in _ANSI.sub("", error).splitlines() if line.strip()]
    raised = [line for line in lines if _RAISED.match(line)]
    return raised[-1] if raised else (lines or ["?"])[0]


def _config_fields(state_dir: str, resource: str | None, host: str | None, port: int, backend: str | None,
                   runtime: str | None, pools: tuple[str, ...], env: tuple[str, ...]) -> dict[str, Any]:
    for item in pools:
        try:
            parse_pool(item)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--pool") from None
    return {"state_dir": state_dir, "resource": resource, "host": host, "port": port, "backend": backend,
            "runtime": runtime, "pools": pools, "env": _pairs(env, "--env")}


def _running_controller(address: str) -> Any:
    """The controller of the cluster at ``address``, None when fanfold is not started there."""
    join(address)
    from ..cluster import node

    try:
        return node.controller()
    except InvalidRequest:
        return None


@ray.command(short_help="Nodes (tag, URL, state, memory, CPUs), their errors, the settings.")
@_address_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object: nodes, errors per node, settings.")
def status(address: str, as_json: bool) -> None:
    """Show fanfold's nodes on the Ray cluster (tag, node, URL, state, memory, CPUs), the errors
    of nodes whose server did not start, and the settings (never the token).

    \b
    fanfold ray status --address 10.0.0.1:6379
    """
    report = _call(_controller(address).status)
    import ray as ray_module

    alive = {n["NodeID"] for n in ray_module.nodes() if n["Alive"]}
    for info in report["nodes"]:
        info["alive"] = info["node_id"] in alive
    if as_json:
        click.echo(json.dumps(report))
        return
    _print_status(report)


def _print_status(report: dict[str, Any]) -> None:
    from rich.table import Column, Table

    from .common import _stdout_console

    out = _stdout_console()
    table = Table(Column("TAG", no_wrap=True), Column("NODE", no_wrap=True), Column("URL", no_wrap=True), "STATE",
                  Column("MEMORY", justify="right"), Column("CPUS", justify="right"), box=None, pad_edge=False)
    for info in report["nodes"]:
        table.add_row(info["tag"], info["node_id"][:SHORT_ID], info["url"], _state(info),
                      f"{info.get('memory_mb', 0) / 1024:,.1f} GiB", f"{info.get('cpus', 0):g}")
    out.print(table if report["nodes"] else "no fanfold node is up yet", highlight=False)
    for node_id, error in report["errors"].items():
        out.print(f"node {node_id[:SHORT_ID]}: {_summary(error)}", highlight=False, markup=False, soft_wrap=True)
    if report["errors"]:
        out.print("(whole errors: --json)", highlight=False, markup=False)
    settings = "  ".join(f"{key}={_setting(value)}" for key, value in report["config"].items()
                         if value not in (None, {}, (), []))
    out.print(f"settings: {settings}", highlight=False, markup=False, soft_wrap=True)


def _setting(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{key}={item}" for key, item in value.items())
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _state(info: dict[str, Any]) -> str:
    if not info["alive"]:
        return "node dead"
    return "running" if info.get("running") else "server down"


@ray.command(short_help="Stop every node server (their sandboxes go) and the controller.")
@_address_option
def stop(address: str) -> None:
    """Stop fanfold on the Ray cluster: every node server (which destroys its sandboxes) and the
    controller. Ray itself runs on.

    \b
    fanfold ray stop --address auto
    """
    controller = _running_controller(address)
    if controller is None:
        console.print("fanfold is not running on this Ray cluster", highlight=False)
        return
    from ..cluster import node

    count = len(_call(controller.list_nodes))
    asyncio.run(node.stop_cluster(address=None))
    console.print(f"stopped fanfold on {count} node{'' if count == 1 else 's'}", highlight=False)


@ray.command(short_help="Every node's Prometheus metrics, labelled node=\"TAG\".")
@_address_option
def metrics(address: str) -> None:
    """Print every node's Prometheus metrics, each sample labelled node="TAG".

    A Prometheus server scrapes each node's /metrics itself, with the cluster's token as bearer
    (`fanfold ray status` lists the URLs).

    \b
    fanfold ray metrics | grep fanfold_sandboxes
    """
    join(address)
    text = asyncio.run(_metrics_text())
    click.echo(text, nl=not text.endswith("\n"))


async def _metrics_text() -> str:
    from ..cluster.transport import RayTransport

    transport = RayTransport(None)
    await transport.start()
    try:
        return await transport.metrics_text()
    finally:
        await transport.close()
