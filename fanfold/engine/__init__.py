"""The engine: the one owner of every sandbox on a host."""

from .core import Engine

__all__ = ["Engine"]
