"""``ParallelSandboxEnv``: the ``pettingzoo.ParallelEnv`` twin of an ``AsyncParallelSandboxEnv``, and the
multi-agent envs looked up by name."""

from __future__ import annotations

from typing import Any

from .._extras import require

require("rl", "fanfold's multi-agent envs", "gymnasium", "pettingzoo")
from gymnasium import spaces  # noqa: E402  (after the check that names the extra to install)
from gymnasium.utils import seeding
from pettingzoo import ParallelEnv

from ..client import AsyncFleet, Fleet
from ..errors import InvalidRequest
from .core import ToolCall
from .parallel import AsyncParallelSandboxEnv, StepResult
from .registration import load_env

PARALLEL_ENVS = {"handoff": "fanfold.rl.envs.handoff:HandoffEnv"}
"""Short names of the multi-agent envs that ship; ``parallel_env_class`` also takes ``package.module:Class``."""


def parallel_env_class(name: str | type[AsyncParallelSandboxEnv]) -> type[AsyncParallelSandboxEnv]:
    """A multi-agent env class from a short name (``handoff``) or a ``module:Class`` path."""
    return load_env(name, PARALLEL_ENVS, AsyncParallelSandboxEnv)


def make_parallel_async(name: str | type[AsyncParallelSandboxEnv], fleet: AsyncFleet,
                        **kwargs: Any) -> AsyncParallelSandboxEnv:
    """An async multi-agent env by name on ``fleet``; ``kwargs`` go to its constructor."""
    return parallel_env_class(name)(fleet, **kwargs)


class ParallelSandboxEnv(ParallelEnv):
    """A ``pettingzoo.ParallelEnv`` over a sandbox group: ``ParallelSandboxEnv("handoff")``.

    ``fleet`` is a sync ``Fleet`` (default: an embedded one this env owns and closes); ``render_mode``
    is None or ``"ansi"`` (``render()`` returns the last step as text); other keyword arguments go to
    the async env (``image=``, ``max_steps=``, ``limits=``, ``network=``).
    """

    metadata = {"name": "fanfold_parallel", "render_modes": ["ansi"], "is_parallelizable": True}

    def __init__(self, env: str | type[AsyncParallelSandboxEnv] = "handoff", *, fleet: Fleet | None = None,
                 render_mode: str | None = None, **kwargs: Any) -> None:
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise InvalidRequest(f"render_mode must be None or one of {self.metadata['render_modes']}, "
                                 f"got {render_mode!r}")
        env_type = parallel_env_class(env)  # before a fleet is made: an unknown name leaves nothing behind
        self._owns_fleet = fleet is None
        self.fleet = fleet if fleet is not None else Fleet()
        self.fleet.start()
        self.render_mode = render_mode
        self._wrap(env_type(self.fleet.aio, **kwargs))

    def _wrap(self, inner: AsyncParallelSandboxEnv) -> None:
        self.inner = inner
        self.metadata = {**type(self).metadata, "name": f"fanfold_{inner.name}"}
        self.possible_agents = list(inner.possible_agents)
        self._last: dict[str, str] = {}

    @property
    def agents(self) -> list[str]:
        """The live agents."""
        return list(self.inner.agents)

    @property
    def max_cycles(self) -> int:
        """Steps before every live agent is truncated (the async env's ``max_steps``)."""
        return self.inner.max_steps

    @max_cycles.setter
    def max_cycles(self, steps: int) -> None:
        self.inner.max_steps = steps

    @property
    def group_id(self) -> str | None:
        return self.inner.group.id if self.inner.group else None

    def observation_space(self, agent: str) -> spaces.Text:
        return self.inner.observation_space(agent)

    def action_space(self, agent: str) -> spaces.Text:
        return self.inner.action_space(agent)

    def tools(self, agent: str) -> list[dict[str, Any]]:
        """``agent``'s tools as chat completions' ``tools`` list."""
        return self.inner.tool_schemas(agent)

    def reset(self, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[dict[str, str], dict[str, dict]]:
        """A fresh group and a new task; returns ``(observations, infos)`` by agent."""
        if seed is not None or self.inner.np_random is None:
            self.inner.np_random, _ = seeding.np_random(seed)  # Gymnasium's seeding rules, one generator
        observations, infos = self.fleet.call(self.inner.reset(options=options))
        self._last = dict(observations)
        return observations, infos

    def step(self, actions: dict[str, str | dict[str, Any] | ToolCall]) -> StepResult:
        """Every live agent's tool call at once; returns ``(observations, rewards, terminations,
        truncations, infos)`` by agent."""
        result = self.fleet.call(self.inner.step(actions))
        self._last = dict(result[0])
        return result

    def render(self) -> str | None:
        """With ``render_mode="ansi"``, each agent's last observation as text; else nothing."""
        if self.render_mode != "ansi":
            return None
        return "\n".join(f"[{agent}]\n{text}" for agent, text in self._last.items())

    def fork(self, count: int) -> list[ParallelSandboxEnv]:
        """``count`` copies of this episode as it stands, on this env's fleet; each is closed on its own."""
        copies = []
        for inner in self.fleet.call(self.inner.fork(count)):
            copy = type(self).__new__(type(self))
            copy._owns_fleet, copy.fleet, copy.render_mode = False, self.fleet, self.render_mode
            copy._wrap(inner)
            copy._last = dict(self._last)
            copies.append(copy)
        return copies

    def close(self) -> None:
        """Destroy the group, and the fleet if this env made it (idempotent)."""
        if self.fleet.started:
            self.fleet.call(self.inner.close())
        if self._owns_fleet:
            self.fleet.close()
