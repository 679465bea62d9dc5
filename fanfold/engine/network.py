"""Sandboxes' networks: each with a policy gets a listener inside its own network namespace, which
this engine's ``fanfold netd`` serves as a filtering proxy; the sandbox itself keeps loopback only.

The engine holds every listener (so a netd that dies is replaced and given them all again) and
opens it before any code of the sandbox runs: at create before its services start, at restore
(fork, resume, reset) before its processes thaw. A listener belongs to one sandbox, so netd
tells sandboxes apart by the listener a connection came in on.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import logging
import os
import pwd
import shutil
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from .._extras import require
from ..config import EngineConfig
from ..errors import FanfoldError, InfrastructureError, InvalidRequest, QuotaExceeded, RecordingNotFound
from ..host import safefs
from ..store.trust import SYSTEM_BUNDLES
from ..net.netd import Netd, NetdDied
from ..net.policy import NetworkPolicy, Reachable
from ..runtime import Backend, Handle

if TYPE_CHECKING:
    from ..net.clones import GitGate
    from ..net.pulls import PullGate

log = logging.getLogger("fanfold.engine")
NONE = '"none"'
ELSEWHERE_S = 10.0
DNS_PORT = 53
"""Inside a sandbox with transparent capture, where its DNS queries are answered (by netd)."""
CA_BUNDLE = "/etc/fanfold/ca-bundle.pem"
"""Where a sandbox whose TLS the proxy terminates finds the CAs it trusts: its own and the fleet's."""
FLEET_CA = "/etc/fanfold/fleet-ca.pem"
"""A row's network column when the sandbox has no network."""
RECORDINGS_ADVICE = ("delete recordings (fleet.delete_recording(NAME), `fanfold recordings`) or ask the operator to"
                     " raise the quota")


def proxy_env(port: int, terminates: bool = False) -> dict[str, str]:
    """What points a sandbox's tools at the proxy: curl, pip, git, apt and requests read the
    lowercase forms, others the uppercase; npm its own keys. When the proxy terminates TLS, what
    makes OpenSSL, Python, pip, requests, curl, git and Node trust the fleet's CA."""
    url = f"http://127.0.0.1:{port}"
    env = {}
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "npm_config_proxy",
                 "npm_config_https_proxy"):
        env[name] = url
    env["no_proxy"] = env["NO_PROXY"] = "localhost,127.0.0.1,::1"
    if terminates:
        for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO",
                     "npm_config_cafile"):
            env[name] = CA_BUNDLE
        env["NODE_EXTRA_CA_CERTS"] = FLEET_CA
    return env


def row_policy(row: Any) -> NetworkPolicy | None:
    """The policy a row's network column holds (parsed once per distinct text: every exec asks)."""
    text = row["network"]
    return None if not text or text == NONE else _parsed(text)


@functools.lru_cache(maxsize=1024)
def _parsed(text: str) -> NetworkPolicy | None:
    return NetworkPolicy.from_wire(json.loads(text))


def wire_policy(wire: Any) -> NetworkPolicy | None:
    """The policy a record's ``network`` field holds (``"none"``, or the policy's wire form)."""
    return None if wire == "none" else _parsed(json.dumps(wire))


def to_column(policy: NetworkPolicy | None) -> str:
    return NONE if policy is None else json.dumps(policy.to_wire())


def pull_gate(config: EngineConfig) -> PullGate:
    """Where server tenants' image pulls may go (``net.pulls``), from the operator's settings."""
    require("net", "server tenants' image pulls")
    from ..net.pulls import PullGate

    return PullGate(config.tenant_registries, reachable=config.net_reachable,
                    hosts={name: list(found) for name, found in config.net_hosts}, nameservers=config.net_dns,
                    idle_timeout=config.net_idle_timeout or None)


def git_gate(config: EngineConfig) -> GitGate:
    """Where server tenants' builds may clone from (``net.clones``), from the operator's settings."""
    require("net", "server tenants' repo steps")
    from ..net.clones import GitGate

    return GitGate(config.tenant_git_hosts, reachable=config.net_reachable,
                   hosts={name: list(found) for name, found in config.net_hosts}, nameservers=config.net_dns,
                   idle_timeout=config.net_idle_timeout or None)


def build_refused(config: EngineConfig) -> list[str]:
    """What a server tenant's build steps may not reach through their NAT (``host.stepnet``): the
    ranges the egress proxy refuses, less the operator's ``net_reachable``."""
    return [str(net) for net in Reachable(config.net_reachable).refused_ranges()]


class Network:
    """This engine's netd, and the listener of each sandbox it serves."""

    def __init__(self, config: EngineConfig, backend: Backend) -> None:
        self.config, self.backend = config, backend
        self.port = config.proxy_port
        self.netd: Netd | None = None
        self.listeners: dict[str, list[socket.socket]] = {}
        """Per attached sandbox: the proxy's listener, and with transparent capture its TCP listener and DNS socket."""
        self.policies: dict[str, NetworkPolicy] = {}
        self.scopes: dict[str, str] = {}
        self.ca: Any = None
        """The fleet's CA (``net.ca.FleetCA``), loaded as netd first starts."""
        self.exposed: dict[tuple[str, int], Exposure] = {}
        self.elsewhere: dict[str, float] = {}
        """Sandboxes whose proxy port another engine held (monotonic time of the try)."""
        self.closing = False
        self.figures: dict[str, dict[str, Any]] = {}
        """Each attached sandbox's counters as netd last reported them (``refresh``)."""
        self._totals: dict[str, int] = {}
        self._totals_before: dict[str, int] = {}
        """What netds replaced before the running one had counted."""
        self._starting = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None

    def check(self, value: Any, tenant: str) -> NetworkPolicy | None:
        """A create's ``network=`` as a policy; InvalidRequest when it is malformed or not allowed."""
        policy = NetworkPolicy.parse(value)
        if policy is None:
            return None
        if policy.record:
            self._check_recording_quota(tenant, policy.record)
        if policy.replay and not (self.recording_dir(tenant, policy.replay) / "index.jsonl").is_file():
            raise RecordingNotFound(f"no recording {policy.replay!r}: record one with network={{\"record\":"
                                    f" {policy.replay!r}, \"allow\": [...]}} first (fleet.recordings() lists them)")
        if policy.open and tenant:
            raise InvalidRequest("network=\"open\" is for the host's own callers: list what the sandbox may reach"
                                 " with {\"allow\": [...]}")
        if not self.backend.capabilities.network:
            raise InvalidRequest(f"the {self.backend.name} backend gives sandboxes no network: network policies need"
                                 " the oci backend with crun or runc (FANFOLD_RUNTIME)")
        if policy.transparent and type(self.backend).capture_inside is Backend.capture_inside:
            raise InvalidRequest(f"the {self.backend.name} backend cannot capture traffic transparently: leave out"
                                 " 'transparent' (tools then reach the proxy through its variables)")
        return policy

    def env(self, policy: NetworkPolicy | None) -> dict[str, str]:
        return {} if policy is None else proxy_env(self.port, policy.terminates)

    def before_run(self, sandbox_id: str, policy: NetworkPolicy | None,
                   scope: str = "") -> Callable[[Handle], Awaitable[None]] | None:
        """The bring-up hook that attaches the sandbox before its code runs, when it has a policy."""
        if policy is None:
            return None

        async def attach(handle: Handle) -> None:
            await self.attach(handle, policy, scope)

        return attach

    # -- recordings -----------------------------------------------------------------------------

    def recording_quota(self, tenant: str) -> dict[str, int | None]:
        """What ``tenant``'s recordings may take: ``bytes`` of bodies and ``count``; no limit for the host's own."""
        if not tenant:
            return {"bytes": None, "count": None}
        quota = dict(self.config.quotas).get(tenant)
        mb, count = (quota.recordings_mb, quota.recordings) if quota is not None else (None, None)
        mb = self.config.net_recordings_mb if mb is None else mb
        return {"bytes": mb << 20, "count": self.config.net_recordings if count is None else count}

    def _check_recording_quota(self, tenant: str, name: str) -> None:
        """QuotaExceeded when recording ``name`` would take ``tenant`` past its recordings quota (netd
        checks again as it records)."""
        quota = self.recording_quota(tenant)
        if quota["bytes"] is None:
            return
        held = self.recordings(tenant)
        if name not in {r["name"] for r in held} and len(held) >= (quota["count"] or 0):
            raise QuotaExceeded(f"tenant {tenant} keeps {len(held)} of {quota['count']} network recordings (quota"
                                f" recordings), and {name!r} would be a new one: {RECORDINGS_ADVICE}")
        used = sum(r["bytes"] for r in held)
        if used >= quota["bytes"]:
            raise QuotaExceeded(f"tenant {tenant}'s network recordings take {used >> 20} of {quota['bytes'] >> 20} MB"
                                f" (quota recordings_mb): {RECORDINGS_ADVICE}")

    def recording_dir(self, tenant: str, name: str) -> Path:
        return self.config.state_dir / "net" / "recordings" / (tenant or "_host") / name

    def recordings(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's recordings: name, exchanges, bytes of bodies, when made."""
        found = []
        where = self.recording_dir(tenant, "x").parent
        for entry in sorted(where.iterdir()) if where.is_dir() else []:
            index = entry / "index.jsonl"
            if not index.is_file():
                continue
            with open(index, "rb") as handle:
                exchanges = max(sum(1 for _ in handle) - 1, 0)  # the first line is the format's
            blobs = entry / "blobs"
            size = sum(p.stat().st_size for p in blobs.iterdir()) if blobs.is_dir() else 0
            found.append({"name": entry.name, "exchanges": exchanges, "bytes": size, "created": index.stat().st_ctime})
        return found

    def delete_recording(self, tenant: str, name: str) -> None:
        """Delete a recording no attached sandbox records into or replays from."""
        policy = NetworkPolicy.parse({"replay": name})
        assert policy is not None and policy.replay == name  # a checked name: no path tricks
        where = self.recording_dir(tenant, name)
        if not where.is_dir():
            raise RecordingNotFound(f"no recording {name!r}")
        for sandbox_id, held in self.policies.items():
            if self.scopes.get(sandbox_id, "") == tenant and name in (held.record, held.replay):
                raise InvalidRequest(f"sandbox {sandbox_id} uses recording {name!r}: change its network or kill it first")
        shutil.rmtree(where)

    def holds(self, sandbox_id: str) -> bool:
        return sandbox_id in self.listeners

    def served_elsewhere(self, sandbox_id: str) -> bool:
        """Whether another engine served the sandbox's network when this one last tried (within ELSEWHERE_S)."""
        seen = self.elsewhere.get(sandbox_id)
        return seen is not None and time.monotonic() - seen < ELSEWHERE_S

    async def attach(self, handle: Handle, policy: NetworkPolicy, scope: str = "") -> None:
        """Open the sandbox's listener and hand it to netd (a restored sandbox's replaces its old one).
        ``scope`` (the tenant) is where its recordings live."""
        await self._running()  # first: a netd started now must not be given this listener twice
        if policy.terminates:
            await asyncio.to_thread(self._trust_fleet_ca, handle.id)
        try:
            listener = await self.backend.listen_inside(handle, self.port)
        except InfrastructureError as err:
            if isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.EADDRINUSE:
                raise InvalidRequest(f"port {self.port} is taken inside sandbox {handle.id}: a process there listens"
                                     " on it (stop it: the egress proxy needs the port), or another engine on this"
                                     " state dir (a server) serves its network: change it through that one") from None
            raise
        held = [listener]
        if policy.transparent:
            try:
                held += await self.backend.capture_inside(handle, self.config.capture_port, DNS_PORT)
            except BaseException as err:
                listener.close()
                if isinstance(err, NotImplementedError):
                    raise InvalidRequest(str(err)) from None
                raise
        for old in self.listeners.pop(handle.id, []):
            old.close()
        self.listeners[handle.id], self.policies[handle.id], self.scopes[handle.id] = held, policy, scope
        try:
            await self._request({"op": "attach", "id": handle.id, "policy": policy.to_wire(), "scope": scope,
                                 "quota": self.recording_quota(scope)}, [sock.fileno() for sock in held])
        except BaseException:
            await self.detach(handle.id)
            raise

    async def set_policy(self, sandbox_id: str, policy: NetworkPolicy, *, cut: bool = False) -> None:
        """A new policy for an attached sandbox: new connections and requests follow it at once;
        with ``cut``, open connections end too."""
        if policy.terminates and not self.policies[sandbox_id].terminates:
            await asyncio.to_thread(self._trust_fleet_ca, sandbox_id)
        self.policies[sandbox_id] = policy
        await self._request({"op": "policy", "id": sandbox_id, "policy": policy.to_wire(), "cut": cut})

    async def detach(self, sandbox_id: str) -> None:
        """Close the sandbox's listener (its port is free again) and its open connections."""
        held = self.listeners.pop(sandbox_id, None)
        self.policies.pop(sandbox_id, None)
        self.scopes.pop(sandbox_id, None)
        if held is None:
            return
        for sock in held:
            sock.close()
        if self.netd is not None and self.netd.running:
            try:
                await self.netd.request({"op": "detach", "id": sandbox_id})
            except (NetdDied, InfrastructureError):
                pass  # a netd that died took its copy with it

    async def stats(self) -> dict[str, dict[str, Any]]:
        """Per attached sandbox: connections, requests, bytes up and down, denials (counts)."""
        if self.netd is None:
            return {}
        reply = await self._request({"op": "stats"})
        self.figures, self._totals = dict(reply.get("sandboxes", {})), dict(reply.get("totals", {}))
        return self.figures

    async def sandbox_stats(self, sandbox_id: str) -> dict[str, Any]:
        """One sandbox's counters and its latest denial reasons ({} when it is not attached)."""
        if self.netd is None:
            return {}
        reply = await self._request({"op": "stats", "id": sandbox_id})
        return dict(reply.get("sandboxes", {}).get(sandbox_id, {}))

    async def refresh(self) -> None:
        """Read netd's counters for ``figures`` and ``totals`` (the reaper does, once a second)."""
        if self.netd is not None and self.netd.running:
            await self.stats()

    def totals(self) -> dict[str, int]:
        """Counters over every sandbox since this engine started (replaced netds' included)."""
        names = set(self._totals) | set(self._totals_before)
        return {name: self._totals.get(name, 0) + self._totals_before.get(name, 0) for name in names}

    async def splice(self, sandbox_id: str, outside: socket.socket, inside: socket.socket) -> None:
        """Have netd pass bytes between a host connection and one into the sandbox (exposed ports)."""
        await self._request({"op": "splice", "id": sandbox_id}, [outside.fileno(), inside.fileno()])

    async def expose(self, sandbox_id: str, port: int, connect: Callable[[], Awaitable[socket.socket]]) -> int:
        """A port on the host's loopback whose connections reach ``port`` inside the sandbox through
        ``connect`` (called on each connection: it wakes a paused or suspended sandbox, as any call
        does); the same one when asked again."""
        exposure = self.exposed.get((sandbox_id, port))
        if exposure is None:
            exposure = self.exposed[(sandbox_id, port)] = Exposure(self, sandbox_id, port, connect)
        return exposure.host_port

    def unexpose(self, sandbox_id: str) -> None:
        """Close the sandbox's exposed ports (it is being destroyed)."""
        for key in [key for key in self.exposed if key[0] == sandbox_id]:
            self.exposed.pop(key).close()

    async def close(self) -> None:
        self.closing = True
        if self._watch is not None:
            self._watch.cancel()
        for exposure in self.exposed.values():
            exposure.close()
        self.exposed.clear()
        for held in self.listeners.values():
            for sock in held:
                sock.close()
        self.listeners.clear()
        self.policies.clear()
        if self.netd is not None:
            await self.netd.stop()
            self.netd = None

    # -- netd -----------------------------------------------------------------------------------

    async def _request(self, message: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        netd = await self._running()
        try:
            return await netd.request(message, fds)
        except NetdDied:
            await self._replace(netd)
            return await (await self._running()).request(message, fds)

    async def _running(self) -> Netd:
        async with self._starting:
            if self.netd is None or not self.netd.running:
                if self.netd is not None:
                    await self.netd.stop()
                require("net", "network policies (fanfold netd)")
                from ..net.ca import FleetCA

                self.ca = self.ca or await asyncio.to_thread(FleetCA.load_or_create, self.config.state_dir / "net-ca")
                await asyncio.to_thread(self._net_dir)
                self.netd = Netd(self._settings(), self.config.state_dir / "netd.log", self.config.net_user)
                await self.netd.start()
                # The CA's key never touches netd's argv or files: it comes over the control socket.
                await self.netd.request({"op": "ca", "cert": self.ca.cert_pem.decode(), "key": self.ca.key_pem.decode()})
                for sandbox_id, held in list(self.listeners.items()):  # a replaced netd gets them all again
                    scope = self.scopes.get(sandbox_id, "")
                    await self.netd.request({"op": "attach", "id": sandbox_id, "policy": self.policies[sandbox_id].to_wire(),
                                             "scope": scope, "quota": self.recording_quota(scope)},
                                            [s.fileno() for s in held])
                self._watch = asyncio.ensure_future(self._replace_when_dead(self.netd))
            return self.netd

    async def _replace_when_dead(self, netd: Netd) -> None:
        """A netd that dies (killed, a bug) is replaced at once: the sandboxes' listeners are ours,
        so their connections only wait in the backlog meanwhile."""
        assert netd.process is not None
        loop, pid = asyncio.get_running_loop(), netd.process.pid
        pidfd = os.pidfd_open(pid)
        try:
            ended = loop.create_future()
            loop.add_reader(pidfd, lambda: ended.done() or ended.set_result(None))
            try:
                await ended
            finally:
                loop.remove_reader(pidfd)
        finally:
            os.close(pidfd)
        if self.closing or self.netd is not netd:
            return
        log.warning("fanfold netd (pid %d) ended; starting another", pid)
        await self._replace(netd)
        try:
            await self._running()
        except InfrastructureError as err:
            log.error("could not start a new netd: %s; the next network call tries again", err)

    async def _replace(self, dead: Netd) -> None:
        async with self._starting:
            if self.netd is dead:
                await dead.stop()
                self._totals_before, self._totals = self.totals(), {}

    def _settings(self) -> dict[str, Any]:
        cfg = self.config
        return {"reachable": list(cfg.net_reachable), "hosts": {k: list(v) for k, v in cfg.net_hosts},
                "nameservers": list(cfg.net_dns), "net_dir": str(cfg.state_dir / "net"),
                "upstream_ca": cfg.net_ca_file, "cache_mb": cfg.net_cache_mb, "idle_timeout": cfg.net_idle_timeout}

    def _net_dir(self) -> None:
        """``<state>/net`` (recordings, the cache): netd's own, and no one else's."""
        where = self.config.state_dir / "net"
        where.mkdir(mode=0o700, exist_ok=True)
        if self.config.net_user and os.geteuid() == 0:
            entry = pwd.getpwnam(self.config.net_user)
            if where.stat().st_uid != entry.pw_uid:
                for path in [where, *where.rglob("*")]:
                    os.lchown(path, entry.pw_uid, entry.pw_gid)

    def _trust_fleet_ca(self, sandbox_id: str) -> None:
        """Write the sandbox's CA bundle (its own CAs and the fleet's) where its TLS variables point."""
        assert self.ca is not None
        root = self.backend.root(sandbox_id)
        fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            own = b""
            for path in SYSTEM_BUNDLES:
                try:
                    own = safefs.read(fd, path, limit=16 << 20)
                    break
                except FanfoldError:
                    continue
            with self.backend.as_root(sandbox_id):
                safefs.makedirs(fd, "/etc/fanfold")
                safefs.write(fd, FLEET_CA, self.ca.cert_pem)
                safefs.write(fd, CA_BUNDLE, own.rstrip(b"\n") + b"\n" + self.ca.cert_pem)
        finally:
            os.close(fd)


class Exposure:
    """A listener on the host's loopback for one sandbox port; netd carries the bytes."""

    def __init__(self, network: Network, sandbox_id: str, port: int,
                 connect: Callable[[], Awaitable[socket.socket]]) -> None:
        self.network, self.sandbox_id, self.port, self.connect = network, sandbox_id, port, connect
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.listener.bind(("127.0.0.1", 0))
            self.listener.listen(256)
            self.listener.setblocking(False)
        except OSError:
            self.listener.close()
            raise
        self.host_port: int = self.listener.getsockname()[1]
        self.task = asyncio.ensure_future(self._accept())
        self.passing: set[asyncio.Task[None]] = set()

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self.listener)
            except OSError:
                return  # closed
            task = asyncio.ensure_future(self._pass(conn))
            self.passing.add(task)
            task.add_done_callback(self.passing.discard)

    async def _pass(self, conn: socket.socket) -> None:
        with conn:
            try:
                inside = await self.connect()
            except Exception:  # nothing listens there, or the sandbox is gone: the client sees a close
                return
            with inside:
                try:
                    await self.network.splice(self.sandbox_id, conn, inside)
                except InfrastructureError:
                    return

    def close(self) -> None:
        self.task.cancel()
        for task in self.passing:
            task.cancel()
        self.listener.close()
