"""fanfold: a self-hosted sandbox fleet for reinforcement learning of tool-using agents.

    from fanfold import EnvSpec, Fleet

    with Fleet() as fleet:
        image = fleet.build(EnvSpec("host").workdir("/env").copy("project", "/env"))
        with fleet.create(image) as sandbox:
            print(sandbox.exec("python3 -m unittest").outcome)
"""

from .client import AsyncFiles, AsyncFleet, AsyncFork, AsyncSandbox, Files, Fleet, Fork, Sandbox
from .config import EngineConfig
from .errors import (
    BuildFailed,
    CapacityExceeded,
    CheckpointFailed,
    CommandFailed,
    ExecTimeout,
    FanfoldError,
    FileNotFoundInSandbox,
    HostNotReady,
    ImageNotFound,
    InfrastructureError,
    InvalidPath,
    InvalidRequest,
    InvalidSpec,
    LeaseNotFound,
    LimitExceeded,
    NotFound,
    Retryable,
    SandboxGone,
    SandboxNotFound,
    SnapshotInUse,
    SnapshotNotFound,
    Unauthorized,
)
from .images import Image
from .images.builder import StepEvent
from .models import (
    ExecResult,
    FileEntry,
    ForkResult,
    LeaseInfo,
    Limits,
    Outcome,
    OutputChunk,
    Persistence,
    PoolInfo,
    SandboxInfo,
    SnapshotInfo,
)
from .spec import EnvSpec

__version__ = "0.1.0"

__all__ = [
    "AsyncFiles",
    "AsyncFleet",
    "AsyncFork",
    "AsyncSandbox",
    "BuildFailed",
    "CapacityExceeded",
    "CheckpointFailed",
    "CommandFailed",
    "EngineConfig",
    "EnvSpec",
    "ExecResult",
    "ExecTimeout",
    "FanfoldError",
    "FileEntry",
    "FileNotFoundInSandbox",
    "Files",
    "Fleet",
    "Fork",
    "ForkResult",
    "HostNotReady",
    "Image",
    "ImageNotFound",
    "InfrastructureError",
    "InvalidPath",
    "InvalidRequest",
    "InvalidSpec",
    "LeaseInfo",
    "LeaseNotFound",
    "LimitExceeded",
    "Limits",
    "NotFound",
    "Outcome",
    "OutputChunk",
    "Persistence",
    "PoolInfo",
    "Retryable",
    "Sandbox",
    "SandboxGone",
    "SandboxInfo",
    "SandboxNotFound",
    "SnapshotInUse",
    "SnapshotInfo",
    "SnapshotNotFound",
    "StepEvent",
    "Unauthorized",
]
