"""Isolation backends: the contract in ``base``, one module per backend, looked up by name."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from ..errors import InvalidRequest
from .base import Backend, Capabilities, CounterReader, Handle, SandboxSpec
from .container import Bind, ContainerSpec, Runtime
from .seccomp import PROFILES as SECCOMP_PROFILES
from .seccomp import check as check_seccomp

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..store import LayerStore

_RUNTIMES = {"crun": "fanfold.runtime.oci:OciRuntime", "runc": "fanfold.runtime.oci:OciRuntime"}
_BACKENDS = {
    "oci": "fanfold.runtime.oci_backend:OciBackend", "runsc": "fanfold.runtime.runsc_backend:RunscBackend",
    "fake": "fanfold.runtime.fake:FakeBackend",
}


def _lookup(kind: str, names: dict[str, str], name: str) -> type:
    target = names.get(name, name)
    if ":" not in target:
        raise InvalidRequest(f"unknown {kind} {name!r}: use {', '.join(names)} or a 'module:Class' path")
    module, _, cls = target.partition(":")
    try:
        return getattr(import_module(module), cls)
    except (ImportError, AttributeError) as err:
        raise InvalidRequest(f"cannot load the {kind} {name!r}: {err}") from None


def get_runtime(name: str, state_root: str) -> Runtime:
    """The OCI runtime driver called ``name`` (``crun``, ``runc``, or a dotted ``module:Class`` path)."""
    cls = _lookup("runtime", _RUNTIMES, name)
    return cls(binary=name if name in _RUNTIMES else None, state_root=state_root)  # type: ignore[no-any-return]


def get_backend(config: EngineConfig, store: LayerStore) -> Backend:
    """The backend ``config.backend`` names (``oci``, ``runsc``, ``fake``, or a dotted ``module:Class``
    path); the oci backend with ``runtime="runsc"`` is the runsc one (gVisor)."""
    name = "runsc" if config.backend == "oci" and config.runtime == "runsc" else config.backend
    cls = _lookup("backend", _BACKENDS, name)
    return cls(config, store)  # type: ignore[no-any-return]


__all__ = [
    "Backend", "Bind", "Capabilities", "ContainerSpec", "CounterReader", "Handle", "Runtime", "SECCOMP_PROFILES",
    "SandboxSpec", "check_seccomp", "get_backend", "get_runtime",
]
