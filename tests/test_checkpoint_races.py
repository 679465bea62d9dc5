"""A dump that meets a unix connection its listener has not accepted yet (CRIU cannot carry the bytes in
flight: systemd hands each new unit's output to journald so) is tried again while the sandbox runs.
Real CRIU, crun and processes, embedded.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from fanfold import AsyncFleet, CheckpointFailed, CheckpointRaced, EngineConfig
from fanfold.engine import checkpoints
from fanfold.host import census
from fanfold.runtime.criu import Criu

# Connects to its own listener and writes, then accepts only on SIGUSR1: until then the connection is
# in flight, its bytes in the client's write queue.
SERVER = r"""
import os, signal, socket
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
listener = socket.socket(socket.AF_UNIX)
listener.bind("/tmp/listener.sock")
listener.listen()
client = socket.socket(socket.AF_UNIX)
client.connect("/tmp/listener.sock")
client.sendall(b"hello")
open("/tmp/ready", "w").write("1")
signal.sigwait({signal.SIGUSR1})
connection, _ = listener.accept()
open("/tmp/accepted.new", "w").write(connection.recv(5).decode())
os.rename("/tmp/accepted.new", "/tmp/accepted")
signal.sigwait({signal.SIGUSR1})
"""


def host_pid(script: str) -> int:
    """The host pid of the sandbox's process running ``script``."""
    found = [pid for pid, argv in census.processes() if script.encode() in argv]
    assert found, f"no process runs {script}"
    return found[0]


class Dumps:
    """Each CRIU dump of this process, by what it raised (None: it went through); ``on_raced(root)``
    runs after a raced one, with the root of the sandbox it dumped."""

    def __init__(self) -> None:
        self.raised: list[BaseException | None] = []
        self.on_raced: Callable[[Path], None] | None = None


@pytest.fixture
def dumps(monkeypatch: pytest.MonkeyPatch) -> Dumps:
    seen = Dumps()
    dump = Criu.dump

    async def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            said = await dump(self, *args, **kwargs)
        except CheckpointRaced as err:
            seen.raised.append(err)
            if seen.on_raced is not None:
                seen.on_raced(kwargs["root"])
            raise
        seen.raised.append(None)
        return said

    monkeypatch.setattr(Criu, "dump", spy)
    return seen


async def test_a_dump_that_meets_a_connection_in_flight_is_tried_again(config: EngineConfig, dumps: Dumps):
    script = f"/tmp/server-{uuid.uuid4().hex[:8]}.py"
    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create() as sandbox:
            await sandbox.files.write(script, SERVER)
            await sandbox.exec(f"nohup python3 {script} >/dev/null 2>&1 &")
            await sandbox.exec("while [ ! -f /tmp/ready ]; do sleep 0.01; done", timeout=30)

            # Never accepted: every try meets it, and the last one's error comes through; the sandbox runs on.
            with pytest.raises(CheckpointFailed, match="in-flight socket"):
                await sandbox.snapshot(memory=True)
            assert [type(err) for err in dumps.raised] == [CheckpointRaced] * (checkpoints.RACED_RETRIES + 1)
            assert (await sandbox.exec("echo alive")).text == "alive\n"

            # Accepted after the first try: the second one takes the sandbox whole.
            dumps.raised.clear()
            server = host_pid(script)

            def accept(root: Path) -> None:
                os.kill(server, signal.SIGUSR1)
                deadline = time.monotonic() + 30
                while not (root / "tmp/accepted").exists():
                    assert time.monotonic() < deadline, "the server did not accept"
                    time.sleep(0.002)

            dumps.on_raced = accept
            snap = await sandbox.snapshot(memory=True)
            assert [err is None for err in dumps.raised] == [False, True]
            async with await fleet.create(snap) as copy:
                assert (await copy.exec("cat /tmp/accepted; pgrep -f server- >/dev/null && echo running")).text \
                    == "hello" + "running\n"
            await fleet.delete_snapshot(snap.id)
