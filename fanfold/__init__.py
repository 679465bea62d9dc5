"""fanfold: a self-hosted sandbox fleet for reinforcement learning of tool-using agents.

    from fanfold import EnvSpec, Fleet

    with Fleet() as fleet:
        image = fleet.build(EnvSpec("host").workdir("/env").copy("project", "/env"))
        with fleet.create(image) as sandbox:
            print(sandbox.exec("python3 -m unittest").outcome)

The names below are imported on first use (PEP 562): ``import fanfold`` stays cheap, so a
CLI call or a remote client does not pay for the engine, FastAPI or prometheus_client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and readers see; _EXPORTS below must say the same
    from .client import (
        AsyncFiles, AsyncFleet, AsyncFork, AsyncGroup, AsyncProcess, AsyncRollouts, AsyncSandbox, Files, Fleet, Fork,
        Group, Process, RolloutResult, Rollouts, RolloutStats, Sandbox,
    )
    from .config import EngineConfig
    from .errors import (
        BuildFailed, CapacityExceeded, CheckpointFailed, CheckpointRaced, CommandFailed, ExecTimeout, FanfoldError,
        FileNotFoundInSandbox, GroupNotFound, HostNotReady, ImageCorrupt, ImageInUse, ImageNotFound, InfrastructureError, InvalidPath,
        InvalidRequest, InvalidSpec, LeaseNotFound, LimitExceeded, NotFound, PolicyUnavailable, PortUnreachable,
        QuotaExceeded, RecordingNotFound, RegistryDenied, RegistryUnavailable, Retryable, SandboxGone, SandboxNotFound, ServiceFailed, SnapshotInUse, SnapshotNotFound,
        ToolError, Unauthorized,
    )
    from .groups import GroupInfo, GroupMember, GroupParams, GroupSnapshotInfo, HealthCheck
    from .images import Image
    from .images.builder import StepEvent
    from .models import (
        CreateParams, ExecResult, FileEntry, ForkResult, LeaseInfo, Limits, Outcome, OutputChunk, Persistence, PoolInfo,
        Pty, SandboxInfo, SnapshotInfo,
    )
    from .spec import EnvSpec
    from .ssh import SshAccess

from .__version__ import __version__

_EXPORTS = {
    ".client": (
        "AsyncFiles", "AsyncFleet", "AsyncFork", "AsyncGroup", "AsyncProcess", "AsyncRollouts", "AsyncSandbox", "Files",
        "Fleet", "Fork", "Group", "Process", "RolloutResult", "Rollouts", "RolloutStats", "Sandbox",
    ),
    ".config": ("EngineConfig",),
    ".errors": (
        "BuildFailed", "CapacityExceeded", "CheckpointFailed", "CheckpointRaced", "CommandFailed", "ExecTimeout", "FanfoldError",
        "FileNotFoundInSandbox", "GroupNotFound", "HostNotReady", "ImageCorrupt", "ImageInUse", "ImageNotFound", "InfrastructureError",
        "InvalidPath", "InvalidRequest", "InvalidSpec", "LeaseNotFound", "LimitExceeded", "NotFound",
        "PolicyUnavailable", "PortUnreachable", "QuotaExceeded", "RecordingNotFound", "RegistryDenied", "RegistryUnavailable", "Retryable", "SandboxGone", "SandboxNotFound", "ServiceFailed", "SnapshotInUse", "SnapshotNotFound",
        "ToolError", "Unauthorized",
    ),
    ".groups": ("GroupInfo", "GroupMember", "GroupParams", "GroupSnapshotInfo", "HealthCheck"),
    ".images": ("Image",),
    ".images.builder": ("StepEvent",),
    ".models": (
        "CreateParams", "ExecResult", "FileEntry", "ForkResult", "LeaseInfo", "Limits", "Outcome", "OutputChunk", "Persistence",
        "PoolInfo", "Pty", "SandboxInfo", "SnapshotInfo",
    ),
    ".spec": ("EnvSpec",),
    ".ssh": ("SshAccess",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "AsyncFiles",
    "AsyncFleet",
    "AsyncFork",
    "AsyncGroup",
    "AsyncProcess",
    "AsyncRollouts",
    "AsyncSandbox",
    "BuildFailed",
    "CapacityExceeded",
    "CheckpointFailed",
    "CheckpointRaced",
    "CommandFailed",
    "CreateParams",
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
    "Group",
    "GroupInfo",
    "GroupMember",
    "GroupNotFound",
    "GroupParams",
    "GroupSnapshotInfo",
    "HealthCheck",
    "HostNotReady",
    "Image",
    "ImageCorrupt",
    "ImageInUse",
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
    "PortUnreachable",
    "Process",
    "Pty",
    "QuotaExceeded",
    "RecordingNotFound",
    "RegistryDenied",
    "RegistryUnavailable",
    "Retryable",
    "RolloutResult",
    "RolloutStats",
    "Rollouts",
    "Sandbox",
    "SandboxGone",
    "SandboxInfo",
    "SandboxNotFound",
    "ServiceFailed",
    "SnapshotInUse",
    "SnapshotInfo",
    "SnapshotNotFound",
    "SshAccess",
    "StepEvent",
    "ToolError",
    "Unauthorized",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    if not name.startswith("__"):  # `fanfold.errors` after a bare `import fanfold`, as when it imported eagerly
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# Cheap (fanfold.rl loads its names lazily): registers fanfold's gymnasium ids when gymnasium
# loads, so after `import fanfold` gymnasium.make("fanfold/CodeFix-v0") works, in either order.
from . import rl as _rl  # noqa: E402,F401
