"""The real agent run as a plain process, not a sandbox's PID 1 (what a backend without
namespaces does): services start and log under --root, and with --subreaper what a
command leaves running stays in the agent's tree and is reaped by it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fanfold._agent.build import agent_binary
from fanfold._agent.client import AgentClient, AgentUnreachable


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


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
        client = AgentClient(str(socket))
        give_up = time.monotonic() + 10
        while not socket.exists():  # the agent binds its socket as it starts
            assert agent.poll() is None and time.monotonic() < give_up, agent.stderr.read() if agent.stderr else ""
            await asyncio.sleep(0.01)
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


async def _until(condition, what: str, agent: subprocess.Popen[bytes]) -> None:
    give_up = time.monotonic() + 10
    while not condition():
        assert agent.poll() is None and time.monotonic() < give_up, f"waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_held_agent_starts_services_on_g_and_drops_and_rebinds_its_listener(tmp_path):
    """What the gVisor tier relies on: ``--hold`` keeps services back until ``g``; ``q`` closes the
    listener (and the connection) so a checkpoint finds no host socket; SIGUSR2 binds it again,
    and is ignored while the agent listens."""
    agent, root, socket = start_agent(tmp_path, "--hold", "--oneshot", "setup", "echo ran")
    log = root / "var/log/fanfold/setup.log"
    try:
        client = AgentClient(str(socket))
        await _until(socket.exists, "the socket", agent)
        assert await client.ping() == "fanfold-agent 4"
        assert not log.exists()  # held: nothing ran
        await client.release_services()
        assert await client.wait_ready() == "ok" and log.read_text() == "ran\n"
        await client.release_services()  # a second `g` starts nothing again
        assert log.read_text() == "ran\n"

        os.kill(agent.pid, signal.SIGUSR2)  # listening: ignored
        assert await client.ping() == "fanfold-agent 4"
        await client.drop_listener("c0ffee")
        fds = [os.readlink(f"/proc/{agent.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{agent.pid}/fd")]
        assert not any(link.startswith("socket:") for link in fds)  # no listener, no connection left
        with pytest.raises(AgentUnreachable):
            await client.ping()
        socket.unlink()  # the stale socket file: the agent may not find its dir writable (gVisor's is locked)
        os.kill(agent.pid, signal.SIGUSR2)
        await _until(socket.exists, "the rebound socket", agent)
        assert await client.ping() == "fanfold-agent 4"
        assert await client.token() == "c0ffee"  # what a rebound agent proves itself by
        result = await client.exec(["/bin/echo", "back"], env=[], cwd="/", timeout_ms=5000, max_output=100)
        assert bytes(result.stdout) == b"back\n"
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()

