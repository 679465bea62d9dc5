"""Isolation backends: the contract in ``base``, one module per backend, looked up by name."""

from __future__ import annotations

from importlib import import_module

from ..errors import InvalidRequest
from .base import Bind, ContainerSpec, Runtime

_BACKENDS = {"crun": "fanfold.runtime.oci:OciRuntime", "runc": "fanfold.runtime.oci:OciRuntime"}


def get_runtime(name: str, state_root: str) -> Runtime:
    """The backend called ``name`` (``crun``, ``runc``, or a dotted ``module:Class`` path)."""
    target = _BACKENDS.get(name, name)
    if ":" not in target:
        raise InvalidRequest(f"unknown runtime {name!r}: use crun, runc or a 'module:Class' path")
    module, _, cls = target.partition(":")
    return getattr(import_module(module), cls)(binary=name if name in _BACKENDS else None, state_root=state_root)


__all__ = ["Bind", "ContainerSpec", "Runtime", "get_runtime"]
