"""Networks for image-build ``run`` steps: egress to the outside through NAT, nothing of the host.

A build gets one network, made at its first ``run`` step that is not cached and removed when
the build ends (every step of it, nested ``COPY --from`` stages included, joins the same one):

- a network namespace, ``/run/netns/fanfold-TAG-build-PID-N`` (N counts this process's builds);
- a veth pair: ``ffbSLOT`` on the host, ``eth0`` inside, a /30 of ``SUBNET`` between them,
  and a default route via the host's end;
- an nftables table of its own, ``inet fanfold_TAG_build_PID_N``, that masquerades the
  build's traffic out of the host's interfaces, rejects everything it sends to the host itself
  (the input hook: every address of the host, loopback services bound to 0.0.0.0 included),
  rejects forwarding to 127.0.0.0/8, 169.254.0.0/16 (link-local, cloud metadata), to other
  builds' subnets and any IPv6, and drops new connections from outside into the build;
- for a server tenant's build (``refused``), that table also rejects forwarding to every range the
  egress proxy refuses (private, CGNAT, multicast...: ``net.policy.SPECIAL``) less the operator's
  ``net_reachable``, but for DNS (port 53, udp and tcp) to the resolvers its steps are given, which
  on many hosts live at a private address. The host's own builds keep the LAN (its mirrors).

Per build, not per step: a build's steps run one after another and trust each other, and
setup is paid once (tens of ms) instead of at every step; not one per engine: concurrent
builds of different tenants must not reach each other's steps.

Forwarding needs ``net.ipv4.ip_forward=1``: fanfold sets it when it makes a build network (as
Docker and podman do) and leaves it set. A host whose own firewall drops forwarded traffic (an
iptables FORWARD policy of DROP) also drops the builds' egress; no rule here can override it.

Names carry the engine's tag and the builder's pid, so ``sweep`` removes what a dead builder
left. The host's end of a veth is named after its slot alone: the kernel's refusal of a second
``ffbSLOT`` is the host-wide claim on the /30, and it goes when its namespace does.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import os
import random
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import HostNotReady, InfrastructureError
from . import procs

SUBNET = ipaddress.IPv4Network("10.237.0.0/16")
"""Where build networks take their /30s (16384 of them); refused if the host routes any of it."""
BLOCKED = ("127.0.0.0/8", "169.254.0.0/16", "100.100.100.200/32")
"""Loopback, link-local (most clouds' metadata service) and Alibaba Cloud's metadata address."""
NETNS_DIR = Path("/run/netns")
VETH_PREFIX = "ffb"
TOOL_TIMEOUT_S = 30
log = logging.getLogger("fanfold.engine")
_serials = itertools.count()
_active: set[int] = set()
"""Serials of this process's build networks that are made or being made: any other is a leftover."""


@dataclass(frozen=True)
class _Names:
    """Everything one build network is made of: named after its owner, addressed by its slot."""

    tag: str
    pid: int
    serial: int
    slot: int = -1
    """Which /30 of SUBNET; -1 where only the names matter (removal)."""

    @property
    def netns(self) -> str:
        return f"fanfold-{self.tag}-build-{self.pid}-{self.serial}"

    @property
    def table(self) -> str:
        return f"fanfold_{self.tag}_build_{self.pid}_{self.serial}"

    @property
    def veth(self) -> str:
        return f"{VETH_PREFIX}{self.slot}"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network((int(SUBNET.network_address) + 4 * self.slot, 30))

    @property
    def host_address(self) -> ipaddress.IPv4Address:
        return self.subnet.network_address + 1

    @property
    def step_address(self) -> ipaddress.IPv4Address:
        return self.subnet.network_address + 2


class StepNetwork:
    """One build's network: made on the first ``netns()``, removed by ``close()`` whatever happened.
    ``refused``: IPv4 CIDRs its steps may not reach besides ``BLOCKED`` (a server tenant's build), DNS
    to ``resolvers``' nameservers excepted."""

    def __init__(self, tag: str, refused: Sequence[str] = ()) -> None:
        self.tag = tag
        self.refused = tuple(refused)
        self.resolvers = resolv_conf()
        """The resolv.conf its steps get, chosen once: the table admits DNS to its nameservers."""
        self.names: _Names | None = None
        """What exists (or partly does) and ``close`` removes."""
        self._lock = threading.Lock()  # make and remove run in threads: a remove waits for a make
        self._making: asyncio.Future[None] | None = None
        self._closed = False

    async def netns(self) -> str:
        """The path of the build's network namespace, for a step to join."""
        if self._making is None:
            self._making = asyncio.ensure_future(asyncio.to_thread(self._make))
            self._making.add_done_callback(lambda done: done.cancelled() or done.exception())  # seen by the step
        await asyncio.shield(self._making)  # a cancelled step leaves the make to finish; close removes it
        assert self.names is not None
        return str(NETNS_DIR / self.names.netns)

    async def close(self) -> None:
        """Remove the namespace, its veth and its table; once started, a cancelled caller does not stop it.
        A removal that fails is logged and left to the reaper's ``sweep``."""
        if self._making is None:
            return
        try:
            await asyncio.to_thread(self._remove)
        except InfrastructureError as err:
            log.warning("fanfold: %s; the reaper retries", err)

    def _make(self) -> None:
        with self._lock:
            if self._closed:
                raise InfrastructureError("the build ended before its network was made")
            _check_host()
            serial = next(_serials)
            _active.add(serial)
            for _ in range(8):
                # The table first, so the veth is filtered from the moment it exists.
                self.names = names = _Names(self.tag, os.getpid(), serial, _free_slot())
                ruleset = _ruleset(names, self.refused, _nameservers(self.resolvers))
                _tool(["nft", "-f", "-"], ruleset, what="adding the build's nftables table")
                claimed = _run(["ip", "-batch", "-"], _host_batch(names))
                if claimed.returncode == 0:
                    break
                _remove(names)
                self.names = None
                if "File exists" not in claimed.stderr:  # else another builder took the slot meanwhile: try again
                    raise InfrastructureError(f"making a build network failed: {claimed.stderr.strip()[-500:]}")
            else:
                raise InfrastructureError(f"no free /30 for a build network in {SUBNET} after 8 tries")
            _tool(["ip", "-n", names.netns, "-batch", "-"], _step_batch(names), what="configuring the build's namespace")

    def _remove(self) -> None:
        with self._lock:
            self._closed = True
            if self.names is not None:
                names, self.names = self.names, None
                _active.discard(names.serial)  # from now on a leftover, if the removal fails
                _remove(names)


class StepNetworks:
    """Makes the build networks of one engine, its ``tag`` in their names; a confined one (a server
    tenant's build) also refuses ``confined_refused`` (CIDRs; the IPv6 ones go without saying)."""

    def __init__(self, tag: str, confined_refused: Sequence[str] = ()) -> None:
        self.tag = tag
        self.confined_refused = tuple(c for c in confined_refused if ipaddress.ip_network(c).version == 4)

    def network(self, *, confined: bool = False) -> StepNetwork:
        return StepNetwork(self.tag, self.confined_refused if confined else ())


def resolv_conf() -> str:
    """The resolver list a build step gets: the host's, unless it names only loopback resolvers
    (a systemd-resolved stub), which no step can reach; then systemd-resolved's upstream list."""
    upstream = Path("/run/systemd/resolve/resolv.conf")
    servers = _nameservers("/etc/resolv.conf")
    loopback = servers and all(_is_loopback(server) for server in servers)
    return str(upstream) if loopback and upstream.exists() else "/etc/resolv.conf"


def _nameservers(path: str) -> list[str]:
    """The ``nameserver`` entries of a resolv.conf; none if it cannot be read."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    return [line.split()[1] for line in lines if line.startswith("nameserver") and len(line.split()) > 1]


def sweep(tag: str) -> int:
    """Remove the build networks of engines with ``tag`` whose builder process is gone (or, in
    this process, that no build holds); how many."""
    prefix = f"fanfold-{tag}-build-"
    found: set[_Names] = set()
    if NETNS_DIR.is_dir():
        found |= {n for n in map(_parse, (p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))) if n}
    if shutil.which("nft"):
        listed = _run(["nft", "list", "tables", "inet"], "").stdout.split()
        found |= {n for n in map(_parse, listed) if n and n.tag == tag}
    removed = 0
    for names in filter(_abandoned, found):
        try:
            _remove(names)
            removed += 1
        except InfrastructureError as err:  # one that will not go must not stop the rest, nor an engine's start
            log.warning("fanfold: removing a dead builder's network failed, retried on a later sweep: %s", err)
    return removed


def _abandoned(names: _Names) -> bool:
    """Whether no build holds ``names``: its process is gone, or it is this one and no build of it does."""
    return names.serial not in _active if names.pid == os.getpid() else not procs.running(names.pid)


def _parse(name: str) -> _Names | None:
    """The names of a build network from its netns or table name, or None for anything else."""
    parts = name.replace("_", "-").split("-")
    if len(parts) != 5 or parts[0] != "fanfold" or parts[2] != "build" or not (parts[3] + parts[4]).isdigit():
        return None
    return _Names(parts[1], int(parts[3]), int(parts[4]))


def _ruleset(names: _Names, refused: Sequence[str] = (), nameservers: Sequence[str] = ()) -> str:
    veth, blocked = f'"{names.veth}"', ", ".join((*BLOCKED, str(SUBNET)))
    confined = ""
    if refused:
        resolvers = sorted({str(a) for a in map(_ipv4, nameservers) if a is not None and not a.is_loopback})
        if resolvers:  # before the refusal: a resolver at a private address still answers, on port 53 alone
            confined += (f"    iifname {veth} ip daddr {{ {', '.join(resolvers)} }} meta l4proto {{ tcp, udp }}"
                         " th dport 53 accept\n")
        confined += f"    iifname {veth} ip daddr {{ {', '.join(refused)} }} reject with icmpx admin-prohibited\n"
    return f"""table inet {names.table} {{
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    iifname {veth} reject with icmpx admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    iifname {veth} meta nfproto ipv6 reject with icmpx admin-prohibited
    iifname {veth} ip saddr != {names.subnet} drop
    iifname {veth} ip daddr {{ {blocked} }} reject with icmpx admin-prohibited
{confined}    oifname {veth} ct state new drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {names.subnet} oifname != {veth} masquerade
  }}
}}
"""


def _host_batch(names: _Names) -> str:
    return (f"netns add {names.netns}\n"
            f"link add {names.veth} type veth peer name eth0 netns {names.netns}\n"
            f"addr add {names.host_address}/30 dev {names.veth}\n"
            f"link set {names.veth} up\n")


def _step_batch(names: _Names) -> str:
    return ("link set lo up\n"
            "link set eth0 addrgenmode none\n"  # no IPv6 address either (the table rejects IPv6 too)
            f"addr add {names.step_address}/30 dev eth0\n"
            "link set eth0 up\n"
            f"route add default via {names.host_address}\n")


def _remove(names: _Names) -> None:
    """Remove the table and the namespace (its veth goes with it); parts already gone are fine."""
    for argv, what in ((["nft", "delete", "table", "inet", names.table], "table"),
                       (["ip", "netns", "delete", names.netns], "namespace")):
        done = _run(argv, "")
        if done.returncode != 0 and "No such file" not in done.stderr:
            raise InfrastructureError(f"removing build network {what} {names.netns} failed: {done.stderr.strip()[-500:]}")


def _free_slot() -> int:
    """A slot whose veth does not exist now, from a random start so concurrent builders rarely collide."""
    taken = {int(n[len(VETH_PREFIX):]) for n in os.listdir("/sys/class/net")
             if n.startswith(VETH_PREFIX) and n[len(VETH_PREFIX):].isdigit()}
    slots = SUBNET.num_addresses // 4
    start = random.randrange(slots)
    for offset in range(slots):
        if (slot := (start + offset) % slots) not in taken:
            return slot
    raise InfrastructureError(f"every /30 of {SUBNET} is taken by a build network")


def _check_host() -> None:
    """The tools are there, no route of the host overlaps SUBNET, and the kernel forwards."""
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            raise HostNotReady(f"isolated build steps need `{tool}`: run `apt-get install {package}`,"
                               " or build with network='host' as the host's own tenant")
    for device, destination, mask in _routes():
        if device.startswith(VETH_PREFIX) or mask == 0:
            continue
        route = ipaddress.IPv4Network((destination, bin(mask).count("1")), strict=False)
        if route.overlaps(SUBNET):
            raise HostNotReady(f"the host routes {route} (dev {device}), which overlaps {SUBNET}, where"
                               " build networks take their addresses: remove that route or build with network='host'")
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    if forward.read_text().strip() != "1":
        forward.write_text("1")
        log.warning("fanfold set net.ipv4.ip_forward=1 so that build steps reach the outside through NAT")


def _routes() -> list[tuple[str, int, int]]:
    """(device, destination, netmask) of the host's IPv4 routes, from /proc/net/route."""
    rows = Path("/proc/net/route").read_text().splitlines()[1:]
    return [(f[0], _le32(f[1]), _le32(f[7])) for f in (row.split() for row in rows) if len(f) > 7]


def _le32(text: str) -> int:
    return int.from_bytes(int(text, 16).to_bytes(4, "little"), "big")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _ipv4(address: str) -> ipaddress.IPv4Address | None:
    try:
        return ipaddress.IPv4Address(address)
    except ValueError:
        return None


def _run(argv: list[str], stdin: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise InfrastructureError(f"`{' '.join(argv)}` did not finish within {TOOL_TIMEOUT_S} s") from None


def _tool(argv: list[str], stdin: str, *, what: str) -> None:
    done = _run(argv, stdin)
    if done.returncode != 0:
        raise InfrastructureError(f"{what} failed: {done.stderr.strip()[-500:]}")
