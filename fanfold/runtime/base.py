"""The backend contract: what the engine needs from an isolation backend. Read this first.

A backend brings a sandbox up from read-only layers and limits, with fanfold's agent as its
PID 1 (``_agent/PROTOCOL.md``); freezes, thaws, checkpoints, restores and releases it; runs
commands through the agent; and reports its counters. The engine keeps the rows, leases,
gates, pools and policies, and calls nothing below this file: no mounts, cgroups, CRIU,
network namespaces or /proc. What the OS, the OCI runtime or CRIU report, a backend translates
in one place into FanfoldErrors: InfrastructureError (retryable), CheckpointFailed, HostNotReady,
InvalidRequest (a seccomp profile or a snapshot it cannot use). Two kinds of error pass through
untranslated, for the engine to map: the agent client's AgentUnreachable and AgentTooOld from
``exec``, and NotImplementedError from the network calls of a backend without sandbox networks.

Implementations, looked up by name in ``fanfold.runtime.get_backend``:
``oci`` (``oci_backend.OciBackend``: crun or runc, overlayfs, cgroups, CRIU, a network namespace),
``runsc`` (``runsc_backend.RunscBackend``: the same bundle under gVisor's runsc, with its own
checkpoint and restore) and ``fake`` (``fake.FakeBackend``: the real agent as a plain process over
a directory, no root).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
import socket
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Literal, Protocol

from .._agent.client import AgentClient, ExecControl, ExecUser, OnChunk, RawExec
from ..host.cdi import Edits
from ..models import Limits

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..store import LayerStore
    from .container import Runtime


@dataclass(frozen=True, kw_only=True)
class SandboxSpec:
    """All a backend needs to bring one sandbox up."""

    id: str
    layers: tuple[str, ...]
    """Layer ids in the engine's LayerStore, bottom first (``store.layer_path`` finds each)."""
    host_dirs: tuple[str, ...] = ()
    """Host directories overlaid read-only under the layers (the ``host`` base's /usr, /lib...)."""
    limits: Limits
    env: tuple[str, ...] = ()
    """PID 1's environment as KEY=VALUE; services inherit it."""
    services: tuple[tuple[str, str, str], ...] = ()
    """(name, command, ``oneshot``|``simple``): what the agent starts, oneshot ones first."""
    restore: Path | None = None
    """A checkpoint's memory dir (``checkpoint(memory=True)`` wrote it): restore its processes
    onto the new disk instead of starting the agent afresh."""
    seccomp: str = "default"
    """The seccomp profile its processes start under (``runtime.seccomp``); a restore keeps the
    checkpoint's own filters."""
    devices: Edits | None = None
    """Host devices it gets (its GPUs: ``host.gpus.GpuHost.edits``): nodes bound in and allowed by its
    device rules, driver files bound read-only, variables, and the OCI hooks a CDI spec names."""
    addresses: tuple[str, ...] = ()
    """IPv4 addresses (``ADDRESS/PREFIX``) the sandbox has beside loopback once ``before_run`` is done (a
    group member's): a restore binds them on lo first, so its restored sockets bound to them come back."""
    nested: bool = False
    """Containers may run inside it (``CreateParams.nested``): the relaxations ``runtime.nested`` lists."""
    init: str = ""
    """What becomes PID 1 once the agent is up: ``""`` (the agent stays PID 1) or ``systemd`` (the image's
    ``fanfold.init`` label; the agent goes on as systemd's child and ``services`` become its units)."""
    before_run: Callable[[Handle], Awaitable[None]] | None = None
    """Awaited once the sandbox's processes exist but before any of them runs code of the sandbox's
    (services not yet started, restored processes still frozen): the engine opens what must be in
    place first, such as the egress proxy's listener (``listen_inside``)."""


@dataclass(frozen=True)
class Handle:
    """A live sandbox as its backend knows it; what the engine's row keeps of it."""

    id: str
    pid: int | None
    """Host pid of PID 1 (or of the VMM): for liveness, logs and a later engine's release."""


@dataclass(frozen=True)
class Capabilities:
    """What the engine may ask of a backend; it refuses the rest with a clear error."""

    memory: Literal["none", "cold", "live"]
    """Memory checkpoints: refused / accepted, but a restore starts the processes afresh from the
    disk / processes kept, as they were."""
    exact_counters: bool
    """OOM kills and pids-limit hits are observed (not always 0)."""
    isolated: bool
    """Commands see only the sandbox (own root, pid and network namespaces, limits enforced)."""
    network: bool = False
    """``listen_inside`` and ``connect_inside`` work: network policies and exposed ports."""
    nested: bool = False
    """Containers run inside a sandbox created with ``nested`` (``SandboxSpec.nested``)."""


class CounterReader(Protocol):
    """One sandbox's counters, held open for one command (see ``Backend.counters``)."""

    def reset_peak(self) -> None:
        """Start a new peak-memory measurement."""

    def read(self) -> dict[str, int]:
        """``oom_kill``, ``pids_max`` (limit hits), ``memory_peak`` (bytes) and ``cpu_us`` so far."""

    def close(self) -> None: ...


class Backend(ABC):
    """An isolation backend: one per engine, for every sandbox of its state dir."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    step_runtime: Runtime | None = None
    """What runs the ``run`` steps of image builds, or None when this backend cannot."""

    def __init__(self, config: EngineConfig, store: LayerStore) -> None:
        self.config = config
        self.store = store

    @property
    def quota(self) -> bool:
        """Whether sandboxes' disks are subvolumes of the btrfs at ``<state>/disk``, each capped by a quota
        group at its ``disk_mb`` (``host.diskspace`` reads and sets them); False: their disks take nothing
        from a filesystem they share (a tmpfs each, charged to memory)."""
        return False

    # -- the host -------------------------------------------------------------------------------

    @abstractmethod
    async def prepare(self) -> None:
        """Check and ready the host once per engine start; HostNotReady says what is missing."""

    @abstractmethod
    async def close(self, *, idle: bool = True) -> None:
        """Let go of what ``prepare`` took; the engine calls it as it stops. With ``idle`` (no sandbox
        of its state dir is left, suspended ones included) also release host-wide state (parent
        cgroups). Leave what another engine there may still use."""

    @abstractmethod
    async def list_ids(self) -> set[str]:
        """Ids of every sandbox this backend holds anything for: reconcile releases those no row names."""

    async def sweep(self, *, thorough: bool = False) -> None:
        """Collect what helpers left behind (exited runtime processes); ``thorough`` also looks
        for leftovers of dead processes (a dead builder's step). The reaper calls it once a
        second, thorough when it also looks for leftover sandboxes (at start, then every 15 s)."""

    # -- one sandbox ----------------------------------------------------------------------------

    @abstractmethod
    async def bring_up(self, spec: SandboxSpec) -> Handle:
        """Start the agent on a fresh disk over ``spec.layers`` (or restore ``spec.restore``'s
        processes onto it, renamed ``spec.id``). On failure the caller calls ``release``."""

    @abstractmethod
    async def release(self, sandbox_id: str, handle: Handle | None = None) -> None:
        """Kill every process and free every resource of the sandbox. Idempotent, safe on a
        half-made sandbox and on a dead engine's handle; raises InfrastructureError when
        something is still held (the reaper calls it again)."""

    @abstractmethod
    def alive(self, handle: Handle) -> bool:
        """Whether PID 1 still runs (a zombie counts as dead)."""

    @abstractmethod
    async def freeze(self, handle: Handle) -> None:
        """Stop every process in place, memory resident, at a point a checkpoint can take."""

    @abstractmethod
    async def thaw(self, handle: Handle) -> None:
        """Let a frozen sandbox run again; a no-op on a running one."""

    @abstractmethod
    async def checkpoint(
        self, handle: Handle, dest: Path, host_dirs: tuple[str, ...], *, memory: bool, leave_running: bool,
        frozen: bool = False,
    ) -> float:
        """Write the sandbox's writes at one frozen instant as a layer tree into ``dest/layer``
        and, with ``memory``, its processes into ``dest/memory``; return how long it stood frozen
        (ms). Without ``leave_running`` the processes end; ``frozen``: the sandbox was frozen
        before and stays frozen. CheckpointFailed when it cannot."""

    @abstractmethod
    def counters(self, handle: Handle) -> CounterReader:
        """The sandbox's counters, opened for one command (closed by the caller)."""

    @abstractmethod
    def usage(self, handle: Handle) -> tuple[float, int]:
        """CPU seconds used so far and memory in use now (bytes)."""

    def page_counts(self, sandbox_id: str) -> dict[str, Any] | None:
        """A lazily restored sandbox's page server counters: pages ``copied`` in so far, ``total`` in its
        images, ``faults``, ``state`` (None: it was not restored lazily, or its memory is all in)."""
        return None

    def lost_why(self, sandbox_id: str) -> str | None:
        """Why the backend ended the sandbox itself, if it did (its memory's page server died)."""
        return None

    @abstractmethod
    def root(self, sandbox_id: str) -> Path:
        """The sandbox's live root filesystem on the host, for file calls and service logs."""

    def as_root(self, sandbox_id: str) -> AbstractContextManager[None]:
        """Within it, the calling thread's writes into ``root(sandbox_id)`` are made as the sandbox's
        own root (its user namespace's uid 0), not as the host's."""
        return nullcontext()

    @abstractmethod
    def agent(self, handle: Handle) -> AgentClient:
        """A client of the sandbox's agent."""

    async def listen_inside(self, handle: Handle, port: int) -> socket.socket:
        """A non-blocking listener on 127.0.0.1:``port`` inside the sandbox's network, accepted on
        from the host (``capabilities.network``); InfrastructureError when the port is taken there."""
        raise NotImplementedError(f"the {self.name} backend has no sandbox networks")

    async def capture_inside(self, handle: Handle, tcp_port: int, dns_port: int) -> tuple[socket.socket, socket.socket]:
        """Transparent capture: every TCP connection out of the sandbox to a listener on 127.0.0.1:``tcp_port``
        inside it, every DNS query to a UDP socket on ``dns_port``; both returned, non-blocking."""
        raise NotImplementedError(f"the {self.name} backend cannot capture a sandbox's traffic")

    async def connect_inside(self, handle: Handle, port: int) -> socket.socket:
        """A non-blocking connection from the host to 127.0.0.1:``port`` inside the sandbox."""
        raise NotImplementedError(f"the {self.name} backend has no sandbox networks")

    # -- given: the agent protocol --------------------------------------------------------------

    async def exec(
        self, handle: Handle, argv: list[str], *, env: list[str], cwd: str, timeout_ms: int, max_output: int,
        stdin: bytes | None = None, on_chunk: OnChunk | None = None, user: ExecUser | None = None,
        control: ExecControl | None = None,
    ) -> RawExec:
        """Run one command as a child of PID 1 (as ``user``, else as PID 1's own), streaming its
        output; AgentUnreachable when the connection fails or breaks, AgentTooOld when a
        ``user`` is asked of an agent that cannot switch. ``control`` feeds stdin and signals live."""
        return await self.agent(handle).exec(
            argv, env=env, cwd=cwd, timeout_ms=timeout_ms, max_output=max_output, stdin=stdin, on_chunk=on_chunk,
            user=user, control=control,
        )

    async def wait_ready(self, handle: Handle) -> str:
        """``ok`` once every oneshot service finished, or ``fail NAME CODE``."""
        return await self.agent(handle).wait_ready()
