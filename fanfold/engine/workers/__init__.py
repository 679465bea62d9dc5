"""One host's engine as several worker processes behind a router (``EngineConfig.workers``)."""

from .router import Router

__all__ = ["Router"]
