"""Reading a Compose file: YAML, ``.env`` and interpolation, the Compose spec's own validation, then
fanfold's subset of it.

The spec's validation is ``compose-spec`` (Python bindings of the Rust ``compose_spec`` crate, which
refuses keys the spec does not define, wrong types and bad durations); keys the spec defines but
fanfold cannot honour are refused here, each by name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .._extras import require
from ..errors import InvalidSpec
from .interpolate import interpolate

TOP_KEYS = ("name", "services", "volumes")
"""Top-level keys fanfold reads (``version``, obsolete, and ``x-`` extensions are ignored, as Compose does)."""
SERVICE_KEYS = ("build", "command", "depends_on", "entrypoint", "environment", "healthcheck", "image", "ports",
                "user", "volumes", "working_dir")
"""A service's keys fanfold turns into a group member; any other is refused by name."""
BUILD_KEYS = ("args", "context", "dockerfile", "target")
HEALTHCHECK_KEYS = ("disable", "interval", "retries", "start_period", "test", "timeout")
DEPENDS_ON_KEYS = ("condition", "required")
PORT_KEYS = ("host_ip", "protocol", "published", "target")
VOLUME_KEYS = ("read_only", "source", "target", "type")
_PROJECT_NAME = re.compile(r"[^a-z0-9_-]")


@dataclass(frozen=True, kw_only=True)
class ComposeFile:
    """A Compose file as the spec reads it, interpolated and checked against fanfold's subset."""

    name: str
    """The project's name: the file's ``name``, else ``COMPOSE_PROJECT_NAME``, else its directory's name."""
    services: dict[str, dict[str, Any]]
    """Service name -> its keys, in the file's order."""
    volumes: tuple[str, ...] = ()
    """The named volumes the file declares."""
    directory: Path = field(default_factory=Path.cwd)
    """Where relative build contexts are found."""


def load(path: str | Path, *, env: Mapping[str, str] | None = None) -> ComposeFile:
    """Read the Compose file at ``path``; ``env`` (default: this process's environment, over the
    ``.env`` file beside the compose file) supplies ``${VAR}`` values."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise InvalidSpec(f"cannot read compose file {str(path)!r}: {err.strerror}") from None
    directory = path.absolute().parent
    if env is None:
        env = {**dotenv_file(directory / ".env"), **os.environ}
    return parse(text, env=env, directory=directory)


def dotenv_file(path: Path) -> dict[str, str]:
    """The variables of a ``.env`` file (none when it is missing), read by python-dotenv as Compose does."""
    if not path.is_file():
        return {}
    (dotenv,) = require("compose", "reading a Compose file's .env", "dotenv")
    return {name: value for name, value in dotenv.dotenv_values(path).items() if value is not None}


def parse(text: str, *, env: Mapping[str, str], directory: Path) -> ComposeFile:
    """The Compose file ``text``, its references expanded from ``env``."""
    yaml, compose_spec = require("compose", "reading a Compose file", "yaml", "compose_spec")
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise InvalidSpec(f"the compose file is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise InvalidSpec("a compose file is a mapping with a 'services' key")
    tree = interpolate(tree, env)
    try:  # the spec's validation reads YAML, and names the offending key's path in what it says
        checked = compose_spec.PyCompose.from_yaml(yaml.safe_dump(tree, sort_keys=False)).to_dict()
    except (ValueError, TypeError) as err:
        raise InvalidSpec(f"not a valid compose file: {_without_position(str(err))}") from None
    _refuse_unsupported(checked)
    services = checked.get("services") or {}
    if not services:
        raise InvalidSpec("the compose file defines no services")
    for service in services.values():
        _inherit(service, "environment", env)
        if isinstance(service.get("build"), dict):
            _inherit(service["build"], "args", env)
    return ComposeFile(name=_project_name(checked.get("name") or env.get("COMPOSE_PROJECT_NAME") or directory.name),
                       services=services, volumes=tuple(checked.get("volumes") or ()), directory=directory)


def _inherit(keys: dict[str, Any], key: str, env: Mapping[str, str]) -> None:
    """``keys[key]`` (``environment``, ``build.args``: Compose's list-or-map) as a map of strings; a name
    without a value (``- DEBUG``, ``DEBUG:``) takes this environment's value, or stays unset (None)."""
    value = keys.get(key)
    if not value:
        return
    if isinstance(value, list):
        value = {name: text if sep else None for name, sep, text in (str(item).partition("=") for item in value)}
    keys[key] = {name: env.get(name) if item is None else _scalar(item) for name, item in value.items()}


def _scalar(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _without_position(message: str) -> str:
    # the position is in the re-serialised YAML, not the user's file: the key path says where
    return re.sub(r" at line \d+ column \d+$", "", message)


def _project_name(name: str) -> str:
    cleaned = _PROJECT_NAME.sub("", name.lower())
    if not cleaned:
        raise InvalidSpec(f"project name {name!r} has no letters or digits: set 'name:' in the compose file")
    return cleaned


def _refuse_unsupported(tree: dict[str, Any]) -> None:
    _refuse(tree, TOP_KEYS + ("version",), "")
    for name, volume in (tree.get("volumes") or {}).items():
        if volume:
            _refuse(volume, (), f"volumes.{name}.", hint="fanfold's volumes are directories shared in a group")
    for name, service in (tree.get("services") or {}).items():
        where = f"services.{name}."
        _refuse(service, SERVICE_KEYS, where)
        if isinstance(service.get("build"), dict):
            _refuse(service["build"], BUILD_KEYS, where + "build.")
        if isinstance(service.get("healthcheck"), dict):
            _refuse(service["healthcheck"], HEALTHCHECK_KEYS, where + "healthcheck.")
        if isinstance(service.get("depends_on"), dict):
            for other, condition in service["depends_on"].items():
                _refuse(condition or {}, DEPENDS_ON_KEYS, f"{where}depends_on.{other}.")
        for key, allowed in (("ports", PORT_KEYS), ("volumes", VOLUME_KEYS)):
            for i, item in enumerate(service.get(key) or ()):
                if isinstance(item, dict):
                    _refuse(item, allowed, f"{where}{key}[{i}].")


def _refuse(mapping: dict[str, Any], allowed: tuple[str, ...], where: str, *, hint: str = "") -> None:
    unsupported = [key for key in mapping if key not in allowed and not str(key).startswith("x-")]
    if unsupported:
        keys = ", ".join(f"'{where}{key}'" for key in unsupported)
        supported = f"; fanfold supports {', '.join(allowed)}" if allowed else ""
        raise InvalidSpec(f"unsupported compose key{'s' if len(unsupported) > 1 else ''} {keys}: remove"
                          f" {'them' if len(unsupported) > 1 else 'it'}{supported}{' (' + hint + ')' if hint else ''}")
