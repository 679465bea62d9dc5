"""Sandbox networks on the real runtime: policies enforced by the egress proxy against an "outside"
the tests make (tests/outside.py), raw traffic with nowhere to go, policies changed at run time,
fork, suspend and pools keeping them, ports exposed to the host, and nothing left behind."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import urllib.request

import pytest

from fanfold import CreateParams, EngineConfig, Fleet
from fanfold.errors import FanfoldError, InvalidRequest

CURL = "curl -sS --max-time 10"


@pytest.fixture(scope="module")
def net_config(config: EngineConfig, outside) -> EngineConfig:
    return dataclasses.replace(config, net_dns=(outside.dns,))


@pytest.fixture(scope="module")
def fleet(net_config: EngineConfig):
    with Fleet(config=net_config) as handle:
        yield handle


def fetch(sandbox, url: str, *args: str) -> tuple[int, str, dict[str, str]]:
    """(status, body, headers) of a request from inside the sandbox, through its proxy variables."""
    result = sandbox.exec(f"{CURL} -o /tmp/body -D /tmp/head {' '.join(args)} {url}; echo rc=$?")
    assert "rc=0" in result.text, result.stderr
    head = sandbox.files.read("/tmp/head").decode()
    status = int(head.split()[1])
    headers = {}
    for line in head.splitlines()[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, sandbox.files.read("/tmp/body").decode(), headers


def test_allowed_names_pass_and_the_rest_are_refused_with_the_reason(fleet, outside):
    seen = len(outside.requests())
    with fleet.create(network={"allow": ["www.outside.test", "*.example", "api.outside.test:8080"],
                               "deny": ["bad.example"]}) as box:
        assert box.info.network == {"allow": ["www.outside.test", "*.example", "api.outside.test:8080"],
                                    "deny": ["bad.example"]}
        assert fetch(box, "http://www.outside.test/hello")[:2] == (200, "hello from www.outside.test")
        assert fetch(box, "http://other.example/hello")[:2] == (200, "hello from other.example")
        assert fetch(box, "http://api.outside.test:8080/hello")[:2] == (200, "hello from api.outside.test:8080")
        status, body, headers = fetch(box, "http://api.outside.test/hello")  # port 80: the rule names 8080
        assert status == 403 and "no allow rule matches api.outside.test:80" in headers["x-fanfold-denied"]
        assert "api.outside.test" in body
        status, _, headers = fetch(box, "http://bad.example/hello")
        assert status == 403 and "denied by rule 'bad.example'" in headers["x-fanfold-denied"]
        stats = box.network_stats()
        assert stats["requests"] >= 5 and stats["denied"] == 2 and stats["bytes_down"] > 0
        assert any("bad.example" in reason for reason in stats["recent_denials"])
    hosts = [r["host"] for r in outside.requests()[seen:]]
    assert "bad.example" not in hosts and "api.outside.test" not in hosts  # refused before any connection


def test_https_passes_through_unbroken_when_the_name_matches(fleet, outside):
    with fleet.create(network={"allow": ["www.outside.test"]}) as box:
        box.files.write("/tmp/ca.pem", outside.ca_pem.read_bytes())
        ok = box.exec(f"{CURL} --cacert /tmp/ca.pem https://www.outside.test/hello")
        assert ok.ok and ok.text == "hello from www.outside.test", ok.stderr
        # The certificate the sandbox saw is the outside's own: the proxy terminated nothing.
        denied = box.exec(f"{CURL} --cacert /tmp/ca.pem https://api.outside.test/hello")
        assert denied.exit_code == 56 and b"403" in denied.stderr
        # A tunnel to an allowed name whose TLS names another host is cut before the handshake.
        fronted = box.exec(["python3", "-c", SNI_MISMATCH])
        assert fronted.ok and fronted.text.startswith("refused"), fronted.text + fronted.stderr.decode()
        assert any("TLS server name api.outside.test differs" in r for r in box.network_stats()["recent_denials"])


SNI_MISMATCH = """
import socket, ssl
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(b"CONNECT www.outside.test:443 HTTP/1.1\\r\\nHost: www.outside.test:443\\r\\n\\r\\n")
assert s.recv(4096).startswith(b"HTTP/1.1 200")
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
try:
    ctx.wrap_socket(s, server_hostname="api.outside.test")
    print("handshake done")
except (ssl.SSLError, OSError) as err:
    print("refused", err)
"""


def test_special_addresses_are_refused_whatever_the_name(fleet, outside):
    with fleet.create(network={"allow": ["*.outside.test", "203.0.113.0/24", "10.0.0.0/8"]}) as box:
        for name, why in [("metadata.outside.test", "link-local"), ("internal.outside.test", "private"),
                          ("loop.outside.test", "loopback")]:
            status, _, headers = fetch(box, f"http://{name}/hello")
            assert status == 403 and why in headers["x-fanfold-denied"], (name, headers)
        status, _, headers = fetch(box, f"http://{outside.host_address}/hello")  # the host's own address
        assert status == 403 and "host itself" in headers["x-fanfold-denied"]
        assert fetch(box, f"http://{outside.address}/hello")[:2] == (200, f"hello from {outside.address}")


def test_an_operator_may_make_a_private_range_reachable(net_config, outside):
    reachable = dataclasses.replace(net_config, net_reachable=("10.238.77.0/24",))
    with Fleet(config=reachable) as fleet, fleet.create(network={"allow": ["internal.outside.test"]}) as box:
        assert fetch(box, "http://internal.outside.test/hello")[:2] == (200, "hello from internal.outside.test")
        status, _, _ = fetch(box, "http://metadata.outside.test/hello")
        assert status == 403


RAW = """
import socket, sys
for family, kind, where in [(socket.AF_INET, socket.SOCK_STREAM, ("203.0.113.2", 80)),
                            (socket.AF_INET, socket.SOCK_DGRAM, ("203.0.113.2", 53)),
                            (socket.AF_INET6, socket.SOCK_STREAM, ("2001:db8::1", 80))]:
    s = socket.socket(family, kind)
    s.settimeout(3)
    try:
        s.connect(where) if kind == socket.SOCK_STREAM else s.sendto(b"x" * 30, where)
        print("reached", where)
    except OSError as err:
        print("blocked", where, err.errno)
try:
    socket.getaddrinfo("www.outside.test", 80)
    print("resolved")
except OSError:
    print("no dns")
"""


def test_raw_tcp_udp_dns_and_route_changes_have_nowhere_to_go(fleet, outside):
    with fleet.create(network={"allow": ["www.outside.test"]}) as box:
        asked = len(outside.queries())
        raw = box.exec(["python3", "-c", RAW])
        assert raw.ok and "reached" not in raw.text and raw.text.count("blocked") == 3, raw.text
        assert "no dns" in raw.text
        bypass = box.exec(f"{CURL} --noproxy '*' http://203.0.113.2/hello")
        assert bypass.exit_code == 7  # couldn't connect: no route
        tunnel = box.exec("dig +time=1 +tries=1 @203.0.113.2 secret-data.outside.test 2>&1 ||"
                          " nslookup -timeout=1 secret-data.outside.test 203.0.113.2 2>&1; true")
        assert "hello" not in tunnel.text
        routes = box.exec("ip route add default dev lo 2>&1; ip link add x type veth peer name y 2>&1;"
                          " ip addr add 203.0.113.77/24 dev lo 2>&1; true")
        assert routes.text.count("Operation not permitted") == 3, routes.text
        assert box.exec("ip route show").text.strip() == ""
        assert fetch(box, "http://www.outside.test/hello")[0] == 200  # the proxy still works after all that
        assert not [q for q in outside.queries()[asked:] if "secret-data" in q["name"]]


def test_a_policy_changes_while_the_sandbox_runs(fleet, outside):
    with fleet.create() as box:
        assert box.info.network == "none"
        assert "HTTP_PROXY" not in box.exec("env").text
        assert box.exec(f"{CURL} http://www.outside.test/hello").exit_code != 0
        box.set_network({"allow": ["www.outside.test", "files.outside.test", "pypi.outside.test"]})  # setup phase
        assert fetch(box, "http://www.outside.test/hello")[0] == 200
        pip = box.exec("cd /tmp && python3 -m pip download --no-deps --disable-pip-version-check --index-url"
                       " http://pypi.outside.test/simple --trusted-host pypi.outside.test --trusted-host"
                       " files.outside.test fanfold-probe", timeout=120)
        assert pip.ok, pip.stderr
        assert box.exec("ls /tmp/*.whl").text.strip().startswith("/tmp/fanfold_probe-1.0")
        box.set_network({"allow": ["api.outside.test"]})  # the agent phase: installs are over
        assert fetch(box, "http://www.outside.test/hello")[0] == 403
        assert fetch(box, "http://api.outside.test/hello")[0] == 200
        info = box.set_network("none")
        assert info.network == "none" and box.refresh().network == "none"
        closed = box.exec(f"{CURL} http://api.outside.test/hello")
        assert closed.exit_code in (6, 7)  # no proxy variables, and the port is closed inside
        assert "HTTP_PROXY" not in box.exec("env").text


def test_cut_ends_a_connection_that_is_already_open(fleet, outside):
    with fleet.create(network={"allow": ["www.outside.test"]}) as box:
        slow = box.exec("(curl -sS --max-time 60 http://www.outside.test/slow/cut-me > /tmp/slow.out 2>&1;"
                        " echo rc=$? >> /tmp/slow.out) & echo started")
        assert slow.ok
        wait_until(lambda: any(r["path"] == "/slow/cut-me" for r in outside.requests()))
        box.set_network({"allow": ["www.outside.test"]}, cut=True)
        done = box.exec("for i in $(seq 100); do grep -q rc= /tmp/slow.out && break; sleep 0.1; done; cat /tmp/slow.out")
        outside.release("cut-me")
        assert "rc=0" not in done.text and "rc=" in done.text, done.text


def hold_port(sandbox, port: int) -> None:
    """A process in the sandbox listening on 127.0.0.1:``port``, up before this returns."""
    sandbox.exec(f"(setsid python3 -c 'import socket,time; s=socket.socket(); s.bind((\"127.0.0.1\",{port}));"
                 " s.listen(); time.sleep(600)' >/dev/null 2>&1 &)")
    wait_until(lambda: f":{port:04X} " in sandbox.exec("cat /proc/net/tcp").text)


def wait_until(check, attempts: int = 200) -> None:
    import time

    for _ in range(attempts):
        if check():
            return
        time.sleep(0.05)
    raise AssertionError("condition never held")


def test_fork_suspend_resume_and_reset_keep_the_policy(fleet, outside):
    with fleet.create(network={"allow": ["www.outside.test"]}) as box:
        assert fetch(box, "http://www.outside.test/hello")[0] == 200
        fork = box.fork(2)
        with fork:
            for child in fork.children:
                assert child.info.network == {"allow": ["www.outside.test"], "deny": []}
                assert fetch(child, "http://www.outside.test/hello")[:2] == (200, "hello from www.outside.test")
                assert fetch(child, "http://api.outside.test/hello")[0] == 403
        box.suspend()
        assert fetch(box, "http://www.outside.test/hello")[0] == 200  # resumed by the call, listener and all
        box.reset()
        assert fetch(box, "http://www.outside.test/hello")[0] == 200


def test_a_warm_pool_hands_out_sandboxes_with_a_policy(fleet, outside):
    fleet.pool("host", 2, wait=60)
    try:
        with fleet.create(network={"allow": ["www.outside.test"]}) as box:
            assert fleet.pools()[0].handouts >= 1
            assert fetch(box, "http://www.outside.test/hello")[0] == 200
            assert fetch(box, "http://api.outside.test/hello")[0] == 403
    finally:
        fleet.pool("host", 0)


def test_bad_policies_are_clear_errors(fleet):
    for bad, words in [({"allow": ["*"]}, "neither a host name"), ({"allow": "pypi.org"}, "must be a list"),
                       ({"allow": ["a.test:99999"]}, "bad port"), ({"permit": []}, "unknown keys"),
                       ("everything", "not a network policy")]:
        with pytest.raises(InvalidRequest, match=words):
            fleet.create(network=bad)
    with fleet.create() as box, pytest.raises(InvalidRequest, match="egress proxy"):
        box.expose(3128)


def test_a_port_taken_inside_is_a_clear_error_not_a_stolen_port(fleet):
    port_taken_is_refused(fleet)


def port_taken_is_refused(fleet) -> None:
    """A policy whose proxy port a process of the sandbox holds is refused, and the sandbox keeps none."""
    with fleet.create() as box:
        hold_port(box, 3128)
        with pytest.raises(InvalidRequest, match="port 3128 is taken"):
            box.set_network({"allow": ["www.outside.test"]})
        assert box.refresh().network == "none"


SERVICE = ("cd /tmp && echo inside > index.html && (setsid python3 -m http.server 8000 >/dev/null 2>&1 &);"
           " for i in $(seq 100); do python3 -c 'import socket; socket.create_connection((\"127.0.0.1\",8000))'"
           " 2>/dev/null && break; sleep 0.05; done")


def test_an_exposed_port_is_reached_from_the_host_and_survives_suspend(fleet):
    exposed_port_survives_suspend(fleet)


def exposed_port_survives_suspend(fleet) -> None:
    """A service's port exposed on the host's loopback answers, and again after suspend and resume."""
    with fleet.create() as box:
        assert box.exec(SERVICE).ok
        url = box.expose(8000)
        assert url.startswith("http://127.0.0.1:") and box.expose(8000) == url
        assert urllib.request.urlopen(f"{url}/index.html", timeout=10).read() == b"inside\n"
        box.suspend()
        box.resume()
        assert urllib.request.urlopen(f"{url}/index.html", timeout=10).read() == b"inside\n"
    with pytest.raises(OSError):  # gone with its sandbox
        urllib.request.urlopen(f"{url}/index.html", timeout=5)


def test_a_connection_to_an_exposed_port_wakes_a_paused_or_suspended_sandbox(fleet):
    with fleet.create() as box:
        assert box.exec(SERVICE).ok
        url = box.expose(8000)
        box.pause()
        assert urllib.request.urlopen(f"{url}/index.html", timeout=10).read() == b"inside\n"
        assert box.refresh().state == "running"
        box.suspend()
        assert box.refresh().state == "suspended"
        assert urllib.request.urlopen(f"{url}/index.html", timeout=10).read() == b"inside\n"
        assert box.refresh().state == "running"


def test_a_netd_that_dies_is_replaced_with_every_sandbox_attached(net_config):
    from fanfold.engine import Engine
    import asyncio

    async def run() -> None:
        engine = Engine(net_config)
        await engine.start()
        try:
            one = await engine.create(CreateParams(network={"allow": ["www.outside.test"]}))
            two = await engine.create(CreateParams(network={"allow": ["api.outside.test"]}))
            netd = engine.life.network.netd
            assert netd is not None and netd.process is not None
            pid = netd.process.pid
            os.kill(pid, signal.SIGKILL)
            await asyncio.to_thread(netd.process.wait)
            # Another starts at once, with both attached again (their counters start over).
            assert (await engine.network_stats(one.id))["requests"] == 0
            for info, host in [(one, "www"), (two, "api")]:
                result = await engine.exec(info.id, f"{CURL} http://{host}.outside.test/hello")
                assert result.text == f"hello from {host}.outside.test", result.stderr
            assert engine.life.network.netd.process.pid != pid
        finally:
            await engine.close()
        assert engine.life.network.netd is None and not engine.life.network.listeners

    asyncio.run(run())


def test_a_burst_of_policy_sandboxes_leaves_nothing_behind(net_config, outside):
    from fanfold.engine import Engine
    import asyncio

    async def run() -> None:
        engine = Engine(net_config)
        await engine.start()
        network = engine.life.network
        try:
            allow = CreateParams(network={"allow": ["www.outside.test"]})
            made = await asyncio.gather(*(engine.create(allow) for _ in range(12)))
            results = await asyncio.gather(*(engine.exec(i.id, f"{CURL} http://www.outside.test/hello") for i in made))
            assert all(r.text == "hello from www.outside.test" for r in results)
            assert len(network.listeners) == 12
            pid = network.netd.process.pid
            fds_before = len(os.listdir(f"/proc/{pid}/fd"))
            await asyncio.gather(*(engine.kill(i.id) for i in made))
            assert network.listeners == {} and await engine.life.network.stats() == {}
            assert len(os.listdir(f"/proc/{pid}/fd")) <= fds_before - 12  # netd closed each listener
        finally:
            await engine.close()
        assert not os.path.exists(f"/proc/{pid}")

    asyncio.run(run())


def test_the_info_of_a_sandbox_made_by_another_engine_keeps_its_policy_and_gets_a_proxy(net_config, outside):
    from fanfold.engine import Engine
    import asyncio

    async def run() -> None:
        first = Engine(net_config)
        await first.start()
        info = await first.create(CreateParams(network={"allow": ["www.outside.test"]}, detached=True))
        await first.close()  # its netd ends; the detached sandbox lives on
        second = Engine(net_config)
        await second.start()
        try:
            got = await second.get(info.id)
            assert got.network == {"allow": ["www.outside.test"], "deny": []}
            result = await second.exec(info.id, f"{CURL} http://www.outside.test/hello")
            assert result.text == "hello from www.outside.test", result.stderr
        finally:
            await second.kill(info.id)
            await second.close()

    asyncio.run(run())


def test_the_proxy_runs_unprivileged(fleet):
    with fleet.create(network={"allow": ["www.outside.test"]}) as box:
        box.exec(f"{CURL} http://www.outside.test/hello")
        pids = [p for p in os.listdir("/proc") if p.isdigit() and _is_netd(p)]
        assert pids
        for pid in pids:
            uids = next(line for line in open(f"/proc/{pid}/status") if line.startswith("Uid:")).split()[1:]
            assert set(uids) == {"65534"}, uids


def _is_netd(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"fanfold.net.daemon" in handle.read()
    except OSError:
        return False


def test_policies_round_trip_through_json():
    from fanfold.net.policy import NetworkPolicy

    policy = NetworkPolicy.parse({"allow": ["a.test", "*.b.test", "10.0.0.0/8:443", "[2001:db8::/32]:80"],
                                  "deny": ["c.b.test"]})
    assert NetworkPolicy.parse(json.loads(json.dumps(policy.to_wire()))) == policy
    assert NetworkPolicy.parse("open").to_wire() == "open"
    assert NetworkPolicy.parse("none") is None


def test_traffic_shows_in_stats_and_metrics(net_config, outside):
    from fanfold.engine import Engine
    import asyncio

    async def run() -> None:
        engine = Engine(net_config)
        await engine.start()
        try:
            info = await engine.create(CreateParams(network={"allow": ["www.outside.test"]}))
            for host in ("www", "www", "api"):
                await engine.exec(info.id, f"{CURL} -o /dev/null http://{host}.outside.test/bytes/10000")
            await engine.life.network.refresh()  # what the reaper does once a second
            stats = await engine.stats()
            row = next(s for s in stats["sandboxes"] if s["id"] == info.id)
            assert row["net_requests"] == 3 and row["net_denied"] == 1 and row["net_bytes_down"] >= 20000
            assert stats["network"]["requests"] >= 3 and stats["network"]["denied"] >= 1
            await engine.kill(info.id)
            await engine.life.network.refresh()
            text = (await engine.metrics_text()).decode()
            assert "fanfold_network_requests_total 3.0" in text and "fanfold_network_denied_total 1.0" in text
            assert 'fanfold_network_bytes_total{direction="in"}' in text
            assert "fanfold_network_cache_hits_total 0.0" in text and "fanfold_network_replayed_total 0.0" in text
        finally:
            await engine.close()

    asyncio.run(run())


RAW_HOST = """
import socket, sys
s = socket.create_connection(("203.0.113.2", 80), timeout=10)
s.sendall(("GET /hello HTTP/1.1\\r\\nHost: %s\\r\\nConnection: close\\r\\n\\r\\n" % sys.argv[1]).encode())
data = b""
while chunk := s.recv(65536):
    data += chunk
print(data.decode().split("\\r\\n\\r\\n", 1)[-1] or "closed")
"""


def test_transparent_capture_filters_tools_that_ignore_proxy_variables(fleet, outside):
    with fleet.create(network={"allow": ["www.outside.test"], "transparent": True}) as box:
        asked = len(outside.queries())
        direct = box.exec(f"{CURL} --noproxy '*' http://www.outside.test/hello")
        assert direct.ok and direct.text == "hello from www.outside.test", direct.stderr
        box.files.write("/tmp/ca.pem", outside.ca_pem.read_bytes())
        tls = box.exec(f"{CURL} --noproxy '*' --cacert /tmp/ca.pem https://www.outside.test/hello")
        assert tls.ok and tls.text == "hello from www.outside.test", tls.stderr  # passed through: the outside's cert
        denied = box.exec(f"{CURL} --noproxy '*' http://api.outside.test/hello")
        assert denied.exit_code == 6  # the name does not resolve: its query never left
        fronted = box.exec(["python3", "-c", RAW_HOST, "api.outside.test"])  # an allowed address, a denied name
        assert fronted.text.strip() == "closed", fronted.text
        assert box.exec(["python3", "-c", RAW_HOST, "www.outside.test"]).text.strip() == "hello from www.outside.test"
        other_udp = box.exec(["python3", "-c", "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM);"
                              " s.sendto(b'x', ('203.0.113.2', 123))"])
        assert b"Operation not permitted" in other_udp.stderr
        assert box.exec(f"{CURL} http://www.outside.test/hello").text == "hello from www.outside.test"  # the proxy too
        stats = box.network_stats()
        assert stats["denied"] >= 2 and any("api.outside.test" in r for r in stats["recent_denials"])
        assert not [q for q in outside.queries()[asked:] if "api" in q["name"]]
        fork = box.fork(1)
        with fork:
            again = fork.children[0].exec(f"{CURL} --noproxy '*' http://www.outside.test/hello")
            assert again.text == "hello from www.outside.test", again.stderr
        box.set_network({"allow": ["api.outside.test"], "transparent": True})
        assert box.exec(f"{CURL} --noproxy '*' http://api.outside.test/hello").text == "hello from api.outside.test"
        box.set_network({"allow": ["api.outside.test"]})  # capture off: tools without the proxy variables get nothing
        assert box.exec(f"{CURL} --noproxy '*' http://api.outside.test/hello").exit_code != 0
        assert box.exec(f"{CURL} http://api.outside.test/hello").text == "hello from api.outside.test"


def test_a_cidr_rule_lets_no_name_be_resolved_so_dns_carries_nothing_out(fleet, outside):
    with fleet.create(network={"allow": ["203.0.113.0/24"]}) as box:
        asked = len(outside.queries())
        assert fetch(box, "http://203.0.113.2/hello")[:2] == (200, "hello from 203.0.113.2")
        status, _, headers = fetch(box, "http://secret-4242.www.outside.test/hello")
        assert status == 403 and "no allow rule matches" in headers["x-fanfold-denied"]
        assert not [q for q in outside.queries()[asked:] if "secret-4242" in q["name"]]


def test_a_failed_switch_to_transparent_capture_keeps_the_policy_it_had(fleet, outside):
    with fleet.create(network={"allow": ["www.outside.test"]}) as box:
        hold_port(box, 3129)
        with pytest.raises(FanfoldError, match="Address already in use"):
            box.set_network({"allow": ["www.outside.test"], "transparent": True})
        assert box.refresh().network == {"allow": ["www.outside.test"], "deny": []}
        assert fetch(box, "http://www.outside.test/hello")[0] == 200


def test_netd_answers_the_counters_of_thousands_of_sandboxes_in_one_reply():
    import asyncio
    import socket as socketlib

    from fanfold.net.daemon import Daemon
    from fanfold.net.policy import NetworkPolicy, Reachable
    from fanfold.net.proxy import Proxy
    from fanfold.net.resolve import Resolver
    from fanfold.net.state import NetStats, SandboxNet

    daemon = Daemon(Proxy(Resolver(), Reachable()))
    for number in range(5000):
        stats = NetStats(requests=number)
        for _ in range(20):
            stats.deny("GET http://" + "x" * 200, "no allow rule matches it")
        daemon.sandboxes[f"sb-{number:012x}"] = SandboxNet(id=f"sb-{number:012x}", policy=NetworkPolicy(), stats=stats)
    reply = asyncio.run(daemon.handle({"op": "stats"}, []))
    wire = json.dumps(reply).encode()
    assert len(reply["sandboxes"]) == 5000 and reply["totals"]["denied"] == 100000
    assert "recent_denials" not in reply["sandboxes"]["sb-000000000001"] and len(wire) < 4 << 20
    one = asyncio.run(daemon.handle({"op": "stats", "id": "sb-000000000001"}, []))
    assert len(one["sandboxes"]["sb-000000000001"]["recent_denials"]) == 20
    ours, theirs = socketlib.socketpair(socketlib.AF_UNIX, socketlib.SOCK_SEQPACKET)
    with ours, theirs:  # what the engine sets up: one message carries the whole reply
        theirs.setsockopt(socketlib.SOL_SOCKET, 32, 16 << 20)
        ours.setsockopt(socketlib.SOL_SOCKET, 33, 16 << 20)
        theirs.sendall(wire)
        assert len(ours.recv(16 << 20)) == len(wire)
