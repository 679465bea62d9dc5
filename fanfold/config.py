"""Engine configuration; the only place environment variables are read."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .ids import check_node_tag

DEFAULT_STATE_DIR = "/var/lib/fanfold"
RUNTIMES = ("crun", "runc")
DEFAULT_SOCKET = "/run/fanfold.sock"
"""Where ``fanfold serve`` listens by default (mode 0600)."""
DEFAULT_CRIU = "/usr/local/lib/fanfold/criu/criu"
"""Where set-up installs the CRIU it builds (``scripts/criu.sh``)."""


@dataclass(frozen=True, kw_only=True)
class Quota:
    """What one tenant of a server may hold at once; None is no limit."""

    sandboxes: int | None = None
    """Its live sandboxes (running, paused or suspended)."""
    memory_mb: int | None = None
    """The sum of its sandboxes' memory limits, live ones and those its pools keep warm."""
    disk_mb: int | None = None
    """The sum of its sandboxes' disk limits, live ones and those its pools keep warm."""
    pools: int | None = None
    """Warm sandboxes its pools keep (a pool that follows demand counts as ``pool_auto_max``)."""
    gpus: int | None = None
    """GPUs its sandboxes hold, live and warm: a GPU held alone counts 1, a shared one ``1/gpu_shares``."""
    recordings: int | None = None
    """Network recordings it keeps (None: ``EngineConfig.net_recordings``)."""
    recordings_mb: int | None = None
    """MB of bodies its network recordings take (None: ``EngineConfig.net_recordings_mb``)."""

    @classmethod
    def parse(cls, items: list[str]) -> Quota:
        """``NAME=N`` items (``sandboxes=8 memory_mb=8192``); ValueError naming what is wrong."""
        values: dict[str, int] = {}
        for item in items:
            name, _, number = item.partition("=")
            if name not in QUOTAS or not number.isdigit():
                raise ValueError(f"{item!r} is not a quota: use NAME=N with NAME one of {', '.join(QUOTAS)}")
            values[name] = int(number)
        return cls(**values)


QUOTAS = ("sandboxes", "memory_mb", "disk_mb", "pools", "gpus", "recordings", "recordings_mb")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Where the engine keeps its state and how it isolates sandboxes."""

    state_dir: Path = field(default_factory=lambda: Path(os.environ.get("FANFOLD_STATE_DIR", DEFAULT_STATE_DIR)))
    """Layers, images, sandboxes and the SQLite database live here."""
    backend: str = field(default_factory=lambda: os.environ.get("FANFOLD_BACKEND", "oci"))
    """The isolation backend (``fanfold.runtime``): ``oci`` (default: crun or runc, needs root), ``fake``
    (plain processes in a directory, no isolation, no root: for tests of engine logic), or ``module:Class``."""
    runtime: str = field(default_factory=lambda: os.environ.get("FANFOLD_RUNTIME", "crun"))
    """The OCI backend's runtime: ``crun`` (default), ``runc``, or ``runsc`` (gVisor: a kernel in user space
    between each sandbox and the host's; stronger isolation, slower; the ``runsc`` backend)."""
    runsc_platform: str = field(default_factory=lambda: os.environ.get("FANFOLD_RUNSC_PLATFORM", "systrap"))
    """How gVisor's sentry intercepts a sandbox's syscalls: ``systrap`` (default, gVisor's own), ``ptrace``
    (execs ran 1.7x faster with it on a nested-KVM development machine) or ``kvm`` (needs a usable /dev/kvm)."""
    debian_mirror: str = field(
        default_factory=lambda: os.environ.get("FANFOLD_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    )
    """Mirror debootstrap uses for the ``debian:bookworm`` base."""
    max_output_bytes: int = 16 * 1024 * 1024
    """Default cap on each of stdout and stderr kept per exec."""
    criu: str = field(default_factory=lambda: os.environ.get("FANFOLD_CRIU", DEFAULT_CRIU))
    """The CRIU binary that checkpoints memory (snapshot with memory, fork, suspend)."""
    copy_on_write_dump: bool = field(
        default_factory=lambda: os.environ.get("FANFOLD_COW_DUMP", "1") not in ("0", "false", "no"))
    """A fork or a memory snapshot of a running sandbox stops it only while CRIU dumps all but its memory
    (default): a fork of each process keeps the memory as it was, and the pages are written after the
    sandbox runs again, so the pause does not grow with memory. ``FANFOLD_COW_DUMP=0``: every page is
    written while the sandbox is frozen."""
    pressure_memory_mb: int = 512
    """Below this much available host memory the reaper evicts sticky sandboxes, lowest priority first."""
    pressure_disk_mb: int = 1024
    """Below this much free space in the state dir the reaper evicts sticky sandboxes too."""
    max_creating: int = field(default_factory=lambda: _env_int("FANFOLD_MAX_CREATING", max(4, 2 * (os.cpu_count() or 1))))
    """Sandboxes brought up at once; further creates queue (first come, first served)."""
    max_queued: int = 10_000
    """Creates allowed to wait in the queue; past this a create fails at once with CapacityExceeded."""
    queue_timeout_s: float = 300.0
    """How long a create waits for a slot and for host headroom by default (``queue_timeout=``)."""
    max_sandboxes: int = field(default_factory=lambda: _env_int("FANFOLD_MAX_SANDBOXES", 4096))
    """Live sandboxes (pooled ones included) the host holds at most."""
    reserve_memory_mb: int = 256
    """Host memory (MemAvailable) a create leaves free; below it creates wait for headroom."""
    reserve_disk_mb: int = 512
    """Free space in the state dir a create leaves free, and that sandboxes' disks never take: the engine's
    own state (its database, runtime state, snapshots' files) keeps it when the disks fill."""
    disk_overcommit: float = field(default_factory=lambda: _env_float_or("FANFOLD_DISK_OVERCOMMIT", 1.0))
    """How many times the disks' real free space the ``disk_mb`` that live sandboxes may still write may add up
    to (``FANFOLD_DISK_OVERCOMMIT``). 1 (default): every sandbox can write its whole ``disk_mb``. More packs in
    sandboxes that write little; when the space runs short anyway, each sandbox's cap shrinks to what it holds
    plus its share of what is left, so the one that writes on gets its quota error and the others keep working."""
    reserve_pids: int = 2048
    """Kernel tasks (of ``threads-max`` and ``pid_max``) a create leaves free."""
    default_deadline_s: float = field(default_factory=lambda: float(_env_int("FANFOLD_DEFAULT_DEADLINE", 3600)))
    """The deadline of every sandbox that is not persistent and was given none."""
    lease_ttl_s: float = 30.0
    """Default lease lifetime between heartbeats; a lease not renewed in time is reaped with its sandboxes."""
    pools: tuple[tuple[str, int], ...] = field(default_factory=lambda: _env_pools(os.environ.get("FANFOLD_POOLS", "")))
    """Warm pools kept from the start: (image or snapshot, size); ``FANFOLD_POOLS=host=8,img-x=4``."""
    disk: str = field(default_factory=lambda: os.environ.get("FANFOLD_DISK", "btrfs"))
    """Sandbox disks of the oci backend: ``btrfs`` (default: a subvolume each with a ``disk_mb`` quota, on a
    btrfs at ``STATE/disk``, made from a sparse file when the state dir's filesystem is not one) or
    ``tmpfs`` (a tmpfs each, charged to the sandbox's memory limit)."""
    disk_size_gb: float | None = field(default_factory=lambda: _env_float("FANFOLD_DISK_SIZE_GB"))
    """Size of the sparse file the disks' btrfs is made in (default: the state filesystem's size)."""
    pull: str = field(default_factory=lambda: os.environ.get("FANFOLD_PULL", "missing"))
    """When an image reference is pulled: ``missing`` (default: a create or build pulls one never pulled
    here) or ``never`` (only ``fanfold pull`` does; an air-gapped host, or a server whose tenants must not
    make it fetch)."""
    userns: bool = field(default_factory=lambda: os.environ.get("FANFOLD_USERNS", "1") not in ("0", "false", "no"))
    """Each sandbox in a user namespace of its own (default): its root is an unprivileged host uid, a
    range no other live sandbox has. ``FANFOLD_USERNS=0``: sandbox root is host root, as in a Docker default."""
    uid_ranges: int = field(default_factory=lambda: _env_int("FANFOLD_UID_RANGES", 16384))
    """Ranges of 65536 host ids the entry named ``fanfold`` in /etc/subuid and /etc/subgid holds when the
    engine (or ``fanfold doctor --fix``) adds it, there being none: the most sandboxes with user namespaces
    live on the host at once, every state dir's together. Sandboxes take their ranges within that entry."""
    lazy_restore: bool = field(
        default_factory=lambda: os.environ.get("FANFOLD_LAZY_RESTORE", "1") not in ("0", "false", "no"))
    """Memory snapshots restore lazily (default): resume, create from a memory snapshot and fork's children
    start with no page copied, and CRIU's page server copies each page in when the sandbox first touches it
    (``fanfold.runtime.lazy``). ``FANFOLD_LAZY_RESTORE=0``: every page is copied before the restore returns."""
    images_cold_s: float = field(default_factory=lambda: _env_float_or("FANFOLD_IMAGES_COLD_S", 300.0))
    """Memory snapshots' images no restore used for this long are dropped from the page cache (they stay
    on disk); hot ones are read from it."""
    page_servers_max: int = field(default_factory=lambda: _env_int("FANFOLD_PAGE_SERVERS_MAX", 128))
    """Lazily restored sandboxes whose memory is not all in that the page server serves at once (about 25 kB
    and a few file descriptors each; ``FANFOLD_PAGE_SERVERS_MAX``); a restore past it copies every page
    before it returns."""
    page_server_processes: int = field(default_factory=lambda: _env_int("FANFOLD_PAGE_SERVER_PROCESSES", 1))
    """Processes of the page server (``FANFOLD_PAGE_SERVER_PROCESSES``): one serves every lazily restored
    sandbox, its faults one at a time; more spread the sandboxes over them, for hosts where many
    sandboxes fault at once (after a fork, say) and cores are free. Each costs about 1 MB."""
    page_server_idle_s: float = field(default_factory=lambda: _env_float_or("FANFOLD_PAGE_SERVER_IDLE_S", 60.0))
    """A sandbox whose page server copied no page for it for this long gets the rest copied in
    (``FANFOLD_PAGE_SERVER_IDLE_S``): an idle sandbox stops being served for pages it may never touch."""
    pool_auto_max: int = 64
    """The most sandboxes a demand-sized pool (``size=None``) keeps warm."""
    pool_window_s: float = 60.0
    """How far back a demand-sized pool looks when it counts creates."""
    quotas: tuple[tuple[str, Quota], ...] = ()
    """(tenant, quota) of a server's tenants (``fanfold serve --tokens-file``); a tenant not named,
    the host's own ("") included, has no quota."""

    proxy_port: int = 3128
    """The port of the egress proxy inside every sandbox with a network policy (taken there)."""
    capture_port: int = 3129
    """Inside a sandbox with transparent capture, the port its TCP connections are redirected to (taken there)."""
    net_reachable: tuple[str, ...] = field(default_factory=lambda: _env_list("FANFOLD_NET_REACHABLE"))
    """CIDRs of private, loopback, link-local or host addresses the egress proxy may still connect to
    when a sandbox's policy allows them (``FANFOLD_NET_REACHABLE=10.1.0.0/16,...``); by default none.
    A server tenant's build steps may reach them too, but for loopback, link-local and the host's own
    addresses, which no build step reaches."""
    tenant_registries: tuple[str, ...] = field(default_factory=lambda: _env_list("FANFOLD_TENANT_REGISTRIES"))
    """``HOST[:PORT]`` of the registries a server's tenants may pull from (``fanfold serve --registry``,
    ``FANFOLD_TENANT_REGISTRIES=ghcr.io,10.1.2.3:5000``), at whatever address each has; by default any
    registry at a public address. Every other host a tenant's pull is sent to (a redirect) must be at a
    public address or in ``net_reachable``. The host's own pulls go anywhere."""
    tenant_git_hosts: tuple[str, ...] = field(default_factory=lambda: _env_list("FANFOLD_TENANT_GIT_HOSTS"))
    """``HOST[:PORT]`` of the git hosts a server's tenants' builds may clone from over https or http
    (``fanfold serve --git-host``, ``FANFOLD_TENANT_GIT_HOSTS=github.com,10.1.2.3:3000``), at whatever
    address each has; by default any host at a public address. A list of its own, not the registries'.
    Every other host a tenant's git is sent to (a redirect) must be at a public address or in
    ``net_reachable``. The host's own builds clone from anywhere, over any transport."""
    net_dns: tuple[str, ...] = field(default_factory=lambda: _env_list("FANFOLD_NET_DNS"))
    """DNS servers (``IP`` or ``IP:PORT``) the egress proxy resolves names with; by default the host's resolver."""
    net_hosts: tuple[tuple[str, tuple[str, ...]], ...] = field(
        default_factory=lambda: _env_hosts(os.environ.get("FANFOLD_NET_HOSTS", "")))
    """Fixed answers the egress proxy gives before asking DNS, like /etc/hosts
    (``FANFOLD_NET_HOSTS=pypi.internal=10.1.2.3,...``)."""
    net_user: str | None = field(default_factory=lambda: os.environ.get("FANFOLD_NET_USER", "nobody") or None)
    """The host user the egress proxy (``fanfold netd``) runs as; it needs no privilege."""
    net_ca_file: str | None = field(default_factory=lambda: os.environ.get("FANFOLD_NET_CA_FILE") or None)
    """A CA bundle the egress proxy trusts, besides the system's, when it terminates TLS (record, replay,
    cache) and connects on to the real server (an internal registry's CA)."""
    extra_ca_file: str | None = field(default_factory=lambda: os.environ.get("FANFOLD_EXTRA_CA_FILE") or None)
    """PEM CA certificates build steps and sandboxes trust besides their image's own (a host whose HTTPS goes
    through an intercepting proxy with its own CA): laid over each root at set-up, appended to the image's
    system bundle, with SSL_CERT_FILE, REQUESTS_CA_BUNDLE and PIP_CERT naming it; never written into layers."""
    node_tag: str | None = field(default_factory=lambda: os.environ.get("FANFOLD_NODE_TAG") or None)
    """In a cluster, this node's name in every sandbox and snapshot id it mints (``sb-<tag>-…``), so
    clients route an id to its node; 1-12 lowercase letters and digits. None (default): ``sb-…``."""
    net_idle_timeout: float = field(default_factory=lambda: _env_float_or("FANFOLD_NET_IDLE_TIMEOUT", 600.0))
    """Seconds a tunnel through the egress proxy (a CONNECT, an upgrade, an exposed port, a captured
    connection) may pass no byte either way before it is closed; 0: never."""
    net_cache_mb: int = field(default_factory=lambda: _env_int("FANFOLD_NET_CACHE_MB", 4096))
    net_recordings: int = field(default_factory=lambda: _env_int("FANFOLD_NET_RECORDINGS", 100))
    """Network recordings each server tenant may keep, unless its quota line says ``recordings=N``; the
    host's own tenant has no limit."""
    net_recordings_mb: int = field(default_factory=lambda: _env_int("FANFOLD_NET_RECORDINGS_MB", 4096))
    """MB of bodies each server tenant's network recordings may take, unless its quota line says
    ``recordings_mb=N``; the host's own tenant has no limit."""
    """Most disk the shared download cache (``network={"cache": True}``) takes; the least recently used go first."""
    gpu_shares: int = field(default_factory=lambda: _env_int("FANFOLD_GPU_SHARES", 16))
    """Sandboxes that may share one GPU at once, time-sliced (``FANFOLD_GPU_SHARES``); 1 makes every GPU
    exclusive. A sandbox with ``gpu_exclusive`` takes all of a GPU's shares."""
    gpu_cdi_dirs: tuple[str, ...] = field(
        default_factory=lambda: _env_list("FANFOLD_GPU_CDI_DIRS") or ("/etc/cdi", "/var/run/cdi"))
    """Where CDI specs are read (``nvidia-ctk cdi generate`` writes them); ``FANFOLD_GPU_CDI_DIRS=a,b``."""
    gpu_cdi_kind: str = field(default_factory=lambda: os.environ.get("FANFOLD_GPU_CDI_KIND", "nvidia.com/gpu"))
    """The CDI kind whose devices are the host's GPUs."""
    gpu_dev_dir: str = field(default_factory=lambda: os.environ.get("FANFOLD_GPU_DEV_DIR", "/dev"))
    """Where the NVIDIA device nodes are found when no CDI spec names them."""
    gpu_proc_dir: str = field(default_factory=lambda: os.environ.get("FANFOLD_GPU_PROC_DIR", "/proc/driver/nvidia"))
    """The driver's /proc directory (each GPU's UUID and minor number) when no CDI spec names them."""
    gpu_driver_dirs: tuple[str, ...] = field(
        default_factory=lambda: _env_list("FANFOLD_GPU_DRIVER_DIRS") or ("/usr/local/nvidia",))
    """Driver trees (``lib64/``, ``bin/``) bound read-only into GPU sandboxes when no CDI spec names the
    driver's files; else the driver libraries ``ldconfig`` knows and ``nvidia-smi`` on the PATH are."""
    gpu_mps_dir: str | None = field(default_factory=lambda: os.environ.get("FANFOLD_GPU_MPS_DIR") or None)
    """An MPS daemon's pipe directory: shared GPU sandboxes get it and ``CUDA_MPS_PIPE_DIRECTORY``, so their
    kernels run through that daemon rather than time-sliced (``FANFOLD_GPU_MPS_DIR``)."""
    workers: int = field(default_factory=lambda: _env_workers(os.environ.get("FANFOLD_WORKERS", "0")))
    """Engine worker processes (``FANFOLD_WORKERS``): 0 (default) runs the engine in this process; N runs N
    worker processes, each an engine over a share of the sandboxes, behind a router here, so creates,
    execs and destroys spread over the host's cores; ``auto`` is one per core, at most 32."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_dir", Path(self.state_dir).absolute())
        check_node_tag(self.node_tag)
        if not isinstance(self.workers, int) or not 0 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"FANFOLD_WORKERS (workers=) must be 0 to {MAX_WORKERS} or auto, got {self.workers!r}")
        if self.disk not in DISKS:
            raise ValueError(f"FANFOLD_DISK (disk=) must be one of {', '.join(DISKS)}, got {self.disk!r}")
        if not self.disk_overcommit > 0:
            raise ValueError(f"FANFOLD_DISK_OVERCOMMIT (disk_overcommit=) must be > 0, got {self.disk_overcommit!r}")
        if not isinstance(self.gpu_shares, int) or not 1 <= self.gpu_shares <= 1024:
            raise ValueError(f"FANFOLD_GPU_SHARES (gpu_shares=) must be 1 to 1024, got {self.gpu_shares!r}")
        if self.pull not in PULL_POLICIES:
            raise ValueError(f"FANFOLD_PULL (pull=) must be one of {', '.join(PULL_POLICIES)}, got {self.pull!r}")

    # Cached (in the instance's __dict__, beside the frozen fields): every create, exec and release
    # asks for them, and they follow from state_dir alone, which never changes after __post_init__.
    @cached_property
    def tag(self) -> str:
        """A short name unique to this state directory, for cgroups and sockets."""
        return hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:8]

    @cached_property
    def run_dir(self) -> Path:
        """Short paths for unix sockets (108-byte limit) and the runtime's state."""
        return Path("/run/fanfold") / self.tag

    @cached_property
    def cgroup_parent(self) -> str:
        return f"fanfold-{self.tag}"


MAX_WORKERS = 64


def _env_workers(text: str) -> int:
    if text.strip() == "auto":
        return min(32, os.cpu_count() or 1)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"FANFOLD_WORKERS must be a number of worker processes or auto, got {text!r}") from None


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {text!r}") from None


def parse_pool(item: str) -> tuple[str, int]:
    """``IMAGE=SIZE`` as ``(image, size)``; ValueError when it is not that."""
    ref, _, size = item.rpartition("=")
    if not ref or not size.isdigit():
        raise ValueError(f"{item!r} is not IMAGE=SIZE")
    return ref, int(size)


def _env_pools(text: str) -> tuple[tuple[str, int], ...]:
    try:
        return tuple(parse_pool(item) for item in filter(None, (part.strip() for part in text.split(","))))
    except ValueError as err:
        raise ValueError(f"FANFOLD_POOLS entries are IMAGE=SIZE separated by commas: {err}") from None


def _env_list(name: str) -> tuple[str, ...]:
    return tuple(filter(None, (part.strip() for part in os.environ.get(name, "").split(","))))


def _env_hosts(text: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    hosts: dict[str, list[str]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, address = item.partition("=")
        if not name or not address:
            raise ValueError(f"FANFOLD_NET_HOSTS entries are NAME=ADDRESS separated by commas, got {item!r}")
        hosts.setdefault(name.strip().lower(), []).append(address.strip())
    return tuple((name, tuple(addresses)) for name, addresses in hosts.items())


PULL_POLICIES = ("missing", "never")
DISKS = ("btrfs", "tmpfs")


def _env_float_or(name: str, default: float) -> float:
    value = _env_float(name)
    return default if value is None else value


def _env_float(name: str) -> float | None:
    text = os.environ.get(name, "")
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None


def env_registry_auth() -> Path | None:
    """Registry credentials (a Docker ``config.json``) from ``FANFOLD_REGISTRY_AUTH``, if set."""
    text = os.environ.get("FANFOLD_REGISTRY_AUTH", "")
    return Path(text) if text else None


def env_insecure_registries() -> frozenset[str]:
    """``host:port`` of registries reached without TLS verification, from ``FANFOLD_INSECURE_REGISTRIES`` (commas)."""
    return frozenset(h.strip() for h in os.environ.get("FANFOLD_INSECURE_REGISTRIES", "").split(",") if h.strip())


def env_pull_stall_s() -> float:
    """Seconds a registry may send nothing mid-pull before the pull fails, from ``FANFOLD_PULL_STALL_S`` (default 120)."""
    value = _env_float("FANFOLD_PULL_STALL_S")
    if value is not None and value <= 0:
        raise ValueError(f"FANFOLD_PULL_STALL_S must be a positive number of seconds, got {value}")
    return PULL_STALL_S if value is None else value


PULL_STALL_S = 120.0


def env_registry_certs() -> Path | None:
    """A dir like ``/etc/containers/certs.d`` (``<host:port>/ca.crt``) from ``FANFOLD_REGISTRY_CERTS``, if set."""
    text = os.environ.get("FANFOLD_REGISTRY_CERTS", "")
    return Path(text) if text else None


def env_url() -> str | None:
    """The server address from ``FANFOLD_URL``, if set."""
    return os.environ.get("FANFOLD_URL") or None


def env_lease_ttl() -> float:
    """Seconds a remote client's lease lasts between heartbeats, from ``FANFOLD_LEASE_TTL`` (default 30)."""
    text = os.environ.get("FANFOLD_LEASE_TTL", "")
    try:
        return float(text) if text else 30.0
    except ValueError:
        raise ValueError(f"FANFOLD_LEASE_TTL must be a number of seconds, got {text!r}") from None


def env_token() -> str | None:
    """The bearer token from ``FANFOLD_TOKEN``, if set."""
    return os.environ.get("FANFOLD_TOKEN") or None


def env_trajectories() -> Path | None:
    """The trajectory store's file from ``FANFOLD_TRAJECTORIES``, if set."""
    text = os.environ.get("FANFOLD_TRAJECTORIES", "")
    return Path(text) if text else None


def env_policy_url() -> str | None:
    """The policy server (OpenAI-compatible chat completions) from ``FANFOLD_POLICY_URL``, if set."""
    return os.environ.get("FANFOLD_POLICY_URL") or None


def env_e2b_domain() -> str | None:
    """The domain E2B sandbox hosts are named under (``PORT-SANDBOX.DOMAIN``, wildcard DNS to this
    server, a port allowed: ``sandboxes.example.com:8700``) from ``FANFOLD_E2B_DOMAIN``, if set."""
    return os.environ.get("FANFOLD_E2B_DOMAIN") or None
