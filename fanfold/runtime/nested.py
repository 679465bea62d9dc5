"""Containers inside a sandbox (``CreateParams.nested``): what a sandbox needs for rootless podman.

Podman in a sandbox runs as the sandbox's root, which the sandbox's user namespace maps to its
own 65536 host uids; podman sees a user namespace and runs rootless, its containers in user
namespaces of their own within that range (``SUBIDS``). Each relaxation below is listed, with
its risk, in docs/security.md; nothing else about the sandbox changes (capabilities, limits,
network, ``no_new_privs``):

- seccomp (``seccomp.default_profile(nested=True)``): ``seccomp.NESTED_ALLOWED`` (new namespaces,
  mounts, ``pivot_root``) and ``clone`` with namespace flags;
- ``/proc`` is not masked or made read-only in parts (``UNMASKED``): the kernel lets a user
  namespace mount a new procfs, as each inner container needs, only where a procfs is already
  fully visible. The agent, PID 1, turns itself non-dumpable (``AGENT_FLAG``), so the sandbox's
  root cannot write its memory through ``/proc/1/mem``;
- ``/dev/fuse`` (fuse-overlayfs, podman's storage) and ``/dev/net/tun`` (slirp4netns, its
  default network), bound from nodes of fanfold's own (``device_nodes``): the host's are often
  root-only, and a user namespace cannot make its own;
- an empty read-only tmpfs on ``/sys/fs/cgroup``: crun reads the cgroup version there. Inner
  containers get no cgroups (``CONTAINERS_CONF``): the sandbox's own limits hold them all.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from ..errors import FileNotFoundInSandbox, HostNotReady
from ..host import safefs

UNMASKED = "/proc"
"""Masked and read-only paths under it are left as they are in a nested sandbox."""
AGENT_FLAG = "--undumpable"
DEVICES = (("fuse", "/dev/fuse", 10, 229), ("tun", "/dev/net/tun", 10, 200))
"""(node name under ``<state>/devices``, path in the sandbox, major, minor)."""

SUBIDS = "root:1:65535\n"
"""Every uid of the sandbox's range but root's own, for podman's inner user namespaces."""
POLICY = '{"default": [{"type": "insecureAcceptAnything"}]}\n'
CONTAINERS_CONF = """\
# Written by fanfold for a nested sandbox: the sandbox's cgroups and limits hold its containers.
[containers]
cgroups = "disabled"
# /proc/sys is the sandbox's; a sysctl of an inner container's own network is refused there.
default_sysctls = []
# The kernel keyring stays closed to sandboxes (seccomp): no session keyring per container.
keyring = false

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
FILES = (
    ("/etc/subuid", SUBIDS), ("/etc/subgid", SUBIDS),
    ("/etc/containers/policy.json", POLICY), ("/etc/containers/containers.conf", CONTAINERS_CONF),
)
"""What a nested sandbox gets in its root where its image has none (an image's own stay)."""


def device_nodes(state_dir: Path) -> Path:
    """``<state>/devices`` with the nodes of ``DEVICES``, readable and writable by all, in a
    directory only root may enter; made once. HostNotReady where nodes cannot work there."""
    folder = state_dir / "devices"
    folder.mkdir(mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    if os.statvfs(folder).f_flag & os.ST_NODEV:
        raise HostNotReady(f"{state_dir} is mounted nodev: device nodes for nested sandboxes cannot work there;"
                           " remount it without nodev or move the state dir")
    for name, _, major, minor in DEVICES:
        node = folder / name
        try:
            found = os.lstat(node)
        except FileNotFoundError:
            found = None
        if found is not None and (not stat.S_ISCHR(found.st_mode) or found.st_rdev != os.makedev(major, minor)):
            node.unlink()
            found = None
        if found is None:
            os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(node, 0o666)  # past the umask
    return folder


def apply(config: dict[str, Any], nodes: Path) -> None:
    """Edit an OCI config (``oci.oci_config``'s) for a nested sandbox."""
    linux = config["linux"]
    linux["maskedPaths"] = [p for p in linux["maskedPaths"] if not _under_proc(p)]
    linux["readonlyPaths"] = [p for p in linux["readonlyPaths"] if not _under_proc(p)]
    mounts = config["mounts"]
    for name, path, major, minor in DEVICES:
        mounts.append({"destination": path, "type": "bind", "source": str(nodes / name),
                       "options": ["bind", "nosuid", "rw"]})
        linux["resources"]["devices"].append({"allow": True, "type": "c", "major": major, "minor": minor,
                                              "access": "rw"})
    mounts.append({"destination": "/sys/fs/cgroup", "type": "tmpfs", "source": "tmpfs",
                   "options": ["nosuid", "noexec", "nodev", "ro", "mode=755", "size=4k"]})
    config["process"]["args"] = [config["process"]["args"][0], AGENT_FLAG, *config["process"]["args"][1:]]


def _under_proc(path: str) -> bool:
    return path == UNMASKED or path.startswith(UNMASKED + "/")


def write_files(rootfs: Path) -> None:
    """Add ``FILES`` to a sandbox's root where it lacks them (call as the sandbox's root: ``idmap.as_mapped_root``)."""
    root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for path, text in FILES:
            try:
                os.close(safefs.open_in(root_fd, path, os.O_PATH))
                continue
            except FileNotFoundInSandbox:
                pass
            safefs.makedirs(root_fd, os.path.dirname(path))
            safefs.write(root_fd, path, text.encode())
    finally:
        os.close(root_fd)
