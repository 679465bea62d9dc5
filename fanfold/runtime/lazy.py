"""Lazy restore: a sandbox restored from memory images gets its pages when it touches them.

``criu restore --lazy-pages`` maps the restored tasks' anonymous memory empty and registers it
with userfaultfd; one ``criu lazy-pages`` daemon per restore answers each fault with the page
from the images (``UFFDIO_COPY``). fanfold's CRIU carries a patch (``scripts/criu/
lazy-pages-on-demand.patch``) so that the daemon

- serves faults only: a page the sandbox never touches is never copied (stock CRIU copies all
  the rest in the background once faults go quiet);
- copies the rest and exits (a *drain*) when its control pipe gets a byte or is closed: before a
  checkpoint (CRIU dumps only pages that are present), and when the engine that owns it dies, so
  the sandbox never depends on a daemon nobody watches;
- keeps its counters (pages copied, pages in the images, faults, state) in a small file;
- makes the tasks' uffds from ``/dev/userfaultfd`` where a user namespace may not call
  ``userfaultfd()`` (``vm.unprivileged_userfaultfd = 0``).

A daemon that dies before its drain is done takes the missing pages with it (the kernel fills
them with zeros): ``PageSource.watch`` tells the owner, who ends the sandbox and says why.

Each daemon is a process and about 1 MB. Its owner drains one that copied nothing for a while
(``PageSource.idle_for``: a sandbox that stopped touching new pages may never touch the rest), and
restores eagerly past a cap on how many run (``EngineConfig.page_servers_max``).
"""

from __future__ import annotations

import asyncio
import os
import signal
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
LOG_FILE = "lazy-pages.log"
READY_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 120.0


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


class PageSource:
    """One ``criu lazy-pages`` daemon, a child of the engine, serving one restore from ``images``.

    Its files (log, counters, pid) are in ``work``, the dir the restore's ``-W`` names too, where
    CRIU puts the socket the two meet on. ``stop()`` ends it; ``drain()`` lets it finish.
    """

    def __init__(self, pid: int, control: int, work: Path) -> None:
        self.pid, self.work = pid, work
        self._control = control
        self._pidfd = os.pidfd_open(pid)
        self._status: int | None = None
        self._exited = asyncio.get_running_loop().create_future()
        self._stopping = False
        self.draining = False
        """Whether ``drain`` was called: the daemon copies the rest in and exits."""
        self._seen: tuple[int, int] | None = None
        self._active_at = time.monotonic()
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)

    @classmethod
    async def start(cls, binary: str, images: Path, work: Path) -> PageSource:
        """Start serving ``images``; returns once the daemon listens for the restore."""
        control_r, control_w = os.pipe2(os.O_CLOEXEC)
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        env = {**os.environ, "CRIU_LAZY_CONTROL_FD": "3", "CRIU_LAZY_STATS": str(work / STATS_FILE)}
        argv = [binary, "lazy-pages", "-D", str(images), "-W", str(work), "-o", LOG_FILE, "-v2", "--status-fd", "4"]
        actions = [(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, devnull, 1),
                   (os.POSIX_SPAWN_DUP2, devnull, 2), (os.POSIX_SPAWN_DUP2, control_r, 3),
                   (os.POSIX_SPAWN_DUP2, ready_w, 4)]
        try:
            pid = os.posix_spawn(binary, argv, env, file_actions=actions)
            WAITING.add(pid)
        except OSError as err:
            for fd in (control_r, control_w, ready_r, ready_w, devnull):
                os.close(fd)
            raise InfrastructureError(f"cannot start CRIU's page server {binary}: {err.strerror}") from None
        for fd in (control_r, ready_w, devnull):
            os.close(fd)
        (work / PID_FILE).write_text(f"{pid} {procs.stat_fields(str(pid))[19]}\n")
        source = cls(pid, control_w, work)
        try:
            ready = await asyncio.wait_for(asyncio.to_thread(os.read, ready_r, 1), READY_TIMEOUT_S)
        except asyncio.TimeoutError:
            ready = b""
        finally:
            os.close(ready_r)
        if ready != b"\0" or read_counts(work) is None:
            await source.stop()
            raise InfrastructureError(
                f"CRIU's page server did not start ({log_errors(work / LOG_FILE, 3)}); lazy restore needs the CRIU"
                " that `bash scripts/criu.sh` builds (with scripts/criu/lazy-pages-on-demand.patch)")
        return source

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
                break
            await asyncio.sleep(0.0005)
        if self.running:
            raise InfrastructureError(f"CRIU's page server did not take the restored tasks within {timeout:.0f} s")
        if not self._complete():
            raise InfrastructureError(f"CRIU's page server did not take the restored tasks: {self._why_lost()}")

    @property
    def running(self) -> bool:
        return self._status is None

    @property
    def stopping(self) -> bool:
        """Whether ``stop`` or ``let_go`` ended or released it."""
        return self._stopping

    def idle_for(self) -> float:
        """Seconds since the daemon was last seen to copy a page (each call looks at its counters)."""
        counts = self.counts()
        seen = (counts.copied, counts.faults) if counts else None
        if seen != self._seen:
            self._seen, self._active_at = seen, time.monotonic()
        return time.monotonic() - self._active_at

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost(why)`` if the daemon ends before its drain is done, not when ``stop()`` ends it."""
        def exited(_: asyncio.Future[None]) -> None:
            if not self._stopping and not self._complete():
                on_lost(self._why_lost())
        self._exited.add_done_callback(exited)

    async def drain(self, timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Have every page not yet faulted in copied, and wait for the daemon to exit: after it,
        the sandbox's memory no longer depends on it. CheckpointFailed when it fails."""
        self.draining = True
        if self.running:
            try:
                os.write(self._control, b"d")
            except OSError:
                pass  # it is exiting: its status says how
            try:
                await asyncio.wait_for(asyncio.shield(self._exited), timeout)
            except asyncio.TimeoutError:
                raise CheckpointFailed(f"copying the sandbox's memory in took over {timeout:.0f} s") from None
        if not self._complete():
            raise CheckpointFailed(f"the sandbox's memory is incomplete: {self._why_lost()}")
        self._close()

    async def stop(self) -> None:
        """End the daemon (its sandbox is gone or going) and reap it."""
        self._stopping = True
        if self.running:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await asyncio.shield(self._exited)
        self._close()

    def let_go(self) -> None:
        """This engine is closing and the sandbox outlives it: the daemon copies the rest in and exits,
        watched by nobody (a thread reaps it)."""
        self._stopping = True
        if self._pidfd >= 0:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        if self._control >= 0:
            os.close(self._control)  # the daemon's cue to drain
            self._control = -1
        if self.running:
            threading.Thread(target=_reap, args=(self.pid,), name="fanfold-page-server-reaper", daemon=True).start()

    def _on_exit(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 0
        if not pid:
            return
        WAITING.discard(self.pid)
        self._status = os.waitstatus_to_exitcode(status)
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        if not self._exited.done():
            self._exited.set_result(None)

    def _complete(self) -> bool:
        counts = self.counts()
        return self._status == 0 and counts is not None and counts.state == "done"

    def _why_lost(self) -> str:
        counts = self.counts()
        how = (f"was killed by signal {-self._status}" if self._status is not None and self._status < 0
               else f"exited with status {self._status}")
        served = f" after copying {counts.copied} of {counts.total} pages" if counts else ""
        return (f"its memory's page server (CRIU lazy-pages, pid {self.pid}) {how}{served}; its log:"
                f" {log_errors(self.work / LOG_FILE, 3)}")

    def _close(self) -> None:
        if self._control >= 0:
            os.close(self._control)
            self._control = -1
        (self.work / PID_FILE).unlink(missing_ok=True)


async def settle_orphan(work: Path, timeout: float = DRAIN_TIMEOUT_S) -> None:
    """A sandbox restored lazily by an engine that is gone: its daemon drains on its own (its control
    pipe closed). Wait for that; CheckpointFailed unless its memory is all there."""
    counts = read_counts(work)
    if counts is None:
        return
    pid = _daemon_pid(work)
    if pid is not None:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            pidfd = -1
        if pidfd >= 0:
            loop = asyncio.get_running_loop()
            gone = loop.create_future()
            loop.add_reader(pidfd, lambda: gone.done() or gone.set_result(None))
            try:
                await asyncio.wait_for(gone, timeout)
            except asyncio.TimeoutError:
                raise CheckpointFailed(f"copying the sandbox's memory in took over {timeout:.0f} s") from None
            finally:
                loop.remove_reader(pidfd)
                os.close(pidfd)
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


def kill_orphan(work: Path) -> None:
    """Kill the page server a crashed engine left serving ``work``'s sandbox, if it still runs."""
    pid = _daemon_pid(work)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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

