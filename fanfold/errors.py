"""The one exception tree of fanfold.

    FanfoldError
    ├── InvalidRequest          bad input: limits, paths, commands, arguments
    │   ├── InvalidSpec         an EnvSpec that cannot be built as written
    │   ├── InvalidPath         a sandbox path that is malformed or leaves the root
    │   ├── LimitExceeded       the sandbox's disk is full
    │   ├── ToolError           a tool call the model got wrong: unknown tool, bad arguments, a missing file
    │   └── RegistryDenied      the registry refused the credentials (or gave none access)
    ├── NotFound
    │   ├── ImageNotFound
    │   ├── SandboxNotFound
    │   ├── SnapshotNotFound
    │   ├── LeaseNotFound       the lease expired (its sandboxes were reaped) or never existed
    │   ├── RecordingNotFound   no network recording of that name (for the caller's tenant)
    │   └── FileNotFoundInSandbox
    ├── SandboxGone             the sandbox was destroyed (deadline, kill, crash)
    ├── SnapshotInUse           a snapshot that sandboxes or later snapshots still need
    ├── ImageInUse              an image that sandboxes or snapshots still use
    ├── BuildFailed             a spec step exited non-zero
    ├── ImageCorrupt            a pulled or imported layer does not match its digest, or is not a safe tree
    ├── ServiceFailed           a oneshot service of the image failed as a sandbox started
    ├── PortUnreachable         nothing answers on an exposed port inside the sandbox (HTTP 502)
    ├── ExecTimeout             raised only by ``check=True`` callers on a timeout
    ├── CommandFailed           raised only by ``check=True`` callers on non-zero exit
    ├── HostNotReady            the host lacks what sandboxes need (see ``fanfold doctor``)
    ├── Unauthorized            the server refused the bearer token
    ├── QuotaExceeded           the tenant holds all its quota allows (HTTP 429; retrying does not help)
    └── Retryable               try again; nothing was left behind
        ├── CapacityExceeded
        ├── RegistryUnavailable the registry did not answer or broke off mid-pull
        └── InfrastructureError the runtime, the kernel or the agent failed
            ├── CheckpointFailed CRIU could not dump or restore; the sandbox runs on
            │   └── CheckpointRaced a dump met a moment that passes (a connection not yet accepted)
            └── PolicyUnavailable the policy server failed or did not answer

Errors from crun, the kernel, the agent and HTTP are translated into these at the edge,
in one place each; none leaks raw.
"""

from __future__ import annotations


class FanfoldError(Exception):
    """Root of every error fanfold raises."""

    kind = "fanfold_error"


class InvalidRequest(FanfoldError):
    """The request is malformed: the message says what to change."""

    kind = "invalid_request"


class InvalidSpec(InvalidRequest):
    """An EnvSpec that cannot be built as written."""

    kind = "invalid_spec"


class InvalidPath(InvalidRequest):
    """A sandbox path that is malformed or tries to leave the sandbox."""

    kind = "invalid_path"


class LimitExceeded(InvalidRequest):
    """The sandbox hit one of its limits (its disk is full)."""

    kind = "limit_exceeded"


class ToolError(InvalidRequest):
    """A tool call the model got wrong (unknown tool, bad arguments, a missing file); the message is for the model."""

    kind = "tool_error"


class RegistryDenied(InvalidRequest):
    """The registry refused the credentials: log in (``fanfold login``) or check ``FANFOLD_REGISTRY_AUTH``."""

    kind = "registry_denied"


class NotFound(FanfoldError):
    """The named thing does not exist."""

    kind = "not_found"


class ImageNotFound(NotFound):
    """No image or base of that name or id."""

    kind = "image_not_found"


class LeaseNotFound(NotFound):
    """No live lease with that id: it expired unrenewed (its sandboxes were reaped) or never existed."""

    kind = "lease_not_found"


class RecordingNotFound(NotFound):
    """No network recording of that name: record one first (``network={"record": NAME, ...}``)."""

    kind = "recording_not_found"


class SandboxNotFound(NotFound):
    """No sandbox with that id."""

    kind = "sandbox_not_found"


class GroupNotFound(NotFound):
    """No sandbox group (or group snapshot) with that id or name."""

    kind = "group_not_found"


class SnapshotNotFound(NotFound):
    """No snapshot with that id or name (never taken, deleted, or collected by gc)."""

    kind = "snapshot_not_found"


class FileNotFoundInSandbox(NotFound):
    """The path does not exist inside the sandbox."""

    kind = "file_not_found"


class SandboxGone(FanfoldError):
    """The sandbox was destroyed while in use (deadline, kill or crash)."""

    kind = "sandbox_gone"


class SnapshotInUse(FanfoldError):
    """The snapshot cannot be deleted: sandboxes or later snapshots are made from it."""

    kind = "snapshot_in_use"


class ImageInUse(FanfoldError):
    """The image is used by sandboxes or snapshots; remove them first (or drop only its name)."""

    kind = "image_in_use"


class BuildFailed(FanfoldError):
    """A build step failed; carries the step, its exit code and its output's tail."""

    kind = "build_failed"

    def __init__(self, message: str, *, step: str = "", exit_code: int | None = None, output_tail: str = ""):
        super().__init__(message)
        self.step = step
        self.exit_code = exit_code
        self.output_tail = output_tail


class ImageCorrupt(FanfoldError):
    """A layer's content does not match its digest, or the image is not one fanfold can use; nothing was stored."""

    kind = "image_corrupt"


class ServiceFailed(FanfoldError):
    """A oneshot service exited non-zero as a sandbox started (which was then destroyed);
    carries the service, its exit code and its log's tail."""

    kind = "service_failed"

    def __init__(self, message: str, *, service: str = "", exit_code: int | None = None, log_tail: str = ""):
        super().__init__(message)
        self.service = service
        self.exit_code = exit_code
        self.log_tail = log_tail


class PortUnreachable(FanfoldError):
    """Nothing answers on that port inside the sandbox (no service listens there, or it closed without answering)."""

    kind = "port_unreachable"


class ExecTimeout(FanfoldError):
    """A command ran past its timeout (raised only when the caller asked to check)."""

    kind = "exec_timeout"


class CommandFailed(FanfoldError):
    """A command exited non-zero (raised only when the caller asked to check)."""

    kind = "command_failed"


class HostNotReady(FanfoldError):
    """The host cannot run sandboxes yet; ``fanfold doctor`` says what to fix."""

    kind = "host_not_ready"


class Unauthorized(FanfoldError):
    """The server needs a valid bearer token (``token=`` or ``FANFOLD_TOKEN``)."""

    kind = "unauthorized"


class QuotaExceeded(FanfoldError):
    """The caller's tenant holds all its quota allows (sandboxes, memory, disk or pool sizes): free some,
    or ask the server's operator to raise it. Not retryable: the same call fails the same way."""

    kind = "quota_exceeded"


class Retryable(FanfoldError):
    """A transient failure: retrying the same call may succeed."""

    kind = "retryable"


class CapacityExceeded(Retryable):
    """The host cannot hold another sandbox right now."""

    kind = "capacity_exceeded"


class RegistryUnavailable(Retryable):
    """The registry could not be reached or broke off mid-pull; nothing half-pulled was kept."""

    kind = "registry_unavailable"

    def __init__(self, message: str = "", *, reached: bool = True) -> None:
        super().__init__(message)
        self.reached = reached
        """Whether the registry was reached and then failed (a 5xx, a timeout, a broken transfer), as opposed
        to never reached at all (no such host, connection refused, no route): then nothing is known of the name."""


class InfrastructureError(Retryable):
    """The runtime, the kernel or the in-sandbox agent failed; not the caller's fault."""

    kind = "infrastructure_error"


class CheckpointFailed(InfrastructureError):
    """CRIU could not checkpoint or restore; the sandbox keeps running and nothing is left behind."""

    kind = "checkpoint_failed"


class CheckpointRaced(CheckpointFailed):
    """The dump met a state that passes by itself in a moment: a process connected to a listening
    unix socket and wrote, and the listener had not accepted yet (CRIU cannot carry the bytes). The
    engine thaws the sandbox and tries again a few times before it lets this through."""

    kind = "checkpoint_failed"


class PolicyUnavailable(InfrastructureError):
    """The policy (inference) server failed or did not answer; the rollout did nothing wrong."""

    kind = "policy_unavailable"


_FULL_ERRNOS = (28,)  # ENOSPC (EDQUOT is a quota of its own: not the filesystem)


def host_full(err: BaseException, what: str = "") -> CapacityExceeded | None:
    """The typed error for a host filesystem that filled under fanfold's own writes (a snapshot's
    staging dir, the database), which is no bug of fanfold's, saying ``what`` failed; None for any
    other error."""
    if isinstance(err, OSError) and err.errno in _FULL_ERRNOS:
        where = f" ({err.filename})" if err.filename else ""
        return CapacityExceeded(f"{what + ': ' if what else ''}the host's state filesystem is full{where}:"
                                f" {err.strerror}. Try again once space is freed (the operator: free space under"
                                " the state dir)")
    if type(err).__name__ == "OperationalError" and "disk is full" in str(err):  # sqlite3's SQLITE_FULL
        return CapacityExceeded(f"the host's state filesystem is full: the database says {err};"
                                " try again once space is freed")
    return None
