"""Start a program with chosen file descriptors in place, and wait for it without blocking the loop."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path


# Children whose status a caller of run() is waiting for: orphan reaping must leave them alone.
WAITING: set[int] = set()
_ENVIRON = getattr(os.environ, "_data", os.environ)
"""This process's environment as posix_spawn reads it fastest: the dict of bytes under os.environ,
which every change to os.environ keeps up to date; os.environ itself decodes and encodes each
variable on every spawn (~0.4 ms of CPU a runtime call)."""


@dataclass
class Finished:
    returncode: int
    stdout: bytes
    stderr: bytes


async def run(
    argv: list[str], *, fds: dict[int, int] | None = None, timeout: float | None = None, log: str | None = None,
    env: dict[str, str] | None = None,
) -> Finished:
    """Run ``argv`` with ``fds`` (child fd -> parent fd) installed; capture stdout and stderr.

    With ``log``, stdout and stderr are appended to that file instead: a detached
    sandbox inherits them, and a pipe it holds open would never reach end of file.
    ``env`` replaces this process's environment.

    ``posix_spawn`` lets a given descriptor land at an exact number (the runtime's
    ``--preserve-fds`` passes 3, 4, ... to the sandbox), which ``subprocess`` cannot do.
    """
    if log is not None:
        out_r = err_r = -1
        out_w = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        err_w = os.dup(out_w)
    else:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
    devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    actions = [(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
    actions += [(os.POSIX_SPAWN_DUP2, parent, child) for child, parent in (fds or {}).items()]
    try:
        pid = os.posix_spawnp(argv[0], argv, _ENVIRON if env is None else env, file_actions=actions)
        WAITING.add(pid)
    finally:
        for fd in (out_w, err_w, devnull):
            os.close(fd)
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):  # no task of its own, as wait_for would make
            if log is not None:
                stdout, stderr, status = b"", b"", await _wait(loop, pid)
            else:
                stdout, stderr, status = await asyncio.gather(
                    _drain(loop, out_r), _drain(loop, err_r), _wait(loop, pid))
    except BaseException:
        _kill_and_reap(pid)
        raise
    return Finished(os.waitstatus_to_exitcode(status), stdout, stderr)


async def _drain(loop: asyncio.AbstractEventLoop, fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    done = loop.create_future()

    def readable() -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if data:
            chunks.append(data)
        elif not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return b"".join(chunks)


async def _wait(loop: asyncio.AbstractEventLoop, pid: int) -> int:
    pidfd = os.pidfd_open(pid)
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    try:
        return os.waitpid(pid, 0)[1]
    finally:
        WAITING.discard(pid)


def log_tail(path: str | Path, size: int = 2000) -> str:
    """The end of a log a detached program wrote (see ``run(log=...)``), for error messages."""
    try:
        return Path(path).read_text(errors="replace")[-size:].strip() or "(no output)"
    except OSError:
        return "(no log)"


def _kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    finally:
        WAITING.discard(pid)
