"""Where a server tenant's builds may clone from (a spec's ``repo`` step): the git hosts the operator
allows, over https or http only, under the egress proxy's address rules (``outbound``).

git runs on an ``outbound.Route`` (``images.git`` points it at the route's proxy and allows no other
transport: no ssh, git://, file:// or ``ext::``), so every connection it opens, a redirect's too, is
checked on the address it connects to. The git hosts are a list of their own, not the registries':
an operator who lets tenants pull from a registry does not thereby let them clone from its host.

With no git hosts listed, a tenant may clone from any host at a public address.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator
from urllib.parse import urlsplit

from ..errors import InvalidRequest
from .outbound import Gate, Route

SCHEMES = {"https": 443, "http": 80}
"""The transports a tenant's git may use, and their default ports."""
HOW_TO_ALLOW = ("the operator lists the git hosts tenants may clone from with `fanfold serve --git-host HOST[:PORT]`"
                " (repeatable) or FANFOLD_TENANT_GIT_HOSTS=HOST[:PORT],...")


def url_host(url: str) -> str:
    """The ``host[:port]`` an https or http git URL names (its default port left out); InvalidRequest,
    saying what a tenant may clone instead, for any other URL."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise InvalidRequest(f"repo source {url!r} is not a URL git can clone: {err}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES or not parts.hostname:
        raise InvalidRequest(f"repo source {url!r} is not an https:// or http:// URL: a server's tenants clone"
                             " over https or http only (not ssh, git://, file:// or a local path), through the"
                             " server's egress rules")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return host if port in (None, SCHEMES[scheme]) else f"{host}:{port}"


class GitGate(Gate):
    """The git hosts server tenants may clone from, and the way out each of their git commands takes
    (``images.git.Gate``)."""

    fetch, elsewhere, how_to_allow = "clone", "a redirect", HOW_TO_ALLOW
    noun, plural, example = "git host", "git hosts", "git.example.com"

    def check(self, url: str) -> None:
        """InvalidRequest, naming the URL's host and how the operator allows it, when a tenant may not clone ``url``."""
        self.check_host(url_host(url))

    @contextlib.asynccontextmanager
    async def route(self, url: str) -> AsyncIterator[Route]:
        """The way out of one tenant git command on ``url`` (checked first), open for the block."""
        async with self.opened(url_host(url), f"a clone of {url}") as route:
            yield route
