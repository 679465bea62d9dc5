"""OCI runtimes (crun, runc) driven through their command line."""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import HostNotReady, InfrastructureError
from ..host import cgroups, procs, setup
from ..host.cdi import Edits
from ..host.idmap import RANGE as USERNS_RANGE
from ..host.offload import to_the_end
from ..host.spawn import Finished, log_tail, run, settle, start_logged, wait_logged
from . import nested, seccomp, systemd
from .container import CAPABILITIES, ContainerSpec

MASKED = [
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
    "/proc/1/mem", "/proc/1/task/1/mem",  # PID 1 is fanfold's agent: see seccomp's NAMES_A_PID
]
READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]


# What crun and runc take for a copy of themselves a container cannot overwrite (CVE-2019-5736).
RUNTIME_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


@lru_cache(maxsize=None)
def sealed_copy(binary: str) -> str:
    """A path that executes a sealed in-memory copy of ``binary``, made once per process.

    Started from its installed file, crun (as runc) protects the host binary by copying
    itself to a sealed file and executing itself again, loading its eleven libraries a
    second time, on every call: ~4 ms of CPU a sandbox. Started from a copy already sealed,
    it runs at once, and the container still cannot write to the binary it runs from.
    The descriptor lives as long as this process and is closed on exec.
    """
    fd = os.memfd_create(f"fanfold-{Path(binary).name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(binary, "rb") as source:
            data = source.read()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, RUNTIME_SEALS)
    except BaseException:
        os.close(fd)
        raise
    setup.RUNTIME_NAMES.add(str(fd))  # the kernel names a process after the file it runs: here, the fd's number
    return f"/proc/self/fd/{fd}"


def oci_config(spec: ContainerSpec) -> dict[str, Any]:
    """The OCI ``config.json`` for one sandbox or build step."""
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    if not spec.host_network:  # joins the namespace given, else has a new one made
        namespaces.append({"type": "network"} if spec.netns is None else {"type": "network", "path": spec.netns})
    resources: dict[str, Any] = {"devices": [{"allow": False, "access": "rwm"}]}
    if spec.limits is not None:
        memory = spec.limits.memory_mb * 1024 * 1024
        resources["memory"] = {"limit": memory, "swap": memory}
        resources["cpu"] = {"quota": int(spec.limits.cpus * 100_000), "period": 100_000}
        resources["pids"] = {"limit": spec.limits.pids}
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
    ]
    for bind in spec.binds:
        options = ["rbind", "nosuid", "nodev"] + (["ro"] if bind.readonly else ["rw"])
        mounts.append({"destination": bind.destination, "type": "bind", "source": bind.source, "options": options})
    linux: dict[str, Any] = {
        "namespaces": namespaces, "resources": resources, "maskedPaths": MASKED, "readonlyPaths": READONLY,
    }
    if spec.cgroup_path:
        linux["cgroupsPath"] = spec.cgroup_path
    if spec.uid_base is not None:
        namespaces.append({"type": "user"} if spec.userns_path is None else {"type": "user", "path": spec.userns_path})
        mapping = [{"containerID": 0, "hostID": spec.uid_base, "size": USERNS_RANGE}]
        linux["uidMappings"] = linux["gidMappings"] = mapping
    env = list(spec.env)
    if spec.systemd:
        systemd.container_parts(namespaces, mounts, env)
    hooks = {} if spec.devices is None else apply_devices(spec.devices, mounts, resources)
    annotations = {} if spec.seccomp_bpf is None else {seccomp.BPF_ANNOTATION: spec.seccomp_bpf}
    process_extra = {} if spec.oom_score_adj is None else {"oomScoreAdj": spec.oom_score_adj}
    user: dict[str, Any] = {"uid": spec.user.uid, "gid": spec.user.gid}
    gids = list(spec.user.additional_gids) + list(spec.devices.groups if spec.devices is not None else ())
    if gids:
        user["additionalGids"] = gids
    config: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False, "user": user, "args": spec.args, "env": env, "cwd": spec.cwd,
            "capabilities": {k: CAPABILITIES for k in ("bounding", "effective", "permitted")},
            "noNewPrivileges": True, **process_extra,
        },
        "root": {"path": str(spec.rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": mounts,
        "linux": linux,
        "annotations": annotations,
        **({"hooks": hooks} if hooks else {}),
    }
    if spec.nested_nodes is not None:
        nested.apply(config, spec.nested_nodes)
    return config


def apply_devices(devices: Edits, mounts: list[dict[str, Any]],
                  resources: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Add ``devices``' nodes and files to a config's mounts and device rules; return its hooks.

    Each node is bound in from the host (a container in a user namespace cannot make one) without
    ``nodev``, and its device rule lets it be opened. The edits' variables are the engine's to put
    in the processes' environments (``SandboxSpec.env``)."""
    for node in devices.nodes:
        mounts.append({"destination": node.path, "type": "bind", "source": node.host_path,
                       "options": ["bind", "nosuid", "rw" if "w" in node.permissions else "ro"]})
        resources["devices"].append({"allow": True, "type": node.type, "major": node.major, "minor": node.minor,
                                     "access": node.permissions})
    for mount in devices.mounts:
        options = list(mount.options)
        if "bind" not in options and "rbind" not in options:
            options.append("rbind")
        mounts.append({"destination": mount.container_path, "type": "bind", "source": mount.host_path,
                       "options": options})
    hooks: dict[str, list[dict[str, Any]]] = {}
    for hook in devices.hooks:
        entry: dict[str, Any] = {"path": hook.path, "args": list(hook.args) or [hook.path]}
        if hook.env:
            entry["env"] = list(hook.env)
        if hook.timeout is not None:
            entry["timeout"] = hook.timeout
        hooks.setdefault(hook.hook_name, []).append(entry)
    return hooks


class OciRuntime:
    """crun or runc, each sandbox a container in a runtime root of our own."""

    def __init__(self, *, binary: str | None, state_root: str) -> None:
        self.name = binary or "crun"
        self.root = Path(state_root)
        path = shutil.which(self.name)
        if path is None:
            raise HostNotReady(f"OCI runtime {self.name!r} is not installed: run `apt-get install {self.name}`")
        self.binary = path

    def _argv(self, *args: str) -> list[str]:
        return [sealed_copy(self.binary), "--root", str(self.root), *args]

    def prepare(self, spec: ContainerSpec, bundle: Path) -> None:
        bundle.mkdir(parents=True, exist_ok=True)
        (bundle / "config.json").write_text(json.dumps(oci_config(spec)))

    def launch(self, spec: ContainerSpec, bundle: Path, pass_fd: int) -> int:
        self.prepare(spec, bundle)
        argv = self._argv("run", "--detach", "--preserve-fds", "1", "--pid-file", str(bundle / "pid"),
                          "--bundle", str(bundle), spec.id)
        return start_logged(argv, fds={3: pass_fd}, log=str(bundle / "runtime.log"))

    async def started(self, container_id: str, bundle: Path, launched: int) -> int:
        done = await wait_logged(launched, timeout=60)
        if done.returncode != 0:
            raise InfrastructureError(
                f"{self.name} could not start sandbox {container_id}: {log_tail(bundle / 'runtime.log')}")
        return int(procs.read_small(str(bundle / "pid")))

    def abandon(self, launched: int) -> None:
        settle(launched, timeout=60)

    async def run(self, spec: ContainerSpec, bundle: Path, timeout: float | None = None) -> Finished:
        spec = dataclasses.replace(spec, cgroup_path=spec.cgroup_path or f"/{spec.id}")  # the runtime's default
        self.prepare(spec, bundle)
        try:
            return await run(self._argv("run", "--bundle", str(bundle), spec.id), timeout=timeout)
        finally:
            # Killing `run` (a cancelled build) leaves its container's processes running: `delete` ends
            # them. A runtime killed before it recorded the container leaves nothing `delete` can find,
            # while the container's process may already run the step: its cgroup still holds it.
            await to_the_end(self.delete(spec.id))
            await to_the_end(asyncio.to_thread(cgroups.remove_group, spec.cgroup_path))

    def forget(self, sandbox_id: str) -> None:
        # What `delete --force` would do after its own kill, without spawning the
        # runtime (~6 ms of CPU a sandbox): the engine removes the cgroups itself.
        shutil.rmtree(self.root / sandbox_id, ignore_errors=True)

    async def delete(self, sandbox_id: str, *, stopped: bool = False) -> None:
        state = self.root / sandbox_id
        if stopped:
            self.forget(sandbox_id)
        if not state.exists():
            return
        done = await run(self._argv("delete", "--force", sandbox_id), timeout=60)
        if done.returncode != 0 and state.exists():
            if not (state / "config.json").exists():
                # A runtime killed mid-create leaves a state it cannot load itself, nor ever delete:
                # it started nothing the engine's cgroup release does not end, so its state just goes.
                shutil.rmtree(state, ignore_errors=True)
                return
            raise InfrastructureError(f"{self.name} could not delete {sandbox_id}: {done.stderr.decode()[-500:]}")

    async def list_ids(self) -> set[str]:
        if not self.root.is_dir():
            return set()
        return {p.name for p in self.root.iterdir() if p.is_dir()}
