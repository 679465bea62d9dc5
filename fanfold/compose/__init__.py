"""Compose files as sandbox groups: each service a member, built from its ``image`` or ``build``.

``load`` reads a file (YAML, ``.env``, ``${VAR}``, the Compose spec's validation, fanfold's subset);
``plan`` turns it into an EnvSpec per service and the group's members. Keys fanfold cannot honour
are refused by name (InvalidSpec), never ignored.
"""

from .load import SERVICE_KEYS, TOP_KEYS, ComposeFile, load, parse
from .translate import PROJECT_LABEL, ComposePlan, ServicePlan, plan

__all__ = ["PROJECT_LABEL", "SERVICE_KEYS", "TOP_KEYS", "ComposeFile", "ComposePlan", "ServicePlan", "load", "parse",
           "plan"]
