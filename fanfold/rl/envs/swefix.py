"""The SWE-fix env: a real project at a pinned version, shipped as an image, with a bug that fails one of
its tests; explore, edit, run the tests, submit.

Each task is an image (``examples/swe_image/build.py`` builds one from more-itertools 10.2.0),
as SWE-bench and its kin ship theirs: the project at ``/env``, owned by the image's user
(``agent``, who runs the shell and the tests), a pristine copy of its tests and the grader
at ``/opt/grader`` (root's: the agent cannot change them), and ``/opt/swefix/task.json``
naming the issue and the failing test. The reward comes at ``submit``: 1 when the whole
pristine suite passes against ``/env`` as it stands, else 0. As in SWE-bench, the code under
test runs inside the grader's process.

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
from .codefix import WORKDIR, CodeFixEnv

TASK_FILE = "/opt/swefix/task.json"
TASK_KEYS = ("id", "project", "version", "workdir", "issue", "failing_test", "test_command", "grade_command")
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
        ran, failed = await self.grade_suite()
        reward = 1.0 if ran and not failed else 0.0
        shown = "; failing: " + ", ".join(failed[:5]) + (" ..." if len(failed) > 5 else "") if failed else ""
        return ToolOutcome(f"submitted: {ran - len(failed)} of {ran} tests pass{shown}", reward=reward, done=True)

    async def grade(self) -> tuple[int, int]:
        """Passing and total tests of the pristine suite against the project as it stands."""
        ran, failed = await self.grade_suite()
        return ran - len(failed), max(ran, 1)

    async def grade_suite(self) -> tuple[int, list[str]]:
        """Tests run and the ids of those that failed, by the image's grader, as root."""
        result = await self.sandbox.exec(self.task["grade_command"], cwd=self.task["workdir"], timeout=300,
                                         user="root")
        try:
            counts = json.loads(result.stdout.decode().strip().splitlines()[-1])
            return int(counts["ran"]), [str(name) for name in counts["failed"]]
        except (ValueError, IndexError, KeyError, TypeError):
            return 0, ["<the grader gave no result>"]
