"""Exec against real sandboxes: output, streaming, typed outcomes and limits."""

from __future__ import annotations

import asyncio

import pytest

from fanfold import ExecResult, InvalidRequest, Outcome, OutputChunk, SandboxGone, SandboxNotFound
from fanfold.engine.execution import start_failure


async def test_exec_returns_output_exit_code_and_duration(afleet):
    async with await afleet.create() as sandbox:
        result = await sandbox.exec("echo out; echo err >&2; exit 3")
    assert (result.outcome, result.exit_code) == (Outcome.EXITED, 3)
    assert (result.stdout, result.stderr) == (b"out\n", b"err\n")
    assert 0 < result.duration_s < 5


async def test_argv_env_cwd_and_stdin(afleet):
    async with await afleet.create(env={"FROM_CREATE": "c"}) as sandbox:
        result = await sandbox.exec(
            ["sh", "-c", 'echo "$FROM_CREATE $FROM_EXEC $(pwd)"; cat'], env={"FROM_EXEC": "e"}, cwd="/tmp",
            stdin=b"piped\n",
        )
        big = await sandbox.exec(["wc", "-c"], stdin=b"x" * 5_000_000)
    assert result.text == "c e /tmp\npiped\n"
    assert big.text.strip() == "5000000"


async def test_output_streams_while_the_command_runs(afleet):
    async with await afleet.create() as sandbox:
        items = []
        async for item in sandbox.exec_stream("echo first; read go; echo second", stdin=b"go\n", timeout=10):
            items.append(item)
    chunks = [i for i in items if isinstance(i, OutputChunk)]
    assert isinstance(items[-1], ExecResult) and items[-1].ok
    assert b"".join(c.data for c in chunks) == b"first\nsecond\n"


async def test_on_output_sees_chunks_before_the_command_ends(afleet):
    seen: list[bytes] = []
    gate = asyncio.Event()

    async def on_output(stream: str, data: bytes) -> None:
        seen.append(data)
        gate.set()

    async with await afleet.create() as sandbox:
        task = asyncio.create_task(sandbox.exec("echo early; sleep 30", on_output=on_output, timeout=60))
        await asyncio.wait_for(gate.wait(), 10)
        assert not task.done() and seen == [b"early\n"]
        await sandbox.kill()
        with pytest.raises(SandboxGone):
            await task


async def test_missing_command_is_exit_127_with_a_message(afleet):
    async with await afleet.create() as sandbox:
        result = await sandbox.exec(["no-such-command-xyz"])
        shell = await sandbox.exec("no-such-command-xyz")
    assert result.exit_code == 127 and b"no-such-command-xyz" in result.stderr
    assert shell.exit_code == 127


async def test_a_missing_cwd_is_named_not_the_shell(afleet):
    async with await afleet.create() as sandbox:
        shell = await sandbox.exec("pwd", cwd="/nope")
        argv = await sandbox.exec(["ls"], cwd="/etc/hostname")
        missing = await sandbox.exec(["no-such-command-xyz"], cwd="/tmp")
    assert shell.exit_code == 127
    assert shell.stderr == b"fanfold: cannot change to directory '/nope': No such file or directory\n"
    assert argv.stderr == b"fanfold: cannot change to directory '/etc/hostname': Not a directory\n"
    assert missing.stderr == b"fanfold: cannot run 'no-such-command-xyz': No such file or directory\n"


def test_an_agent_from_an_old_snapshot_still_reports_why_a_command_did_not_start():
    # Agents restored from memory snapshots taken before the stage existed send ``ERRNO message``.
    old = start_failure("2 No such file or directory", ["x"], "/")
    assert old == "fanfold: cannot run 'x': No such file or directory\n"
    assert start_failure("13 exec Permission denied", ["x"], "/") == "fanfold: cannot run 'x': Permission denied\n"


async def test_timeout_is_a_typed_outcome(afleet):
    async with await afleet.create() as sandbox:
        result = await sandbox.exec("echo before; sleep 30", timeout=0.5)
        after = await sandbox.exec("echo alive")
    assert result.outcome is Outcome.TIMEOUT and result.exit_code is None and result.stdout == b"before\n"
    assert 0.4 < result.duration_s < 5
    assert after.ok


async def test_memory_limit_gives_oom_and_spares_the_sandbox(afleet):
    async with await afleet.create(memory_mb=64) as sandbox:
        result = await sandbox.exec(["python3", "-c", "x = bytearray(512 * 1024 * 1024); print(len(x))"], timeout=60)
        after = await sandbox.exec("echo alive")
    assert result.outcome is Outcome.OOM and "memory" in result.limits_hit
    assert after.ok


async def test_fork_bomb_hits_the_pids_limit_and_harms_no_one(afleet):
    async with await afleet.create(pids=64) as bomb, await afleet.create() as neighbour:
        result = await bomb.exec("bomb() { bomb | bomb & }; bomb; sleep 2", timeout=5)
        assert "pids" in result.limits_hit
        assert (await neighbour.exec("echo fine")).ok
    assert result.outcome in (Outcome.TIMEOUT, Outcome.EXITED, Outcome.KILLED)


async def test_huge_output_is_bounded_and_flagged(afleet):
    async with await afleet.create() as sandbox:
        result = await sandbox.exec("head -c 1000000000 /dev/zero; echo done >&2", timeout=120)
        small = await sandbox.exec("seq 5", max_output=4)
    assert result.ok and result.stdout_truncated and len(result.stdout) == 16 * 1024 * 1024
    assert result.stderr == b"done\n" and not result.stderr_truncated
    assert small.stdout == b"1\n2\n" and small.stdout_truncated


async def test_killed_by_a_signal(afleet):
    async with await afleet.create() as sandbox:
        result = await sandbox.exec("kill -TERM $$")
    assert result.outcome is Outcome.KILLED and result.signal == 15


async def test_background_processes_do_not_hold_the_exec(afleet):
    async with await afleet.create() as sandbox:
        # waits for the child to be sleep: a pgrep right after could find it still a forked sh
        result = await sandbox.exec("sleep 100 & while [ \"$(cat /proc/$!/comm)\" != sleep ]; do :; done; echo started",
                                    timeout=10)
        still = await sandbox.exec("pgrep -c sleep")
    assert result.ok and result.duration_s < 2 and still.text.strip() == "1"


async def test_many_concurrent_execs(afleet):
    async with await afleet.create() as sandbox:
        results = await asyncio.gather(*(sandbox.exec(f"echo {i}") for i in range(50)))
    assert [r.text for r in results] == [f"{i}\n" for i in range(50)]


@pytest.mark.parametrize("cmd", ["", "   ", [], [1, 2], ["a\0b"]])
async def test_bad_commands_are_rejected(afleet, cmd):
    async with await afleet.create() as sandbox:
        with pytest.raises(InvalidRequest):
            await sandbox.exec(cmd)


async def test_bad_exec_arguments_are_rejected(afleet):
    async with await afleet.create() as sandbox:
        for kwargs in ({"timeout": 0}, {"timeout": -1}, {"max_output": -5}, {"env": {"A=B": "c"}}, {"cwd": "/../x"}):
            with pytest.raises(InvalidRequest):
                await sandbox.exec("true", **kwargs)


async def test_calls_on_a_killed_sandbox_are_typed(afleet):
    sandbox = await afleet.create()
    await sandbox.kill()
    await sandbox.kill()  # twice is fine
    with pytest.raises(SandboxNotFound):
        await sandbox.exec("true")
    with pytest.raises(SandboxNotFound):
        await afleet.get(sandbox.id)


async def test_deadline_destroys_the_sandbox_mid_command(afleet):
    sandbox = await afleet.create(deadline=1)
    with pytest.raises(SandboxGone):
        await sandbox.exec("sleep 30", timeout=60)
    assert sandbox.id not in {s.id for s in await afleet.list()}
    with pytest.raises(SandboxNotFound):
        await sandbox.exec("true")


async def test_live_stdin_and_signals_reach_a_running_command(config):
    """The embedded engine's ``control``: stdin written while the command runs, then closed, and a
    signal to its process group (what the E2B endpoint's SendInput, CloseStdin and SendSignal use)."""
    from fanfold import AsyncFleet
    from fanfold._agent.client import ExecControl

    async with AsyncFleet(config=config) as fleet, await fleet.create() as sandbox:
        engine = fleet._transport
        control = ExecControl()
        running = asyncio.create_task(engine.exec(sandbox.id, "read a; echo got $a; cat", control=control))
        assert await control.started > 0
        control.write(b"one\n")
        control.write(b"two\n")
        control.close_stdin()
        echoed = await running
        control = ExecControl()
        sleeper = asyncio.create_task(engine.exec(sandbox.id, ["sleep", "60"], control=control))
        await control.started
        control.signal(15)
        ended = await sleeper
    assert (echoed.exit_code, echoed.stdout) == (0, b"got one\ntwo\n")
    assert (ended.outcome, ended.signal) == (Outcome.KILLED, 15)


async def test_input_sent_after_a_fast_command_ended_loses_nothing(config):
    """Stdin written after the agent finished a command that never read it (and closed the
    connection) fails only the writing: the exit status, already on its way, still arrives."""
    from fanfold import AsyncFleet
    from fanfold._agent.client import ExecControl

    async with AsyncFleet(config=config) as fleet, await fleet.create() as sandbox:
        engine = fleet._transport
        results = []
        for _ in range(150):
            control = ExecControl()
            running = asyncio.create_task(engine.exec(sandbox.id, ["true"], control=control))
            await control.started
            control.close_stdin()
            results.append(await running)
        results += [await sandbox.exec(["true"], stdin=b"x" * (1 << 20)) for _ in range(10)]
    assert all(r.outcome == Outcome.EXITED and r.exit_code == 0 for r in results)


async def test_stdin_nobody_reads_is_bounded_on_the_host(config):
    """Live stdin queues on the host only up to ExecControl.MAX_BACKLOG for a command that does not
    read it; past that a write is refused (BufferError). Ending the exec still kills the command."""
    from fanfold import AsyncFleet
    from fanfold._agent.client import ExecControl

    async with AsyncFleet(config=config) as fleet, await fleet.create() as sandbox:
        control = ExecControl()
        running = asyncio.create_task(fleet._transport.exec(sandbox.id, ["sleep", "61"], control=control))
        await control.started
        with pytest.raises(BufferError):
            for _ in range(2 * ExecControl.MAX_BACKLOG >> 20):
                control.write(b"x" * (1 << 20))
        assert 0 < control.backlog <= ExecControl.MAX_BACKLOG
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        left = await sandbox.exec("for p in /proc/[0-9]*; do cat $p/cmdline; echo; done | tr '\\0' ' '")
    assert "sleep 61" not in left.text


async def test_a_signal_reaches_a_command_that_never_reads_its_stdin_at_once(config):
    """With stdin still on its way to a command that never reads it (more than its pipe and the
    agent's connection hold), a signal ends the command at once: it goes on a connection of its own."""
    from fanfold import AsyncFleet
    from fanfold._agent.client import ExecControl

    async with AsyncFleet(config=config) as fleet, await fleet.create() as sandbox:
        control = ExecControl()
        running = asyncio.create_task(fleet._transport.exec(sandbox.id, ["sleep", "63"], stdin=b"x" * (4 << 20),
                                                            control=control))
        await control.started
        control.signal(9)
        ended = await asyncio.wait_for(running, 10)
    assert (ended.outcome, ended.signal) == (Outcome.KILLED, 9)


async def test_an_agent_that_no_longer_listens_ends_its_sandbox(config):
    """A sandbox whose agent let go of its socket (what an older gVisor agent did on a `q` from
    inside) is ended with a typed, final error, not left failing every exec as retryable."""
    import os
    import socket

    from fanfold import AsyncFleet
    from fanfold.runtime.oci_sandbox import paths, set_immutable

    async with AsyncFleet(config=config) as fleet:
        sandbox = await fleet.create()
        where = paths(config, sandbox.id)
        set_immutable(where.channel, False)
        try:  # a socket file that nothing listens on, where the agent's was
            where.socket.unlink()
            dead = socket.socket(socket.AF_UNIX)
            fd = os.open(where.channel, os.O_PATH | os.O_CLOEXEC)
            dead.bind(f"/proc/self/fd/{fd}/{where.socket.name}")
            os.close(fd)
            dead.close()
        finally:
            set_immutable(where.channel, True)
        with pytest.raises(SandboxGone, match="no longer listens"):
            await sandbox.exec("true")
        assert sandbox.id not in {s.id for s in await fleet.list()}
