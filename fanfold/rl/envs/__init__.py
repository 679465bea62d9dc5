"""The envs that ship: ``codefix`` (fix a project's failing tests) and ``corpus`` (find documents)."""

from .scripts import codefix, corpus

SCRIPTS = {"codefix": codefix, "corpus": corpus}
"""The scripted policy of each env, by the env's short name."""
