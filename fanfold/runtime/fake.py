"""The fake backend: fanfold's real agent run as a plain process over a directory. No root.

Each sandbox is ``<state_dir>/fake/<id>/root``, made from its layers (hard links, copies across
file systems; overlayfs whiteouts and opaque dirs honoured), with the real static agent started
beside it in its own session (``--root``, ``--subreaper``) and driven by the real AgentClient
over a socket in ``/tmp/ff-<uid>-<tag>/``. Freezing stops the agent's process tree with
SIGSTOP; a checkpoint copies the root as a full tree (marked ``.fanfold-fake-full``, so a later
bring-up starts from it and needs no whiteouts).

What it cannot do: isolate (commands run as the engine's user and see the host's files apart
from their cwd: no namespaces, hostname or network), enforce ``spec.limits`` or overlay
``spec.host_dirs`` (both ignored; ``oom_kill`` and ``pids_max`` read 0, the memory peak is
sampled), or keep processes: a memory checkpoint is cold, its restore re-runs the services over
the disk and in-memory state is lost. A file linked from a layer shares the layer's inode, so a
command that rewrites one in place changes the layer (the Files API replaces files, so it never
does). Sockets, and device nodes when unprivileged, are not copied.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .._agent.build import agent_binary
from .._agent.client import AgentClient, ExecControl, ExecUser, OnChunk, RawExec
from ..errors import CheckpointFailed, HostNotReady, InfrastructureError, InvalidRequest
from ..host import procs, setup
from ..host.offload import host_errors, on_thread, read_once
from .base import Backend, Capabilities, CounterReader, Handle, SandboxSpec

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..store import LayerStore

MARKER = ".fanfold-fake-full"
"""At the top of a layer the fake's checkpoint wrote: a full tree, not a diff on the layers below."""
OPAQUE = ("trusted.overlay.opaque", "user.overlay.opaque")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_TICK_US = 1_000_000 // os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


class FakeBackend(Backend):
    """Sandboxes as plain processes over directories: for tests of engine logic, without root."""

    name = "fake"
    capabilities = Capabilities(memory="cold", exact_counters=False, isolated=False)
    step_runtime = None

    def __init__(self, config: EngineConfig, store: LayerStore) -> None:
        super().__init__(config, store)
        self._base = config.state_dir / "fake"
        tag = hashlib.sha256(str(config.state_dir).encode()).hexdigest()[:8]
        self._sockets = Path(f"/tmp/ff-{os.getuid()}-{tag}")
        self._agent_path: Path | None = None
        self._agents: dict[str, tuple[int, int]] = {}
        """Sandbox id -> (agent pid, its start time), as also kept in the sandbox's ``agent.pid``."""
        self._children: set[int] = set()
        """Agents we spawned and have not reaped."""

    # -- the host -------------------------------------------------------------------------------

    async def prepare(self) -> None:
        try:
            self._agent_path = await on_thread(agent_binary, self.config.state_dir)
            self._make_dirs()
        except OSError as err:
            raise HostNotReady(f"the fake backend cannot set up its directories: {err}") from None

    async def close(self, *, idle: bool = True) -> None:
        if not idle:
            return
        await self.sweep()
        try:
            self._sockets.rmdir()
        except OSError:
            pass  # sockets of live sandboxes (maybe another engine's) are still there

    async def list_ids(self) -> set[str]:
        ids = {p.name for p in self._base.iterdir()} if self._base.is_dir() else set()
        if self._sockets.is_dir():
            ids |= {p.name.removesuffix(".sock") for p in self._sockets.glob("*.sock")}
        return ids

    async def sweep(self, *, thorough: bool = False) -> None:
        self._children -= {pid for pid in self._children if _reaped(pid)}

    def _make_dirs(self) -> None:
        self._base.mkdir(parents=True, exist_ok=True)
        self._sockets.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(self._sockets)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise PermissionError(errno.EPERM, "not a directory of this user", str(self._sockets))

    # -- one sandbox ----------------------------------------------------------------------------

    def root(self, sandbox_id: str) -> Path:
        return self._base / sandbox_id / "root"

    def _socket(self, sandbox_id: str) -> Path:
        return self._sockets / f"{sandbox_id}.sock"

    def agent(self, handle: Handle) -> AgentClient:
        return AgentClient(str(self._socket(handle.id)))

    async def bring_up(self, spec: SandboxSpec) -> Handle:
        if self._agent_path is None:
            await self.prepare()
        if spec.init:
            raise InvalidRequest(f"the fake backend runs no init but its agent: an image with {spec.init} as init"
                                 " (label fanfold.init) needs the oci backend")
        if spec.restore is not None and not (spec.restore / "fake.json").is_file():
            raise InfrastructureError(f"{spec.restore} is not a memory image of the fake backend")
        layers = [self.store.layer_path(layer) for layer in spec.layers]
        with host_errors(f"bringing up sandbox {spec.id} failed"):
            self._make_dirs()
            (self._base / spec.id).mkdir()
            await on_thread(materialize, layers, self.root(spec.id))
            pid = await self._start_agent(spec)
        return Handle(spec.id, pid)

    async def _start_agent(self, spec: SandboxSpec) -> int:
        """Spawn the agent (not a child the loop watches) and wait for its ``r`` on fd 3."""
        assert self._agent_path is not None
        sock = self._socket(spec.id)
        sock.unlink(missing_ok=True)
        args = [str(self._agent_path), "--listen", str(sock), "--root", str(self.root(spec.id)), "--subreaper"]
        for name, cmd, mode in spec.services:
            args += [f"--{mode}", name, cmd]
        env = {key: value for key, _, value in (item.partition("=") for item in spec.env)}
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            pid = _spawn(args, env, err_w, ready_w)
            self._children.add(pid)
            self._record(spec.id, pid)
            os.close(ready_w)
            ready_w = -1
            try:
                said = await asyncio.wait_for(read_once(ready_r), START_TIMEOUT_S)
            except TimeoutError:
                raise InfrastructureError(f"sandbox {spec.id}'s agent did not listen within {START_TIMEOUT_S:.0f} s:"
                                          f" {_drain(err_r)}") from None
            if said != b"r":  # end of file: it exited, saying why on stderr
                raise InfrastructureError(f"sandbox {spec.id}'s agent died at start: {_drain(err_r) or 'no message'}")
            return pid
        finally:
            for fd in (ready_r, ready_w, err_r, err_w):
                if fd >= 0:
                    os.close(fd)

    def _record(self, sandbox_id: str, pid: int) -> None:
        """Keep the agent's pid and start time, for alive() and for a later engine's release."""
        started = procs.start_time(pid) or 0
        self._agents[sandbox_id] = (pid, started)
        (self._base / sandbox_id / "agent.pid").write_text(f"{pid} {started}\n")

    def _agent_pid(self, sandbox_id: str) -> int | None:
        """The sandbox's agent pid while that very process exists (zombie included), else None."""
        known = self._agents.get(sandbox_id)
        if known is None:
            try:
                pid, started = map(int, (self._base / sandbox_id / "agent.pid").read_text().split())
            except (OSError, ValueError):
                return None
            known = self._agents[sandbox_id] = (pid, started)
        pid, started = known
        return pid if procs.start_time(pid) == started else None

    def alive(self, handle: Handle) -> bool:
        return handle.pid is not None and self._agent_pid(handle.id) == handle.pid and procs.running(handle.pid)

    async def exec(
        self, handle: Handle, argv: list[str], *, env: list[str], cwd: str, timeout_ms: int, max_output: int,
        stdin: bytes | None = None, on_chunk: OnChunk | None = None, user: ExecUser | None = None,
        control: ExecControl | None = None,
    ) -> RawExec:
        """The base exec with ``cwd`` taken inside the sandbox's root. A ``user`` is the agent's to
        switch to, host ids and all: an engine run as root can, any other gets EPERM (exit 126)."""
        inside = os.path.join(self.root(handle.id), cwd.lstrip("/"))
        return await super().exec(handle, argv, env=env, cwd=inside, timeout_ms=timeout_ms,
                                  max_output=max_output, stdin=stdin, on_chunk=on_chunk, user=user,
                                  control=control)

    # -- freeze, checkpoint, release ------------------------------------------------------------

    async def freeze(self, handle: Handle) -> None:
        """SIGSTOP the agent and its descendants, top down, until the tree is the same twice and
        every process in it is stopped (stopping a parent first keeps it from forking unseen).

        A vfork parent (dash runs commands so) waits uninterruptibly until its child execs: that
        child runs on until its parent has left the wait, else neither would ever stop.
        """
        pid = self._agent_pid(handle.id)
        if pid is None or not procs.running(pid):
            raise InfrastructureError(f"sandbox {handle.id}'s agent is not running")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        seen: set[int] | None = None
        while True:
            tree = process_tree(pid)
            fields = {p: procs.stat_fields(p)[:2] for p in tree}  # [state, ppid], [] once gone
            if set(tree) == seen and all(f[:1] in ([], ["T"], ["t"], ["Z"]) for f in fields.values()):
                return
            if time.monotonic() > deadline:
                _signal(tree[::-1], signal.SIGCONT)
                raise InfrastructureError(f"sandbox {handle.id} did not freeze within {STOP_TIMEOUT_S:.0f} s")
            vforked = [p for p, f in fields.items() if f and fields.get(int(f[1]), [""])[0] == "D"]
            _signal([p for p in tree if p not in vforked], signal.SIGSTOP)
            _signal(vforked, signal.SIGCONT)
            seen = set(tree)
            await asyncio.sleep(0.001)

    async def thaw(self, handle: Handle) -> None:
        """SIGCONT bottom up, the agent last: no parent runs while a child of its is still stopped
        (a shell's wait could report the stop)."""
        pid = self._agent_pid(handle.id)
        if pid is not None:
            _signal(process_tree(pid)[::-1], signal.SIGCONT)

    async def checkpoint(
        self, handle: Handle, dest: Path, host_dirs: tuple[str, ...], *, memory: bool, leave_running: bool,
        frozen: bool = False,
    ) -> float:
        """Copy the root to ``dest/layer`` as a full tree; ``memory`` writes a cold image. Returns
        the pause in ms (the engine's telemetry reads it)."""
        started = time.perf_counter()
        if not frozen:
            await self.freeze(handle)
        try:
            await on_thread(self._write_checkpoint, handle.id, dest, memory)
        except OSError as err:
            if not frozen:
                await self.thaw(handle)
            raise CheckpointFailed(f"snapshot of {handle.id} failed: {err}") from None
        if not leave_running:
            await self._kill(handle.id)
        elif not frozen:
            await self.thaw(handle)
        return (time.perf_counter() - started) * 1000

    def _write_checkpoint(self, sandbox_id: str, dest: Path, memory: bool) -> None:
        layer = dest / "layer"
        layer.mkdir(parents=True)
        apply_layer(self.root(sandbox_id), layer, link=False)  # copies: later writes leave it alone
        (layer / MARKER).touch()
        if memory:
            (dest / "memory").mkdir()
            image = {"format": "fanfold-fake-memory", "version": 1, "sandbox": sandbox_id, "cold": True}
            (dest / "memory" / "fake.json").write_text(json.dumps(image) + "\n")

    async def release(self, sandbox_id: str, handle: Handle | None = None) -> None:
        """Kill the agent's tree (found by the pid file: the handle's pid alone could be reused),
        reap the agent, remove the sandbox's directory and socket."""
        with host_errors(f"releasing sandbox {sandbox_id} failed (the reaper tries again)"):
            await self._kill(sandbox_id)
            await on_thread(_rmtree, self._base / sandbox_id)
            self._socket(sandbox_id).unlink(missing_ok=True)
        self._agents.pop(sandbox_id, None)

    async def _kill(self, sandbox_id: str) -> None:
        """SIGKILL the descendants until none is left, then the agent, and reap it.

        The agent runs meanwhile: as subreaper it adopts and reaps the dying (a stopped agent
        would leave them as zombies); its socket goes first, so no new command starts.
        """
        pid = self._agent_pid(sandbox_id)
        if pid is None:
            return
        self._socket(sandbox_id).unlink(missing_ok=True)
        _signal([pid], signal.SIGCONT)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while len(rest := process_tree(pid)) > 1:
            if time.monotonic() > deadline:
                raise InfrastructureError(f"sandbox {sandbox_id} keeps {len(rest) - 1} processes after SIGKILL")
            _signal(rest[1:], signal.SIGKILL)
            await asyncio.sleep(0.001)
        _signal([pid], signal.SIGKILL)
        if pid in self._children:
            await setup.reap(pid)
            self._children.discard(pid)
        while procs.running(pid):  # a dead engine's agent: its parent (init) reaps it
            if time.monotonic() > deadline:
                raise InfrastructureError(f"sandbox {sandbox_id}'s agent {pid} outlived SIGKILL")
            await asyncio.sleep(0.001)

    # -- counters -------------------------------------------------------------------------------

    def counters(self, handle: Handle) -> CounterReader:
        return _Counters(self, handle.id)

    def usage(self, handle: Handle) -> tuple[float, int]:
        cpu_us, rss = self._sample(handle.id)
        return cpu_us / 1e6, rss

    def _sample(self, sandbox_id: str) -> tuple[int, int]:
        """(cpu_us, rss bytes) of the live tree; cutime counts the children each one has reaped."""
        pid = self._agent_pid(sandbox_id)
        cpu = rss = 0
        for fields in map(procs.stat_fields, process_tree(pid) if pid else []):
            if len(fields) > 21:
                cpu += sum(int(f) for f in fields[11:15]) * _TICK_US
                rss += int(fields[21]) * _PAGE
        return cpu, rss


class _Counters:
    """Sampled counters: the peak is the largest RSS seen at a read since ``reset_peak``."""

    def __init__(self, backend: FakeBackend, sandbox_id: str) -> None:
        self._backend, self._id, self._peak = backend, sandbox_id, 0

    def reset_peak(self) -> None:
        self._peak = 0

    def read(self) -> dict[str, int]:
        cpu_us, rss = self._backend._sample(self._id)
        self._peak = max(self._peak, rss)
        return {"cpu_us": cpu_us, "memory_peak": self._peak, "oom_kill": 0, "pids_max": 0}

    def close(self) -> None:
        pass


# -- processes ----------------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents before children (from /proc's children lists)."""
    tree, i = [pid], 0
    while i < len(tree):
        tree += [child for child in _children(tree[i]) if child not in tree]
        i += 1
    return tree if procs.stat_fields(pid) else []


def _children(pid: int) -> list[int]:
    found = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as handle:
                found += [int(child) for child in handle.read().split()]
    except OSError:
        pass  # gone meanwhile
    return found


def _spawn(args: list[str], env: dict[str, str], stderr: int, ready: int) -> int:
    """Start ``args`` in a session of its own with ``ready`` as fd 3: no fork of our process,
    and no child watcher of the loop waits for it (release reaps it)."""
    return os.posix_spawn(args[0], args, env, setsid=True, file_actions=[
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
        (os.POSIX_SPAWN_DUP2, stderr, 2), (os.POSIX_SPAWN_DUP2, ready, 3),
    ])


def _reaped(pid: int) -> bool:
    """Collect ``pid`` if it exited; whether it is no child of ours to wait for any more."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _drain(fd: int) -> str:
    try:
        return os.read(fd, 4096).decode(errors="replace").strip()
    except OSError:
        return ""


# -- trees --------------------------------------------------------------------------------------


def materialize(layers: list[Path], root: Path) -> None:
    """Make ``root`` from ``layers`` (bottom first): from the topmost full tree up."""
    full = [i for i, layer in enumerate(layers) if (layer / MARKER).exists()]
    root.mkdir()
    for layer in layers[full[-1] if full else 0:]:
        apply_layer(layer, root, link=True)
    (root / MARKER).unlink(missing_ok=True)


def apply_layer(src: Path, dst: Path, *, link: bool) -> None:
    """Lay ``src`` over the directory ``dst`` as overlayfs would show it: a whiteout (char device
    0:0) deletes, an opaque directory replaces. Files are hard links (``link``) or copies."""
    with os.scandir(src) as entries:
        for entry in entries:
            _apply_entry(entry, dst / entry.name, link)


def _apply_entry(entry: os.DirEntry[str], target: Path, link: bool) -> None:
    st = entry.stat(follow_symlinks=False)
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        _remove(target)
    elif stat.S_ISDIR(st.st_mode):
        if _is_opaque(entry.path) or not stat.S_ISDIR(_lmode(target)):
            _remove(target)
            target.mkdir()
        os.chmod(target, 0o700)  # writable while we fill it, even unprivileged
        apply_layer(Path(entry.path), target, link=link)
        os.chmod(target, stat.S_IMODE(st.st_mode))
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        _remove(target)
        _place(entry.path, target, st, link)


def _place(src: str, target: Path, st: os.stat_result, link: bool) -> None:
    if link:
        try:
            os.link(src, target, follow_symlinks=False)
            return
        except OSError as err:  # another file system, a file not ours (protected_hardlinks), too many links
            if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP):
                raise
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), target)
    elif stat.S_ISREG(st.st_mode):
        shutil.copy2(src, target, follow_symlinks=False)
    elif not stat.S_ISSOCK(st.st_mode):
        try:
            os.mknod(target, st.st_mode, st.st_rdev)
        except PermissionError:
            pass  # a device node, and we are not root


def _is_opaque(path: str) -> bool:
    for name in OPAQUE:
        try:
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
        except OSError:
            pass
    return False


def _lmode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return 0


def _remove(path: Path) -> None:
    mode = _lmode(path)
    if stat.S_ISDIR(mode):
        _rmtree(path)
    elif mode:
        path.unlink()


def _rmtree(path: Path) -> None:
    """rmtree that also removes what a command made read-only; missing is fine."""
    shutil.rmtree(path, ignore_errors=True)
    if not stat.S_ISDIR(_lmode(path)):
        return
    os.chmod(path, 0o700)
    for top, dirs, _ in os.walk(path):
        for name in dirs:
            if stat.S_ISDIR(_lmode(Path(top, name))):  # never chmod through a symlink
                os.chmod(os.path.join(top, name), 0o700)
    shutil.rmtree(path)
