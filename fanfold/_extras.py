"""Optional features and the pip extra that installs each.

The core (SDK, engine, CLI) needs only click, rich, h11 and prometheus-client; a
feature whose packages are missing raises ``MissingExtra`` naming the extra to install,
instead of a bare ``ModuleNotFoundError`` from deep inside it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import FanfoldError

EXTRAS = {
    "server": ("fastapi", "uvicorn"),
    "rl": ("gymnasium", "numpy", "aiohttp", "pettingzoo"),
    "parquet": ("pyarrow",),
    "report": ("matplotlib",),
    "net": ("dns", "cryptography"),
    "ray": ("ray",),
    "gpu": ("pynvml", "yaml"),
    "compose": ("compose_spec", "yaml", "dotenv"),
}
"""The packages each extra brings, as pyproject's ``[project.optional-dependencies]`` lists them (by module name)."""
DISTRIBUTIONS = {"compose_spec": "compose-spec", "dns": "dnspython", "dotenv": "python-dotenv", "pynvml": "nvidia-ml-py",
                 "yaml": "pyyaml"}
"""Modules whose distribution on PyPI has another name."""


class MissingExtra(FanfoldError, ImportError):
    """A feature's optional packages are not installed; the message names the extra."""

    kind = "missing_extra"


def require(extra: str, feature: str, *names: str) -> list[ModuleType]:
    """Import ``names`` (default: every package of ``extra``) for ``feature``, or raise ``MissingExtra``."""
    unknown = set(names) - set(EXTRAS[extra])
    if unknown:
        raise ValueError(f"{sorted(unknown)} are not packages of the {extra!r} extra")
    return [_import(name, extra, feature) for name in names or EXTRAS[extra]]


def _import(name: str, extra: str, feature: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        # Only the package itself missing is the user's to fix by installing; a module
        # missing deep inside an installed package is a broken install, so let it show.
        if exc.name is None or exc.name.partition(".")[0] != name:
            raise
        raise MissingExtra(f"{feature} needs {DISTRIBUTIONS.get(name, name)}, which is not installed: "
                           f"pip install 'fanfold[{extra}]'") from None
