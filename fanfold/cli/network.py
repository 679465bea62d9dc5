"""``fanfold network`` and ``fanfold port``: a sandbox's network policy, its traffic, and its ports."""

from __future__ import annotations

import json
import threading
from typing import Any

import click

from .common import _fleet, console
from .netopts import network_options


@click.command()
@click.argument("sandbox_id")
@network_options
@click.option("--cut", is_flag=True, help="End the connections already open too (else only new ones follow it).")
@click.option("--json", "as_json", is_flag=True, help="Print the policy and traffic as one JSON object.")
@click.pass_context
def network(ctx: click.Context, sandbox_id: str, network: Any, cut: bool, as_json: bool) -> None:
    """Show a sandbox's network policy and traffic through the proxy; change the policy (--allow, --deny, --network).

    With --allow, --deny or --network the policy of SANDBOX_ID changes first, in force at once for
    new connections.

    \b
    fanfold network sb-1 --allow pypi.org --allow '*.pythonhosted.org'   # a setup phase
    fanfold network sb-1 --network none --cut                            # locked
    """
    with _fleet(ctx) as fleet:
        sandbox = fleet.get(sandbox_id)
        if network is not None:
            sandbox.set_network(network, cut=cut)
        policy, stats = sandbox.refresh().network, sandbox.network_stats()
    if as_json:
        click.echo(json.dumps({"network": policy, "traffic": stats}))
        return
    console.print(f"policy: {json.dumps(policy)}", highlight=False)
    if not stats:
        console.print("traffic: none through this engine's proxy yet", highlight=False)
        return
    console.print(f"traffic: {stats.get('connections', 0)} connections, {stats.get('requests', 0)} requests,"
                  f" {stats.get('bytes_up', 0):,} bytes up, {stats.get('bytes_down', 0):,} bytes down,"
                  f" {stats.get('denied', 0)} denied", highlight=False)
    for reason in stats.get("recent_denials", []):
        console.print(f"  denied: {reason}", highlight=False, soft_wrap=True)


@click.command()
@click.argument("sandbox_id")
@click.argument("port", type=click.IntRange(1, 65535))
@click.pass_context
def port(ctx: click.Context, sandbox_id: str, port: int) -> None:
    """Reach a port inside a sandbox from the host: print its URL (embedded: forward it until Ctrl-C).

    Against a server (--url), the URL is the server's port route (send the token) and this returns.
    Embedded, the port is forwarded from this host's loopback until Ctrl-C.
    """
    with _fleet(ctx) as fleet:
        url = fleet.get(sandbox_id).expose(port)
        click.echo(url)
        if ctx.obj["url"]:
            return
        console.print(f"forwarding {url} to port {port} of {sandbox_id}; Ctrl-C to stop", highlight=False)
        threading.Event().wait()


@click.command()
@click.option("--rm", "remove", multiple=True, metavar="NAME", help="Delete this recording (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of recordings.")
@click.pass_context
def recordings(ctx: click.Context, remove: tuple[str, ...], as_json: bool) -> None:
    """List network recordings (made with network={"record": NAME}); --rm deletes some.

    A recording holds every request and response of the rollouts that recorded into it; a sandbox
    made with network={"replay": NAME} gets the same answers with no outside access.
    """
    with _fleet(ctx) as fleet:
        for name in remove:
            fleet.delete_recording(name)
        found = fleet.recordings()
    if as_json:
        click.echo(json.dumps(found))
        return
    if not found:
        console.print("no recordings", highlight=False)
    for item in found:
        console.print(f"{item['name']}\t{item['exchanges']} exchanges\t{item['bytes']:,} bytes", highlight=False)
