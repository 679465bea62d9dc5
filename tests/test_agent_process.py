"""The real agent run as a plain process, not a sandbox's PID 1 (what a backend without
namespaces does): services start and log under --root, and with --subreaper what a
command leaves running stays in the agent's tree and is reaped by it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

from fanfold._agent.build import agent_binary
from fanfold._agent.client import PROTOCOL_VERSION, AgentClient, AgentGone, AgentProtocolError, ExecControl
from fanfold.host import procs

from agents import until_listening


def parent_of(pid: int) -> int:
    return int(procs.stat_fields(pid)[1])


def start_agent(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """The agent as a plain process listening at ``tmp_path/agent.sock``, its --root ``tmp_path/root``."""
    root, socket = tmp_path / "root", tmp_path / "agent.sock"
    root.mkdir()
    agent = subprocess.Popen(
        [str(agent_binary(tmp_path / "state")), "--listen", str(socket), "--root", str(root), *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    return agent, root, socket


async def test_the_agent_as_a_plain_process_keeps_services_and_orphans_at_home(tmp_path):
    agent, root, socket = start_agent(tmp_path, "--subreaper", "--oneshot", "setup", "echo ready; pwd")
    try:
        client = await until_listening(socket, agent)
        assert await client.wait_ready() == "ok"
        assert (root / "var/log/fanfold/setup.log").read_text() == f"ready\n{root}\n"
        started = await client.exec(["/bin/sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], env=["PATH=/usr/bin:/bin"],
                                    cwd=str(root), timeout_ms=10_000, max_output=4096)
        orphan = int(started.stdout)
        assert started.status.get("code") == 0 and parent_of(orphan) == agent.pid  # adopted, not the test's
        os.kill(orphan, signal.SIGKILL)
        give_up = time.monotonic() + 10
        while Path(f"/proc/{orphan}").exists():  # the agent reaps it: no zombie left behind
            assert time.monotonic() < give_up
            await asyncio.sleep(0.01)
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


KEY = "5e" * 32


async def test_a_held_agent_starts_services_on_g_and_drops_and_rebinds_its_listener(tmp_path):
    """What the gVisor tier relies on: ``--hold`` keeps services back until ``g``, which gives the
    agent the host's key; ``q`` proven with that key closes the listener (and the connection) so a
    checkpoint finds no host socket, and no other ``q`` does; SIGUSR2 binds it again, and is ignored
    while the agent listens; the agent bound again proves itself with the key."""
    agent, root, socket = start_agent(tmp_path, "--hold", "--oneshot", "setup", "echo ran")
    log = root / "var/log/fanfold/setup.log"
    try:
        client = await until_listening(socket, agent)
        assert await client.ping() == f"fanfold-agent {PROTOCOL_VERSION}"
        assert not log.exists()  # held: nothing ran
        await client.release_services(KEY)
        assert await client.wait_ready() == "ok" and log.read_text() == "ran\n"
        await client.release_services("0" * 64)  # a second `g` starts nothing again, nor changes the key
        assert log.read_text() == "ran\n"

        os.kill(agent.pid, signal.SIGUSR2)  # listening: ignored
        assert await client.ping() == f"fanfold-agent {PROTOCOL_VERSION}"
        for unproven in (client.drop_listener_legacy("c0ffee"), client.drop_listener("0" * 64)):
            with pytest.raises(AgentProtocolError):  # what a process of the sandbox can send: refused
                await unproven
            assert await client.ping() == f"fanfold-agent {PROTOCOL_VERSION}"
        await client.drop_listener(KEY)
        fds = [os.readlink(f"/proc/{agent.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{agent.pid}/fd")]
        assert not any(link.startswith("socket:") for link in fds)  # no listener, no connection left
        with pytest.raises(AgentGone):
            await client.ping()
        socket.unlink()  # the stale socket file: the agent may not find its dir writable (gVisor's is locked)
        os.kill(agent.pid, signal.SIGUSR2)
        await until_listening(socket, agent)
        assert await client.ping() == f"fanfold-agent {PROTOCOL_VERSION}"
        assert await client.proves(KEY) and not await client.proves("0" * 64)
        assert await client.token() == ""  # nothing secret for whoever asks
        result = await client.exec(["/bin/echo", "back"], env=[], cwd="/", timeout_ms=5000, max_output=100)
        assert bytes(result.stdout) == b"back\n"
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


async def _relay_one_request(loop, conn: socket.socket, to_agent: socket.socket) -> None:
    """Pass one frame of the host's to the agent over a connection made before, and its answer back."""
    header = await loop.sock_recv(conn, 5)
    size = struct.unpack(">BI", header)[1] if len(header) == 5 else 0
    payload = await loop.sock_recv(conn, size) if size else b""
    await loop.sock_sendall(to_agent, header + payload)
    await loop.sock_sendall(conn, await loop.sock_recv(to_agent, 1 << 16))
    conn.close()


async def test_a_process_relaying_the_hosts_check_to_the_agent_gets_no_proof(tmp_path):
    """The window a gVisor sandbox has while its agent binds again: a process connects to the agent,
    puts its own socket in the agent's place and passes the host's check to the agent over the
    connection it made before. The agent finds that its path no longer leads to it and proves
    nothing, so the host's check fails; ``t`` tells nothing secret to whoever asks."""
    agent, client, path = await _started_agent(tmp_path, "--hold")
    loop = asyncio.get_running_loop()
    try:
        await client.release_services(KEY)
        await client.drop_listener(KEY)
        path.unlink()
        os.kill(agent.pid, signal.SIGUSR2)
        await until_listening(path, agent)
        made_before = [socket.socket(socket.AF_UNIX) for _ in range(2)]
        for conn in made_before:
            conn.connect(str(path))
            conn.setblocking(False)
        path.unlink()
        impostor = socket.socket(socket.AF_UNIX)
        impostor.bind(str(path))
        impostor.listen(8)
        impostor.setblocking(False)

        async def relay() -> None:
            for to_agent in made_before:
                conn, _ = await loop.sock_accept(impostor)
                asyncio.create_task(_relay_one_request(loop, conn, to_agent))
                while True:  # the agent's own probe of its path lands here too: not the host's
                    conn, _ = await loop.sock_accept(impostor)
                    conn.close()

        relaying = asyncio.create_task(relay())
        try:
            assert not await asyncio.wait_for(client.proves(KEY), 5)
        finally:
            relaying.cancel()
            impostor.close()
            for conn in made_before:
                conn.close()
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


async def test_signal_requests_reach_only_running_execs(tmp_path):
    """``k PID SIGNAL`` on a connection of its own signals an exec the agent runs, and nothing else:
    a pid that is not one of its running commands is left alone."""
    agent, client, _ = await _started_agent(tmp_path)
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        assert await client.signal(bystander.pid, signal.SIGKILL)  # "gone": no exec of that pid
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


async def _started_agent(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], AgentClient, Path]:
    agent, root, socket = start_agent(tmp_path, *args)
    return agent, await until_listening(socket, agent), socket


async def _exec_with_stdin_pending(client: AgentClient, command: str, timeout_ms: int = 0):
    """``command`` run with live stdin, 4 MiB given at the start and 4 more written to it: more than
    the pipe and the connection hold, so the agent holds a chunk the command has not taken once it
    reads no more, and the host is still writing."""
    control = ExecControl()
    running = asyncio.create_task(client.exec(["/bin/sh", "-c", command], env=["PATH=/usr/bin:/bin"], cwd="/",
                                              timeout_ms=timeout_ms, max_output=4096, stdin=b"s" * (4 << 20),
                                              control=control))
    await control.started
    for _ in range(4):
        control.write(b"x" * (1 << 20))
    return control, running


async def test_a_signal_ends_a_command_that_never_reads_its_stdin_at_once(tmp_path):
    """A signal does not wait behind stdin the command never takes: it reaches a command that reads
    none of it, or stopped reading part way, while the host still has stdin to write; so does the
    exec's timeout."""
    agent, client, _ = await _started_agent(tmp_path)
    try:
        for command in ("sleep 1000", "head -c 100000 >/dev/null; sleep 1000"):
            control, running = await _exec_with_stdin_pending(client, command)
            control.signal(signal.SIGKILL)
            ended = await asyncio.wait_for(running, 5)
            assert ended.status["signal"] == signal.SIGKILL and control.backlog == control.written, command
        control, running = await _exec_with_stdin_pending(client, "sleep 1000", timeout_ms=300)
        ended = await asyncio.wait_for(running, 5)
        assert ended.status["timeout"] == 1 and ended.status["signal"] == signal.SIGKILL
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


async def test_live_stdin_streams_with_backpressure_and_signals_pass_it(tmp_path):
    """Stdin to a command that reads it arrives whole and in order, the host writing only as fast as
    the command reads (never more than ExecControl.MAX_BACKLOG ahead); a signal sent meanwhile
    reaches it before the stdin still queued."""
    agent, client, _ = await _started_agent(tmp_path)
    total = 3 * ExecControl.MAX_BACKLOG
    try:
        control = ExecControl()
        running = asyncio.create_task(client.exec(
            ["/bin/sh", "-c", "sha256sum; wc -c"], env=["PATH=/usr/bin:/bin"], cwd="/", timeout_ms=0,
            max_output=4096, control=control))
        await control.started
        chunk = bytes(range(256)) * 4096
        digest = hashlib.sha256()
        while control.written < total:
            while control.backlog + len(chunk) > ExecControl.MAX_BACKLOG:
                await asyncio.sleep(0.001)  # the host's side of backpressure: wait until the command reads
            control.write(chunk)
            digest.update(chunk)
        control.close_stdin()
        done = await asyncio.wait_for(running, 60)
        assert bytes(done.stdout).split()[0].decode() == digest.hexdigest() and done.status["code"] == 0

        control, trapping = ExecControl(), asyncio.Event()
        running = asyncio.create_task(client.exec(
            ["/bin/sh", "-c", "trap 'echo got TERM; exit 3' TERM; echo trapping;"
             " while :; do head -c 1 >/dev/null; sleep 0.01; done"],
            env=["PATH=/usr/bin:/bin"], cwd="/", timeout_ms=0, max_output=4096, control=control,
            on_chunk=lambda stream, data: trapping.set()))
        await asyncio.wait_for(trapping.wait(), 5)
        control.write(b"y" * (1 << 20))
        control.signal(signal.SIGTERM)
        ended = await asyncio.wait_for(running, 5)
        assert ended.status["code"] == 3 and bytes(ended.stdout) == b"trapping\ngot TERM\n"
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
