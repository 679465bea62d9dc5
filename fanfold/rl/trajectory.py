"""Trajectories as plain, versioned data: an ``Episode`` of ``Step``s, JSON-able, never pickled.

An episode is written step by step while a rollout runs (``outcome="running"``) and ends
with one of the other outcomes; ``TrajectoryStore`` in ``fanfold.rl.store`` keeps them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import InvalidRequest

FORMAT_VERSION = 1
"""Bumped whenever a field changes meaning or is removed; readers refuse newer versions."""

OUTCOMES = ("running", "success", "failure", "truncated", "error", "infra_error", "partial")
"""How an episode ended.

``running``: still being written. ``success``: terminated with a positive reward.
``failure``: terminated with reward <= 0 or a wrong answer. ``truncated``: hit the step
limit or its deadline. ``error``: the rollout's own code raised. ``infra_error``: the
infrastructure failed after retries. ``partial``: its writer died before finishing it.
"""

COMPLETE_OUTCOMES = ("success", "failure", "truncated")
"""Outcomes of episodes fit to train on; queries return only these unless asked otherwise."""


def check_outcome(outcome: str) -> str:
    """Return ``outcome`` if it is one of ``OUTCOMES``, else raise ``InvalidRequest``."""
    if outcome not in OUTCOMES:
        raise InvalidRequest(f"outcome must be one of {', '.join(OUTCOMES)}; got {outcome!r}")
    return outcome


@dataclass
class Step:
    """One turn: what the model said, the tool it called and what came back."""

    index: int
    model_output: str = ""
    """Text the model produced this turn."""
    tool_call: dict[str, Any] | None = None
    """A Responses API ``function_call`` item: ``type``, ``call_id``, ``name``, ``arguments`` (a JSON string)."""
    tool_result: str | None = None
    """The output text of the matching ``function_call_output``."""
    reward: float = 0.0
    token_ids: list[int] | None = None
    """The model's tokens, then the tool's."""
    logprobs: list[float] | None = None
    """Aligned with ``token_ids``; 0.0 at tool tokens."""
    loss_mask: list[int] | None = None
    """Aligned with ``token_ids``: 1 at a model token, 0 at a tool token."""
    policy_version: str | None = None
    snapshot_id: str | None = None
    """The memory snapshot taken just before this step, where the episode forked: this step (in
    every branch) is the first one played from it. Fork snapshots go once their last branch does."""
    started_at: float = 0.0
    """Unix time."""
    duration_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``InvalidRequest`` naming the problem if this step is malformed."""
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise InvalidRequest(f"step index must be a whole number >= 0, got {self.index!r}")
        lengths = {name: len(value) for name in ("token_ids", "logprobs", "loss_mask")
                   if (value := getattr(self, name)) is not None}
        if not _is_number(self.reward):
            raise InvalidRequest(f"step {self.index}: reward must be a number, got {self.reward!r}")
        if len(set(lengths.values())) > 1:
            raise InvalidRequest(f"step {self.index}: token_ids, logprobs and loss_mask must have equal lengths, got "
                                 + ", ".join(f"{name}={n}" for name, n in lengths.items()))
        if self.loss_mask is not None and not set(self.loss_mask) <= {0, 1}:
            raise InvalidRequest(f"step {self.index}: loss_mask holds only 0 (tool token) and 1 (model token)")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able copy."""
        # Not dataclasses.asdict: it copies token lists element by element, ten times slower than list().
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("token_ids", "logprobs", "loss_mask"):
            data[name] = None if data[name] is None else list(data[name])
        data["tool_call"], data["info"] = copy.deepcopy(self.tool_call), copy.deepcopy(self.info)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Step:
        """The inverse of ``to_dict``; unknown keys are refused."""
        return cls(**_known(cls, data, "step"))


@dataclass
class Episode:
    """One rollout of one task: its steps, how it ended, and where it came from."""

    task: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    seed: int | None = None
    rollout_id: str | None = None
    image_id: str | None = None
    snapshot_id: str | None = None
    """The snapshot the episode started from, if any."""
    parent_id: str | None = None
    """The episode this one forked from."""
    fork_step: int | None = None
    """The parent's step index at which this one forked."""
    outcome: str = "running"
    total_reward: float = 0.0
    error: str | None = None
    steps: list[Step] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task:
            raise InvalidRequest(f"an episode needs a task name, got {self.task!r}")
        check_outcome(self.outcome)
        if not _is_number(self.total_reward):
            raise InvalidRequest(f"total_reward must be a number, got {self.total_reward!r}")
        _check_version(self.format_version)

    @property
    def complete(self) -> bool:
        """Whether it ended in a way fit to train on (``COMPLETE_OUTCOMES``)."""
        return self.outcome in COMPLETE_OUTCOMES

    def digest(self) -> str:
        """A hash of what the episode did, shared by identical episodes whatever their ids and times."""
        return digest_of(self.task, self.seed, self.image_id, self.snapshot_id, self.steps)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able copy, steps nested."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["metadata"] = copy.deepcopy(self.metadata)
        data["steps"] = [step.to_dict() for step in self.steps]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Episode:
        """The inverse of ``to_dict``; refuses unknown keys and format versions newer than this fanfold's."""
        if isinstance(data, dict):
            _check_version(data.get("format_version", FORMAT_VERSION))  # before the keys: a newer writer may add some
        values = _known(cls, data, "episode")
        values["steps"] = [step if isinstance(step, Step) else Step.from_dict(step) for step in values.get("steps", [])]
        return cls(**values)


def digest_of(task: str, seed: int | None, image_id: str | None, snapshot_id: str | None, steps: list[Step]) -> str:
    """The digest ``Episode.digest`` returns, from its parts (the store computes it from stored rows)."""
    body = {
        "task": task, "seed": seed, "image_id": image_id, "snapshot_id": snapshot_id,
        "steps": [[s.model_output, _without_call_id(s.tool_call), s.tool_result, s.reward]
                  for s in sorted(steps, key=lambda s: s.index)],
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _without_call_id(call: dict[str, Any] | None) -> dict[str, Any] | None:
    # Servers draw call ids at random: two identical episodes differ only there.
    return None if call is None else {k: v for k, v in call.items() if k != "call_id"}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_version(version: object) -> None:
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
        raise InvalidRequest(f"trajectory format version {version!r} is not one this fanfold reads "
                             f"(1 to {FORMAT_VERSION}); a newer fanfold wrote it")


def _known(cls: type, data: dict[str, Any], what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise InvalidRequest(f"a {what} must be a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:  # refused rather than dropped: a silently lost field is lost training data
        raise InvalidRequest(f"unknown {what} field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    return dict(data)
