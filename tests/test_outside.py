"""The outside fixture itself: it comes up, answers DNS, HTTP, HTTPS and its package index from the
host, and leaves no veth, route or process behind, even when the test process that made it is killed."""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import select
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import dns.message
import dns.query
import dns.rcode
import pytest

import outside as outside_module
from outside import ADDRESS, PRIVATE_ADDRESS, PUBLIC_ADDRESS, ROUTED, Outside, pattern

outside = outside_module.outside  # the fixture; one outside still, should conftest register it too

TESTS = Path(__file__).resolve().parent


def get(url: str, host: str | None = None, context: ssl.SSLContext | None = None, data: bytes | None = None) -> bytes:
    request = urllib.request.Request(url, data=data, headers={"Host": host} if host else {})
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        return response.read()


def get_tls(address: str, server_name: str, path: str, context: ssl.SSLContext) -> bytes:
    """GET over TLS to ``address`` with ``server_name`` as SNI and Host (verified as the name)."""
    with context.wrap_socket(socket.create_connection((address, 443), timeout=10), server_hostname=server_name) as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {server_name}\r\nConnection: close\r\n\r\n".encode())
        response = http.client.HTTPResponse(tls)
        response.begin()
        return response.read()


def links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def query(name: str, rdtype: str = "A", tcp: bool = False) -> dns.message.Message:
    ask = dns.query.tcp if tcp else dns.query.udp
    return ask(dns.message.make_query(name, rdtype), ADDRESS, timeout=5)


def test_dns_answers_its_names_and_nxdomain_for_others(outside: Outside) -> None:
    for name, address in outside.names.items():
        answer = query(name)
        assert [item.address for rrset in answer.answer for item in rrset] == [address], name
    assert query("nowhere.outside.test").rcode() == dns.rcode.NXDOMAIN
    no_aaaa = query("www.outside.test", "AAAA")
    assert (no_aaaa.rcode(), no_aaaa.answer) == (dns.rcode.NOERROR, [])
    assert [item.address for item in query("OTHER.example", tcp=True).answer[0]] == [PUBLIC_ADDRESS]
    logged = [(q["name"], q["type"], q["rcode"], q["transport"]) for q in outside.queries()]
    assert ("nowhere.outside.test", "A", "NXDOMAIN", "udp") in logged
    assert ("other.example", "A", "NOERROR", "tcp") in logged


def test_http_answers_on_every_address_and_port(outside: Outside) -> None:
    for address in (ADDRESS, PUBLIC_ADDRESS, PRIVATE_ADDRESS):
        for port in (80, 8080):
            assert get(f"http://{address}:{port}/hello?{port}", host="api.outside.test") == b"hello from api.outside.test"
    arrived = {(r["address"], r["port"]) for r in outside.requests() if r["path"].startswith("/hello?")}
    assert arrived == {(a, p) for a in (ADDRESS, PUBLIC_ADDRESS, PRIVATE_ADDRESS) for p in (80, 8080)}
    assert get(f"http://{ADDRESS}/bytes/1000003") == pattern(1000003)
    assert get(f"http://{ADDRESS}/bytes/0") == b""
    assert get(f"http://{ADDRESS}/echo", data=b"some body") == b"some body"
    with pytest.raises(urllib.error.HTTPError) as refused:
        get(f"http://{ADDRESS}/status/418")
    assert refused.value.code == 418


def test_a_large_download_is_streamed(outside: Outside) -> None:
    size, chunk = 200 * 1024 * 1024, 64 * 1024
    expected = pattern(chunk)  # a period of 256 divides the chunk: every chunk is the same
    with urllib.request.urlopen(f"http://{ADDRESS}/bytes/{size}", timeout=30) as response:
        assert int(response.headers["Content-Length"]) == size
        for _ in range(size // chunk):
            assert response.read(chunk) == expected
        assert response.read() == b""
    server_rss_kib = int(re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{outside.pid}/status").read_text()).group(1))
    assert server_rss_kib < 100 * 1024


def test_https_is_verified_with_the_test_ca(outside: Outside) -> None:
    trusting = ssl.create_default_context(cafile=str(outside.ca_pem))
    assert get(f"https://{ADDRESS}/hello", context=trusting) == f"hello from {ADDRESS}".encode()
    assert get_tls(PUBLIC_ADDRESS, "other.example", "/hello", trusting) == b"hello from other.example"
    assert get_tls(ADDRESS, "files.outside.test", "/bytes/5", trusting) == bytes(range(5))
    assert {"other.example", "files.outside.test"} <= {r["sni"] for r in outside.requests() if r["kind"] == "https"}
    with pytest.raises(ssl.SSLCertVerificationError):
        get_tls(ADDRESS, "www.outside.test", "/hello", ssl.create_default_context())  # the system's CAs only
    with pytest.raises(ssl.SSLCertVerificationError):
        get_tls(ADDRESS, "elsewhere.example", "/hello", trusting)  # not a name of the certificate


def test_the_index_links_its_wheels_by_sha256(outside: Outside) -> None:
    root = get(f"http://{ADDRESS}/simple/", host="pypi.outside.test").decode()
    assert re.findall(r'href="([^"]+)"', root) == ["/simple/fanfold-probe/", "/simple/fanfold-probe-dep/"]
    for scheme in ("http", "https"):
        context = ssl.create_default_context(cafile=str(outside.ca_pem)) if scheme == "https" else None
        page = get(f"{scheme}://{ADDRESS}/simple/Fanfold_Probe/", host="pypi.outside.test", context=context).decode()
        (link,) = re.findall(r'href="([^"]+)"', page)
        url, _, digest = link.partition("#sha256=")
        assert url == f"{scheme}://files.outside.test/packages/fanfold_probe-1.0-py3-none-any.whl"
        wheel = get(f"{scheme}://{ADDRESS}/packages/{url.rsplit('/', 1)[1]}", host="files.outside.test", context=context)
        assert hashlib.sha256(wheel).hexdigest() == digest == outside.wheels["fanfold_probe-1.0-py3-none-any.whl"]
    with pytest.raises(urllib.error.HTTPError) as missing:
        get(f"http://{ADDRESS}/simple/no-such-project/", host="pypi.outside.test")
    assert missing.value.code == 404


def test_pip_downloads_from_the_index_by_name(outside: Outside, tmp_path: Path) -> None:
    """pip resolves the names through a private /etc/hosts (a mount namespace), over HTTPS with the CA."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in outside.names.items()))
    dest = tmp_path / "dest"
    pip = [sys.executable, "-m", "pip", "download", "--no-cache-dir", "--disable-pip-version-check",
           "--index-url", "https://pypi.outside.test/simple", "--cert", str(outside.ca_pem), "--dest", str(dest),
           "fanfold-probe"]
    done = subprocess.run(
        ["unshare", "--mount", "--", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *pip],
        capture_output=True, text=True, timeout=60, env=pip_environment(),
    )
    assert done.returncode == 0, done.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dest.iterdir()} == outside.wheels
    assert {r["sni"] for r in outside.requests() if r["kind"] == "https"} >= {"pypi.outside.test", "files.outside.test"}


def pip_environment() -> dict[str, str]:
    """This one without the CA bundle variables: requests lets REQUESTS_CA_BUNDLE override ``--cert``."""
    dropped = {"REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT"}
    return {**{k: v for k, v in os.environ.items() if k not in dropped}, "PIP_CONFIG_FILE": os.devnull}


def test_slow_answers_when_released(outside: Outside) -> None:
    with socket.create_connection((ADDRESS, 80), timeout=10) as sock:
        sock.sendall(b"GET /slow/first HTTP/1.1\r\nHost: www.outside.test\r\n\r\n")
        outside.release("first")
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.read() == b"released first"


def test_stop_leaves_nothing_and_start_brings_it_back(outside: Outside) -> None:
    pid, interface = outside.pid, outside.interface
    outside.stop()
    outside.stop()
    assert f" {interface}@" not in links()
    assert not Path(f"/proc/{pid}").exists()
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True, check=True).stdout
    assert not any(line.startswith(network) and interface in line for line in routes.splitlines() for network in ROUTED)
    outside.start()
    assert get(f"http://{ADDRESS}/hello", host="www.outside.test") == b"hello from www.outside.test"
    with outside.down():
        assert outside.pid is None
    assert get(f"http://{PRIVATE_ADDRESS}/hello", host="internal.outside.test") == b"hello from internal.outside.test"


def way(address: str) -> str:
    """How the host routes to ``address`` now: ``via GATEWAY dev DEVICE`` or ``dev DEVICE``."""
    found = subprocess.run(["ip", "-o", "route", "get", address], capture_output=True, text=True, check=True).stdout
    return " ".join(re.findall(r"(via \S+|dev \S+)", found))


def test_a_package_index_in_its_networks_keeps_its_way_while_it_is_up(outside: Outside, monkeypatch) -> None:
    """A workplace may serve its package indexes from a network the outside takes (TEST-NET-3 is
    both): the host keeps reaching them the way it did, and the /32 routes go with the outside."""
    from pip._internal.models.index import PyPI

    index = "203.0.113.77"  # where pip's index is, for this test
    resolve = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *args, **kwargs: (
        [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (index, 0))] if host == PyPI.netloc else resolve(host, *args, **kwargs)))
    with outside.down():
        before = way(index)
        assert "dev ffo-" not in before
    assert f"{index}/32 {before}" in outside.kept
    assert way(index) == before and way("203.0.113.78") == f"dev {outside.interface}"
    with outside.down():
        assert f"{index} " not in subprocess.run(["ip", "route"], capture_output=True, text=True, check=True).stdout
    monkeypatch.undo()
    outside.stop()
    outside.start()  # as the session's other tests find it
    assert all(not route.startswith(f"{index}/") for route in outside.kept)


CHILD = """
import signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from outside import Outside
up = Outside(Path(sys.argv[1]))
up.start()
print(up.pid, up.interface, flush=True)
signal.pause()
"""


def test_a_killed_test_process_leaves_no_veth_and_no_server(outside: Outside, tmp_path: Path) -> None:
    with outside.down():
        monitor = subprocess.Popen(["ip", "-o", "monitor", "link"], stdout=subprocess.PIPE, text=True)
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(TESTS)], stdout=subprocess.PIPE, text=True)
        try:
            server_pid, interface = child.stdout.readline().split()
            assert f" {interface}@" in links()
            server = os.pidfd_open(int(server_pid))
            child.kill()
            child.wait()
            assert select.select([server], [], [], 10)[0], "the server outlived the process that started it"
            os.close(server)
            while f" {interface}@" in links():  # the kernel frees the namespace, and the veth, a moment later
                assert select.select([monitor.stdout], [], [], 10)[0], "the veth outlived the namespace"
                monitor.stdout.readline()
        finally:
            child.kill()
            child.wait()
            monitor.terminate()
            monitor.wait()
