"""User namespaces for sandboxes: a host uid range per sandbox, and layers idmapped into it.

Root in a sandbox is host uid ``base`` (its whole range is ``base .. base+65535``), a range no
other live sandbox on this host has: ``claim`` takes the lowest free slot of those fanfold's
entry in /etc/subuid and /etc/subgid allows (``subids``), host-wide (engines of every state dir
share ``CLAIMS``), as two symlinks (``sweep`` removes what a crash between them leaves). The
layers stay as they are on disk (owned by uid 0, shared by every sandbox): each gets an idmapped clone
(``open_tree`` + ``mount_setattr(MOUNT_ATTR_IDMAP)``) through a user namespace with the
sandbox's mapping, and the overlay is mounted over the clones by a thread whose fsuid is the
range's root, so what the sandbox writes lands on disk as uid 0 again: snapshot layers fit
any range. Host-side writes into a sandbox's root go through ``as_mapped_root`` for the same
reason (host uid 0 has no mapping there: EOVERFLOW).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import platform
import signal
import subprocess
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterator

from ..errors import HostNotReady, InfrastructureError

RANGE = 65536
FIRST_SLOT = 16
"""Slot s maps to host uids (s) * RANGE ..: the first 16 ranges (uids below 1048576) stay the host's."""
SLOTS = (1 << 32) // RANGE - FIRST_SLOT - 1
ALL_SLOTS = range(SLOTS)
CLAIMS = Path("/run/fanfold/uids")
HALF_CLAIM_AGE_S = 60.0
"""A half claim (a crash's) this old is swept: younger ones may be an older engine's claim in flight."""
NAMESPACES_KEPT = 256
"""User namespaces kept open (one fd each) for the idmaps of the slots used last."""

_SYSCALLS = {"x86_64": (428, 429, 442, 122, 123, 157), "aarch64": (428, 429, 442, 151, 152, 167)}
"""open_tree, move_mount, mount_setattr, setfsuid, setfsgid, prctl: called raw, per thread."""
AT_FDCWD, AT_EMPTY_PATH = -100, 0x1000
OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH = 1, 0x4
MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_IDMAP = 0x2, 0x4, 0x100000
PR_GET_SECUREBITS, PR_SET_SECUREBITS, SECBIT_NO_SETUID_FIXUP = 27, 28, 0x4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _numbers() -> tuple[int, int, int, int, int, int]:
    found = _SYSCALLS.get(platform.machine())
    if found is None:
        raise HostNotReady(f"user namespaces for sandboxes are not wired up for {platform.machine()}:"
                           " set FANFOLD_USERNS=0")
    return found


def _check(rc: int, what: str) -> int:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return rc


# -- ranges -----------------------------------------------------------------------------------


def base_of_slot(slot: int) -> int:
    return (slot + FIRST_SLOT) * RANGE


def claim(sandbox_id: str, slots: range = ALL_SLOTS, claims: Path = CLAIMS) -> int:
    """Take the lowest free range of ``slots`` for ``sandbox_id``; its base (host uid of the sandbox's root).

    Its ``by-id`` link goes first, then the slot's, under the claims' lock: a crash between leaves
    a ``by-id`` link that the sandbox's own ``release`` removes, and ``sweep`` too; no sweep sees
    a claim half made by a live engine."""
    by_id = claims / "by-id"
    by_id.mkdir(parents=True, exist_ok=True)
    mine = by_id / sandbox_id
    with _locked(claims):
        taken = {int(n) for n in os.listdir(claims) if n.isdigit()}
        for slot in slots:
            if slot in taken:
                continue
            try:
                os.symlink(str(slot), mine)
            except FileExistsError:
                raise InfrastructureError(f"sandbox {sandbox_id} already holds a uid range") from None
            try:
                os.symlink(sandbox_id, claims / str(slot))  # atomic: the host-wide claim
            except FileExistsError:
                os.unlink(mine)
                continue  # an engine of an older version, which takes no lock, took it meanwhile
            return base_of_slot(slot)
    raise InfrastructureError(f"every one of the {len(slots)} uid ranges fanfold may use is taken by a live sandbox:"
                              " kill some, or give fanfold's entry in /etc/subuid and /etc/subgid more")


def base_of(sandbox_id: str, claims: Path = CLAIMS) -> int | None:
    """The base of the range ``sandbox_id`` holds, or None when it holds none."""
    try:
        return base_of_slot(int(os.readlink(claims / "by-id" / sandbox_id)))
    except (OSError, ValueError):
        return None


def release(sandbox_id: str, claims: Path = CLAIMS) -> None:
    """Give back the range of ``sandbox_id``, or what a crash left of its claim; idempotent."""
    link = claims / "by-id" / sandbox_id
    try:
        slot = os.readlink(link)
    except OSError:
        return
    with contextlib.suppress(OSError):
        if os.readlink(claims / slot) == sandbox_id:
            os.unlink(claims / slot)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(link)


def sweep(claims: Path = CLAIMS, min_age: float = HALF_CLAIM_AGE_S) -> int:
    """Remove half claims older than ``min_age`` seconds, host-wide: a slot's link whose sandbox's
    ``by-id`` link does not name it back, and a ``by-id`` link whose slot is not its sandbox's (what
    a crash between a claim's two links leaves). The age spares engines of older versions, which
    claim without the lock, slot first. Returns how many links went."""
    if not claims.is_dir():
        return 0
    with _locked(claims):
        slots, owners = _links(claims), _links(claims / "by-id")
        old = time.time() - min_age
        stale = [claims / slot for slot, owner in slots.items() if slot.isdigit() and owners.get(owner) != slot]
        stale += [claims / "by-id" / owner for owner, slot in owners.items() if slots.get(slot) != owner]
        removed = 0
        for link in stale:
            with contextlib.suppress(FileNotFoundError):  # a release took it meanwhile
                if os.lstat(link).st_mtime < old:
                    os.unlink(link)
                    removed += 1
        return removed


def _links(folder: Path) -> dict[str, str]:
    """Each symlink in ``folder`` and what it points to."""
    found = {}
    for name in os.listdir(folder) if folder.is_dir() else ():
        with contextlib.suppress(OSError):  # not a link, or gone meanwhile
            found[name] = os.readlink(folder / name)
    return found


@contextlib.contextmanager
def _locked(claims: Path) -> Iterator[None]:
    """Claims and sweeps one at a time, host-wide (a release needs no lock: it removes only its own)."""
    claims.mkdir(parents=True, exist_ok=True)
    fd = os.open(claims / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def claimed() -> set[str]:
    """Sandbox ids holding a range, on this host."""
    try:
        return set(os.listdir(CLAIMS / "by-id"))
    except FileNotFoundError:
        return set()


# -- user namespaces --------------------------------------------------------------------------


class Namespaces:
    """User namespaces mapping 0..RANGE-1 to a base, one fd each, made once (~5 ms) and kept: for
    the idmaps, and for crun to join. The sandboxes that hold a range one after another share its
    namespace; none of them outlives its sandbox but the kernel keyring, which seccomp closes."""

    def __init__(self, kept: int = NAMESPACES_KEPT, slots: range = ALL_SLOTS) -> None:
        self.slots = slots
        """The slots sandboxes may claim (``subids``: fanfold's entry in /etc/subuid)."""
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._kept = kept
        self._lock = threading.Lock()

    def fd(self, base: int) -> int:
        """An fd of a user namespace for ``base``: valid until ``close`` (or ``kept`` other bases later)."""
        with self._lock:
            if base in self._fds:
                self._fds.move_to_end(base)
                return self._fds[base]
        made = _new_userns(base)
        with self._lock:
            if base in self._fds:  # another thread made one meanwhile
                os.close(made)
                return self._fds[base]
            self._fds[base] = made
            while len(self._fds) > self._kept:
                os.close(self._fds.popitem(last=False)[1])
            return made

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _new_userns(base: int) -> int:
    """A user namespace fd with the range at ``base``: a child that unshares one waits while its
    maps are written from here; its namespace outlives it through the fd."""
    mine = os.readlink("/proc/self/ns/user")
    child = subprocess.Popen(["unshare", "--user", "--", "sleep", "60"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, close_fds=True,
                             preexec_fn=_die_with_parent(os.getpid()))
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if os.readlink(f"/proc/{child.pid}/ns/user") != mine and _exe_is_sleep(child.pid):
                    break
            except OSError:
                pass
            if child.poll() is not None:
                raise HostNotReady(f"unshare --user failed: {child.stderr.read().decode()[-300:] if child.stderr else ''}"
                                   " (set FANFOLD_USERNS=0 to run sandboxes without user namespaces)")
            if time.monotonic() > deadline:
                raise InfrastructureError("a helper process for a user namespace did not start within 10 s")
            time.sleep(0.0005)
        mapping = f"0 {base} {RANGE}\n".encode()
        for name in ("uid_map", "gid_map"):
            fd = os.open(f"/proc/{child.pid}/{name}", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, mapping)
            finally:
                os.close(fd)
        return os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGKILL)
        child.wait()
        if child.stderr is not None:
            child.stderr.close()


def _die_with_parent(parent: int) -> Callable[[], None]:
    """For a helper child: SIGKILL when the thread that started it dies (an engine killed while
    making a namespace leaves no ``sleep`` behind)."""
    def arm() -> None:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)  # died before the signal was armed
    return arm


PR_SET_PDEATHSIG = 1


def _exe_is_sleep(pid: int) -> bool:
    """Whether ``pid`` has exec'd ``sleep``: by then it has unshared, and its maps may be written."""
    try:
        return os.readlink(f"/proc/{pid}/exe").endswith("/sleep")
    except OSError:
        return False


# -- idmapped mounts --------------------------------------------------------------------------


def idmapped_bind(source: Path, target: Path, userns: int) -> None:
    """Mount an idmapped clone of the mount at ``source`` (or the subtree there) on ``target``,
    nosuid and nodev; the sandbox's root tmpfs holds it, so its lazy unmount takes the clone too."""
    open_tree, move_mount, mount_setattr, _, _, _ = _numbers()
    fd = _check(_libc.syscall(open_tree, AT_FDCWD, str(source).encode(), OPEN_TREE_CLONE | os.O_CLOEXEC),
                f"open_tree {source}")
    try:
        attr = _MountAttr(attr_set=MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, userns_fd=userns)
        _check(_libc.syscall(mount_setattr, fd, b"", AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)),
               f"idmapping {source}")
        _check(_libc.syscall(move_mount, fd, b"", AT_FDCWD, str(target).encode(), MOVE_MOUNT_F_EMPTY_PATH),
               f"mounting the idmapped {source} on {target}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def as_mapped_root(base: int | None) -> Iterator[None]:
    """Within it, this thread creates files (and mounts overlays) as host uid ``base``: through an
    idmapped mount they land as uid 0. Capabilities are kept; a no-op for ``base`` None."""
    if base is None:
        yield
        return
    _, _, _, setfsuid, setfsgid, prctl = _numbers()
    bits = _check(_libc.syscall(prctl, PR_GET_SECUREBITS), "reading securebits")
    _check(_libc.syscall(prctl, PR_SET_SECUREBITS, bits | SECBIT_NO_SETUID_FIXUP), "setting securebits")
    try:
        _libc.syscall(setfsgid, base)
        _libc.syscall(setfsuid, base)
        if _libc.syscall(setfsuid, -1) != base:  # setfsuid answers the previous value, never an error
            raise InfrastructureError(f"could not take fsuid {base} for writes into a sandbox")
        yield
    finally:
        _libc.syscall(setfsuid, 0)
        _libc.syscall(setfsgid, 0)
        _libc.syscall(prctl, PR_SET_SECUREBITS, bits)
