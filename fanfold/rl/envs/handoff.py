"""The handoff env: two agents, each in a sandbox of its own, must cooperate across their private network.

``server`` alone holds a secret (``/srv/secret`` in its sandbox, written there by the host at reset);
``client`` must fetch it from ``http://server:PORT/secret`` and report it. Both get reward 1 when the
client reports the secret, both 0 on a wrong report; the report ends the episode for both.

Grading trusts nothing the agents' code can touch: the secret is drawn on the host from the episode's
seed and kept there, and the report (the client's action itself) is compared with it on the host; no
file or process of either sandbox takes part. The secret is masked in every observation of the
server's, so a policy that sees both agents' observations cannot pass it along without the network.
"""

from __future__ import annotations

import hmac
from typing import Any

from ... import tools as generic
from ...spec import EnvSpec
from ..core import Tool, ToolCall, ToolOutcome
from ..parallel import WAIT, AsyncParallelSandboxEnv

SECRET_PATH = "/srv/secret"
MASK = "[secret]"
SHELL_TIMEOUT_S = 30.0
"""The longest a shell command may hold up a lockstep step."""

REPORT = Tool("report", "Report the secret; this ends the episode for both agents (reward 1 each if right).",
              {"type": "object", "properties": {"secret": {"type": "string"}}, "required": ["secret"],
               "additionalProperties": False})


class HandoffEnv(AsyncParallelSandboxEnv):
    """``server`` serves the secret only it can read; ``client`` fetches it by name and reports it."""

    name = "handoff"
    possible_agents = ("server", "client")
    tools = {"server": (generic.TOOLS["shell"], WAIT), "client": (generic.TOOLS["shell"], WAIT, REPORT)}
    system_prompts = {
        agent: (f"You are the agent `{agent}`, one of two agents (`server` and `client`), each in a Linux sandbox "
                "of its own; the two sandboxes share a private network where each reaches the other by name. "
                "Act through tool calls; both agents act at once, one tool call each per step.")
        for agent in possible_agents
    }
    max_steps = 8

    @classmethod
    def env_spec(cls) -> EnvSpec:
        return EnvSpec("host").run("mkdir -p /srv")

    async def begin(self, options: dict[str, Any]) -> dict[str, str]:
        port = int(options.get("port") or 8000 + self.np_random.integers(0, 1000))
        secret = "".join(f"{b:02x}" for b in self.np_random.bytes(16))
        self.task = {"id": "secret", "port": port, "secret": secret}
        await self.sandbox("server").files.write(SECRET_PATH, secret + "\n", mode=0o600)
        url = f"http://server:{port}/secret"
        return {
            "server": (f"Only your sandbox holds the secret, in {SECRET_PATH}. The agent `client` must fetch it from "
                       f"{url}: serve it there over HTTP (keep the server running in the background) until the "
                       "client has reported it. Your own tool outputs never show the secret. Call wait when you "
                       "have nothing to do."),
            "client": (f"The agent `server` is to serve a secret at {url} (it may take a step or two to come up). "
                       "Fetch it and report it with the report tool: a right report earns both agents 1, a wrong "
                       "one 0, and either ends the episode."),
        }

    async def call(self, agent: str, tool: ToolCall) -> ToolOutcome:
        if tool.name == "report":
            right = self.grade(tool.arguments["secret"])
            return ToolOutcome(f"reported: {'right' if right else 'wrong'}", reward=float(right), done=True)
        arguments = {**tool.arguments, "timeout": min(tool.arguments.get("timeout", SHELL_TIMEOUT_S), SHELL_TIMEOUT_S)}
        text = await self.sandbox(agent).run_tool("shell", arguments)
        return ToolOutcome(text.replace(self.task["secret"], MASK) if agent == "server" else text)

    async def judge(self, outcomes: dict[str, ToolOutcome]) -> dict[str, ToolOutcome]:
        """The client's report settles the server's step too: the same reward, and the end."""
        reported = outcomes.get("client")
        if reported is None or not reported.done or "server" not in outcomes:
            return outcomes
        said = f"{outcomes['server'].text}\n[the client {reported.text}; the episode is over]"
        return {**outcomes, "server": ToolOutcome(said, reward=reported.reward, done=True)}

    def grade(self, reported: str) -> bool:
        """Whether ``reported`` is this episode's secret, compared on the host (never in a sandbox)."""
        return hmac.compare_digest(reported.strip().encode(), self.task["secret"].encode())
