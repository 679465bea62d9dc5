"""The code-fix env: a small Python project whose tests fail; read, edit, run the tests, submit.

The golden image holds the project at ``/env``; every episode starts from it. The reward comes
at ``submit``: the share of the pristine tests that pass, graded in a fresh sandbox of the golden
image into which only ``stats.py`` is copied (``fanfold.rl.grading``), so nothing else the agent
did there counts (edited tests, planted files, processes left running). There a root grader
(``fanfold.rl.graders.codefix``) holds the tests as data, runs the calls in a child as ``nobody``
and compares the plain values it gets back itself: a patched test framework, an object that
equals anything or a line printed on exit earn nothing. ``test_stats.py`` (the same tests) is
what ``run_tests`` runs.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

from ...errors import FileNotFoundInSandbox, InvalidPath, ToolError
from ...spec import EnvSpec
from ..core import AsyncSandboxEnv, Tool, ToolCall, ToolOutcome
from ..grading import grade_submission
from ..graders import SANDBOX_DIR, programs
from ..graders import codefix as grader

PROJECT = Path(__file__).parent / "codefix_project"
WORKDIR = "/env"
FILES = ("stats.py", "test_stats.py")
TEST_CMD = ["/bin/sh", "-c", "python3 -B -m unittest -q test_stats 2>&1 | tail -n 60"]
GRADE_CMD = ["python3", "-I", "-B", f"{SANDBOX_DIR}/codefix.py"]
SUBMISSION = (f"{WORKDIR}/stats.py",)

_PATH = {"type": "string", "description": "a file in the project, e.g. stats.py"}
TOOLS = (
    Tool("read_file", "Show a project file with line numbers.",
            {"type": "object", "properties": {"path": _PATH}, "required": ["path"], "additionalProperties": False}),
    Tool("edit_file", "Replace one exact, unique occurrence of `old` with `new` in a project file.",
            {"type": "object", "properties": {"path": _PATH, "old": {"type": "string"}, "new": {"type": "string"}},
             "required": ["path", "old", "new"], "additionalProperties": False}),
    Tool("run_tests", "Run the project's unit tests and show the failures.",
            {"type": "object", "properties": {}, "additionalProperties": False}),
    Tool("submit", "Finish: the reward is the share of the tests that pass.",
            {"type": "object", "properties": {}, "additionalProperties": False}),
)


class CodeFixEnv(AsyncSandboxEnv):
    """Fix the failing tests of ``stats.py``; reward = passing share of the pristine tests at submit."""

    name = "codefix"
    tools = TOOLS
    system_prompt = ("You fix bugs in a Python project. Use the tools to read files, edit them, and run the "
                     "tests; call submit when the tests pass.")
    max_steps = 16

    @classmethod
    def env_spec(cls) -> EnvSpec:
        return (EnvSpec("host").workdir(WORKDIR)
                .copy(PROJECT / "stats.py", f"{WORKDIR}/stats.py")
                .copy(PROJECT / "test_stats.py", f"{WORKDIR}/test_stats.py")
                .env(PYTHONDONTWRITEBYTECODE="1"))

    async def begin(self, options: dict[str, Any]) -> str:
        self.task = {"id": "stats", "files": list(FILES)}
        return (f"The tests of the project in {WORKDIR} fail. Files: {', '.join(FILES)}. "
                "Fix stats.py so that test_stats.py passes, without changing the tests, then submit.")

    async def call(self, tool: ToolCall) -> ToolOutcome:
        args = tool.arguments
        if tool.name == "read_file":
            return ToolOutcome(_numbered(await self._read(args["path"])))
        if tool.name == "edit_file":
            return ToolOutcome(await self._edit(args["path"], args["old"], args["new"]))
        if tool.name == "run_tests":
            result = await self.sandbox.exec(TEST_CMD, timeout=30, max_output=16384)
            return ToolOutcome(result.text.strip() or f"(no output; exit {result.exit_code})")
        passed, total = await self.grade()
        return ToolOutcome(f"submitted: {passed} of {total} tests pass", reward=passed / total, done=True)

    def solved(self, total_reward: float) -> bool:
        return total_reward >= 0.999  # every test passes

    async def grade(self) -> tuple[int, int]:
        """Passing and total pristine tests against the submitted stats.py, graded in a fresh sandbox
        of the golden image; a refused submission or a grader without a verdict passes none."""
        total = len(grader.CHECKS)
        graded = await grade_submission(
            self.fleet, self.grading_image(), self.sandbox, SUBMISSION, GRADE_CMD,
            trusted_files=programs("kit", "calls", "codefix"), timeout=60, limits=self.limits)
        verdict = graded.verdict or {}
        passed = verdict.get("passed")
        if type(passed) is not int or verdict.get("total") != total or not 0 <= passed <= total:
            return 0, total
        return passed, total

    async def _read(self, path: str) -> str:
        try:
            return (await self.sandbox.files.read(_project_path(path))).decode(errors="replace")
        except (FileNotFoundInSandbox, InvalidPath) as exc:
            raise ToolError(f"cannot read {path}: {exc}") from None

    async def _edit(self, path: str, old: str, new: str) -> str:
        text = await self._read(path)
        count = text.count(old) if old else 0
        if count != 1:
            where = "is empty" if not old else f"occurs {count} times in {path}; it must occur exactly once"
            raise ToolError(f"`old` {where}")
        await self.sandbox.files.write(_project_path(path), text.replace(old, new, 1))
        return f"edited {path}: replaced {len(old.splitlines()) or 1} line(s)"


def _project_path(path: str) -> str:
    """An absolute path inside the project; anything that leaves it is the model's error."""
    full = posixpath.normpath(posixpath.join(WORKDIR, path))
    if not full.startswith(WORKDIR + "/"):
        raise ToolError(f"{path} is outside the project ({WORKDIR})")
    return full


def _numbered(text: str) -> str:
    return "\n".join(f"{n:4} {line}" for n, line in enumerate(text.splitlines(), 1))
