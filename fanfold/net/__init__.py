"""Sandbox networks: policies, the egress proxy (``fanfold netd``), and ports exposed to the host."""

from .policy import NetworkPolicy, Reachable, Rule

__all__ = ["NetworkPolicy", "Reachable", "Rule"]
