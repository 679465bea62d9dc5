"""fanfold: a self-hosted sandbox fleet for reinforcement learning of tool-using agents.

    from fanfold import EnvSpec, Fleet

    with Fleet() as fleet:
        image = fleet.build(EnvSpec("host").workdir("/env").copy("project", "/env"))
        with fleet.create(image) as sandbox:
            print(sandbox.exec("python3 -m unittest").outcome)
"""

from .client import (
    AsyncFiles,
    AsyncFleet,
    AsyncFork,
    AsyncRollouts,
    AsyncSandbox,
    Files,
    Fleet,
    Fork,
    RolloutResult,
    Rollouts,
    RolloutStats,
    Sandbox,
)
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
    PolicyUnavailable,
    Retryable,
    SandboxGone,
    SandboxNotFound,
    SnapshotInUse,
    SnapshotNotFound,
    ToolError,
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
    "AsyncRollouts",
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
    "PolicyUnavailable",
    "PoolInfo",
    "Retryable",
    "RolloutResult",
    "RolloutStats",
    "Rollouts",
    "Sandbox",
    "SandboxGone",
    "SandboxInfo",
    "SandboxNotFound",
    "SnapshotInUse",
    "SnapshotInfo",
    "SnapshotNotFound",
    "StepEvent",
    "ToolError",
    "Unauthorized",
]
