"""The options that give a sandbox its network policy on the command line (``run``, ``create``, ``network``)."""

from __future__ import annotations

import functools
from typing import Any

import click

OPTIONS = ("allow", "deny", "record", "replay", "live")


def network_options(fn):  # type: ignore[no-untyped-def]
    """``--network``, ``--allow``, ``--deny``, ``--record``, ``--replay`` and ``--live``, handed to the command
    as one ``network`` argument: the policy they describe, or None when none of them was given."""

    @functools.wraps(fn)
    def with_policy(*args: Any, network: str | None, **kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name in OPTIONS}
        return fn(*args, network=network_value(network, **given), **kwargs)

    for option in reversed([
        click.option("--network", type=click.Choice(["none", "open"]), default=None,
                     help="none: loopback only (the default without --allow); open: any public address."),
        click.option("--allow", "allow", multiple=True, metavar="RULE",
                     help="What its traffic may reach through the host's proxy (repeatable): a host name, *.domain,"
                          " an address or a CIDR, each with an optional :PORT."),
        click.option("--deny", "deny", multiple=True, metavar="RULE", help="Refused even when allowed (repeatable)."),
        click.option("--record", metavar="NAME", default=None,
                     help="Store every request and answer through the proxy as recording NAME (`fanfold recordings`)."),
        click.option("--replay", metavar="NAME", default=None,
                     help="Answer from recording NAME with no outside access (a request not in it: 502)."),
        click.option("--live", is_flag=True, help="With --replay: requests not in the recording go out under --allow."),
    ]):
        with_policy = option(with_policy)
    return with_policy


def network_value(network: str | None, allow: tuple[str, ...] = (), deny: tuple[str, ...] = (),
                  record: str | None = None, replay: str | None = None, live: bool = False) -> Any:
    """The policy the options describe; None when they describe none (no option given)."""
    if network == "none" and (allow or deny or record or replay or live):
        raise click.UsageError("--network none takes no --allow, --deny, --record or --replay")
    if network == "open" and allow:
        raise click.UsageError("--network open reaches every public address, so --allow would narrow nothing:"
                               " give --allow rules alone to reach only those, or --network open (with --deny)")
    if live and not replay:
        raise click.UsageError("--live lets a replay's misses out: it goes with --replay NAME")
    extra = {key: value for key, value in (("record", record), ("replay", replay), ("live", live)) if value}
    if network == "open":
        return {"open": True, "allow": [], "deny": list(deny), **extra} if deny or extra else "open"
    if allow or deny or extra:
        return {"allow": list(allow), "deny": list(deny), **extra}
    return network
