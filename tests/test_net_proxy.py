"""The egress proxy against real sockets: HTTP, HTTPS and raw TCP servers on loopback, clients speaking
to the proxy as curl or pip would (absolute-form requests, CONNECT then TLS), and a resolver with fixed
answers. Loopback counts as outside here only because ``Reachable`` is given 127.0.0.0/8."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import ipaddress
import os
import socket
import ssl
import struct
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import h11
import pytest

from fanfold.errors import InvalidRequest
from fanfold.net.policy import NetworkPolicy, Reachable
from fanfold.net.proxy import Proxy
from fanfold.net.clones import GitGate
from fanfold.net.pulls import PullGate, PullPolicy
from fanfold.net.resolve import LookupFailed, Resolver
from fanfold.net.state import NetStats, SandboxNet
from fanfold.net.tls import MalformedHello, client_hello_sni, is_tls_handshake, read_client_hello, sni_of

HOSTS = {
    "allowed.test": ["127.0.0.1"],
    "other.test": ["127.0.0.1"],
    "a.wild.test": ["127.0.0.1"],
    "deep.a.wild.test": ["127.0.0.1"],
    "wild.test": ["127.0.0.1"],
    "bad.wild.test": ["127.0.0.1"],
    "cidr.test": ["127.0.0.1"],
    "metadata.test": ["169.254.169.254"],
    "twice.test": ["169.254.169.254", "127.0.0.1"],
}
BIG = 20 * 1024 * 1024


def pattern(size: int) -> Iterator[bytes]:
    """``size`` deterministic bytes, in 64 KiB pieces."""
    block = hashlib.sha256(b"fanfold").digest() * 2048
    for start in range(0, size, len(block)):
        yield block[: min(len(block), size - start)]


def digest_of(size: int) -> str:
    sha = hashlib.sha256()
    for piece in pattern(size):
        sha.update(piece)
    return sha.hexdigest()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.startswith("/big/"):
            size = int(self.path.split("/")[2])
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            for piece in pattern(size):
                self.wfile.write(piece)
        elif self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in (b"one ", b"two ", b"three"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/then-close":  # keep-alive by its headers, but closed after the response
            self._send(200, b"closed after this")
            self.close_connection = True
        elif self.path == "/until-close":  # no length, no chunks: the body ends when the connection does
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"all of it")
            self.close_connection = True
        elif self.path == "/upgrade" and self.headers.get("Upgrade") == "echo":
            self.send_response(101)
            self.send_header("Connection", "Upgrade")
            self.send_header("Upgrade", "echo")
            self.end_headers()
            self.wfile.flush()
            while data := self.connection.recv(65536):
                self.connection.sendall(data)
            self.close_connection = True
        else:  # what the upstream saw: the request line and the headers
            seen = f"{self.command} {self.path}\n" + "".join(f"{k.lower()}: {v}\n" for k, v in self.headers.items())
            self._send(200, seen.encode())

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()

    def do_POST(self) -> None:
        sha, size = hashlib.sha256(), 0
        if self.headers.get("Transfer-Encoding") == "chunked":
            while (length := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                data = self.rfile.read(length)
                sha.update(data)
                size += len(data)
                self.rfile.readline()
            self.rfile.readline()
        else:
            left = int(self.headers.get("Content-Length", 0))
            while left:
                data = self.rfile.read(min(left, 65536))
                sha.update(data)
                left -= len(data)
                size += len(data)
        self._send(200, f"{size} {sha.hexdigest()}".encode())


class QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients that go away mid-response are part of the tests


@dataclass
class Servers:
    http: int
    https: int
    echo: int
    closed: int
    ca: Path


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("net")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=allowed.test",
                    "-addext", "subjectAltName=DNS:allowed.test,DNS:a.wild.test"],
                   check=True, capture_output=True)
    plain = QuietServer(("127.0.0.1", 0), Handler)
    tls = QuietServer(("127.0.0.1", 0), Handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    tls.socket = context.wrap_socket(tls.socket, server_side=True)
    echo = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))  # bound, never listening: connections are refused
    closed_port = closed.getsockname()[1]
    closed.close()
    threads = [threading.Thread(target=server.serve_forever, daemon=True) for server in (plain, tls)]
    threads.append(threading.Thread(target=_echo_forever, args=(echo,), daemon=True))
    for thread in threads:
        thread.start()
    try:
        yield Servers(plain.server_address[1], tls.server_address[1], echo.getsockname()[1], closed_port, cert)
    finally:
        for server in (plain, tls):
            server.shutdown()
            server.server_close()
        echo.shutdown(socket.SHUT_RDWR)
        echo.close()
        for thread in threads:
            thread.join(5)


def _echo_forever(listener: socket.socket) -> None:
    """A raw TCP echo server: what it reads it sends back, until the client half-closes."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return

        def serve(conn: socket.socket = conn) -> None:
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)
                conn.shutdown(socket.SHUT_WR)
        threading.Thread(target=serve, daemon=True).start()


@dataclass
class Running:
    proxy: Proxy
    sandbox: SandboxNet
    port: int

    @property
    def stats(self) -> NetStats:
        return self.sandbox.stats

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def settle(self) -> None:
        """Wait until every connection the proxy served has ended (its sockets closed)."""
        await asyncio.gather(*self.sandbox.open, return_exceptions=True)


@asynccontextmanager
async def serving(proxy: Proxy, sandbox: SandboxNet) -> AsyncIterator[int]:
    """``proxy`` serving ``sandbox`` on a loopback port (yielded); its connections end with it."""
    server = await asyncio.start_server(lambda r, w: proxy.handle(r, w, sandbox), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        proxy.cut(sandbox)
        await asyncio.gather(*sandbox.open, return_exceptions=True)
        await server.wait_closed()


@asynccontextmanager
async def running(policy: object, *, reachable: Reachable | None = None, **options: float) -> AsyncIterator[Running]:
    proxy = Proxy(Resolver(hosts=HOSTS), reachable or Reachable(["127.0.0.0/8"]), **options)
    sandbox = SandboxNet(id="sb", policy=NetworkPolicy.parse(policy) or NetworkPolicy(), stats=NetStats(), open=set())
    async with serving(proxy, sandbox) as port:
        yield Running(proxy, sandbox, port)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


class Client:
    """An HTTP/1.1 client connection to the proxy (h11), as curl with http_proxy set would be."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.http = h11.Connection(h11.CLIENT)

    async def request(self, method: str, target: str, headers: list[tuple[str, str]] | None = None,
                      body: list[bytes] | None = None, digest: bool = False) -> Reply:
        host = target.split("://", 1)[-1].split("/", 1)[0]
        fields = headers if headers is not None else [("Host", host)]
        if body is not None and not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in fields):
            fields = [*fields, ("Transfer-Encoding", "chunked")]
        self.writer.write(self.http.send(h11.Request(method=method, target=target, headers=fields)))
        for piece in body or ():
            self.writer.write(self.http.send(h11.Data(data=piece)))
            await self.writer.drain()
        self.writer.write(self.http.send(h11.EndOfMessage()))
        await self.writer.drain()
        response = await self._event()
        while isinstance(response, h11.InformationalResponse) and response.status_code != 101:
            response = await self._event()
        headers_seen = {k.decode().lower(): v.decode() for k, v in response.headers}
        if response.status_code == 101:
            return Reply(101, headers_seen, b"")
        sha, data = hashlib.sha256(), bytearray()
        while isinstance(event := await self._event(), h11.Data):
            sha.update(event.data) if digest else data.extend(event.data)
        assert isinstance(event, h11.EndOfMessage), event
        if self.http.our_state is h11.DONE and self.http.their_state is h11.DONE:
            self.http.start_next_cycle()
        return Reply(response.status_code, headers_seen, sha.hexdigest().encode() if digest else bytes(data))

    async def _event(self) -> object:
        while (event := self.http.next_event()) is h11.NEED_DATA:
            self.http.receive_data(await self.reader.read(65536))
        return event

    def close(self) -> None:
        self.writer.close()


@asynccontextmanager
async def client(run: Running) -> AsyncIterator[Client]:
    conn = Client(*await run.open())
    try:
        yield conn
    finally:
        conn.close()


async def get(run: Running, url: str, **kw: object) -> Reply:
    async with client(run) as conn:
        return await conn.request("GET", url, **kw)  # type: ignore[arg-type]


async def connect(run: Running, target: str) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a CONNECT tunnel: the proxy's response head, and the streams (the tunnel once it is 200)."""
    reader, writer = await run.open()
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    return head, reader, writer


async def read_all(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.read()
    except ConnectionResetError:
        return b""


def tls_context(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


# -- plain HTTP ---------------------------------------------------------------------------------------


async def test_allowed_name_is_forwarded_in_origin_form_without_hop_by_hop_headers(servers: Servers) -> None:
    async with running({"allow": ["allowed.test"]}) as run:
        url = f"http://allowed.test:{servers.http}/seen?q=1"
        reply = await get(run, url, headers=[("Host", f"allowed.test:{servers.http}"), ("Proxy-Authorization", "x"),
                                             ("Connection", "keep-alive, X-Secret"), ("X-Secret", "s"),
                                             ("Proxy-Connection", "keep-alive"), ("X-Kept", "yes")])
        assert reply.status == 200
        seen = reply.body.decode()
        assert seen.startswith("GET /seen?q=1\n")
        assert f"host: allowed.test:{servers.http}" in seen and "x-kept: yes" in seen
        assert "proxy-" not in seen and "x-secret" not in seen
        await run.settle()
        assert (run.stats.connections, run.stats.requests, run.stats.denied) == (1, 1, 0)
        assert run.stats.bytes_up > 0 and run.stats.bytes_down >= len(reply.body)


@pytest.mark.parametrize(("allow", "deny", "host", "verdict"), [
    (["allowed.test"], [], "allowed.test", 200),
    (["allowed.test"], [], "other.test", 403),
    (["*.wild.test"], [], "a.wild.test", 200),
    (["*.wild.test"], [], "deep.a.wild.test", 200),
    (["*.wild.test"], [], "wild.test", 403),
    (["*.wild.test"], ["bad.wild.test"], "bad.wild.test", 403),
    (["127.0.0.1/32"], [], "cidr.test", 403),  # a CIDR covers addresses asked for as such, never a name
    (["10.0.0.0/8"], [], "cidr.test", 403),
    (["*.wild.test"], ["127.0.0.0/8"], "a.wild.test", 403),
    (["allowed.test:1"], [], "allowed.test", 403),
])
async def test_policy_rules(servers: Servers, allow: list[str], deny: list[str], host: str, verdict: int) -> None:
    async with running({"allow": allow, "deny": deny}) as run:
        reply = await get(run, f"http://{host}:{servers.http}/x")
        assert reply.status == verdict, reply
        if verdict == 403:
            reason = reply.headers["x-fanfold-denied"]
            assert reason and reason in reply.body.decode()
            assert run.stats.denied == 1
            assert list(run.stats.recent_denials) == [f"GET http://{host}:{servers.http}/x: {reason}"]


@pytest.mark.parametrize(("host", "why"), [("allowed.test", "loopback"), ("metadata.test", "link-local")])
async def test_special_addresses_are_refused_unless_reachable(servers: Servers, host: str, why: str) -> None:
    async with running({"allow": [host, "169.254.0.0/16", "127.0.0.0/8"]}, reachable=Reachable()) as run:
        reply = await get(run, f"http://{host}:{servers.http}/x")
        assert reply.status == 403 and why in reply.headers["x-fanfold-denied"]


async def test_first_allowed_address_is_used(servers: Servers) -> None:
    async with running({"allow": ["twice.test"]}) as run:  # 169.254.169.254 first: refused, 127.0.0.1 next
        assert (await get(run, f"http://twice.test:{servers.http}/x")).status == 200


async def test_host_header_must_match_the_url(servers: Servers) -> None:
    async with running({"allow": ["allowed.test", "other.test"]}) as run:
        url = f"http://allowed.test:{servers.http}/x"
        reply = await get(run, url, headers=[("Host", f"other.test:{servers.http}")])
        assert reply.status == 400 and b"Host header" in reply.body
        reply = await get(run, f"http://allowed.test:{servers.http}/x", headers=[("Host", "allowed.test")])
        assert reply.status == 400  # port 80 is not the URL's port
        ok = await get(run, f"http://ALLOWED.test.:{servers.http}/x",
                       headers=[("Host", f"allowed.TEST:{servers.http}")])
        assert ok.status == 200


async def test_origin_form_and_malformed_requests_get_400(servers: Servers) -> None:
    async with running({"allow": ["allowed.test"]}) as run:
        reply = await get(run, "/x", headers=[("Host", "allowed.test")])
        assert reply.status == 400 and b"HTTP_PROXY" in reply.body
        for bad in (b"GARBAGE\r\n\r\n", b"GET http://allowed.test:1/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
                    b"GET https://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
                    b"GET http://user@allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
                    b"CONNECT allowed.test HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
                    b"CONNECT allowed.test:99999 HTTP/1.1\r\nHost: allowed.test\r\n\r\n"):
            reader, writer = await run.open()
            writer.write(bad)
            answer = await read_all(reader)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 400 "), (bad, answer)
        await run.settle()
        assert run.stats.errors == 7 and run.stats.denied == 0


async def test_http_1_0_request_without_host_gets_one(servers: Servers) -> None:
    async with running({"allow": ["allowed.test"]}) as run:
        reader, writer = await run.open()
        writer.write(b"GET http://allowed.test:%d/seen HTTP/1.0\r\n\r\n" % servers.http)
        answer = await read_all(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200 ") and b"host: allowed.test:%d" % servers.http in answer


async def test_unknown_name_and_dead_upstream_get_502(servers: Servers) -> None:
    async with running({"allow": ["*.test"]}) as run:
        reply = await get(run, f"http://nowhere.test:{servers.http}/x")
        assert reply.status == 502 and "nowhere.test" in reply.headers["x-fanfold-error"]
        reply = await get(run, f"http://allowed.test:{servers.closed}/x")
        assert reply.status == 502 and "could not connect" in reply.headers["x-fanfold-error"]
        head, reader, writer = await connect(run, f"nowhere.test:{servers.http}")
        writer.close()
        assert head.startswith(b"HTTP/1.1 502 ")
        assert run.stats.errors == 3 and run.stats.denied == 0


async def test_policy_change_applies_to_the_next_request_on_a_kept_connection(servers: Servers) -> None:
    async with running({"allow": ["allowed.test"]}) as run:
        async with client(run) as conn:
            url = f"http://allowed.test:{servers.http}/x"
            assert (await conn.request("GET", url)).status == 200
            assert (await conn.request("GET", url)).status == 200
            run.sandbox.policy = NetworkPolicy.parse({"allow": ["other.test"]})  # type: ignore[assignment]
            denied = await conn.request("GET", url)
            assert denied.status == 403 and "allowed.test" in denied.headers["x-fanfold-denied"]
            other = await conn.request("GET", f"http://other.test:{servers.http}/x")
            assert other.status == 200  # a refused bodyless request leaves the connection usable
        await run.settle()
        assert (run.stats.connections, run.stats.requests, run.stats.denied) == (1, 4, 1)


async def test_an_upstream_closed_while_idle_is_replaced(servers: Servers) -> None:
    async with running({"allow": ["allowed.test"]}) as run:
        async with client(run) as conn:
            for _ in range(3):
                reply = await conn.request("GET", f"http://allowed.test:{servers.http}/then-close")
                assert (reply.status, reply.body) == (200, b"closed after this")
        assert run.stats.errors == 0


async def test_large_bodies_stream_both_ways(servers: Servers) -> None:
    async with running({"allow": ["allowed.test"]}) as run:
        async with client(run) as conn:
            url = f"http://allowed.test:{servers.http}"
            reply = await conn.request("GET", f"{url}/big/{BIG}", digest=True)
            assert reply.status == 200 and reply.headers["content-length"] == str(BIG)
            assert reply.body.decode() == digest_of(BIG)
            chunked = await conn.request("GET", f"{url}/chunked")
            assert chunked.body == b"one two three"
            upload = await conn.request("POST", f"{url}/upload", body=list(pattern(3 * 1024 * 1024 + 17)))
            assert upload.body.decode() == f"{3 * 1024 * 1024 + 17} {digest_of(3 * 1024 * 1024 + 17)}"
            sized = await conn.request("POST", f"{url}/upload", headers=[("Host", url[7:]), ("Content-Length", "5")],
                                       body=[b"hel", b"lo"])
            assert sized.body.decode() == f"5 {hashlib.sha256(b'hello').hexdigest()}"
            head = await conn.request("HEAD", f"{url}/x")  # a length but no body: the next request still frames
            assert head.status == 200 and head.headers["content-length"] == "1000" and head.body == b""
            until_close = await conn.request("GET", f"{url}/until-close")
            assert until_close.body == b"all of it" and until_close.headers["transfer-encoding"] == "chunked"
            expect = await conn.request("POST", f"{url}/upload", headers=[("Host", url[7:]), ("Content-Length", "2"),
                                                                        ("Expect", "100-continue")], body=[b"hi"])
            assert expect.status == 200 and expect.body.startswith(b"2 ")
        assert run.stats.bytes_down >= BIG and run.stats.bytes_up >= 3 * 1024 * 1024


async def test_upgrade_passes_through_raw(servers: Servers) -> None:
    async with running({"allow": ["allowed.test"]}) as run:
        async with client(run) as conn:
            reply = await conn.request("GET", f"http://allowed.test:{servers.http}/upgrade",
                                       headers=[("Host", f"allowed.test:{servers.http}"), ("Connection", "Upgrade"),
                                                ("Upgrade", "echo")])
            assert reply.status == 101 and reply.headers["upgrade"] == "echo"
            conn.writer.write(b"ping over the upgraded connection")
            conn.writer.write_eof()
            assert await read_all(conn.reader) == b"ping over the upgraded connection"


async def test_a_silent_client_is_dropped() -> None:
    async with running({"allow": ["allowed.test"]}, head_timeout=0.2) as run:
        reader, writer = await run.open()
        assert await read_all(reader) == b""
        writer.close()


# -- CONNECT ------------------------------------------------------------------------------------------


async def test_connect_with_matching_sni_passes_tls_end_to_end(servers: Servers) -> None:
    async with running({"allow": ["allowed.test"]}) as run:
        head, reader, writer = await connect(run, f"allowed.test:{servers.https}")
        assert head.startswith(b"HTTP/1.1 200 ")
        await writer.start_tls(tls_context(servers.ca), server_hostname="allowed.test")
        assert writer.get_extra_info("peercert")["subject"] == ((("commonName", "allowed.test"),),)
        writer.write(b"GET /seen HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
        answer = await read_all(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200 ") and b"GET /seen" in answer
        await run.settle()
        assert run.stats.denied == 0 and run.stats.bytes_up > 200 and run.stats.bytes_down > len(answer)


@pytest.mark.parametrize(("target", "sni", "policy", "passes"), [
    ("allowed.test", "evil.test", {"allow": ["allowed.test"]}, False),
    ("allowed.test", "ALLOWED.test", {"allow": ["allowed.test"]}, True),
    ("allowed.test", "a.wild.test", {"allow": ["allowed.test", "a.wild.test"]}, False),  # same address, other name
    ("127.0.0.1", "allowed.test", {"allow": ["127.0.0.1"]}, True),  # an allowed address: any name not denied
    ("127.0.0.1", "evil.test", {"allow": ["127.0.0.1"], "deny": ["evil.test"]}, False),
    ("127.0.0.1", "evil.test", {"allow": ["127.0.0.1/32"], "deny": ["*.test"]}, False),
])
async def test_connect_sni_check(servers: Servers, target: str, sni: str, policy: dict[str, list[str]],
                                 passes: bool) -> None:
    async with running(policy) as run:
        head, reader, writer = await connect(run, f"{target}:{servers.https}")
        assert head.startswith(b"HTTP/1.1 200 ")
        context = tls_context(servers.ca)
        context.check_hostname = False  # the proxy, not certificate checking, must stop the wrong name
        if passes:
            await writer.start_tls(context, server_hostname=sni)
            writer.close()
        else:
            with pytest.raises((ConnectionError, ssl.SSLError)):
                await writer.start_tls(context, server_hostname=sni)
            writer.close()
            assert run.stats.denied == 1
            assert sni.lower() in run.stats.recent_denials[0] and run.stats.recent_denials[0].startswith("TLS to ")


async def test_connect_denied_and_special_addresses(servers: Servers) -> None:
    async with running({"allow": ["allowed.test"]}, reachable=Reachable()) as run:
        for target, why in (("other.test", "no allow rule"), ("allowed.test", "loopback")):
            head, reader, writer = await connect(run, f"{target}:{servers.https}")
            body = await read_all(reader)
            writer.close()
            assert head.startswith(b"HTTP/1.1 403 Forbidden\r\n") and b"x-fanfold-denied: " in head.lower()
            assert why in body.decode()
        assert run.stats.denied == 2
        assert run.stats.recent_denials[0].startswith(f"CONNECT other.test:{servers.https}: no allow rule")


async def test_raw_tunnel_echoes_half_closes_and_cut_ends_it(servers: Servers) -> None:
    async with running({"allow": ["allowed.test"]}) as run:
        head, reader, writer = await connect(run, f"allowed.test:{servers.echo}")
        assert head.startswith(b"HTTP/1.1 200 ")
        writer.write(b"not TLS at all")
        writer.write_eof()
        assert await read_all(reader) == b"not TLS at all"
        writer.close()

        head, reader, writer = await connect(run, f"allowed.test:{servers.echo}")
        writer.write(b"first")
        assert await reader.readexactly(5) == b"first"
        assert len(run.sandbox.open) == 1
        run.proxy.cut(run.sandbox)
        assert await read_all(reader) == b""
        writer.close()
        await run.settle()
        assert not run.sandbox.open
        assert (run.stats.connections, run.stats.requests, run.stats.bytes_up, run.stats.bytes_down) == (2, 2, 19, 19)


async def test_an_idle_tunnel_is_closed_and_counted_a_busy_one_is_not(servers: Servers) -> None:
    async with running({"allow": ["allowed.test"]}, idle_timeout=1.0) as run:
        _, reader, writer = await connect(run, f"allowed.test:{servers.echo}")
        for i in range(12):  # 1.8 s of traffic, never 1 s apart: the tunnel stays
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
            await asyncio.sleep(0.15)
        assert run.stats.idle_closed == 0
        async with asyncio.timeout(10):  # then silence: the proxy ends it
            assert await read_all(reader) == b""
        writer.close()
        await run.settle()
        assert run.stats.idle_closed == 1 and not run.sandbox.open and run.stats.errors == 0


def test_a_pull_gate_admits_public_registries_or_only_the_listed_ones_wherever_they_are() -> None:
    anywhere_public = PullGate()
    for registry in ("docker.io", "ghcr.io", "203.0.113.9:5000"):
        anywhere_public.check(registry)
    for registry, why in (("127.0.0.1:5000", "a loopback address"), ("localhost:5000", "a loopback name"),
                          ("169.254.169.254", "link-local"), ("10.0.0.5:5000", "a private address"),
                          ("[::1]:5000", "a loopback address")):
        with pytest.raises(InvalidRequest, match=why):
            anywhere_public.check(registry)
    listed = PullGate(["10.0.0.5:5000", "Registry.Internal"])
    listed.check("10.0.0.5:5000")
    listed.check("registry.internal")
    with pytest.raises(InvalidRequest, match=r"\(10.0.0.5:5000, registry.internal\), and docker.io is not one"):
        listed.check("docker.io")
    policy, reachable = PullPolicy(open=True, trusted=listed.registries), Reachable()
    private = ipaddress.ip_address("10.0.0.5")
    assert policy.decide("registry.internal", 443, private, reachable) is None  # the operator vouches for it
    assert policy.decide("10.0.0.5", 5000, private, reachable) is None
    assert "private" in (policy.decide("cdn.example", 443, private, reachable) or "")  # a redirect there: refused
    assert "private" in (policy.decide("registry.internal", 8443, private, reachable) or "")  # another port


def test_a_git_gate_admits_https_and_http_urls_of_public_or_listed_hosts_only() -> None:
    anywhere_public = GitGate()
    for url in ("https://github.com/a/b.git", "http://203.0.113.9:8080/x.git", "HTTPS://Example.COM:443/x"):
        anywhere_public.check(url)
    for url, why in (("http://127.0.0.1:3000/x", "a loopback address"), ("https://localhost/x", "a loopback name"),
                     ("http://169.254.169.254/x", "link-local"), ("https://10.0.0.5/x", "a private address"),
                     ("http://[::1]:80/x", "a loopback address"), ("ssh://git@github.com/a/b", "https or http only"),
                     ("git@github.com:a/b.git", "https or http only"), ("git://github.com/a/b", "https or http only"),
                     ("file:///root", "https or http only"), ("ext::sh -c touch% /tmp/x", "https or http only"),
                     ("/srv/repo", "https or http only"), ("http://github.com:99999/a", "not a URL git can clone")):
        with pytest.raises(InvalidRequest, match=why):
            anywhere_public.check(url)
    listed = GitGate(["git.internal", "10.0.0.5:3000"])
    for url in ("https://git.internal/x", "http://git.internal:80/x", "https://git.internal:443/x", "http://10.0.0.5:3000/x"):
        listed.check(url)
    for url in ("https://github.com/a/b", "https://git.internal:8443/x", "http://10.0.0.5/x"):
        with pytest.raises(InvalidRequest, match=r"\(git.internal, 10.0.0.5:3000\), and .* is not one: .*--git-host"):
            listed.check(url)


async def test_no_socket_is_left_open(servers: Servers) -> None:
    async with running({"allow": ["allowed.test"]}) as run:
        before = proxy_sockets(run.port, servers)
        await get(run, f"http://allowed.test:{servers.http}/x")
        await get(run, f"http://other.test:{servers.http}/x")
        await get(run, f"http://allowed.test:{servers.closed}/x")
        await get(run, "/origin-form", headers=[("Host", "x")])
        for target in (f"allowed.test:{servers.echo}", f"other.test:{servers.echo}"):
            _, reader, writer = await connect(run, target)
            writer.write(b"\x16\x03\x01\x00\x05hello")  # a TLS record that holds no ClientHello: refused
            await read_all(reader)
            writer.close()
        _, reader, writer = await connect(run, f"allowed.test:{servers.echo}")
        writer.write(b"x")
        await reader.readexactly(1)
        assert proxy_sockets(run.port, servers) == 2  # what is counted: the client's and the upstream's
        writer.close()
        reader, writer = await run.open()
        writer.write(b"GET http://allowed.test:%d/big/%d HTTP/1.1\r\nHost: allowed.test:%d\r\n\r\n"
                     % (servers.http, BIG, servers.http))
        await reader.readexactly(1000)
        writer.transport.abort()  # gone in the middle of a response
        await run.settle()
        assert proxy_sockets(run.port, servers) == before == 0


def proxy_sockets(proxy_port: int, servers: Servers) -> int:
    """This process's TCP sockets accepted by the proxy, or connected by it to the test servers."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    upstream = {servers.http, servers.https, servers.echo}
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, inode = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16), fields[9]
            if inode in inodes and fields[3] != "0A" and (local == proxy_port or remote in upstream):
                count += 1
    return count


# -- TLS parsing --------------------------------------------------------------------------------------


def client_hello(server_hostname: str | None) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    outgoing = ssl.MemoryBIO()
    tls = context.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def refragment(record: bytes, at: int) -> bytes:
    """One handshake record split into two records, ``at`` bytes in."""
    payload = record[5:]
    head = record[:3]
    return (head + struct.pack("!H", at) + payload[:at] + head + struct.pack("!H", len(payload) - at) + payload[at:])


def test_sni_of_real_client_hellos() -> None:
    hello = client_hello("Pypi.ORG")
    assert is_tls_handshake(hello) and is_tls_handshake(hello[:1])
    assert sni_of(hello) == "pypi.org"
    assert sni_of(refragment(hello, 10)) == "pypi.org"
    assert sni_of(client_hello(None)) is None and client_hello_sni(client_hello(None)) is None
    assert sni_of(b"GET / HTTP/1.1\r\n") is None and not is_tls_handshake(b"GET /")
    with pytest.raises(MalformedHello):
        client_hello_sni(hello[:-3])  # incomplete
    with pytest.raises(MalformedHello):
        client_hello_sni(hello[:5] + b"\x02" + hello[6:])  # a different handshake message
    tampered = hello.replace(b"Pypi.ORG", b"Pypi\x00ORG")
    with pytest.raises(MalformedHello):
        client_hello_sni(tampered)


async def test_read_client_hello_waits_for_every_record() -> None:
    hello = refragment(client_hello("files.pythonhosted.org"), 100)
    reader = asyncio.StreamReader()
    reader.feed_data(hello[7:])
    assert sni_of(await read_client_hello(reader, hello[:7], 5)) == "files.pythonhosted.org"
    late = asyncio.StreamReader()
    with pytest.raises(MalformedHello, match="no whole ClientHello"):
        await read_client_hello(late, hello[:7], 0.05)
    ended = asyncio.StreamReader()
    ended.feed_eof()
    with pytest.raises(MalformedHello, match="ended"):
        await read_client_hello(ended, hello[:7], 5)


# -- resolution ---------------------------------------------------------------------------------------


async def test_resolver_hosts_literals_and_system() -> None:
    resolver = Resolver(hosts={"Pypi.Test.": ["10.0.0.1", "::ffff:10.0.0.2"], "one.test": "10.0.0.3"})
    assert [str(a) for a in await resolver.resolve("pypi.test")] == ["10.0.0.1", "10.0.0.2"]
    assert [str(a) for a in await resolver.resolve("one.test.")] == ["10.0.0.3"]
    assert [str(a) for a in await resolver.resolve("[::1]")] == ["::1"]
    assert [str(a) for a in await resolver.resolve("203.0.113.7")] == ["203.0.113.7"]
    assert "127.0.0.1" in {str(a) for a in await resolver.resolve("localhost")}
    with pytest.raises(LookupFailed):
        await resolver.resolve("no-such-name.invalid")


async def test_resolver_asks_the_named_dns_server() -> None:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: FakeDNS(), local_addr=("127.0.0.1", 0))
    try:
        port = transport.get_extra_info("sockname")[1]
        resolver = Resolver(nameservers=[f"127.0.0.1:{port}"], hosts={"fixed.test": ["10.0.0.9"]})
        assert [str(a) for a in await resolver.resolve("pypi.test")] == ["203.0.113.7", "2001:db8::7"]
        assert [str(a) for a in await resolver.resolve("fixed.test")] == ["10.0.0.9"]
        with pytest.raises(LookupFailed, match="NXDOMAIN"):
            await resolver.resolve("nowhere.test")
    finally:
        transport.close()


class FakeDNS(asyncio.DatagramProtocol):
    """Answers pypi.test (A and AAAA); every other name does not exist."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        query = dns.message.from_wire(data)
        reply = dns.message.make_response(query)
        question = query.question[0]
        if question.name.to_text() == "pypi.test.":
            kind = dns.rdatatype.to_text(question.rdtype)
            value = {"A": "203.0.113.7", "AAAA": "2001:db8::7"}[kind]
            reply.answer.append(dns.rrset.from_text(question.name, 60, "IN", kind, value))
        else:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        self.transport.sendto(reply.to_wire(), addr)  # type: ignore[attr-defined]
