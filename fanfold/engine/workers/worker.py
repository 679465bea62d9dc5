"""An engine worker process: one ``Engine`` over its share of the sandboxes, serving its router.

    python -m fanfold.engine.workers.worker FD

FD is this end of the router's socketpair. The first frame says the config, the owner (the router's
token: the sandboxes are the router's, so they outlive this process) and the share ``(index, count)``;
then every ``call`` frame runs as a task of its own. At the end of the stream (the router closed it
or died) the engine closes, destroying what it made for the router, and the process exits.
"""

from __future__ import annotations

import asyncio
import ctypes
import signal
import socket
import sys
from typing import Any

from ..core import Engine
from . import wire

PROCESS_NAME = b"fanfold-worker"
PR_SET_NAME = 15


class Worker:
    """Serves one router's calls on one engine."""

    def __init__(self, engine: Engine, channel: wire.Channel) -> None:
        self.engine, self.channel = engine, channel
        self.tasks: dict[int, asyncio.Task[None]] = {}

    def on_frame(self, frame: tuple[Any, ...]) -> None:
        if frame[0] == "call":
            self.start_call(*frame[1:])
        elif frame[0] == "cancel" and (task := self.tasks.get(frame[1])) is not None:
            task.cancel()

    def start_call(self, call_id: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for name, value in kwargs.items():
            if isinstance(value, wire.Callback):
                kwargs[name] = self._callback(call_id, value.name)
        task = asyncio.create_task(self._run(call_id, method, args, kwargs))
        self.tasks[call_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(call_id, None))

    def _callback(self, call_id: int, name: str) -> Any:
        return lambda *args: self.channel.send(wire.encode(("cb", call_id, name, args)))

    async def _run(self, call_id: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            value = await getattr(self.engine, method)(*args, **kwargs)
        except asyncio.CancelledError:
            self.channel.send(wire.encode_error(call_id, asyncio.CancelledError("cancelled by its caller")))
            return
        except BaseException as err:  # noqa: BLE001 - every error goes back to the caller
            self.channel.send(wire.encode_error(call_id, err))
            return
        try:
            frame = wire.encode(("ok", call_id, value))
        except Exception as err:  # noqa: BLE001 - a result that does not pickle
            frame = wire.encode_error(call_id, err)
        self.channel.send(frame)

    async def stop(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.engine.close()


async def main(fd: int) -> None:
    first: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()
    channel = await wire.open_channel(socket.socket(fileno=fd), lambda frame: first.done() or first.set_result(frame))
    await asyncio.wait([first, channel.ended], return_when=asyncio.FIRST_COMPLETED)
    if not first.done():
        return  # the router stopped before this worker was needed
    _, config, owner, shard = first.result()
    engine = Engine(config, owner=owner, shard=shard)
    try:
        await engine.start()
    except BaseException as err:  # noqa: BLE001 - the router raises it as this engine's start failure
        channel.send(wire.encode_error(0, err))
        channel.close()
        return
    worker = Worker(engine, channel)
    channel.on_frame = worker.on_frame
    channel.send(wire.encode(("ready",)))
    try:
        await channel.ended
    finally:
        await worker.stop()
        channel.close()


def run(argv: list[str]) -> None:
    # Ctrl-C reaches the whole process group: the router closes this worker when its fleet closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(PROCESS_NAME), 0, 0, 0)
    asyncio.run(main(int(argv[1])))


if __name__ == "__main__":
    run(sys.argv)
