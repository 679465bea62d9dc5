"""Grader programs that run inside a pristine grading sandbox, written there by the host: ``kit``
(the trusted side's tools), ``calls`` and ``suite`` (what runs as the unprivileged user), and the
trusted graders of the envs that ship (``codefix``, ``swefix``). Standard library only."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
SANDBOX_DIR = "/opt/fanfold-grader"
"""Where the host writes them in the grading sandbox."""


def programs(*names: str) -> dict[str, bytes]:
    """The named programs (``kit``, ``calls``, ...) as files for ``grade_submission``'s ``trusted_files``."""
    return {f"{SANDBOX_DIR}/{name}.py": (HERE / f"{name}.py").read_bytes() for name in names}
