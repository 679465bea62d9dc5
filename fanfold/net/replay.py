"""The replay path: a request answered from the policy's recording, never from outside; a miss is a
502 with ``X-Fanfold-Replay: miss`` (or, with ``live``, goes out unrecorded)."""

from __future__ import annotations

import h11

from .forward import Forwarding
from .heads import Target
from .policy import NetworkPolicy
from .record import Taps


class Replaying(Forwarding):
    """Answers requests from a recording."""

    async def _replay(self, request: h11.Request, target: Target, what: str, policy: NetworkPolicy) -> None:
        """Answer from the policy's recording; a miss is a 502 (or, with ``live``, goes out unrecorded)."""
        name = policy.replay
        assert name is not None
        await self._admit(what, target.host, target.port, policy, lookup=False)
        body = await self._read_body(request, keep=policy.live)  # only a live miss sends it on
        try:
            try:
                recording = self.proxy.recordings.recording(self.sandbox.scope, name) if self.proxy.recordings else None
            except (OSError, ValueError, TypeError) as err:
                await self._fail(what, f"recording {name!r} cannot be read: {err}")
            if recording is None:
                self.stats.replay_misses += 1
                await self._respond(502, f"fanfold: the sandbox replays recording {name!r}, which does not exist;"
                                         f" {what} has no answer\n", (("x-fanfold-replay", "no-recording"),))
                return
            key = (request.method.decode("latin-1"), target.url, body.sha.hexdigest())
            seen = self.sandbox.replayed[(name, key)]
            exchange = recording.find(key, seen)
            if exchange is not None and not recording.blob(exchange.response_body_sha256).is_file():
                await self._fail(what, f"recording {name!r} lacks the body {exchange.response_body_sha256}")
            if exchange is not None:
                self.sandbox.replayed[(name, key)] += 1
                self.stats.replayed += 1
                await self._serve_stored(request.method, exchange.status, exchange.response_headers,
                                         recording.blob(exchange.response_body_sha256), Taps())
                return
            self.stats.replay_misses += 1
            if policy.live:
                await self._pass_on(request, target, what, None, Taps(), body)
                return
            await self._respond(502, f"fanfold: recording {name!r} holds no answer to {what} (request body sha256"
                                     f" {key[2]}); record it again with this request, or replay with"
                                     " \"live\": true to let misses go out\n", (("x-fanfold-replay", "miss"),))
        finally:
            body.handle.close()
