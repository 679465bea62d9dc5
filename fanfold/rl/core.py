"""The env API's contract, read this first: ``AsyncSandboxEnv``, Gymnasium's shape over a sandbox.

An episode is one sandbox. ``reset(seed=, options=)`` gives a fresh one made from the env's
golden image (or a snapshot) and returns the task as text; ``step(action)`` runs one tool
call in it and returns ``(observation, reward, terminated, truncated, info)``. Observations
and actions are text; an action is a tool call as JSON: ``{"name": ..., "arguments": {...}}``
or a Responses API ``function_call`` item. A malformed action or a tool the model misused is
an observation the model sees (reward 0), never an exception; a fleet failure is raised
(``Retryable``), never scored.

A concrete env subclasses ``AsyncSandboxEnv``: it names its ``tools``, its golden image
(``env_spec``), what a seed makes of the task (``begin``) and what each tool does
(``call``). ``SandboxEnv`` (``fanfold.rl.env``) is the ``gymnasium.Env`` twin.
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from .._extras import require

require("rl", "fanfold's RL envs", "gymnasium", "numpy")
import numpy as np  # noqa: E402  (after the check that names the extra to install)
from gymnasium import spaces
from gymnasium.utils import seeding

from ..client import AsyncFleet, AsyncSandbox
from ..images import Image
from ..models import SnapshotInfo
from ..spec import EnvSpec
from ..errors import ToolError
from ..tools import Tool, check_arguments, load_arguments

MAX_TEXT = 16384
"""The longest observation or action, in characters; longer observations are cut."""

# Tab, newline and every character from space up to the CJK block: tool output is shown as
# it is, and anything outside (control bytes, rarer scripts) becomes U+FFFD's stand-in '?'.
CHARSET = "\t\n" + "".join(chr(c) for c in range(32, 0x3000) if c != 0x7F and not 0xD800 <= c < 0xE000)
_CHARS = frozenset(CHARSET)


def text_space() -> spaces.Text:
    """The observation and action space: text of up to ``MAX_TEXT`` characters."""
    return spaces.Text(max_length=MAX_TEXT, min_length=0, charset=CHARSET)


@functools.cache
def _shared_space(role: str) -> spaces.Text:
    # Building a Text space over this charset takes ~10 ms: every env of a process shares one per role.
    return text_space()


def as_text(value: str | bytes) -> str:
    """``value`` cut to ``MAX_TEXT`` and mapped into ``CHARSET``."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    value = value.replace("\r\n", "\n")
    if len(value) > MAX_TEXT:
        value = value[: MAX_TEXT - 40] + f"\n[... cut {len(value) - MAX_TEXT + 40} characters]"
    return "".join(ch if ch in _CHARS else "?" for ch in value)


@dataclass(frozen=True)
class ToolCall:
    """One action: which tool, with what arguments; ``call_id`` ties it to its output."""

    name: str
    arguments: dict[str, Any]
    call_id: str = ""

    def item(self) -> dict[str, Any]:
        """The Responses API ``function_call`` item."""
        return {"type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": json.dumps(self.arguments, sort_keys=True)}


@dataclass(frozen=True)
class ToolOutcome:
    """What a tool call did: the text the model sees, a reward, and whether the episode ended."""

    text: str
    reward: float = 0.0
    done: bool = False
    error: bool = False


def parse_action(action: str | dict[str, Any] | ToolCall) -> ToolCall:
    """A tool call from JSON text, a ``{"name", "arguments"}`` dict or a ``function_call`` item."""
    if isinstance(action, ToolCall):
        return action
    if isinstance(action, str):
        try:
            action = json.loads(action)
        except ValueError:
            raise ToolError('an action is a JSON tool call: {"name": "<tool>", "arguments": {...}}') from None
    if not isinstance(action, dict) or not isinstance(action.get("name"), str):
        raise ToolError('an action is a JSON object with a "name" (the tool) and "arguments"')
    arguments = load_arguments(action["name"], action.get("arguments", {}))
    return ToolCall(action["name"], arguments, str(action.get("call_id") or action.get("id") or ""))


class AsyncSandboxEnv:
    """A sandbox-backed env (async). Subclasses set ``name``, ``tools`` and ``system_prompt``
    and implement ``env_spec``, ``begin`` and ``call``.

    ``fleet`` runs the sandboxes; ``image`` is the golden image or snapshot to start from
    (default: ``env_spec()`` built on first reset); ``limits`` go to ``fleet.create``, and so does
    ``network`` (its policy; ``{"allow": [...], "record": NAME}`` records the episode's traffic, and the
    episode's metadata keeps the policy, so ``{"replay": NAME}`` re-runs it with the same answers).
    """

    name: ClassVar[str] = "sandbox"
    tools: ClassVar[tuple[Tool, ...]] = ()
    system_prompt: ClassVar[str] = "You are an agent working in a Linux sandbox through tool calls."
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
        self.sandbox: AsyncSandbox | None = None
        self.task: dict[str, Any] = {}
        self.steps = 0
        self.done = False
        self.fork_snapshot_id: str | None = None
        """The memory snapshot the last ``fork`` made (its copies start from it)."""

    @property
    def observation_space(self) -> spaces.Text:
        return _shared_space("observation")

    @property
    def action_space(self) -> spaces.Text:
        return _shared_space("action")

    # -- what a concrete env defines --------------------------------------------------------------

    @classmethod
    def env_spec(cls) -> EnvSpec:
        """The golden environment as code."""
        raise NotImplementedError

    async def begin(self, options: dict[str, Any]) -> str:
        """Set up ``self.task`` from ``self.np_random`` and ``options``; return the task prompt."""
        raise NotImplementedError

    async def call(self, tool: ToolCall) -> ToolOutcome:
        """Run one tool call (its arguments checked against the tool's schema) in ``self.sandbox``;
        raise ToolError for a misuse the model should see."""
        raise NotImplementedError

    # -- the API ----------------------------------------------------------------------------------

    @classmethod
    async def prepare(cls, fleet: AsyncFleet) -> Image:
        """Build (or find cached) the golden image; pass it as ``image=`` to skip this per env."""
        return await fleet.build(cls.env_spec())

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools as chat completions' ``tools`` list."""
        return [tool.chat_schema() for tool in self.tools]

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        """A fresh sandbox and a new task; returns ``(prompt, info)``."""
        if seed is not None or self.np_random is None:
            self.np_random, _ = seeding.np_random(seed)
        if self.image is None:
            self.image = await self.prepare(self.fleet)
        old, self.sandbox = self.sandbox, None
        labels = {"env": self.name, **self.labels}
        made, killed = await asyncio.gather(
            self.fleet.create(self.image, labels=labels, network=self.network, **self.limits), _kill(old),
            return_exceptions=True)
        if isinstance(made, BaseException):
            raise made
        self.sandbox = made  # owned before any error below, so close() still destroys it
        if isinstance(killed, BaseException):
            raise killed
        self.steps, self.done = 0, False
        prompt = await self.begin(dict(options or {}))
        return as_text(prompt), {"task": self.task_name(), "tools": [t.name for t in self.tools]}

    async def step(self, action: str | dict[str, Any] | ToolCall) -> tuple[str, float, bool, bool, dict]:
        """Run one tool call; returns ``(observation, reward, terminated, truncated, info)``."""
        if self.sandbox is None or self.done:
            raise RuntimeError("call reset() before step(), and again once an episode has ended")
        self.steps += 1
        try:
            tool = parse_action(action)
            spec = next((t for t in self.tools if t.name == tool.name), None)
            if spec is None:
                raise ToolError(f"unknown tool {tool.name!r}; the tools are {', '.join(t.name for t in self.tools)}")
            tool = ToolCall(tool.name, check_arguments(spec, tool.arguments), tool.call_id)
            outcome = await self.call(tool)
        except ToolError as exc:
            tool, outcome = None, ToolOutcome(f"error: {exc}", error=True)
        truncated = not outcome.done and self.steps >= self.max_steps
        self.done = outcome.done or truncated
        info = {"tool": tool.name if tool else None, "error": outcome.error, "step": self.steps}
        return as_text(outcome.text), float(outcome.reward), outcome.done, truncated, info

    async def fork(self, count: int) -> list[AsyncSandboxEnv]:
        """``count`` copies of this episode as it stands (sandbox memory and disk included),
        each to be stepped on its own; this env runs on."""
        if self.sandbox is None:
            raise RuntimeError("call reset() before fork()")
        forked = await self.sandbox.fork(count, cmd=None)
        self.fork_snapshot_id = forked.result.snapshot_id
        copies = []
        for child in forked.children:
            copy = type(self).__new__(type(self))
            copy.__dict__.update(self.__dict__)
            copy.sandbox, copy.task = child, dict(self.task)
            copy.np_random = np.random.default_rng(self.np_random.integers(2**63) if self.np_random else None)
            copies.append(copy)
        return copies

    def solved(self, total_reward: float) -> bool:
        """Whether an episode that ended with ``total_reward`` solved its task."""
        return total_reward > 0

    def grading_image(self) -> Image | SnapshotInfo | str:
        """What a grader's pristine sandbox is made from (``fanfold.rl.grading``): the env's golden
        image as given, else the image at the root of the episode's sandbox; never the sandbox itself."""
        if self.image is not None:
            return self.image
        if self.sandbox is None:
            raise RuntimeError("call reset() before grading")
        return self.sandbox.info.image_id

    def task_name(self) -> str:
        return f"{self.name}/{self.task.get('id', 'default')}"

    async def close(self) -> None:
        """Destroy the sandbox (idempotent)."""
        old, self.sandbox = self.sandbox, None
        await _kill(old)

    async def __aenter__(self) -> AsyncSandboxEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _kill(sandbox: AsyncSandbox | None) -> None:
    if sandbox is not None:
        await sandbox.kill()


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:12]
