"""The agent loop: a policy plays an env turn by turn, and every step is recorded as it happens.

``run_episode`` is what a rollout function calls. The trajectory is written step by step to
the store, so an episode cut short (killed, cancelled at its deadline, a fleet failure) is
kept, marked as what it is, and never mixed with complete ones.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from ..errors import Retryable
from ..images import Image
from ..models import SnapshotInfo
from .core import AsyncSandboxEnv, ToolCall
from .policy import Policy, PolicyReply
from .store import TrajectoryStore
from .trajectory import Episode, Step


@asynccontextmanager
async def recorded_failure(finish: Callable[..., Awaitable[None]], closing: Any = None) -> AsyncIterator[None]:
    """Record how a run inside ended if it failed (``finish(outcome, error=...)``: ``infra_error`` for a
    retryable error, ``partial`` when cancelled, else ``error``), then raise; close ``closing`` (an env) always."""
    try:
        yield
    except Retryable as exc:
        await finish("infra_error", error=f"{type(exc).__name__}: {exc}")
        raise
    except asyncio.CancelledError:
        await finish("partial", error="cancelled (deadline or shutdown) before the episode ended")
        raise
    except Exception as exc:
        await finish("error", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if closing is not None:
            await asyncio.shield(closing.close())


class EpisodeRun:
    """One episode in progress: its env, the conversation so far and its trajectory."""

    def __init__(self, env: AsyncSandboxEnv, policy: Policy, episode: Episode, messages: list[dict[str, Any]],
                 store: TrajectoryStore | None, *, owns_env: bool = False, turns: int = 0,
                 snapshot_id: str | None = None) -> None:
        self.env, self.policy, self.episode, self.messages, self.store = env, policy, episode, messages, store
        self.owns_env = owns_env
        self.done = False
        self.turns = turns
        self._snapshot_id = snapshot_id
        """The snapshot the next step starts from, when a fork made one (a branch's first step)."""

    @classmethod
    async def start(cls, env: AsyncSandboxEnv, policy: Policy, *, seed: int | None = None,
                    options: dict[str, Any] | None = None, store: TrajectoryStore | None = None,
                    rollout_id: str | None = None, metadata: dict[str, Any] | None = None) -> EpisodeRun:
        """Reset ``env`` and open the episode's record."""
        prompt, _ = await env.reset(seed=seed, options=options)
        image_id, snapshot_id = _source_ids(env.image)
        about: dict[str, Any] = {"env": env.name}
        if env.network != "none":  # its recording's name among it: a replay re-runs the episode's traffic exactly
            about["network"] = env.sandbox.info.network if env.sandbox is not None else env.network
        episode = Episode(task=env.task_name(), seed=seed, rollout_id=rollout_id, image_id=image_id,
                          snapshot_id=snapshot_id, metadata={**about, **(metadata or {})})
        if store is not None:  # SQLite writes off the event loop: other rollouts' tools run meanwhile
            await asyncio.to_thread(store.begin, episode)
        messages = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": prompt}]
        return cls(env, policy, episode, messages, store)

    async def turn(self) -> None:
        """One model turn and the tool calls it made (each a step)."""
        started = time.time()
        reply = await self.policy.act(self.messages, self.env.tool_schemas(), seed=self._turn_seed())
        policy_s = time.time() - started
        self.turns += 1
        calls = reply.tool_calls or [None]
        self.messages.append(_assistant_message(reply))
        for position, call in enumerate(calls):
            await self._act(reply if position == 0 else PolicyReply(version=reply.version), call, policy_s)
            if self.done:
                break

    async def _act(self, reply: PolicyReply, call: ToolCall | None, policy_s: float) -> None:
        started = time.time()
        action = call if call is not None else reply.text
        result = await self.env.step(action)
        await self.record(reply, call, result, started=started, policy_s=policy_s)

    async def record(self, reply: PolicyReply, call: ToolCall | None, result: tuple[str, float, bool, bool, dict],
                     *, started: float, policy_s: float) -> None:
        """Record one step: ``reply`` (its ``call``, or its text when it made none) ran in the env from
        ``started`` and gave ``result`` (``step``'s five values); ends the episode when ``result`` does."""
        obs, reward, terminated, truncated, info = result
        tool_s = time.time() - started
        if call is not None:
            self.messages.append({"role": "tool", "tool_call_id": call.call_id, "content": obs})
        else:
            self.messages.append({"role": "user", "content": obs})
        token_ids = logprobs = loss_mask = None
        if model_ids := reply.token_ids:  # the model's tokens (trained on), then the tool's (masked out)
            tool_ids = await self.policy.tokenize(obs) or []
            token_ids = model_ids + tool_ids
            logprobs = list(reply.logprobs or [0.0] * len(model_ids)) + [0.0] * len(tool_ids)
            loss_mask = [1] * len(model_ids) + [0] * len(tool_ids)
        step = Step(
            index=len(self.episode.steps), model_output=reply.text, tool_call=call.item() if call else None,
            tool_result=obs, reward=reward, token_ids=token_ids, logprobs=logprobs, loss_mask=loss_mask,
            policy_version=reply.version, snapshot_id=self._snapshot_id, started_at=started - policy_s,
            duration_s=time.time() - started + policy_s,
            info={**info, "policy_s": round(policy_s, 6), "tool_s": round(tool_s, 6)},
        )
        self._snapshot_id = None
        self.episode.steps.append(step)
        self.episode.total_reward += reward
        if self.store is not None:
            await asyncio.to_thread(self.store.add_step, self.episode.id, step)
        if terminated or truncated:
            solved = terminated and self.env.solved(self.episode.total_reward)
            await self.finish("success" if solved else "failure" if terminated else "truncated")

    async def fork(self, count: int) -> list[EpisodeRun]:
        """``count`` branches of this episode as it stands, each to be played on its own."""
        envs = await self.env.fork(count)
        snapshot_id = self.env.fork_snapshot_id
        self._snapshot_id = snapshot_id
        return [await self.branch(env, number, snapshot_id=snapshot_id) for number, env in enumerate(envs, 1)]

    async def branch(self, env: Any, number: int, *, snapshot_id: str | None = None,
                     metadata: dict[str, Any] | None = None) -> EpisodeRun:
        """This run continued on ``env`` (a fork of its env), recorded as branch ``number`` of its episode
        (``parent_id``, ``fork_step``, the steps so far); an ended run's branch is ended as it is."""
        parent = self.episode
        episode = Episode(task=parent.task, seed=parent.seed, rollout_id=parent.rollout_id, image_id=parent.image_id,
                          snapshot_id=snapshot_id or parent.snapshot_id, parent_id=parent.id,
                          fork_step=len(parent.steps), steps=[*parent.steps], total_reward=parent.total_reward,
                          metadata={**parent.metadata, "branch": number, **(metadata or {})})
        if self.done:
            episode.outcome, episode.error, episode.finished_at = parent.outcome, parent.error, parent.finished_at
        if self.store is not None:
            await asyncio.to_thread(self.store.add if self.done else self.store.begin, episode)
        branch = EpisodeRun(env, self.policy, episode, [dict(m) for m in self.messages], self.store, owns_env=True,
                            turns=self.turns, snapshot_id=snapshot_id)
        branch.done = self.done
        return branch

    async def play(self, max_turns: int | None = None) -> Episode:
        """Turns until the episode ends; a failure is recorded, then raised."""
        async with recorded_failure(self.finish, self.env if self.owns_env else None):
            # The env truncates at its max_steps, so this ends without max_turns too.
            while not self.done and (max_turns is None or self.turns < max_turns):
                await self.turn()
        return self.episode

    async def finish(self, outcome: str, *, error: str | None = None) -> None:
        """End the episode with ``outcome`` and record it (once; later calls do nothing)."""
        if self.done:
            return
        self.done = True
        self.episode.outcome, self.episode.error, self.episode.finished_at = outcome, error, time.time()
        if self.store is not None:
            # Shielded: a cancelled episode is still recorded as ended.
            await asyncio.shield(asyncio.to_thread(
                self.store.finish, self.episode.id, outcome, total_reward=self.episode.total_reward, error=error))

    def _turn_seed(self) -> int | None:
        seed = self.episode.seed
        branch = self.episode.metadata.get("branch", 0)
        return None if seed is None else (seed * 1_000_003 + self.turns * 101 + branch) % 2**31


async def run_episode(env: AsyncSandboxEnv, policy: Policy, *, seed: int | None = None,
                      options: dict[str, Any] | None = None, store: TrajectoryStore | None = None,
                      rollout_id: str | None = None, fork_at: int | None = None, fork_count: int = 2,
                      metadata: dict[str, Any] | None = None) -> list[Episode]:
    """Play one episode of ``env`` with ``policy``; returns its episodes (more than one when it forks).

    With ``fork_at``, after that many turns the episode forks (sandbox memory and disk
    included) into ``fork_count`` branches that play on independently, each with its own
    policy seed: the first branch is the original episode, the others record ``parent_id``
    and ``fork_step``.
    """
    run = await EpisodeRun.start(env, policy, seed=seed, options=options, store=store, rollout_id=rollout_id,
                                 metadata=metadata)
    if fork_at is None:
        return [await run.play()]
    await run.play(max_turns=fork_at)
    if run.done:
        return [run.episode]
    try:
        branches = await run.fork(fork_count - 1)
    except BaseException as exc:
        await run.finish("infra_error" if isinstance(exc, Retryable) else "error", error=f"{type(exc).__name__}: {exc}")
        raise
    results = await asyncio.gather(run.play(), *(b.play() for b in branches), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)


def _source_ids(image: Image | SnapshotInfo | str | None) -> tuple[str | None, str | None]:
    if isinstance(image, SnapshotInfo):
        return image.image_id, image.id
    if isinstance(image, Image):
        return image.id, None
    return (image, None) if isinstance(image, str) else (None, None)


def _assistant_message(reply: PolicyReply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.tool_calls:
        message["tool_calls"] = [{"id": c.call_id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.item()["arguments"]}}
                                 for c in reply.tool_calls]
    return message
