"""The multi-agent env API's contract: ``AsyncParallelSandboxEnv``, PettingZoo's ``ParallelEnv`` shape
over a sandbox group.

An episode is one group (``fanfold.groups``): one sandbox per agent, the agents' sandboxes on a
private network of their own where each reaches the others by agent name. ``reset`` makes a fresh
group and returns each agent's task; ``step(actions)`` runs every live agent's action at once (in
lockstep) and returns ``(observations, rewards, terminations, truncations, infos)``, each a dict
keyed by agent. Actions and observations are text, as in the single-agent API (``fanfold.rl.core``):
a tool call as JSON, malformed ones an observation the agent sees, never an exception. An agent
that terminates or is truncated leaves ``agents``; the episode ends when none is left.

A concrete env subclasses ``AsyncParallelSandboxEnv``: it names its agents and each one's tools
and system prompt, its golden image (``env_spec``), what a seed makes of the task (``begin``),
what each tool does (``call``) and, where agents' outcomes depend on each other (a shared reward,
one agent's answer ending everyone's episode), how a step's outcomes are settled (``judge``). An
agent with nothing to do this step calls ``wait`` where its tools include ``WAIT``.
``ParallelSandboxEnv`` (``fanfold.rl.parallel_env``) is the ``pettingzoo.ParallelEnv`` twin.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from ..client import AsyncFleet, AsyncGroup, AsyncSandbox
from ..errors import InvalidRequest, ToolError
from ..groups import GroupMember
from ..images import Image
from ..models import CreateParams, Limits, SnapshotInfo
from ..spec import EnvSpec
from ..tools import check_arguments
from .core import Tool, ToolCall, ToolOutcome, _shared_space, as_text, parse_action

import numpy as np  # noqa: E402  (after .core, whose import names the extra to install when these are missing)
from gymnasium import spaces  # noqa: E402
from gymnasium.utils import seeding  # noqa: E402

WAIT = Tool("wait", "Do nothing this step (the other agents act meanwhile).",
            {"type": "object", "properties": {}, "additionalProperties": False})
"""The no-op of lockstep play: an env that lists it among an agent's tools gets it handled here."""

StepResult = tuple[dict[str, str], dict[str, float], dict[str, bool], dict[str, bool], dict[str, dict]]
"""What ``step`` returns: observations, rewards, terminations, truncations and infos, by agent."""


class AsyncParallelSandboxEnv:
    """A multi-agent env over a sandbox group (async). Subclasses set ``name``, ``possible_agents``,
    ``tools`` and ``system_prompts`` and implement ``env_spec``, ``begin`` and ``call``.

    The arguments are the single-agent env's (``AsyncSandboxEnv``): ``image`` is every agent's
    golden image (default: ``env_spec()`` built on first reset), ``limits`` each agent sandbox's,
    ``network`` the group's egress policy (its members always reach each other).
    """

    name: ClassVar[str] = "parallel"
    possible_agents: ClassVar[tuple[str, ...]] = ()
    """The agents, each also its sandbox's name on the group's network (a DNS label)."""
    tools: ClassVar[dict[str, tuple[Tool, ...]]] = {}
    """Agent -> the tools it may call."""
    system_prompts: ClassVar[dict[str, str]] = {}
    """Agent -> its system prompt."""
    max_steps: int = 20

    def __init__(
        self, fleet: AsyncFleet, *, image: Image | SnapshotInfo | str | None = None, max_steps: int | None = None,
        limits: dict[str, Any] | None = None, labels: dict[str, str] | None = None, network: Any = "none",
    ) -> None:
        self.fleet = fleet
        self.image = image
        self.network = network
        self.limits = {"memory_mb": 256, "pids": 128, **(limits or {})}
        self.labels = labels or {}
        if max_steps is not None:
            self.max_steps = max_steps
        self.np_random: np.random.Generator | None = None
        self.group: AsyncGroup | None = None
        self.agents: list[str] = []
        """The live agents: those that have neither terminated nor been truncated."""
        self.task: dict[str, Any] = {}
        self.steps = 0

    def observation_space(self, agent: str) -> spaces.Text:
        """The same object for every call and agent: text of up to ``MAX_TEXT`` characters."""
        self._check_agent(agent)
        return _shared_space("observation")

    def action_space(self, agent: str) -> spaces.Text:
        self._check_agent(agent)
        return _shared_space("action")

    # -- what a concrete env defines --------------------------------------------------------------

    @classmethod
    def env_spec(cls) -> EnvSpec:
        """The golden environment as code (every agent's sandbox starts from it)."""
        raise NotImplementedError

    def members(self) -> list[GroupMember]:
        """The group's members, one per agent; override to add health checks or a start order."""
        limits = Limits(**self.limits)
        return [GroupMember(name=agent, params=CreateParams(image=_image_ref(self.image), limits=limits))
                for agent in self.possible_agents]

    async def begin(self, options: dict[str, Any]) -> dict[str, str]:
        """Set up ``self.task`` from ``self.np_random`` and ``options`` (the group is up); return each
        agent's task prompt."""
        raise NotImplementedError

    async def call(self, agent: str, tool: ToolCall) -> ToolOutcome:
        """Run ``agent``'s tool call (its arguments checked) in ``self.sandbox(agent)``; raise ToolError
        for a misuse the agent should see."""
        raise NotImplementedError

    async def judge(self, outcomes: dict[str, ToolOutcome]) -> dict[str, ToolOutcome]:
        """The step's outcomes, settled together: each live agent's own outcome by default; an env
        whose agents share a reward or an end sets them here."""
        return outcomes

    # -- the API ----------------------------------------------------------------------------------

    @classmethod
    async def prepare(cls, fleet: AsyncFleet) -> Image:
        """Build (or find cached) the golden image; pass it as ``image=`` to skip this per env."""
        return await fleet.build(cls.env_spec())

    def sandbox(self, agent: str) -> AsyncSandbox:
        """``agent``'s sandbox in the current episode."""
        if self.group is None:
            raise RuntimeError("call reset() before using the agents' sandboxes")
        return self.group[agent]

    def tool_schemas(self, agent: str) -> list[dict[str, Any]]:
        """``agent``'s tools as chat completions' ``tools`` list."""
        self._check_agent(agent)
        return [tool.chat_schema() for tool in self.tools.get(agent, ())]

    async def reset(self, *, seed: int | None = None,
                    options: dict[str, Any] | None = None) -> tuple[dict[str, str], dict[str, dict]]:
        """A fresh group and a new task; returns ``(prompts, infos)`` by agent."""
        if seed is not None or self.np_random is None:
            self.np_random, _ = seeding.np_random(seed)
        if self.image is None:
            self.image = await self.prepare(self.fleet)
        old, self.group, self.agents = self.group, None, []
        if old is not None:
            await old.kill()
        self.group = await self.fleet.create_group(self.members(), network=self.network,
                                                   labels={"env": self.name, **self.labels})
        self.steps, self.agents = 0, list(self.possible_agents)
        prompts = await self.begin(dict(options or {}))
        infos = {agent: {"task": self.task_name(), "tools": [t.name for t in self.tools.get(agent, ())]}
                 for agent in self.agents}
        return {agent: as_text(prompts[agent]) for agent in self.agents}, infos

    async def step(self, actions: dict[str, str | dict[str, Any] | ToolCall]) -> StepResult:
        """Run every live agent's tool call at once; returns ``(observations, rewards, terminations,
        truncations, infos)`` for the agents that were live."""
        if self.group is None or not self.agents:
            raise RuntimeError("call reset() before step(), and again once every agent is done")
        if set(actions) != set(self.agents):
            raise InvalidRequest(f"step takes one action per live agent, {sorted(self.agents)}; got actions for "
                                 f"{sorted(actions)}")
        self.steps += 1
        live = list(self.agents)
        acted = await asyncio.gather(*(self._act(agent, actions[agent]) for agent in live), return_exceptions=True)
        for result in acted:
            if isinstance(result, BaseException):
                raise result
        tools = {agent: tool for agent, (tool, _) in zip(live, acted)}
        outcomes = await self.judge({agent: outcome for agent, (_, outcome) in zip(live, acted)})
        out_of_steps = self.steps >= self.max_steps
        observations, rewards, terminations, truncations, infos = {}, {}, {}, {}, {}
        for agent in live:
            outcome = outcomes[agent]
            observations[agent], rewards[agent] = as_text(outcome.text), float(outcome.reward)
            terminations[agent], truncations[agent] = outcome.done, not outcome.done and out_of_steps
            infos[agent] = {"tool": tools[agent], "error": outcome.error, "step": self.steps}
        self.agents = [agent for agent in live if not (terminations[agent] or truncations[agent])]
        return observations, rewards, terminations, truncations, infos

    async def _act(self, agent: str, action: str | dict[str, Any] | ToolCall) -> tuple[str | None, ToolOutcome]:
        try:
            tool = parse_action(action)
            spec = next((t for t in self.tools.get(agent, ()) if t.name == tool.name), None)
            if spec is None:
                names = ", ".join(t.name for t in self.tools.get(agent, ()))
                raise ToolError(f"unknown tool {tool.name!r}; {agent}'s tools are {names}")
            tool = ToolCall(tool.name, check_arguments(spec, tool.arguments), tool.call_id)
            if spec is WAIT:
                return tool.name, ToolOutcome("waited")
            return tool.name, await self.call(agent, tool)
        except ToolError as exc:
            return None, ToolOutcome(f"error: {exc}", error=True)

    async def fork(self, count: int) -> list[AsyncParallelSandboxEnv]:
        """``count`` copies of this episode as it stands (every agent's sandbox, memory and disk, on a
        private network of its own), each to be stepped on its own; this env runs on."""
        if self.group is None:
            raise RuntimeError("call reset() before fork()")
        copies = []
        for group in await self.group.fork(count):
            copy = type(self).__new__(type(self))
            copy.__dict__.update(self.__dict__)
            copy.group, copy.task, copy.agents = group, dict(self.task), list(self.agents)
            copy.np_random = np.random.default_rng(self.np_random.integers(2**63) if self.np_random else None)
            copies.append(copy)
        return copies

    def solved(self, agent: str, total_reward: float) -> bool:
        """Whether ``agent``, ending with ``total_reward``, did its part of the task."""
        return total_reward > 0

    def task_name(self) -> str:
        return f"{self.name}/{self.task.get('id', 'default')}"

    async def close(self) -> None:
        """Destroy the group (idempotent)."""
        old, self.group, self.agents = self.group, None, []
        if old is not None:
            await old.kill()

    async def __aenter__(self) -> AsyncParallelSandboxEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_agent(self, agent: str) -> None:
        if agent not in self.possible_agents:
            raise InvalidRequest(f"{self.name} has no agent {agent!r}: its agents are {list(self.possible_agents)}")


def _image_ref(image: Image | SnapshotInfo | str | None) -> str | None:
    """What ``CreateParams.image`` takes: an image's or a snapshot's id."""
    return getattr(image, "id", image)
