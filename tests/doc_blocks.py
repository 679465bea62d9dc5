"""The Python blocks of README.md and the guides in docs/, and what each fence says about running it.

A block's fence is ```` ```python ```` followed by at most one word that says how it runs:

- nothing: ``tests/test_docs.py`` runs it as a script, embedded, on the tests' state dir;
- ``server``: the same, with ``FANFOLD_URL`` and ``FANFOLD_TOKEN`` naming a real ``fanfold serve``;
- ``example=examples/NAME.py``: it is that file's text, which ``tests/test_examples.py`` runs and
  checks the output of;
- ``no-run: REASON``: it cannot run here (a Ray cluster, a remote host); the reason says why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
"""The front page and the guides (not docs/design/, the design notes, whose blocks are sketches)."""

_FENCE = re.compile(r"^```(\S*)\s*(.*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    """The line of its opening fence, counted from 1."""
    how: str
    """What its fence says after the language: "", "server", "example=PATH" or "no-run: REASON"."""
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str:
        """``run``, ``server``, ``example``, ``no-run``, or ``unknown`` for a fence this file cannot read."""
        if self.how in ("", "server"):
            return self.how or "run"
        if self.how.startswith("example="):
            return "example"
        if re.fullmatch(r"no-run: \S.*", self.how):
            return "no-run"
        return "unknown"

    @property
    def example(self) -> Path:
        return ROOT / self.how.removeprefix("example=")


def python_blocks(pages: list[Path] = PAGES) -> list[Block]:
    """Every ``python`` (or ``py``) fenced block of ``pages``, in order."""
    found = []
    for page in pages:
        lines = page.read_text().splitlines(keepends=True)
        index = 0
        while index < len(lines):
            match = _FENCE.match(lines[index])
            index += 1
            if match is None:
                continue
            start, body = index, []
            while index < len(lines) and not lines[index].startswith("```"):
                body.append(lines[index])
                index += 1
            index += 1  # the closing fence
            if match.group(1) in ("python", "py"):
                found.append(Block(page, start, match.group(2).strip(), "".join(body)))
    return found
