"""The git of a build's ``repo`` steps: ``ls-remote`` resolves a ref, ``clone`` and ``checkout`` fetch it.

The host's own builds run git as the operator would: its config, its credentials, any transport. A
server tenant's build passes a ``Gate`` (``fanfold.net.clones``): its URL is checked first, and git
runs on a ``Route`` of the gate's, in a network namespace whose one way out is the egress proxy
(``http.proxy``), over https and http only (``GIT_ALLOW_PROTOCOL``: no ssh, git://, file:// or
``ext::``, for a submodule or a redirect either), with none of the host's git config or credentials.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import AbstractAsyncContextManager
from typing import AsyncIterator, Callable, Protocol

from ..errors import BuildFailed, FanfoldError, HostNotReady, InvalidSpec
from ..host import spawn
from .registry import NO_HOME, Route as ToolRoute

LS_REMOTE_TIMEOUT_S = 120
CLONE_TIMEOUT_S = 1800
TENANT_PROTOCOLS = "http:https"


class Route(ToolRoute, Protocol):
    """Where a tenant's git goes out (``fanfold.net.outbound.Route``)."""

    @property
    def proxy_url(self) -> str:
        """The proxy every connection goes through, as git inside the route reaches it."""

    def explain(self, err: FanfoldError) -> FanfoldError:
        """The error a failed git command raises: what the route refused, when it refused something."""


class Gate(Protocol):
    """Where a server tenant's repo steps may clone from (``fanfold.net.clones.GitGate``)."""

    def check(self, url: str) -> None:
        """InvalidRequest, saying why and how the operator allows it, when a tenant may not clone ``url``."""

    def route(self, url: str) -> AbstractAsyncContextManager[Route]:
        """The way out of git commands on ``url`` (checked first), open for the block."""


def _is_commit(ref: str) -> bool:
    return len(ref) == 40 and all(c in "0123456789abcdef" for c in ref)


async def resolve_commit(src: str, ref: str, gate: Gate | None = None) -> str:
    """The commit ``ref`` names in the repository at ``src`` (a commit names itself); InvalidSpec when
    it names none. With ``gate``, ``src`` is checked even when nothing is fetched."""
    if gate is not None:
        gate.check(src)
    if _is_commit(ref):
        return ref

    def failed(done: spawn.Finished | None) -> FanfoldError:
        if done is None:
            return InvalidSpec(f"git repository {src!r} did not answer within {LS_REMOTE_TIMEOUT_S} s")
        return InvalidSpec(f"cannot resolve {ref!r} in git repository {src!r}: {_said(done)[-300:]}")

    async with _route(gate, src) as route:
        found = (await _git(["ls-remote", "--", src, ref], route, LS_REMOTE_TIMEOUT_S, failed)).split()
        if not found:
            raise _explained(route, failed(spawn.Finished(0, b"", f"no ref {ref!r} there".encode())))
    return found[0]


async def clone(src: str, dst: str, commit: str, *, step: str, gate: Gate | None = None) -> None:
    """Clone ``src`` into ``dst`` and check out ``commit``; BuildFailed (or what ``gate`` refused) when git fails."""

    def failed(done: spawn.Finished | None) -> FanfoldError:
        said = f"git did not finish within {CLONE_TIMEOUT_S} s" if done is None else _said(done)
        return BuildFailed(f"build step {step!r} failed: {said[-1000:]}", step=step,
                           exit_code=None if done is None else done.returncode, output_tail=said[-2000:])

    async with _route(gate, src) as route:  # the checkout too: a lazy fetch or a filter would go out
        for args in (["clone", "--quiet", "--no-hardlinks", "--", src, dst],
                     ["-C", dst, "checkout", "--quiet", "--detach", commit]):
            await _git(args, route, CLONE_TIMEOUT_S, failed)


@contextlib.asynccontextmanager
async def _route(gate: Gate | None, url: str) -> AsyncIterator[Route | None]:
    if gate is None:
        yield None
    else:
        async with gate.route(url) as route:
            yield route


async def _git(args: list[str], route: Route | None, timeout: float,
               failed: Callable[[spawn.Finished | None], FanfoldError]) -> str:
    """git ``args`` (on ``route``, when given); its stdout, or the error ``failed`` makes of how it
    ended (None: it timed out), explained by the route."""
    argv, env, fds = ["git", *args], None, None
    if route is not None:
        argv, env, fds = route.command(argv), tenant_env(route), route.fds
    try:
        done = await spawn.run(argv, fds=fds, timeout=timeout, env=env)
    except FileNotFoundError:
        raise HostNotReady(f"{argv[0]} is missing, needed for a build's repo steps: apt-get install git") from None
    except TimeoutError:
        raise _explained(route, failed(None)) from None
    if done.returncode != 0:
        raise _explained(route, failed(done))
    return done.stdout.decode(errors="replace")


def _said(done: spawn.Finished) -> str:
    return done.stderr.decode(errors="replace").strip()


def _explained(route: Route | None, err: FanfoldError) -> FanfoldError:
    return err if route is None else route.explain(err)


def tenant_env(route: Route) -> dict[str, str]:
    """A tenant's git's environment: this process's, less every git and ssh setting and config file of
    the host's, pointed at ``route``'s proxy, over https and http only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "SSH_"))}
    env.update(HOME=NO_HOME, XDG_CONFIG_HOME=NO_HOME, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull,
               GIT_TERMINAL_PROMPT="0", GIT_ALLOW_PROTOCOL=TENANT_PROTOCOLS)
    config = {"http.proxy": route.proxy_url, "protocol.allow": "never", "protocol.http.allow": "always",
              "protocol.https.allow": "always", "credential.helper": ""}
    env["GIT_CONFIG_COUNT"] = str(len(config))
    for index, (key, value) in enumerate(config.items()):
        env[f"GIT_CONFIG_KEY_{index}"], env[f"GIT_CONFIG_VALUE_{index}"] = key, value
    return route.environment(env)
