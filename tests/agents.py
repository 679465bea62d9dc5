"""The agent as a plain process, for tests of its protocol: today's, or one built from an older commit."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fanfold._agent.client import AgentClient, AgentGone, AgentUnreachable


def agent_of(commit: str, where: Path, protocol: int) -> Path:
    """The agent of ``commit`` (the last of protocol ``protocol``) built in ``where``; skips the test when the
    checkout's history does not reach that commit."""
    source = subprocess.run(["git", "show", f"{commit}:fanfold/_agent/agent.c"], capture_output=True,
                            cwd=Path(__file__).parent)
    if source.returncode != 0:
        pytest.skip(f"the protocol {protocol} agent's source is not in this checkout's history ({commit})")
    (where / f"agent-{commit}.c").write_bytes(source.stdout)
    binary = where / f"agent-{commit}"
    subprocess.run(["cc", "-static", "-O2", "-o", str(binary), str(where / f"agent-{commit}.c")], check=True)
    return binary


async def until_listening(socket: Path, agent: subprocess.Popen[bytes], give_up_s: float = 10) -> AgentClient:
    """A client of the agent at ``socket`` once it answers: the socket's file appears at bind, a
    moment before the agent listens, so its existence alone does not say a connect will be taken."""
    client, give_up = AgentClient(str(socket)), time.monotonic() + give_up_s
    while True:
        try:
            await client.ping()
            return client
        except (AgentGone, AgentUnreachable):
            assert agent.poll() is None and time.monotonic() < give_up, f"the agent never listened on {socket}"
            await asyncio.sleep(0.01)


class running:
    """The agent at ``binary`` listening in ``where`` (its own session), killed with its children on exit."""

    def __init__(self, binary: Path, where: Path) -> None:
        self.binary, self.socket = binary, where / f"{binary.name}.sock"

    async def __aenter__(self) -> AgentClient:
        self.process = subprocess.Popen([str(self.binary), "--listen", str(self.socket), "--subreaper"],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        return await until_listening(self.socket, self.process)

    async def __aexit__(self, *exc: object) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
