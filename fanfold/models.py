"""Plain data shared by every layer: limits, exec results, sandbox and file records."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import InvalidRequest

MIB = 1024 * 1024


class Outcome(str, enum.Enum):
    """How an exec ended."""

    EXITED = "exited"
    """The command exited on its own; see ``exit_code``."""
    TIMEOUT = "timeout"
    """The command ran past its timeout and was killed."""
    OOM = "oom"
    """The kernel killed it because the sandbox ran out of memory."""
    KILLED = "killed"
    """A signal ended it (a kill from inside, or the sandbox being destroyed)."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Resource limits of one sandbox."""

    cpus: float = 1.0
    """CPU quota in cores (fractions allowed)."""
    memory_mb: int = 512
    """Memory limit; crossing it OOM-kills the offending process."""
    pids: int = 256
    """Most processes and threads alive at once (fork bombs stop here)."""
    disk_mb: int = 1024
    """Most bytes the sandbox may write to its filesystem."""

    def __post_init__(self) -> None:
        checks = [
            ("cpus", self.cpus, 0.01, 1024),
            ("memory_mb", self.memory_mb, 16, 1 << 22),
            ("pids", self.pids, 8, 1 << 22),
            ("disk_mb", self.disk_mb, 1, 1 << 24),
        ]
        for name, value, low, high in checks:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidRequest(f"limit {name} must be a number, got {value!r}")
            if not low <= value <= high:
                raise InvalidRequest(f"limit {name}={value} is out of range: use a value from {low} to {high}")
        for name in ("memory_mb", "pids", "disk_mb"):
            if not float(getattr(self, name)).is_integer():
                raise InvalidRequest(f"limit {name} must be a whole number, got {getattr(self, name)!r}")
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "cpus", float(self.cpus))


@dataclass(frozen=True, kw_only=True)
class OutputChunk:
    """A piece of a running command's output."""

    stream: str
    """``"stdout"`` or ``"stderr"``."""
    data: bytes


@dataclass(frozen=True, kw_only=True)
class ExecResult:
    """The typed result of one command."""

    outcome: Outcome
    exit_code: int | None
    """The exit status when ``outcome`` is ``exited``, else None."""
    signal: int | None = None
    """The signal that ended it, if one did."""
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    """True when output past ``max_output`` was dropped."""
    stderr_truncated: bool = False
    duration_s: float = 0.0
    limits_hit: tuple[str, ...] = ()
    """Limits the sandbox hit during the command: ``memory``, ``pids``."""
    cpu_s: float = 0.0
    """CPU time (user and system) the sandbox's cgroup used while the command ran."""
    memory_peak_bytes: int = 0
    """Peak memory of the sandbox's cgroup while the command ran (since the sandbox started,
    when other commands overlapped it)."""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.EXITED and self.exit_code == 0

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (invalid bytes replaced)."""
        return self.stdout.decode("utf-8", "replace")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["outcome"] = self.outcome.value
        data["stdout"] = self.stdout.decode("utf-8", "replace")
        data["stderr"] = self.stderr.decode("utf-8", "replace")
        return data


class Persistence(str, enum.Enum):
    """What becomes of a sandbox when it goes idle, and whether it outlives its creator."""

    EPHEMERAL = "ephemeral"
    """Dies with the client that made it; idle or suspended, it is destroyed."""
    STICKY = "sticky"
    """Kept (suspended when idle) as a cache; under memory or disk pressure evicted, lowest priority first."""
    PERSISTENT = "persistent"
    """Kept (suspended when idle) until killed or its deadline."""


STATES = ("creating", "running", "paused", "suspended", "destroying")
"""``paused``: frozen, memory resident. ``suspended``: memory on disk, no processes.
Any call on a paused or suspended sandbox wakes it first."""


@dataclass(frozen=True, kw_only=True)
class SandboxInfo:
    """What the engine knows of one sandbox."""

    id: str
    state: str
    image_id: str
    """The image at the root of its lineage."""
    limits: Limits
    labels: dict[str, str] = field(default_factory=dict)
    created_at: float = 0.0
    deadline_at: float | None = None
    detached: bool = False
    """True when the sandbox outlives the process that created it (CLI ``create``, sticky, persistent)."""
    source: str = ""
    """The image or snapshot id it was made from, and that ``reset()`` returns it to."""
    persistence: str = "ephemeral"
    priority: int = 0
    """0-10, for sticky sandboxes: under pressure the lowest go first."""
    idle_timeout: float | None = None
    """Seconds without a call before it is suspended (ephemeral: destroyed)."""
    user: str = ""
    """Whom its commands run as unless an exec says otherwise (``name[:group]``, ``uid[:gid]``; "" is root)."""
    seccomp: str = "default"
    """Its seccomp profile: ``default``, ``unconfined`` or the path of a profile file on the host."""
    network: Any = "none"
    """Its network policy: ``"none"`` (loopback only), ``"open"``, or ``{"allow": [...], "deny": [...]}``
    (``fanfold.net.policy``); traffic goes out only through the host's filtering proxy."""
    tenant: str = ""
    """The server tenant it belongs to: "" is the host's own (the embedded SDK, the CLI, the unix socket)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class SnapshotInfo:
    """An immutable checkpoint of a sandbox: its disk, and with ``memory`` its processes."""

    id: str
    parent: str
    """The snapshot or image the sandbox was made from: snapshots form a tree rooted at images."""
    image_id: str
    sandbox_id: str
    """The sandbox it was taken from."""
    memory: bool
    kind: str
    """``snapshot`` (asked for), ``fork`` (made by fork) or ``suspend`` (holds a suspended sandbox)."""
    created_at: float
    size_bytes: int = 0
    name: str | None = None
    """A named snapshot is kept by ``gc``; so is any a sandbox or later snapshot needs."""
    limits: Limits | None = None
    """Sandboxes restored from a memory snapshot keep these limits."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class ForkResult:
    """What ``fork(count)`` made, and what it cost the parent."""

    parent_id: str
    children: tuple[SandboxInfo, ...]
    snapshot_id: str
    """The memory snapshot the children were restored from (``reset()`` returns them there)."""
    parent_pause_ms: float
    """How long the parent's processes were frozen."""
    total_ms: float
    setup: tuple[ExecResult, ...] = ()
    """The result of ``cmd`` in each child, in order, when one was given."""
    user_random_copied: bool = True
    """Always true: random state held in process memory (seeded PRNGs, OpenSSL pools) is copied
    into every child with the rest of memory. Kernel randomness (/dev/urandom, getrandom) is
    fresh in each. Pass ``cmd`` to reseed or change an identity in each child."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["setup"] = [result.to_dict() for result in self.setup]
        return data


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One entry of a directory listing."""

    name: str
    path: str
    type: str
    """``file``, ``dir``, ``symlink`` or ``other``."""
    size: int
    mode: int
    mtime: float


@dataclass(frozen=True, kw_only=True)
class PoolInfo:
    """A warm pool: sandboxes brought up ahead of need from one image or snapshot, with one set of limits."""

    source: str
    """The image or snapshot id its sandboxes are made from."""
    limits: Limits
    size: int | None
    """Sandboxes to keep warm; None follows recent demand."""
    target: int
    """What it is filling to now (``size``, or the recent demand)."""
    ready: int
    filling: int
    handouts: int = 0
    """Creates it served."""
    misses: int = 0
    """Creates that found it empty and brought a sandbox up themselves."""
    last_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class LeaseInfo:
    """An owner's claim on its sandboxes: renew it before ``expires_at`` or they are destroyed."""

    id: str
    ttl: float
    """Seconds a renewal keeps it alive."""
    expires_at: float
    sandboxes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
