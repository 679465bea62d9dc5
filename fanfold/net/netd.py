"""The engine's end of ``fanfold netd`` (``daemon.py``): start it, talk to it, stop it."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..errors import InfrastructureError

START_TIMEOUT_S = 30.0
MAX_REPLY = 16 << 20
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33
REPLY_TIMEOUT_S = 30.0


class NetdDied(InfrastructureError):
    """netd ended or stopped answering; the engine starts a new one and attaches its sandboxes again."""


class Netd:
    """One netd process and its control socket; requests are answered in order."""

    def __init__(self, settings: dict[str, Any], log: Path, user: str | None) -> None:
        self.settings, self.log, self.user = settings, log, user
        self.process: subprocess.Popen[bytes] | None = None
        self.control: socket.socket | None = None
        self._lock = asyncio.Lock()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None and self.control is not None

    async def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if os.geteuid() == 0:  # one message holds one reply: room for every sandbox's counters
            theirs.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, MAX_REPLY)
            ours.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, MAX_REPLY)
        try:
            self.process = await asyncio.to_thread(self._spawn, theirs)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self.control = ours
        try:
            await self.request({"op": "ping"}, timeout=START_TIMEOUT_S)
        except NetdDied as err:
            await self.stop()
            raise InfrastructureError(f"the egress proxy (fanfold netd) did not start: {err}") from None

    def _spawn(self, theirs: socket.socket) -> subprocess.Popen[bytes]:
        args = [sys.executable, "-m", "fanfold.net.daemon", "--control", str(theirs.fileno()),
                "--settings", json.dumps(self.settings)]
        if self.user and os.geteuid() == 0:
            # netd drops to the user itself, once Python and its modules are loaded: the interpreter
            # may live where that user cannot read (a root-only pyenv).
            try:
                entry = pwd.getpwnam(self.user)
            except KeyError:
                raise InfrastructureError(f"the egress proxy's user {self.user!r} does not exist on this host: set"
                                          " FANFOLD_NET_USER to an unprivileged user") from None
            args += ["--user", f"{entry.pw_uid}:{entry.pw_gid}"]
        log = open(self.log, "ab")
        try:
            return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(theirs.fileno(),),
                                    cwd="/", env=_env(), start_new_session=True)
        finally:
            log.close()

    async def request(self, message: dict[str, Any], fds: list[int] | None = None, *,
                      timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        """Send one message (with ``fds``) and return netd's answer; NetdDied when it is gone."""
        async with self._lock:
            # Its own reference: ``stop`` (netd found dead) may close and drop the socket under this wait.
            control = self.control
            if control is None:
                raise NetdDied("netd is not running")
            loop = asyncio.get_running_loop()
            try:
                await asyncio.wait_for(self._send(loop, control, json.dumps(message).encode(), fds or []), timeout)
                data = await asyncio.wait_for(loop.sock_recv(control, MAX_REPLY), timeout)
            except (OSError, ValueError, asyncio.TimeoutError) as err:
                # ValueError: ``stop`` closed the socket under this wait (its fd is now -1).
                raise NetdDied(f"netd did not answer {message.get('op')!r}: {err or 'timed out'}{self._tail()}") from None
            if not data:
                raise NetdDied(f"netd exited{self._tail()}")
        reply: dict[str, Any] = json.loads(data)
        if not reply.get("ok"):
            raise InfrastructureError(f"netd refused {message.get('op')!r}: {reply.get('error')}")
        return reply

    @staticmethod
    async def _send(loop: asyncio.AbstractEventLoop, control: socket.socket, data: bytes, fds: list[int]) -> None:
        while True:
            try:
                socket.send_fds(control, [data], fds)
                return
            except BlockingIOError:
                ready = loop.create_future()
                loop.add_writer(control, ready.set_result, None)
                try:
                    await ready
                finally:
                    loop.remove_writer(control)

    def _tail(self) -> str:
        try:
            text = self.log.read_bytes()[-600:].decode("utf-8", "replace").strip()
        except OSError:
            return ""
        return f"; the end of {self.log}:\n{text}" if text else ""

    async def stop(self) -> None:
        """Close the control socket (netd ends on its end of file) and wait for it; kill if it lingers."""
        if self.control is not None:
            self.control.close()
            self.control = None
        process, self.process = self.process, None
        if process is not None:
            try:
                await asyncio.to_thread(process.wait, 5)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait)


SECRET_WORDS = ("TOKEN", "AUTH", "PASSWORD", "SECRET", "KEY", "CREDENTIAL")


def _env() -> dict[str, str]:
    """netd's environment: the engine's, less anything that looks like a secret, and enough to import fanfold."""
    env = {name: value for name, value in os.environ.items() if not any(w in name.upper() for w in SECRET_WORDS)}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env
