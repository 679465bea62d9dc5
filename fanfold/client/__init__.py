"""The SDK: ``AsyncFleet``/``AsyncSandbox`` and their sync twins ``Fleet``/``Sandbox``.

Also here for what builds on the SDK: ``HttpTransport`` (one server's, loaded on first use) and its
lease ``LEASE_TTL_S``, which the Ray cluster's transport drives one per node, and ``ray_address``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._async import AsyncFiles, AsyncFleet, AsyncFork, AsyncSandbox, ray_address
from ._fanout import AsyncRollouts, RolloutResult, RolloutStats
from ._group import AsyncGroup
from ._process import AsyncProcess
from ._sync import Files, Fleet, Fork, Group, Process, Rollouts, Sandbox

if TYPE_CHECKING:
    from ._http import LEASE_TTL_S, HttpTransport

__all__ = [
    "AsyncFiles", "AsyncFleet", "AsyncFork", "AsyncGroup", "AsyncProcess", "AsyncRollouts", "AsyncSandbox", "Files",
    "Fleet", "Fork", "Group", "HttpTransport", "LEASE_TTL_S", "Process", "RolloutResult", "RolloutStats", "Rollouts", "Sandbox", "ray_address",
]


def __getattr__(name: str) -> Any:
    # The HTTP transport (and h11 under it) loads only when asked for: an embedded fleet never needs it.
    if name in ("HttpTransport", "LEASE_TTL_S"):
        from . import _http

        return getattr(_http, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
