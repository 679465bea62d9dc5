"""Drop-in integrations with what RL users already run: an E2B-compatible endpoint (``e2b``), a
mini-swe-agent environment (``minisweagent``), a SWE-ReX deployment (``swerex``), a Harbor environment
(``harbor``), an OpenEnv server (``openenv``), a TRL ``environment_factory`` (``trl``) and Agent RFT tool
and grader endpoints (``rft``).

Each module imports its third-party package only where it must: the server side speaks the
protocols itself and imports none of them.
"""
