"""Request and response bodies of the HTTP API, as pydantic models (they make /openapi.json).

The bodies of fanfold's own shapes are derived from their one definition (``fanfold.models``,
``fanfold.net.policy``) by ``model_of``: field names, types, defaults, bounds and docstrings, so
the server takes exactly what the engine takes.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, StrictBool, StrictInt, StringConstraints, create_model, field_validator,
    model_validator,
)

from ..engine.api import MAX_FORK, MAX_POOL
from ..models import (
    CreateParams, ExecResult, FileEntry, ForkResult, LeaseInfo, Limits, Persistence, PoolInfo, SandboxInfo,
    SnapshotInfo, field_docs,
)
from ..net.policy import NetworkPolicy

PersistenceName = Literal[tuple(p.value for p in Persistence)]  # type: ignore[valid-type]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def fields_of(cls: type, *, skip: tuple[str, ...] = (), **types: Any) -> dict[str, Any]:
    """pydantic fields of dataclass ``cls``: its types (or those ``types`` name instead), defaults,
    bounds (field metadata) and docstrings."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    made: dict[str, Any] = {}
    for spec in dataclasses.fields(cls):
        if spec.name in skip:
            continue
        default: dict[str, Any] = {}
        hint = types.get(spec.name, hints[spec.name])
        if isinstance(spec.default, tuple) and typing.get_origin(hint) is list:
            # A list field's default is a list: a tuple would not serialize as the field's type.
            default["default_factory"] = functools.partial(list, spec.default)
        elif spec.default is not dataclasses.MISSING:
            default["default"] = spec.default
        elif spec.default_factory is not dataclasses.MISSING:
            default["default_factory"] = spec.default_factory
        if spec.name in docs:
            default["description"] = docs[spec.name]
        # The engine takes true or false only, never "yes" or 1.
        made[spec.name] = (StrictBool if hint is bool else _strict_ints(hint), Field(**default, **spec.metadata))
    return made


def _strict_ints(hint: Any) -> Any:
    """In a union with str (``Limits.gpus``), an int taken strictly: true is not a count of 1."""
    args = typing.get_args(hint)
    if int in args and str in args:
        return functools.reduce(lambda a, b: a | b, [StrictInt if arg is int else arg for arg in args])
    return hint


def model_of(cls: type, *, name: str = "", base: type[BaseModel] = BaseModel, skip: tuple[str, ...] = (),
             **types: Any) -> Any:
    """A pydantic model with dataclass ``cls``'s fields (see ``fields_of``)."""
    return create_model(name or f"{cls.__name__}Body", __base__=base, __doc__=cls.__doc__,
                        **fields_of(cls, skip=skip, **types))


NetworkName = Literal["none", "open"]
NETWORK_HELP = (
    "none: loopback only; open: any public address (the host's own tenant only); or allow/deny rules: the"
    " sandbox's traffic leaves only through the host's filtering proxy, which its proxy variables name.")
NetworkRule = Annotated[str, StringConstraints(min_length=1, max_length=300)]
NetworkRules = model_of(NetworkPolicy, name="NetworkRules", base=_Body, allow=list[NetworkRule],
                        deny=list[NetworkRule])
NetworkValue = Annotated[NetworkName | NetworkRules, Field(description=NETWORK_HELP)]


def network_value(body: NetworkName | BaseModel) -> Any:
    """A policy as the engine takes it (only what is set, so the same policy reads the same everywhere)."""
    return body if isinstance(body, str) else body.model_dump(exclude_defaults=True)


class NetworkRequest(_Body):
    network: NetworkValue
    cut: bool = Field(False, description="End the connections already open too (else only new ones follow it).")


class PortBody(BaseModel):
    port: int
    path: str = Field(description="This server's route to the port: any HTTP method, with the caller's token.")
    direct: str | None = Field(None, description=(
        "For the host's own tenant: a URL on the server host's loopback reaching the port (any TCP protocol)."))


LimitsBody = model_of(Limits, name="LimitsBody")
LIMIT_FIELDS = fields_of(Limits)
"""A request body's limits, spread out among its other fields (``cpus``, ``memory_mb``, ...)."""
_create_fields = fields_of(CreateParams, skip=("limits",), persistence=PersistenceName, network=NetworkValue)
CreateRequest = create_model(
    "CreateRequest", __base__=_Body, __doc__=CreateParams.__doc__, image=_create_fields.pop("image"),
    **LIMIT_FIELDS, **_create_fields, lease=(str | None, Field(None, min_length=1, max_length=64, description=(
        "A lease of the caller's (POST /v1/leases): the sandbox dies when the lease is closed or expires."))),
)
PoolRequest = create_model(
    "PoolRequest", __base__=_Body, __doc__="A warm pool: its image, size and limits.",
    image=(str, Field("host", min_length=1, max_length=256, description=(
        "Image id or base name, or a snapshot of the caller's."))),
    size=(int | None, Field(description="Sandboxes kept warm; null follows recent demand; 0 removes the pool.",
                            ge=0, le=MAX_POOL)),
    **LIMIT_FIELDS,
    wait=(float | None, Field(None, gt=0, le=3600, description="Answer only once the pool is full (seconds to wait).")),
)


def limits_of(body: BaseModel) -> Limits:
    """The limits a request body spreads out among its fields."""
    return Limits(**body.model_dump(include=set(LIMIT_FIELDS)))


class LeaseRequest(_Body):
    ttl: float | None = Field(None, ge=1, le=86400, description="Seconds a renewal keeps it alive (default 30).")


LeaseBody = model_of(LeaseInfo, name="LeaseBody")


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


SandboxBody = model_of(SandboxInfo, name="SandboxBody", limits=LimitsBody, persistence=PersistenceName)


class TerminalSize(_Body):
    rows: int = Field(ge=1, le=65535)
    cols: int = Field(ge=1, le=65535)


KEPT_MAX_OUTPUT = 64 << 20
"""The most output an exec's result keeps, per stream."""
LIVE_MAX_OUTPUT = 1 << 62
"""The most output a live exec (which keeps none) streams, per stream."""


class ExecRequest(_Body):
    cmd: str | list[str] = Field(description="A shell string (run by /bin/sh -c) or an argv list.")
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    stdin: str | None = Field(None, description="Standard input, base64.")
    timeout: float | None = Field(None, gt=0, le=86400, description="Seconds before the command is killed.")
    max_output: int | None = Field(None, ge=0, le=LIVE_MAX_OUTPUT, description=(
        "Bytes kept of each of stdout and stderr (default 16 MiB, at most 64 MiB); of a live exec, which keeps"
        " none, bytes streamed (at most 2**62: a long session, `fanfold ssh`)."))
    user: str | None = Field(None, max_length=65, description=(
        "name[:group] or uid[:gid] to run as, resolved in the sandbox's /etc/passwd (default: the sandbox's user)."))
    live: bool = Field(False, description=(
        "Keep the command's stdin open and take input while it runs: the stream's first line is"
        " `{\"started\": {\"pid\": N, \"exec\": ID}}`, and `POST .../exec/{ID}/input` feeds it. Output is streamed,"
        " not kept in the result."))
    pty: TerminalSize | None = Field(None, description="Run on a pseudo-terminal of this size (implies `live`).")

    @model_validator(mode="after")
    def _kept_output_fits(self) -> ExecRequest:
        if not (self.live or self.pty) and (self.max_output or 0) > KEPT_MAX_OUTPUT:
            raise ValueError(f"max_output is at most {KEPT_MAX_OUTPUT} bytes unless the exec is live (nothing kept)")
        return self


class ExecInput(_Body):
    """Input for a live exec, applied in this order: stdin, end of stdin, signals, resize."""

    stdin: str | None = Field(None, description="Bytes for the command's stdin (a terminal's keys), base64.")
    eof: bool = Field(False, description="End the command's stdin after these bytes.")
    signals: list[Annotated[int, Field(ge=1, le=64)]] = Field(default_factory=list, max_length=64,
                                                        description="Signals for its process group.")
    resize: TerminalSize | None = Field(None, description="The terminal's new size.")


Base64 = Annotated[str, Field(description="base64")]
ExecResultBody = model_of(ExecResult, name="ExecResultBody", stdout=Base64, stderr=Base64, limits_hit=list[str])
SnapshotBody = model_of(SnapshotInfo, name="SnapshotBody", limits=LimitsBody | None)
ForkBody = model_of(ForkResult, name="ForkBody", children=list[SandboxBody], setup=list[ExecResultBody])


class GcBody(BaseModel):
    removed: list[str] = Field(description="Ids of the snapshots removed.")


FileEntryBody = model_of(FileEntry, name="FileEntryBody", type=Literal["file", "dir", "symlink", "other"])


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


PoolBody = model_of(PoolInfo, name="PoolBody", limits=LimitsBody)


# -- rollouts: tools over HTTP keyed by rollout id ---------------------------------------------

ROLLOUT_ID = r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$"
ROLLOUT_DEADLINE_MAX = 86400
RolloutID = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=ROLLOUT_ID)]
LabelName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:/-]{1,128}$")]
EnvName = Annotated[str, StringConstraints(pattern=r"^[^=\x00]+$")]
EnvValue = Annotated[str, StringConstraints(pattern=r"^[^\x00]*$")]
RolloutState = Literal["pending", "creating", "running", "paused", "suspended", "destroying", "expired", "gone"]


RolloutLimits = model_of(Limits, name="RolloutLimits", base=_Body)


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
    network: NetworkValue = "none"

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
