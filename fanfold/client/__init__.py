"""The SDK: ``AsyncFleet``/``AsyncSandbox`` and their sync twins ``Fleet``/``Sandbox``."""

from ._async import AsyncFiles, AsyncFleet, AsyncFork, AsyncSandbox
from ._sync import Files, Fleet, Fork, Sandbox

__all__ = ["AsyncFiles", "AsyncFleet", "AsyncFork", "AsyncSandbox", "Files", "Fleet", "Fork", "Sandbox"]
