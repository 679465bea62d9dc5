"""systemd as a sandbox's init (an image labelled ``fanfold.init=systemd``): what the OCI backend adds.

The agent starts as PID 1 as always, binds its socket and waits for the host to lock the channel
dir; then PID 1 execs systemd and the agent goes on as its child (``agent --init``), so every
process still descends from PID 1 and CRIU takes the whole tree. The container gets what systemd
needs and, without CAP_SYS_ADMIN, cannot mount itself: a tmpfs on /run and /run/lock, a cgroup
namespace and the sandbox's own cgroup2 group mounted at /sys/fs/cgroup, delegated to the sandbox's
root (systemd keeps its units' processes in groups of their own below it), and ``container=fanfold``.
The image's services become units in /etc/systemd/system, enabled in multi-user.target: oneshots
one after another (each requires the one before), simple ones after the last oneshot, logging to
/var/log/fanfold/NAME.log as the agent's services do. ``wait_ready`` waits until systemd has
finished starting and reads how each unit went.

Resource limits, counters and the freezer stay on the sandbox's group: on a hybrid host systemd sees
only cgroup2, where no controller is enabled, and the v1 controllers keep every process in the
sandbox's group; cgroup2's freezer and a cgroup2-only host's limits hold for the groups below it.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

from .._agent.client import RawExec
from ..errors import FanfoldError, HostNotReady, InfrastructureError, InvalidRequest
from ..host import cgroups, safefs

INIT = "systemd"
"""The one init an image may ask for besides fanfold's agent."""
INIT_PATHS = ("/lib/systemd/systemd", "/usr/lib/systemd/systemd")
UNIT_DIR = "/etc/systemd/system"
WANTS_DIR = f"{UNIT_DIR}/multi-user.target.wants"
LOG_DIR = "/var/log/fanfold"
BOOT_TIMEOUT_S = 60.0
"""How long systemd may take to answer on its socket at all (it starts in well under a second)."""
DELEGATED = ("cgroup.procs", "cgroup.threads", "cgroup.subtree_control")
"""A delegated cgroup2 group's files its new owner writes (cgroup-v2.rst, "Delegation")."""


def check_init(init: str) -> str:
    """``init`` as an image may name it: ``""`` (fanfold's agent) or ``systemd``; else InvalidRequest."""
    if init not in ("", INIT):
        raise InvalidRequest(f"unknown init {init!r}: an image's init is fanfold's agent (no label) or 'systemd'")
    return init


def find_init(rootfs: Path) -> str:
    """The path of systemd in the sandbox's root; InvalidRequest naming what to install when it has none."""
    root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for path in INIT_PATHS:
            try:
                os.close(safefs.open_in(root, path, os.O_RDONLY))
                return path
            except (OSError, FanfoldError):
                continue
    finally:
        os.close(root)
    raise InvalidRequest(f"the image asks for systemd as init but has no {INIT_PATHS[0]}: install it in the image"
                         " (`apt-get install systemd` on Debian), or build on the `host` base")


# -- units ---------------------------------------------------------------------------------------


def _quoted(text: str, *, dollars: bool) -> str:
    """``text`` as one double-quoted word of a unit file: C escapes, ``%`` doubled (a specifier
    otherwise), and in a command line ``$`` doubled (systemd expands variables there)."""
    out = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t").replace("%", "%%")
    return f'"{out.replace("$", "$$") if dollars else out}"'


def unit_text(name: str, cmd: str, mode: str, env: tuple[str, ...], after: str | None) -> str:
    """The unit of one image service; ``after``: the oneshot it waits for and requires."""
    lines = ["[Unit]", f"Description=fanfold service {name}"]
    if after is not None:
        lines += [f"After={after}.service", f"Requires={after}.service"]
    lines += ["", "[Service]", f"Type={mode}"]
    if mode == "oneshot":
        lines.append("RemainAfterExit=yes")
    lines += [f"ExecStart=/bin/sh -c {_quoted(cmd, dollars=True)}", "WorkingDirectory=/"]
    lines += [f"Environment={_quoted(entry, dollars=False)}" for entry in env]
    lines += [f"StandardOutput=append:{LOG_DIR}/{name}.log", "StandardError=inherit",
              "", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)


def units(services: tuple[tuple[str, str, str], ...], env: tuple[str, ...]) -> dict[str, str]:
    """File name -> text of the unit of each service, in the agent's order: oneshots one after another
    in the order given, each simple one after the last oneshot."""
    out: dict[str, str] = {}
    last: str | None = None
    for name, cmd, mode in services:
        if mode == "oneshot":
            out[f"{name}.service"] = unit_text(name, cmd, mode, env, last)
            last = name
    for name, cmd, mode in services:
        if mode != "oneshot":
            out[f"{name}.service"] = unit_text(name, cmd, mode, env, last)
    return out


def write_units(rootfs: Path, services: tuple[tuple[str, str, str], ...], env: tuple[str, ...]) -> None:
    """Write and enable the services' units in the sandbox's root (the caller writes as its root), and
    give it a machine id of its own: without one systemd takes its start for a first boot and enables
    every unit its presets name (Debian's: all of them, the ``host`` base's whole /usr)."""
    root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        safefs.write(root, "/etc/machine-id", f"{uuid.uuid4().hex}\n".encode(), mode=0o444)
        for directory in (UNIT_DIR, WANTS_DIR, LOG_DIR):
            safefs.makedirs(root, directory)
        with safefs.opened(root, WANTS_DIR, os.O_PATH | os.O_DIRECTORY) as wants:
            for file_name, text in units(services, env).items():
                safefs.write(root, f"{UNIT_DIR}/{file_name}", text.encode())
                with safefs.translated(f"{WANTS_DIR}/{file_name}"):
                    try:
                        os.unlink(file_name, dir_fd=wants)
                    except FileNotFoundError:
                        pass
                    os.symlink(f"../{file_name}", file_name, dir_fd=wants)
    finally:
        os.close(root)


# -- the container ---------------------------------------------------------------------------------


def container_parts(namespaces: list[dict[str, Any]], mounts: list[dict[str, Any]], env: list[str]) -> None:
    """Add to an OCI config what systemd needs: its own cgroup namespace and cgroup2 mount, tmpfs on
    /run and /run/lock, ``container=``. /sys stays read-only but for the cgroup2 mount over it."""
    namespaces.append({"type": "cgroup"})
    mounts += [
        {"destination": "/run", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/run/lock", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "noexec", "strictatime", "mode=1777", "size=5120k"]},
        {"destination": "/sys/fs/cgroup", "type": "cgroup2", "source": "cgroup2",
         "options": ["nosuid", "nodev", "noexec", "rw"]},
    ]
    env.append("container=fanfold")


def unified_dir(parent: str, sandbox_id: str) -> Path:
    """The sandbox's cgroup2 group (the one systemd sees as its root)."""
    roots = (Path("/sys/fs/cgroup"),) if cgroups.is_v2_only() else cgroups.v2_roots()
    if not roots:
        raise HostNotReady("systemd as a sandbox's init needs cgroup2, which this host has not mounted:"
                           " boot it with the unified or hybrid cgroup layout")
    return roots[0] / parent / sandbox_id


def delegate(parent: str, sandbox_id: str, uid: int | None) -> None:
    """Give the sandbox's root its cgroup2 group and every group below it (a restore's are made by CRIU
    as the host's root), as a delegation does; ``uid`` None: the sandbox's root is the host's."""
    if uid is None:
        return
    top = unified_dir(parent, sandbox_id)
    for directory, subdirs, _ in os.walk(top):
        os.chown(directory, uid, uid)
        for name in DELEGATED:
            try:
                os.chown(os.path.join(directory, name), uid, uid)
            except FileNotFoundError:
                pass  # cgroup.threads: not in every kernel


# -- readiness -------------------------------------------------------------------------------------

Exec = Callable[[list[str]], Awaitable[RawExec]]


async def wait_ready(run: Exec, services: tuple[tuple[str, str, str], ...]) -> str:
    """``ok`` once systemd has finished starting (its oneshots done, its simple units started) and every
    oneshot unit succeeded, else ``fail NAME CODE`` for the first that did not, as the agent's ``w``
    answers. A simple unit that exits is left to ``systemctl status``, as the agent leaves it (whether it
    did so yet would be a race). ``run`` execs a command in the sandbox."""
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while True:
        # --wait: until the boot's jobs are done; before systemd listens it says "offline" at once
        done = await run(["systemctl", "is-system-running", "--wait"])
        if not done.started:
            raise InvalidRequest(f"the image asks for systemd as init but systemctl cannot run in it: {done.error}")
        state = done.stdout.decode(errors="replace").strip()
        if state not in ("", "offline", "unknown"):
            break
        if time.monotonic() > deadline:
            raise InfrastructureError(f"systemd did not answer within {BOOT_TIMEOUT_S:.0f} s of its start:"
                                      f" {done.stderr.decode(errors='replace').strip()[-300:] or state}")
        await asyncio.sleep(0.01)
    names = [name for name, _, mode in services if mode == "oneshot"]
    if not names:
        return "ok"
    shown = await run(["systemctl", "show", "--property=Id,ActiveState,Result,ExecMainCode,ExecMainStatus",
                       "--", *(f"{name}.service" for name in names)])
    states = _parse_show(shown.stdout.decode(errors="replace"))
    for name in names:
        unit = states.get(f"{name}.service", {})
        if unit.get("Result", "success") != "success" or unit.get("ActiveState") == "failed":
            return f"fail {name} {_exit_code(unit)}"
    return "ok"


def _parse_show(text: str) -> dict[str, dict[str, str]]:
    """``systemctl show``'s blocks (one per unit, blank-line separated) by unit name."""
    out: dict[str, dict[str, str]] = {}
    for block in text.strip().split("\n\n"):
        fields = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if "Id" in fields:
            out[fields["Id"]] = fields
    return out


def _exit_code(unit: dict[str, str]) -> int:
    """The unit's main process's exit code, 128+N when signal N killed it (as a shell says)."""
    status = int(unit.get("ExecMainStatus", "1") or 1)
    killed = unit.get("ExecMainCode") in ("2", "3")  # CLD_KILLED, CLD_DUMPED
    return 128 + status if killed else status or 1


def agent_pid(init_pid: int, agent_path: str) -> int:
    """The agent's host pid: PID 1, or where systemd is PID 1, its child running ``agent_path``."""
    if _argv0(init_pid) == agent_path:
        return init_pid
    try:
        children = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
    except OSError:
        return init_pid
    return next((int(child) for child in children if _argv0(int(child)) == agent_path), init_pid)


def _argv0(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return ""
