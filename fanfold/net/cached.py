"""The cache path: an immutable download (``cache.cacheable``) answered from the shared cache after the
policy's check; a miss is fetched by the forwarding path, which keeps it as it streams."""

from __future__ import annotations

import h11

from .forward import Forwarding
from .heads import Target, origin_form
from .policy import NetworkPolicy
from .record import Taps


class Caching(Forwarding):
    """Answers immutable downloads from the shared cache."""

    async def _from_cache(self, request: h11.Request, target: Target, what: str, policy: NetworkPolicy,
                          taps: Taps) -> bool:
        """Answer from the cache (after the policy's check) and True; False on a miss, to be fetched."""
        cache = self.proxy.cache
        assert cache is not None
        await self._admit(what, target.host, target.port, policy, lookup=True)
        await cache.wait_for(target.url)  # the same file on its way in for another sandbox: fetched once
        hit = cache.lookup(target.url)
        if hit is None:
            self.stats.cache_misses += 1
            return False
        body = await self._read_body(request, taps)
        body.handle.close()
        self.stats.cache_hits += 1
        self.stats.cache_bytes += hit.size
        head = origin_form(request, target, None)
        taps.request(head.method.decode("latin-1"), target.url, head.headers.raw_items())
        await self._serve_stored(request.method, 200, hit.headers, hit.path, taps)
        return True
