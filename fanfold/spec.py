"""``EnvSpec``: a golden environment as code, a chain of immutable steps."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import InvalidSpec

BASES = ("host", "debian:bookworm")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SERVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


_REPO_URL = re.compile(r"^(https?|ssh|git)://[^/]+/|^[A-Za-z0-9_.-]+@[A-Za-z0-9_.-]+:")


def is_repo_url(src: str) -> bool:
    """True for a network git URL (https, http, ssh, git, or scp-style user@host:path);
    anything else, ``file://`` included, is a local path."""
    return bool(_REPO_URL.match(src))


REMOTE_LOCAL_REPO = (
    "repo source {src!r} is a local path: a server build can clone only network URLs (https://, ssh://,"
    " git@host:path); copy a local repository's files instead"
)


def sandbox_path(path: str, *, what: str) -> str:
    """Check an absolute in-sandbox path and return it normalised."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidSpec(f"{what} must be an absolute path inside the sandbox, got {path!r}")
    if "\0" in path or ".." in PurePosixPath(path).parts:
        raise InvalidSpec(f"{what} {path!r} may not contain '..' or NUL bytes")
    return str(PurePosixPath(path))


@dataclass(frozen=True)
class Step:
    """One build step; ``kind`` is workdir, copy, repo, run, env or service."""

    kind: str
    args: tuple[tuple[str, Any], ...]

    def arg(self, name: str) -> Any:
        return dict(self.args)[name]

    def describe(self) -> str:
        values = " ".join(str(v) for _, v in self.args if not isinstance(v, tuple))
        return f"{self.kind.upper()} {values}".strip()


@dataclass(frozen=True)
class EnvSpec:
    """A golden environment: a base and the steps that build on it.

    Each method returns a new spec, so a shared prefix can be reused::

        spec = EnvSpec("host").workdir("/env").copy("project", "/env").run("python3 -m compileall .")
    """

    base: str = "host"
    steps: tuple[Step, ...] = field(default=())
    context: Path | None = None
    """Directory that relative ``copy``/``repo`` sources resolve against (default: the cwd)."""

    def __post_init__(self) -> None:
        if self.base not in BASES:
            raise InvalidSpec(f"unknown base {self.base!r}: choose one of {', '.join(BASES)}")

    def _add(self, kind: str, **args: Any) -> EnvSpec:
        return replace(self, steps=self.steps + (Step(kind, tuple(args.items())),))

    def workdir(self, path: str) -> EnvSpec:
        """Create ``path`` and make it the default directory of later steps and execs."""
        return self._add("workdir", path=sandbox_path(path, what="workdir"))

    def copy(self, src: str | Path, dst: str) -> EnvSpec:
        """Copy a host file or directory into the image at ``dst``."""
        if not isinstance(src, (str, Path)) or not str(src) or "\0" in str(src):
            raise InvalidSpec(f"copy source must be a path, got {src!r}")
        return self._add("copy", src=str(src), dst=sandbox_path(dst, what="copy destination"))

    def repo(self, src: str, dst: str, ref: str = "HEAD") -> EnvSpec:
        """Clone a git repository (a URL or a local path) at ``ref`` into ``dst``."""
        if not isinstance(ref, str) or not ref or ref.startswith("-") or "\0" in ref:
            raise InvalidSpec(f"repo ref must be a branch, tag or commit name, got {ref!r}")
        if not isinstance(src, (str, Path)) or not str(src):
            raise InvalidSpec(f"repo source must be a URL or a path, got {src!r}")
        return self._add("repo", src=str(src), dst=sandbox_path(dst, what="repo destination"), ref=ref)

    def run(self, cmd: str) -> EnvSpec:
        """Run a shell command (``/bin/sh -c``) with the host's network; its changes become a layer."""
        if not isinstance(cmd, str) or not cmd.strip():
            raise InvalidSpec("run() needs a non-empty shell command string")
        return self._add("run", cmd=cmd)

    def env(self, **variables: str) -> EnvSpec:
        """Set environment variables for later steps and every exec."""
        for name, value in variables.items():
            if not _ENV_NAME.match(name) or not isinstance(value, str) or "\0" in value:
                raise InvalidSpec(f"bad environment variable {name}={value!r}: names are identifiers, values strings")
        return self._add("env", vars=tuple(sorted(variables.items())))

    def service(self, name: str, cmd: str, mode: str = "simple") -> EnvSpec:
        """A process started in every sandbox at create: ``oneshot`` runs to completion first."""
        if not _SERVICE_NAME.match(name or ""):
            raise InvalidSpec(f"bad service name {name!r}: letters, digits, '.', '_' and '-'")
        if mode not in ("oneshot", "simple"):
            raise InvalidSpec(f"service mode must be 'oneshot' or 'simple', got {mode!r}")
        if not isinstance(cmd, str) or not cmd.strip():
            raise InvalidSpec(f"service {name!r} needs a non-empty command")
        return self._add("service", name=name, cmd=cmd, mode=mode)

    def with_context(self, context: str | Path) -> EnvSpec:
        return replace(self, context=Path(context).absolute())
