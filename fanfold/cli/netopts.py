"""The options that give a sandbox its network policy on the command line (``run``, ``create``, ``network``)."""

from __future__ import annotations

from typing import Any

import click


def network_options(fn):  # type: ignore[no-untyped-def]
    """``--network``, ``--allow`` and ``--deny``: a sandbox's network policy on the command line."""
    for option in reversed([
        click.option("--network", type=click.Choice(["none", "open"]), default=None,
                     help="none: loopback only (the default without --allow); open: any public address."),
        click.option("--allow", "allow", multiple=True, metavar="RULE",
                     help="What its traffic may reach through the host's proxy (repeatable): a host name, *.domain,"
                          " an address or a CIDR, each with an optional :PORT."),
        click.option("--deny", "deny", multiple=True, metavar="RULE", help="Refused even when allowed (repeatable)."),
    ]):
        fn = option(fn)
    return fn


def network_value(network: str | None, allow: tuple[str, ...], deny: tuple[str, ...]) -> Any:
    """The policy the options describe."""
    if network == "none" and (allow or deny):
        raise click.UsageError("--network none takes no --allow or --deny rules")
    if network == "open":
        return {"open": True, "allow": [], "deny": list(deny)} if deny else "open"
    if allow or deny:
        return {"allow": list(allow), "deny": list(deny)}
    return "none"
