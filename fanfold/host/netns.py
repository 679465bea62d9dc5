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
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0))[:18])[1]
                fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))
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


def netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino
