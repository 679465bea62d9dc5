"""Docker's word expansion (buildkit's shell/lex.go): quotes, backslash escapes and ``$`` forms.

A Dockerfile is read before its base image is known, so a variable only that image sets (``PATH``
after ``FROM python:3.12-slim``) cannot be expanded then. ``template`` expands what is known and
keeps such references, escaping everything else; the builder ``expand``s the result against the
image's environment, as Docker does at build time.
"""

from __future__ import annotations

import re
from typing import Mapping

_NAME = re.compile(r"[A-Za-z0-9_]")
_SPECIAL = re.compile(r"""([\\$'"}])""")


class UnknownVariable(Exception):
    """A word names a variable whose value is not known yet (``args[0]`` is its name)."""


def expand(text: str, variables: Mapping[str, str]) -> str:
    """``text`` with quotes removed and ``$VAR``, ``${VAR}``, ``${VAR:-x}``, ``${VAR:+x}``, ``${VAR:?x}``
    (and the forms without ``:``) replaced; an unset variable is empty. ValueError for bad syntax."""
    return _Lexer(text, variables, known=True).word(stop="")


def expand_known(text: str, variables: Mapping[str, str]) -> str:
    """As ``expand``, but a variable not in ``variables`` may be set later: UnknownVariable."""
    return _Lexer(text, variables, known=False).word(stop="")


def template(text: str, variables: Mapping[str, str]) -> tuple[str, bool]:
    """``text`` expanded with ``variables``, references to any other variable kept for ``expand``
    (everything else escaped); and whether any was kept."""
    lexer = _Lexer(text, variables, known=False, keep=True)
    return lexer.word(stop=""), lexer.kept


def escape(text: str) -> str:
    """``text`` as a word that expands to itself."""
    return _SPECIAL.sub(r"\\\1", text)


def check(text: str) -> None:
    """ValueError unless ``text`` is a word ``expand`` can read."""
    _Lexer(text, _AnyName(), known=True).word(stop="")


class _AnyName(dict):
    def __contains__(self, name: object) -> bool:
        return True

    def __missing__(self, name: str) -> str:
        return "x"


class _Lexer:
    def __init__(self, text: str, variables: Mapping[str, str], known: bool, keep: bool = False) -> None:
        self.text, self.pos, self.variables, self.known = text, 0, variables, known
        self.keep, self.kept = keep, False
        """keep: write unknown references back (a template) instead of raising UnknownVariable."""

    def lit(self, text: str) -> str:
        return escape(text) if self.keep else text

    def next(self) -> str:
        char = self.text[self.pos] if self.pos < len(self.text) else ""
        self.pos += 1
        return char

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def word(self, stop: str) -> str:
        out: list[str] = []
        while self.pos < len(self.text):
            char = self.peek()
            if stop and char == stop:
                self.pos += 1
                return "".join(out)
            if char == "'":
                self.pos += 1
                end = self.text.find("'", self.pos)
                if end < 0:
                    raise ValueError(f"unterminated single quote in {self.text!r}")
                out.append(self.lit(self.text[self.pos:end]))
                self.pos = end + 1
            elif char == '"':
                self.pos += 1
                out.append(self.double_quoted())
            elif char == "\\":
                self.pos += 1
                out.append(self.lit(self.next()))
            elif char == "$":
                self.pos += 1
                out.append(self.dollar())
            else:
                out.append(self.lit(self.next()))
        if stop:
            raise ValueError(f"missing '{stop}' in {self.text!r}")
        return "".join(out)

    def double_quoted(self) -> str:
        out: list[str] = []
        while True:
            char = self.next()
            if char == "":
                raise ValueError(f"unterminated double quote in {self.text!r}")
            if char == '"':
                return "".join(out)
            if char == "$":
                out.append(self.dollar())
            elif char == "\\" and self.peek() in ('"', "$", "\\"):
                out.append(self.lit(self.next()))
            else:
                out.append(self.lit(char))

    def dollar(self) -> str:
        if self.peek() != "{":
            name = self.name()
            if not name:
                return self.lit("$")
            return self.kept_reference(name, "") if self.unknown(name) else self.lit(self.variables.get(name, ""))
        self.pos += 1
        name = self.name()
        if not name:
            raise ValueError(f"bad substitution in {self.text!r}")
        char = self.next()
        if char == "}":
            return self.kept_reference(name, "") if self.unknown(name) else self.lit(self.variables.get(name, ""))
        colon = char == ":"
        operator = self.next() if colon else char
        if operator not in ("-", "+", "?"):
            raise ValueError(f"unsupported substitution ${{{name}{char}{operator}...}} in {self.text!r}:"
                             " fanfold expands $VAR, ${VAR}, ${VAR:-default}, ${VAR:+alt} and ${VAR:?message}")
        alternative = self.word(stop="}")
        if self.unknown(name):
            return self.kept_reference(name, (":" if colon else "") + operator + alternative)
        value = self.variables.get(name)
        is_set = value is not None and (value != "" or not colon)
        if operator == "-":
            return self.lit(value) if is_set else alternative  # type: ignore[arg-type]
        if operator == "+":
            return alternative if is_set else ""
        if not is_set:
            raise ValueError(f"{name}: {alternative or 'is not allowed to be unset'}")
        return self.lit(value)  # type: ignore[arg-type]

    def name(self) -> str:
        start = self.pos
        while _NAME.match(self.peek() or "-"):
            self.pos += 1
        return self.text[start:self.pos]

    def unknown(self, name: str) -> bool:
        return not self.known and name not in self.variables

    def kept_reference(self, name: str, rest: str) -> str:
        if not self.keep:
            raise UnknownVariable(name)
        self.kept = True
        return "${" + name + rest + "}"
