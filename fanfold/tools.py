"""The four generic agent tools (shell, read_file, write_file, search), written once.

The server's rollout routes and the Python RL layer both run them, through anything with
the transport's ``exec``, ``read_file`` and ``write_file`` (the in-process Engine or the
HTTP client). A tool's result is text for the model. A mistake the model made (unknown
tool, bad arguments, a missing file) raises ``ToolError``, whose message is also for the
model; failures of the sandbox or the host (``Retryable``, ``SandboxGone``) pass through
unchanged, since they are never the model's doing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from .errors import FileNotFoundInSandbox, InvalidRequest, ToolError
from .models import ExecResult, Outcome

MAX_SHELL_TIMEOUT_S = 3600.0
"""The longest ``timeout`` a model may give the shell tool."""
MAX_MATCHES = 200
"""Lines of ``search`` output kept."""


class SandboxOps(Protocol):
    """What the tools need of a transport (``Engine`` and ``HttpTransport`` both have it)."""

    async def exec(self, sandbox_id: str, cmd: str | list[str], *, cwd: str | None = None,
                   timeout: float | None = None, max_output: int | None = None) -> ExecResult: ...
    async def read_file(self, sandbox_id: str, path: str) -> bytes: ...
    async def write_file(self, sandbox_id: str, path: str, data: bytes | str, mode: int = 0o644) -> None: ...


@dataclass(frozen=True)
class Tool:
    """A tool as a model sees it: a name, what it does, and its arguments as JSON Schema."""

    name: str
    description: str
    parameters: dict[str, Any]

    def chat_schema(self) -> dict[str, Any]:
        """The tool in the Chat Completions format."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}

    def responses_schema(self) -> dict[str, Any]:
        """The tool in the Responses API format."""
        return {"type": "function", "name": self.name, "description": self.description, "parameters": self.parameters}


def _object(required: list[str], **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


TOOLS: dict[str, Tool] = {tool.name: tool for tool in (
    Tool("shell", "Run a command with /bin/sh in the sandbox; returns its exit code and output (stdout, then stderr).",
         _object(["command"],
                 command={"type": "string", "description": "The shell command line."},
                 timeout={"type": "number", "exclusiveMinimum": 0, "maximum": MAX_SHELL_TIMEOUT_S,
                          "description": "Seconds before the command is killed."},
                 workdir={"type": "string", "description": "Directory to run in (default: the project's)."})),
    Tool("read_file", "Read a text file in the sandbox, optionally only lines start_line to end_line (from 1).",
         _object(["path"],
                 path={"type": "string"},
                 start_line={"type": "integer", "minimum": 1},
                 end_line={"type": "integer", "minimum": 1})),
    Tool("write_file", "Create or replace a file in the sandbox with the given content.",
         _object(["path", "content"], path={"type": "string"}, content={"type": "string"})),
    Tool("search", "Search files for lines matching an extended regular expression (grep -rnIE).",
         _object(["pattern"],
                 pattern={"type": "string", "description": "An extended regular expression."},
                 path={"type": "string", "description": "File or directory to search (default: .)."},
                 glob={"type": "string", "description": "Only files whose name matches, e.g. *.py."})),
)}

_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                            "array": (list,)}


def parse_arguments(name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    """A tool call's arguments, checked against the tool's schema; ToolError says what is wrong."""
    tool = TOOLS.get(name)
    if tool is None:
        raise ToolError(f"unknown tool {name!r}: the tools are {', '.join(TOOLS)}")
    return check_arguments(tool, load_arguments(name, arguments))


def load_arguments(name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    """Arguments as a dict, from the JSON text a model wrote (or a dict already)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as err:
            raise ToolError(f"{name}: the arguments are not valid JSON ({err})") from None
    if not isinstance(arguments, dict):
        raise ToolError(f"{name}: the arguments must be a JSON object, got {type(arguments).__name__}")
    return arguments


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` checked against ``tool``'s schema (names, required ones, types, bounds)."""
    name, schema = tool.name, tool.parameters
    properties = schema.get("properties", {})
    for key in arguments:
        if key not in properties:
            takes = ", ".join(properties) or "no arguments"
            raise ToolError(f"{name}: unexpected argument {key!r}; it takes {takes}")
    for key in schema.get("required", ()):
        if key not in arguments:
            raise ToolError(f"{name}: missing required argument {key!r}")
    return {key: _checked(name, key, value, properties[key]) for key, value in arguments.items()}


def _checked(tool: str, key: str, value: Any, spec: dict[str, Any]) -> Any:
    kind = spec["type"]
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has one number type: 3.0 is 3
    if isinstance(value, bool) or not isinstance(value, _JSON_TYPES[kind]):
        raise ToolError(f"{tool}: argument {key!r} must be a {kind}, got {json.dumps(value)[:80]}")
    if kind == "array":
        return [_checked(tool, f"{key}[{i}]", item, spec["items"]) for i, item in enumerate(value)]
    if kind == "string" and "\0" in value:
        raise ToolError(f"{tool}: argument {key!r} must not contain NUL bytes")
    if ("minimum" in spec and value < spec["minimum"]) or \
            ("exclusiveMinimum" in spec and value <= spec["exclusiveMinimum"]):
        raise ToolError(f"{tool}: argument {key!r} is too small: {value}")
    if "maximum" in spec and value > spec["maximum"]:
        raise ToolError(f"{tool}: argument {key!r} is too large: {value} (at most {spec['maximum']:g})")
    return value


async def run_tool(ops: SandboxOps, sandbox_id: str, name: str, arguments: str | dict[str, Any], *,
                   timeout: float = 60.0, max_output: int = 16384) -> str:
    """Run one tool call in the sandbox and return its output for the model.

    ``timeout`` is the shell's default (the model may give its own); ``max_output`` caps
    the text returned. Model mistakes raise ToolError; infrastructure errors propagate.
    """
    return await run_checked(ops, sandbox_id, name, parse_arguments(name, arguments), timeout=timeout,
                             max_output=max_output)


async def run_checked(ops: SandboxOps, sandbox_id: str, name: str, args: dict[str, Any], *,
                      timeout: float = 60.0, max_output: int = 16384) -> str:
    """``run_tool`` for arguments ``parse_arguments`` (or ``check_arguments``) already passed."""
    try:
        return await _RUNNERS[name](ops, sandbox_id, args, timeout, max_output)
    except ToolError:
        raise
    except (InvalidRequest, FileNotFoundInSandbox) as err:  # InvalidPath and LimitExceeded among them
        raise ToolError(f"{name}: {err}") from None


async def _shell(ops: SandboxOps, sandbox_id: str, args: dict[str, Any], timeout: float, max_output: int) -> str:
    command, workdir = args["command"], args.get("workdir")
    # A missing workdir should read as a shell's own "can't cd", not as a failure to start /bin/sh.
    argv = ["/bin/sh", "-c", command] if workdir is None else \
        ["/bin/sh", "-c", 'cd -- "$1" || exit 1; exec /bin/sh -c "$2"', "sh", workdir, command]
    seconds = args.get("timeout", timeout)
    result = await ops.exec(sandbox_id, argv, timeout=seconds, max_output=max_output)
    output = result.stdout + result.stderr
    cut = result.stdout_truncated or result.stderr_truncated or len(output) > max_output
    text = f"{_status(result, seconds)}\n{output[:max_output].decode('utf-8', 'replace')}"
    return text + (f"\n[output truncated to {max_output} bytes]" if cut else "")


def _status(result: ExecResult, seconds: float) -> str:
    if result.outcome is Outcome.TIMEOUT:
        return f"timed out after {seconds:g}s"
    if result.outcome is Outcome.OOM:
        return "killed: out of memory"
    if result.outcome is Outcome.KILLED:
        return f"killed by signal {result.signal}"
    return f"exit code {result.exit_code}"


async def _read_file(ops: SandboxOps, sandbox_id: str, args: dict[str, Any], timeout: float, max_output: int) -> str:
    data = await ops.read_file(sandbox_id, args["path"])
    lines = data.decode("utf-8", "replace").splitlines(keepends=True)
    start, end = args.get("start_line", 1), args.get("end_line", len(lines))
    if start > max(len(lines), 1):
        raise ToolError(f"read_file: start_line {start} is past the end of {args['path']} ({len(lines)} lines)")
    if end < start:
        raise ToolError(f"read_file: end_line {end} is before start_line {start}")
    text = "".join(lines[start - 1:end])
    if len(text) > max_output:
        shown = text[:max_output].count("\n")
        return text[:max_output] + f"\n[truncated: {len(lines)} lines in all; read on with start_line={start + shown}]"
    return text


async def _write_file(ops: SandboxOps, sandbox_id: str, args: dict[str, Any], timeout: float, max_output: int) -> str:
    data = args["content"].encode()
    await ops.write_file(sandbox_id, args["path"], data)
    return f"wrote {len(data)} bytes to {args['path']}"


async def _search(ops: SandboxOps, sandbox_id: str, args: dict[str, Any], timeout: float, max_output: int) -> str:
    argv = ["grep", "-rnIE"] + ([f"--include={args['glob']}"] if "glob" in args else [])
    argv += ["-e", args["pattern"], "--", args.get("path", ".")]  # an argv: nothing is parsed by a shell
    result = await ops.exec(sandbox_id, argv, timeout=timeout, max_output=max(max_output, 1 << 20))
    if result.outcome is Outcome.TIMEOUT:
        return f"search timed out after {timeout:g}s; narrow the path or the pattern"
    if result.exit_code == 1:
        return "no matches"
    # 2 with matches: some files could not be read; the matches still stand.
    if result.outcome is not Outcome.EXITED or result.exit_code not in (0, 2) or not result.stdout:
        raise ToolError(f"search: {result.stderr.decode('utf-8', 'replace').strip() or _status(result, timeout)}")
    lines = result.stdout.decode("utf-8", "replace").splitlines()
    kept, size = [], 0
    for line in lines[:MAX_MATCHES]:
        size += len(line) + 1
        if size > max_output:
            break
        kept.append(line)
    more = "" if len(kept) == len(lines) and not result.stdout_truncated else \
        f"\n[{'at least ' if result.stdout_truncated else ''}{len(lines) - len(kept)} more matches not shown]"
    return "\n".join(kept) + more


_RUNNERS: dict[str, Callable[[SandboxOps, str, dict[str, Any], float, int], Awaitable[str]]] = {
    "shell": _shell, "read_file": _read_file, "write_file": _write_file, "search": _search,
}


def function_call_output(call_id: str, output: str) -> dict[str, Any]:
    """A Responses API ``function_call_output`` item answering the call ``call_id``."""
    return {"type": "function_call_output", "call_id": call_id, "output": output}
