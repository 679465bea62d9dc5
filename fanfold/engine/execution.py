"""Exec without I/O: checking arguments and typing what the agent reported."""

from __future__ import annotations

import signal as signals

from .._agent.client import RawExec
from ..errors import InvalidRequest
from ..models import ExecResult, Outcome

MAX_STDIN = 64 * 1024 * 1024


def check_exec_args(
    cmd: str | list[str], stdin: bytes | str | None, timeout: float | None, max_output: int | None, default_limit: int
) -> tuple[list[str], bytes | None, int]:
    """Validate an exec request; return the argv, stdin bytes and output limit."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidRequest("the command is empty: pass a shell string or a non-empty argv list")
        argv = ["/bin/sh", "-c", cmd]
    elif isinstance(cmd, (list, tuple)) and cmd and all(isinstance(a, str) for a in cmd):
        argv = list(cmd)
    else:
        raise InvalidRequest(f"the command must be a shell string or a non-empty list of strings, got {cmd!r}")
    if any("\0" in a for a in argv):
        raise InvalidRequest("command arguments may not contain NUL bytes")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise InvalidRequest(f"timeout must be a positive number of seconds, got {timeout!r}")
    limit = default_limit if max_output is None else max_output
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise InvalidRequest(f"max_output must be a non-negative number of bytes, got {max_output!r}")
    data = stdin.encode() if isinstance(stdin, str) else stdin
    if data is not None and not isinstance(data, (bytes, bytearray)):
        raise InvalidRequest("stdin must be bytes or str")
    if data is not None and len(data) > MAX_STDIN:
        raise InvalidRequest(f"stdin is larger than {MAX_STDIN} bytes: upload a file instead")
    return argv, None if data is None else bytes(data), limit


def start_failure(error: str, argv: list[str], cwd: str) -> str:
    """The line a command that could not start prints, from the agent's ``ERRNO STAGE message``.

    STAGE says whether switching user (``user``), the cwd (``chdir``) or the program (``exec``) failed; agents
    restored from snapshots taken before it existed send ``ERRNO message``.
    """
    errno_text, _, rest = error.partition(" ")
    stage, _, message = rest.partition(" ")
    if stage == "chdir":
        return f"fanfold: cannot change to directory {cwd!r}: {message or errno_text}\n"
    if stage == "user":
        return f"fanfold: cannot switch to the command's user: {message or errno_text}\n"
    if stage != "exec":
        message = rest
    return f"fanfold: cannot run {argv[0]!r}: {message or errno_text}\n"


def sandbox_oom_result(before: dict[str, int], after: dict[str, int], sandbox_id: str,
                       duration_s: float) -> ExecResult | None:
    """The ``oom`` outcome of a command whose sandbox died of it (gVisor's sentry is one host process,
    which the OOM killer takes with every process inside), or None when no OOM kill was counted."""
    if after.get("oom_kill", 0) <= before.get("oom_kill", 0):
        return None
    note = (f"fanfold: sandbox {sandbox_id} ran out of memory and ended with the command (the OOM killer took"
            " the whole sandbox); it was destroyed\n")
    return ExecResult(
        outcome=Outcome.OOM, exit_code=None, signal=signals.SIGKILL, stderr=note.encode(), duration_s=duration_s,
        limits_hit=("memory",), cpu_s=max(0, after.get("cpu_us", 0) - before.get("cpu_us", 0)) / 1e6,
        memory_peak_bytes=after.get("memory_peak", 0),
    )


def build_result(
    raw: RawExec, argv: list[str], before: dict[str, int], after: dict[str, int], cwd: str = "/"
) -> ExecResult:
    """Type the agent's report: exited, timeout, oom or killed, with the limits hit."""
    hit = tuple(
        name for name, key in (("memory", "oom_kill"), ("pids", "pids_max")) if after.get(key, 0) > before.get(key, 0)
    )
    if raw.error is not None:
        text = start_failure(raw.error, argv, cwd)
        code = 127 if raw.error.partition(" ")[0] == "2" else 126
        return ExecResult(outcome=Outcome.EXITED, exit_code=code, stderr=text.encode(), limits_hit=hit)
    status = raw.status
    sig = status.get("signal", 0) or None
    if status.get("timeout"):
        outcome = Outcome.TIMEOUT
    elif sig == signals.SIGKILL and "memory" in hit:
        outcome = Outcome.OOM
    elif sig is not None:
        outcome = Outcome.KILLED
    else:
        outcome = Outcome.EXITED
    return ExecResult(
        outcome=outcome,
        exit_code=status.get("code") if outcome is Outcome.EXITED else None,
        signal=sig,
        stdout=bytes(raw.stdout),
        stderr=bytes(raw.stderr),
        stdout_truncated=bool(status.get("out_trunc")),
        stderr_truncated=bool(status.get("err_trunc")),
        duration_s=status.get("duration_us", 0) / 1e6,
        limits_hit=hit,
        cpu_s=max(0, after.get("cpu_us", 0) - before.get("cpu_us", 0)) / 1e6,
        memory_peak_bytes=after.get("memory_peak", 0),
    )
