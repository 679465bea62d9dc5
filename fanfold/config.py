"""Engine configuration; the only place environment variables are read."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_STATE_DIR = "/var/lib/fanfold"
RUNTIMES = ("crun", "runc")
DEFAULT_SOCKET = "/run/fanfold.sock"
"""Where ``fanfold serve`` listens by default (mode 0600)."""
DEFAULT_CRIU = "/usr/local/lib/fanfold/criu/criu"
"""Where set-up installs the CRIU it builds (``scripts/criu.sh``)."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Where the engine keeps its state and how it isolates sandboxes."""

    state_dir: Path = field(default_factory=lambda: Path(os.environ.get("FANFOLD_STATE_DIR", DEFAULT_STATE_DIR)))
    """Layers, images, sandboxes and the SQLite database live here."""
    runtime: str = field(default_factory=lambda: os.environ.get("FANFOLD_RUNTIME", "crun"))
    """The OCI runtime binary: ``crun`` (default) or ``runc``."""
    debian_mirror: str = field(
        default_factory=lambda: os.environ.get("FANFOLD_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    )
    """Mirror debootstrap uses for the ``debian:bookworm`` base."""
    max_output_bytes: int = 16 * 1024 * 1024
    """Default cap on each of stdout and stderr kept per exec."""
    criu: str = field(default_factory=lambda: os.environ.get("FANFOLD_CRIU", DEFAULT_CRIU))
    """The CRIU binary that checkpoints memory (snapshot with memory, fork, suspend)."""
    pressure_memory_mb: int = 512
    """Below this much available host memory the reaper evicts sticky sandboxes, lowest priority first."""
    pressure_disk_mb: int = 1024
    """Below this much free space in the state dir the reaper evicts sticky sandboxes too."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_dir", Path(self.state_dir).absolute())

    @property
    def tag(self) -> str:
        """A short name unique to this state directory, for cgroups and sockets."""
        return hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:8]

    @property
    def run_dir(self) -> Path:
        """Short paths for unix sockets (108-byte limit) and the runtime's state."""
        return Path("/run/fanfold") / self.tag

    @property
    def cgroup_parent(self) -> str:
        return f"fanfold-{self.tag}"


def env_url() -> str | None:
    """The server address from ``FANFOLD_URL``, if set."""
    return os.environ.get("FANFOLD_URL") or None


def env_token() -> str | None:
    """The bearer token from ``FANFOLD_TOKEN``, if set."""
    return os.environ.get("FANFOLD_TOKEN") or None
