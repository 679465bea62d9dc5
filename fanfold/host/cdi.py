"""Container Device Interface specs: what a device needs done to a container to work in it.

A CDI spec (``/etc/cdi/*.yaml`` or ``*.json``, as ``nvidia-ctk cdi generate`` writes them, read by
podman and CRI-O) names devices of one kind (``nvidia.com/gpu``) and, for each and for the spec as a
whole, its *container edits*: device nodes to make, files to bind, environment variables and OCI
hooks to run. ``Edits`` is those edits, whoever made them (a spec, or ``gpus.discover`` from the
device nodes and driver files it finds); the OCI config writer applies them.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import HostNotReady

HOOK_NAMES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")


@dataclass(frozen=True)
class DeviceNode:
    """A host device node made visible at ``path`` inside, with a device rule that lets it be opened."""

    path: str
    host_path: str
    type: str
    """``c`` (character) or ``b`` (block)."""
    major: int
    minor: int
    permissions: str = "rwm"


@dataclass(frozen=True)
class Mount:
    """A host file or directory bound in (read-only unless the options say ``rw``)."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = ("ro", "nosuid", "nodev", "bind")


@dataclass(frozen=True)
class Hook:
    """An OCI hook the runtime runs at ``hook_name`` (``createContainer``...)."""

    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None


@dataclass(frozen=True)
class Edits:
    """What to add to a container's OCI config for some devices."""

    nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    env: tuple[str, ...] = ()
    """KEY=VALUE; a later edit's value for a key wins."""
    hooks: tuple[Hook, ...] = ()
    groups: tuple[int, ...] = field(default=())
    """Additional group ids the container's processes need (``additionalGIDs``)."""

    def __add__(self, other: Edits) -> Edits:
        def merged(mine: tuple, theirs: tuple) -> tuple:  # type: ignore[type-arg]
            return mine + tuple(item for item in theirs if item not in mine)

        return Edits(merged(self.nodes, other.nodes), merged(self.mounts, other.mounts), self.env + other.env,
                     merged(self.hooks, other.hooks), merged(self.groups, other.groups))

    def env_dict(self) -> dict[str, str]:
        return dict(item.partition("=")[::2] for item in self.env)


@dataclass(frozen=True)
class Spec:
    """One CDI spec file: its kind, its devices' edits by name, and the edits every device of it needs."""

    path: str
    kind: str
    devices: dict[str, Edits]
    common: Edits


def load_specs(dirs: tuple[str, ...]) -> list[Spec]:
    """Every CDI spec in ``dirs`` (``*.json``, ``*.yaml``, ``*.yml``; later directories win on a name
    clash, as the CDI spec says); HostNotReady names a file that is not a valid spec."""
    chosen: dict[str, Path] = {}
    for directory in dirs:
        root = Path(directory)
        if not root.is_dir():
            continue
        for path in sorted(root.iterdir()):
            if path.suffix in (".json", ".yaml", ".yml") and path.is_file():
                chosen[path.name] = path
    return [read_spec(path) for _, path in sorted(chosen.items())]


def read_spec(path: Path) -> Spec:
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else _yaml(text)
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str) or "/" not in data["kind"]:
            raise ValueError("it has no kind of the form vendor.com/class")
        devices = {}
        for device in data.get("devices") or []:
            name = device.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError("a device has no name")
            devices[name] = edits_of(device.get("containerEdits") or {})
        return Spec(str(path), data["kind"], devices, edits_of(data.get("containerEdits") or {}))
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as err:
        raise HostNotReady(f"CDI spec {path} cannot be used: {err}; fix it (nvidia-ctk cdi generate) or remove it")


def _yaml(text: str) -> Any:
    from .._extras import require

    (yaml,) = require("gpu", "reading CDI specs in YAML", "yaml")

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"it is not valid YAML ({err})") from None


def edits_of(data: dict[str, Any]) -> Edits:
    """One ``containerEdits`` object as Edits; a device node without a type or numbers takes its host node's."""
    nodes = tuple(_node(node) for node in data.get("deviceNodes") or [])
    mounts = tuple(
        Mount(m["hostPath"], m["containerPath"], tuple(m.get("options") or ("ro", "nosuid", "nodev", "bind"))
              if m.get("type", "bind") in ("bind", "none", None) else tuple(m.get("options") or ()))
        for m in data.get("mounts") or [])
    hooks = []
    for hook in data.get("hooks") or []:
        if hook.get("hookName") not in HOOK_NAMES:
            raise ValueError(f"hook {hook.get('path')!r} has hookName {hook.get('hookName')!r}, not one of {HOOK_NAMES}")
        hooks.append(Hook(hook["hookName"], hook["path"], tuple(hook.get("args") or ()), tuple(hook.get("env") or ()),
                          hook.get("timeout")))
    env = tuple(data.get("env") or ())
    if any(not isinstance(item, str) or "=" not in item for item in env):
        raise ValueError("an env entry is not KEY=VALUE")
    return Edits(nodes, mounts, env, tuple(hooks), tuple(int(g) for g in data.get("additionalGIDs") or ()))


def _node(data: dict[str, Any]) -> DeviceNode:
    path = data["path"]
    host_path = data.get("hostPath") or path
    kind, major, minor = data.get("type"), data.get("major"), data.get("minor")
    if kind is None or major is None or minor is None:
        found = node_numbers(host_path)
        kind, major, minor = kind or found[0], found[1] if major is None else major, found[2] if minor is None else minor
    if kind not in ("c", "b", "u"):
        raise ValueError(f"device node {path} has type {kind!r}, not c or b")
    return DeviceNode(path, host_path, "c" if kind == "u" else kind, int(major), int(minor), data.get("permissions") or "rwm")


def node_numbers(path: str) -> tuple[str, int, int]:
    """A device node's type (``c`` or ``b``), major and minor number; ValueError when it is none."""
    try:
        info = os.stat(path)
    except OSError as err:
        raise ValueError(f"device node {path} cannot be read ({err.strerror})") from None
    if stat.S_ISCHR(info.st_mode):
        kind = "c"
    elif stat.S_ISBLK(info.st_mode):
        kind = "b"
    else:
        raise ValueError(f"{path} is not a device node")
    return kind, os.major(info.st_rdev), os.minor(info.st_rdev)
