"""Plain data shared by every layer: limits, create's parameters, exec results, sandbox and file records.

Each shape is defined here once. A field's bounds live in its metadata (``bounds``): the
dataclass checks them (``check_bounds``) and the server's request bodies, derived from these
classes (``fanfold.web.schemas``), carry them into its schema, so every transport refuses
the same values the same way.
"""

from __future__ import annotations

import ast
import enum
import functools
import inspect
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .errors import InvalidRequest
from .gpu_request import MAX_GPUS, NO_GPUS  # noqa: F401 (named here too: the values Limits.gpus takes)
from .gpu_request import parse as parse_gpus

MIB = 1024 * 1024
DAY_S = 86_400


def bounds(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
           min_length: int | None = None, max_length: int | None = None) -> dict[str, Any]:
    """A field's metadata: the bounds its value keeps (pydantic's names, so a schema can take them as they are)."""
    named = {"ge": ge, "gt": gt, "le": le, "min_length": min_length, "max_length": max_length}
    return {key: value for key, value in named.items() if value is not None}


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a class (the string literal that follows its annotation)."""
    path = inspect.getsourcefile(cls)
    return _docs_of_classes(path).get(cls.__qualname__, {}) if path else {}


@functools.cache
def _docs_of_classes(path: str) -> dict[str, dict[str, str]]:
    """Every top-level class's field docstrings in the module at ``path`` (one parse a module: the CLI
    reads them as it starts)."""
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read(), path)
    found: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = found.setdefault(node.name, {})
        for item, after in zip(node.body, node.body[1:]):
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and isinstance(after, ast.Expr) \
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[item.target.id] = inspect.cleandoc(after.value.value)
    return found


def check_bounds(obj: Any, prefix: str = "") -> None:
    """InvalidRequest unless each field of dataclass ``obj`` keeps the bounds in its metadata; a
    bounded ``int`` field is made an int and a bounded ``float`` one a float."""
    for field_name, meta, kind in _bounded_fields(type(obj)):
        value, name = getattr(obj, field_name), prefix + field_name
        if value is None:
            continue
        if "min_length" in meta or "max_length" in meta:
            low, high = meta.get("min_length", 0), meta.get("max_length")
            if not isinstance(value, (str, list, tuple)):
                raise InvalidRequest(f"{name} must be a string, got {value!r}")
            if len(value) < low or (high is not None and len(value) > high):
                raise InvalidRequest(f"{name} must be {low} to {high} long, got {len(value)}")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequest(f"{name} must be a number, got {value!r}")
        low_ok = value >= meta["ge"] if "ge" in meta else value > meta.get("gt", float("-inf"))
        if not low_ok or value > meta.get("le", float("inf")):
            low = f"from {meta['ge']} to" if "ge" in meta else f"above {meta.get('gt')} and at most"
            raise InvalidRequest(f"{name}={value} is out of range: use a value {low} {meta.get('le')}")
        if kind == "int":
            if not float(value).is_integer():
                raise InvalidRequest(f"{name} must be a whole number, got {value!r}")
            object.__setattr__(obj, field_name, int(value))
        elif kind == "float":
            object.__setattr__(obj, field_name, float(value))


@functools.lru_cache(maxsize=None)
def _bounded_fields(cls: type) -> tuple[tuple[str, Any, str], ...]:
    """The fields of dataclass ``cls`` with bounds: name, bounds, and the type's first name (``int | None``: int)."""
    return tuple((spec.name, spec.metadata, str(spec.type).split(" |")[0]) for spec in fields(cls) if spec.metadata)


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

    cpus: float = field(default=1.0, metadata=bounds(ge=0.01, le=1024))
    """CPU quota in cores (fractions allowed)."""
    memory_mb: int = field(default=512, metadata=bounds(ge=16, le=1 << 22))
    """Memory limit in MiB; crossing it OOM-kills the offending process."""
    pids: int = field(default=256, metadata=bounds(ge=8, le=1 << 22))
    """Most processes and threads alive at once (fork bombs stop here)."""
    disk_mb: int = field(default=1024, metadata=bounds(ge=1, le=1 << 24))
    """Most MiB the sandbox may write to its filesystem."""
    gpus: str | int | None = None
    """GPUs it gets: ``all``, a count (``2``), or ``device=`` and GPU indexes or UUIDs (``device=0,GPU-9f3c...``);
    ``none`` (or 0): none; unset (None): the image's own (``EnvSpec.gpus``), for most images none. The engine
    picks which GPUs; the sandbox record's ``gpu_ids`` says."""
    gpu_exclusive: bool = False
    """Hold its GPUs alone; by default a GPU is shared, time-sliced, by up to the host's ``gpu_shares`` sandboxes."""

    def __post_init__(self) -> None:
        check_bounds(self, "limit ")
        object.__setattr__(self, "gpus", gpu_request(self.gpus))
        if not isinstance(self.gpu_exclusive, bool):
            raise InvalidRequest(f"limit gpu_exclusive is true or false, got {self.gpu_exclusive!r}")


def gpu_request(value: Any) -> str | None:
    """A ``gpus`` value in its one written form (``fanfold.gpu_request.parse``); InvalidRequest when it is no
    GPU request."""
    try:
        return parse_gpus(value, what="limit gpus")
    except ValueError as err:
        raise InvalidRequest(str(err)) from None


@dataclass(frozen=True)
class Pty:
    """A pseudo-terminal for a command (``spawn(..., pty=Pty(rows, cols))``): its output is one
    stream (stdout), Ctrl-C is the byte ``b"\\x03"`` written to its stdin."""

    rows: int = 24
    cols: int = 80
    term: str = "xterm-256color"
    """``TERM`` in the command's environment (unless ``env`` sets it)."""

    def __post_init__(self) -> None:
        for name in ("rows", "cols"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
                raise InvalidRequest(f"Pty.{name} is a whole number from 1 to 65535, got {value!r}")
        if not isinstance(self.term, str) or not self.term or "\0" in self.term or "=" in self.term:
            raise InvalidRequest(f"Pty.term is a terminal type such as 'xterm-256color', got {self.term!r}")


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


@dataclass(frozen=True, kw_only=True)
class CreateParams:
    """What a create asks for: the SDK builds it, every transport carries it, the engine makes it.
    The server's create body is these fields with ``limits`` spread out (``cpus``, ``memory_mb``, ...)."""

    image: str = field(default="host", metadata=bounds(min_length=1, max_length=256))
    """An image id, reference or base name, or a snapshot's id or name (a server's tenant: one of its own)."""
    limits: Limits | None = None
    """None: ``Limits()``; from a memory snapshot the sandbox keeps the snapshot's cpu, memory and pids
    limits (and with None its disk limit too)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables of its services and commands."""
    labels: dict[str, str] = field(default_factory=dict)
    """Free-form tags; ``list`` filters by them."""
    deadline: float | None = field(default=None, metadata=bounds(gt=0, le=365 * DAY_S))
    """Hard lifetime in seconds; None: the host's default (an hour unless configured), none if persistent."""
    detached: bool = False
    """Outlive the creating client (until killed or its deadline)."""
    persistence: str = "ephemeral"
    """``ephemeral``, ``sticky`` or ``persistent``: what becomes of it when idle (see ``Persistence``)."""
    priority: int = field(default=0, metadata=bounds(ge=0, le=10))
    """0-10, for sticky sandboxes: under memory or disk pressure the lowest go first."""
    idle_timeout: float | None = field(default=None, metadata=bounds(gt=0, le=30 * DAY_S))
    """Seconds without a call before it is suspended (ephemeral: destroyed)."""
    queue_timeout: float | None = field(default=None, metadata=bounds(ge=0, le=3600))
    """Seconds to wait for a create slot and host headroom before CapacityExceeded (default 300)."""
    user: str | None = field(default=None, metadata=bounds(max_length=65))
    """``name[:group]`` or ``uid[:gid]`` its commands run as, resolved in its /etc/passwd; by default the
    image's ``USER``, else root."""
    seccomp: str = field(default="default", metadata=bounds(min_length=1, max_length=4096))
    """The syscall filter: ``default``, ``unconfined`` or the path of an OCI seccomp profile on the host
    (a server's tenants other than the host's own: ``default`` only)."""
    network: Any = "none"
    """``"none"`` (loopback only), ``"open"`` (any public address; the host's own callers only) or a
    ``fanfold.net.policy.NetworkPolicy`` as a dict (``{"allow": [...], "deny": [...], ...}``): traffic
    leaves only through the host's filtering proxy, which the sandbox's proxy variables name."""
    nested: bool = False
    """Let containers run inside it (rootless podman): the default seccomp profile relaxed, ``/proc``
    unmasked, ``/dev/fuse`` and ``/dev/net/tun`` (docs/security.md lists each with its risk). Not on
    the runsc backend; no memory checkpoints (fork, suspend, memory snapshots)."""

    def __post_init__(self) -> None:
        if self.limits is not None and not isinstance(self.limits, Limits):
            raise InvalidRequest(f"limits must be a fanfold.Limits, got {self.limits!r}")
        check_bounds(self)
        try:
            object.__setattr__(self, "persistence", Persistence(self.persistence).value)
        except ValueError:
            choices = ", ".join(p.value for p in Persistence)
            raise InvalidRequest(f"persistence must be one of {choices}, got {self.persistence!r}") from None
        if not isinstance(self.detached, bool):
            raise InvalidRequest(f"detached is true or false, got {self.detached!r}")
        if not isinstance(self.nested, bool):
            raise InvalidRequest(f"nested is true or false, got {self.nested!r}")


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
    gpu_ids: list[str] = field(default_factory=list)
    """The GPUs it holds (UUIDs, or indexes where the host knows none), as ``limits.gpus`` asked."""
    group_id: str = ""
    """The group it is a member of ("" for none): see ``fanfold.groups``."""
    member: str = ""
    """Its name in its group, by which the other members reach it."""
    nested: bool = False
    """Containers may run inside it (``CreateParams.nested``)."""

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
