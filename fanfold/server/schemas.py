"""Request and response bodies of the HTTP API, as pydantic models (they make /openapi.json)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateRequest(_Body):
    image: str = Field("host", min_length=1, max_length=256, description="Image id or base name.")
    cpus: float = Field(1.0, ge=0.01, le=1024, description="CPU quota in cores.")
    memory_mb: int = Field(512, ge=16, le=1 << 22)
    pids: int = Field(256, ge=8, le=1 << 22)
    disk_mb: int = Field(1024, ge=1, le=1 << 24)
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    deadline: float | None = Field(None, gt=0, le=365 * 86400, description="Hard lifetime in seconds.")
    detached: bool = Field(False, description="Outlive the creating client (until killed or its deadline).")


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


class ExecRequest(_Body):
    cmd: str | list[str] = Field(description="A shell string (run by /bin/sh -c) or an argv list.")
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    stdin: str | None = Field(None, description="Standard input, base64.")
    timeout: float | None = Field(None, gt=0, le=86400, description="Seconds before the command is killed.")
    max_output: int | None = Field(None, ge=0, le=64 << 20,
                                   description="Bytes kept of each of stdout and stderr (default 16 MiB, at most 64 MiB).")


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


class ErrorBody(BaseModel):
    kind: str = Field(description="The FanfoldError kind, e.g. sandbox_not_found.")
    message: str


class WhoAmI(BaseModel):
    tenant: str
    version: str
