"""Two agents cooperate across their group's private network (the handoff env): ``server`` alone holds
a secret and serves it, ``client`` fetches it by name and reports it; both earn 1 when it is right."""

import asyncio

from fanfold import AsyncFleet, Fleet
from fanfold.rl import ParallelSandboxEnv, TrajectoryStore, make_parallel_async, run_parallel_episode, scripted


async def scripted_episode():
    async with AsyncFleet() as fleet:
        env = make_parallel_async("handoff", fleet)             # one sandbox per agent, in a group of their own
        store = TrajectoryStore("trajectories.db")
        try:
            [episodes] = await run_parallel_episode(env, scripted("handoff"), seed=1, store=store)
        finally:
            await env.close()
        for agent, episode in episodes.items():
            print(agent, episode.outcome, episode.total_reward, [step.tool_call["name"] for step in episode.steps])
        joint = store.joint_episode(episodes["client"].metadata["joint_episode"])
        print(sorted(joint))                                    # one trajectory per agent, one joint id


asyncio.run(scripted_episode())

# The same env in PettingZoo's ParallelEnv shape: every live agent acts at once, one tool call each.
with Fleet() as fleet:
    env = ParallelSandboxEnv("handoff", fleet=fleet)
    try:
        tasks, infos = env.reset(seed=2)
        print(env.agents, infos["client"]["tools"])
        actions = {"server": {"name": "wait", "arguments": {}},
                   "client": {"name": "report", "arguments": {"secret": "a guess"}}}
        observations, rewards, terminations, truncations, infos = env.step(actions)
        print(rewards, terminations, env.agents)               # a wrong report: 0 for both, and the end
    finally:
        env.close()
