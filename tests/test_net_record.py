"""Record, replay and the download cache of the egress proxy, against real sockets on loopback: an
upstream with HTTP and HTTPS (its certificate from a test CA the proxy is told to trust), the proxy
terminating TLS with a fleet CA made here, and clients that trust only that CA."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import h11
import pytest

from fanfold.net.ca import FleetCA, Leaves, leaf_key, mint_leaf
from fanfold.net.cache import Cache, cacheable
from fanfold.net.daemon import TOTALS, Daemon
from fanfold.net.egress import upstream_context
from fanfold.net.policy import NetworkPolicy, Reachable
from fanfold.net.proxy import Proxy
from fanfold.net.record import FORMAT, PARTS, Recordings, Spool, normal_url
from fanfold.net.resolve import Resolver
from fanfold.net.state import SandboxNet
from test_net_proxy import (
    HOSTS, Client, Handler, QuietServer, Reply, Running, connect, digest_of, get, pattern, serving,
)

BIG_BODY = 50 * 1024 * 1024
WHEEL = "/packages/ab/cd/probe-1.0-py3-none-any.whl"


class Counting(Handler):
    """The test upstream: counts what it serves; ``/count/...`` answers which call it is; wheels named
    ``big-SIZE`` are SIZE pattern bytes."""

    disable_nagle_algorithm = True  # a head and a body written apart must not wait for a delayed ACK

    def do_GET(self) -> None:
        self.server.hits.append(self.path)  # type: ignore[attr-defined]
        if self.path.startswith("/count/"):
            n = self.server.hits.count(self.path)  # type: ignore[attr-defined]
            self._send(200, f"call {n}".encode(), {"X-Call": str(n), "Content-Type": "text/plain"})
        elif match := re.search(r"/big-(\d+)\.whl$", self.path):
            size = int(match[1])
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            for piece in pattern(size):
                self.wfile.write(piece)
        elif self.path == "/missing.whl":
            self._send(404, b"no such file")
        else:
            super().do_GET()

    def do_POST(self) -> None:
        self.server.hits.append(self.path)  # type: ignore[attr-defined]
        super().do_POST()


class Upstream:
    """A plain and a TLS server on loopback (the TLS one for allowed.test and other.test); stoppable."""

    def __init__(self, where: Path) -> None:
        ca = FleetCA.create()  # any CA will do for the upstream's own
        key = leaf_key()
        from cryptography.hazmat.primitives import serialization

        self.ca_file = where / "upstream-ca.pem"
        self.ca_file.write_bytes(ca.cert_pem)
        chain = where / "upstream-chain.pem"
        chain.write_bytes(mint_leaf(ca, "allowed.test", key) + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        self.hits: list[str] = []
        self.plain = QuietServer(("127.0.0.1", 0), Counting)
        self.tls = QuietServer(("127.0.0.1", 0), Counting)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(chain)
        self.tls.socket = context.wrap_socket(self.tls.socket, server_side=True)
        for server in (self.plain, self.tls):
            server.hits = self.hits  # type: ignore[attr-defined]
        self.http, self.https = self.plain.server_address[1], self.tls.server_address[1]
        self.threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (self.plain, self.tls)]
        for thread in self.threads:
            thread.start()
        self.up = True

    def stop(self) -> None:
        if self.up:
            self.up = False
            for server in (self.plain, self.tls):
                server.shutdown()
                server.server_close()
            for thread in self.threads:
                thread.join(5)


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[Upstream]:
    server = Upstream(tmp_path)
    try:
        yield server
    finally:
        server.stop()


class CountingResolver(Resolver):
    def __init__(self) -> None:
        super().__init__(hosts=HOSTS)
        self.calls = 0

    async def resolve(self, host: str):  # type: ignore[no-untyped-def]
        self.calls += 1
        return await super().resolve(host)


@dataclass
class Terminating(Running):
    fleet_ca: Path
    net_dir: Path
    resolver: CountingResolver
    servers: list[asyncio.Server] = field(default_factory=list)

    def policy(self, value: object) -> None:
        self.sandbox.policy = NetworkPolicy.parse(value) or NetworkPolicy()

    def index(self, name: str) -> list[dict[str, object]]:
        lines = (self.net_dir / "recordings" / "_host" / name / "index.jsonl").read_text().splitlines()
        assert json.loads(lines[0]) == FORMAT
        return [json.loads(line) for line in lines[1:]]


@asynccontextmanager
async def terminating(tmp: Path, policy: object, upstream_ca: Path | None, cache_mb: float = 64) -> AsyncIterator[Terminating]:
    fleet = FleetCA.create()
    fleet_ca = tmp / "fleet-ca.pem"
    fleet_ca.write_bytes(fleet.cert_pem)
    net_dir = tmp / "net"
    resolver = CountingResolver()
    proxy = Proxy(resolver, Reachable(["127.0.0.0/8"]), leaves=Leaves(fleet).context,
                  recordings=Recordings(net_dir / "recordings"), cache=Cache(net_dir / "cache", int(cache_mb * 2**20)),
                  upstream_tls=upstream_context(upstream_ca))
    sandbox = SandboxNet(id="sb", policy=NetworkPolicy.parse(policy) or NetworkPolicy())
    async with serving(proxy, sandbox) as port:
        yield Terminating(proxy, sandbox, port, fleet_ca, net_dir, resolver)


@asynccontextmanager
async def https(run: Terminating, host: str, port: int, ca: Path | None = None) -> AsyncIterator[Client]:
    """A client in a CONNECT tunnel to ``host:port``, its TLS checked against ``ca`` (the fleet's by default)."""
    head, reader, writer = await connect(run, f"{host}:{port}")  # type: ignore[arg-type]
    assert head.startswith(b"HTTP/1.1 200 "), head
    await writer.start_tls(ssl.create_default_context(cafile=str(ca or run.fleet_ca)), server_hostname=host)
    conn = Client(reader, writer)
    try:
        yield conn
    finally:
        conn.close()


async def exchanges(run: Terminating, upstream: Upstream) -> list[Reply]:
    """The same requests each time: plain and HTTPS GETs, a repeated GET, a POST."""
    plain = f"http://allowed.test:{upstream.http}"
    replies = [await get(run, f"{plain}/seen?b=2&a=1"),  # type: ignore[arg-type]
               await get(run, f"{plain}/count/x"), await get(run, f"{plain}/count/x")]  # type: ignore[arg-type]
    async with https(run, "allowed.test", upstream.https) as conn:
        host = [("Host", f"allowed.test:{upstream.https}")]
        replies.append(await conn.request("GET", "/seen", headers=host))
        replies.append(await conn.request("GET", "/count/y", headers=host))
        replies.append(await conn.request("POST", "/upload", headers=[*host, ("Content-Length", "5")], body=[b"hello"]))
    return replies


def key_headers(reply: Reply) -> tuple[object, ...]:
    return (reply.status, reply.body, reply.headers.get("x-call"), reply.headers.get("content-type"),
            reply.headers.get("content-length"))


# -- record and replay --------------------------------------------------------------------------------


async def test_record_then_replay_with_the_upstream_gone(tmp_path: Path, upstream: Upstream) -> None:
    async with terminating(tmp_path, {"record": "r1", "allow": ["allowed.test"]}, upstream.ca_file) as run:
        recorded = await exchanges(run, upstream)
        assert [r.status for r in recorded] == [200] * 6
        assert recorded[1].body == b"call 1" and recorded[2].body == b"call 2"
        assert recorded[3].body.startswith(b"GET /seen\n") and recorded[5].body.decode().startswith("5 ")
        await run.settle()
        assert run.stats.recorded == 6 and run.stats.errors == 0
        index = run.index("r1")
        assert [(e["method"], e["url"], e["ordinal"]) for e in index] == [
            ("GET", f"http://allowed.test:{upstream.http}/seen?b=2&a=1", 0),
            ("GET", f"http://allowed.test:{upstream.http}/count/x", 0),
            ("GET", f"http://allowed.test:{upstream.http}/count/x", 1),
            ("GET", f"https://allowed.test:{upstream.https}/seen", 0),
            ("GET", f"https://allowed.test:{upstream.https}/count/y", 0),
            ("POST", f"https://allowed.test:{upstream.https}/upload", 0)]
        assert index[5]["request_body_sha256"] == hashlib.sha256(b"hello").hexdigest()
        blobs = run.net_dir / "recordings" / "_host" / "r1" / "blobs"
        assert (blobs / str(index[5]["request_body_sha256"])).read_bytes() == b"hello"
        assert (blobs / str(index[1]["response_body_sha256"])).read_bytes() == b"call 1"
        assert all(isinstance(e["started"], float) and float(e["duration_ms"]) >= 0 for e in index)  # type: ignore[arg-type]

        upstream.stop()
        listeners = await count_accepts(upstream.http, upstream.https)
        try:
            run.policy({"replay": "r1"})
            run.resolver.calls = 0
            replayed = await exchanges(run, upstream)
            assert [key_headers(r) for r in replayed] == [key_headers(r) for r in recorded]
            again = await get(run, f"http://allowed.test:{upstream.http}/count/x")  # type: ignore[arg-type]
            assert again.body == b"call 2"  # past the last recorded repeat: the last again
            await run.settle()
            assert listeners.accepts == 0 and run.resolver.calls == 0  # nothing resolved or connected
            assert (run.stats.replayed, run.stats.replay_misses) == (7, 0)
        finally:
            listeners.close()


@dataclass
class Accepts:
    servers: list[asyncio.Server]
    accepts: int = 0

    def close(self) -> None:
        for server in self.servers:
            server.close()


async def count_accepts(*ports: int) -> Accepts:
    """Listeners on ``ports`` (where the upstream was) that count the connections they get."""
    found = Accepts([])

    def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        found.accepts += 1
        writer.close()

    for port in ports:
        found.servers.append(await asyncio.start_server(accepted, "127.0.0.1", port, reuse_address=True))
    return found


async def test_replay_miss_is_502_and_live_goes_out_unrecorded(tmp_path: Path, upstream: Upstream) -> None:
    async with terminating(tmp_path, {"record": "r2", "allow": ["allowed.test"]}, upstream.ca_file) as run:
        url = f"http://allowed.test:{upstream.http}"
        assert (await get(run, f"{url}/count/a")).status == 200  # type: ignore[arg-type]
        run.policy({"replay": "r2"})
        miss = await get(run, f"{url}/count/b")  # type: ignore[arg-type]
        assert miss.status == 502 and miss.headers["x-fanfold-replay"] == "miss"
        assert f"GET http://allowed.test:{upstream.http}/count/b" in miss.body.decode() and "'r2'" in miss.body.decode()
        async with https(run, "allowed.test", upstream.https) as conn:  # a miss inside a terminated tunnel too
            reply = await conn.request("GET", "/nothing", headers=[("Host", f"allowed.test:{upstream.https}")])
            assert reply.status == 502 and reply.headers["x-fanfold-replay"] == "miss"
            assert (await conn.request("GET", "/x", headers=[("Host", f"allowed.test:{upstream.https}")])).status == 502
        assert run.stats.replay_misses == 3
        hits = len(upstream.hits)

        run.policy({"replay": "r2", "live": True, "allow": ["allowed.test"]})
        live = await get(run, f"{url}/count/b")  # type: ignore[arg-type]
        assert live.status == 200 and live.body == b"call 1" and len(upstream.hits) == hits + 1
        async with https(run, "allowed.test", upstream.https) as conn:
            posted = await conn.request("POST", "/upload", headers=[("Host", f"allowed.test:{upstream.https}"),
                                                                    ("Content-Length", "2")], body=[b"hi"])
            assert posted.status == 200 and posted.body.decode().startswith("2 ")
        assert (await get(run, f"{url}/count/a")).body == b"call 1"  # type: ignore[arg-type]  # recorded: replayed
        assert len(run.index("r2")) == 1  # live answers are not recorded
        run.policy({"replay": "r2", "live": True, "allow": ["other.test"]})
        assert (await get(run, f"{url}/count/c")).status == 403  # type: ignore[arg-type]  # live obeys the allow list


async def test_a_replay_keeps_only_the_bodies_a_live_miss_sends_on_capped_under_its_own_dir(
        tmp_path: Path, upstream: Upstream) -> None:
    async with terminating(tmp_path, {"record": "r5", "allow": ["allowed.test"]}, upstream.ca_file) as run:
        url = f"http://allowed.test:{upstream.http}"
        assert (await get(run, f"{url}/count/a")).status == 200  # type: ignore[arg-type]
        run.proxy.spool_dir, run.proxy.spool_limit = tmp_path / "spool", 1 << 20
        run.proxy.spool_dir.mkdir()
        run.policy({"replay": "r5", "live": True, "allow": ["allowed.test"]})
        hits = len(upstream.hits)
        async with https(run, "allowed.test", upstream.https) as conn:
            host = ("Host", f"allowed.test:{upstream.https}")
            over = await conn.request("POST", "/upload", headers=[host], body=[b"x" * (256 << 10)] * 5)
        assert over.status == 413 and "over 1 MiB" in over.body.decode() and len(upstream.hits) == hits
        async with https(run, "allowed.test", upstream.https) as conn:
            within = await conn.request("POST", "/upload", headers=[("Host", f"allowed.test:{upstream.https}")],
                                        body=[b"y" * (256 << 10)] * 3)
        assert within.status == 200 and within.body.decode().startswith(f"{768 << 10} ")

        run.policy({"replay": "r5"})  # no live: a body is hashed, never kept, whatever its size
        async with https(run, "allowed.test", upstream.https) as conn:
            miss = await conn.request("POST", "/upload", headers=[("Host", f"allowed.test:{upstream.https}")],
                                      body=[b"z" * (256 << 10)] * 8)
        assert miss.status == 502 and miss.headers["x-fanfold-replay"] == "miss"
        await run.settle()
        assert list(run.proxy.spool_dir.iterdir()) == []


def test_a_spool_keeps_bytes_only_when_asked_and_only_under_its_dir(tmp_path: Path) -> None:
    kept, hashed = Spool(tmp_path, keep=True), Spool(tmp_path, keep=False)
    for spool in (kept, hashed):
        spool.write(b"q" * (3 << 20))  # past what stays in memory
    assert kept.size == hashed.size == 3 << 20 and kept.sha.hexdigest() == hashed.sha.hexdigest()
    where = os.readlink(f"/proc/self/fd/{kept.handle.fileno()}")
    assert where.startswith(f"{tmp_path}/") and where.endswith("(deleted)")  # unlinked from the start
    kept.handle.seek(0)
    assert kept.handle.read() == b"q" * (3 << 20)
    assert hashed.handle.getvalue() == b""  # type: ignore[attr-defined]
    kept.handle.close()
    assert list(tmp_path.iterdir()) == []


async def test_a_tenants_recordings_stop_at_its_quota_and_leave_nothing_half_written(
        tmp_path: Path, upstream: Upstream) -> None:
    async with terminating(tmp_path, {"record": "q1", "allow": ["allowed.test"]}, upstream.ca_file) as run:
        run.proxy.recordings.limit("", 8 << 10, 1)  # 8 KiB of bodies, one recording
        url = f"http://allowed.test:{upstream.http}"
        assert (await get(run, f"{url}/big/6000")).status == 200  # recorded: 6000 bytes of 8192
        past = await get(run, f"{url}/big/4000")  # it would pass 8 KiB: it goes through, unrecorded
        assert past.status == 200 and len(past.body) == 4000
        assert len(run.index("q1")) == run.stats.recorded == 1
        assert "(recordings_mb)" in run.stats.recent_denials[-1] and run.stats.denied == 1
        tenant = run.net_dir / "recordings" / "_host"
        assert len(list((tenant / "q1" / "blobs").iterdir())) == 2  # the empty body's and the one recorded
        hits = len(upstream.hits)

        run.policy({"record": "q2", "allow": ["allowed.test"]})  # a second recording: past the count
        refused = await get(run, f"{url}/big/10")
        assert refused.status == 507 and "(recordings)" in refused.body.decode(), refused.body
        assert "fleet.delete_recording" in refused.body.decode() and not (tenant / "q2").exists()
        run.proxy.recordings.limit("", 6000, None)  # what q1 holds: full
        run.policy({"record": "q1", "allow": ["allowed.test"]})
        full = await get(run, f"{url}/big/10")
        assert full.status == 507 and "(recordings_mb)" in full.headers["x-fanfold-denied"]
        assert len(upstream.hits) == hits  # refused before going out
        await run.settle()
        assert list((tenant / PARTS).iterdir()) == []


async def test_a_missing_recording_and_a_denied_url_are_refused(tmp_path: Path, upstream: Upstream) -> None:
    async with terminating(tmp_path, {"record": "r3", "allow": ["allowed.test"]}, upstream.ca_file) as run:
        url = f"http://allowed.test:{upstream.http}/seen"
        assert (await get(run, url)).status == 200  # type: ignore[arg-type]
        run.policy({"replay": "nowhere"})
        for _ in range(2):
            reply = await get(run, url)  # type: ignore[arg-type]
            assert reply.status == 502 and "'nowhere'" in reply.body.decode() and "does not exist" in reply.body.decode()
        run.policy({"replay": "r3", "deny": ["allowed.test"]})
        denied = await get(run, url)  # type: ignore[arg-type]
        assert denied.status == 403 and "allowed.test" in denied.headers["x-fanfold-denied"]
        head, reader, writer = await connect(run, f"allowed.test:{upstream.https}")  # type: ignore[arg-type]
        writer.close()
        assert head.startswith(b"HTTP/1.1 403 ")
        run.policy({"record": "r3", "allow": ["allowed.test"]})
        head, reader, writer = await connect(run, f"other.test:{upstream.https}")  # type: ignore[arg-type]
        writer.close()
        assert head.startswith(b"HTTP/1.1 403 ")
        assert run.stats.denied == 3 and len(run.index("r3")) == 1  # denials are not recorded


# -- TLS ------------------------------------------------------------------------------------------------


async def test_sni_must_match_when_terminating(tmp_path: Path, upstream: Upstream) -> None:
    async with terminating(tmp_path, {"record": "r4", "allow": ["allowed.test"]}, upstream.ca_file) as run:
        head, reader, writer = await connect(run, f"allowed.test:{upstream.https}")  # type: ignore[arg-type]
        assert head.startswith(b"HTTP/1.1 200 ")
        context = ssl.create_default_context(cafile=str(run.fleet_ca))
        context.check_hostname = False
        with pytest.raises((ConnectionError, ssl.SSLError)):
            await writer.start_tls(context, server_hostname="evil.test")
        writer.close()
        head, reader, writer = await connect(run, f"allowed.test:{upstream.https}")  # type: ignore[arg-type]
        writer.write(b"GET / HTTP/1.1\r\n\r\n")  # not TLS at all
        assert await reader.read() == b""
        writer.close()
        await run.settle()
        assert run.stats.denied == 2
        assert "evil.test" in run.stats.recent_denials[0] and "only TLS" in run.stats.recent_denials[1]
        assert upstream.hits == []


async def test_a_sandbox_that_does_not_terminate_sees_the_upstream_certificate(tmp_path: Path,
                                                                               upstream: Upstream) -> None:
    async with terminating(tmp_path, {"allow": ["allowed.test"]}, upstream.ca_file) as run:
        head, reader, writer = await connect(run, f"allowed.test:{upstream.https}")  # type: ignore[arg-type]
        await writer.start_tls(ssl.create_default_context(cafile=str(upstream.ca_file)), server_hostname="allowed.test")
        writer.write(b"GET /seen HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 200 ")
        writer.close()
        run.policy({"record": "r5", "allow": ["allowed.test"]})
        async with https(run, "allowed.test", upstream.https) as conn:  # the fleet CA's leaf now
            issuer = dict(x[0] for x in conn.writer.get_extra_info("peercert")["issuer"])
            assert issuer["commonName"].startswith("fanfold fleet CA")
            assert conn.writer.get_extra_info("ssl_object").selected_alpn_protocol() in (None, "http/1.1")


async def test_an_upstream_with_an_untrusted_certificate_is_a_502(tmp_path: Path, upstream: Upstream) -> None:
    async with terminating(tmp_path, {"record": "r6", "allow": ["allowed.test"]}, None) as run:
        async with https(run, "allowed.test", upstream.https) as conn:
            reply = await conn.request("GET", "/seen", headers=[("Host", f"allowed.test:{upstream.https}")])
            assert reply.status == 502 and "certificate" in reply.headers["x-fanfold-error"].lower()


# -- the cache ------------------------------------------------------------------------------------------


def test_cacheable_urls() -> None:
    for path in (WHEEL, "/packages/source/p/probe/probe-1.0.tar.gz", "/lodash/-/lodash-4.17.21.tgz",
                 "/@types/node/-/node-20.1.0.tgz", "/debian/pool/main/c/curl/curl_7.88_amd64.deb",
                 "/api/v1/crates/serde/1.0.0/download/serde-1.0.0.crate", "/x.whl?sig=1"):
        assert cacheable("GET", path), path
    for path in ("/simple/probe/", "/simple/probe/probe-1.0.whl", "/lodash", "/debian/dists/bookworm/Release",
                 "/debian/dists/bookworm/main/binary-amd64/Packages.gz", "/probe-1.0.tar.gz", "/index.html"):
        assert not cacheable("GET", path), path
    assert not cacheable("HEAD", WHEEL) and not cacheable("POST", WHEEL)
    assert normal_url("https", "Files.Test", 443, "/a?b=1") == "https://files.test/a?b=1"
    assert normal_url("http", "h.test", 8080, "/") == "http://h.test:8080/"


async def test_a_wheel_is_fetched_once_and_served_from_the_cache(tmp_path: Path, upstream: Upstream) -> None:
    async with terminating(tmp_path, {"allow": ["allowed.test"], "cache": True}, upstream.ca_file) as run:
        plain = f"http://allowed.test:{upstream.http}"
        first = await get(run, f"{plain}{WHEEL}")  # type: ignore[arg-type]
        second = await get(run, f"{plain}{WHEEL}")  # type: ignore[arg-type]
        assert first.status == second.status == 200 and first.body == second.body
        assert upstream.hits.count(WHEEL) == 1
        async with https(run, "allowed.test", upstream.https) as conn:
            for _ in range(2):
                reply = await conn.request("GET", WHEEL, headers=[("Host", f"allowed.test:{upstream.https}")])
                assert reply.status == 200 and reply.body.startswith(f"GET {WHEEL}".encode())
        assert upstream.hits.count(WHEEL) == 2  # once over http, once over https: two URLs
        for _ in range(2):
            assert (await get(run, f"{plain}/simple/probe/")).status == 200  # type: ignore[arg-type]
            assert (await get(run, f"{plain}/missing.whl")).status == 404  # type: ignore[arg-type]
        assert upstream.hits.count("/simple/probe/") == 2 and upstream.hits.count("/missing.whl") == 2
        assert (run.stats.cache_hits, run.stats.cache_misses) == (2, 4)

        upstream.stop()
        again = await get(run, f"{plain}{WHEEL}")  # type: ignore[arg-type]
        assert (again.status, again.body) == (200, first.body)
        assert run.stats.cache_bytes == 2 * len(first.body) + len(reply.body)
        run.policy({"allow": ["other.test"], "cache": True})
        denied = await get(run, f"{plain}{WHEEL}")  # type: ignore[arg-type]
        assert denied.status == 403 and run.stats.cache_hits == 3  # a cached URL is no way around the policy
        run.policy({"allow": ["allowed.test"]})
        assert (await get(run, f"{plain}{WHEEL}")).status == 502  # type: ignore[arg-type]  # no cache: upstream


async def test_concurrent_misses_fetch_once(tmp_path: Path, upstream: Upstream) -> None:
    async with terminating(tmp_path, {"allow": ["allowed.test"], "cache": True}, upstream.ca_file) as run:
        url = f"http://allowed.test:{upstream.http}/packages/big-{4 << 20}.whl"
        replies = await asyncio.gather(*(get(run, url, digest=True) for _ in range(4)))  # type: ignore[arg-type]
        assert {r.body.decode() for r in replies} == {digest_of(4 << 20)}
        assert len(upstream.hits) == 1 and run.stats.cache_hits == 3


async def test_cache_evicts_the_least_recently_used(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache", max_bytes=250)
    now = time.time()

    def put(url: str, body: bytes, age: float) -> None:
        writer = cache.writer(url)
        writer.write(body)
        writer.commit([(b"content-type", b"x")])
        os.utime(cache.bodies / hashlib.sha256(body).hexdigest(), (now - age, now - age))

    put("http://a/1.whl", b"1" * 100, 100)
    put("http://a/2.whl", b"2" * 100, 50)
    assert cache.lookup("http://a/1.whl") is not None  # used: now the newest
    put("http://a/3.whl", b"3" * 100, 0)  # 300 > 250: the least recently used (2) goes
    assert cache.lookup("http://a/2.whl") is None
    hit = cache.lookup("http://a/1.whl")
    assert hit is not None and hit.path.read_bytes() == b"1" * 100 and hit.headers == [["content-type", "x"]]
    assert cache.lookup("http://a/3.whl") is not None and cache.size == 200


async def test_a_50_mb_body_streams_through_record_and_cache_in_bounded_memory(tmp_path: Path,
                                                                              upstream: Upstream) -> None:
    policy = {"record": "big", "allow": ["allowed.test"], "cache": True}
    async with terminating(tmp_path, policy, upstream.ca_file, cache_mb=200) as run:
        path = f"/packages/big-{BIG_BODY}.whl"
        async with https(run, "allowed.test", upstream.https) as conn:
            before = rss()
            peak, digest = await stream_get(conn, path, f"allowed.test:{upstream.https}")
            assert digest == digest_of(BIG_BODY)
            assert peak - before < 25 * 2**20, f"RSS grew by {(peak - before) / 2**20:.0f} MiB"
            peak, digest = await stream_get(conn, path, f"allowed.test:{upstream.https}")  # from the cache
            assert digest == digest_of(BIG_BODY) and peak - before < 25 * 2**20
        index = run.index("big")
        assert len(index) == 2 and index[0]["response_body_sha256"] == digest_of(BIG_BODY)
        assert run.stats.cache_hits == 1 and run.stats.cache_bytes == BIG_BODY
        assert (run.net_dir / "cache" / "sha256" / digest_of(BIG_BODY)).stat().st_size == BIG_BODY


def rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


async def stream_get(conn: Client, path: str, host: str) -> tuple[int, str]:
    """GET ``path`` reading the body piece by piece: the highest RSS seen meanwhile, and the body's sha256."""
    conn.writer.write(conn.http.send(h11.Request(method="GET", target=path, headers=[("Host", host)])))
    conn.writer.write(conn.http.send(h11.EndOfMessage()))
    response = await conn._event()
    assert isinstance(response, h11.Response) and response.status_code == 200
    sha, peak = hashlib.sha256(), rss()
    while isinstance(event := await conn._event(), h11.Data):
        sha.update(event.data)
        peak = max(peak, rss())
    conn.http.start_next_cycle()
    return peak, sha.hexdigest()


# -- netd ---------------------------------------------------------------------------------------------


async def test_daemon_takes_the_ca_and_counts_the_new_figures() -> None:
    proxy = Proxy(Resolver(hosts=HOSTS), Reachable())
    daemon = Daemon(proxy)
    ca = FleetCA.create()
    assert (await daemon.handle({"op": "ca", "cert": ca.cert_pem.decode(), "key": ca.key_pem.decode()}, []))["ok"]
    assert proxy.leaves is not None and proxy.leaves("a.test") is proxy.leaves("a.test")
    assert isinstance(proxy.leaves("203.0.113.7"), ssl.SSLContext)
    totals = (await daemon.handle({"op": "stats"}, []))["totals"]
    assert set(totals) == set(TOTALS) >= {"cache_hits", "cache_misses", "cache_bytes", "recorded", "replayed",
                                          "replay_misses"}


@dataclass
class Listening:
    """A proxy reached at a port (netd's listener): what ``connect`` and ``https`` need."""

    port: int
    fleet_ca: Path

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


@pytest.mark.skipif(os.geteuid() != 0, reason="netd drops to its own user only when started by root")
async def test_netd_as_its_own_user_terminates_records_caches_and_replays(tmp_path: Path, upstream: Upstream) -> None:
    import pwd
    import shutil
    import socket
    import tempfile

    from fanfold.net.netd import Netd

    nobody = pwd.getpwnam("nobody")
    net_dir = Path(tempfile.mkdtemp(prefix="fanfold-netd-test-"))  # in /tmp: a path the user can reach
    os.chown(net_dir, nobody.pw_uid, nobody.pw_gid)
    settings = {"reachable": ["127.0.0.0/8"], "hosts": HOSTS, "net_dir": str(net_dir),
                "upstream_ca": str(upstream.ca_file), "cache_mb": 64}
    netd = Netd(settings, tmp_path / "netd.log", "nobody")
    listener = socket.create_server(("127.0.0.1", 0))
    fleet = FleetCA.create()
    run = Listening(listener.getsockname()[1], tmp_path / "fleet.pem")
    run.fleet_ca.write_bytes(fleet.cert_pem)
    try:
        await netd.start()
        await netd.request({"op": "ca", "cert": fleet.cert_pem.decode(), "key": fleet.key_pem.decode()})
        policy = {"record": "r", "allow": ["allowed.test"], "cache": True}
        await netd.request({"op": "attach", "id": "sb", "policy": policy, "scope": "t1"}, [listener.fileno()])
        host = [("Host", f"allowed.test:{upstream.https}")]
        for call in (b"call 1", b"call 2"):
            async with https(run, "allowed.test", upstream.https) as conn:  # type: ignore[arg-type]
                assert (await conn.request("GET", "/count/n", headers=host)).body == call
                assert (await conn.request("GET", WHEEL, headers=host)).status == 200
        # netd stores an exchange in the loop step that sends its last byte: once it answers, all are stored
        stats = (await netd.request({"op": "stats"}))["sandboxes"]["sb"]
        assert (stats["recorded"], stats["cache_hits"], stats["cache_misses"]) == (4, 1, 1)
        index = net_dir / "recordings" / "t1" / "r" / "index.jsonl"
        assert index.stat().st_uid == nobody.pw_uid and len(index.read_text().splitlines()) == 5
        upstream.stop()
        await netd.request({"op": "policy", "id": "sb", "policy": {"replay": "r"}})
        async with https(run, "allowed.test", upstream.https) as conn:  # type: ignore[arg-type]
            for call in (b"call 1", b"call 2", b"call 2"):
                assert (await conn.request("GET", "/count/n", headers=host)).body == call
            assert (await conn.request("GET", WHEEL, headers=host)).status == 200
        totals = (await netd.request({"op": "stats"}))["totals"]
        assert totals["replayed"] == 4 and totals["errors"] == 0, totals
    finally:
        await netd.stop()
        listener.close()
        shutil.rmtree(net_dir)


async def test_requests_with_credentials_are_not_cached_and_a_proxy_without_a_store_records_nothing(
        tmp_path: Path, upstream: Upstream) -> None:
    async with terminating(tmp_path, {"allow": ["allowed.test"], "cache": True}, upstream.ca_file) as run:
        url = f"http://allowed.test:{upstream.http}/packages/private/secret-1.0-py3-none-any.whl"
        for _ in range(2):
            reply = await get(run, url, headers=[("Host", f"allowed.test:{upstream.http}"),  # type: ignore[arg-type]
                                                 ("Authorization", "Bearer t")])
            assert reply.status == 200
        assert len(upstream.hits) == 2 and run.stats.cache_hits == 0
        run.proxy.recordings = None
        run.policy({"record": "nowhere", "allow": ["allowed.test"]})
        reply = await get(run, url)  # type: ignore[arg-type]
        assert reply.status == 502 and "net_dir" in reply.headers["x-fanfold-error"]


def test_a_body_past_the_cap_is_not_recorded_and_leaves_nothing(tmp_path, monkeypatch):
    from fanfold.net import record

    monkeypatch.setattr(record, "MAX_RECORDED_BODY", 10)
    recorder = record.Recordings(tmp_path).recorder("", "capped")
    taps = record.Taps(recorder=recorder)
    taps.request("GET", "http://x.test/", [])
    taps.response(200, [])
    taps.response_data(b"x" * 6)
    taps.response_data(b"x" * 6)  # past the cap: the exchange goes through, unrecorded
    assert taps.commit() is False
    assert not recorder.directory.exists() and not any((tmp_path / "_host" / record.PARTS).iterdir())


async def test_a_request_in_flight_when_netd_is_stopped_fails_as_netd_died(tmp_path: Path) -> None:
    """The engine stops a netd it found dead while a call waits on it: that call is NetdDied (which the
    engine answers by starting another), never a closed socket's ValueError or an assert."""
    import shutil
    import tempfile

    from fanfold.net.netd import Netd, NetdDied

    net_dir = Path(tempfile.mkdtemp(prefix="fanfold-netd-test-"))
    netd = Netd({"reachable": [], "hosts": {}, "net_dir": str(net_dir)}, tmp_path / "netd.log", None)
    try:
        await netd.start()
        # The request sends from a task of its own: stop runs first, between its check and its send.
        asked, stopped = await asyncio.gather(netd.request({"op": "ping"}), netd.stop(), return_exceptions=True)
        assert isinstance(asked, NetdDied), repr(asked)
        assert stopped is None and not netd.running
    finally:
        await netd.stop()
        shutil.rmtree(net_dir)
