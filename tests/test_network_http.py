"""Sandboxes' networks through ``fanfold serve``: policies on create and at run time, traffic counts,
exposed ports under the caller's token, and the CLI, with the ``outside`` fixture as the internet.

The unix socket is the host's own tenant; TCP with a token is tenant alice or bob. The SDK is used
where the outcome is the point, raw HTTP where the route itself is.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from conftest import TOKENS, Server, run_cli, start_server, stop_server
from fanfold import EngineConfig, Fleet, InvalidRequest, QuotaExceeded, Sandbox
from outside import Outside

WWW = "www.outside.test"
API = "api.outside.test"
ALLOW_WWW = {"allow": [WWW]}
ECHO_PORT = 8000
IDLE_PORT = 8001
ECHO_SERVICE = r'''
import hashlib, http.server, json, sys


class Echo(http.server.BaseHTTPRequestHandler):
    """Answers any request with what it saw: method, path, headers, body length and digest."""

    def _body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                data += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return data
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _answer(self):
        body = self._body()
        seen = {"method": self.command, "path": self.path, "headers": dict(self.headers.items()),
                "length": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        out = json.dumps(seen).encode()
        self.send_response(201 if self.command == "POST" else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Set-Cookie", "first=1")
        self.send_header("Set-Cookie", "second=2")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Echo).serve_forever()
'''
WAIT_FOR_PORT = (
    "import socket, sys, time\n"
    "deadline = time.monotonic() + 20\n"
    "while True:\n"
    "    try:\n"
    "        socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=1).close()\n"
    "        break\n"
    "    except OSError:\n"
    "        if time.monotonic() > deadline:\n"
    "            sys.exit('nothing listens on port ' + sys.argv[1])\n"
    "        time.sleep(0.02)\n"
)


@pytest.fixture(scope="module")
def net_server(config: EngineConfig, outside: Outside, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose proxy resolves names through the outside's DNS (the session's has no FANFOLD_NET_DNS)."""
    running = start_server(config.state_dir, tmp_path_factory.mktemp("net-server"),
                           env={"FANFOLD_NET_DNS": outside.dns, "FANFOLD_PULL": "never"})
    children: set[int] = set()
    try:
        yield running
        children = _children(running.process.pid)
        with Fleet(running.unix_url) as host:
            assert [info.id for info in host.list()] == [], "the host tenant left sandboxes"
        for tenant in TOKENS:
            with Fleet(running.tcp_url, token=TOKENS[tenant]) as fleet:
                assert [info.id for info in fleet.list()] == [], f"{tenant} left sandboxes"
    finally:
        assert stop_server(running) == 0
    assert children, "the server started no netd"
    assert not [pid for pid in children if _alive(pid)], "netd outlived its server"


@pytest.fixture(scope="module")
def host(net_server: Server) -> Iterator[Fleet]:
    with Fleet(net_server.unix_url) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def alice(net_server: Server) -> Iterator[Fleet]:
    with Fleet(net_server.tcp_url, token=TOKENS["alice"]) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def bob(net_server: Server) -> Iterator[Fleet]:
    with Fleet(net_server.tcp_url, token=TOKENS["bob"]) as fleet:
        yield fleet


def api(server: Server, who: str | None) -> httpx.Client:
    """Raw HTTP as ``who``: "host" over the unix socket, a tenant's token over TCP, None for no token."""
    if who == "host":
        transport = httpx.HTTPTransport(uds=urlsplit(server.unix_url).path)
        return httpx.Client(base_url="http://localhost", transport=transport, timeout=60)
    headers = {"Authorization": f"Bearer {TOKENS[who]}"} if who else {}
    return httpx.Client(base_url=server.tcp_url, headers=headers, timeout=60)


def curl(sandbox: Sandbox, url: str, *args: str) -> tuple[int, str]:
    """``curl`` in the sandbox (through its proxy variables): exit status and output."""
    done = sandbox.exec(["curl", "-sS", "--max-time", "20", *args, url], timeout=30)
    return done.exit_code, done.stdout.decode() + done.stderr.decode()


def http_code(sandbox: Sandbox, url: str) -> str:
    return curl(sandbox, url, "-o", "/dev/null", "-w", "%{http_code}")[1]


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``condition`` (state outside this process: a log, a sandbox's file) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def start_echo(sandbox: Sandbox, port: int = ECHO_PORT) -> None:
    """The echo service, detached inside the sandbox, listening once this returns."""
    sandbox.files.write("/tmp/echo.py", ECHO_SERVICE)
    sandbox.files.write("/tmp/wait_for_port.py", WAIT_FOR_PORT)
    started = sandbox.exec(f"setsid python3 /tmp/echo.py {port} </dev/null >/tmp/echo.log 2>&1 &")
    assert started.exit_code == 0, started
    ready = sandbox.exec(["python3", "/tmp/wait_for_port.py", str(port)], timeout=30)
    assert ready.exit_code == 0, ready.stderr.decode() + sandbox.exec("cat /tmp/echo.log").stdout.decode()


def error_of(response: httpx.Response) -> str:
    """The message of an error answer, checked to be fanfold's own (a kind, no traceback)."""
    body = response.json()
    assert body["kind"] != "internal_error" and "Traceback" not in body["message"], body
    return body["message"]


# -- policies on create -------------------------------------------------------------------------------


def test_an_allow_list_reaches_its_names_only(alice: Fleet, net_server: Server, outside: Outside) -> None:
    with alice.create(network=ALLOW_WWW) as sandbox:
        assert sandbox.info.network["allow"] == [WWW] and not sandbox.info.network.get("deny")
        assert curl(sandbox, f"http://{WWW}/hello") == (0, f"hello from {WWW}")
        status, headers = curl(sandbox, f"http://{API}/hello", "-o", "/dev/null", "-D", "-")
        assert status == 0 and headers.startswith("HTTP/1.1 403"), headers
        denied = [line for line in headers.splitlines() if line.lower().startswith("x-fanfold-denied:")]
        assert len(denied) == 1 and API in denied[0], headers
        sandbox.files.write("/tmp/ca.pem", outside.ca_pem.read_bytes())
        tls = ("--cacert", "/tmp/ca.pem")  # CONNECT passes TLS through unbroken: the outside's own certificate
        assert curl(sandbox, f"https://{WWW}/hello", *tls) == (0, f"hello from {WWW}")
        status, output = curl(sandbox, f"https://{API}/hello", *tls)
        assert status != 0 and "403" in output, output
        with api(net_server, "alice") as http:
            assert http.get(f"/v1/sandboxes/{sandbox.id}").json()["network"]["allow"] == [WWW]


@pytest.mark.parametrize("who", ["host", "alice"])
def test_transparent_capture_works_over_http(who: str, request: pytest.FixtureRequest) -> None:
    """Every key of a network policy the engine takes, the server takes: here ``transparent``,
    which captures the traffic of tools that ignore the proxy variables."""
    fleet: Fleet = request.getfixturevalue(who)
    with fleet.create(network={"allow": [WWW], "transparent": True}) as sandbox:
        assert sandbox.info.network == {"allow": [WWW], "deny": [], "transparent": True}
        assert curl(sandbox, f"http://{WWW}/hello", "--noproxy", "*") == (0, f"hello from {WWW}")
        status, _ = curl(sandbox, f"http://{API}/hello", "--noproxy", "*")
        assert status == 6  # the name does not resolve: no rule names it


def test_a_policy_sent_as_raw_json_comes_back_as_sent(net_server: Server) -> None:
    policy = {"allow": [WWW, "*.outside.test:443", "203.0.113.0/24"], "deny": [API]}
    with api(net_server, "alice") as http:
        made = http.post("/v1/sandboxes", json={"network": policy})
        try:
            assert made.status_code == 201, made.text
            shown = http.get(f"/v1/sandboxes/{made.json()['id']}").json()
            for body in (made.json(), shown):
                assert {k: body["network"][k] for k in ("allow", "deny")} == policy
                assert body["network"].get("open", False) is False
        finally:
            if "id" in made.json():
                assert http.delete(f"/v1/sandboxes/{made.json()['id']}").status_code == 204


def test_open_is_for_the_host_tenant_only(alice: Fleet, host: Fleet, net_server: Server) -> None:
    with pytest.raises(InvalidRequest, match="open"):
        alice.create(network="open")
    with api(net_server, "alice") as http:
        before = http.get("/v1/sandboxes").json()
        refused = http.post("/v1/sandboxes", json={"network": "open"})
        assert refused.status_code == 422 and "host's own" in error_of(refused)
        assert http.post("/v1/sandboxes", json={"network": {"open": True, "deny": [API]}}).status_code == 422
        assert http.get("/v1/sandboxes").json() == before
    with host.create(network="open") as sandbox:
        assert sandbox.info.network == "open"
        assert curl(sandbox, f"http://{WWW}/hello") == (0, f"hello from {WWW}")
        assert curl(sandbox, "http://other.example/hello") == (0, "hello from other.example")
        assert http_code(sandbox, "http://internal.outside.test/hello") == "403"  # private, even when open
        assert http_code(sandbox, "http://metadata.outside.test/hello") == "403"


@pytest.mark.parametrize("network, named", [
    ({"allow": ["*"]}, "'*'"),
    ({"allow": ["www.*.test"]}, "www.*.test"),
    ({"allow": ["www.outside.test:99999"]}, "99999"),
    ({"allow": [""]}, "allow"),
    ({"allow": "x"}, "allow"),
    ({"allow": [WWW], "colour": "blue"}, "colour"),
    ({"deny": [42]}, "deny"),
    ("half-open", "network"),
    ({"open": "maybe"}, "open"),
])
def test_a_bad_policy_is_refused_naming_the_bad_rule(net_server: Server, network: object, named: str) -> None:
    with api(net_server, "alice") as http:
        before = http.get("/v1/sandboxes").json()
        refused = http.post("/v1/sandboxes", json={"network": network})
        assert refused.status_code in (400, 422), refused.text
        assert named in error_of(refused)
        assert http.get("/v1/sandboxes").json() == before


def test_a_bad_policy_from_the_sdk_is_invalid_request(alice: Fleet) -> None:
    before = alice.list()
    with pytest.raises(InvalidRequest, match=r"\*\.\*"):
        alice.create(network={"allow": ["*.*.outside.test"]})
    with pytest.raises(InvalidRequest, match="unknown|colour|extra"):
        alice.create(network={"allow": [WWW], "colour": "blue"})
    assert alice.list() == before


# -- policies at run time ---------------------------------------------------------------------------


def test_put_network_changes_the_policy_while_it_runs(alice: Fleet, net_server: Server) -> None:
    with alice.create(network=ALLOW_WWW) as sandbox, api(net_server, "alice") as http:
        route = f"/v1/sandboxes/{sandbox.id}/network"
        assert http_code(sandbox, f"http://{API}/hello") == "403"
        opened = http.put(route, json={"network": {"allow": [WWW, API]}})
        assert opened.status_code == 200 and opened.json()["network"]["allow"] == [WWW, API]
        assert curl(sandbox, f"http://{API}/hello") == (0, f"hello from {API}")
        closed = http.put(route, json={"network": ALLOW_WWW})
        assert closed.status_code == 200 and closed.json()["network"]["allow"] == [WWW]
        assert http_code(sandbox, f"http://{API}/hello") == "403"
        bad = http.put(route, json={"network": {"allow": ["*"]}})
        assert bad.status_code == 422 and "'*'" in error_of(bad)
        assert http.get(f"/v1/sandboxes/{sandbox.id}").json()["network"]["allow"] == [WWW]
        traffic = http.get(route).json()
        assert (traffic["requests"], traffic["denied"]) == (3, 2), traffic
        assert traffic["bytes_down"] > 0 and traffic["bytes_up"] > 0
        assert all(API in reason for reason in traffic["recent_denials"]), traffic
        assert sandbox.network_stats() == traffic


def test_none_closes_the_way_out_and_a_policy_opens_it_again(alice: Fleet) -> None:
    with alice.create() as sandbox:
        assert sandbox.info.network == "none" and sandbox.network_stats() == {}
        assert curl(sandbox, f"http://{WWW}/hello")[0] != 0
        assert sandbox.set_network(ALLOW_WWW).network["allow"] == [WWW]
        assert sandbox.exec("echo $http_proxy").stdout.strip(), "a later exec gets the proxy variables"
        assert curl(sandbox, f"http://{WWW}/hello") == (0, f"hello from {WWW}")
        assert sandbox.set_network("none").network == "none"
        status, output = curl(sandbox, f"http://{WWW}/hello", "--proxy", "http://127.0.0.1:3128")
        assert status == 7, output  # nothing listens on the proxy's port any more


def test_cut_ends_open_connections_and_without_it_they_go_on(alice: Fleet, outside: Outside) -> None:
    kept, cut = f"kept-{uuid.uuid4().hex[:8]}", f"cut-{uuid.uuid4().hex[:8]}"
    try:
        with alice.create(network=ALLOW_WWW) as sandbox:
            start_slow(sandbox, outside, kept)
            sandbox.set_network({"allow": [API]})  # new connections to www are refused, this one goes on
            outside.release(kept)
            assert slow_result(sandbox, kept) == ("0", f"released {kept}")
            assert http_code(sandbox, f"http://{WWW}/hello") == "403"
            sandbox.set_network(ALLOW_WWW)
            start_slow(sandbox, outside, cut)
            sandbox.set_network({"allow": [API]}, cut=True)
            status, _ = slow_result(sandbox, cut)
            assert status != "0"
    finally:
        outside.release(kept)
        outside.release(cut)


def start_slow(sandbox: Sandbox, outside: Outside, key: str) -> None:
    """``GET /slow/KEY`` from a detached curl in the sandbox, in flight once this returns."""
    script = f"curl -sS --max-time 30 http://{WWW}/slow/{key} >/tmp/{key}.out 2>&1; echo $? >/tmp/{key}.rc"
    assert sandbox.exec(["sh", "-c", f"setsid sh -c '{script}' </dev/null >/dev/null 2>&1 &"]).exit_code == 0
    wait_until(lambda: any(r["path"] == f"/slow/{key}" for r in outside.requests()), f"/slow/{key} to arrive")


def slow_result(sandbox: Sandbox, key: str) -> tuple[str, str]:
    """The detached curl's exit status and output, once it ended."""
    done = sandbox.exec(f"while ! test -s /tmp/{key}.rc; do sleep 0.02; done; cat /tmp/{key}.rc", timeout=30)
    assert done.ok, done  # else the curl did not end within its own 30 s
    return done.stdout.decode().strip(), sandbox.exec(f"cat /tmp/{key}.out").stdout.decode()


def test_a_policy_set_while_suspended_holds_after_resume(host: Fleet, net_server: Server) -> None:
    with host.create(network=ALLOW_WWW) as sandbox, api(net_server, "host") as http:
        start_echo(sandbox)
        direct = http.post(f"/v1/sandboxes/{sandbox.id}/ports/{ECHO_PORT}").json()["direct"]
        assert http.post(f"/v1/sandboxes/{sandbox.id}/suspend").status_code == 200
        changed = http.put(f"/v1/sandboxes/{sandbox.id}/network", json={"network": {"allow": [API]}})
        assert changed.status_code == 200 and changed.json()["network"]["allow"] == [API]
        assert changed.json()["state"] == "suspended"
        assert http.post(f"/v1/sandboxes/{sandbox.id}/resume").status_code == 200
        assert curl(sandbox, f"http://{API}/hello") == (0, f"hello from {API}")
        assert http_code(sandbox, f"http://{WWW}/hello") == "403"
        assert httpx.get(direct + "/after", timeout=10).json()["path"] == "/after"  # the port outlived the restore


def test_another_tenants_network_is_not_found(alice: Fleet, net_server: Server) -> None:
    with alice.create(network=ALLOW_WWW) as sandbox, api(net_server, "bob") as http:
        route = f"/v1/sandboxes/{sandbox.id}/network"
        assert http.get(route).status_code == 404
        assert http.put(route, json={"network": "none"}).status_code == 404
        assert http.put(route, json={"network": {"allow": [API]}, "cut": True}).status_code == 404
        assert sandbox.refresh().network["allow"] == [WWW]
        assert curl(sandbox, f"http://{WWW}/hello")[0] == 0
        with api(net_server, None) as anonymous:
            assert anonymous.get(route).status_code == 401


# -- ports ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(alice: Fleet) -> Iterator[Sandbox]:
    """Alice's sandbox (no network: ports do not need one) with the echo service on ECHO_PORT."""
    with alice.create() as sandbox:
        start_echo(sandbox)
        yield sandbox


def test_a_port_is_reached_through_the_server_with_the_token(served: Sandbox, net_server: Server) -> None:
    with api(net_server, "alice") as http:
        exposed = http.post(f"/v1/sandboxes/{served.id}/ports/{ECHO_PORT}")
        assert exposed.status_code == 200, exposed.text
        assert exposed.json() == {"port": ECHO_PORT, "path": f"/v1/sandboxes/{served.id}/ports/{ECHO_PORT}/",
                                  "direct": None}
        answer = http.get(exposed.json()["path"] + "some/where?x=1&y=two", headers={"X-Custom": "kept"})
        assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
        seen = answer.json()
        assert (seen["method"], seen["path"], seen["length"]) == ("GET", "/some/where?x=1&y=two", 0)
        headers = {k.lower(): v for k, v in seen["headers"].items()}
        assert headers["x-custom"] == "kept" and headers["host"] == f"127.0.0.1:{ECHO_PORT}"
        assert "authorization" not in headers, seen  # the fanfold token stays with the server
        assert served.expose(ECHO_PORT) == net_server.tcp_url + exposed.json()["path"]


@pytest.mark.parametrize("size", [0, 11, 3 * 1024 * 1024 + 7])
def test_a_post_body_passes_through_to_the_port(served: Sandbox, net_server: Server, size: int) -> None:
    body = os.urandom(size)
    with api(net_server, "alice") as http:
        answer = http.post(f"/v1/sandboxes/{served.id}/ports/{ECHO_PORT}/upload", content=body,
                           headers={"Content-Type": "application/octet-stream"})
    assert answer.status_code == 201, answer.text
    seen = answer.json()
    assert (seen["method"], seen["path"], seen["length"]) == ("POST", "/upload", size)
    assert seen["sha256"] == hashlib.sha256(body).hexdigest()
    assert "authorization" not in {k.lower() for k in seen["headers"]}


def test_a_port_needs_the_owners_token(served: Sandbox, net_server: Server) -> None:
    path = f"/v1/sandboxes/{served.id}/ports/{ECHO_PORT}"
    with api(net_server, None) as anonymous:
        assert anonymous.post(path).status_code == 401
        assert anonymous.get(path + "/").status_code == 401
    with api(net_server, "bob") as bob:
        assert bob.post(path).status_code == 404
        for method in ("GET", "POST", "DELETE"):
            assert bob.request(method, path + "/x").status_code == 404, method


def test_a_port_with_nothing_listening_is_a_502(served: Sandbox, net_server: Server) -> None:
    path = f"/v1/sandboxes/{served.id}/ports/{IDLE_PORT}"
    with api(net_server, "alice") as http:
        assert http.post(path).status_code == 200
        nothing = http.get(path + "/")
        assert nothing.status_code == 502 and str(IDLE_PORT) in nothing.text and nothing.json()["kind"] == "port_unreachable"
        for bad in ("0", "65536", "http"):
            assert http.post(f"/v1/sandboxes/{served.id}/ports/{bad}").status_code == 422, bad
        assert http.post(f"/v1/sandboxes/sb-nosuchsandbox/ports/{ECHO_PORT}").status_code == 404


def test_a_percent_encoded_path_reaches_the_port_as_sent(served: Sandbox, net_server: Server) -> None:
    with api(net_server, "alice") as http:
        answer = http.get(f"/v1/sandboxes/{served.id}/ports/{ECHO_PORT}/a%20b/c%2Fd")
    assert answer.status_code == 200, answer.text
    assert answer.json()["path"] == "/a%20b/c%2Fd"


def test_every_response_header_of_the_port_comes_back(served: Sandbox, net_server: Server) -> None:
    with api(net_server, "alice") as http:
        answer = http.get(f"/v1/sandboxes/{served.id}/ports/{ECHO_PORT}/")
    assert answer.headers.get_list("set-cookie") == ["first=1", "second=2"]


def test_the_proxy_port_is_not_exposed(served: Sandbox, net_server: Server) -> None:
    with api(net_server, "alice") as http:
        assert http.get(f"/v1/sandboxes/{served.id}/ports/3128/").status_code == 422
        assert http.post(f"/v1/sandboxes/{served.id}/ports/3128").status_code == 422


def test_the_host_tenant_gets_a_direct_port_too(host: Fleet, net_server: Server) -> None:
    with host.create() as sandbox:
        start_echo(sandbox)
        with api(net_server, "host") as http:
            exposed = http.post(f"/v1/sandboxes/{sandbox.id}/ports/{ECHO_PORT}").json()
            assert exposed["path"] == f"/v1/sandboxes/{sandbox.id}/ports/{ECHO_PORT}/"
            assert exposed["direct"].startswith("http://127.0.0.1:")
            assert httpx.get(exposed["direct"] + "/direct", timeout=10).json()["path"] == "/direct"
            # The SDK over the unix socket (the host's own tenant, on the server's host) answers the direct port.
            url = sandbox.expose(ECHO_PORT)
            assert url == exposed["direct"]
            assert http.get(exposed["path"] + "routed").json()["path"] == "/routed"
        direct_port = urlsplit(exposed["direct"]).port
    with pytest.raises(ConnectionRefusedError):  # the direct port went with the sandbox
        socket.create_connection(("127.0.0.1", direct_port), timeout=5).close()


# -- CLI --------------------------------------------------------------------------------------------


def cli(server: Server, *args: str, token: str | None = None) -> tuple[int, str]:
    url = ["--url", server.tcp_url, "--token", token] if token else ["--url", server.unix_url]
    done = run_cli(*url, *args)
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output
    return done.returncode, output


def test_cli_creates_shows_and_changes_a_network(net_server: Server, host: Fleet) -> None:
    status, output = cli(net_server, "create", "--allow", WWW, "--allow", "*.outside.test:8080")
    assert status == 0, output
    sandbox_id = output.strip()
    try:
        assert cli(net_server, "exec", sandbox_id, "curl", "-sS", f"http://{WWW}/hello") == (0, f"hello from {WWW}")
        assert cli(net_server, "exec", sandbox_id, "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}",
                   f"http://{API}/hello") == (0, "403")
        status, shown = cli(net_server, "network", sandbox_id)
        assert status == 0 and WWW in shown and "*.outside.test:8080" in shown, shown
        assert "2 requests" in shown and "1 denied" in shown and f"denied: GET http://{API}" in shown, shown
        status, locked = cli(net_server, "network", sandbox_id, "--network", "none", "--cut")
        assert status == 0 and 'policy: "none"' in locked, locked
        status, as_json = cli(net_server, "network", sandbox_id, "--json")
        assert status == 0 and json.loads(as_json) == {"network": "none", "traffic": {}}, as_json
        status, reopened = cli(net_server, "network", sandbox_id, "--allow", API, "--json")
        assert status == 0 and json.loads(reopened)["network"]["allow"] == [API], reopened
        start_echo(host.get(sandbox_id))
        status, url = cli(net_server, "port", sandbox_id, str(ECHO_PORT))
        assert status == 0 and url.strip().startswith("http://127.0.0.1:"), url
        assert httpx.get(url.strip() + "/cli", timeout=10).json()["path"] == "/cli"
    finally:
        host.get(sandbox_id).kill()


def test_cli_port_prints_the_server_route_and_returns(net_server: Server, served: Sandbox) -> None:
    status, url = cli(net_server, "port", served.id, str(ECHO_PORT), token=TOKENS["alice"])
    assert (status, url.strip()) == (0, f"{net_server.tcp_url}/v1/sandboxes/{served.id}/ports/{ECHO_PORT}/")
    answer = httpx.get(url.strip() + "cli", headers={"Authorization": f"Bearer {TOKENS['alice']}"}, timeout=30)
    assert answer.json()["path"] == "/cli"


@pytest.mark.parametrize("rule", ["*", "www.outside.test:0", "http://www.outside.test/"])
def test_cli_refuses_a_bad_rule_in_one_line(net_server: Server, host: Fleet, rule: str) -> None:
    before = {info.id for info in host.list()}  # the host sees every tenant's
    status, output = cli(net_server, "create", "--allow", rule)
    assert status == 2 and output.startswith("error: InvalidRequest: ") and repr(rule) in output, output
    assert len(output.strip().splitlines()) == 1, output
    assert {info.id for info in host.list()} == before


@pytest.mark.parametrize("args, named", [
    (("--network", "none", "--allow", WWW), "--network none takes no --allow"),
    (("--network", "sideways"), "'sideways' is not one of"),
    (("--network", "open", "--allow", WWW), "--network open reaches every public address, so --allow would narrow"),
    (("--live",), "--live lets a replay's misses out: it goes with --replay NAME"),
    (("--network", "none", "--record", "rec-cli"), "--network none takes no"),
])
def test_cli_refuses_options_that_do_not_fit(net_server: Server, host: Fleet, args: tuple[str, ...],
                                             named: str) -> None:
    before = {info.id for info in host.list()}  # the host sees every tenant's
    status, output = cli(net_server, "create", *args)
    assert status == 2 and named in output, output
    assert {info.id for info in host.list()} == before


def test_cli_open_for_a_tenant_is_a_clear_error(net_server: Server, alice: Fleet, host: Fleet) -> None:
    status, output = cli(net_server, "create", "--network", "open", token=TOKENS["alice"])
    assert status == 2 and "host's own" in output and len(output.strip().splitlines()) == 1, output
    assert "open" not in [info.network for info in alice.list()]
    with host.create() as theirs:
        status, output = cli(net_server, "network", theirs.id, "--allow", WWW, token=TOKENS["alice"])
        assert status == 2 and theirs.id in output and len(output.strip().splitlines()) == 1, output
        assert theirs.refresh().network == "none"


def test_cli_help_names_the_network_options() -> None:
    for command in ("create", "run", "network"):
        done = run_cli(command, "--help")
        assert done.returncode == 0
        for option in ("--allow", "--deny", "--network", "--record", "--replay", "--live"):
            assert option in done.stdout, (command, option)


def test_cli_run_records_and_replays(net_server: Server, host: Fleet) -> None:
    name = f"rec-cli-{uuid.uuid4().hex[:8]}"
    fetch = ("--", "curl", "-sS", f"http://{WWW}/hello")
    try:
        assert cli(net_server, "run", "--allow", WWW, "--record", name, *fetch) == (0, f"hello from {WWW}")
        status, listed = cli(net_server, "recordings")
        assert status == 0 and name in listed, listed
        assert cli(net_server, "run", "--replay", name, *fetch) == (0, f"hello from {WWW}")
        status, missed = cli(net_server, "run", "--replay", name, "--", "curl", "-sS", "-o", "/dev/null",
                             "-w", "%{http_code}", f"http://{API}/hello")
        assert (status, missed) == (0, "502"), missed
    finally:
        host.delete_recording(name)


def test_a_tenants_recordings_are_held_to_its_quota_at_create(config: EngineConfig, outside: Outside,
                                                               tmp_path: Path) -> None:
    tenant, token = f"rec-{uuid.uuid4().hex[:8]}", f"rec-token-{uuid.uuid4().hex}"
    (tmp_path / "quota-tokens").write_text(f"{tenant} {token} recordings=1\n")
    running = start_server(config.state_dir, tmp_path, "--tokens-file", str(tmp_path / "quota-tokens"),
                           env={"FANFOLD_NET_DNS": outside.dns, "FANFOLD_PULL": "never"})
    try:
        with Fleet(running.tcp_url, token=token) as fleet:
            first, second = "first", "second"
            with fleet.create("host", network={"allow": [WWW], "record": first}) as box:
                assert box.exec(f"curl -sS http://{WWW}/hello").stdout.decode() == f"hello from {WWW}"
            with pytest.raises(QuotaExceeded, match=r"keeps 1 of 1 network recordings \(quota recordings\)"):
                fleet.create("host", network={"allow": [WWW], "record": second})
            with fleet.create("host", network={"allow": [WWW], "record": first}):  # going on with one is fine
                pass
            assert [r["name"] for r in fleet.recordings()] == [first]
            fleet.delete_recording(first)
    finally:
        assert stop_server(running) == 0


# -- helpers --------------------------------------------------------------------------------------


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid``."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
        for kid in kids:
            found |= {kid, *_children(kid)}
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_rollout_over_http_takes_a_network_policy(net_server: Server) -> None:
    def shell(http: httpx.Client, rollout_id: str, command: str) -> str:
        body = {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": json.dumps({"command": command})}
        answer = http.post(f"/v1/rollouts/{rollout_id}/tools/shell", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["output"]

    with api(net_server, "alice") as http:
        made = http.post("/v1/rollouts", json={"rollout_id": "net-ro", "network": {"allow": [WWW]}})
        assert made.status_code == 201 and made.json()["network"] == {"allow": [WWW]}, made.text
        try:
            assert f"hello from {WWW}" in shell(http, "net-ro", f"curl -sS http://{WWW}/hello")
            assert "403" in shell(http, "net-ro", f"curl -sS -o /dev/null -w '%{{http_code}}' http://{API}/hello")
            refused = http.post("/v1/rollouts", json={"rollout_id": "net-open", "network": "open"})
            assert refused.status_code == 422 and "host's own" in refused.text
            bad = http.post("/v1/rollouts", json={"rollout_id": "net-bad", "network": {"allow": ["*"]}})
            assert bad.status_code == 422 and "'*'" in bad.text
        finally:
            http.delete("/v1/rollouts/net-ro")
