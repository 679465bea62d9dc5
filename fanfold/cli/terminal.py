"""``exec -i``/``-t`` and ``run -i``/``-t``: our stdin to a running command, live, and with ``-t`` our
terminal in raw mode as the command's own (its size followed, Ctrl-C reaching the command)."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import click

if TYPE_CHECKING:
    from ..client import Process, Sandbox
    from ..models import ExecResult

DEFAULT_SHELL = ("/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash; else exec sh; fi")
"""What ``exec -it ID`` runs without a command: bash where the image has it, else sh."""

INTERACTIVE = click.option("-i", "--interactive", is_flag=True,
                           help="Pass our stdin to the command as we read it (it stays open while the command runs).")
TTY = click.option("-t", "--tty", is_flag=True,
                   help="Run the command on a terminal: ours, in raw mode (resizes and Ctrl-C reach the command).")


def check_tty(tty: bool) -> None:
    """``-t`` needs a terminal on our stdin: say so before anything starts, as docker does."""
    if tty and not (sys.stdin is not None and sys.stdin.isatty()):
        raise click.UsageError("the input device is not a TTY: run from a terminal, or drop -t")


def interact(sandbox: Sandbox, cmd: tuple[str, ...], *, tty: bool, **kwargs: Any) -> ExecResult:
    """Run ``cmd`` (default: a shell) with our stdin passed on live; with ``tty`` on our terminal's twin."""
    from ..models import Pty

    stdin_fd, out_fd = sys.stdin.fileno(), sys.stdout.fileno()
    pty = None
    if tty:
        size = os.get_terminal_size(out_fd if os.isatty(out_fd) else stdin_fd)
        pty = Pty(size.lines or 24, size.columns or 80, os.environ.get("TERM") or "xterm-256color")
    process = sandbox.spawn(list(cmd) or list(DEFAULT_SHELL), pty=pty, **kwargs)
    wake_r, wake_w = os.pipe()
    handlers = _forward_signals(wake_w, tty)
    feeder = threading.Thread(target=_feed, args=(process, stdin_fd, wake_r, tty), daemon=True, name="fanfold-stdin")
    try:
        with _raw(stdin_fd) if tty else _nothing():
            feeder.start()
            for chunk in process.output():
                _write_all(out_fd if chunk.stream == "stdout" else sys.stderr.fileno(), chunk.data)
            result = process.wait()
        if result.stderr:  # output streamed is not kept: this is the engine's own word (`cannot run 'x'`)
            _write_all(sys.stderr.fileno(), result.stderr)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        os.write(wake_w, b"q")
        feeder.join(timeout=5)
        os.close(wake_r)
        os.close(wake_w)
    return result


def exit_code(result: ExecResult) -> int:
    """The shell's convention: the command's code, or 128 + the signal that ended it (124: its timeout)."""
    if result.outcome.value == "timeout":
        return 124
    if result.signal:
        return 128 + result.signal
    return 124 if result.exit_code is None else result.exit_code


def _forward_signals(wake_w: int, tty: bool) -> dict[int, Any]:
    """SIGWINCH (a resize) and, without a terminal, SIGINT (Ctrl-C) wake the feeder, which passes them on."""
    marks = {signal.SIGWINCH: b"w"} if tty else {signal.SIGINT: b"c"}
    return {signum: signal.signal(signum, lambda *_, m=mark: os.write(wake_w, m)) for signum, mark in marks.items()}


def _feed(process: Process, stdin_fd: int, wake_r: int, tty: bool) -> None:
    """Our stdin to the command, and the wake-ups (resize, Ctrl-C) to their calls, until told to quit."""
    from ..errors import FanfoldError

    reading = True
    try:
        while True:
            ready, _, _ = select.select([wake_r, stdin_fd] if reading else [wake_r], [], [])
            if wake_r in ready:
                for mark in os.read(wake_r, 64):
                    if mark == ord("q"):
                        return
                    if mark == ord("w"):
                        size = os.get_terminal_size(stdin_fd)
                        process.resize(size.lines or 24, size.columns or 80)
                    elif mark == ord("c"):
                        process.signal(signal.SIGINT)
            if reading and stdin_fd in ready:
                data = os.read(stdin_fd, 65536)
                if data:
                    process.write(data)
                else:  # end of our input: a terminal's command keeps its own (it reads ^D as end of file)
                    reading = False
                    if not tty:
                        process.close_stdin()
    except (FanfoldError, OSError):
        return  # the command ended under us: its output and result say how


@contextmanager
def _raw(fd: int) -> Iterator[None]:
    """Our terminal in raw mode (no echo, no line editing, no signals from keys) until the block ends."""
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
