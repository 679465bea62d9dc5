"""Host checks behind ``fanfold doctor``: one line each, with the fix for each failure."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..config import EngineConfig
from . import cgroups, idmap, setup, subids


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True
    """A failed required check means sandboxes cannot run."""


def _run(argv: list[str], timeout: float = 60) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        return 1, str(err)
    return done.returncode, (done.stdout + done.stderr).strip()


def check_root() -> Check:
    ok = setup.is_root()
    return Check("root", ok, "running as root" if ok else f"running as uid {os.geteuid()}", "run fanfold as root")


def check_namespaces() -> Check:
    needed = ["mnt", "pid", "net", "ipc", "uts"]
    missing = [ns for ns in needed if not Path(f"/proc/self/ns/{ns}").exists()]
    return Check("namespaces", not missing, "mount, pid, net, ipc, uts available" if not missing else f"missing {missing}",
                 "use a kernel built with namespaces")


def check_overlayfs() -> Check:
    text = Path("/proc/filesystems").read_text()
    ok = "overlay" in text
    return Check("overlayfs", ok, "overlay filesystem available" if ok else "overlay not in /proc/filesystems",
                 "run `modprobe overlay`")


def check_cgroups() -> Check:
    if cgroups.is_v2_only():
        return Check("cgroups", True, "cgroup v2 (unified)")
    roots = cgroups.v1_roots()
    missing = [c for c in ("memory", "pids", "cpu") if c not in roots]
    hybrid = setup.unified_controllers()
    if missing:
        return Check("cgroups", False, f"cgroup v1 lacks {missing}", "mount the missing v1 controllers")
    if hybrid:
        return Check("cgroups", False, f"controllers {hybrid} left on cgroup2 (hybrid mode, refused by crun)",
                     "run `fanfold doctor --fix` (mounts them as v1 hierarchies)")
    return Check("cgroups", True, "cgroup v1: memory, pids, cpu; none left on cgroup2")


def check_cgroup_attach() -> Check:
    """Whether cgroup2 is mounted with favordynmods: else each create waits ~10 ms for the kernel."""
    on = any("favordynmods" in setup.mount_options(root)[1] for root in cgroups.v2_roots())
    return Check("cgroup attach", on, "fast (cgroup2 favordynmods)" if on else
                 "each create waits ~10 ms for an RCU grace period (cgroup2 without favordynmods)",
                 "run `fanfold doctor --fix` (remounts cgroup2 with favordynmods; Linux 6.0+)", required=False)


def check_runtime(name: str) -> Check:
    path = shutil.which(name)
    if path is None:
        return Check(f"runtime {name}", False, "not installed", f"apt-get install {name}")
    code, out = _run([path, "--version"])
    return Check(f"runtime {name}", code == 0, out.splitlines()[0] if out else "no version", f"reinstall {name}")


RUNSC_MIN = 20240729
"""Older runsc (Debian 12's own, 20221219) fails ``statx`` with AT_NO_AUTOMOUNT: ``ls -l`` in a sandbox."""


def check_gvisor(required: bool) -> Check:
    """gVisor's runsc for ``runtime="runsc"``: optional unless that is the runtime chosen."""
    fix = "bash scripts/runsc.sh (installs runsc from bookworm-backports; Debian 12's own is too old)"
    path = shutil.which("runsc")
    if path is None:
        return Check("gVisor (runsc)", False, "not installed: runtime=runsc is unavailable", fix, required=required)
    code, out = _run([path, "--version"])
    match = re.search(r"version 0\.0~(\d{8})", out)
    if code != 0 or match is None or int(match.group(1)) < RUNSC_MIN:
        found = out.splitlines()[0] if out else "no version"
        return Check("gVisor (runsc)", False, f"{found}: runtime=runsc needs {RUNSC_MIN} or later", fix,
                     required=required)
    return Check("gVisor (runsc)", True, f"runsc {match.group(1)}")


def check_compiler() -> Check:
    ok = shutil.which("cc") is not None
    return Check("C compiler", ok, "cc present (builds the sandbox agent)" if ok else "no cc",
                 "apt-get install gcc libc6-dev")


def check_kernel() -> Check:
    release = os.uname().release
    major, minor = (int(x) for x in release.split(".")[:2])
    ok = (major, minor) >= (5, 6)
    return Check("kernel", ok, f"{release} (openat2, pidfd)" if ok else f"{release} is older than 5.6",
                 "use Linux 5.6 or newer")


def check_criu(criu: str | None = None) -> Check:
    """The CRIU that fanfold uses (``EngineConfig().criu``), not whichever ``criu`` is on PATH."""
    configured = criu or EngineConfig().criu
    fix = "run `bash scripts/criu.sh` (or `make setup`): builds CRIU >= 4.1"
    path = configured if "/" in configured else shutil.which(configured)
    if path is None or not os.access(path, os.X_OK):
        return Check("criu", False, f"{configured} not installed (needed for memory snapshots, fork and suspend)",
                     fix, required=False)
    _, version_out = _run([path, "--version"], timeout=10)
    version = next((line.split(":", 1)[1].strip() for line in version_out.splitlines()
                    if line.startswith("Version:")), "unknown version")
    code, out = _run([path, "check"])
    if code == 0 and "Looks good" in out:
        return Check("criu", True, f"{version} ({path}): looks good", required=False)
    tail = out.splitlines()[-1] if out else f"exit status {code}"
    return Check("criu", False, f"{version} ({path}): `criu check` failed: {tail}", fix, required=False)


def check_lazy_restore(criu: str | None = None) -> Check:
    """What lazy restore needs (userfaultfd, fanfold's page server patch), and whether the kernel
    tracks dirty pages (a fork's parent would then be frozen only while what changed is written)."""
    configured = criu or EngineConfig().criu
    path = configured if "/" in configured else shutil.which(configured)
    fix = "run `bash scripts/criu.sh`: it builds CRIU with scripts/criu/lazy-pages-*.patch"
    if path is None or not os.access(path, os.X_OK):
        return Check("lazy restore", False, "no CRIU", fix, required=False)
    code, out = _run([path, "check", "--feature", "uffd-noncoop"], timeout=10)
    if code != 0:
        return Check("lazy restore", False, f"this kernel's userfaultfd is not enough: {out.splitlines()[-1:]}",
                     "use Linux 4.18 or newer with CONFIG_USERFAULTFD, or FANFOLD_LAZY_RESTORE=0", required=False)
    try:
        patched = b"CRIU_LAZY_SHARED" in Path(path).read_bytes()  # on top of the on-demand patch
    except OSError:
        patched = False
    if not patched:
        return Check("lazy restore", False, f"{path} lacks fanfold's on-demand, shared page server", fix, required=False)
    dirty, _ = _run([path, "check", "--feature", "mem_dirty_track"], timeout=10)
    tracking = ("dirty tracking on" if dirty == 0 else
                "no dirty tracking (CONFIG_MEM_SOFT_DIRTY): a fork's parent stays frozen while every page is written")
    return Check("lazy restore", True, f"userfaultfd and the on-demand, shared page server; {tracking}", required=False)


def check_debootstrap() -> Check:
    ok = shutil.which("debootstrap") is not None
    return Check("debootstrap", ok, "present (debian:bookworm base)" if ok else "missing: only the host base works",
                 "apt-get install debootstrap", required=False)


def check_disks() -> Check:
    """What sandbox disks with quotas need: btrfs in the kernel, its tools, and loop devices."""
    missing = []
    if "btrfs" not in Path("/proc/filesystems").read_text():
        missing.append("btrfs in the kernel")
    if shutil.which("mkfs.btrfs") is None:
        missing.append("mkfs.btrfs")
    if not Path("/dev/loop-control").exists():
        missing.append("/dev/loop-control")
    return Check("disks", not missing, "btrfs with quotas (a disk_mb quota per sandbox)" if not missing else
                 f"missing {', '.join(missing)}: sandbox disks fall back to tmpfs, charged to memory",
                 "apt-get install btrfs-progs (and load the btrfs and loop modules)", required=False)


def check_image_tools() -> Check:
    """What pulling and importing images needs: skopeo and the containers-storage tool."""
    missing = [tool for tool in ("skopeo", "containers-storage") if shutil.which(tool) is None]
    return Check("image tools", not missing, "skopeo and containers-storage (pull, import)" if not missing else
                 f"missing {', '.join(missing)}: images come only from specs", "apt-get install skopeo containers-storage",
                 required=False)


def check_build_network() -> Check:
    """What isolated build steps need (``host.stepnet``): ip and nft."""
    missing = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    return Check("build network", not missing, "ip and nft (isolated build steps)"
                 if not missing else f"missing {', '.join(missing)}: only builds with network='host' run steps",
                 "apt-get install iproute2 nftables", required=False)


def check_uid_ranges(subuid: Path = subids.SUBUID, subgid: Path = subids.SUBGID) -> Check:
    """fanfold's entry in /etc/subuid and /etc/subgid, where sandboxes' user namespaces take their ranges."""
    found = subids.slots(subuid, subgid)
    if not found:
        detail = (f"no usable `{subids.NAME}` entry in both {subuid} and {subgid}: the engine adds one as it starts"
                  if found is None else f"the `{subids.NAME}` entries of {subuid} and {subgid} share no whole range")
        return Check("uid ranges", False, detail, "`fanfold doctor --fix` adds one", required=found is None)
    first = subids.LOWEST + found.start * idmap.RANGE
    return Check("uid ranges", True, f"{len(found)} ranges of {idmap.RANGE} ids from {first} ({subids.NAME} in"
                                     f" {subuid} and {subgid})")


def check_gpus() -> Check:
    """The GPUs sandboxes may get (``gpus=``): from a CDI spec, else the NVIDIA device nodes."""
    from ..config import EngineConfig
    from ..errors import HostNotReady
    from . import gpus

    cfg = EngineConfig()
    try:
        found = gpus.discover(cdi_dirs=cfg.gpu_cdi_dirs, cdi_kind=cfg.gpu_cdi_kind, dev_dir=cfg.gpu_dev_dir,
                              proc_dir=cfg.gpu_proc_dir, driver_dirs=cfg.gpu_driver_dirs)
    except HostNotReady as err:
        return Check("GPUs", False, str(err), "fix or remove the CDI spec it names", required=False)
    if not found.gpus:
        return Check("GPUs", False, f"none: {found.source}", "only on a host with NVIDIA GPUs and their driver;"
                     " `nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml` describes them", required=False)
    listed = ", ".join(f"{gpu.index}: {gpu.model} {gpu.id}" for gpu in found.gpus)
    return Check("GPUs", True, f"{len(found.gpus)} ({listed}), {found.source}, up to {cfg.gpu_shares} sandboxes each",
                 required=False)


def run_checks(runtime: str) -> list[Check]:
    return [
        check_root(), check_kernel(), check_namespaces(), check_overlayfs(), check_cgroups(), check_cgroup_attach(),
        check_runtime(runtime), check_compiler(), check_criu(), check_lazy_restore(), check_debootstrap(),
        check_disks(), check_image_tools(), check_build_network(), check_uid_ranges(), check_gvisor(runtime == "runsc"),
        check_gpus(),
    ]
