"""Fresh network namespaces with loopback up, made in-process for restored sandboxes."""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import os
import socket
import struct
import subprocess
import threading
from typing import Callable

from ..errors import InfrastructureError

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
SIOCSIFADDR, SIOCSIFNETMASK = 0x8916, 0x891C


def _on_a_thread(work: Callable[[], int | None], what: str) -> int | None:
    """Run ``work`` on a short-lived thread of its own, since a thread may switch network
    namespace alone; it ends there, so nothing else of ours ever runs in that namespace.
    ``work`` signals failure with OSError."""
    result: dict[str, int | OSError | None] = {}

    def run() -> None:
        try:
            result["value"] = work()
        except OSError as err:
            result["error"] = err
        except Exception as err:  # noqa: BLE001 (a thread's error is lost unless handed over)
            result["error"] = OSError(0, f"{type(err).__name__}: {err}")

    thread = threading.Thread(target=run, name="fanfold-netns")
    thread.start()
    thread.join()
    error = result.get("error")
    if isinstance(error, OSError):  # the cause stays attached: callers tell EADDRINUSE from the rest
        raise InfrastructureError(f"{what} failed: {error.strerror or error}") from error
    value = result.get("value")
    return None if isinstance(value, OSError) or value is None else int(value)


def _check(rc: int) -> None:
    if rc != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def new_netns() -> int:
    """An fd of a new network namespace whose only device, lo, is up."""

    def work() -> int:
        _check(_libc.unshare(CLONE_NEWNET))
        fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _lo_up()
        except OSError:
            os.close(fd)
            raise
        return fd

    fd = _on_a_thread(work, "making a network namespace")
    assert fd is not None
    return fd


def alias_lo(netns_fd: int, addresses: tuple[str, ...]) -> None:
    """What the agent's restore action script does in a namespace CRIU makes, in the one ``netns_fd``
    holds: each of ``addresses`` (``ADDRESS/PREFIX``) a /32 alias of lo (lo:0, lo:1, ...), its network
    routed to lo at metric 1000 (``host.groupnet.route_via_lo``)."""

    def work() -> None:
        _check(_libc.setns(netns_fd, CLONE_NEWNET))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for n, address in enumerate(addresses):
                name = f"lo:{n}".encode()
                interface = ipaddress.IPv4Interface(address)
                for request, value in ((SIOCSIFADDR, str(interface.ip)), (SIOCSIFNETMASK, "255.255.255.255")):
                    sockaddr = struct.pack("HH4s8x", socket.AF_INET, 0, socket.inet_aton(value))
                    fcntl.ioctl(sock, request, struct.pack("16s", name) + sockaddr)
                route_via_lo(sock, interface.network, add=True)

    _on_a_thread(work, "binding a restored sandbox's addresses")


SIOCADDRT, SIOCDELRT, RTF_UP, LO_ROUTE_METRIC, RTENTRY_SIZE = 0x890B, 0x890C, 0x1, 1000, 120
_LO = ctypes.create_string_buffer(b"lo")


def route_via_lo(sock: socket.socket, network: ipaddress.IPv4Network, *, add: bool) -> None:
    """Add (or delete) the route of ``network`` to lo at metric 1000, with the old routing ioctl (struct
    rtentry: the kernel reads the device name through the pointer in it). A route already there (or
    gone) is left as it is."""
    entry = bytearray(RTENTRY_SIZE)  # struct rtentry on 64-bit Linux: the offsets <net/route.h> gives
    struct.pack_into("HH4s", entry, 8, socket.AF_INET, 0, network.network_address.packed)  # rt_dst
    struct.pack_into("HH4s", entry, 40, socket.AF_INET, 0, network.netmask.packed)  # rt_genmask
    struct.pack_into("H", entry, 56, RTF_UP)  # rt_flags
    struct.pack_into("h", entry, 80, LO_ROUTE_METRIC + 1)  # rt_metric: one more than the route's
    struct.pack_into("Q", entry, 88, ctypes.addressof(_LO))  # rt_dev
    try:
        fcntl.ioctl(sock, SIOCADDRT if add else SIOCDELRT, entry)
    except OSError as err:
        if err.errno not in (17, 3):  # EEXIST, ESRCH
            raise


def _lo_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0))[:18])[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def raise_lo(pid: int) -> None:
    """Bring lo up in the network namespace of ``pid``."""

    def work() -> None:
        _enter(pid)
        _lo_up()

    _on_a_thread(work, f"bringing lo up in sandbox process {pid}'s network")


def set_hostname(pid: int, name: str) -> None:
    """Set the hostname in the UTS namespace of ``pid`` (a restored sandbox comes back with its source's),
    from a thread that enters it: no ``nsenter`` and ``hostname`` processes to start."""

    def work() -> None:
        target = os.open(f"/proc/{pid}/ns/uts", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _check(_libc.setns(target, CLONE_NEWUTS))
        finally:
            os.close(target)
        socket.sethostname(name)

    _on_a_thread(work, f"naming sandbox process {pid}'s host {name}")


NOT_INET = frozenset({"UNIX", "UNIX-STREAM", "NETLINK", "PACKET", "AF_VSOCK", "XDP", "KEY", "PF_KEY"})
"""Protocols in ``/proc/net/protocols`` whose sockets bind no IP address; any other counts as IP."""


def has_inet_sockets(pid: int) -> bool:
    """Whether the network namespace of ``pid`` holds any IP socket: one listening, connected or bound
    (TCP, UDP, raw, ping, ...), or a TCP connection in TIME_WAIT.

    Read from the namespace's own counters (``protocols``' in-use column, ``sockstat``'s ``tw``), not
    from ``/proc/net/tcp`` and the like, which walk the host's whole socket hash (~4.5 ms each for tcp
    and tcp6, while the sandbox is frozen). As with those tables, a TCP socket only bound, neither
    listening nor connected, is not seen."""
    try:
        protocols, sockstat = (_read(f"/proc/{pid}/net/{name}") for name in ("protocols", "sockstat"))
    except FileNotFoundError:
        return False  # gone: the checkpoint reports it
    for row in protocols.splitlines()[1:]:
        name, _size, sockets = row.split()[:3]
        if name not in NOT_INET and sockets != "0":
            return True
    for line in sockstat.splitlines():
        fields = line.split()
        if fields[:1] == ["TCP:"] and "tw" in fields:
            return fields[fields.index("tw") + 1] != "0"
    return False


def _read(path: str) -> str:
    with open(path, "rb") as handle:
        return handle.read().decode()


def _enter(pid: int) -> None:
    target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(target, CLONE_NEWNET))
    finally:
        os.close(target)


Binding = tuple[int, int, "tuple[str, int] | None"]
"""(family kind, listen backlog or 0, address to bind or None): one socket ``sockets_in`` makes."""


def sockets_in(pid: int, wanted: list[Binding], what: str) -> list[socket.socket]:
    """Non-blocking sockets made (and bound, and listening) inside the network namespace of ``pid``
    from a thread of their own: a socket keeps the namespace it was made in, whichever thread later
    uses it. IPv4 unless the address to bind is IPv6. All or none: on a failure those made are closed."""
    return _sockets(lambda: _enter(pid), wanted, what)


def sockets_in_netns(netns_fd: int, wanted: list[Binding], what: str) -> list[socket.socket]:
    """``sockets_in`` for the network namespace ``netns_fd`` holds (one of ``new_netns``)."""
    return _sockets(lambda: _check(_libc.setns(netns_fd, CLONE_NEWNET)), wanted, what)


def _sockets(enter: Callable[[], None], wanted: list[Binding], what: str) -> list[socket.socket]:
    made: list[socket.socket] = []

    def work() -> None:
        enter()
        for kind, backlog, address in wanted:
            family = socket.AF_INET6 if address is not None and ":" in address[0] else socket.AF_INET
            sock = socket.socket(family, kind)
            made.append(sock)
            if address is not None:
                sock.bind(address)
            if backlog:
                sock.listen(backlog)
            sock.setblocking(False)

    try:
        _on_a_thread(work, what)
    except BaseException:
        for sock in made:
            sock.close()
        raise
    return made


def listen_in(pid: int, port: int) -> socket.socket:
    """A TCP listener on 127.0.0.1:``port`` inside the network namespace of ``pid``, served from here.
    No SO_REUSEPORT, so nothing in the sandbox can bind beside it."""
    wanted: list[Binding] = [(socket.SOCK_STREAM, 1024, ("127.0.0.1", port))]
    return sockets_in(pid, wanted, f"opening port {port} in sandbox process {pid}'s network")[0]


def socket_in(pid: int) -> socket.socket:
    """A TCP socket of the network namespace of ``pid``, not yet connected: its connect runs on the
    caller's event loop, so a service that never accepts holds no thread."""
    return sockets_in(pid, [(socket.SOCK_STREAM, 0, None)], f"making a socket in sandbox process {pid}'s network")[0]


CAPTURE_SCRIPT = """
# 10.250.0.0/24: a sandbox group's own network (host.groupnet.SUBNET), never captured
ip link show ffcap0 >/dev/null 2>&1 || ip -batch - <<'LINKS' || exit 1
link add ffcap0 type veth peer name ffcap1
addr add 10.255.255.1/30 dev ffcap0
link set ffcap0 up
link set ffcap1 up
route add default via 10.255.255.2 dev ffcap0
LINKS
exec nft -f - <<'RULES'
table ip fanfold_capture
delete table ip fanfold_capture
table ip fanfold_capture {{
  chain nat_out {{
    type nat hook output priority -100; policy accept;
    udp dport 53 redirect to :{dns}
    ip daddr 127.0.0.0/8 return
    ip daddr 10.250.0.0/24 return
    meta l4proto tcp redirect to :{tcp}
  }}
  chain filter_out {{
    type filter hook output priority 0; policy accept;
    ip daddr 127.0.0.0/8 accept
    ip daddr 10.250.0.0/24 accept
    ct state established,related accept
    reject
  }}
}}
RULES
"""
"""Both ends of the veth stay in the sandbox's namespace: the route only gives packets somewhere to
go, so that the output hook can send TCP to netd's capture listener and DNS to its answerer; nothing is
forwarded anywhere (the namespace forwards nothing), and whatever else leaves is rejected at once."""


def capture_in(pid: int, tcp_port: int, dns_port: int) -> tuple[socket.socket, socket.socket]:
    """Transparent capture in the network namespace of ``pid``: a TCP listener on 127.0.0.1:``tcp_port``
    that every outgoing TCP connection is redirected to, and a UDP socket on 127.0.0.1:``dns_port`` that
    gets every DNS query (``CAPTURE_SCRIPT``). Idempotent: again after a policy change, the rules are made anew."""
    made = sockets_in(pid, [(socket.SOCK_STREAM, 1024, ("127.0.0.1", tcp_port)),
                            (socket.SOCK_DGRAM, 0, ("127.0.0.1", dns_port))],
                      f"opening the capture ports in sandbox process {pid}'s network")
    try:
        done = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "sh", "-c",
                               CAPTURE_SCRIPT.format(tcp=tcp_port, dns=dns_port)],
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise InfrastructureError(f"setting up transparent capture in sandbox process {pid}'s network failed:"
                                      f" {(done.stderr or done.stdout).strip()[-400:]}")
    except BaseException:
        for sock in made:
            sock.close()
        raise
    return made[0], made[1]


def netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino
