"""An env whose reward runs a small model on a GPU, fanned out 16 rollouts wide on one GPU.

    python examples/gpu_env.py [--rollouts 16] [--gpu-shares 16]

Each rollout is an episode of ``ReviewEnv``: the policy (here a scripted one) writes a one-line
product review into its sandbox and submits it. The reward is a reward model's score of that
review: a small PyTorch network (a fixed random embedding of character trigrams, so no download)
run on the GPU, in a pristine grading sandbox of its own made from the golden image with
``gpus=1`` (``fanfold.rl.grade_submission``), never in the policy's sandbox, whose files and
processes the policy controls. The 16 grading sandboxes share the one GPU, time-sliced.

Needs a host with an NVIDIA GPU and PyTorch with CUDA in the host's ``python3`` (the ``host``
base image is the host's own /usr); elsewhere it says what is missing and exits with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from typing import Any

from fanfold import AsyncFleet, EngineConfig, InvalidRequest
from fanfold.rl import AsyncSandboxEnv, Tool, ToolCall, ToolOutcome, grade_submission
from fanfold.spec import EnvSpec

REFERENCE = "Fast, quiet and it just works: five stars, would buy again."
CANDIDATES = (
    "Fast, quiet and it simply works: five stars, I would buy it again.",
    "It broke after a week and support never answered.",
    "Quiet and fast. Works as promised, five stars.",
    "The box was blue.",
)

# The grader: it reads the review the policy submitted and scores its likeness to the reference on the GPU.
REWARD_PY = f"""\
import json, zlib, torch
REFERENCE = {REFERENCE!r}
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4096, 512), torch.nn.Tanh(), torch.nn.Linear(512, 128)).cuda()

def embed(text):
    grams = torch.zeros(4096, device="cuda")
    text = text.lower()
    for i in range(len(text) - 2):
        grams[zlib.crc32(text[i:i + 3].encode()) % 4096] += 1.0
    return net(grams / grams.norm().clamp(min=1.0))

with torch.no_grad():
    review = open("/work/review.txt", encoding="utf-8", errors="replace").read()[:2000]
    score = torch.nn.functional.cosine_similarity(embed(review), embed(REFERENCE), dim=0).clamp(min=0).item()
print(json.dumps({{"score": round(score, 4), "gpu": torch.cuda.get_device_name(0)}}))
"""


class ReviewEnv(AsyncSandboxEnv):
    """Write the review that the reward model likes best."""

    name = "review"
    tools = (
        Tool("write_review", "Write your review (one line).",
             {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
        Tool("submit", "Finish: the review written is scored.", {"type": "object", "properties": {}}),
    )
    max_steps = 4

    @classmethod
    def env_spec(cls) -> EnvSpec:
        return EnvSpec("host").run("mkdir -p /work")

    async def begin(self, options: dict[str, Any]) -> str:
        return f"Write a one-line review of a product you liked. A good one reads like: {REFERENCE!r}"

    async def call(self, tool: ToolCall) -> ToolOutcome:
        assert self.sandbox is not None
        if tool.name == "write_review":
            await self.sandbox.files.write("/work/review.txt", tool.arguments["text"])
            return ToolOutcome("written")
        graded = await grade_submission(self.fleet, self.image, self.sandbox, ["/work/review.txt"],
                                        ["python3", "/opt/reward.py"], trusted_files={"/opt/reward.py": REWARD_PY},
                                        limits={"gpus": 1, "memory_mb": 4096}, timeout=120)
        if not graded.ok:  # a crash or a faked verdict scores nothing
            return ToolOutcome(f"not scored: {graded.failure}", done=True)
        return ToolOutcome(f"scored on {graded.verdict['gpu']}", reward=float(graded.verdict["score"]), done=True)


async def rollout(fleet: AsyncFleet, image: Any, seed: int) -> float:
    async with ReviewEnv(fleet, image=image) as env:
        await env.reset(seed=seed)
        await env.step({"name": "write_review", "arguments": {"text": CANDIDATES[seed % len(CANDIDATES)]}})
        observation, reward, _, _, _ = await env.step({"name": "submit", "arguments": {}})
        print(f"rollout {seed:2d}: reward {reward:.3f}  {observation}")
        return reward


async def main(rollouts: int, shares: int) -> int:
    async with AsyncFleet(config=dataclasses.replace(EngineConfig(), gpu_shares=shares)) as fleet:
        image = await ReviewEnv.prepare(fleet)
        try:
            probe = await fleet.create(image, gpus=1)
        except InvalidRequest as err:
            print(f"gpu_env: {err}", file=sys.stderr)
            return 2
        has_torch = await probe.exec(["python3", "-c", "import torch; assert torch.cuda.is_available()"])
        await probe.kill()
        if has_torch.exit_code != 0:
            print("gpu_env: the host's python3 has no PyTorch that sees the GPU: pip install torch", file=sys.stderr)
            return 2
        rewards = await asyncio.gather(*(rollout(fleet, image, seed) for seed in range(rollouts)))
        print(f"{rollouts} rollouts on one GPU, mean reward {sum(rewards) / len(rewards):.3f}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--gpu-shares", type=int, default=16, help="sandboxes that may share one GPU")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.rollouts, args.gpu_shares)))
