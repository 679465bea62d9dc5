"""The JSON forms of fanfold's data, shared by the server and the remote SDK (no I/O here).

Bytes travel as base64. Every ``*_from_json`` revalidates what it reads, so the server
can feed client input straight in and get fanfold's own errors back.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

from . import errors
from .errors import BuildFailed, FanfoldError, InvalidRequest, InvalidSpec, ServiceFailed
from .images import Image
from .images.builder import StepEvent
from .models import (
    CreateParams, ExecResult, FileEntry, ForkResult, Limits, Outcome, Persistence, PoolInfo, SandboxInfo, SnapshotInfo,
)
from .spec import EnvSpec


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise InvalidRequest(f"{what} must be base64") from None


# -- sandboxes, snapshots, forks, results, files, images ------------------------------------------


def create_to_json(params: CreateParams) -> dict[str, Any]:
    """A create's parameters as the server's create body takes them: the limits' fields spread out."""
    spread = {spec.name: getattr(params, spec.name) for spec in dataclasses.fields(params) if spec.name != "limits"}
    return {**spread, **dataclasses.asdict(params.limits or Limits())}


def create_from_json(data: dict[str, Any]) -> CreateParams:
    limit_names = {spec.name for spec in dataclasses.fields(Limits)}
    limits = Limits(**{key: value for key, value in data.items() if key in limit_names})
    return CreateParams(limits=limits, **{key: value for key, value in data.items() if key not in limit_names})


def info_to_json(info: SandboxInfo) -> dict[str, Any]:
    return {**info.to_dict(), "persistence": Persistence(info.persistence).value}


def info_from_json(data: dict[str, Any]) -> SandboxInfo:
    # source, persistence, priority and idle_timeout keep their defaults from servers that predate them.
    return SandboxInfo(**{**data, "limits": Limits(**data["limits"])})


def snapshot_to_json(snapshot: SnapshotInfo) -> dict[str, Any]:
    return snapshot.to_dict()


def snapshot_from_json(data: dict[str, Any]) -> SnapshotInfo:
    limits = data.get("limits")
    return SnapshotInfo(**{**data, "limits": None if limits is None else Limits(**limits)})


def pool_from_json(data: dict[str, Any]) -> PoolInfo:
    return PoolInfo(**{**data, "limits": Limits(**data["limits"])})


def fork_to_json(fork: ForkResult) -> dict[str, Any]:
    return {
        "parent_id": fork.parent_id, "children": [info_to_json(child) for child in fork.children],
        "snapshot_id": fork.snapshot_id, "parent_pause_ms": fork.parent_pause_ms, "total_ms": fork.total_ms,
        "setup": [result_to_json(result) for result in fork.setup], "user_random_copied": fork.user_random_copied,
    }


def fork_from_json(data: dict[str, Any]) -> ForkResult:
    return ForkResult(**{
        **data, "children": tuple(info_from_json(child) for child in data["children"]),
        "setup": tuple(result_from_json(result) for result in data.get("setup", ())),
    })


def result_to_json(result: ExecResult) -> dict[str, Any]:
    return {
        "outcome": result.outcome.value, "exit_code": result.exit_code, "signal": result.signal,
        "stdout": b64(result.stdout), "stderr": b64(result.stderr),
        "stdout_truncated": result.stdout_truncated, "stderr_truncated": result.stderr_truncated,
        "duration_s": result.duration_s, "limits_hit": list(result.limits_hit),
        "cpu_s": result.cpu_s, "memory_peak_bytes": result.memory_peak_bytes,
    }


def result_from_json(data: dict[str, Any]) -> ExecResult:
    return ExecResult(**{
        **data, "outcome": Outcome(data["outcome"]), "stdout": unb64(data["stdout"], "stdout"),
        "stderr": unb64(data["stderr"], "stderr"), "limits_hit": tuple(data["limits_hit"]),
    })


def entry_to_json(entry: FileEntry) -> dict[str, Any]:
    return dict(entry.__dict__)


def entry_from_json(data: dict[str, Any]) -> FileEntry:
    return FileEntry(**data)


def image_to_json(image: Image) -> dict[str, Any]:
    return dataclasses.asdict(image)


def image_from_json(data: dict[str, Any]) -> Image:
    return Image.from_dict(data)


def pull_event_to_json(event: Any) -> dict[str, Any]:
    return dict(event.__dict__)


def pull_event_from_json(data: dict[str, Any]) -> Any:
    from .images.oci import PullEvent  # the pull machinery loads only when a pull is watched

    return PullEvent(**data)


def event_to_json(event: StepEvent) -> dict[str, Any]:
    return dict(event.__dict__)


def event_from_json(data: dict[str, Any]) -> StepEvent:
    return StepEvent(**data)


# -- specs ----------------------------------------------------------------------------------------


def spec_to_json(spec: EnvSpec) -> dict[str, Any]:
    """A spec as JSON; a ``copy_from`` spec (a stage) nests as its own object."""
    steps = []
    for step in spec.steps:
        args = dict(step.args)
        if step.kind == "env":
            args = {**args, "vars": dict(args["vars"])}
        elif step.kind == "label":
            args = {"labels": dict(args["labels"])}
        elif step.kind == "run" and "build_args" in args:
            args["build_args"] = dict(args["build_args"])
        elif step.kind == "copy_from" and isinstance(args["source"], EnvSpec):
            args["source"] = spec_to_json(args["source"])
        steps.append({"kind": step.kind, **args})
    return {"base": spec.base, "steps": steps}


_STEP_ARGS = {
    "workdir": ("path",), "copy": ("src", "dst", "chown"), "copy_from": ("source", "src", "dst", "chown"),
    "repo": ("src", "dst", "ref"), "run": ("cmd", "build_args"), "env": ("vars", "expand"),
    "service": ("name", "cmd", "mode"),
    "user": ("user",), "entrypoint": ("argv",), "cmd": ("argv",), "expose": ("ports",), "label": ("labels",),
    "volume": ("paths",), "healthcheck": ("test", "interval_s", "timeout_s", "start_period_s", "retries"),
}
MAX_STAGES = 32
"""Deepest nesting of copy_from specs a spec may have."""


def spec_from_json(data: Any, _depth: int = 0) -> EnvSpec:
    """Rebuild a spec through EnvSpec's own methods, so every rule they check applies."""
    if _depth > MAX_STAGES:
        raise InvalidSpec(f"copy_from specs nest over {MAX_STAGES} deep")
    if not isinstance(data, dict) or not isinstance(data.get("base", "host"), str):
        raise InvalidSpec("a spec is an object with a base name and a list of steps")
    spec = EnvSpec(data.get("base", "host"))
    steps = data.get("steps", [])
    if not isinstance(steps, list):
        raise InvalidSpec("spec steps must be a list")
    for number, step in enumerate(steps, start=1):
        kind = step.get("kind") if isinstance(step, dict) else None
        if kind not in _STEP_ARGS:
            raise InvalidSpec(f"step {number}: kind must be one of {', '.join(_STEP_ARGS)}, got {kind!r}")
        args = {key: value for key, value in step.items() if key != "kind"}
        unknown = set(args) - set(_STEP_ARGS[kind])
        if unknown:
            raise InvalidSpec(f"step {number} ({kind}): unknown fields {', '.join(sorted(unknown))}")
        try:
            if kind == "env":
                variables = args.get("vars")
                if not isinstance(variables, dict):
                    raise InvalidSpec(f"step {number} (env): vars must be an object of strings")
                if not isinstance(args.get("expand", False), bool):
                    raise InvalidSpec(f"step {number} (env): expand must be true or false")
                spec = spec.expand_env(**variables) if args.get("expand") else spec.env(**variables)
            elif kind == "copy_from":
                source = args.get("source")
                if isinstance(source, dict):
                    source = spec_from_json(source, _depth + 1)
                spec = spec.copy_from(source, args.get("src"), args.get("dst"), chown=args.get("chown"))
            elif kind == "label":
                labels = args.get("labels")
                if not isinstance(labels, dict):
                    raise InvalidSpec(f"step {number} (label): labels must be an object of strings")
                spec = spec.label(**labels)
            elif kind == "healthcheck":
                test = args.pop("test", None)
                if not isinstance(test, (list, tuple)) or not test or test[0] not in ("CMD", "CMD-SHELL", "NONE"):
                    raise InvalidSpec(f"step {number} (healthcheck): test must be [\"CMD\", ...], [\"CMD-SHELL\","
                                      " command] or [\"NONE\"]")
                cmd = None if test[0] == "NONE" else test[1] if test[0] == "CMD-SHELL" else list(test[1:])
                spec = spec.healthcheck(cmd, **args)
            elif kind in ("entrypoint", "cmd", "expose", "volume"):
                values = args.get({"expose": "ports", "volume": "paths"}.get(kind, "argv"))
                if not isinstance(values, (list, tuple)):
                    raise InvalidSpec(f"step {number} ({kind}): give a list")
                spec = getattr(spec, kind)(*values)
            else:
                spec = getattr(spec, kind)(**args)
        except TypeError as err:
            raise InvalidSpec(f"step {number} ({kind}): {err}") from None
    return spec


# -- errors ---------------------------------------------------------------------------------------


def error_to_json(err: FanfoldError) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": err.kind, "message": str(err)}
    if isinstance(err, BuildFailed):
        body.update(step=err.step, exit_code=err.exit_code, output_tail=err.output_tail)
    elif isinstance(err, ServiceFailed):
        body.update(service=err.service, exit_code=err.exit_code, log_tail=err.log_tail)
    return body


def _error_classes() -> dict[str, type[FanfoldError]]:
    found: dict[str, type[FanfoldError]] = {}
    pending: list[type[FanfoldError]] = [FanfoldError]
    while pending:
        cls = pending.pop()
        found[cls.kind] = cls
        pending.extend(cls.__subclasses__())
    return found


def error_from_json(data: Any, status: int) -> FanfoldError:
    """The exception a server reply stands for; unknown kinds fall back by status code."""
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
        message = f"the server answered {status} without a fanfold error body"
        return errors.InfrastructureError(message) if status >= 500 else FanfoldError(message)
    cls = _error_classes().get(data["kind"])
    message = str(data.get("message", ""))
    if cls is BuildFailed:
        return BuildFailed(
            message, step=data.get("step", ""), exit_code=data.get("exit_code"), output_tail=data.get("output_tail", "")
        )
    if cls is ServiceFailed:
        return ServiceFailed(
            message, service=data.get("service", ""), exit_code=data.get("exit_code"), log_tail=data.get("log_tail", "")
        )
    if cls is None:
        return errors.InfrastructureError(message) if status in (502, 503, 504) else FanfoldError(message)
    return cls(message)
