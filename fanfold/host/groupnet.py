"""A sandbox group's private network: a hub namespace with a bridge, and one veth per member.

The hub is a network namespace of its own, with no route anywhere else: only its members reach
each other there. It lives as long as its pin (the namespace bind-mounted on a file in the state
dir), which the group's owner removes on every path; an engine's start removes the pins of
groups that no longer exist. Every group uses the same subnet (``SUBNET``): hubs never meet, so
a forked group keeps its members' addresses.
"""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import os
import secrets
import socket
import struct
import subprocess
from pathlib import Path

from ..errors import InfrastructureError
from .netns import (
    CLONE_NEWNET, IFF_UP, SIOCGIFFLAGS, SIOCSIFADDR, SIOCSIFFLAGS, SIOCSIFNETMASK, _check, _libc, _lo_up, _on_a_thread,
    route_via_lo,
)

SUBNET = ipaddress.IPv4Network("10.250.0.0/24")
"""The members' addresses: the first member has .2, the next .3, and so on."""
BRIDGE = "ffgroup0"
MS_BIND, MNT_DETACH = 0x1000, 0x2
NETLINK_ROUTE, RTM_NEWLINK, NLMSG_ERROR = 0, 16, 2
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
IFLA_IFNAME, IFLA_MASTER, IFLA_LINKINFO, IFLA_NET_NS_PID = 3, 10, 18, 19
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
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
        _ip_here(f"link add {BRIDGE} type bridge\nlink set {BRIDGE} up\n")  # ip runs in this thread's namespace
        _check(_libc.mount(b"/proc/thread-self/ns/net", os.fsencode(pin), None, MS_BIND, None))

    try:
        _on_a_thread(work, "making a group's network")
    except BaseException:
        pin.unlink(missing_ok=True)
        raise


def join(pin: Path, pid: int, index: int) -> None:
    """Give the sandbox whose PID 1 is ``pid`` an ``eth0`` on the hub at ``address(index)``.

    One thread, no process: in the hub, netlink makes a veth pair whose far end is born in the
    sandbox's namespace (moving an existing end there costs a kernel grace period, ~15 ms); in the
    sandbox's namespace, ioctls address it and bring it up."""

    def work() -> None:
        _enter_file(pin)
        bridge = socket.if_nametoindex(BRIDGE)
        hub_end = f"ffg{index}x{secrets.token_hex(2)}"  # an earlier life's end may still be going away
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE) as link:
            _new_veth(link, hub_end.encode(), bridge, pid)
        _enter_file(f"/proc/{pid}/ns/net")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            route_via_lo(sock, SUBNET, add=False)  # a restore's stand-ins (``restore_address``), if any
            _drop_alias(sock, b"lo:0")
            _ioctl_addr(sock, SIOCSIFADDR, address(index))
            _ioctl_addr(sock, SIOCSIFNETMASK, str(SUBNET.netmask))
            _up(sock, b"eth0")

    _on_a_thread(work, f"joining sandbox process {pid} to its group's network")


def _new_veth(link: socket.socket, hub_end: bytes, bridge: int, pid: int) -> None:
    """RTM_NEWLINK: veth ``hub_end`` (up, on ``bridge``) whose peer ``eth0`` is made in the namespace of ``pid``."""
    peer = _ifinfo(0) + _attr(IFLA_IFNAME, b"eth0\0") + _attr(IFLA_NET_NS_PID, struct.pack("I", pid))
    info = _attr(IFLA_INFO_KIND, b"veth\0") + _attr(IFLA_INFO_DATA, _attr(VETH_INFO_PEER, peer))
    body = _ifinfo(IFF_UP) + _attr(IFLA_IFNAME, hub_end + b"\0") + _attr(IFLA_MASTER, struct.pack("I", bridge)) \
        + _attr(IFLA_LINKINFO, info)
    flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
    link.send(struct.pack("IHHII", 16 + len(body), RTM_NEWLINK, flags, 1, 0) + body)
    reply = link.recv(4096)
    kind, = struct.unpack_from("H", reply, 4)
    error, = struct.unpack_from("i", reply, 16) if kind == NLMSG_ERROR else (0,)
    if error:
        raise OSError(-error, os.strerror(-error))


def _ifinfo(flags: int) -> bytes:
    return struct.pack("BxHiII", socket.AF_UNSPEC, 0, 0, flags, flags)


def _ip_here(batch: str) -> None:
    done = subprocess.run(["ip", "-batch", "-"], input=batch, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise OSError(0, (done.stderr or done.stdout).strip()[-300:])


def _enter_file(path: str | Path) -> None:
    target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(target, CLONE_NEWNET))
    finally:
        os.close(target)


def _attr(kind: int, data: bytes) -> bytes:
    return struct.pack("HH", 4 + len(data), kind) + data + b"\0" * (-len(data) % 4)


def _ioctl_addr(sock: socket.socket, request: int, value: str) -> None:
    sockaddr = struct.pack("HH4s8x", socket.AF_INET, 0, socket.inet_aton(value))
    fcntl.ioctl(sock, request, struct.pack("16s", b"eth0") + sockaddr)


def hold_traffic(pin: Path, held: bool) -> None:
    """Stop (``held``) or restart the traffic between a group's members: its bridge down forwards nothing,
    so while the members are checkpointed one after another, no connection between them moves on."""

    def work() -> None:
        _enter_file(pin)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack("16sH", BRIDGE.encode(), 0))[:18])[1]
            flags = flags & ~IFF_UP if held else flags | IFF_UP
            fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", BRIDGE.encode(), flags))

    _on_a_thread(work, "holding a group's traffic" if held else "letting a group's traffic go")


def restore_address(index: int) -> str:
    """What a restore stands in for member ``index``'s address until it rejoins (``netns.alias_lo``): its
    address, and its group's network routed to lo."""
    return f"{address(index)}/{SUBNET.prefixlen}"


def _drop_alias(sock: socket.socket, name: bytes) -> None:
    """Take an IPv4 alias (and its address and prefix route) away by bringing it down; none: nothing to do."""
    try:
        flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack("16sH", name, 0))[:18])[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", name, flags & ~IFF_UP))
    except OSError:
        pass


def _up(sock: socket.socket, name: bytes) -> None:
    flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack("16sH", name, 0))[:18])[1]
    fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", name, flags | IFF_UP))


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
