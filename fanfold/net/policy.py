"""Network policies: which names and addresses a sandbox's traffic may reach through the proxy.

A policy is ``"none"`` (no network: loopback only), ``"open"`` (any public address) or a dict of
``allow`` and ``deny`` rules. A rule is a host name (``pypi.org``: exactly that name), a wildcard
(``*.example.com``: any name below it, not ``example.com`` itself), an address (``203.0.113.7``) or a
CIDR (``10.0.0.0/8``), each with an optional ``:port`` (``[2001:db8::1]:443`` for IPv6). Deny wins.
Address and CIDR rules cover connections asked for by address; a name needs a name rule, so no name
that no rule names is ever resolved (its lookup would carry data out).

Whatever the rules say, the proxy never connects to a special address (loopback, private, link-local
and cloud metadata, CGNAT, multicast, the host's own) unless the operator made its range reachable
(``EngineConfig.net_reachable``): names are checked again on the address they resolve to, so a name
that points at 169.254.169.254 is no way around it.
"""

from __future__ import annotations

import ipaddress
import re
import time
from dataclasses import dataclass, field, fields
from typing import Any, Iterable

from ..errors import InvalidRequest

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

SPECIAL: tuple[tuple[str, str], ...] = (
    ("0.0.0.0/8", "a 'this network' address"),
    ("127.0.0.0/8", "a loopback address"),
    ("10.0.0.0/8", "a private address"),
    ("172.16.0.0/12", "a private address"),
    ("192.168.0.0/16", "a private address"),
    ("100.64.0.0/10", "a shared (CGNAT) address"),
    ("169.254.0.0/16", "a link-local address (cloud metadata lives there)"),
    ("192.0.0.0/24", "an IETF protocol address"),
    ("224.0.0.0/4", "a multicast address"),
    ("240.0.0.0/4", "a reserved address"),
    ("::/128", "the unspecified address"),
    ("::1/128", "a loopback address"),
    ("fc00::/7", "a private (unique local) address"),
    ("fe80::/10", "a link-local address"),
    ("ff00::/8", "a multicast address"),
    ("64:ff9b:1::/48", "a private NAT64 address"),
    ("64:ff9b::/96", "a NAT64 address (an IPv4 address inside)"),
    ("2002::/16", "a 6to4 address (an IPv4 address inside)"),
    ("::/96", "an IPv4-compatible address"),
    ("::ffff:0:0/96", "an IPv4-mapped address"),
    ("100::/64", "a discard-only address"),
)
"""Ranges the proxy refuses unless the operator made them reachable: whoever runs a sandbox must not
reach the host's LAN, its loopback services or the cloud's metadata service through it."""
_SPECIAL = tuple((ipaddress.ip_network(cidr), why) for cidr, why in SPECIAL)
_NAME = re.compile(r"^(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*$")
MAX_RULES = 1024


def normal_host(host: str) -> str:
    """A host name as rules compare it: lowercase, no trailing dot, no IPv6 brackets."""
    return host.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")


def as_address(host: str) -> Address | None:
    """The address a host names literally, else None; IPv4-mapped IPv6 counts as its IPv4."""
    try:
        address = ipaddress.ip_address(normal_host(host))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@dataclass(frozen=True)
class Rule:
    """One allow or deny rule, as parsed from its text."""

    text: str
    host: str | None = None
    """An exact name, or the suffix (``.example.com``) of a wildcard."""
    wildcard: bool = False
    net: Network | None = None
    port: int | None = None
    """None: any port."""

    @classmethod
    def parse(cls, text: Any) -> Rule:
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequest(f"network rule {text!r} is not a non-empty string: use a name (pypi.org), a wildcard"
                                 " (*.example.com), an address or a CIDR (10.0.0.0/8), each with an optional :PORT")
        if "://" in text or "/" in text.split("]")[-1].partition("/")[2]:
            raise InvalidRequest(f"network rule {text!r} looks like a URL: a rule is a host name (pypi.org), a wildcard"
                                 " (*.example.com), an address or a CIDR (10.0.0.0/8), with an optional :PORT")
        body, port = _split_port(text.strip())
        wildcard = body.startswith("*.")
        name = normal_host(body[2:] if wildcard else body)
        try:
            net = ipaddress.ip_network(name, strict=False) if not wildcard else None
        except ValueError:
            net = None
        if net is not None:
            return cls(text=text, net=net, port=port)
        if not _NAME.match(name) or "*" in name:
            raise InvalidRequest(f"network rule {text!r} is neither a host name, a wildcard (*.example.com, the star"
                                 " only as the first label), an address nor a CIDR")
        return cls(text=text, host=f".{name}" if wildcard else name, wildcard=wildcard, port=port)

    def _port_ok(self, port: int) -> bool:
        return self.port is None or self.port == port

    def matches_name(self, host: str, port: int) -> bool:
        if self.host is None or not self._port_ok(port):
            return False
        return host.endswith(self.host) if self.wildcard else host == self.host

    def matches_address(self, address: Address, port: int) -> bool:
        return self.net is not None and self._port_ok(port) and address.version == self.net.version \
            and address in self.net


def _split_port(text: str) -> tuple[str, int | None]:
    if text.startswith("["):  # [v6]:port or [v6/len]:port
        inside, _, rest = text[1:].partition("]")
        if not rest:
            return inside, None
        number = rest.removeprefix(":")
    elif text.count(":") == 1:
        inside, _, number = text.partition(":")
    else:  # a bare IPv6 address or CIDR
        return text, None
    if not number.isdigit() or not 0 < int(number) < 65536:
        raise InvalidRequest(f"network rule {text!r} has a bad port {number!r}: use 1-65535")
    return inside, int(number)


_RECORDING = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _name(value: Any, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _RECORDING.match(value) or ".." in value:
        raise InvalidRequest(f"network {key!r} names a recording: a letter or digit, then up to 127 letters, digits"
                             f" and _.-; got {value!r}")
    return value


def _rules(value: Any, key: str) -> tuple[Rule, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise InvalidRequest(f"network {key!r} must be a list of rules, got {value!r}")
    if len(value) > MAX_RULES:
        raise InvalidRequest(f"network {key!r} has {len(value)} rules; at most {MAX_RULES} are allowed")
    return tuple(Rule.parse(item) for item in value)


@dataclass(frozen=True)
class NetworkPolicy:
    """Where a sandbox's traffic may go through the proxy; ``None`` stands for no network at all."""

    allow: tuple[Rule, ...] = field(default=(), metadata={"max_length": MAX_RULES})
    """Host names (pypi.org), wildcards (*.example.com: names below it), addresses and CIDRs (10.0.0.0/8),
    each with an optional :PORT. Private, loopback and link-local addresses stay out of reach unless the
    operator made them reachable."""
    deny: tuple[Rule, ...] = field(default=(), metadata={"max_length": MAX_RULES})
    """Rules as in allow; deny wins."""
    open: bool = False
    """Any public address (the host's own tenant only)."""
    record: str | None = None
    """Store every request and response under this name (TLS terminated with the fleet's CA)."""
    replay: str | None = None
    """Answer from this recording, with no outside access; a request not in it is a 502."""
    live: bool = False
    """With ``replay``: a request not in the recording goes out under the allow rules instead."""
    cache: bool = False
    """Serve immutable downloads (wheels, npm tarballs, .debs) from the host's shared cache."""
    transparent: bool = False
    """Capture TCP and DNS of tools that ignore the proxy variables too (crun only; filtering, no recording)."""

    @property
    def terminates(self) -> bool:
        """Whether the proxy terminates this sandbox's TLS (and so the sandbox must trust the fleet's CA)."""
        return bool(self.record or self.replay or self.cache)

    @classmethod
    def parse(cls, value: Any) -> NetworkPolicy | None:
        """``"none"``/None -> None, ``"open"``, a ``{"allow": [...], "deny": [...]}`` dict, or a policy;
        InvalidRequest naming what is wrong."""
        if value is None or value == "none":
            return None
        if isinstance(value, NetworkPolicy):
            return value
        if value == "open":
            return cls(open=True)
        if not isinstance(value, dict):
            raise InvalidRequest(f"network={value!r} is not a network policy: use \"none\", \"open\" or"
                                 " {\"allow\": [rules], \"deny\": [rules]}")
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise InvalidRequest(f"network policy has unknown keys {', '.join(map(repr, unknown))}: it takes"
                                 f" {', '.join(map(repr, KEYS))}")
        for key in ("open", "live", "cache", "transparent"):
            if not isinstance(value.get(key, False), bool):
                raise InvalidRequest(f"network {key!r} is true or false, got {value[key]!r}")
        record, replay = _name(value.get("record"), "record"), _name(value.get("replay"), "replay")
        if record and replay:
            raise InvalidRequest("a network policy records or replays, not both: replay the recording in a later rollout")
        if value.get("transparent") and (record or replay):
            raise InvalidRequest("transparent capture filters traffic but records and replays none: record or replay"
                                 " through the proxy variables, without 'transparent'")
        if value.get("live") and not replay:
            raise InvalidRequest("network 'live' lets a replay's misses go out: it needs 'replay'")
        return cls(allow=_rules(value.get("allow"), "allow"), deny=_rules(value.get("deny"), "deny"),
                   open=bool(value.get("open", False)), record=record, replay=replay, live=bool(value.get("live")),
                   cache=bool(value.get("cache")), transparent=bool(value.get("transparent")))

    def to_wire(self) -> str | dict[str, Any]:
        if self.open and not self.deny and not self.terminates and not self.transparent:
            return "open"
        wire: dict[str, Any] = {"allow": [r.text for r in self.allow], "deny": [r.text for r in self.deny]}
        if self.open:
            wire["open"] = True
        for key in ("record", "replay"):
            if getattr(self, key):
                wire[key] = getattr(self, key)
        for key in ("live", "cache", "transparent"):
            if getattr(self, key):
                wire[key] = True
        return wire

    @classmethod
    def from_wire(cls, value: Any) -> NetworkPolicy | None:
        return cls.parse(value)

    def precheck(self, host: str, port: int) -> str | None:
        """Before resolving: None when ``host`` may go on to be resolved and checked, else why not."""
        host = normal_host(host)
        address = as_address(host)
        if address is None:
            for rule in self.deny:
                if rule.matches_name(host, port):
                    return f"{host}:{port} is denied by rule {rule.text!r}"
            # A name goes on only when a name rule allows it: a CIDR rule covers addresses asked for as
            # such, so no name is ever resolved (and carried out by DNS) that no rule names.
            if self.open or any(r.matches_name(host, port) for r in self.allow):
                return None
        elif self.open or any(r.net is not None for r in self.allow):
            return None  # the address is checked in decide
        return f"no allow rule matches {host}:{port}: add one (\"{host}\" or a wildcard) to the policy's allow list"

    def resolvable(self, host: str) -> str | None:
        """None when some allowed connection (any port) could need ``host``'s addresses, else why not:
        the DNS answers of transparent capture."""
        host = normal_host(host)
        for rule in self.deny:
            if rule.port is None and rule.matches_name(host, 0):
                return f"{host} is denied by rule {rule.text!r}"
        if self.open or any(r.host is not None and r.matches_name(host, r.port or 0) for r in self.allow):
            return None
        return f"no allow rule names {host}"

    def decide(self, host: str, port: int, address: Address, reachable: Reachable) -> str | None:
        """After ``host`` resolved to ``address``: None when connecting there is allowed, else why not."""
        if (reason := self.precheck(host, port)) is not None:
            return reason
        address = as_address(str(address)) or address
        for rule in self.deny:
            if rule.matches_address(address, port):
                return f"{address}:{port} is denied by rule {rule.text!r}"
        if (reason := reachable.refuses(address)) is not None:
            return f"{host} resolves to {address}, {reason}" if as_address(host) is None else f"{address} is {reason}"
        name = normal_host(host)
        if self.open or any(r.matches_address(address, port) or r.matches_name(name, port) for r in self.allow):
            return None
        return f"no allow rule matches {address}:{port} (which {name} resolves to)"


KEYS = tuple(spec.name for spec in fields(NetworkPolicy))
"""What a policy's dict may hold: its fields, named once (the server's request bodies derive from them too)."""


class Reachable:
    """Which special addresses the proxy may still connect to: the operator's CIDRs. The host's own
    addresses are special too (they reach its local services), re-read every few seconds."""

    REFRESH_S = 5.0

    def __init__(self, operator_cidrs: Iterable[str] = ()) -> None:
        try:
            self.operator = tuple(ipaddress.ip_network(c, strict=False) for c in operator_cidrs)
        except ValueError as err:
            raise InvalidRequest(f"net_reachable (FANFOLD_NET_REACHABLE) has a bad CIDR: {err}") from None
        self._own: frozenset[Address] = frozenset()
        self._read_at = -self.REFRESH_S

    def _operator_allows(self, address: Address) -> bool:
        return any(address.version == net.version and address in net for net in self.operator)

    def refuses(self, address: Address) -> str | None:
        """Why the proxy must not connect to ``address``, or None."""
        if self._operator_allows(address):
            return None
        for net, why in _SPECIAL:
            if address.version == net.version and address in net:
                return f"{why}, which the proxy does not reach unless the operator adds it to net_reachable"
        if address in self.own_addresses():
            return "an address of the host itself, which the proxy does not reach"
        return None

    def own_addresses(self) -> frozenset[Address]:
        if time.monotonic() - self._read_at > self.REFRESH_S:
            self._own = frozenset(host_addresses())
            self._read_at = time.monotonic()
        return self._own

    def refused_ranges(self) -> tuple[Network, ...]:
        """The special ranges ``refuses`` names, less the operator's, disjoint and sorted: for a firewall
        that applies the proxy's rules to traffic that never passes through it (a server tenant's build
        steps, ``host.stepnet``). The host's own addresses are not among them: they change."""
        pieces: list[Network] = [net for net, _ in _SPECIAL]
        for allowed in self.operator:
            pieces = [rest for piece in pieces for rest in _less(piece, allowed)]
        v4 = ipaddress.collapse_addresses(p for p in pieces if p.version == 4)
        v6 = ipaddress.collapse_addresses(p for p in pieces if p.version == 6)
        return (*v4, *v6)


def _less(piece: Network, allowed: Network) -> list[Network]:
    """``piece`` without the addresses of ``allowed`` (two CIDRs overlap only where one holds the other)."""
    if piece.version != allowed.version or not piece.overlaps(allowed):  # type: ignore[arg-type]
        return [piece]
    if piece.subnet_of(allowed):  # type: ignore[arg-type]
        return []
    return list(piece.address_exclude(allowed))  # type: ignore[arg-type]


def host_addresses() -> set[Address]:
    """Every address of this host's network namespace (/proc/net/fib_trie's local ones, if_inet6)."""
    found: set[Address] = set()
    try:
        with open("/proc/net/fib_trie") as handle:
            last = None
            for line in handle:
                words = line.split()
                if words[:1] == ["|--"]:
                    last = words[1]
                elif last and words[:2] == ["/32", "host"] and words[2:3] == ["LOCAL"]:
                    found.add(ipaddress.ip_address(last))
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6") as handle:
            for line in handle:
                text = line.split()[0]
                found.add(ipaddress.ip_address(":".join(text[i:i + 4] for i in range(0, 32, 4))))
    except OSError:
        pass
    return found
