"""Reading and removing the cgroups the OCI runtime made for sandboxes (v1 or v2)."""

from __future__ import annotations

import logging
import os
import signal
import time
from functools import lru_cache
from pathlib import Path

from . import procs

log = logging.getLogger("fanfold.engine")

CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "cpuset", "freezer", "devices", "blkio", "hugetlb", "systemd")


@lru_cache(maxsize=1)
def v1_roots() -> dict[str, Path]:
    """Controller name -> mount point of each cgroup v1 hierarchy."""
    roots: dict[str, Path] = {}
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        for line in handle:
            pre, _, post = line.partition(" - ")
            fstype, _source, options = post.split()[:3]
            if fstype != "cgroup":
                continue
            for option in options.split(","):
                name = option.removeprefix("name=")
                if name in CONTROLLERS:
                    roots.setdefault(name, Path(pre.split()[4]))
    return roots


@lru_cache(maxsize=1)
def v2_roots() -> tuple[Path, ...]:
    """Mount points of cgroup2 (in hybrid mode the runtime makes groups there too)."""
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        return tuple(Path(line.split()[4]) for line in handle if " - cgroup2 " in line)


@lru_cache(maxsize=1)
def is_v2_only() -> bool:
    return not v1_roots() and Path("/sys/fs/cgroup/cgroup.controllers").exists()


def forget_roots() -> None:
    """Read the hierarchies again (after mounting one): what is derived from them is cached."""
    for cached in (v1_roots, v2_roots, is_v2_only, _counter_templates):
        cached.cache_clear()


def sandbox_dirs(parent: str, sandbox_id: str | None = None) -> list[Path]:
    """Every cgroup directory of one sandbox (or of the whole parent when id is None)."""
    rel = parent if sandbox_id is None else f"{parent}/{sandbox_id}"
    return [root / rel for root in _roots()]


def _roots() -> tuple[Path, ...]:
    """The root of every hierarchy."""
    return (Path("/sys/fs/cgroup"),) if is_v2_only() else (*v1_roots().values(), *v2_roots())


def ensure_parent(parent: str) -> None:
    """The engine's parent group in every v1 hierarchy, cpuset's cpus and mems filled from the root,
    as a runtime makes it on a create: a restore by CRIU, which makes only the sandbox's own group
    and cannot fill an empty cpuset parent, needs it there first (cgroup2 needs nothing)."""
    for name, root in v1_roots().items():
        directory = root / parent
        directory.mkdir(exist_ok=True)
        if name == "cpuset":
            for key in ("cpuset.cpus", "cpuset.mems"):
                if not (directory / key).read_text().strip():
                    (directory / key).write_text((root / key).read_text())


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _kv(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def _counter_paths(parent: str, sandbox_id: str) -> dict[str, str]:
    """The file behind each counter: OOM kills, pids-limit hits, peak memory, CPU time."""
    return {key: template.format(sandbox_id) for key, template in _counter_templates(parent).items()}


@lru_cache(maxsize=8)
def _counter_templates(parent: str) -> dict[str, str]:
    """``_counter_paths`` with ``{}`` for the sandbox's id: the hierarchies do not change while an
    engine runs (``fix_hybrid_cgroups`` runs before its first sandbox), and every exec asks."""
    rel = f"{parent}/{{}}"
    if is_v2_only():
        base = f"/sys/fs/cgroup/{rel}"
        return {"oom_kill": f"{base}/memory.events", "pids_max": f"{base}/pids.events",
                "memory_peak": f"{base}/memory.peak", "cpu_us": f"{base}/cpu.stat"}
    roots = v1_roots()
    memory, pids, cpuacct = roots.get("memory"), roots.get("pids"), roots.get("cpuacct")
    found = {"oom_kill": memory and f"{memory}/{rel}/memory.oom_control",
             "pids_max": pids and f"{pids}/{rel}/pids.events",
             "memory_peak": memory and f"{memory}/{rel}/memory.max_usage_in_bytes",
             "cpu_us": cpuacct and f"{cpuacct}/{rel}/cpuacct.usage"}
    return {key: path for key, path in found.items() if path}


class CounterFiles:
    """One sandbox's counter files, opened once and re-read with pread, for one exec.

    Kept open, the peak reset and the reads that follow go through one file: on cgroup v2
    since Linux 6.12 a write to ``memory.peak`` resets the peak of that open file only.
    A counter whose group is gone reads as 0.
    """

    def __init__(self, parent: str, sandbox_id: str) -> None:
        self._fds: dict[str, int] = {}
        self._v2 = is_v2_only()
        for key, path in _counter_paths(parent, sandbox_id).items():
            try:
                self._fds[key] = os.open(path, (os.O_RDWR if key == "memory_peak" else os.O_RDONLY) | os.O_CLOEXEC)
            except OSError:
                pass

    def reset_peak(self) -> None:
        """Start a new peak-memory measurement (v1: max_usage_in_bytes; v2 from Linux 6.12: memory.peak)."""
        fd = self._fds.get("memory_peak")
        try:
            if fd is not None:
                os.pwrite(fd, b"0", 0)
        except OSError:
            pass  # older kernels cannot reset it: the peak then covers the sandbox's life

    def read(self) -> dict[str, int]:
        """OOM kills, pids-limit hits, peak memory (bytes) and CPU time (us) so far."""
        text = {key: self._pread(key) for key in ("oom_kill", "pids_max", "memory_peak", "cpu_us")}
        cpu = text["cpu_us"]  # v2: cpu.stat's usage_usec; v1: cpuacct.usage in ns
        return {
            "oom_kill": _kv(text["oom_kill"]).get("oom_kill", 0),
            "pids_max": _kv(text["pids_max"]).get("max", 0),
            "memory_peak": int(text["memory_peak"].strip() or 0),
            "cpu_us": _kv(cpu).get("usage_usec", 0) if self._v2 else int(cpu.strip() or 0) // 1000,
        }

    def _pread(self, key: str) -> str:
        fd = self._fds.get(key)
        try:
            return os.pread(fd, 4096, 0).decode() if fd is not None else ""
        except OSError:
            return ""

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def usage(parent: str, sandbox_id: str) -> tuple[float, int]:
    """CPU seconds used so far and memory in use now (bytes) of one sandbox."""
    rel = f"{parent}/{sandbox_id}"
    if is_v2_only():
        base = Path("/sys/fs/cgroup") / rel
        cpu = _kv(_read(base / "cpu.stat")).get("usage_usec", 0) / 1e6
        return cpu, int(_read(base / "memory.current").strip() or 0)
    roots = v1_roots()
    cpuacct, memory = roots.get("cpuacct"), roots.get("memory")
    cpu = int(_read(cpuacct / rel / "cpuacct.usage").strip() or 0) / 1e9 if cpuacct else 0.0
    mem = int(_read(memory / rel / "memory.usage_in_bytes").strip() or 0) if memory else 0
    return cpu, mem


UNLIMITED_V1 = 1 << 62
"""Above this, a v1 memory limit is "none" (the kernel shows 9223372036854771712)."""


def _memory_limit_files(parent: str, sandbox_id: str) -> list[Path]:
    """The files that cap a sandbox's memory, in the order they may be raised (v1: memsw before memory)."""
    rel = f"{parent}/{sandbox_id}"
    if is_v2_only():
        return [Path("/sys/fs/cgroup") / rel / "memory.max"]
    memory = v1_roots().get("memory")
    if memory is None:
        return []
    files = [memory / rel / "memory.memsw.limit_in_bytes", memory / rel / "memory.limit_in_bytes"]
    return [f for f in files if f.exists()]


Raised = list[tuple[Path, str]]
"""Memory limit files raised by ``make_room``, each with the value to put back."""


def make_room(parent: str, sandbox_id: str) -> Raised:
    """Raise a sandbox's memory limit by what it uses now, until ``put_back``.

    While a copy-on-write dump's shadows keep a sandbox's memory as it was, each page the
    sandbox writes becomes a second copy charged to its group; without room a sandbox that
    rewrites its memory during the copy would be OOM-killed for it. Never raises: a limit that
    cannot be raised is left as it is."""
    _cpu, used = usage(parent, sandbox_id)
    raised: Raised = []
    try:
        for path in _memory_limit_files(parent, sandbox_id):
            old = _read(path).strip()
            if not old or old == "max" or int(old) >= UNLIMITED_V1:
                continue
            path.write_text(str(int(old) + used))
            raised.append((path, old))
    except (OSError, ValueError):
        pass  # no more room made: the dump goes on as it would have
    return raised


def put_back(raised: Raised, *, within: float = 2.0) -> bool:
    """Put the limits ``make_room`` raised back (blocking; lowest first, as v1 wants memory under
    memsw); False if one stayed raised. On v1 a limit below usage is refused (EBUSY) when reclaim
    falls short, as while a shadow's exit still frees its pages: tried again for ``within`` seconds.
    A sandbox that grew into the room meanwhile is then over its limit: v2 reclaims and OOM-kills
    as it would have without the room; v1 keeps the room (logged) rather than fail the dump."""
    deadline = time.monotonic() + within
    pause = 0.002
    for path, old in reversed(raised):
        while True:
            try:
                path.write_text(old)
                break
            except FileNotFoundError:
                return True  # the sandbox is gone
            except OSError as err:
                if time.monotonic() > deadline:
                    log.warning("the memory limit %s stays at its raised value, not %s: %s", path, old, err)
                    return False
                time.sleep(pause)  # reclaim and the shadows' exits need time, not an event to wait on
                pause = min(pause * 2, 0.1)
    return True


def remove(parent: str, sandbox_id: str) -> None:
    """Kill whatever is left in a sandbox's cgroups and remove them. Groups that still hold tasks
    are thawed first: a checkpointer that died mid-dump leaves them frozen, where SIGKILL waits."""
    held = [directory for directory in sandbox_dirs(parent, sandbox_id) if not _rmdir(directory)]
    if held:
        try:
            thaw(parent, sandbox_id)
        except OSError:
            pass  # no freezer left to thaw
        for directory in held:
            _remove_tree(directory)


def remove_group(path: str) -> None:
    """Kill whatever is in the cgroup at ``path`` (relative to each hierarchy's root, e.g. a build
    step's ``/build-PID-N``) and below it, and remove it; a group that is not there is fine."""
    for directory in sandbox_dirs(path.strip("/")):
        _remove_tree(directory)


def top_groups(prefix: str) -> set[str]:
    """Names of the groups at the hierarchies' roots that start with ``prefix`` (build steps')."""
    return {p.name for root in _roots() if root.is_dir() for p in root.glob(f"{prefix}*") if p.is_dir()}


def _rmdir(directory: Path) -> bool:
    """True once the group is gone (removed now, or before); False while it has tasks or children."""
    try:
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _remove_tree(directory: Path) -> None:
    """Remove a cgroup and its child groups, deepest first; an empty leaf (the usual case:
    PID 1 is dead and sandboxes see no cgroupfs) goes with one rmdir and no listing."""
    if _rmdir(directory):
        return
    try:
        with os.scandir(directory) as entries:
            children = [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return
    for child in children:
        _remove_tree(child)
    _kill_and_rmdir(directory)


def _kill_and_rmdir(directory: Path) -> None:
    # Killed tasks take a moment to leave the cgroup; rmdir fails with EBUSY until then.
    for _ in range(500):
        for pid in _read(directory / "cgroup.procs").split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if _rmdir(directory):
            return
        time.sleep(0.002)


def remove_parent(parent: str) -> None:
    """Remove the engine's parent groups once empty; a group still in use is left as it is."""
    for directory in sandbox_dirs(parent):
        try:
            directory.rmdir()
        except OSError:
            pass


def leftover_ids(parent: str) -> set[str]:
    """Sandbox ids that still have a cgroup under ``parent`` in any hierarchy."""
    ids: set[str] = set()
    for directory in sandbox_dirs(parent):
        if directory.is_dir():
            ids.update(p.name for p in directory.iterdir() if p.is_dir())
    return ids


def _freezer(parent: str, sandbox_id: str) -> tuple[Path, str, str, str]:
    """The file that freezes a sandbox, what to write to freeze and thaw, and the file to poll.

    cgroup2's freezer first (also in hybrid mode): v1's can stay FREEZING for good while
    tasks fork, which is why runc toggles it in a retry loop.
    """
    rel = f"{parent}/{sandbox_id}"
    roots = (Path("/sys/fs/cgroup"),) if is_v2_only() else v2_roots()
    for root in roots:
        base = root / rel
        if (base / "cgroup.freeze").exists():
            return base / "cgroup.freeze", "1", "0", str(base / "cgroup.events")
    base = v1_roots().get("freezer", Path("/sys/fs/cgroup/freezer")) / rel
    return base / "freezer.state", "FROZEN", "THAWED", str(base / "freezer.state")


def blocked_tasks(parent: str, sandbox_id: str) -> list[int]:
    """Processes of a sandbox in uninterruptible sleep (a vfork parent whose child froze before exec),
    in its group or one below (systemd as init keeps its units' processes in groups of their own)."""
    blocked = []
    for directory, _, _ in os.walk(_freezer(parent, sandbox_id)[0].parent):
        for pid in _read(Path(directory) / "cgroup.procs").split():
            if procs.stat_fields(pid)[:1] == ["D"]:
                blocked.append(int(pid))
    return blocked


def frozen(parent: str, sandbox_id: str) -> bool:
    try:
        return is_frozen_text(Path(_freezer(parent, sandbox_id)[3]).read_text())
    except OSError:
        return False


def is_frozen_text(text: str) -> bool:
    return text.strip() == "FROZEN" or "frozen 1" in text


def freeze_start(parent: str, sandbox_id: str) -> str:
    """Ask the kernel to freeze every process of a sandbox; returns the file to poll until frozen."""
    control, frozen, _, poll = _freezer(parent, sandbox_id)
    control.write_text(frozen)
    return poll


def thaw(parent: str, sandbox_id: str) -> None:
    """Thaw in every freezer the sandbox has: a restore may bring back a v1 FROZEN state too."""
    control, _, thawed, _ = _freezer(parent, sandbox_id)
    control.write_text(thawed)
    v1 = v1_roots().get("freezer")
    if v1 is not None and control.name != "freezer.state":
        try:
            (v1 / parent / sandbox_id / "freezer.state").write_text("THAWED")
        except FileNotFoundError:
            pass


def freezer_dir(parent: str, sandbox_id: str) -> Path:
    """The sandbox's cgroup in the hierarchy that freezes it (CRIU's --freeze-cgroup)."""
    return _freezer(parent, sandbox_id)[0].parent


def paths_of(pid: int) -> tuple[str, ...]:
    """The groups of process ``pid``, one per hierarchy, as /proc/PID/cgroup names them (() when it is gone)."""
    try:
        text = procs.read_small(f"/proc/{pid}/cgroup").decode(errors="replace")
    except OSError:
        return ()
    return tuple(fields[2] for line in text.splitlines() if len(fields := line.split(":", 2)) == 3)


def sandbox_in(paths: tuple[str, ...], parent: str) -> str | None:
    """The sandbox whose group (``/PARENT/ID``, or one below it) is among ``paths``, or None."""
    for path in paths:
        parts = path.split("/")
        for at, part in enumerate(parts[:-1]):
            if part == parent and parts[at + 1]:
                return parts[at + 1]
    return None
