"""A sandbox group's private network: a hub namespace with a bridge, and one veth per member.

The hub is a network namespace of its own, with no route anywhere else: only its members reach
each other there. It lives as long as its pin (the namespace bind-mounted on a file in the state
dir), which the group's owner removes on every path; an engine's start removes the pins of
groups that no longer exist. Every group uses the same subnet (``SUBNET``): hubs never meet, so
a forked group keeps its members' addresses.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import secrets
import subprocess
from pathlib import Path

from ..errors import InfrastructureError
from .netns import CLONE_NEWNET, _check, _libc, _lo_up, _on_a_thread

SUBNET = ipaddress.IPv4Network("10.250.0.0/24")
"""The members' addresses: the first member has .2, the next .3, and so on."""
BRIDGE = "ffgroup0"
MS_BIND, MNT_DETACH = 0x1000, 0x2
HOSTS_MARK = "# fanfold group"
"""Ends each /etc/hosts line a group wrote, so a later write replaces them and keeps the rest."""


def address(index: int) -> str:
    return str(SUBNET.network_address + 2 + index)


def make_hub(pin: Path) -> None:
    """A new hub namespace with its bridge up, pinned at ``pin`` (a file made here)."""
    pin.parent.mkdir(parents=True, exist_ok=True)
    pin.touch(mode=0o600)

    def work() -> None:
        _check(_libc.unshare(CLONE_NEWNET))
        _lo_up()
        # ip inherits this thread's network namespace (a child process takes its caller's)
        done = subprocess.run(["ip", "-batch", "-"], input=f"link add {BRIDGE} type bridge\nlink set {BRIDGE} up\n",
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise OSError(0, (done.stderr or done.stdout).strip()[-300:])
        _check(_libc.mount(b"/proc/thread-self/ns/net", os.fsencode(pin), None, MS_BIND, None))

    try:
        _on_a_thread(work, "making a group's network")
    except BaseException:
        pin.unlink(missing_ok=True)
        raise


def join(pin: Path, pid: int, index: int) -> None:
    """Give the sandbox whose PID 1 is ``pid`` an ``eth0`` on the hub at ``address(index)``."""
    hub_end = f"ffg{index}x{secrets.token_hex(3)}"  # unique: a member's old end may still be going away
    _ip(["nsenter", f"--net={pin}", "ip", "-batch", "-"],
        f"link add {hub_end} type veth peer name eth0 netns {pid}\nlink set {hub_end} master {BRIDGE}\n"
        f"link set {hub_end} up\n", f"joining sandbox process {pid} to its group's network")
    _ip(["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-batch", "-"],
        f"addr add {address(index)}/{SUBNET.prefixlen} dev eth0\nlink set eth0 up\n",
        f"addressing sandbox process {pid} on its group's network")


def release_hub(pin: Path) -> None:
    """Unpin a hub (its namespace, bridge and member ends go with the last reference); idempotent."""
    if _libc.umount2(os.fsencode(pin), MNT_DETACH) != 0 and ctypes.get_errno() not in (22, 2):  # EINVAL, ENOENT
        errno = ctypes.get_errno()
        raise InfrastructureError(f"unpinning the group network {pin} failed: {os.strerror(errno)}")
    pin.unlink(missing_ok=True)


def hosts_file(existing: str, names: dict[str, str]) -> str:
    """``existing`` /etc/hosts with the group's lines (name -> address) in place of any earlier ones."""
    kept = [line for line in existing.splitlines() if not line.endswith(HOSTS_MARK)]
    if not any(line.split()[:1] == ["127.0.0.1"] for line in kept):
        kept.insert(0, "127.0.0.1\tlocalhost")
    return "\n".join(kept + [f"{addr}\t{name}\t{HOSTS_MARK}" for name, addr in names.items()]) + "\n"


def _ip(argv: list[str], batch: str, what: str) -> None:
    try:
        done = subprocess.run(argv, input=batch, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise InfrastructureError(f"{what} failed: {err}") from None
    if done.returncode != 0:
        raise InfrastructureError(f"{what} failed: {(done.stderr or done.stdout).strip()[-300:]}")
