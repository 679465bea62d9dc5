"""Seccomp profiles for sandboxes and build steps: ``default``, ``unconfined`` or a file.

The default is an allowlist: the syscalls of containers-common's profile (Debian's
``golang-github-containers-common``, the one podman uses, derived from Docker's) resolved for
the capabilities sandboxes hold and this host's architecture, then tightened to what Docker's
own default refuses and a sandbox of ours never needs: new namespaces (``unshare``, ``setns``,
``clone`` with namespace flags; ``clone3`` answers ENOSYS so libc falls back to ``clone``), the
kernel keyring, mounts of any API, ``bpf``, ``perf_event_open``, ``userfaultfd``, io_uring, the
kernel log, modules, kexec, reboot, swap and quotas. ``ptrace`` stays (debuggers in a sandbox
work), except of PID 1, fanfold's agent, which no ``ptrace``, ``process_vm_readv``/``writev`` or
``pidfd_open`` may name (its ``/proc/1/mem`` is masked, ``oci.MASKED``); in an image whose init is
systemd, PID 1 is systemd and the agent its child, not shielded (``runtime.systemd``). A non-dumpable agent
would do as much, but CRIU cannot checkpoint a restored one in a user namespace again.
A sandbox with containers inside gets namespaces and mounts back (``NESTED_ALLOWED``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import HostNotReady, InvalidRequest
from .container import CAPABILITIES

TEMPLATE = Path("/usr/share/containers/seccomp.json")
PROFILES = ("default", "unconfined")
DENIED = frozenset({
    "unshare", "setns", "keyctl", "add_key", "request_key", "mount", "umount", "umount2", "pivot_root",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "bpf",
    "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "syslog",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon",
    "swapoff", "quotactl", "quotactl_fd", "acct", "lookup_dcookie", "fanotify_init", "open_by_handle_at",
    "clone", "clone3", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open",
})
"""Refused outright; ``clone`` is allowed again below without namespace flags, and the calls
that name a process, unless they name PID 1."""
NESTED_ALLOWED = frozenset({
    "unshare", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "mount_setattr", "sethostname",
})
"""What a sandbox with containers inside (``CreateParams.nested``) is allowed beyond the default, with
``clone`` of namespace flags: what podman and crun need to make an inner container's namespaces, root
and hostname (the template allows the last three only with CAP_SYS_ADMIN, which sandboxes lack)."""
NAMES_A_PID = {"ptrace": 1, "process_vm_readv": 0, "process_vm_writev": 0, "pidfd_open": 0}
"""Which argument of each is the pid."""
CLONE_NAMESPACES = 0x7E020000
"""CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET."""
EPERM, ENOSYS = 1, 38
ARCHES = {
    "x86_64": ("amd64", ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]),
    "aarch64": ("arm64", ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"]),
}


def _not_pid_1(index: int) -> list[dict[str, Any]]:
    """Conditions, any of which lets an argument through unless its low 32 bits are 1: the kernel
    reads a pid as 32 bits, so "!= 1" on all 64 would let 0x100000001 name PID 1. Even values, or
    any of bits 1-31 set."""
    even = {"index": index, "value": 1, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}
    return [even] + [{"index": index, "value": 1 << bit, "valueTwo": 1 << bit, "op": "SCMP_CMP_MASKED_EQ"}
                     for bit in range(1, 32)]


def check(profile: str) -> str:
    """``profile`` as given, once it names a known profile or a readable JSON file; else InvalidRequest."""
    if profile in PROFILES:
        return profile
    if not isinstance(profile, str) or not profile.startswith("/"):
        raise InvalidRequest(f"seccomp must be 'default', 'unconfined' or an absolute path to a profile, got {profile!r}")
    bpf(profile)  # compiled now: a profile libseccomp refuses fails the create, before it queues
    return profile


def load(profile: str) -> dict[str, Any] | None:
    """The OCI ``linux.seccomp`` object for a profile name or file; None for ``unconfined``."""
    if profile == "unconfined":
        return None
    if profile == "default":
        return default_profile(platform.machine())
    try:
        data = json.loads(Path(profile).read_text())
    except (OSError, ValueError) as err:
        raise InvalidRequest(f"seccomp profile {profile} cannot be read as JSON: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("defaultAction"), str) \
            or not isinstance(data.get("syscalls", []), list):
        raise InvalidRequest(f"seccomp profile {profile} is not an OCI seccomp profile:"
                             " it needs a defaultAction and a syscalls list")
    return data


@lru_cache(maxsize=None)
def default_profile(machine: str, nested: bool = False) -> dict[str, Any]:
    """fanfold's default profile for ``machine`` (``platform.machine()``), from the template; with
    ``nested``, as a sandbox with containers inside needs it (``NESTED_ALLOWED``, ``clone`` of namespaces)."""
    if machine not in ARCHES:
        raise HostNotReady(f"no default seccomp profile for {machine}: pass seccomp='unconfined' or a profile file")
    arch, architectures = ARCHES[machine]
    try:
        template = json.loads(TEMPLATE.read_text())
    except (OSError, ValueError) as err:
        raise HostNotReady(f"the seccomp template {TEMPLATE} is missing or broken ({err}):"
                           " run `apt-get install golang-github-containers-common` (or `make setup`)") from None
    caps = set(CAPABILITIES)
    rules: list[dict[str, Any]] = []
    for rule in template["syscalls"]:
        includes, excludes = rule.get("includes") or {}, rule.get("excludes") or {}
        if includes.get("arches") and arch not in includes["arches"]:
            continue
        if includes.get("caps") and not caps.issuperset(includes["caps"]):
            continue
        if excludes.get("arches") and arch in excludes["arches"]:
            continue
        if excludes.get("caps") and caps.intersection(excludes["caps"]):
            continue
        # NESTED_ALLOWED are allowed by a rule of their own below (nested), or not at all.
        dropped = DENIED | NESTED_ALLOWED if rule["action"] == "SCMP_ACT_ALLOW" else NESTED_ALLOWED if nested else set()
        names = [n for n in rule["names"] if n not in dropped]
        if names:
            out = {"names": names, "action": rule["action"]}
            if rule.get("args"):
                out["args"] = rule["args"]
            if rule["action"] == "SCMP_ACT_ERRNO":
                out["errnoRet"] = rule.get("errnoRet") or EPERM
            rules.append(out)
    no_namespaces = [{"index": 1 if arch == "s390x" else 0, "value": CLONE_NAMESPACES, "valueTwo": 0,
                      "op": "SCMP_CMP_MASKED_EQ"}]
    if nested:
        rules.append({"names": sorted(NESTED_ALLOWED), "action": "SCMP_ACT_ALLOW"})
    rules += [
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW", **({} if nested else {"args": no_namespaces})},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
    ]
    rules += [{"names": [name], "action": "SCMP_ACT_ALLOW", "args": [arg]}
              for name, index in NAMES_A_PID.items() for arg in _not_pid_1(index)]
    return {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": EPERM, "architectures": architectures,
            "syscalls": rules}


# -- compiling: crun 1.8 compiles a profile with libseccomp on every start (~20 ms for the default);
# given the BPF program in the ``run.oci.seccomp_bpf_data`` annotation it loads it as it is.

BPF_ANNOTATION = "run.oci.seccomp_bpf_data"
_ACTIONS = {"SCMP_ACT_KILL": 0, "SCMP_ACT_KILL_THREAD": 0, "SCMP_ACT_KILL_PROCESS": 0x80000000,
            "SCMP_ACT_TRAP": 0x00030000, "SCMP_ACT_LOG": 0x7FFC0000, "SCMP_ACT_ALLOW": 0x7FFF0000}
_OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5,
        "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}
_ARCH_NAMES = {"SCMP_ARCH_X86_64": b"x86_64", "SCMP_ARCH_X86": b"x86", "SCMP_ARCH_X32": b"x32",
               "SCMP_ARCH_AARCH64": b"aarch64", "SCMP_ARCH_ARM": b"arm"}
_FLTATR_CTL_OPTIMIZE = 8
EACCES, EEXIST = 13, 17


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _action(name: str, errno_ret: int | None, default_errno: int) -> int:
    if name == "SCMP_ACT_ERRNO":
        return 0x00050000 | ((default_errno if errno_ret is None else errno_ret) & 0xFFFF)
    if name == "SCMP_ACT_TRACE":
        return 0x7FF00000 | ((errno_ret or 0) & 0xFFFF)
    if name not in _ACTIONS:
        raise InvalidRequest(f"seccomp action {name!r} is not supported: use one of {sorted(_ACTIONS)} or SCMP_ACT_ERRNO")
    return _ACTIONS[name]


def _compiled(text: str) -> str:
    try:
        return _compile(text)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise InvalidRequest(f"seccomp profile is not a valid OCI profile ({type(err).__name__}: {err}): each rule"
                             " needs names and an action, each arg an index, a value and an op") from None


@lru_cache(maxsize=8)
def _compile(text: str) -> str:
    import base64

    profile = json.loads(text)
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    default_errno = profile.get("defaultErrnoRet") or EPERM
    default = _action(profile["defaultAction"], profile.get("defaultErrnoRet"), default_errno)
    ctx = ctypes.c_void_p(lib.seccomp_init(ctypes.c_uint32(default)))
    if not ctx:
        raise InvalidRequest("libseccomp refused the profile's default action")
    fd = os.memfd_create("fanfold-seccomp", os.MFD_CLOEXEC)
    try:
        lib.seccomp_attr_set(ctx, _FLTATR_CTL_OPTIMIZE, ctypes.c_uint32(2))  # a binary tree: fewer checks per syscall
        for arch in profile.get("architectures") or ():
            token = lib.seccomp_arch_resolve_name(_ARCH_NAMES.get(arch, arch.lower().encode()))
            if token and lib.seccomp_arch_add(ctx, ctypes.c_uint32(token)) not in (0, -EEXIST):
                raise InvalidRequest(f"seccomp architecture {arch} is not supported here")
        for rule in profile.get("syscalls") or ():
            action = _action(rule["action"], rule.get("errnoRet"), default_errno)
            if action == default:
                continue  # libseccomp refuses a rule that repeats the default
            args = rule.get("args") or []
            cmps = (_ArgCmp * max(len(args), 1))(*[
                _ArgCmp(a["index"], _OPS[a["op"]], a.get("value", 0), a.get("valueTwo", 0)) for a in args])
            for name in rule["names"]:
                number = lib.seccomp_syscall_resolve_name(name.encode())
                if number < 0:
                    continue  # a syscall this host's headers do not know, as crun skips it
                rc = lib.seccomp_rule_add_array(ctx, ctypes.c_uint32(action), number, len(args), cmps)
                if rc < 0 and rc != -EACCES:
                    raise InvalidRequest(f"seccomp rule for {name} cannot be compiled (error {-rc})")
        if lib.seccomp_export_bpf(ctx, fd) < 0:
            raise InvalidRequest("libseccomp could not export the profile")
        return base64.b64encode(os.pread(fd, os.fstat(fd).st_size, 0)).decode()
    finally:
        os.close(fd)
        lib.seccomp_release(ctx)


def bpf(profile: str, *, nested: bool = False) -> str | None:
    """The named profile (see ``load``) as a BPF program in base64, for ``BPF_ANNOTATION``; None for
    ``unconfined``. Compiled once per profile (a file, once per content). ``nested`` relaxes the
    default profile for containers inside (a file or ``unconfined`` is taken as it is)."""
    if profile == "default":
        return _default_bpf(platform.machine(), nested)
    data = load(profile)
    return None if data is None else _compiled(json.dumps(data, sort_keys=True))


@lru_cache(maxsize=None)
def _default_bpf(machine: str, nested: bool = False) -> str:
    return _compiled(json.dumps(default_profile(machine, nested), sort_keys=True))
