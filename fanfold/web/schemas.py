"""Request and response bodies of the HTTP API, as pydantic models (they make /openapi.json)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints, field_validator, model_validator

from ..engine.api import MAX_FORK

PersistenceName = Literal["ephemeral", "sticky", "persistent"]
IDLE_TIMEOUT_MAX = 30 * 86400


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


NetworkName = Literal["none", "open"]
NETWORK_HELP = (
    "none: loopback only; open: any public address (the host's own tenant only); or allow/deny rules: the"
    " sandbox's traffic leaves only through the host's filtering proxy, which its proxy variables name.")


class NetworkRules(_Body):
    allow: list[Annotated[str, StringConstraints(min_length=1, max_length=300)]] = Field(
        default_factory=list, max_length=1024, description=(
            "Host names (pypi.org), wildcards (*.example.com: names below it), addresses and CIDRs (10.0.0.0/8),"
            " each with an optional :PORT. Private, loopback and link-local addresses stay out of reach unless"
            " the operator made them reachable."))
    deny: list[Annotated[str, StringConstraints(min_length=1, max_length=300)]] = Field(
        default_factory=list, max_length=1024, description="Rules as in allow; deny wins.")
    open: StrictBool = Field(False, description="Any public address but what deny names (the host's own tenant only).")
    record: str | None = Field(None, description=(
        "Store every request and response under this name (the sandbox then trusts the fleet's CA)."))
    replay: str | None = Field(None, description="Answer from this recording, with no outside access.")
    live: StrictBool = Field(False, description="With replay: a request not in the recording goes out instead.")
    cache: StrictBool = Field(False, description="Serve immutable downloads from the host's shared cache.")


def network_value(body: NetworkName | NetworkRules) -> Any:
    """A policy as the engine takes it (``open`` only when set, so the same policy reads the same everywhere)."""
    return body if isinstance(body, str) else body.model_dump(exclude_defaults=True)


class NetworkRequest(_Body):
    network: NetworkName | NetworkRules = Field(description=NETWORK_HELP)
    cut: bool = Field(False, description="End the connections already open too (else only new ones follow it).")


class PortBody(BaseModel):
    port: int
    path: str = Field(description="This server's route to the port: any HTTP method, with the caller's token.")
    direct: str | None = Field(None, description=(
        "For the host's own tenant: a URL on the server host's loopback reaching the port (any TCP protocol)."))


class CreateRequest(_Body):
    image: str = Field("host", min_length=1, max_length=256,
                       description="Image id or base name, or the id or name of one of the caller's snapshots.")
    cpus: float = Field(1.0, ge=0.01, le=1024, description="CPU quota in cores.")
    memory_mb: int = Field(512, ge=16, le=1 << 22)
    pids: int = Field(256, ge=8, le=1 << 22)
    disk_mb: int = Field(1024, ge=1, le=1 << 24)
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    deadline: float | None = Field(None, gt=0, le=365 * 86400, description="Hard lifetime in seconds.")
    detached: bool = Field(False, description="Outlive the creating client (until killed or its deadline).")
    persistence: PersistenceName = Field("ephemeral", description=(
        "ephemeral: dies with its creator, destroyed when idle; sticky: kept suspended when idle, evicted under"
        " pressure (lowest priority first); persistent: kept suspended when idle, until killed."))
    priority: int = Field(0, ge=0, le=10, description="Eviction order of sticky sandboxes: the lowest go first.")
    idle_timeout: float | None = Field(None, gt=0, le=IDLE_TIMEOUT_MAX, description=(
        "Seconds without a call before it is suspended (ephemeral: destroyed)."))
    lease: str | None = Field(None, min_length=1, max_length=64, description=(
        "A lease of the caller's (POST /v1/leases): the sandbox dies when the lease is closed or expires."))
    queue_timeout: float | None = Field(None, ge=0, le=3600, description=(
        "Seconds to wait for a create slot and host headroom before 429 capacity_exceeded (default 300)."))
    user: str | None = Field(None, max_length=65, description=(
        "name[:group] or uid[:gid] its commands run as, resolved in its /etc/passwd (default: the image's USER, else root)."))
    seccomp: str = Field("default", min_length=1, max_length=4096, description=(
        "The syscall filter: default, unconfined or the path of an OCI seccomp profile on the host;"
        " only the host's own tenant may choose another than default."))
    network: NetworkName | NetworkRules = Field("none", description=NETWORK_HELP)


class LeaseRequest(_Body):
    ttl: float | None = Field(None, ge=1, le=86400, description="Seconds a renewal keeps it alive (default 30).")


class LeaseBody(BaseModel):
    id: str
    ttl: float
    expires_at: float
    sandboxes: int = Field(0, description="Sandboxes it owns now.")


class PoolRequest(_Body):
    image: str = Field("host", min_length=1, max_length=256, description="Image id or base name, or a snapshot of the caller's.")
    size: int | None = Field(description="Sandboxes kept warm; null follows recent demand; 0 removes the pool.", ge=0, le=4096)
    cpus: float = Field(1.0, ge=0.01, le=1024)
    memory_mb: int = Field(512, ge=16, le=1 << 22)
    pids: int = Field(256, ge=8, le=1 << 22)
    disk_mb: int = Field(1024, ge=1, le=1 << 24)
    wait: float | None = Field(None, gt=0, le=3600, description="Answer only once the pool is full (seconds to wait).")


class SnapshotRequest(_Body):
    memory: bool = Field(False, description="Also checkpoint the processes (CRIU), not only the disk.")
    name: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$",
                             description="Keeps it from gc, and create takes it as the image; not starting with snap-.")

    @field_validator("name")
    @classmethod
    def _not_an_id(cls, name: str | None) -> str | None:
        if name is not None and name.startswith("snap-"):
            raise ValueError("a snapshot name must not start with 'snap-' (ids do)")
        return name


class SnapshotImportRequest(_Body):
    source: str = Field(min_length=1, max_length=2048, description="The server holding it: http(s)://host:port.")
    snapshot: str = Field(min_length=1, max_length=64, pattern=r"^snap-[a-z0-9-]+$",
                          description="Its id there; it keeps that id (and its name) here.")
    token: str | None = Field(None, min_length=1, max_length=4096, description=(
        "The bearer token the source takes, of the snapshot's owner; default: the caller's own. The snapshot"
        " belongs here to the tenant this server knows that token as, else to the caller."))


class ForkRequest(_Body):
    count: int = Field(ge=1, le=MAX_FORK, description="How many children to restore from one checkpoint of the parent.")
    cmd: str | list[str] | None = Field(None, description=(
        "Run in each child once restored (e.g. to reseed): a shell string or an argv list."))
    deadline: float | None = Field(None, gt=0, description=(
        "Seconds from now after which the children are destroyed; default: the parent's deadline."))


class LimitsBody(BaseModel):
    cpus: float
    memory_mb: int
    pids: int
    disk_mb: int


class SandboxBody(BaseModel):
    id: str
    state: str
    image_id: str
    limits: LimitsBody
    labels: dict[str, str]
    created_at: float
    deadline_at: float | None
    detached: bool
    source: str = Field(description="The image or snapshot id it was made from, and that reset returns it to.")
    persistence: PersistenceName
    priority: int
    idle_timeout: float | None
    user: str = Field("", description="Whom its commands run as unless an exec says otherwise (\"\": root).")
    seccomp: str = Field("default", description="Its syscall filter: default, unconfined or a profile file's path.")
    network: Any = Field("none", description="Its network policy: none, open, or {allow, deny} rules.")
    tenant: str = Field("", description="The tenant it belongs to (\"\": the host's own).")


class ExecRequest(_Body):
    cmd: str | list[str] = Field(description="A shell string (run by /bin/sh -c) or an argv list.")
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    stdin: str | None = Field(None, description="Standard input, base64.")
    timeout: float | None = Field(None, gt=0, le=86400, description="Seconds before the command is killed.")
    max_output: int | None = Field(None, ge=0, le=64 << 20,
                                   description="Bytes kept of each of stdout and stderr (default 16 MiB, at most 64 MiB).")
    user: str | None = Field(None, max_length=65, description=(
        "name[:group] or uid[:gid] to run as, resolved in the sandbox's /etc/passwd (default: the sandbox's user)."))


class ExecResultBody(BaseModel):
    outcome: Literal["exited", "timeout", "oom", "killed"]
    exit_code: int | None
    signal: int | None
    stdout: str = Field(description="base64")
    stderr: str = Field(description="base64")
    stdout_truncated: bool
    stderr_truncated: bool
    duration_s: float
    limits_hit: list[str]
    cpu_s: float = Field(0.0, description="CPU time of the sandbox's cgroup while the command ran.")
    memory_peak_bytes: int = Field(0, description="Peak memory of the sandbox's cgroup while the command ran.")


class SnapshotBody(BaseModel):
    id: str
    parent: str = Field(description="The snapshot or image the sandbox was made from.")
    image_id: str
    sandbox_id: str
    memory: bool
    kind: str = Field(description="snapshot, fork or suspend.")
    created_at: float
    size_bytes: int
    name: str | None
    limits: LimitsBody | None


class ForkBody(BaseModel):
    parent_id: str
    children: list[SandboxBody]
    snapshot_id: str
    parent_pause_ms: float
    total_ms: float
    setup: list[ExecResultBody] = Field(description="The result of cmd in each child, in order.")
    user_random_copied: bool


class GcBody(BaseModel):
    removed: list[str] = Field(description="Ids of the snapshots removed.")


class FileEntryBody(BaseModel):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


class WrittenBody(BaseModel):
    bytes: int


class ImageBody(BaseModel):
    id: str
    base: str
    layers: list[str]
    host_dirs: list[str]
    env: list[list[str]]
    workdir: str
    services: list[list[str]]
    user: str = ""
    entrypoint: list[str] = []
    cmd: list[str] = []
    ports: list[str] = []
    source: str = ""
    digest: str = ""
    labels: list[list[str]] = []
    volumes: list[str] = []
    healthcheck: dict[str, Any] | None = Field(None, description="A HEALTHCHECK, recorded; fanfold runs no probe.")
    history: list[tuple[str, str, int]] = Field([], description="(what made it, its layer or \"\", bytes) per step.")
    names: list[str] = []
    shared: bool = Field(False, description="Published by the host's own tenant to every tenant.")


class ErrorBody(BaseModel):
    kind: str = Field(description="The FanfoldError kind, e.g. sandbox_not_found.")
    message: str


class WhoAmI(BaseModel):
    tenant: str
    version: str


class PoolBody(BaseModel):
    source: str
    limits: LimitsBody
    size: int | None
    target: int
    ready: int
    filling: int
    handouts: int
    misses: int
    last_error: str | None


# -- rollouts: tools over HTTP keyed by rollout id ---------------------------------------------

ROLLOUT_ID = r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$"
ROLLOUT_DEADLINE_MAX = 86400
RolloutID = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=ROLLOUT_ID)]
LabelName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:/-]{1,128}$")]
EnvName = Annotated[str, StringConstraints(pattern=r"^[^=\x00]+$")]
EnvValue = Annotated[str, StringConstraints(pattern=r"^[^\x00]*$")]
RolloutState = Literal["pending", "creating", "running", "paused", "suspended", "destroying", "expired", "gone"]


class RolloutLimits(_Body):
    cpus: float = Field(1.0, ge=0.01, le=1024, description="CPU quota in cores.")
    memory_mb: int = Field(512, ge=16, le=1 << 22)
    pids: int = Field(256, ge=8, le=1 << 22)
    disk_mb: int = Field(1024, ge=1, le=1 << 24)


class RolloutRequest(_Body):
    rollout_id: RolloutID | None = Field(None, description=(
        "The caller's id for the rollout (a letter or digit, then letters, digits and _.:-); generated (ro-...)"
        " when absent."))
    image: str | None = Field(None, min_length=1, max_length=256, description=(
        "Image id or base name the sandbox is made from (default host); not with snapshot."))
    snapshot: str | None = Field(None, min_length=1, max_length=256, description=(
        "Id or name of one of the caller's snapshots to start from instead (a memory snapshot keeps its processes)."))
    limits: RolloutLimits | None = None
    env: dict[EnvName, EnvValue] = Field(default_factory=dict)
    deadline: float = Field(3600, gt=0, le=ROLLOUT_DEADLINE_MAX, description=(
        "Seconds from now after which the rollout ends and its sandboxes are destroyed."))
    labels: dict[LabelName, str] = Field(default_factory=dict, description="Put on its sandbox, with rollout_id.")
    network: NetworkName | NetworkRules = Field("none", description=NETWORK_HELP)

    @model_validator(mode="after")
    def _one_source(self) -> RolloutRequest:
        if self.image is not None and self.snapshot is not None:
            raise ValueError("give image or snapshot, not both")
        return self


class RolloutBody(BaseModel):
    rollout_id: str
    image: str | None
    snapshot: str | None
    limits: LimitsBody | None
    labels: dict[str, str]
    created_at: float
    deadline_at: float
    sandbox_id: str | None = Field(description="Made on the first tool call or fork; null until then.")
    network: Any = Field("none", description="Its sandbox's network policy.")
    state: RolloutState = Field(description=(
        "pending (no sandbox yet), the sandbox's state, expired (deadline passed) or gone (its sandbox was"
        " destroyed: deleted, crashed, or the server shut down)."))
    forked_from: str | None


class FunctionCall(BaseModel):
    """A Responses API function_call item, as the model produced it."""

    # Items from a model API may carry fields added after this was written: they are ignored.
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"] = "function_call"
    call_id: str = Field(min_length=1, max_length=256)
    name: str | None = Field(None, max_length=64, description="If given, it must be the tool named in the path.")
    arguments: str | dict[str, Any] = Field("{}", description="The arguments: a JSON string or an object.")
    id: str | None = Field(None, max_length=256)
    status: str | None = Field(None, max_length=32)


class FunctionCallOutput(BaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    status: Literal["completed"] = "completed"


class ToolErrorBody(ErrorBody):
    type: Literal["function_call_output"]
    call_id: str
    output: str = Field(description="The error, for the model.")


class RolloutForkRequest(_Body):
    count: int = Field(ge=1, le=16, description="How many rollouts to fork off, each with a live copy of the sandbox.")
    rollout_ids: list[RolloutID] | None = Field(None, min_length=1, max_length=16, description=(
        "Their ids (default: {rollout_id}.f1, .f2, ...); as many as count."))

    @field_validator("rollout_ids")
    @classmethod
    def _distinct(cls, ids: list[str] | None) -> list[str] | None:
        if ids is not None and len(set(ids)) != len(ids):
            raise ValueError("rollout_ids repeat an id")
        return ids


class RolloutForkBody(BaseModel):
    rollouts: list[RolloutBody]
    parent_pause_ms: float


class ToolsBody(BaseModel):
    responses: list[dict[str, Any]] = Field(description="For the Responses API's tools.")
    chat_completions: list[dict[str, Any]] = Field(description="For Chat Completions' tools.")
