"""E2B's PTYs (``sandbox.pty``) with the unmodified ``e2b`` SDK against a real ``fanfold serve``:
create, send_stdin, resize, kill, and the output streamed as it comes."""

from __future__ import annotations

import threading

import pytest

e2b = pytest.importorskip("e2b")

from e2b import CommandExitException, Sandbox  # noqa: E402
from e2b.sandbox.commands.command_handle import PtySize  # noqa: E402

from test_e2b import e2b_env  # noqa: E402, F401  (a fixture: the SDK pointed at the test server)


@pytest.fixture(scope="module")
def sbx(e2b_env):
    sandbox = Sandbox.create(timeout=600)
    yield sandbox
    assert sandbox.kill()


class Screen:
    """What the PTY showed, with a wait for a mark in what came after the last mark."""

    def __init__(self) -> None:
        self.text, self.seen, self.changed = "", 0, threading.Condition()

    def __call__(self, data: bytes) -> None:
        with self.changed:
            self.text += data.decode(errors="replace")
            self.changed.notify_all()

    def until(self, mark: str, timeout: float = 30) -> str:
        with self.changed:
            assert self.changed.wait_for(lambda: mark in self.text[self.seen:], timeout), self.text
            start, self.seen = self.seen, self.text.index(mark, self.seen) + len(mark)
            return self.text[start:self.seen]


def test_a_pty_runs_a_shell_that_takes_input_and_resizes(sbx):
    screen = Screen()
    terminal = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
    waiting = threading.Thread(target=lambda: _wait_quietly(terminal, screen), daemon=True)
    waiting.start()
    sbx.pty.send_stdin(terminal.pid, b"tty; stty size; echo $TERM\n")
    assert "24 80" in screen.until("xterm-256color\r\n") and "/dev/pts/" in screen.text
    sbx.pty.resize(terminal.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(terminal.pid, b"stty size\n")
    screen.until("40 120\r\n")
    sbx.pty.send_stdin(terminal.pid, b"sleep 100\n")
    sbx.pty.send_stdin(terminal.pid, b"\x03")  # Ctrl-C ends the sleep, not the shell
    sbx.pty.send_stdin(terminal.pid, b"echo still here\n")
    screen.until("still here\r\n")
    assert sbx.pty.kill(terminal.pid)
    waiting.join(30)
    assert terminal.pid not in [p.pid for p in sbx.commands.list()]


def test_a_pty_exits_with_its_shells_code(sbx):
    terminal = sbx.pty.create(PtySize(rows=10, cols=50), timeout=0)
    sbx.pty.send_stdin(terminal.pid, b"exit 7\n")
    with pytest.raises(CommandExitException) as ended:
        terminal.wait()
    assert ended.value.exit_code == 7


def _wait_quietly(handle, on_pty) -> None:
    try:
        handle.wait(on_pty=on_pty)
    except CommandExitException:
        pass
