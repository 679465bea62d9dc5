"""The SDK: ``AsyncFleet``/``AsyncSandbox`` and their sync twins ``Fleet``/``Sandbox``."""

from ._async import AsyncFiles, AsyncFleet, AsyncSandbox
from ._sync import Files, Fleet, Sandbox

__all__ = ["AsyncFiles", "AsyncFleet", "AsyncSandbox", "Files", "Fleet", "Sandbox"]
