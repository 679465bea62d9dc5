"""The multi-agent loop: every agent's policy picks its next tool call, the env steps them all at once,
and each agent's step is recorded in its own episode as it happens.

Each agent's trajectory is an ``Episode`` of its own (its messages, token ids and loss mask, its
rewards), recorded by the single-agent loop's ``EpisodeRun``; the agents of one multi-agent episode
share ``metadata["joint_episode"]`` (``TrajectoryStore.joint_episode`` reads them back by agent), and
each names its ``metadata["agent"]``. A reply with several tool calls plays one per step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from ..errors import InvalidRequest, Retryable
from .agent import EpisodeRun, _assistant_message, _source_ids, recorded_failure
from .core import ToolCall
from .parallel import AsyncParallelSandboxEnv
from .policy import Policy, PolicyReply
from .store import TrajectoryStore
from .trajectory import Episode

Choice = tuple[PolicyReply, ToolCall | None, float]
"""An agent's next action: the reply it comes from, its tool call (None: the reply's text), the policy's seconds."""


class _Seat:
    """One agent's place in a multi-agent env: what ``EpisodeRun.record`` asks of an env."""

    def __init__(self, env: AsyncParallelSandboxEnv, agent: str) -> None:
        self.env, self.agent = env, agent

    def solved(self, total_reward: float) -> bool:
        return self.env.solved(self.agent, total_reward)


class ParallelEpisodeRun:
    """One multi-agent episode in progress: its env and one ``EpisodeRun`` per agent."""

    def __init__(self, env: AsyncParallelSandboxEnv, runs: dict[str, EpisodeRun], *, owns_env: bool = False,
                 turns: int = 0) -> None:
        self.env, self.runs, self.owns_env, self.turns = env, runs, owns_env, turns
        self._queued: dict[str, list[ToolCall]] = {agent: [] for agent in runs}
        """Tool calls of an agent's last reply still to play, one a step."""

    @property
    def joint_id(self) -> str:
        return next(iter(self.runs.values())).episode.metadata["joint_episode"]

    @property
    def episodes(self) -> dict[str, Episode]:
        """Each agent's episode."""
        return {agent: run.episode for agent, run in self.runs.items()}

    @classmethod
    async def start(cls, env: AsyncParallelSandboxEnv, policies: Policy | dict[str, Policy], *,
                    seed: int | None = None, options: dict[str, Any] | None = None,
                    store: TrajectoryStore | None = None, rollout_id: str | None = None,
                    metadata: dict[str, Any] | None = None) -> ParallelEpisodeRun:
        """Reset ``env`` and open each agent's record; ``policies`` is one per agent, or one for all."""
        if not isinstance(policies, dict):
            policies = dict.fromkeys(env.possible_agents, policies)
        missing = sorted(set(env.possible_agents) - set(policies))
        if missing:
            raise InvalidRequest(f"no policy for agents {missing} of {env.name}")
        prompts, _ = await env.reset(seed=seed, options=options)
        image_id, snapshot_id = _source_ids(env.image)
        joint_id = uuid.uuid4().hex
        runs = {}
        for agent in env.possible_agents:
            episode = Episode(task=env.task_name(), seed=seed, rollout_id=rollout_id, image_id=image_id,
                              snapshot_id=snapshot_id, metadata={"env": env.name, "agent": agent,
                                                                 "joint_episode": joint_id, **(metadata or {})})
            if store is not None:
                await asyncio.to_thread(store.begin, episode)
            messages = [{"role": "system", "content": env.system_prompts[agent]},
                        {"role": "user", "content": prompts[agent]}]
            runs[agent] = EpisodeRun(_Seat(env, agent), policies[agent], episode, messages, store)
        return cls(env, runs)

    async def turn(self) -> None:
        """One lockstep step: every live agent's next tool call, run at once, each recorded."""
        live = list(self.env.agents)
        chosen: list[Choice] = list(await asyncio.gather(*(self._choose(agent) for agent in live)))
        started = time.time()
        result = await self.env.step({agent: call if call is not None else reply.text
                                      for agent, (reply, call, _) in zip(live, chosen)})
        self.turns += 1
        for agent, (reply, call, policy_s) in zip(live, chosen):
            await self.runs[agent].record(reply, call, tuple(part[agent] for part in result),  # type: ignore[arg-type]
                                          started=started, policy_s=policy_s)

    async def _choose(self, agent: str) -> Choice:
        run = self.runs[agent]
        if self._queued[agent]:
            return PolicyReply(version=run.episode.steps[-1].policy_version), self._queued[agent].pop(0), 0.0
        started = time.time()
        reply = await run.policy.act(run.messages, self.env.tool_schemas(agent), seed=run._turn_seed())
        run.turns += 1
        run.messages.append(_assistant_message(reply))
        calls = reply.tool_calls or [None]
        self._queued[agent] = [call for call in calls[1:] if call is not None]
        return reply, calls[0], time.time() - started

    async def play(self, max_turns: int | None = None) -> dict[str, Episode]:
        """Steps until every agent is done; a failure is recorded in every agent's episode, then raised."""
        async with recorded_failure(self._finish_all, self.env if self.owns_env else None):
            while self.env.agents and (max_turns is None or self.turns < max_turns):
                await self.turn()
        return self.episodes

    async def fork(self, count: int) -> list[ParallelEpisodeRun]:
        """``count`` branches of this episode as it stands (``env.fork``), each to be played on its own:
        every agent's episode in a branch records its parent and fork step, under a joint id of its own."""
        branches = []
        for number, env in enumerate(await self.env.fork(count), 1):
            joint = {"joint_episode": uuid.uuid4().hex, "joint_parent": self.joint_id}
            runs = {agent: await run.branch(_Seat(env, agent), number, metadata=joint)
                    for agent, run in self.runs.items()}
            branch = ParallelEpisodeRun(env, runs, owns_env=True, turns=self.turns)
            branch._queued = {agent: list(calls) for agent, calls in self._queued.items()}
            branches.append(branch)
        return branches

    async def _finish_all(self, outcome: str, *, error: str) -> None:
        for run in self.runs.values():
            await run.finish(outcome, error=error)


async def run_parallel_episode(
    env: AsyncParallelSandboxEnv, policies: Policy | dict[str, Policy], *, seed: int | None = None,
    options: dict[str, Any] | None = None, store: TrajectoryStore | None = None, rollout_id: str | None = None,
    fork_at: int | None = None, fork_count: int = 2, metadata: dict[str, Any] | None = None,
) -> list[dict[str, Episode]]:
    """Play one multi-agent episode of ``env``; returns each agent's episode, per branch when it forks.

    ``policies``: one per agent, or one for all. With ``fork_at``, after that many steps the episode
    forks (every agent's sandbox, memory and disk) into ``fork_count`` branches that play on
    independently; the first is the original episode.
    """
    run = await ParallelEpisodeRun.start(env, policies, seed=seed, options=options, store=store,
                                         rollout_id=rollout_id, metadata=metadata)
    if fork_at is None:
        return [await run.play()]
    await run.play(max_turns=fork_at)
    if not env.agents:
        return [run.episodes]
    try:
        branches = await run.fork(fork_count - 1)
    except BaseException as exc:
        await run._finish_all("infra_error" if isinstance(exc, Retryable) else "error",
                              error=f"{type(exc).__name__}: {exc}")
        raise
    results = await asyncio.gather(run.play(), *(b.play() for b in branches), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)
