"""The RL layer: sandbox envs in Gymnasium's shape, policies, the agent loop and trajectories.

    from fanfold import AsyncFleet
    from fanfold.rl import TrajectoryStore, make_async, run_episode, scripted

    async with AsyncFleet() as fleet:
        env = make_async("codefix", fleet)
        episodes = await run_episode(env, scripted("codefix"), seed=7, store=TrajectoryStore())

Multi-agent envs (one sandbox per agent, in a group on a private network) take PettingZoo's
``ParallelEnv`` shape: ``ParallelSandboxEnv("handoff")``, or ``run_parallel_episode`` for the async loop.
Fan-out is ``fleet.map(rollout_fn, items)``; tools over HTTP live under ``/v1/rollouts``. A custom
env grades with ``grade_submission``: only the submission, in a pristine sandbox of its image.
Names load on first use: the trajectory store needs only the core install, the envs and
policies the ``[rl]`` extra (gymnasium, numpy, pettingzoo).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .registration import register_when_gymnasium_loads

if TYPE_CHECKING:
    from .agent import EpisodeRun, run_episode
    from .core import AsyncSandboxEnv, Tool, ToolCall, ToolOutcome, parse_action, text_space
    from .env import ENVS, SandboxEnv, env_class, make_async
    from .envs import default_policy, scripted
    from .grading import Graded, grade_submission
    from .parallel import AsyncParallelSandboxEnv
    from .parallel_agent import ParallelEpisodeRun, run_parallel_episode
    from .parallel_env import PARALLEL_ENVS, ParallelSandboxEnv, make_parallel_async, parallel_env_class
    from .policy import OpenAIPolicy, Policy, PolicyReply, ScriptedPolicy
    from .store import TrajectoryStore
    from .trajectory import Episode, Step

_HOMES = {
    "agent": ("EpisodeRun", "run_episode"),
    "core": ("AsyncSandboxEnv", "Tool", "ToolCall", "ToolOutcome", "parse_action", "text_space"),
    "env": ("ENVS", "SandboxEnv", "env_class", "make_async"),
    "envs": ("default_policy", "scripted"),
    "grading": ("Graded", "grade_submission"),
    "parallel": ("AsyncParallelSandboxEnv",),
    "parallel_agent": ("ParallelEpisodeRun", "run_parallel_episode"),
    "parallel_env": ("PARALLEL_ENVS", "ParallelSandboxEnv", "make_parallel_async", "parallel_env_class"),
    "policy": ("OpenAIPolicy", "Policy", "PolicyReply", "ScriptedPolicy"),
    "store": ("TrajectoryStore",),
    "trajectory": ("Episode", "Step"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# Costs nothing until gymnasium loads; then gymnasium.make("fanfold/CodeFix-v0") works.
register_when_gymnasium_loads()
