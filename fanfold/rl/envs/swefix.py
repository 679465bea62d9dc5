"""The SWE-fix env: a real project at a pinned version, shipped as an image, with a bug that fails one of
its tests; explore, edit, run the tests, submit.

Each task is an image (``examples/swe_image/build.py`` builds one from more-itertools 10.2.0),
as SWE-bench and its kin ship theirs: the project at ``/env``, owned by the image's user
(``agent``, who runs the shell and the tests), a pristine copy of its tests at ``/opt/grader``
(root's: the agent cannot change them), and ``/opt/swefix/task.json`` naming the issue, the
failing test and what grading needs.

The reward comes at ``submit``: 1 when the oracle checks and the whole pristine suite pass, else 0.
Grading happens in a fresh sandbox of the task image into which only the submission is copied:
the library's source files (task.json's ``submission`` globs under the workdir; by default every
``*.py`` outside tests, docs and packaging files), never tests, ``conftest.py`` or
``sitecustomize.py``. There a root grader (``fanfold.rl.graders.swefix``) runs the code under test
as the task's user: first the oracle checks (task.json's ``oracle``, a root-only file of call
expressions and their expected values, compared by the grader with the plain values the child
returns), then the suite. The suite runs the library in its own process, as SWE-bench does, so
its counts are the library's claim; they count only beside the oracle checks, which the library
cannot answer for. An image built before oracles existed is graded by its suite alone.

    env = make_async("swefix", fleet, image="localhost:5000/swe/more-itertools:padded")
"""

from __future__ import annotations

import json
from typing import Any

from ... import tools as generic
from ...client import AsyncFleet
from ...errors import FileNotFoundInSandbox, InvalidRequest
from ...images import Image
from ...spec import EnvSpec
from ..core import Tool, ToolCall, ToolOutcome
from ..graders import SANDBOX_DIR, programs
from ..grading import Graded, SubmissionRefused, find_files, pristine_sandbox, read_submission, run_grader, write_files
from .codefix import WORKDIR, CodeFixEnv

TASK_FILE = "/opt/swefix/task.json"
TASK_KEYS = ("id", "project", "version", "workdir", "issue", "failing_test", "test_command")
SUBMISSION = ("*.py",)
"""The submission's globs when task.json names none (images built before it could): every Python file."""
NOT_SUBMITTED = ("tests", "test", "testing", "docs", "doc", "build", "dist", ".*", "__pycache__", "test_*.py",
                 "*_test.py", "conftest.py", "setup.py", "noxfile.py", "sitecustomize.py", "usercustomize.py")
"""Never part of a submission, whatever task.json says: tests, hooks the interpreter or a test runner loads."""
GRADE_CMD = ["python3", "-I", "-B", f"{SANDBOX_DIR}/swefix.py"]
GRADE_TIMEOUT = 420.0
TAIL = 80
"""Lines of the test run's output the model sees (the failures come last)."""

TOOLS = (
    generic.TOOLS["shell"],
    generic.TOOLS["read_file"],
    Tool("edit_file", "Replace one exact, unique occurrence of `old` with `new` in a project file.",
         {"type": "object", "properties": {
             "path": {"type": "string", "description": f"a file in the project ({WORKDIR}), e.g. pkg/module.py"},
             "old": {"type": "string"}, "new": {"type": "string"}},
          "required": ["path", "old", "new"], "additionalProperties": False}),
    Tool("run_tests", "Run the project's test suite and show the end of its output.",
         {"type": "object", "properties": {}, "additionalProperties": False}),
    Tool("submit", "Finish: the reward is 1 if the whole test suite passes, else 0.",
         {"type": "object", "properties": {}, "additionalProperties": False}),
)


class SWEFixEnv(CodeFixEnv):
    """Fix the bug a task image describes; reward 1 when its pristine test suite passes at submit.

    ``image`` (required) is the task image: a reference (pulled on first use) or an image id.
    """

    name = "swefix"
    tools = TOOLS
    system_prompt = ("You fix bugs in a real Python project checked out in a Linux sandbox. Explore it with the "
                     "shell, read and edit files, run the tests, and call submit when the whole suite passes.")
    max_steps = 24

    @classmethod
    def env_spec(cls) -> EnvSpec:
        raise InvalidRequest("swefix has no image of its own: pass image= (see prepare)")

    @classmethod
    async def prepare(cls, fleet: AsyncFleet) -> Image:
        raise InvalidRequest(
            "swefix runs on a task image: pass image='REGISTRY/NAME:TAG' (pulled on first use) or an image id;"
            " examples/swe_image/build.py builds and pushes one"
        )

    async def begin(self, options: dict[str, Any]) -> str:
        try:
            task = json.loads(await self.sandbox.files.read(TASK_FILE))
            missing = [key for key in TASK_KEYS if key not in task]
        except (FileNotFoundInSandbox, ValueError, TypeError) as exc:
            missing = [f"a JSON object at {TASK_FILE} ({exc})"]
        if missing:
            raise InvalidRequest(f"image {self.image} is not a swefix task image: it lacks {', '.join(missing)};"
                                 " build one with examples/swe_image/build.py")
        self.task = task
        return (f"The project {task['project']} {task['version']} is checked out in {task['workdir']}. "
                f"An issue was filed against it:\n\n{task['issue']}\n\nThe test {task['failing_test']} fails. "
                "Fix the library (not the tests) so that the whole test suite passes, then submit.")

    async def call(self, tool: ToolCall) -> ToolOutcome:
        args = tool.arguments
        if tool.name in ("shell", "read_file"):
            # As the image's user, in the project; step() checked the arguments already.
            return ToolOutcome(await self.sandbox.run_tool(tool.name, args, timeout=60))
        if tool.name == "edit_file":
            return ToolOutcome(await self._edit(args["path"], args["old"], args["new"]))
        if tool.name == "run_tests":
            command = f"{self.task['test_command']} 2>&1 | tail -n {TAIL}"
            result = await self.sandbox.exec(["/bin/sh", "-c", command], cwd=self.task["workdir"], timeout=300,
                                             max_output=16384)
            return ToolOutcome(result.text.strip() or f"(no output; exit {result.exit_code})")
        graded = await self.grade_suite()
        return ToolOutcome(_said(graded), reward=1.0 if solved(graded) else 0.0, done=True)

    async def grade(self) -> tuple[int, int]:
        """(1, 1) when the oracle checks and the whole pristine suite pass against the submission,
        else (0, 1): the suite's own count of passing tests is the library's claim, no reward."""
        return (1 if solved(await self.grade_suite()) else 0), 1

    async def grade_suite(self) -> Graded:
        """The grader's verdict ``{"ran", "failed", "checks", "checks_failed"}`` on the submission, from
        a pristine sandbox of the task image (its task.json, not the episode's, says what to copy)."""
        async with pristine_sandbox(self.fleet, self.grading_image(), timeout=GRADE_TIMEOUT,
                                    limits=self.limits) as clean:
            try:
                task = json.loads(await clean.files.read(TASK_FILE))
            except (FileNotFoundInSandbox, ValueError) as exc:
                raise InvalidRequest(f"image {self.grading_image()} is not a swefix task image ({exc})") from None
            workdir = task.get("workdir", WORKDIR)
            try:
                paths = await find_files(self.sandbox, workdir, task.get("submission") or SUBMISSION, NOT_SUBMITTED)
                files = await read_submission(self.sandbox, paths)
                await write_files(clean, {**programs("kit", "calls", "suite", "swefix"), **files})
            except SubmissionRefused as refused:
                return Graded(None, str(refused))
            user = task.get("user") or clean.info.user or "nobody"
            graded = await run_grader(clean, [*GRADE_CMD, user], timeout=GRADE_TIMEOUT)
        return graded if _well_formed(graded.verdict) else Graded(None, f"the grader's verdict is malformed: {graded}")


def solved(graded: Graded) -> bool:
    """Whether a verdict pays: tests ran, none failed, every oracle check passed."""
    verdict = graded.verdict
    return bool(verdict) and verdict["ran"] > 0 and not verdict["failed"] and not verdict["checks_failed"]


def _well_formed(verdict: dict[str, Any] | None) -> bool:
    if verdict is None:
        return True
    counts = (verdict.get("ran"), verdict.get("checks"))
    names = (verdict.get("failed"), verdict.get("checks_failed"))
    return (all(type(n) is int and n >= 0 for n in counts)
            and all(type(group) is list and all(type(name) is str for name in group) for group in names))


def _said(graded: Graded) -> str:
    """What the model sees: counts and failing test ids; the oracle's expressions stay hidden."""
    if not graded.ok:
        return f"submitted: nothing passes ({graded.failure})"
    verdict = graded.verdict
    ran, failed, checks = verdict["ran"], verdict["failed"], verdict["checks"]
    text = f"submitted: {ran - len(failed)} of {ran} tests pass" if ran else "submitted: the suite ran no test"
    if checks:
        text += f", {checks - len(verdict['checks_failed'])} of {checks} checks"
    if failed:
        text += "; failing: " + ", ".join(failed[:5]) + (" ..." if len(failed) > 5 else "")
    return text
