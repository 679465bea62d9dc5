"""CRIU, driven through its command line: dump a sandbox's process tree, restore it as a new one.

A sandbox's tree is all descendants of its agent (PID 1), so nothing in it has a parent
outside. The mounts we make (the agent binary, the channel dir, the ``host`` base's
overlaid dirs) are external: named at dump, and at restore pointed at the new sandbox's
own paths. The rest (proc, dev, tmpfs, sysfs, the network namespace) CRIU carries itself.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import CheckpointFailed, CheckpointRaced, HostNotReady
from ..host.netns import netns_inode
from ..host.spawn import run

AGENT_KEY = "fanfold-agent"
CHANNEL_KEY = "fanfold-channel"
NETNS_KEY = "fanfold-netns"
NETNS_FD = 3
RESUMED_FD = 3
"""Where a copy-on-write dump writes when it resumed the tree (``CRIU_RESUMED_FD``)."""
# Restoring: CRIU's network lock would run iptables four times (~50 ms); nothing in a
# frozen sandbox talks to the outside, so there is nothing to lock.
COMMON = ["--network-lock", "skip", "--tcp-established", "--file-locks", "--manage-cgroups=full", "-v2"]
IRMAP_PATHS = ("/usr/share/dbus-1", "/usr/share/zoneinfo")
"""Where CRIU also looks for a watched file it must name by its path (an overlay's file handles cannot be
opened), besides its own list (/etc, /var/log, /var/spool, ...): dbus-daemon watches its config dirs, and
systemd's watch on the /etc/localtime link comes back from a restore on the zone file it names (CRIU
follows the link). Looked through only when a watch needs it."""
PASSING_MOMENTS = ("Non-empty write queue on an in-flight socket", "Found a closed in-flight socket")
"""CRIU's words for a unix connection made and not yet accepted by its listener (systemd hands each
new unit's output to journald so): gone in a moment, when the listener accepts (``CheckpointRaced``)."""


YARDS = Path("/run/fanfold")
"""Where the cgroup yards CRIU is given live (``cgroup_yard``), beside the engines' run dirs."""


def host_dir_key(host_dir: str) -> str:
    return "fanfold-host" + host_dir.replace("/", "-")


@dataclass(frozen=True)
class Mounts:
    """Mount points (inside the sandbox) that CRIU must leave to us."""

    agent: str
    channel: str
    host_dirs: tuple[str, ...]

    def dump_args(self) -> list[str]:
        pairs = [(self.agent, AGENT_KEY), (self.channel, CHANNEL_KEY)]
        pairs += [(d, host_dir_key(d)) for d in self.host_dirs]
        return ["--external", "mnt[]"] + [arg for point, key in pairs for arg in ("--external", f"mnt[{point}]:{key}")]


@dataclass(frozen=True)
class Resumed:
    """What a copy-on-write dump says as it resumes the tree (``CRIU_RESUMED_FD``)."""

    at: float
    """When, on ``time.monotonic()``'s clock."""
    shadows: int
    """How many processes' memory a shadow held (the rest were dumped while frozen)."""

    @classmethod
    def parse(cls, said: bytes) -> Resumed | None:
        """``SECONDS.NANOSECONDS SHADOWS``; None for nothing (CRIU failed first, or lacks the patch)."""
        fields = said.split()
        if not fields:
            return None
        return cls(float(fields[0]), int(fields[1]) if len(fields) > 1 else 0)


class Criu:
    """One CRIU binary; every failure becomes a CheckpointFailed that quotes CRIU's log."""

    def __init__(self, binary: str, lo_up: Path | None = None) -> None:
        self.binary = binary
        self.lo_up = lo_up
        """The action script of restores into a network namespace of their own: the agent's binary,
        which, run by CRIU, brings lo up in it once the namespaces exist (a shell script running
        ``nsenter`` and ``ip`` at every stage of a restore cost ~20 ms of it)."""

    def check_installed(self) -> None:
        if not (Path(self.binary).is_file() or shutil.which(self.binary)):
            raise HostNotReady(
                f"CRIU is not installed at {self.binary}: run `bash scripts/criu.sh` (or `make setup`) to build it;"
                " memory snapshots, fork and suspend need it"
            )

    async def dump(
        self, pid: int, images: Path, *, root: Path, mounts: Mounts, freezer: Path, leave_running: bool,
        own_netns: bool = False, cgroup: str | None = None, copy_on_write: bool = False,
        keep_frozen: tuple[int, ...] = (),
    ) -> Resumed | None:
        """Dump the tree under ``pid`` into ``images``; with ``leave_running`` it goes on, else it is killed.
        ``own_netns``: the image keeps the network namespace, for CRIU to rebuild (a tree in a user
        namespace of its own cannot join one of ours).

        ``copy_on_write`` (with ``leave_running``): the tree runs again, thawed, as soon as everything
        but its memory is dumped; the memory is kept as it was by a fork of each process, a shadow that
        the pages are then read from (``scripts/criu/shadow-fork-dump.patch``), so how long the tree stops does
        not grow with its memory. ``keep_frozen``: pids whose memory no shadow may hold (a shadow is a
        process of the sandbox's, and these are guarded from it), dumped the old way. Returns when the
        tree was resumed and how many processes had a shadow, or None when CRIU did not say (not
        copy-on-write)."""
        self.check_installed()
        argv = [self.binary, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "--root", str(root),
                "--freeze-cgroup", str(freezer), "--timeout", "5", *COMMON, *mounts.dump_args()]
        argv += [arg for path in IRMAP_PATHS for arg in ("--irmap-scan-path", path)]
        if own_netns:  # nothing of it is kept but the namespace: a sandbox's has only lo
            argv += ["--empty-ns", "net"]
        else:
            # Restores get a fresh namespace of ours: CRIU's own rebuild runs ip and iptables (~40 ms).
            argv += ["--external", f"net[{netns_inode(pid)}]:{NETNS_KEY}"]
        if cgroup is not None:
            # the groups CRIU takes are those below this one, not only below PID 1's: systemd keeps its
            # units' processes in groups of their own, and watches groups that hold none
            argv += ["--cgroup-root", cgroup]
        if leave_running:
            argv.append("--leave-running")
        argv += yard_args()
        cow = copy_on_write and leave_running
        told, tell = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK) if cow else (-1, -1)
        try:
            env = {**os.environ, "CRIU_COW_DUMP": "1", "CRIU_RESUMED_FD": str(RESUMED_FD),
                   "CRIU_COW_SKIP_PIDS": ",".join(map(str, keep_frozen))} if cow else None
            done = await run(argv, fds={RESUMED_FD: tell} if cow else None, timeout=300, env=env)
            try:
                said = os.read(told, 64) if cow else b""
            except BlockingIOError:  # CRIU failed before the tree was resumed
                said = b""
        finally:
            for fd in (told, tell):
                if fd >= 0:
                    os.close(fd)
        if done.returncode != 0:
            errors = log_errors(images / "dump.log")
            raced = any(moment in errors for moment in PASSING_MOMENTS)
            raise (CheckpointRaced if raced else CheckpointFailed)(f"CRIU could not checkpoint the sandbox: {errors}")
        return Resumed.parse(said)

    async def restore(
        self, images: Path, *, work: Path, root: Path, cgroup: str, binds: dict[str, str], netns: int | None,
        lo_first: bool = True, lazy: bool = False, addresses: tuple[str, ...] = (),
    ) -> int:
        """Restore ``images`` as a new tree rooted at ``root``, in cgroup ``cgroup``; return its PID 1.

        ``binds`` maps each external key to the host path the new sandbox uses for it.
        ``netns`` is an fd of the network namespace to restore into (None: the image has its own, made
        empty, and with ``lo_first`` lo comes up before the sockets are restored; without, the caller
        raises it); the action script also binds ``addresses`` on lo, for sockets bound to them (a group
        member's). ``work`` (the new sandbox's own dir) takes the log and pid file, so restores of
        one image can run at once. ``lazy``: the memory is left to the page server serving ``work``
        (``lazy.PageSource``), which must be listening.
        """
        self.check_installed()
        pidfile = work / "restored.pid"
        pidfile.unlink(missing_ok=True)
        argv = [self.binary, "restore", "-D", str(images), "-W", str(work), "-o", "restore.log", "--root", str(root),
                "--cgroup-root", cgroup, "--restore-detached", "--pidfile", str(pidfile), "--ext-mount-map", "auto",
                *COMMON, *yard_args()]
        if netns is not None:
            argv += ["--inherit-fd", f"fd[{NETNS_FD}]:{NETNS_KEY}"]
        else:
            argv += ["--empty-ns", "net"]
            if lo_first:  # CRIU runs the action script at every stage, ~1 ms each
                assert self.lo_up is not None, "Criu(lo_up=) names what a restore in its own namespace runs"
                argv += ["--action-script", str(self.lo_up)]
        for key, path in binds.items():
            argv += ["--external", f"mnt[{key}]:{path}"]
        if lazy:
            argv.append("--lazy-pages")
        env = {**os.environ, "FANFOLD_RESTORE_ADDRESSES": ",".join(addresses)} if addresses else None
        done = await run(argv, fds=None if netns is None else {NETNS_FD: netns}, timeout=300, env=env)
        if done.returncode != 0 or not pidfile.exists():
            raise CheckpointFailed(f"CRIU could not restore the snapshot: {log_errors(work / 'restore.log')}")
        return int(pidfile.read_text().strip())


def yard_args() -> list[str]:
    yard = cgroup_yard()
    return [] if yard is None else ["--cgroup-yard", str(yard)]


def cgroup_yard() -> Path | None:
    """A dir naming each cgroup hierarchy as CRIU does (``memory``, ``cpu,cpuacct``, ``systemd``,
    ``unified``), each a link to where the host has it mounted; None where one is not mounted.

    Without it CRIU mounts every hierarchy itself, at each dump and restore (~13-15 ms); and its
    mount of cgroup2, lacking ``favordynmods``, turns that option off for the whole host, undoing
    ``setup.favor_dynamic_cgroups`` (each later cgroup attach waits for an RCU grace period again).
    Named after its links, so engines sharing the host share one, made once and never changed."""
    links = _hierarchy_links()
    if links is None:
        return None
    digest = hashlib.sha256(repr(links).encode()).hexdigest()[:12]
    yard = YARDS / f"criu-cgroups-{digest}"
    if not yard.is_dir():
        YARDS.mkdir(parents=True, exist_ok=True)
        made = Path(tempfile.mkdtemp(prefix=".criu-cgroups-", dir=YARDS))
        made.chmod(0o755)
        for name, target in links:
            (made / name).symlink_to(target)
        try:
            made.rename(yard)
        except OSError:  # another engine made it first: the same links
            shutil.rmtree(made, ignore_errors=True)
    return yard


@lru_cache(maxsize=1)
def _hierarchy_links() -> tuple[tuple[str, str], ...] | None:
    """CRIU's name of each hierarchy this process is in (``/proc/self/cgroup``) and its mount point,
    read once: the host's mount table grows with every live sandbox."""
    mounted: dict[str, str] = {}
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        for line in handle:
            pre, _, post = line.partition(" - ")
            fstype, _source, options = post.split()[:3]
            _id, _parent, _dev, root, point = pre.split()[:5]
            if root != "/":  # a bind of a group below the hierarchy's root
                continue
            if fstype == "cgroup2":
                mounted.setdefault("", point)
            elif fstype == "cgroup":
                for option in options.split(","):
                    mounted.setdefault(option, point)
    links = {}
    with open("/proc/self/cgroup", encoding="utf-8") as handle:
        for line in handle:
            controllers = line.split(":")[1]
            first = controllers.split(",")[0]
            point = mounted.get(first)
            if point is None or "\\" in point:
                return None
            links["unified" if not controllers else controllers.removeprefix("name=")] = point
    return tuple(sorted(links.items())) or None


def log_errors(log: Path, lines: int = 6) -> str:
    """The error lines of a CRIU log (else its last lines), for a message."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no CRIU log)"
    errors = [line.strip() for line in text if "Error" in line and "RLIMIT_NOFILE" not in line]
    return " | ".join((errors or text)[-lines:])[-1500:] or "(empty CRIU log)"
