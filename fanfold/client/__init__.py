"""The SDK: ``AsyncFleet``/``AsyncSandbox`` and their sync twins ``Fleet``/``Sandbox``."""

from ._async import AsyncFiles, AsyncFleet, AsyncFork, AsyncSandbox
from ._fanout import AsyncRollouts, RolloutResult, RolloutStats
from ._sync import Files, Fleet, Fork, Rollouts, Sandbox

__all__ = [
    "AsyncFiles", "AsyncFleet", "AsyncFork", "AsyncRollouts", "AsyncSandbox", "Files", "Fleet", "Fork",
    "RolloutResult", "RolloutStats", "Rollouts", "Sandbox",
]
