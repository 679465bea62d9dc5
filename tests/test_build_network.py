"""Build ``run`` steps reach the outside through NAT and nothing of the host (``host.stepnet``).

``nat_outside`` is a network namespace this module makes, behind a veth from the host (198.18.0.0/15),
with an HTTP server that also answers as the metadata address 169.254.169.254 (routed to it for the
module): if the filter let anything through, the probes would reach it, and nothing leaves the host.
``outside`` (tests/outside.py) has a public-looking address and a private one, and DNS on both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import http.server
import ipaddress
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import TOKENS, run_cli
from fanfold import AsyncFleet, EnvSpec, InvalidRequest, Unauthorized
from fanfold.engine import Engine
from fanfold.engine.network import build_refused
from fanfold.images import Image, LayerStore
from fanfold.host import cgroups, stepnet
from outside import ADDRESS, PRIVATE_ADDRESS

OUTSIDE_NS = f"fanfold-test-outside-{os.getpid()}"
OUTSIDE_VETH = f"ffto{os.getpid() % 100000}"
HOST_SIDE, OUTSIDE = "198.18.0.1", "198.18.0.2"
METADATA = "169.254.169.254"

# Run in the step by the host image's python3: fetch each URL (a short timeout) and note what came back.
PROBE = """
import json, sys, time, urllib.request
routes = [l.split() for l in open("/proc/net/route").read().splitlines()[1:]]
gateway = next((".".join(str(b) for b in reversed(bytes.fromhex(r[2]))) for r in routes if r[1] == "00000000"), "none")
iflink = open("/sys/class/net/eth0/iflink").read().strip() if gateway != "none" else ""
results = {"iflink": iflink}
for name, url in json.loads(sys.argv[1]).items():
    started = time.monotonic()
    try:
        outcome = "ok:" + urllib.request.urlopen(url.replace("GATEWAY", gateway), timeout=3).read().decode()
    except Exception as err:
        outcome = type(err).__name__ + ": " + str(getattr(err, "reason", err))
    results[name] = {"outcome": outcome, "seconds": time.monotonic() - started}
open("/probes.json", "w").write(json.dumps(results))
"""


def sh(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30)


def probe_spec(urls: dict[str, str]) -> EnvSpec:
    """A build whose one step probes ``urls`` (never cached: the nonce) and keeps what it saw."""
    command = f"python3 -c {shlex.quote(PROBE)} {shlex.quote(json.dumps(urls))} # {time.time_ns()}"
    return EnvSpec("host").run(command)


def probes(config, image) -> dict:
    """What the image's probing step saw, read from its layer."""
    return json.loads((LayerStore(config.state_dir).layer_path(image.layers[-1]) / "probes.json").read_text())


def ours(config) -> dict[str, list[str]]:
    """The build networks of this state dir's engines still on the host."""
    netns = sorted(p.name for p in stepnet.NETNS_DIR.glob(f"fanfold-{config.tag}-build-*"))
    tables = [t for t in sh("nft", "list", "tables").stdout.split() if t.startswith(f"fanfold_{config.tag}_build_")]
    return {"netns": netns, "tables": tables}


def veth_gone(iflink: str, timeout: float = 5.0) -> bool:
    """Whether the host's end of a build's veth (its ifindex) is gone; a namespace's devices go a moment after it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if iflink not in _ifindexes():
            return True
        time.sleep(0.05)
    return False


def _ifindexes() -> set[str]:
    found = set()
    for device in Path("/sys/class/net").iterdir():
        try:
            found.add((device / "ifindex").read_text().strip())
        except OSError:
            pass  # a device going away meanwhile (EINVAL, ENOENT)
    return found


@pytest.fixture(scope="module")
def nat_outside(tmp_path_factory):
    """An HTTP server in a namespace of its own, answering ``outside`` on OUTSIDE and METADATA, port 80."""
    root = tmp_path_factory.mktemp("outside")
    (root / "probe").write_text("outside")
    sh("ip", "netns", "add", OUTSIDE_NS)
    server = None
    try:
        sh("ip", "link", "add", OUTSIDE_VETH, "type", "veth", "peer", "name", "eth0", "netns", OUTSIDE_NS)
        sh("ip", "addr", "add", f"{HOST_SIDE}/30", "dev", OUTSIDE_VETH)
        sh("ip", "link", "set", OUTSIDE_VETH, "up")
        sh("ip", "route", "add", f"{METADATA}/32", "via", OUTSIDE)  # the metadata address, faked out there
        for command in (["link", "set", "lo", "up"], ["addr", "add", f"{OUTSIDE}/30", "dev", "eth0"],
                        ["addr", "add", f"{METADATA}/32", "dev", "lo"], ["link", "set", "eth0", "up"]):
            sh("ip", "-n", OUTSIDE_NS, *command)
        server = subprocess.Popen(["ip", "netns", "exec", OUTSIDE_NS, sys.executable, "-m", "http.server", "80",
                                   "--bind", "0.0.0.0", "--directory", str(root)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://{OUTSIDE}/probe", timeout=1).text == "outside":
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "the outside server did not start"
            time.sleep(0.05)
        yield
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        subprocess.run(["ip", "netns", "del", OUTSIDE_NS], check=False)  # its veth and route go with it


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"host")

    def log_message(self, *args: object) -> None:
        pass


class _DualStack(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


@pytest.fixture(scope="module")
def host_service():
    """A careless host service: on every address of the host (0.0.0.0 and ::), answering ``host``."""
    server = _DualStack(("::", 0), _Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(timeout=30)


@pytest.fixture(scope="module", autouse=True)
def nothing_left(config):
    yield
    assert ours(config) == {"netns": [], "tables": []}


def host_addresses() -> list[str]:
    """The host's own addresses but loopback's and the test veth's, as URL hosts."""
    found = []
    for link in json.loads(sh("ip", "-j", "addr").stdout):
        if link["ifname"] in ("lo", OUTSIDE_VETH) or link["ifname"].startswith(stepnet.VETH_PREFIX):
            continue
        for info in link.get("addr_info", []):
            if info.get("scope") == "global":
                found.append(f"[{info['local']}]" if ":" in info["local"] else info["local"])
    return found


def blocked(result: dict) -> bool:
    return not result["outcome"].startswith("ok:")


async def test_isolated_steps_reach_the_outside_and_nothing_of_the_host(config, nat_outside, host_service):
    port = host_service
    urls = {"outside": f"http://{OUTSIDE}/probe", "metadata": f"http://{METADATA}/probe",
            "loopback": f"http://127.0.0.1:{port}/", "loopback6": f"http://[::1]:{port}/",
            "gateway": f"http://GATEWAY:{port}/"}
    urls.update({f"host {address}": f"http://{address}:{port}/" for address in host_addresses()})
    async with AsyncFleet(config=config) as fleet:
        image = await fleet.build(probe_spec(urls))
    seen = probes(config, image)
    assert seen["outside"]["outcome"] == "ok:outside", seen  # egress through NAT
    for name in urls.keys() - {"outside"}:
        assert blocked(seen[name]), (name, seen[name])
    # Refused, not dropped: a step that tries the metadata address fails at once, not after its timeout.
    assert seen["metadata"]["seconds"] < 1.5, seen["metadata"]
    assert len(urls) > 5, "the host has no address of its own to probe"
    assert veth_gone(seen["iflink"])
    assert ours(config) == {"netns": [], "tables": []}


async def test_the_hosts_own_tenant_may_build_on_the_hosts_network(config, server, host_service):
    urls = {"loopback": f"http://127.0.0.1:{host_service}/"}
    async with AsyncFleet(config=config) as fleet:
        embedded = await fleet.build(probe_spec(urls), network="host")
    async with AsyncFleet(server.unix_url) as local:  # the unix socket: the host's own tenant
        remote = await local.build(probe_spec(urls), network="host")
    for image in (embedded, remote):
        assert probes(config, image)["loopback"]["outcome"] == "ok:host"


async def test_other_tenants_build_isolated_and_may_not_ask_for_the_hosts_network(config, server, nat_outside,
                                                                                     outside, host_service):
    urls = {"outside": f"http://{OUTSIDE}/probe", "loopback": f"http://127.0.0.1:{host_service}/",
            "gateway": f"http://GATEWAY:{host_service}/", "metadata": f"http://{METADATA}/probe",
            "public": f"http://{ADDRESS}/hello", "private": f"http://{PRIVATE_ADDRESS}/hello"}
    async with AsyncFleet(server.tcp_url, token=TOKENS["alice"]) as alice:
        with pytest.raises(Unauthorized, match=r"only the host's own tenant .*\(network=host\)"):
            await alice.build(probe_spec(urls), network="host")
        with pytest.raises(InvalidRequest, match="network must be one of isolated, host"):
            await alice.build(probe_spec(urls), network="bridge")  # type: ignore[arg-type]
        image = await alice.build(probe_spec(urls))
    seen = probes(config, image)
    assert seen["outside"]["outcome"] == "ok:outside", seen
    assert seen["public"]["outcome"] == f"ok:hello from {ADDRESS}", seen
    assert all(blocked(seen[name]) for name in ("loopback", "gateway", "metadata", "private")), seen
    async with AsyncFleet(server.unix_url) as local:  # the host's own tenant keeps the LAN
        assert probes(config, await local.build(probe_spec(urls)))["private"]["outcome"].startswith("ok:hello")
    async with httpx.AsyncClient(base_url=server.tcp_url, timeout=60,
                                 headers={"Authorization": f"Bearer {TOKENS['bob']}"}) as http:
        spec = {"base": "host", "steps": [{"kind": "run", "cmd": "true"}]}
        refused = await http.post("/v1/images", params={"network": "host"}, json=spec)
        unknown = await http.post("/v1/images", params={"network": "bridge"}, json=spec)
    assert refused.status_code == 401 and "network=host" in refused.json()["message"], refused.text
    assert unknown.status_code == 422 and "network must be one of" in unknown.json()["message"], unknown.text


async def test_a_tenants_steps_reach_no_range_the_proxy_refuses_where_the_operators_do(config, outside,
                                                                                        monkeypatch, tmp_path):
    """A server tenant's steps reach public addresses, not the operator's private ranges; the operator's
    steps reach both. Both resolve names through a resolver at a private address: port 53 stays open."""
    resolvers = tmp_path / "resolv.conf"
    resolvers.write_text(f"nameserver {PRIVATE_ADDRESS}\n")
    monkeypatch.setattr(stepnet, "resolv_conf", lambda: str(resolvers))  # the resolver a host's DHCP names
    urls = {"public": f"http://{ADDRESS}/hello", "private": f"http://{PRIVATE_ADDRESS}/hello",
            "named": "http://www.outside.test/hello"}
    engine = Engine(config)
    await engine.start()
    try:
        spec = probe_spec(urls)  # the same for both: what the operator's step got from the LAN serves no tenant
        operator = probes(config, await engine.build(spec))
        tenant = probes(config, await engine.build(spec, tenant="alice"))
    finally:
        await engine.close()
    for seen in (operator, tenant):
        assert seen["public"]["outcome"] == f"ok:hello from {ADDRESS}", seen
        assert seen["named"]["outcome"] == "ok:hello from www.outside.test", seen
    assert operator["private"]["outcome"] == f"ok:hello from {PRIVATE_ADDRESS}", operator
    assert blocked(tenant["private"]) and tenant["private"]["seconds"] < 1.5, tenant  # refused, not dropped
    assert ours(config) == {"netns": [], "tables": []}


async def test_a_tenants_steps_reach_what_the_operator_made_reachable(config, outside):
    engine = Engine(dataclasses.replace(config, net_reachable=(f"{PRIVATE_ADDRESS}/32",)))
    await engine.start()
    try:
        image = await engine.build(probe_spec({"private": f"http://{PRIVATE_ADDRESS}/hello"}), tenant="alice")
    finally:
        await engine.close()
    assert probes(config, image)["private"]["outcome"] == f"ok:hello from {PRIVATE_ADDRESS}"


def test_a_tenants_build_network_refuses_the_proxys_special_ranges_less_the_reachable_ones(config):
    refused = [ipaddress.ip_network(cidr) for cidr in build_refused(
        dataclasses.replace(config, net_reachable=("10.1.0.0/16", "100.64.0.0/10")))]
    def refuses(address: str) -> bool:
        return any(ipaddress.ip_address(address) in net for net in refused)
    assert all(refuses(a) for a in ("10.2.0.1", "10.0.0.1", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                                    "127.0.0.1", "224.0.0.1", "0.0.0.1"))
    assert not any(refuses(a) for a in ("10.1.2.3", "100.64.0.1", "8.8.8.8", ADDRESS, OUTSIDE))
    assert [str(net) for net in ipaddress.collapse_addresses(n for n in refused if n.version == 4)] == \
        [str(net) for net in refused if net.version == 4], "overlapping ranges: nft refuses them in one set"


async def test_a_dead_builders_network_is_swept_when_an_engine_starts(config):
    made = subprocess.run(
        [sys.executable, "-c", "import asyncio, os, sys\nfrom fanfold.host import stepnet\n"
         "net = stepnet.StepNetwork(sys.argv[1])\nprint(asyncio.run(net.netns()), os.getpid(), flush=True)\n"
         "os._exit(0)",
         config.tag], capture_output=True, text=True, timeout=60, check=True)
    path, builder = made.stdout.split()
    left = Path(path)
    assert left.exists() and ours(config)["tables"], "the dead builder left nothing to sweep"
    # And a step its runtime never recorded (killed mid-create): its process lives on in its cgroup.
    step = subprocess.Popen(["sleep", "60"])
    group = f"build-{builder}-0000dead"
    for directory in cgroups.sandbox_dirs(group):
        directory.mkdir()
        if "cpuset" not in directory.parent.name:  # an empty cpuset takes no task
            (directory / "cgroup.procs").write_text(str(step.pid))
    try:
        engine = Engine(config)
        await engine.start()  # reconciles: sweeps what dead owners left
        await engine.close()
        assert step.wait(timeout=10) == -9
    finally:
        step.kill()
        cgroups.remove_group(group)
    assert not left.exists()
    assert ours(config) == {"netns": [], "tables": []}
    assert not cgroups.top_groups(group)


async def test_a_cancelled_build_removes_its_network(config):
    async with AsyncFleet(config=config) as fleet:
        build = asyncio.ensure_future(fleet.build(EnvSpec("host").run(f"sleep 60 # {time.time_ns()}")))
        deadline = time.monotonic() + 30
        while not (made := ours(config)["netns"]) or not in_netns(inode := (stepnet.NETNS_DIR / made[0]).stat().st_ino):
            assert time.monotonic() < deadline and not build.done(), "the build's step did not start"
            await asyncio.sleep(0.02)
        build.cancel()  # with its step running in the namespace
        await asyncio.gather(build, return_exceptions=True)
        assert build.cancelled()
    assert ours(config) == {"netns": [], "tables": []}
    deadline = time.monotonic() + 10
    while in_netns(inode):
        assert time.monotonic() < deadline, "the cancelled step still runs"
        time.sleep(0.05)
    # However early the cancel came (before the runtime recorded the container, too), no group is left.
    assert not [d for root in ("/sys/fs/cgroup", *map(str, cgroups.v1_roots().values()), *map(str, cgroups.v2_roots()))
                for d in glob.glob(f"{root}/build-{os.getpid()}-*")]


def in_netns(inode: int) -> list[str]:
    """Pids of the processes in the network namespace whose inode is ``inode``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino == inode:
                found.append(pid)
        except OSError:
            pass  # gone meanwhile
    return found


def test_cli_builds_on_the_hosts_network_only_when_asked_and_allowed(config, server, host_service, tmp_path):
    spec = probe_spec({"loopback": f"http://127.0.0.1:{host_service}/"})
    (tmp_path / "spec.py").write_text(f"from fanfold import EnvSpec\nspec = EnvSpec('host').run({spec.steps[0].arg('cmd')!r})\n")
    refused = run_cli("--url", server.tcp_url, "--token", TOKENS["alice"], "build", "--network", "host",
                      str(tmp_path / "spec.py"))
    assert refused.returncode == 2 and "Unauthorized" in refused.stderr and "network=host" in refused.stderr
    isolated = run_cli("build", "--json", str(tmp_path / "spec.py"), timeout=300)
    host = run_cli("build", "--json", "--network", "host", str(tmp_path / "spec.py"), timeout=300)
    assert isolated.returncode == 0 and host.returncode == 0, isolated.stderr + host.stderr
    # Layers are keyed by network too: what a step fetched from the host's loopback never serves an isolated build.
    assert probes(config, Image.from_json(host.stdout))["loopback"]["outcome"] == "ok:host"
    assert blocked(probes(config, Image.from_json(isolated.stdout))["loopback"])
    assert run_cli("build", "--network", "bridge", str(tmp_path / "spec.py")).returncode == 2
