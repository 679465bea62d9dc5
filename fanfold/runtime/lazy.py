"""Lazy restore: a sandbox restored from memory images gets its pages when it touches them.

``criu restore --lazy-pages`` maps the restored tasks' anonymous memory empty and registers it
with userfaultfd; a ``criu lazy-pages`` daemon answers each fault with the page from the images
(``UFFDIO_COPY``). fanfold's CRIU carries patches (``scripts/criu/lazy-pages-*.patch``) so that
the daemon

- serves every lazy restore of its engine (``PageServer``, one per engine): each restore is a
  *session* of its own (``PageSource``), with its images, its socket in the restore's ``-W`` dir,
  its counters, and its end; a session that fails ends alone;
- serves faults only: a page the sandbox never touches is never copied (stock CRIU copies all
  the rest in the background once faults go quiet);
- copies a session's rest in (a *drain*) when asked: before a checkpoint (CRIU dumps only pages
  that are present), and every session's when the engine that owns it dies (its control socket
  hangs up), so no sandbox depends on a daemon nobody watches; then it exits;
- keeps each session's counters (pages copied, pages in the images, faults, state) in a small file;
- makes the tasks' uffds from ``/dev/userfaultfd`` where a user namespace may not call
  ``userfaultfd()`` (``vm.unprivileged_userfaultfd = 0``).

A daemon that dies takes the pages it had not copied with it (the kernel fills them with zeros):
``PageSource.watch`` tells the owner of each sandbox it had not finished, who ends the sandbox and
says why; the next lazy restore starts a new daemon. A session costs the daemon a few kB per
restored task; its owner drains one that copied nothing for a while (``PageSource.idle_for``: a
sandbox that stopped touching new pages may never touch the rest), and restores eagerly past a cap
on how many are served (``EngineConfig.page_servers_max``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import CheckpointFailed, InfrastructureError
from ..host import procs
from ..host.spawn import WAITING
from .criu import log_errors

STATS_FILE = "lazy-pages.stats"
PID_FILE = "lazy-pages.pid"
"""In a session's dir: the pid and start time of the daemon serving it (``settle_orphan``)."""
READY_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 120.0
SETTLE_POLL_S = 0.005


@dataclass(frozen=True)
class PageCounts:
    """What a page source has done so far."""

    copied: int
    """Pages copied into the sandbox (faults, then a drain's rest)."""
    total: int
    """Pages of the images the sandbox's tasks may fault in."""
    faults: int
    state: str
    """``starting``, ``serving`` (faults only), ``draining``, ``done`` or ``failed``."""

    def to_dict(self) -> dict[str, int | str]:
        return {"copied": self.copied, "total": self.total, "faults": self.faults, "state": self.state}


def read_counts(work: Path) -> PageCounts | None:
    """The counters a page source keeps in ``work`` (None: no lazy restore there, or unreadable)."""
    try:
        fields = (work / STATS_FILE).read_text().split()
        return PageCounts(int(fields[0]), int(fields[1]), int(fields[2]), fields[3])
    except (OSError, ValueError, IndexError):
        return None


class PageServer:
    """One ``criu lazy-pages`` daemon, a child of the engine, serving every lazy restore it is given.

    The engine talks to it over a ``SOCK_SEQPACKET`` socket, one record a command, fields joined
    by newlines: ``serve ID IMAGES WORK`` (answered ``ready ID`` or ``failed ID WHY``), ``drain ID``
    (answered ``done ID``) and ``drop ID``; a session that fails later says ``failed ID WHY``.
    """

    def __init__(self, pid: int, control: socket.socket, log: Path) -> None:
        self.pid, self.log = pid, log
        self.start_time = procs.stat_fields(str(pid))[19]
        self._control = control
        self._pidfd = os.pidfd_open(pid)
        self._status: int | None = None
        self._sources: dict[str, PageSource] = {}
        self._starting: dict[str, asyncio.Future[str | None]] = {}
        loop = asyncio.get_running_loop()
        loop.add_reader(self._pidfd, self._on_exit)
        loop.add_reader(control.fileno(), self._on_message)

    @classmethod
    async def start(cls, binary: str, state_dir: Path, log: Path) -> PageServer:
        """Start the daemon; returns once it listens on its control socket. ``log``'s dir is its
        ``-W``; ``state_dir`` (its ``-D``) names whose it is (``census.page_servers``)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        env = {**os.environ, "CRIU_LAZY_CONTROL_FD": "3", "CRIU_LAZY_SHARED": "1"}
        argv = [binary, "lazy-pages", "-D", str(state_dir), "-W", str(log.parent), "-o", log.name, "-v2",
                "--status-fd", "4"]
        actions = [(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, devnull, 1),
                   (os.POSIX_SPAWN_DUP2, devnull, 2), (os.POSIX_SPAWN_DUP2, theirs.fileno(), 3),
                   (os.POSIX_SPAWN_DUP2, ready_w, 4)]
        try:
            pid = os.posix_spawn(binary, argv, env, file_actions=actions)
            WAITING.add(pid)
        except OSError as err:
            ours.close()
            os.close(ready_r)
            raise InfrastructureError(f"cannot start CRIU's page server {binary}: {err.strerror}") from None
        finally:
            theirs.close()
            for fd in (ready_w, devnull):
                os.close(fd)
        ours.setblocking(False)
        server = cls(pid, ours, log)
        try:
            ready = await asyncio.wait_for(asyncio.to_thread(os.read, ready_r, 1), READY_TIMEOUT_S)
        except asyncio.TimeoutError:
            ready = b""
        finally:
            os.close(ready_r)
        if ready != b"\0":
            server.kill()
            raise InfrastructureError(
                f"CRIU's page server did not start ({log_errors(log, 3)}); lazy restore needs the CRIU that"
                " `bash scripts/criu.sh` builds (with scripts/criu/lazy-pages-shared.patch)")
        return server

    @property
    def running(self) -> bool:
        return self._status is None

    @property
    def sessions(self) -> int:
        """Sandboxes it serves now."""
        return len(self._sources)

    async def serve(self, sandbox_id: str, images: Path, work: Path) -> PageSource:
        """Have the daemon listen in ``work`` for the restore of ``images`` into ``sandbox_id``."""
        if not self.running:
            raise InfrastructureError(f"CRIU's page server (pid {self.pid}) is gone; its log: {log_errors(self.log, 3)}")
        started = self._starting[sandbox_id] = asyncio.get_running_loop().create_future()
        try:
            self._send("serve", sandbox_id, str(images), str(work))
            failed = await asyncio.wait_for(asyncio.shield(started), READY_TIMEOUT_S)
        except asyncio.TimeoutError:
            failed = f"no answer within {READY_TIMEOUT_S:.0f} s"
        finally:
            self._starting.pop(sandbox_id, None)
        if failed is not None:
            raise InfrastructureError(f"CRIU's page server cannot serve sandbox {sandbox_id}: {failed}")
        (work / PID_FILE).write_text(f"{self.pid} {self.start_time}\n")
        source = self._sources[sandbox_id] = PageSource(self, sandbox_id, work)
        return source

    def let_go(self) -> None:
        """This engine is closing and its sandboxes outlive it: the daemon copies every session's
        rest in and exits, watched by nobody (a thread reaps it)."""
        for source in self._sources.values():
            source._stopping = True
        self._sources.clear()
        loop = asyncio.get_running_loop()
        if self._control.fileno() >= 0:
            loop.remove_reader(self._control.fileno())
            self._control.close()  # the daemon's cue to drain
        if self._pidfd >= 0:
            loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
            threading.Thread(target=_reap, args=(self.pid,), name="fanfold-page-server-reaper", daemon=True).start()

    def kill(self) -> None:
        if self.running:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _send(self, *fields: str) -> None:
        try:
            self._control.send("\n".join(fields).encode())
        except OSError:
            pass  # it is exiting: its exit ends every session

    def _on_message(self) -> None:
        while True:
            try:
                record = self._control.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                record = b""
            if not record:
                asyncio.get_running_loop().remove_reader(self._control.fileno())
                return  # exiting: _on_exit says how
            what, _, rest = record.decode(errors="replace").partition("\n")
            sandbox_id, _, why = rest.partition("\n")
            started = self._starting.get(sandbox_id)
            if started is not None and not started.done():
                started.set_result(None if what == "ready" else why or what)
                continue
            source = self._sources.pop(sandbox_id, None)
            if source is not None:
                source._end(None if what == "done" else self._why(f"failed to serve it: {why or what}", source))

    def _on_exit(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 0
        if not pid:
            return
        WAITING.discard(self.pid)
        self._status = os.waitstatus_to_exitcode(status)
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        if self._control.fileno() >= 0:
            loop.remove_reader(self._control.fileno())
            self._control.close()
        how = (f"was killed by signal {-self._status}" if self._status < 0
               else f"exited with status {self._status}")
        for started in self._starting.values():
            if not started.done():
                started.set_result(f"it {how}")
        sources, self._sources = self._sources, {}
        for source in sources.values():
            source._end(self._why(how, source))

    def _why(self, how: str, source: PageSource) -> str:
        counts = source.counts()
        served = f" after copying {counts.copied} of {counts.total} pages" if counts else ""
        return (f"its memory's page server (CRIU lazy-pages, pid {self.pid}) {how}{served}; its log:"
                f" {self._errors_of(source.sandbox_id)}")

    def _errors_of(self, sandbox_id: str) -> str:
        """The log's errors about ``sandbox_id`` (the log is every session's), else its last lines."""
        try:
            own = [line.strip() for line in self.log.read_text(errors="replace").splitlines()
                   if "Error" in line and sandbox_id in line]
        except OSError:
            own = []
        return " | ".join(own[-3:])[-1500:] if own else log_errors(self.log, 3)


class PageSource:
    """One sandbox's session on the engine's ``PageServer``: its counters are in ``work``, the
    dir the restore's ``-W`` names too, where the daemon listens for it. ``stop()`` ends it;
    ``drain()`` lets it finish."""

    def __init__(self, server: PageServer, sandbox_id: str, work: Path) -> None:
        self.server, self.sandbox_id, self.work = server, sandbox_id, work
        self._ended: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        """Set as the session ends: None when its drain is done, else why it was lost."""
        self._stopping = False
        self.draining = False
        """Whether ``drain`` was called: the daemon copies the rest in and forgets the session."""
        self._seen: tuple[int, int] | None = None
        self._active_at = time.monotonic()

    def counts(self) -> PageCounts | None:
        return read_counts(self.work)

    async def opened(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until the daemon holds every image it serves open (it reads each task's as the restore
        sends it, maybe after the restore returned): from then on the image files may be removed."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.running:
            counts = self.counts()
            if counts is not None and counts.state != "starting":
                return
            if asyncio.get_running_loop().time() > deadline:
                raise InfrastructureError(
                    f"CRIU's page server did not take the restored tasks within {timeout:.0f} s")
            await asyncio.sleep(0.0005)
        if self._ended.result() is not None:
            raise InfrastructureError(f"CRIU's page server did not take the restored tasks: {self._ended.result()}")

    @property
    def running(self) -> bool:
        """Whether the session still serves (neither drained, lost nor stopped)."""
        return not self._ended.done()

    @property
    def stopping(self) -> bool:
        """Whether ``stop`` ended it."""
        return self._stopping

    def idle_for(self) -> float:
        """Seconds since the daemon was last seen to copy a page (each call looks at its counters)."""
        counts = self.counts()
        seen = (counts.copied, counts.faults) if counts else None
        if seen != self._seen:
            self._seen, self._active_at = seen, time.monotonic()
        return time.monotonic() - self._active_at

    async def ended(self) -> str | None:
        """Wait for the session to end: None when its drain is done, else why it was lost or stopped."""
        return await asyncio.shield(self._ended)

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost(why)`` if the session ends before its drain is done, not when ``stop()`` ends it."""
        def ended(done: asyncio.Future[str | None]) -> None:
            if not self._stopping and done.result() is not None:
                on_lost(done.result())
        self._ended.add_done_callback(ended)

    async def drain(self, timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Have every page not yet faulted in copied: after it, the sandbox's memory no longer
        depends on the daemon. CheckpointFailed when it fails."""
        self.draining = True
        if self.running:
            self.server._send("drain", self.sandbox_id)
            try:
                await asyncio.wait_for(asyncio.shield(self._ended), timeout)
            except asyncio.TimeoutError:
                raise CheckpointFailed(f"copying the sandbox's memory in took over {timeout:.0f} s") from None
        if self._ended.result() is not None:
            raise CheckpointFailed(f"the sandbox's memory is incomplete: {self._ended.result()}")
        self._close()

    async def stop(self) -> None:
        """End the session (its sandbox is gone or going)."""
        self._stopping = True
        if self.running:
            if self.server._sources.pop(self.sandbox_id, None) is not None:
                self.server._send("drop", self.sandbox_id)
            self._end("stopped")
        self._close()

    def _end(self, why: str | None) -> None:
        if not self._ended.done():
            self._ended.set_result(why)

    def _close(self) -> None:
        (self.work / PID_FILE).unlink(missing_ok=True)


class LazyPages:
    """A backend's lazy restores: its page servers (``processes`` of them, each started at its first
    restore, again after one died) and the session of each sandbox whose memory is not all in, by
    sandbox id. A restore goes to the server serving the fewest sandboxes."""

    def __init__(self, binary: str, state_dir: Path, run_dir: Path, processes: int = 1) -> None:
        self.binary, self.state_dir, self.run_dir = binary, state_dir, run_dir
        self.sources: dict[str, PageSource] = {}
        self.servers: list[PageServer | None] = [None] * max(1, processes)
        self._asked = [0] * len(self.servers)
        self._starting = asyncio.Lock()
        for log in run_dir.glob("lazy-pages.*.log"):  # those of engines that died
            engine = log.name.split(".")[1]
            if engine.isdigit() and not procs.running(engine):
                log.unlink(missing_ok=True)

    async def serve(self, sandbox_id: str, images: Path, work: Path) -> PageSource:
        """A session for the restore of ``images`` into ``sandbox_id``, kept in ``sources``."""
        async with self._starting:
            slot = min(range(len(self.servers)), key=self._load)
            self._asked[slot] += 1
        try:
            async with self._starting:
                server = self.servers[slot]
                if server is None or not server.running:
                    server = self.servers[slot] = await PageServer.start(self.binary, self.state_dir, self._log(slot))
            self.sources[sandbox_id] = source = await server.serve(sandbox_id, images, work)
        finally:
            self._asked[slot] -= 1
        return source

    def let_go(self) -> None:
        """The engine is closing: each daemon finishes every session on its own (``PageServer.let_go``)."""
        for source in self.sources.values():
            source._stopping = True
        self.sources.clear()
        for slot, server in enumerate(self.servers):
            if server is not None:
                server.let_go()
                self.servers[slot] = None
            self._log(slot).unlink(missing_ok=True)

    def _load(self, slot: int) -> int:
        """Sandboxes the slot's server serves or is asked to (restores at once all count)."""
        server = self.servers[slot]
        return self._asked[slot] + (server.sessions if server is not None and server.running else 0)

    def _log(self, slot: int) -> Path:
        return self.run_dir / f"lazy-pages.{os.getpid()}.{slot}.log"


async def settle_orphan(work: Path, timeout: float = DRAIN_TIMEOUT_S) -> None:
    """A sandbox restored lazily by an engine that is gone: the daemon drains it on its own (its
    control socket hung up). Wait for that; CheckpointFailed unless its memory is all there."""
    counts = read_counts(work)
    if counts is None:
        return
    deadline = time.monotonic() + timeout
    # The daemon serves the rest of that engine's sandboxes too: this one's counters say when it is done.
    while counts is not None and counts.state not in ("done", "failed") and _daemon_pid(work) is not None:
        if time.monotonic() > deadline:
            raise CheckpointFailed(f"copying the sandbox's memory in took over {timeout:.0f} s")
        await asyncio.sleep(SETTLE_POLL_S)
        counts = read_counts(work)
    if counts is None or counts.state != "done":
        raise CheckpointFailed(f"the sandbox's memory is incomplete: its page server stopped after copying"
                               f" {counts.copied if counts else '?'} of {counts.total if counts else '?'} pages")
    (work / STATS_FILE).unlink(missing_ok=True)
    (work / PID_FILE).unlink(missing_ok=True)


def cool_images(snapshots: Path, last_used: dict[str, float], cooled: set[str], cold_s: float) -> set[str]:
    """Drop from the page cache the memory images of snapshots no restore used for ``cold_s`` seconds
    (since ``last_used``, else since they were written) and not dropped before (``cooled``); returns
    the images dropped now. Blocking; the caller passes copies.

    While hot, a snapshot's pages are read from the page cache, as cheap as tmpfs here and reclaimable
    (tmpfs would pin them without swap); cold, they wait on disk and cost no memory."""
    now, dropped = time.time(), set()
    for memory in snapshots.glob("*/memory"):
        key = str(memory)
        if key in cooled:
            continue
        try:
            if now - max(last_used.get(key, 0.0), memory.stat().st_mtime) < cold_s:
                continue
            for image in memory.glob("pages-*.img"):
                fd = os.open(image, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fdatasync(fd)  # dirty pages would stay
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        except OSError:
            continue  # deleted meanwhile
        dropped.add(key)
    return dropped


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    WAITING.discard(pid)


def _daemon_pid(work: Path) -> int | None:
    """The pid in ``work``'s pid file, if that process still runs (its start time matches)."""
    try:
        pid, start = (work / PID_FILE).read_text().split()
        fields = procs.stat_fields(pid)
    except (OSError, ValueError):
        return None
    return int(pid) if len(fields) > 19 and fields[19] == start else None

