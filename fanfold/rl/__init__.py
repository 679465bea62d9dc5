"""The RL layer: sandbox envs in Gymnasium's shape, policies, the agent loop and trajectories.

    from fanfold import AsyncFleet
    from fanfold.rl import TrajectoryStore, make_async, run_episode, scripted

    async with AsyncFleet() as fleet:
        env = make_async("codefix", fleet)
        episodes = await run_episode(env, scripted("codefix"), seed=7, store=TrajectoryStore())

Fan-out is ``fleet.map(rollout_fn, items)``; tools over HTTP live under ``/v1/rollouts``.
"""

from .agent import EpisodeRun, run_episode
from .core import AsyncSandboxEnv, Tool, ToolCall, ToolOutcome, parse_action, text_space
from .env import ENVS, SandboxEnv, env_class, make_async
from .policy import OpenAIPolicy, Policy, PolicyReply, ScriptedPolicy, default_policy, scripted
from .store import TrajectoryStore
from .trajectory import Episode, Step

__all__ = [
    "ENVS", "AsyncSandboxEnv", "Episode", "EpisodeRun", "OpenAIPolicy", "Policy",
    "PolicyReply", "SandboxEnv", "ScriptedPolicy", "Step", "Tool", "ToolCall", "ToolOutcome", "TrajectoryStore",
    "default_policy", "env_class", "make_async", "parse_action", "run_episode", "scripted", "text_space",
]
