"""The OCI runtime driver's contract: turn a root filesystem and a config into running processes.

A driver (crun or runc, ``oci.py``) starts a sandbox's PID 1 (the agent) detached, with one host
descriptor handed to it as fd 3, runs build steps in the foreground, and deletes containers.
The OCI backend (``oci_backend.py``) and the image builder drive it; the engine never does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..host.cdi import Edits
from ..host.spawn import Finished
from ..models import Limits

# The capabilities Docker grants by default: enough for package managers, not for mounts or modules.
CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
]


@dataclass(frozen=True)
class Bind:
    """A host path mounted into the sandbox."""

    source: str
    destination: str
    readonly: bool = True


@dataclass(frozen=True)
class ProcessUser:
    """Whom a container's process runs as (the OCI config's ``process.user``)."""

    uid: int = 0
    gid: int = 0
    additional_gids: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ContainerSpec:
    """What a backend needs to start one sandbox or build step."""

    id: str
    rootfs: Path
    args: list[str]
    env: list[str]
    cwd: str = "/"
    hostname: str = "sandbox"
    limits: Limits | None = None
    host_network: bool = False
    """Share the host's network (a build of the host's own tenant that asks for it); else
    ``netns``, else a new namespace with only loopback (sandboxes)."""
    netns: str | None = None
    """The path of a network namespace to join (an isolated build step's, ``host.stepnet``)."""
    binds: list[Bind] = field(default_factory=list)
    cgroup_path: str | None = None
    oom_score_adj: int | None = None
    """Set for PID 1 when the host allows; None keeps the runtime's own."""
    user: ProcessUser = ProcessUser()
    """Root unless a build step's USER says otherwise (a sandbox's PID 1, the agent, is always root)."""
    uid_base: int | None = None
    """A user namespace of its own whose root is this host uid (its range: ``idmap.RANGE`` ids);
    None: none, root is the host's."""
    userns_path: str | None = None
    """With ``uid_base``: a user namespace with that mapping to join rather than make one."""
    seccomp_bpf: str | None = None
    """The seccomp filter as a BPF program in base64 (``seccomp.bpf``); None runs unconfined."""
    devices: Edits | None = None
    """Devices it gets (a GPU's nodes, driver files, variables and hooks: ``host.gpus``)."""
    nested_nodes: Path | None = None
    """Set for a sandbox with containers inside: the folder of the device nodes it gets (``nested``)."""
    systemd: bool = False
    """systemd becomes its PID 1 (``runtime.systemd``): a cgroup namespace, /run and a cgroup2 mount for it."""


class Runtime(Protocol):
    """An isolation backend (an OCI runtime today, a microVM later)."""

    name: str

    def prepare(self, spec: ContainerSpec, bundle: Path) -> None:
        """Write ``spec``'s bundle (blocking: file system work, for a thread that makes the rest of its root)."""
        ...

    def launch(self, spec: ContainerSpec, bundle: Path, pass_fd: int) -> int:
        """Write ``spec``'s bundle and start it detached with ``pass_fd`` as its fd 3; returns what ``started``
        or ``abandon`` takes. Blocking: for the thread that made the root, which goes on with what the
        runtime does not need while it runs."""
        ...

    async def started(self, container_id: str, bundle: Path, launched: int) -> int:
        """Wait for the start ``launch`` began; return PID 1's host pid."""
        ...

    def abandon(self, launched: int) -> None:
        """Wait out (blocking) the runtime ``launch`` started, whose create failed meanwhile, whatever it
        does: the create's release then finds whole whatever it made, and removes it."""
        ...

    async def run(self, spec: ContainerSpec, bundle: Path, timeout: float | None = None) -> Finished:
        """Run ``spec`` to completion in the foreground and capture its output."""
        ...

    async def delete(self, sandbox_id: str, *, stopped: bool = False) -> None:
        """Kill every process of the sandbox and forget it; idempotent. ``stopped``: the caller
        killed and reaped its PID 1 and removes its cgroups, so only the runtime's state is left."""
        ...

    def forget(self, sandbox_id: str) -> None:
        """``delete(stopped=True)`` as one blocking call, for a thread that releases the rest of the sandbox."""
        ...

    async def list_ids(self) -> set[str]:
        """Ids of every sandbox this backend holds state for."""
        ...
