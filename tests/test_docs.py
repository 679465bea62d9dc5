"""Every Python block of README.md and docs/*.md runs as written (see ``doc_blocks`` for the fences):
each as a script in a fresh directory, against the real runtime on the tests' state dir, or against
a real ``fanfold serve`` where its fence says ``server``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import STATE_DIR, Server
from doc_blocks import ROOT, python_blocks

BLOCKS = python_blocks()
RUNNABLE = [block for block in BLOCKS if block.kind in ("run", "server")]
MOST_NOT_RUN = 2
"""A guide's examples run in the suite; one that cannot run here says why, and stays rare."""


def test_every_block_says_how_it_runs():
    assert RUNNABLE, "no runnable block found: the fence parser is broken"
    unknown = [f"{block.name}: ```python {block.how}" for block in BLOCKS if block.kind == "unknown"]
    assert unknown == [], "fences this suite cannot read (see tests/doc_blocks.py)"
    not_run = [block.name for block in BLOCKS if block.kind == "no-run"]
    assert len(not_run) <= MOST_NOT_RUN, f"too many blocks that never run: {not_run}"


def test_the_parser_reads_each_kind_of_fence(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\nprint(1)\n```\n```sh\nls\n```\n```python server\nx = 1\n```\n"
                    "```py no-run: needs a GPU\ny\n```\n```python example=examples/pool.py\nz\n```\n```python nope\n```\n")
    blocks = python_blocks([page])
    assert [(b.line, b.kind, b.code) for b in blocks] == [
        (2, "run", "print(1)\n"), (8, "server", "x = 1\n"), (11, "no-run", "y\n"), (14, "example", "z\n"), (17, "unknown", ""),
    ]
    assert blocks[3].example == ROOT / "examples" / "pool.py"


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.name for block in RUNNABLE])
def test_the_block_runs(block, tmp_path: Path, request: pytest.FixtureRequest):
    env = {k: v for k, v in os.environ.items() if k not in ("FANFOLD_URL", "FANFOLD_TOKEN", "FANFOLD_POLICY_URL")}
    env.update(FANFOLD_STATE_DIR=str(STATE_DIR), PYTHONPATH=str(ROOT))
    if block.kind == "server":
        server: Server = request.getfixturevalue("server")
        env.update(FANFOLD_URL=server.tcp_url, FANFOLD_TOKEN=server.tokens["alice"])
    script = tmp_path / "block.py"
    script.write_text(block.code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=180)
    assert done.returncode == 0, f"{block.name} failed:\n{done.stdout}{done.stderr}"
