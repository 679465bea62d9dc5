"""``EnvSpec``: a golden environment as code, a chain of immutable steps."""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from ..errors import InvalidSpec
from ..gpu_request import parse as parse_gpus
from ..refs import BASES, is_image_id, is_image_ref
from . import words

__all__ = ["BASES", "EnvSpec", "GPUS_LABEL", "GPU_EXCLUSIVE_LABEL", "INITS", "INIT_LABEL", "Step", "check_user", "is_image_id", "is_image_ref",
           "is_repo_url", "sandbox_path"]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SERVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

GPUS_LABEL = "fanfold.gpus"
"""The image label naming the GPUs its sandboxes get unless their create names others (``EnvSpec.gpus``)."""
GPU_EXCLUSIVE_LABEL = "fanfold.gpu_exclusive"
"""The image label saying those GPUs are held alone (``true``) or shared (``false``, the default)."""
INIT_LABEL = "fanfold.init"
"""The image label naming its sandboxes' PID 1 (``EnvSpec.init``): ``systemd``, or ``fanfold`` (the agent, the default)."""
INITS = ("fanfold", "systemd")


_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?$")


def check_user(user: str) -> str:
    """A user as ``create``/``exec``/``USER`` take it: a name or uid, optionally ``:group`` or ``:gid``."""
    if not isinstance(user, str) or not _USER.match(user):
        raise InvalidSpec(f"bad user {user!r}: give a name or uid, optionally with ':group' or ':gid' (e.g. 'app', '1000:1000')")
    return user


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


def _step_path(path: str, *, what: str) -> str:
    """An absolute sandbox path, or a relative one that the builder resolves against the workdir in
    force at that step (the base image's until a workdir step)."""
    if not isinstance(path, str) or not path or path.startswith("/"):
        return sandbox_path(path, what=what)
    if "\0" in path or ".." in PurePosixPath(path).parts:
        raise InvalidSpec(f"{what} {path!r} may not contain '..' or NUL bytes")
    return posixpath.normpath(path)


@dataclass(frozen=True)
class Step:
    """One build step; ``kind`` is workdir, copy, copy_from, repo, run, env, service, user, entrypoint, cmd,
    expose, label, volume or healthcheck.

    env, service, user, entrypoint, cmd, expose, label, volume and healthcheck change the image's config,
    not its files."""

    kind: str
    args: tuple[tuple[str, Any], ...]

    def arg(self, name: str) -> Any:
        return dict(self.args)[name]

    def describe(self) -> str:
        args = dict(self.args)
        chown = f"--chown={args['chown']} " if args.get("chown") else ""
        if self.kind == "copy_from":
            source = self.arg("source")
            name = source if isinstance(source, str) else f"stage({source.base}+{len(source.steps)} steps)"
            return f"COPY --from={name} {chown}{self.arg('src')} {self.arg('dst')}"
        if self.kind == "copy" and chown:
            return f"COPY {chown}{self.arg('src')} {self.arg('dst')}"
        if self.kind == "label":
            return "LABEL " + " ".join(f"{k}={v}" for k, v in self.arg("labels"))
        if self.kind == "healthcheck":
            test = self.arg("test")
            return "HEALTHCHECK " + (" ".join(test) if test[0] != "CMD-SHELL" else f"CMD {test[1]}")
        if self.kind == "env":
            return "ENV " + " ".join(f"{name}={value}" for name, value in self.arg("vars"))
        values = " ".join(
            " ".join(v) if isinstance(v, tuple) and all(isinstance(x, str) for x in v) else str(v)
            for _, v in self.args
            if not isinstance(v, (tuple, bool)) or isinstance(v, tuple) and all(isinstance(x, str) for x in v)
        )
        return f"{self.kind.upper()} {values}".strip()


@dataclass(frozen=True)
class EnvSpec:
    """A golden environment: a base and the steps that build on it.

    The base is ``host`` (the host's own /usr, read-only), ``debian:bookworm`` (debootstrap), an image
    reference pulled from its registry (``python:3.12-slim``, ``ghcr.io/org/env@sha256:...``) or a
    local image's id. Each method returns a new spec, so a shared prefix can be reused::

        spec = EnvSpec("host").workdir("/env").copy("project", "/env").run("python3 -m compileall .")
    """

    base: str = "host"
    steps: tuple[Step, ...] = field(default=())
    context: Path | None = None
    """Directory that relative ``copy``/``repo`` sources resolve against (default: the cwd)."""

    def __post_init__(self) -> None:
        if self.base not in BASES and not is_image_id(self.base) and not is_image_ref(self.base):
            raise InvalidSpec(
                f"unknown base {self.base!r}: choose one of {', '.join(BASES)}, an image reference"
                " (e.g. 'python:3.12-slim', 'registry.example.org/env@sha256:...') or a local image id (img-...)"
            )

    def _add(self, kind: str, **args: Any) -> EnvSpec:
        return replace(self, steps=self.steps + (Step(kind, tuple(args.items())),))

    def workdir(self, path: str) -> EnvSpec:
        """Create ``path`` and make it the default directory of later steps and execs; a relative
        ``path`` is relative to the workdir in force (the base image's until a workdir step)."""
        return self._add("workdir", path=_step_path(path, what="workdir"))

    def copy(self, src: str | Path, dst: str, *, chown: str | None = None) -> EnvSpec:
        """Copy a host file or directory into the image at ``dst`` (relative: to the workdir in force).
        ``chown`` (``user[:group]``, names or ids, resolved in the image) owns what is copied, as
        ``COPY --chown`` does: a user without a group gets the gid equal to its uid."""
        if not isinstance(src, (str, Path)) or not str(src) or "\0" in str(src):
            raise InvalidSpec(f"copy source must be a path, got {src!r}")
        return self._add("copy", src=str(src), dst=_step_path(dst, what="copy destination"), **_chown(chown))

    def copy_from(self, source: EnvSpec | str, src: str, dst: str, *, chown: str | None = None) -> EnvSpec:
        """Copy ``src`` out of another image: a spec (built first, as a Dockerfile stage is), an image
        reference, a local image id or a base. A directory's contents go into ``dst``; a file becomes
        ``dst``, or goes into it when ``dst`` ends with '/'. Relative ``dst``: to the workdir in force.
        ``chown`` as for ``copy``."""
        if isinstance(source, str):
            EnvSpec(source)  # the same names a base takes, checked the same way
        elif not isinstance(source, EnvSpec):
            raise InvalidSpec(f"copy_from source must be an EnvSpec, an image reference or id, got {source!r}")
        into = isinstance(dst, str) and dst.endswith("/") and dst.strip("/") != ""
        dst = _step_path(dst, what="copy_from destination")
        return self._add("copy_from", source=source, src=sandbox_path(src, what="copy_from source"),
                         dst=dst + "/" if into else dst, **_chown(chown))

    def repo(self, src: str, dst: str, ref: str = "HEAD") -> EnvSpec:
        """Clone a git repository (a URL or a local path) at ``ref`` into ``dst``."""
        if not isinstance(ref, str) or not ref or ref.startswith("-") or "\0" in ref:
            raise InvalidSpec(f"repo ref must be a branch, tag or commit name, got {ref!r}")
        if not isinstance(src, (str, Path)) or not str(src):
            raise InvalidSpec(f"repo source must be a URL or a path, got {src!r}")
        return self._add("repo", src=str(src), dst=sandbox_path(dst, what="repo destination"), ref=ref)

    def run(self, cmd: str, *, build_args: Mapping[str, str] | None = None) -> EnvSpec:
        """Run a shell command (``/bin/sh -c``); its changes become a layer. It reaches the outside
        through NAT but nothing of the host, unless the build asks for ``network="host"``.
        ``build_args`` are variables of this command only, not kept in the image (a Dockerfile's ARG);
        the image's environment wins over them."""
        if not isinstance(cmd, str) or not cmd.strip():
            raise InvalidSpec("run() needs a non-empty shell command string")
        if not build_args:
            return self._add("run", cmd=cmd)
        if not isinstance(build_args, Mapping):
            raise InvalidSpec(f"build_args must be a mapping of names to strings, got {build_args!r}")
        for name, value in build_args.items():
            if not isinstance(name, str) or not _ENV_NAME.match(name) or not isinstance(value, str) or "\0" in value:
                raise InvalidSpec(f"bad build arg {name}={value!r}: names are identifiers, values strings")
        return self._add("run", cmd=cmd, build_args=tuple(sorted(build_args.items())))

    def env(self, **variables: str) -> EnvSpec:
        """Set environment variables for later steps and every exec."""
        for name, value in variables.items():
            if not _ENV_NAME.match(name) or not isinstance(value, str) or "\0" in value:
                raise InvalidSpec(f"bad environment variable {name}={value!r}: names are identifiers, values strings")
        return self._add("env", vars=tuple(sorted(variables.items())))

    def expand_env(self, **variables: str) -> EnvSpec:
        """Set variables whose values are expanded when built, against the environment so far (the
        base image's and earlier env steps'), as Docker's ENV does: ``PATH="/opt/x/bin:$PATH"``.
        ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR:+alt}`` expand; ``\\$`` is a literal '$'."""
        for name, value in variables.items():
            if not _ENV_NAME.match(name) or not isinstance(value, str) or "\0" in value:
                raise InvalidSpec(f"bad environment variable {name}={value!r}: names are identifiers, values strings")
            try:
                words.check(value)
            except ValueError as err:
                raise InvalidSpec(f"environment variable {name}: {err}") from None
        return self._add("env", vars=tuple(sorted(variables.items())), expand=True)

    def service(self, name: str, cmd: str, mode: str = "simple") -> EnvSpec:
        """A process started in every sandbox at create: ``oneshot`` runs to completion first."""
        if not _SERVICE_NAME.match(name or ""):
            raise InvalidSpec(f"bad service name {name!r}: letters, digits, '.', '_' and '-'")
        if mode not in ("oneshot", "simple"):
            raise InvalidSpec(f"service mode must be 'oneshot' or 'simple', got {mode!r}")
        if not isinstance(cmd, str) or not cmd.strip():
            raise InvalidSpec(f"service {name!r} needs a non-empty command")
        return self._add("service", name=name, cmd=cmd, mode=mode)

    def systemd_service(self, name: str, exec: str, mode: str = "oneshot") -> EnvSpec:
        """A systemd unit ``name.service`` running ``exec`` (``oneshot`` or ``simple``), as Freestyle's spec
        names it: ``init("systemd")`` and ``service(name, exec, mode)`` in one step each. Its sandboxes run
        systemd as init, and the unit is active before the create returns."""
        return self.init("systemd").service(name, exec, mode)

    def user(self, user: str) -> EnvSpec:
        """Run later ``run`` steps and every exec as ``user`` (name or uid, optionally ``:group``); services
        still start as root (a service can drop to a user itself, e.g. with ``runuser``)."""
        return self._add("user", user=check_user(user))

    def entrypoint(self, *argv: str) -> EnvSpec:
        """The image's entrypoint: what ``fanfold run`` with no command runs, ``cmd`` appended."""
        return self._add("entrypoint", argv=_argv(argv, "entrypoint"))

    def cmd(self, *argv: str) -> EnvSpec:
        """The image's default command (arguments to the entrypoint, if it has one)."""
        return self._add("cmd", argv=_argv(argv, "cmd"))

    def expose(self, *ports: int | str) -> EnvSpec:
        """Note ports a service in the image listens on (``8000``, ``53/udp``); informational."""
        return self._add("expose", ports=tuple(_port(p) for p in ports))

    def label(self, **labels: str) -> EnvSpec:
        """Metadata kept in the image's config (``fanfold images inspect`` shows it); keys may hold dots:
        ``spec.label(**{"org.opencontainers.image.source": url})``."""
        for key, value in labels.items():
            if not key or not isinstance(value, str) or "\0" in key + value:
                raise InvalidSpec(f"bad label {key}={value!r}: a non-empty key and a string value")
        _check_gpu_labels(labels)
        if labels.get(INIT_LABEL, "fanfold") not in INITS:
            raise InvalidSpec(f"label {INIT_LABEL}={labels[INIT_LABEL]!r} must be one of {', '.join(INITS)}")
        return self._add("label", labels=tuple(sorted(labels.items())))

    def gpus(self, gpus: str | int | None = "all", *, exclusive: bool = False) -> EnvSpec:
        """Give the image's sandboxes GPUs unless their create names its own ``gpus`` (``gpus="none"``: none):
        ``all``, a count, or ``device=ID,...``, as ``Limits.gpus`` takes; ``exclusive`` holds them alone.
        None drops a default the base image set. Recorded as the labels ``fanfold.gpus`` and
        ``fanfold.gpu_exclusive``, which a Dockerfile's ``LABEL`` sets as well; build steps get no GPU."""
        value = _gpus_value(gpus, "gpus") or "none"
        if not isinstance(exclusive, bool):
            raise InvalidSpec(f"gpus(exclusive=) is True or False, got {exclusive!r}")
        return self.label(**{GPUS_LABEL: value, GPU_EXCLUSIVE_LABEL: "true" if exclusive else "false"})

    def init(self, init: str = "systemd") -> EnvSpec:
        """What runs as its sandboxes' PID 1: ``systemd`` (the image must have it, as the ``host`` base
        does), its ``service`` steps becoming systemd units that ``systemctl`` manages; or ``fanfold``,
        fanfold's agent (the default), which starts them itself. Recorded as the label ``fanfold.init``,
        which a Dockerfile's ``LABEL`` sets as well."""
        if init not in INITS:
            raise InvalidSpec(f"init must be one of {', '.join(INITS)}, got {init!r}")
        return self.label(**{INIT_LABEL: init})

    def volume(self, *paths: str) -> EnvSpec:
        """Note paths the image keeps data in, as Docker's VOLUME does. fanfold records them (``inspect``
        shows them) and mounts nothing there: a volume is a directory of the sandbox's own disk, written,
        snapshotted and forked with the rest of it."""
        if not paths:
            raise InvalidSpec("volume() needs one or more absolute paths")
        return self._add("volume", paths=tuple(sandbox_path(p, what="volume") for p in paths))

    def healthcheck(self, cmd: str | list[str] | tuple[str, ...] | None, *, interval_s: float = 30.0,
                    timeout_s: float = 30.0, start_period_s: float = 0.0, retries: int = 3) -> EnvSpec:
        """How to tell the image's service is healthy, as Docker's HEALTHCHECK: a shell command (a string),
        an argv (a list), or None to drop an inherited one. Recorded in the image's config (``inspect``
        shows it) for tools that probe; fanfold itself runs no probe."""
        if cmd is None:
            test: tuple[str, ...] = ("NONE",)
        elif isinstance(cmd, str) and cmd.strip():
            test = ("CMD-SHELL", cmd)
        elif isinstance(cmd, (list, tuple)) and cmd:
            test = ("CMD", *_argv(tuple(cmd), "healthcheck"))
        else:
            raise InvalidSpec("healthcheck() takes a shell command, an argv list, or None")
        numbers = {"interval_s": interval_s, "timeout_s": timeout_s, "start_period_s": start_period_s}
        for name, value in numbers.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise InvalidSpec(f"healthcheck {name} must be a number of seconds >= 0, got {value!r}")
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise InvalidSpec(f"healthcheck retries must be a whole number >= 0, got {retries!r}")
        return self._add("healthcheck", test=test, **{k: float(v) for k, v in numbers.items()}, retries=retries)

    @classmethod
    def from_dockerfile(cls, path: str | Path, *, context: str | Path | None = None,
                        build_args: dict[str, str] | None = None, target: str | None = None,
                        gpus: str | int | None = None) -> EnvSpec:
        """The spec a Dockerfile describes (its last stage, or the stage ``target``): COPY sources come
        from ``context`` (default: the Dockerfile's directory), ``build_args`` override ARG defaults.
        ``gpus`` gives its sandboxes GPUs (``EnvSpec.gpus``), as ``LABEL fanfold.gpus=...`` in it does;
        ``LABEL fanfold.init=systemd`` makes systemd their init (``EnvSpec.init``)."""
        from .dockerfile import from_dockerfile  # buildkit's parser loads only for a Dockerfile

        spec = from_dockerfile(path, cls, context=context, build_args=build_args, target=target)
        return spec if gpus is None else spec.gpus(gpus)

    def with_context(self, context: str | Path) -> EnvSpec:
        return replace(self, context=Path(context).absolute())


def _argv(argv: tuple[str, ...], what: str) -> tuple[str, ...]:
    if not all(isinstance(a, str) and "\0" not in a for a in argv):
        raise InvalidSpec(f"{what} takes strings (an argv), got {argv!r}")
    return tuple(argv)


def _gpus_value(value: Any, what: str) -> str | None:
    try:
        return parse_gpus(value, what=what)
    except ValueError as err:
        raise InvalidSpec(str(err)) from None


def _check_gpu_labels(labels: Mapping[str, str]) -> None:
    """The GPU labels (``EnvSpec.gpus``) hold what a create would take: a bad one fails the spec, not a create."""
    if GPUS_LABEL in labels:
        _gpus_value(labels[GPUS_LABEL], f"label {GPUS_LABEL}")
    if labels.get(GPU_EXCLUSIVE_LABEL, "false").lower() not in ("true", "false"):
        raise InvalidSpec(f"label {GPU_EXCLUSIVE_LABEL}={labels[GPU_EXCLUSIVE_LABEL]!r} must be true or false")


def _chown(chown: str | None) -> dict[str, str]:
    """A copy's ``chown`` argument, present only when given (a copy without one keeps its layer's key)."""
    return {} if chown is None else {"chown": check_user(chown)}


def _port(port: int | str) -> str:
    text = str(port)
    number, _, proto = text.partition("/")
    if not number.isdigit() or not 0 < int(number) < 65536 or proto not in ("", "tcp", "udp", "sctp"):
        raise InvalidSpec(f"bad port {port!r}: a number 1-65535, optionally '/tcp', '/udp' or '/sctp'")
    return f"{int(number)}/{proto or 'tcp'}"
