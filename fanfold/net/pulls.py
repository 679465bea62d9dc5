"""Where a server tenant's image pulls may go: the registries the operator allows, under the egress
proxy's address rules (``outbound``).

A tenant names the registry in its reference, and skopeo then goes wherever that registry sends it
(blob downloads redirect to other hosts; a manifest may list a layer's URLs): it runs on an
``outbound.Route``, where a listed registry is reached at whatever address it has and any other host
only at a public address or in ``net_reachable``, on every redirect. Go never sends loopback through
a proxy: a listed registry there is reached through the route's forwarder.

With no registries listed, a tenant may pull from any registry at a public address.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Iterable

from ..errors import FanfoldError, RegistryUnavailable
from .outbound import DEFAULT_PORTS, Gate, Route, TrustedPolicy, split_host

REGISTRY_PORTS = DEFAULT_PORTS
"""The ports of a registry written without one (HTTPS, or plain HTTP when it is insecure)."""
HOW_TO_ALLOW = ("the operator lists the registries tenants may pull from with `fanfold serve --registry HOST[:PORT]`"
                " (repeatable) or FANFOLD_TENANT_REGISTRIES=HOST[:PORT],...")
PullPolicy = TrustedPolicy
"""Any public address, and the operator's registries wherever they are."""


def split_registry(text: str) -> tuple[str, int | None]:
    """``host[:port]`` (``[v6]:port``) as (lowercase host, port or None); InvalidRequest when it is not one."""
    return split_host(text, PullGate.noun, PullGate.example)


class PullGate(Gate):
    """The registries server tenants may pull from, and the way out each of their pulls takes."""

    fetch, elsewhere, how_to_allow = "pull", "a redirect, a layer's URL", HOW_TO_ALLOW
    noun, plural, example = "registry", "registries", "registry.example.com"

    def __init__(self, registries: Iterable[str] = (), **options) -> None:  # type: ignore[no-untyped-def]
        super().__init__(registries, **options)

    @property
    def registries(self) -> tuple[tuple[str, int | None], ...]:
        return self.listed

    def check(self, registry: str) -> None:
        """InvalidRequest, naming the registry and how the operator allows it, when a tenant may not pull from it."""
        self.check_host(registry)

    @contextlib.asynccontextmanager
    async def route(self, registry: str) -> AsyncIterator[Route]:
        """The way out of one tenant pull from ``registry`` (checked first), open for the block."""
        async with self.opened(registry, f"a pull from {registry}") as route:
            yield route

    def explain(self, route: Route, err: FanfoldError) -> FanfoldError:
        explained = super().explain(route, err)
        if explained is err and isinstance(err, RegistryUnavailable) and route.net.stats.bytes_down == 0:
            # the proxy's 502s alone
            return RegistryUnavailable(f"{route.target} could not be reached (no address, or nothing answered);"
                                       f" nothing was kept, try again ({err})", reached=False)
        return explained
