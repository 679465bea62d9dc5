"""TRL's ``environment_factory`` over a fanfold env::

    GRPOTrainer(..., environment_factory=environment_factory("codefix"))

TRL (1.16, experimental) calls the factory with no arguments, pools the instances and reuses
them: ``reset(**row)`` starts a rollout (here: a fresh sandbox and task) and returns text that is
appended to the row's last user message; every public method of the class is offered to the
model as a tool (its schema from ``transformers.utils.get_json_schema``, so each has typed
arguments and a Google-style docstring); ``get_reward()`` scores the finished rollout.

The class this builds has one method per tool of the env, generated from the env's tool schemas,
and keeps everything else private. A tool returns the observation the model sees (a misuse is an
observation too); once the episode has ended, further calls say so and earn nothing. Sandboxes
are destroyed when an instance is collected or the process exits, by ``_close()``, or all at once
by the class's ``_close_fleet()`` (private, like every helper: TRL would take public ones for tools).
"""

from __future__ import annotations

import inspect
import json
import keyword
import threading
import weakref
from typing import Any

from ..client import Fleet
from ..config import EngineConfig
from ..errors import InvalidRequest
from ..rl.core import AsyncSandboxEnv, Tool, ToolCall
from ..rl.env import SandboxEnv, env_class

_TYPES: dict[str, Any] = {"string": str, "integer": int, "number": float, "boolean": bool, "object": dict}
_RESERVED = {"reset", "get_reward", "self"}
_ENDED = "the episode has ended; call no more tools"


def environment_factory(env: str | type[AsyncSandboxEnv] = "codefix", *, fleet: Fleet | None = None,
                        url: str | None = None, token: str | None = None, config: EngineConfig | None = None,
                        **env_kwargs: Any) -> type:
    """A class TRL can instantiate with no arguments, one rollout at a time per instance.

    ``env`` is a short name (``codefix``, ``corpus``, ``swefix``), a ``module:Class`` path or an
    ``AsyncSandboxEnv`` subclass; ``env_kwargs`` go to its constructor (``image=``, ``max_steps=``,
    ``limits=``, ``network=``). The sandboxes run on ``fleet`` (the caller's, left open) or on one
    fleet the class shares, made on first use from ``url``/``token`` (default ``FANFOLD_URL``,
    else an embedded engine with ``config``) and closed when the process exits.

    A dataset row's ``seed`` (int) and ``options`` (dict) columns go to the env's ``reset``;
    other columns (``prompt`` among them) are ignored.
    """
    cls = env_class(env)
    if fleet is not None and (url or token or config):
        raise InvalidRequest("pass either fleet= or url=/token=/config=, not both")
    shared = _Shared(cls, fleet, {"url": url, "token": token, "config": config}, env_kwargs)
    methods = {tool.name: _tool_method(tool) for tool in cls.tools}
    name = cls.__name__.removesuffix("Env") + "Environment"
    doc = f"TRL environment over fanfold's {cls.name!r} env. {cls.system_prompt}"
    generated = type(name, (_Environment,), {"__doc__": doc, "__module__": __name__, "_shared": shared,
                                              "system_prompt": cls.system_prompt, **methods})
    for method in methods.values():
        method.__qualname__ = f"{name}.{method.__name__}"
    return generated


class _Shared:
    """What every instance of one generated class shares: the fleet, and the golden image once built."""

    def __init__(self, cls: type[AsyncSandboxEnv], fleet: Fleet | None, fleet_args: dict[str, Any],
                 env_kwargs: dict[str, Any]) -> None:
        self.cls, self.fleet, self.fleet_args, self.env_kwargs = cls, fleet, fleet_args, env_kwargs
        self.owns_fleet = fleet is None
        self.lock = threading.Lock()

    def make_env(self) -> SandboxEnv:
        with self.lock:
            if self.fleet is None:  # closed at exit by Fleet.start's own hook
                self.fleet = Fleet(self.fleet_args["url"], token=self.fleet_args["token"],
                                   config=self.fleet_args["config"])
            return SandboxEnv(self.cls, fleet=self.fleet, **self.env_kwargs)

    def close_fleet(self) -> None:
        with self.lock:
            fleet, owned = self.fleet, self.owns_fleet
            if owned:
                self.fleet = None
        if owned and fleet is not None:
            fleet.close()

    def learn_image(self, env: SandboxEnv) -> None:
        """Keep the image the first reset built, so later instances skip the build."""
        with self.lock:
            if "image" not in self.env_kwargs and env.inner.image is not None:
                self.env_kwargs = {**self.env_kwargs, "image": env.inner.image}


class _Environment:
    """The generated classes' base: ``reset``, ``get_reward`` and private helpers only, since TRL
    takes every other public function of the class for a tool."""

    _shared: _Shared
    system_prompt: str

    def __init__(self) -> None:
        self.reward = 0.0
        """The rollout's reward so far: the sum of its steps'."""
        self.done = False
        self._env: SandboxEnv | None = None
        self._finalizer: weakref.finalize | None = None

    def reset(self, **row: Any) -> str:
        """Start a rollout for a dataset row: a fresh sandbox and task; returns the task prompt."""
        if self._env is None:
            self._env = self._shared.make_env()
            # The env, not self: the finalizer must not keep the instance alive.
            self._finalizer = weakref.finalize(self, _release, self._env)
        options = row.get("options")
        if options is not None and not isinstance(options, dict):
            raise InvalidRequest(f"a row's options must be a dict, got {type(options).__name__}")
        self.reward, self.done = 0.0, True  # until the new episode has begun
        prompt, _ = self._env.reset(seed=row.get("seed"), options=options)
        self._shared.learn_image(self._env)
        self.done = False
        return prompt

    def get_reward(self) -> float:
        """The rollout's reward: the sum of its steps' rewards."""
        return self.reward

    def _step(self, name: str, arguments: dict[str, Any]) -> str:
        if self._env is None:
            raise RuntimeError("call reset() before a tool")
        if self.done:
            return _ENDED
        # Arguments the model left out arrive as None defaults; fanfold's schema check wants them absent.
        call = ToolCall(name, {key: value for key, value in arguments.items() if value is not None})
        observation, reward, terminated, truncated, _ = self._env.step(call)
        self.reward += reward
        self.done = terminated or truncated
        return observation

    def _close(self) -> None:
        """Destroy this instance's sandbox now (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
        self._env = self._finalizer = None  # a later reset() starts over with a new sandbox

    @classmethod
    def _close_fleet(cls) -> None:
        """At the end of training: close the fleet the class made (destroying every instance's
        sandbox); a caller's fleet is the caller's to close."""
        cls._shared.close_fleet()


def _release(env: SandboxEnv) -> None:
    try:
        env.close()
    except Exception:  # at exit the shared fleet may have closed first, taking the sandbox with it
        pass


def _tool_method(tool: Tool) -> Any:
    """A method ``name(self, arg: type, ...) -> str`` that runs ``tool``, with a docstring that
    ``transformers.utils.get_json_schema`` reads back as the tool's schema."""
    if not tool.name.isidentifier() or keyword.iskeyword(tool.name) or tool.name.startswith("_") \
            or tool.name in _RESERVED:
        raise InvalidRequest(f"tool {tool.name!r} cannot be a TRL tool method: rename it")
    properties = tool.parameters.get("properties", {})
    required = set(tool.parameters.get("required", ()))
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    # Python wants the required arguments first; the schema's order is kept within each group.
    for arg in sorted(properties, key=lambda a: a not in required):
        if not arg.isidentifier() or keyword.iskeyword(arg) or arg in _RESERVED:
            raise InvalidRequest(f"argument {arg!r} of tool {tool.name!r} cannot be a Python parameter")
        kind = _python_type(properties[arg])
        annotations[arg] = kind if arg in required else kind | None
        parameters.append(inspect.Parameter(arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotations[arg],
                                            default=inspect.Parameter.empty if arg in required else None))
    signature = inspect.Signature(parameters, return_annotation=str)
    name = tool.name

    def method(self: _Environment, *args: Any, **kwargs: Any) -> str:
        bound = signature.bind(self, *args, **kwargs)
        return self._step(name, {k: v for k, v in bound.arguments.items() if k != "self"})

    method.__name__ = method.__qualname__ = name
    method.__signature__ = signature  # type: ignore[attr-defined]
    method.__annotations__ = {**annotations, "return": str}
    method.__doc__ = _docstring(tool.description, {arg: properties[arg] for arg in annotations})
    return method


def _python_type(spec: dict[str, Any]) -> Any:
    kind = spec.get("type")
    if kind == "array":
        return list[_python_type(spec["items"])] if "items" in spec else list
    if kind not in _TYPES:
        raise InvalidRequest(f"a tool argument of JSON type {kind!r} has no Python type here")
    return _TYPES[kind]


def _docstring(description: str, properties: dict[str, dict[str, Any]]) -> str:
    lines = [description.strip() or "Run the tool."]
    if properties:
        lines += ["", "Args:"] + [f"    {arg}: {_describe(arg, spec)}" for arg, spec in properties.items()]
    return "\n".join(lines)


def _describe(arg: str, spec: dict[str, Any]) -> str:
    """One line: the schema's description, its bounds, and its choices as ``get_json_schema`` reads them."""
    text = " ".join(str(spec.get("description") or f"The `{arg}` argument.").split())
    bounds = [f"{word} {spec[key]:g}" for key, word in (("minimum", "at least"), ("exclusiveMinimum", "more than"),
                                                        ("maximum", "at most")) if key in spec]
    if bounds:
        text += f" ({', '.join(bounds)})"
    if "enum" in spec:
        text += f" (choices: {json.dumps(spec['enum'])})"
    return text
