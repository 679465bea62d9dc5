"""Start a program with chosen file descriptors in place, and wait for it without blocking the loop."""

from __future__ import annotations

import asyncio
import ctypes
import os
import select
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


# Children whose status a caller of run() is waiting for: orphan reaping must leave them alone.
WAITING: set[int] = set()
_spawning = 0
_spawning_lock = threading.Lock()


def spawning() -> bool:
    """Whether a child is being started whose pid is not in WAITING yet: posix_spawn runs without the
    GIL, and the child (a runtime that exits at once) may be a zombie before its starter gets the GIL
    back to record it. Orphan reaping waits meanwhile, lest it take that child's status."""
    return _spawning > 0
_ENVIRON = getattr(os.environ, "_data", os.environ)
"""This process's environment as posix_spawn reads it fastest: the dict of bytes under os.environ,
which every change to os.environ keeps up to date; os.environ itself decodes and encodes each
variable on every spawn (~0.4 ms of CPU a runtime call)."""
_LIBC = ctypes.CDLL(None)
"""libc's posix_spawnp called through ctypes, which lets go of the GIL for the call: ``os.posix_spawnp``
holds it while the child executes (~1-2 ms for the runtime), and every other thread, the event loop's
among them, waits that long."""
_FILE_ACTIONS_SIZE = 256
"""Room for a posix_spawn_file_actions_t (80 bytes in glibc on 64-bit hosts)."""


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
        return await wait_logged(start_logged(argv, fds=fds, log=log, env=env), timeout)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        pid = _spawn(argv, fds, env, out_w, err_w)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):  # no task of its own, as wait_for would make
            stdout, stderr, status = await asyncio.gather(_drain(loop, out_r), _drain(loop, err_r), _wait(loop, pid))
    except BaseException:
        _kill_and_reap(pid)
        raise
    return Finished(os.waitstatus_to_exitcode(status), stdout, stderr)


def start_logged(argv: list[str], *, log: str, fds: dict[int, int] | None = None,
                 env: dict[str, str] | None = None) -> int:
    """Start ``argv`` as ``run(log=...)`` does and return its pid, for ``wait_logged`` (or ``settle``).

    Blocking (posix_spawn returns once the child has executed): a thread doing a create's file system
    work starts the runtime here and goes on with what the runtime does not need while it runs."""
    out_w = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        err_w = os.dup(out_w)
    except BaseException:
        os.close(out_w)
        raise
    return _spawn(argv, fds, env, out_w, err_w)


async def wait_logged(pid: int, timeout: float | None) -> Finished:
    """Wait for a program ``start_logged`` started (killed past ``timeout`` or when cancelled)."""
    try:
        async with asyncio.timeout(timeout):
            status = await _wait(asyncio.get_running_loop(), pid)
    except BaseException:
        _kill_and_reap(pid)
        raise
    return Finished(os.waitstatus_to_exitcode(status), b"", b"")


def settle(pid: int, timeout: float) -> None:
    """Wait (blocking) for a program ``start_logged`` started to end of itself, whatever it answers; killed
    past ``timeout``. For a runtime whose caller failed meanwhile: killed midway, it would leave the
    helpers it forked finishing the container after the caller's cleanup ran."""
    pidfd = os.pidfd_open(pid)
    try:
        waiting = select.poll()  # not select(): an engine's descriptors run past its 1024
        waiting.register(pidfd, select.POLLIN)
        ended = waiting.poll(timeout * 1000)
    finally:
        os.close(pidfd)
    if not ended:
        _kill_and_reap(pid)
        return
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    finally:
        WAITING.discard(pid)


def _spawn(argv: list[str], fds: dict[int, int] | None, env: dict[str, str] | None, out_w: int, err_w: int) -> int:
    """posix_spawn ``argv`` with stdin on /dev/null, stdout and stderr on ``out_w`` and ``err_w`` (closed
    here) and ``fds`` installed; the child is in WAITING, so that orphan reaping leaves it alone."""
    try:
        devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except BaseException:
        os.close(out_w)
        os.close(err_w)
        raise
    dup2s = [(devnull, 0), (out_w, 1), (err_w, 2), *((parent, child) for child, parent in (fds or {}).items())]
    global _spawning
    with _spawning_lock:
        _spawning += 1
    try:
        pid = _posix_spawnp(argv, _ENVIRON if env is None else env, dup2s)
        WAITING.add(pid)
    finally:
        with _spawning_lock:
            _spawning -= 1
        for fd in (out_w, err_w, devnull):
            os.close(fd)
    return pid


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


def _posix_spawnp(argv: list[str], env: Mapping[str, str] | Mapping[bytes, bytes], dup2s: list[tuple[int, int]]) -> int:
    """``os.posix_spawnp(argv[0], argv, env, file_actions=[(POSIX_SPAWN_DUP2, old, new), ...])``, without
    the GIL while the child starts; raises OSError as that does."""
    actions = ctypes.create_string_buffer(_FILE_ACTIONS_SIZE)
    _check(_LIBC.posix_spawn_file_actions_init(actions), argv[0])
    try:
        for old, new in dup2s:
            _check(_LIBC.posix_spawn_file_actions_adddup2(actions, old, new), argv[0])
        args = (ctypes.c_char_p * (len(argv) + 1))(*map(os.fsencode, argv), None)
        # a copy first: the comprehension's bytecode may let another thread change os.environ midway
        pairs = [os.fsencode(key) + b"=" + os.fsencode(value) for key, value in list(env.items())]
        environ = (ctypes.c_char_p * (len(pairs) + 1))(*pairs, None)
        pid = ctypes.c_int()
        _check(_LIBC.posix_spawnp(ctypes.byref(pid), args[0], actions, None, args, environ), argv[0])
        return pid.value
    finally:
        _LIBC.posix_spawn_file_actions_destroy(actions)


def _check(error: int, program: str) -> None:
    if error:
        raise OSError(error, os.strerror(error), program)
