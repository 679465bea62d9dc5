"""Sandbox networks: what a policy costs a create, a request and a download.

    python bench/network.py [--creates 40] [--requests 200] [--download-mb 100] [--json]

In one run, on the ``host`` image: creates with ``network="none"`` and with an allow policy,
interleaved, both taken from a warm pool (the pool's sandboxes are brought up ahead; a policy
create attaches the proxy's listener at hand-out) and both brought up cold (with a third kind cold:
the policy with transparent capture); then HTTP GETs of a
small body from a server on this host's loopback, made by one client program run directly on the
host and inside a sandbox through the egress proxy (a new connection per request, as pip and curl
make them); then a download of ``--download-mb`` MB through the proxy, against the same download
made directly. The server is made reachable to the proxy with ``net_reachable=127.0.0.0/8`` (a
bench-only setting: loopback is off limits by default). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import leaked, pct  # noqa: E402
from fanfold import AsyncFleet, EngineConfig  # noqa: E402

NAME = "bench.fanfold.test"
CLIENT = r"""
import socket, sys, time, os
host, port, count, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
proxy = os.environ.get("http_proxy")
times = []
for _ in range(count):
    t = time.perf_counter()
    if proxy:
        s = socket.create_connection(("127.0.0.1", int(proxy.rsplit(":", 1)[1])))
        s.sendall(f"GET http://{host}:{port}{path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
    else:
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
    got = 0
    while chunk := s.recv(1 << 20):
        got += len(chunk)
    s.close()
    times.append((time.perf_counter() - t) * 1000)
print(" ".join(f"{v:.4f}" for v in times), got)
"""


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    BLOCK = bytes(range(256)) * 4096  # 1 MiB

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path.startswith("/bytes/"):
            size = int(self.path.rsplit("/", 1)[1])
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            while size > 0:
                part = self.BLOCK[:min(size, len(self.BLOCK))]
                self.wfile.write(part)
                size -= len(part)
            return
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def serve() -> socketserver.ThreadingTCPServer:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def summary(values: list[float]) -> dict[str, float | None]:
    return {"p50": pct(values, 0.5), "p99": pct(values, 0.99), "n": len(values)}


async def creates(fleet: AsyncFleet, count: int, policy: dict[str, Any], pooled: bool) -> dict[str, list[float]]:
    kinds: list[tuple[str, Any]] = [("none", "none"), ("allow", policy)]
    if not pooled:
        kinds.append(("transparent", {**policy, "transparent": True}))
    times: dict[str, list[float]] = {kind: [] for kind, _ in kinds}
    if pooled:
        await fleet.pool("host", 2, wait=120)
    for _ in range(count):
        for kind, network in kinds:
            if pooled:
                await fleet.pool("host", 2, wait=120)  # refilled off the clock
            t = time.perf_counter()
            sandbox = await fleet.create("host", network=network)
            times[kind].append(ms(t))
            await sandbox.kill()
    if pooled:
        await fleet.pool("host", 0)
    return times


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--creates", type=int, default=40, help="creates of each kind, pooled and cold")
    parser.add_argument("--requests", type=int, default=200, help="small GETs, direct and through the proxy")
    parser.add_argument("--download-mb", type=int, default=100)
    parser.add_argument("--state-dir", default="/var/lib/fanfold-bench")
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")
    args = parser.parse_args()
    server = serve()
    port = server.server_address[1]
    config = EngineConfig(state_dir=Path(args.state_dir), net_reachable=("127.0.0.0/8",),
                          net_hosts=((NAME, ("127.0.0.1",)),))
    policy = {"allow": [f"{NAME}:{port}"]}
    say = (lambda *a: None) if args.json else print
    async with AsyncFleet(config=config) as fleet:
        warm = await fleet.create("host", network=policy)  # the agent compiled, netd started, the image cached
        await warm.kill()
        say("creates, pooled...")
        pooled = await creates(fleet, args.creates, policy, pooled=True)
        say("creates, cold...")
        cold = await creates(fleet, args.creates, policy, pooled=False)
        say("requests...")
        async with await fleet.create("host", network=policy) as box:
            direct_run = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-c", CLIENT, NAME, str(port), str(args.requests), "/small"],
                capture_output=True, text=True, check=True)
            proxied_run = await box.exec(["python3", "-c", CLIENT, NAME, str(port), str(args.requests), "/small"])
            assert proxied_run.ok, proxied_run.stderr
            direct = [float(v) for v in direct_run.stdout.split()[:-1]]
            proxied = [float(v) for v in proxied_run.text.split()[:-1]]
            say("download...")
            size = args.download_mb << 20
            path = f"/bytes/{size}"
            t = time.perf_counter()
            done = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-c", CLIENT, NAME, str(port), "1", path], capture_output=True,
                text=True, check=True)
            direct_s = (time.perf_counter() - t)
            fetched = await box.exec(["python3", "-c", CLIENT, NAME, str(port), "1", path], timeout=300)
            assert fetched.ok and int(fetched.text.split()[-1]) > size, fetched.stderr
            proxied_s = float(fetched.text.split()[0]) / 1000
            assert int(done.stdout.split()[-1]) > size
            stats = await box.network_stats()
    server.shutdown()
    result = {
        "create_none_p50_ms": pct(pooled["none"], 0.5), "create_allow_p50_ms": pct(pooled["allow"], 0.5),
        "create_none_p99_ms": pct(pooled["none"], 0.99), "create_allow_p99_ms": pct(pooled["allow"], 0.99),
        "create_cold_none_p50_ms": pct(cold["none"], 0.5), "create_cold_allow_p50_ms": pct(cold["allow"], 0.5),
        "create_cold_transparent_p50_ms": pct(cold["transparent"], 0.5),
        "proxy_request_p50_ms": pct(proxied, 0.5), "proxy_request_p99_ms": pct(proxied, 0.99),
        "direct_request_p50_ms": pct(direct, 0.5), "direct_request_p99_ms": pct(direct, 0.99),
        "download_mb_per_s": round(args.download_mb / proxied_s, 1),
        "direct_download_mb_per_s": round(args.download_mb / direct_s, 1),
        "proxy_bytes_down": stats.get("bytes_down"),
        "creates_per_kind": args.creates, "requests": args.requests,
        "leaked": leaked(config),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
