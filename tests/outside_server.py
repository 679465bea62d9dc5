"""The outside's servers, run inside its own network namespace by tests/outside.py.

``outside_server.py CONFIG.json``: DNS (udp and tcp), HTTP and HTTPS on every address of the
namespace, and a PEP 503 package index. It binds everything before it prints ``ready``, then reads
commands on stdin (``release KEY`` lets ``/slow/KEY`` answer) and exits at the end of its input,
so it dies with the test process that holds the other end. Every request is appended to the
config's log as a JSON line before it is answered: a client that has its answer finds its entry.

HTTP routes: ``/hello``, ``/bytes/N`` (byte i is ``i % 256``, streamed), ``POST /echo``,
``/headers``, ``/status/N``, ``/slow/KEY``, ``/simple/``, ``/simple/NAME/``, ``/packages/FILE``.
"""

from __future__ import annotations

import hashlib
import html
import http.server
import json
import os
import re
import socket
import socketserver
import ssl
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)  # Linux's; Python names it from 3.13 on
CHUNK = bytes(range(256)) * 256  # 64 KiB, a whole number of periods: chunks stay in phase


class Log:
    """The request log: one JSON object a line, written and flushed before the answer goes out."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, **entry: object) -> None:
        line = json.dumps({"time": time.time(), **entry}) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()


class Releases:
    """Keys the host has released (``release KEY`` on stdin) for ``/slow/KEY`` to answer."""

    def __init__(self) -> None:
        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def event(self, key: str) -> threading.Event:
        with self._lock:
            return self._events.setdefault(key, threading.Event())


# -- DNS ------------------------------------------------------------------------------------------


def dns_answer(wire: bytes, names: dict[str, str]) -> tuple[bytes, dict[str, object]] | None:
    """The response to one query (NXDOMAIN for a name not in ``names``), and what to log; None if unparsable."""
    try:
        query = dns.message.from_wire(wire)
    except dns.exception.DNSException:
        return None
    response = dns.message.make_response(query)
    response.flags |= dns.flags.AA
    if len(query.question) != 1:
        response.set_rcode(dns.rcode.FORMERR)
        return response.to_wire(), {"name": None, "type": None, "rcode": "FORMERR"}
    question = query.question[0]
    name = question.name.to_text(omit_final_dot=True).lower()
    address = names.get(name)
    if address is None:
        response.set_rcode(dns.rcode.NXDOMAIN)
    elif question.rdtype == (dns.rdatatype.AAAA if ":" in address else dns.rdatatype.A):
        response.answer.append(dns.rrset.from_text(question.name, 60, "IN", question.rdtype, address))
    # A known name asked for another type gets NOERROR with no answer, as a real zone would.
    rcode = dns.rcode.to_text(response.rcode())
    return response.to_wire(), {"name": name, "type": dns.rdatatype.to_text(question.rdtype), "rcode": rcode}


class DnsUdpHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        wire, sock, source = self.request
        answered = dns_answer(wire, self.server.names)
        if answered is None:
            return
        response, entry = answered
        self.server.log.write(kind="dns", transport="udp", peer=_peer(self.client_address), **entry)
        sock.sendmsg([response], [(socket.IPPROTO_IP, IP_PKTINFO, source)], 0, self.client_address)


class DnsTcpHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        stream = self.request.makefile("rb")
        while len(size := stream.read(2)) == 2:
            answered = dns_answer(stream.read(int.from_bytes(size, "big")), self.server.names)
            if answered is None:
                return
            response, entry = answered
            self.server.log.write(kind="dns", transport="tcp", peer=_peer(self.client_address), **entry)
            self.request.sendall(len(response).to_bytes(2, "big") + response)


# -- HTTP -----------------------------------------------------------------------------------------


class Index:
    """A PEP 503 simple index of the wheels in one directory, linking to ``files.outside.test``."""

    def __init__(self, packages: Path) -> None:
        self.packages = packages
        self.projects: dict[str, list[tuple[str, str]]] = {}
        for wheel in sorted(packages.glob("*.whl")):
            project = normalize(wheel.name.split("-")[0])
            digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
            self.projects.setdefault(project, []).append((wheel.name, digest))

    def root_page(self) -> bytes:
        links = "".join(f'<a href="/simple/{name}/">{name}</a><br>\n' for name in self.projects)
        return _page(links)

    def project_page(self, name: str, scheme: str) -> bytes | None:
        files = self.projects.get(normalize(name))
        if files is None:
            return None
        base = f"{scheme}://files.outside.test/packages"
        links = "".join(f'<a href="{base}/{html.escape(f)}#sha256={d}">{html.escape(f)}</a><br>\n' for f, d in files)
        return _page(links)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _page(links: str) -> bytes:
    return f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n".encode()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "outside/1"

    def log_message(self, format: str, *args: object) -> None:
        """Silent: the JSON log says it all."""

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_POST(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    def _serve(self, body: bool = True) -> None:
        local = self.connection.getsockname()
        self.server.shared.log.write(
            kind=self.server.scheme, method=self.command, path=self.path, host=self.headers.get("Host"),
            peer=_peer(self.client_address), address=local[0], port=local[1],
            sni=getattr(self.connection, "sni", None),
        )
        status, headers, chunks = self._route()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            for chunk in chunks:
                self.wfile.write(chunk)

    def _route(self) -> tuple[int, dict[str, str], Iterable[bytes]]:
        path = self.path.split("?", 1)[0]
        if "://" in path:  # a proxy's absolute form
            path = "/" + path.split("://", 1)[1].partition("/")[2]
        parts = path.strip("/").split("/")
        if self.command == "POST" and path == "/echo":
            data = self._request_body()
            return _whole(data, self.headers.get("Content-Type", "application/octet-stream"))
        if path == "/hello":
            return _whole(f"hello from {self.headers.get('Host')}".encode(), "text/plain")
        if path == "/headers":
            return _whole(json.dumps(dict(self.headers.items())).encode(), "application/json")
        if len(parts) == 2 and parts[0] == "bytes" and parts[1].isdigit():
            size = int(parts[1])
            return 200, {"Content-Length": str(size), "Content-Type": "application/octet-stream"}, pattern(size)
        if len(parts) == 2 and parts[0] == "status" and parts[1].isdigit():
            return _whole(f"status {parts[1]}".encode(), "text/plain", int(parts[1]))
        if len(parts) == 2 and parts[0] == "slow":
            self.server.shared.releases.event(parts[1]).wait()
            return _whole(f"released {parts[1]}".encode(), "text/plain")
        return self._route_index(path, parts)

    def _route_index(self, path: str, parts: list[str]) -> tuple[int, dict[str, str], Iterable[bytes]]:
        index = self.server.shared.index
        if path in ("/simple", "/simple/"):
            return _whole(index.root_page(), "text/html; charset=utf-8")
        if len(parts) == 2 and parts[0] == "simple":
            page = index.project_page(parts[1], self.server.scheme)
            if page is not None:
                return _whole(page, "text/html; charset=utf-8")
        if len(parts) == 2 and parts[0] == "packages" and (index.packages / parts[1]).is_file():
            return _whole((index.packages / parts[1]).read_bytes(), "application/octet-stream")
        return _whole(b"not found\n", "text/plain", 404)

    def _request_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                data += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return data
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))


def _whole(data: bytes, content_type: str, status: int = 200) -> tuple[int, dict[str, str], Iterable[bytes]]:
    return status, {"Content-Length": str(len(data)), "Content-Type": content_type}, [data]


def pattern(size: int) -> Iterator[bytes]:
    """``size`` bytes where byte i is ``i % 256``, in 64 KiB chunks."""
    for _ in range(size // len(CHUNK)):
        yield CHUNK
    if size % len(CHUNK):
        yield CHUNK[: size % len(CHUNK)]


def _peer(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


@dataclass
class Shared:
    """What the HTTP and HTTPS servers share."""

    log: Log
    index: Index
    releases: Releases


class HttpServer(http.server.ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True
    block_on_close = False

    def __init__(self, port: int, scheme: str, shared: Shared, tls: ssl.SSLContext | None = None) -> None:
        self.scheme, self.shared, self.tls = scheme, shared, tls
        super().__init__(("0.0.0.0", port), Handler)

    def get_request(self) -> tuple[socket.socket, tuple[str, int]]:
        sock, address = super().get_request()
        if self.tls is not None:  # the handshake happens in the request's thread, on its first read
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def handle_error(self, request: object, client_address: tuple[str, int]) -> None:
        """A client that hung up or failed the handshake is no news."""
        if not isinstance(sys.exc_info()[1], (OSError, ValueError)):
            super().handle_error(request, client_address)


class DnsUdpServer(socketserver.ThreadingUDPServer):
    """Answers from the address each query came to (the namespace has three): an answer from another
    one is no answer to a resolver, nor does the asker's NAT take it back."""

    allow_reuse_address = True
    daemon_threads = True

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        super().server_bind()

    def get_request(self) -> tuple[tuple[bytes, socket.socket, bytes], tuple[str, int]]:
        wire, ancillary, _, client = self.socket.recvmsg(self.max_packet_size, socket.CMSG_SPACE(12))
        arrived = next(data for level, kind, data in ancillary if (level, kind) == (socket.IPPROTO_IP, IP_PKTINFO))
        # struct in_pktinfo {ifindex; spec_dst; addr}: send from spec_dst, by whichever interface routes there
        return (wire, self.socket, bytes(4) + arrived[4:12]), client


class DnsTcpServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)

    def note_sni(sock: ssl.SSLSocket, name: str | None, _: ssl.SSLContext) -> None:
        sock.sni = name  # type: ignore[attr-defined]

    context.sni_callback = note_sni
    return context


def serve(config: dict) -> Releases:
    """Bind every server (before ``ready``) and run each in a thread of its own."""
    shared = Shared(Log(config["log"]), Index(Path(config["packages"])), Releases())
    tls = tls_context(config["cert"], config["key"])
    servers: list[socketserver.BaseServer] = [HttpServer(port, "http", shared) for port in config["http_ports"]]
    servers += [HttpServer(port, "https", shared, tls) for port in config["https_ports"]]
    names = {name.lower().rstrip("."): address for name, address in config["names"].items()}
    for kind, handler in ((DnsUdpServer, DnsUdpHandler), (DnsTcpServer, DnsTcpHandler)):
        server = kind(("0.0.0.0", config["dns_port"]), handler)
        server.names, server.log = names, shared.log
        servers.append(server)
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    return shared.releases


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    releases = serve(config)
    print("ready", flush=True)
    for line in sys.stdin:
        command, _, key = line.strip().partition(" ")
        if command == "release":
            releases.event(key).set()
    os._exit(0)  # end of input: the test process is done with us, or gone


if __name__ == "__main__":
    main()
