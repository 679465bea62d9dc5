"""Compose's interpolation: ``$VAR`` and ``${VAR...}`` in a file's values, as the Compose spec defines it.

``${VAR:-default}`` / ``${VAR-default}`` (unset or empty / unset), ``${VAR:?error}`` / ``${VAR?error}``,
``${VAR:+alt}`` / ``${VAR+alt}``, ``$$`` for a literal ``$``; a default may itself hold references.
An unset variable without a default is empty, as ``docker compose`` makes it (it only warns).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from ..errors import InvalidSpec

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPERATORS = (":-", ":?", ":+", "-", "?", "+")


def interpolate(value: Any, env: Mapping[str, str], *, path: str = "") -> Any:
    """``value`` (a loaded YAML tree) with every string's references replaced; keys stay as written."""
    if isinstance(value, str):
        return _Expander(value, env, path).text()
    if isinstance(value, dict):
        return {key: interpolate(item, env, path=f"{path}.{key}" if path else str(key)) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env, path=f"{path}[{i}]") for i, item in enumerate(value)]
    return value


class _Expander:
    def __init__(self, text: str, env: Mapping[str, str], path: str) -> None:
        self.source, self.pos, self.env, self.path = text, 0, env, path

    def fail(self, why: str) -> InvalidSpec:
        return InvalidSpec(f"{self.path}: {why} in {self.source!r}")

    def text(self, *, stop: str = "") -> str:
        """Expand up to the end, or up to an unnested ``stop`` (a default's closing brace)."""
        out = []
        while self.pos < len(self.source):
            char = self.source[self.pos]
            if char == stop:
                return "".join(out)
            self.pos += 1
            out.append(self._reference() if char == "$" else char)
        if stop:
            raise self.fail("a '${' without its closing '}'")
        return "".join(out)

    def _reference(self) -> str:
        rest = self.source[self.pos:]
        if rest.startswith("$"):
            self.pos += 1
            return "$"
        if not rest.startswith("{"):
            name = _NAME.match(rest)
            if name is None:
                return "$"  # a lone '$' stays, as Compose leaves it
            self.pos += name.end()
            return self.env.get(name.group(), "")
        self.pos += 1
        name = _NAME.match(self.source, self.pos)
        if name is None:
            raise self.fail("a '${' that does not start with a variable name")
        self.pos = name.end()
        value = self.env.get(name.group())
        if self.source.startswith("}", self.pos):
            self.pos += 1
            return value or ""
        operator = next((op for op in _OPERATORS if self.source.startswith(op, self.pos)), None)
        if operator is None:
            raise self.fail(f"bad reference to {name.group()}: use ${{NAME}}, ${{NAME:-default}},"
                            " ${NAME:?error} or ${NAME:+alternative}")
        self.pos += len(operator)
        word = self.text(stop="}")
        self.pos += 1
        set_ = value is not None and (value != "" or ":" not in operator)
        if operator.endswith("-"):
            return value if set_ else word
        if operator.endswith("+"):
            return word if set_ else ""
        if not set_:
            raise InvalidSpec(f"{self.path}: variable {name.group()} is required: {word or 'it is unset or empty'}")
        return value
