"""``SandboxEnv``: the ``gymnasium.Env`` twin of an ``AsyncSandboxEnv``, and envs looked up by name."""

from __future__ import annotations

from typing import Any

from .._extras import require

require("rl", "fanfold's RL envs", "gymnasium", "numpy")
import gymnasium  # noqa: E402  (after the check that names the extra to install)

from ..client import AsyncFleet, Fleet
from .core import AsyncSandboxEnv, ToolCall
from .registration import load_env

ENVS = {
    "codefix": "fanfold.rl.envs.codefix:CodeFixEnv",
    "corpus": "fanfold.rl.envs.corpus:CorpusSearchEnv",
    "swefix": "fanfold.rl.envs.swefix:SWEFixEnv",
}
"""Short names of the envs that ship; ``env_class`` also takes ``package.module:Class``."""


def env_class(name: str | type[AsyncSandboxEnv]) -> type[AsyncSandboxEnv]:
    """An env class from a short name (``codefix``, ``corpus``) or a ``module:Class`` path."""
    return load_env(name, ENVS, AsyncSandboxEnv)


def make_async(name: str | type[AsyncSandboxEnv], fleet: AsyncFleet, **kwargs: Any) -> AsyncSandboxEnv:
    """An async env by name on ``fleet``; ``kwargs`` go to its constructor."""
    return env_class(name)(fleet, **kwargs)


class SandboxEnv(gymnasium.Env):
    """A ``gymnasium.Env`` over a sandbox: ``SandboxEnv("codefix")``.

    ``fleet`` is a sync ``Fleet`` (default: an embedded one this env owns and closes);
    other keyword arguments go to the async env (``image=``, ``max_steps=``, ``limits=``).
    """

    metadata = {"render_modes": []}

    def __init__(self, env: str | type[AsyncSandboxEnv] = "codefix", *, fleet: Fleet | None = None,
                 **kwargs: Any) -> None:
        self._owns_fleet = fleet is None
        self.fleet = fleet if fleet is not None else Fleet()
        self.fleet.start()
        self.inner = make_async(env, self.fleet.aio, **kwargs)
        self.observation_space = self.inner.observation_space
        self.action_space = self.inner.action_space

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.inner.tool_schemas()

    @property
    def sandbox_id(self) -> str | None:
        return self.inner.sandbox.id if self.inner.sandbox else None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        """A fresh sandbox and a new task; returns ``(prompt, info)``."""
        super().reset(seed=seed)
        self.inner.np_random = self.np_random  # one generator, so Gymnasium's seeding rules hold
        return self.fleet.call(self.inner.reset(options=options))

    def step(self, action: str | dict[str, Any] | ToolCall) -> tuple[str, float, bool, bool, dict]:
        """Run one tool call; returns ``(observation, reward, terminated, truncated, info)``."""
        return self.fleet.call(self.inner.step(action))

    def close(self) -> None:
        """Destroy the sandbox, and the fleet if this env made it (idempotent)."""
        if self.fleet.started:
            self.fleet.call(self.inner.close())
        if self._owns_fleet:
            self.fleet.close()

