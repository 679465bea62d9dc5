"""GPUs under gVisor: what ``runsc --nvproxy`` needs of a sandbox's config, and whether this host's runsc can give it.

nvproxy is gVisor's proxy of NVIDIA's driver: the sandbox's ``/dev/nvidiactl``, ``/dev/nvidia-uvm`` and
``/dev/nvidia<N>`` are gVisor's own, and each call on them that nvproxy knows goes to the host's driver.
What it takes, as runsc 20240729 does it (``docs/design/runsc.md``):

- The GPUs are the config's ``linux.devices`` entries (path, type, major, minor), never bind mounts of the
  nodes. runsc's gofer opens the host's node at the *same path* (the host's ``/dev/nvidia0``, whatever a
  CDI spec's ``hostPath`` says), and renumbers nvidia-uvm's major inside. Other NVIDIA nodes
  (``nvidia-uvm-tools``, ``nvidia-modeset``, ``nvidia-caps/*``) nvproxy does not serve: they are left out.
- runsc knows a fixed list of driver versions (``runsc nvproxy list-supported-drivers``) and will not
  start a sandbox on any other: it asks the host's ``/dev/nvidiactl`` for the version as it starts.
- The driver's libraries and tools are plain bind mounts. Of OCI hooks, runsc runs ``prestart``,
  ``createRuntime``, ``poststart`` and ``poststop`` ones (on the host), never ``createContainer`` or
  ``startContainer`` ones (which CDI specs of ``nvidia-ctk`` use to link and index the libraries).
- No memory checkpoints: nvproxy cannot save a sandbox's GPU state (asked, the sentry dies).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..host import cdi
from ..host.cdi import DeviceNode, Edits

SERVED = re.compile(r"^/dev/(nvidiactl|nvidia-uvm|nvidia\d+)$")
"""The device nodes nvproxy serves."""
RUNSC_HOOKS = frozenset({"prestart", "createRuntime", "poststart", "poststop"})
"""The OCI hooks runsc runs."""
DRIVER_VERSION_FILES = ("/sys/module/nvidia/version", "/proc/driver/nvidia/version")
"""Where the host's NVIDIA kernel module tells its version, without opening a device."""
FLAG = "--nvproxy"
PROBE_TIMEOUT_S = 20
SHOWN_DRIVERS = 6


@dataclass(frozen=True)
class Support:
    """What a runsc binary can do for GPUs."""

    version: str
    """``runsc --version``'s first line, as users see it."""
    nvproxy: bool
    """It has ``--nvproxy``."""
    drivers: frozenset[str] | None
    """The driver versions its nvproxy supports; None where it cannot tell."""


def probe(binary: str) -> Support:
    """Ask ``binary`` (runsc) what it can do for GPUs: three quick runs of it, nothing started."""
    version = _output([binary, "--version"]).partition("\n")[0].strip() or f"{binary} (of unknown version)"
    flags = _output([binary, "flags"])
    nvproxy = re.search(r"^\s*-nvproxy\b(?!-)", flags, re.MULTILINE) is not None
    listed = _output([binary, "nvproxy", "list-supported-drivers"]) if nvproxy else ""
    drivers = frozenset(line.strip() for line in listed.splitlines() if re.fullmatch(r"\d+\.\d+(\.\d+)?", line.strip()))
    return Support(version, nvproxy, drivers or None)


def _output(argv: list[str]) -> str:
    """What ``argv`` printed (``runsc flags`` prints to stderr), or nothing where it failed."""
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def host_driver_version() -> str | None:
    """The loaded NVIDIA kernel module's version (``580.95.05``), or None where none is loaded."""
    for path in DRIVER_VERSION_FILES:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        found = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s", text) if "NVRM" in text else \
            re.fullmatch(r"\s*(\d+\.\d+(?:\.\d+)?)\s*", text)
        if found:
            return found.group(1)
    return None


def refusal(support: Support, driver: str | None, edits: Edits) -> str | None:
    """Why a runsc sandbox cannot have ``edits``' GPUs on this host (what to do included), or None."""
    fallback = "use the oci backend for GPU sandboxes (FANFOLD_RUNTIME=crun)"
    if not support.nvproxy:
        return (f"{support.version} has no {FLAG} (gVisor's GPU proxy): install a newer gVisor"
                f" (scripts/runsc.sh), or {fallback}")
    if driver is not None and support.drivers is not None and driver not in support.drivers:
        known = sorted(support.drivers, key=_version_key)
        older = len(known) - SHOWN_DRIVERS
        shown = ", ".join(known[-SHOWN_DRIVERS:]) + (f" and {older} older" if older > 0 else "")
        return (f"this host's NVIDIA driver {driver} is not one that {support.version}'s nvproxy supports ({shown}):"
                f" install a gVisor release that supports it (`runsc nvproxy list-supported-drivers` lists them),"
                f" or one of those drivers, or {fallback}")
    served = served_nodes(edits)
    if not any(node.path == "/dev/nvidiactl" for node in served):
        return (f"its devices include no /dev/nvidiactl, without which nvproxy serves no GPU: give it the host's"
                f" (host.gpus finds it), or {fallback}")
    for node in served:
        if (problem := _host_node_problem(node)) is not None:
            return (f"{problem}; nvproxy opens the host's {node.path} itself, whatever node the sandbox is given"
                    f" ({node.host_path}): load the NVIDIA driver (its nodes in /dev), or {fallback}")
    skipped = sorted({f"{hook.hook_name} hook {hook.path}" for hook in edits.hooks if hook.hook_name not in RUNSC_HOOKS})
    if skipped:
        return (f"{support.version} does not run the {', '.join(skipped)} that the GPU's CDI spec needs (runsc runs"
                f" only {', '.join(sorted(RUNSC_HOOKS))} hooks): {fallback}")
    return None


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def served_nodes(edits: Edits) -> list[DeviceNode]:
    return [node for node in edits.nodes if SERVED.match(node.path)]


def _host_node_problem(node: DeviceNode) -> str | None:
    """Why the host's node at ``node.path`` is not the device ``node`` names, or None."""
    try:
        found = cdi.node_numbers(node.path)
    except ValueError as err:
        return f"{err} on this host"
    want = (node.type, node.major, node.minor)
    if found != want:
        return (f"the host's {node.path} is device {found[0]} {found[1]}:{found[2]}, not {node.host_path}'s"
                f" {want[0]} {want[1]}:{want[2]}")
    return None


def others(edits: Edits) -> Edits:
    """What of ``edits`` the OCI config writer applies as it does for crun: the driver's files, hooks and
    groups. Not the nodes: under gVisor they are ``linux.devices`` entries (``add_devices``)."""
    return replace(edits, nodes=())


def add_devices(edits: Edits, config: dict[str, Any]) -> None:
    """Give a runsc bundle's ``config`` the nodes of ``edits`` that nvproxy serves, as ``linux.devices``
    entries that its device rules allow."""
    linux = config["linux"]
    devices = linux.setdefault("devices", [])
    rules = linux["resources"]["devices"]
    for node in served_nodes(edits):
        devices.append({"path": node.path, "type": node.type, "major": node.major, "minor": node.minor,
                        "fileMode": 0o666, "uid": 0, "gid": 0})
        rules.append({"allow": True, "type": node.type, "major": node.major, "minor": node.minor,
                      "access": node.permissions})
