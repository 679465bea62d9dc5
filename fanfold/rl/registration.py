"""Gymnasium ids of the envs that ship: ``gymnasium.make("fanfold/CodeFix-v0")``.

Gymnasium 1.x dropped its entry-point plugins (``gymnasium.envs``), so a package registers
its envs when it is imported. Importing gymnasium costs ~0.4 s, which the CLI and a remote
client should not pay, so ``register_when_gymnasium_loads`` registers right away when
gymnasium is already loaded, else at the moment it is first imported. ``load_env`` looks an env
class up by its short name or ``module:Class`` path, for the single- and the multi-agent tables.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any, TypeVar

from ..errors import InvalidRequest

E = TypeVar("E", bound=type)

GYM_IDS = {"fanfold/CodeFix-v0": "codefix", "fanfold/CorpusSearch-v0": "corpus", "fanfold/SWEFix-v0": "swefix"}
"""Gymnasium id -> the env's short name (``fanfold.rl.ENVS``)."""


def load_env(name: str | E, table: dict[str, str], base: E) -> E:
    """The env class ``name`` stands for: a short name of ``table``, a ``module:Class`` path, or a
    subclass of ``base`` itself."""
    if isinstance(name, type) and issubclass(name, base):
        return name
    target = table.get(name, name) if isinstance(name, str) else None
    if not target or ":" not in target:
        raise InvalidRequest(f"unknown env {name!r}: use one of {', '.join(table)} or 'package.module:Class'")
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise InvalidRequest(f"cannot load env {target!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise InvalidRequest(f"{target} is not an {base.__name__} subclass")
    return cls


def register_envs() -> None:
    """Register ``GYM_IDS`` with gymnasium (idempotent); the env modules load only at ``make``."""
    import gymnasium

    for env_id, name in GYM_IDS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(env_id, entry_point="fanfold.rl.env:SandboxEnv", kwargs={"env": name})


def register_when_gymnasium_loads() -> None:
    """``register_envs`` now if gymnasium is loaded, else right after its first import."""
    if "gymnasium" not in sys.modules:
        if not any(isinstance(finder, _AfterGymnasium) for finder in sys.meta_path):
            sys.meta_path.insert(0, _AfterGymnasium())
    elif sys.modules["gymnasium"] is not None:  # None: imports of it are blocked
        register_envs()


class _AfterGymnasium:
    """Finds gymnasium as the other finders would, and registers the envs once it has run.

    A meta path finder by duck typing: subclassing ``importlib.abc.MetaPathFinder`` would
    cost every ``import fanfold`` ~13 ms (importlib.abc loads importlib.resources).
    """

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "gymnasium":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the find_spec below from coming back here
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module = _then_register(spec.loader.exec_module)  # type: ignore[method-assign]
        return spec


def _then_register(exec_module: Any) -> Any:
    def exec_and_register(module: Any) -> None:
        exec_module(module)
        register_envs()

    return exec_and_register
