"""Fresh network namespaces with loopback up, made in-process for restored sandboxes."""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading

from ..errors import InfrastructureError

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def new_netns() -> int:
    """An fd of a new network namespace whose only device, lo, is up.

    Made in a short-lived thread, since a thread may switch network namespace alone: the
    thread unshares, keeps an fd, raises lo, and ends (so nothing else of ours ever runs
    in the new namespace, even if switching back failed).
    """
    result: dict[str, int | str] = {}

    def work() -> None:
        host = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _libc.unshare(CLONE_NEWNET) != 0:
                result["error"] = os.strerror(ctypes.get_errno())
                return
            result["fd"] = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            _lo_up()
            _libc.setns(host, CLONE_NEWNET)
        except OSError as err:
            result["error"] = str(err)
        finally:
            os.close(host)

    thread = threading.Thread(target=work, name="fanfold-netns")
    thread.start()
    thread.join()
    if "error" in result:
        if "fd" in result:
            os.close(int(result["fd"]))
        raise InfrastructureError(f"making a network namespace failed: {result['error']}")
    return int(result["fd"])


def _lo_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0))[:18])[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def raise_lo(pid: int) -> None:
    """Bring lo up in the network namespace of ``pid``, from a short-lived thread of ours."""
    result: dict[str, str] = {}

    def work() -> None:
        try:
            target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            result["error"] = str(err)
            return
        try:
            if _libc.setns(target, CLONE_NEWNET) != 0:
                result["error"] = os.strerror(ctypes.get_errno())
                return
            _lo_up()  # the thread ends in that namespace: nothing else of ours runs there
        except OSError as err:
            result["error"] = str(err)
        finally:
            os.close(target)

    thread = threading.Thread(target=work, name="fanfold-lo-up")
    thread.start()
    thread.join()
    if "error" in result:
        raise InfrastructureError(f"bringing lo up in sandbox process {pid}'s network failed: {result['error']}")


INET_TABLES = ("tcp", "tcp6", "udp", "udp6", "raw", "raw6", "udplite", "udplite6", "icmp", "icmp6")


def has_inet_sockets(pid: int) -> bool:
    """Whether the network namespace of ``pid`` holds any IP socket (each table's first line is its header)."""
    for table in INET_TABLES:
        try:
            with open(f"/proc/{pid}/net/{table}", "rb") as handle:
                if len(handle.read().splitlines()) > 1:
                    return True
        except FileNotFoundError:
            continue
    return False


def netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino
