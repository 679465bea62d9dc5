"""The envs that ship: ``codefix`` (fix a project's failing tests), ``corpus`` (find documents),
``swefix`` (fix a real project's bug, on a task image) and the multi-agent ``handoff`` (one agent serves
a secret, the other fetches it across their private network)."""

from __future__ import annotations

from ...config import env_policy_url
from ...errors import InvalidRequest
from ..policy import OpenAIPolicy, ScriptedPolicy
from .scripts import codefix, corpus, handoff, swefix

SCRIPTS = {"codefix": codefix, "corpus": corpus, "handoff": handoff, "swefix": swefix}
"""The scripted policy of each env, by the env's short name."""


def scripted(env: str) -> ScriptedPolicy:
    """The scripted policy that ships for env ``env`` (``codefix``, ``corpus``, ``handoff``, ``swefix``)."""
    if env not in SCRIPTS:
        raise InvalidRequest(f"no scripted policy for env {env!r}; there are: {', '.join(SCRIPTS)}")
    return ScriptedPolicy(SCRIPTS[env])


def default_policy(env: str, *, url: str | None = None, model: str | None = None) -> OpenAIPolicy | ScriptedPolicy:
    """The policy server at ``url`` (default ``FANFOLD_POLICY_URL``), or else env ``env``'s scripted policy."""
    url = url or env_policy_url()
    return OpenAIPolicy(url, model=model) if url else scripted(env)
