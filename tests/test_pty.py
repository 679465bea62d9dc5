"""Commands on a real terminal: the agent's pseudo-terminal through every transport, and the CLI's
``exec -it`` driven from a pseudo-terminal of the test's own."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty as ptymod
import select
import signal
import struct
import sys
import termios
import time

import pytest

from fanfold import InvalidRequest, Outcome, Pty
from fanfold._agent.build import agent_binary
from fanfold._agent.client import PROTOCOL_VERSION, AgentTooOld, ExecControl

import agents
from conftest import STATE_DIR

PROTOCOL_5_COMMIT = "67a89a9"  # the last agent of protocol 5, before terminals


class Screen:
    """What a process wrote to its terminal, read up to a mark."""

    def __init__(self, process) -> None:
        self.chunks = process.output()
        self.text = ""

    async def until(self, mark: str, timeout: float = 30) -> str:
        async def read() -> str:
            while mark not in self.text:
                chunk = await anext(self.chunks)
                assert chunk.stream == "stdout"  # a terminal has one stream
                self.text += chunk.data.decode(errors="replace")
            seen, _, self.text = self.text.partition(mark)
            return seen

        return await asyncio.wait_for(read(), timeout)


async def test_a_pty_exec_has_a_terminal_of_the_asked_size(afleet):
    async with await afleet.create() as sandbox:
        process = await sandbox.spawn("tty; stty size; echo TERM=$TERM", pty=Pty(33, 101))
        result = await process.wait()
        text = "".join([c.data.decode() async for c in process.output()])
        assert result.outcome is Outcome.EXITED and result.exit_code == 0
        lines = text.split("\r\n")  # the terminal's output processing turns \n into \r\n
        assert lines[0].startswith("/dev/pts/") and lines[1] == "33 101" and lines[2] == "TERM=xterm-256color"
        piped = await sandbox.exec("tty")  # without a pty, none
        assert piped.exit_code == 1 and piped.text.strip() == "not a tty"


async def test_resize_reaches_a_running_shell_and_ctrl_c_interrupts(afleet):
    async with await afleet.create() as sandbox:
        shell = await sandbox.spawn(["sh", "-c", 'trap "stty size; echo winched" WINCH; echo ready;'
                                    ' while :; do sleep 0.05; done'], pty=Pty(24, 80))
        screen = Screen(shell)
        await screen.until("ready")
        await shell.resize(40, 120)
        assert (await screen.until("winched")).split() == ["40", "120"]
        await shell.write(b"\x03")  # Ctrl-C: the line discipline signals the foreground group
        result = await asyncio.wait_for(shell.wait(), 30)
        assert result.outcome is Outcome.KILLED and result.signal == signal.SIGINT

        # ^C reaches a command once the terminal is its own: it says so before it sleeps
        sleeper = await sandbox.spawn(["sh", "-c", "echo up; exec sleep 100"], pty=Pty())
        await Screen(sleeper).until("up")
        await sleeper.write(b"\x03")
        result = await asyncio.wait_for(sleeper.wait(), 30)
        assert result.outcome is Outcome.KILLED and result.signal == signal.SIGINT


async def test_an_interactive_shell_keeps_its_state_and_its_exit_code(afleet):
    async with await afleet.create() as sandbox:
        shell = await sandbox.spawn("sh", pty=Pty(24, 80))
        screen = Screen(shell)
        await shell.write("X=41; echo $((X + 1))\n")
        await screen.until("42\r\n")
        await shell.write("stty size\n")
        await screen.until("24 80\r\n")
        await shell.resize(50, 132)
        size = []
        for _ in range(200):  # a resize travels on a connection of its own: ask until the terminal has it
            await shell.write('echo "$(stty size) $((6 * 7))"\n')
            size = (await screen.until(" 42\r\n")).split()[-2:]
            if size == ["50", "132"]:
                break
        assert size == ["50", "132"]
        await shell.write("exit 3\n")
        result = await asyncio.wait_for(shell.wait(), 30)
        assert result.outcome is Outcome.EXITED and result.exit_code == 3
        with pytest.raises(InvalidRequest, match="no terminal"):
            await (await sandbox.spawn("true")).resize(1, 1)


async def test_spawn_without_a_pty_streams_stdin_live(afleet):
    async with await afleet.create() as sandbox:
        cat = await sandbox.spawn(["sh", "-c", "cat; echo done >&2; exit 5"])
        screen = Screen(cat)
        await cat.write("first\n")
        await screen.until("first\n")  # it echoed before stdin ended: live, not batched
        await cat.close_stdin()
        result = await asyncio.wait_for(cat.wait(), 30)
        assert result.exit_code == 5


def test_bad_terminal_sizes_are_refused():
    for rows, cols in ((0, 80), (24, 70000), (True, 80)):
        with pytest.raises(InvalidRequest):
            Pty(rows, cols)


async def test_an_agent_of_protocol_5_refuses_a_pty_clearly_and_runs_nothing(tmp_path):
    async with agents.running(agents.agent_of(PROTOCOL_5_COMMIT, tmp_path, 5), tmp_path) as old:
        assert await old.ping() == "fanfold-agent 5"
        marker = tmp_path / "ran"
        with pytest.raises(AgentTooOld, match="terminals"):
            await old.exec(["/bin/touch", str(marker)], env=[], cwd="/", timeout_ms=10_000, max_output=4096,
                           control=ExecControl(pty=(24, 80)))
        assert not marker.exists()
    async with agents.running(agent_binary(tmp_path / "state"), tmp_path) as new:
        assert await new.ping() == f"fanfold-agent {PROTOCOL_VERSION}"
        raw = await new.exec(["/bin/sh", "-c", "stty size"], env=["PATH=/usr/bin:/bin"], cwd="/", timeout_ms=10_000,
                             max_output=4096, control=ExecControl(pty=(7, 9)))
        assert raw.stdout == b"7 9\r\n" and raw.stderr == b"" and raw.status["err_bytes"] == 0




# -- the CLI at a terminal -------------------------------------------------------------------------


def _cli_on_a_terminal(*args: str, steps: list[tuple[bytes, bytes | tuple[int, int]]],
                       timeout: float = 120) -> tuple[bytes, int]:
    """Run the CLI with a pseudo-terminal of 24 x 80 as its stdin, stdout and stderr. Each step waits
    until its mark shows, then types its bytes or resizes the terminal to its (rows, cols); then the
    rest is read to the end. Returns what the CLI showed and its exit code."""
    pid, master = ptymod.fork()
    if pid == 0:  # the child: the CLI on the terminal's slave
        os.environ["FANFOLD_STATE_DIR"] = str(STATE_DIR)
        os.execv(sys.executable, [sys.executable, "-m", "fanfold.cli", *args])
    _set_size(master, 24, 80)
    shown, seen, todo, give_up = b"", 0, list(steps), time.monotonic() + timeout
    try:
        while time.monotonic() < give_up:
            while todo and todo[0][0] in shown[seen:]:
                mark, action = todo.pop(0)
                seen = shown.index(mark, seen) + len(mark)
                if isinstance(action, tuple):
                    _set_size(master, *action)  # the kernel sends the CLI SIGWINCH
                else:
                    os.write(master, action)
            ready, _, _ = select.select([master], [], [], 1)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the CLI ended and closed the terminal
                    break
                if not data:
                    break
                shown += data
        if todo:  # what it waits for never came: it would wait for its input for ever
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert not todo, f"never saw {todo[0][0]!r} in {shown!r}"
        return shown, os.waitstatus_to_exitcode(status)
    finally:
        os.close(master)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


@pytest.fixture
def cli_sandbox():
    from conftest import run_cli

    made = run_cli("create")
    assert made.returncode == 0, made.stderr
    sandbox_id = made.stdout.split()[0]
    yield sandbox_id
    run_cli("rm", sandbox_id)


def test_exec_it_gives_a_working_shell_with_its_exit_code(cli_sandbox):
    shown, code = _cli_on_a_terminal("exec", "-it", cli_sandbox, "--", "sh", steps=[
        (b"# ", b"stty size; echo h''i\n"),  # h''i: the output, not the typed line's echo, says hi
        (b"\r\nhi\r\n", (30, 100)),
        # Ctrl-C goes to the command, not to the CLI: once the command holds the terminal (it says so), else
        # the shell, between commands, would take it
        (b"# ", b"stty size; sh -c 'echo u''p; exec sleep 100'\n"),
        (b"\r\nup\r\n", b"\x03"),
        (b"# ", b"echo again; exit 3\n"),
    ])
    assert code == 3, shown
    # (the resize travels apart from the typed bytes, so the second stty may still say 24 80: the resize
    # itself is test_resize_reaches_a_running_shell_and_ctrl_c_interrupts's)
    assert b"24 80\r\n" in shown and b"\r\nagain\r\n" in shown


def test_run_it_runs_a_command_on_a_terminal_in_a_sandbox_of_its_own():
    shown, code = _cli_on_a_terminal("run", "-it", "--", "sh", "-c", "tty; read line; echo got $line; exit 5",
                                     steps=[(b"/dev/pts/", b"typed\r")])  # Enter in raw mode is \r
    assert code == 5 and b"got typed\r\n" in shown, shown


def test_exec_i_passes_stdin_live_without_a_terminal(cli_sandbox):
    from conftest import run_cli

    done = run_cli("exec", "-i", cli_sandbox, "--", "sh", "-c", "tty; cat; exit 4", input="piped\n")
    assert done.returncode == 4 and done.stdout == "not a tty\npiped\n"


def test_exec_it_through_a_server(server):
    from conftest import run_cli

    url = ["--url", server.unix_url]
    made = run_cli(*url, "create")
    assert made.returncode == 0, made.stderr
    sandbox_id = made.stdout.split()[0]
    try:
        shown, code = _cli_on_a_terminal(*url, "exec", "-it", sandbox_id, steps=[
            (b"# ", b"stty size; echo h''i; exit 9\n"),
        ])
        assert code == 9 and b"24 80\r\n" in shown and b"\r\nhi\r\n" in shown, shown
    finally:
        assert run_cli(*url, "rm", sandbox_id).returncode == 0


def test_exec_it_of_a_missing_program_says_why_and_exits_127(cli_sandbox):
    shown, code = _cli_on_a_terminal("exec", "-it", cli_sandbox, "--", "no-such-program", steps=[])
    assert code == 127 and b"no-such-program" in shown, shown


def test_exec_t_without_a_terminal_says_so():
    from conftest import run_cli

    done = run_cli("exec", "-it", "sb-none", "--", "sh")
    assert done.returncode != 0 and "the input device is not a TTY" in done.stderr
