"""HTTP API benchmark: exec `true` round trips over the unix socket, TCP loopback and in-process.

    python bench/api.py [--calls 500] [--clients 64] [--json]

Starts a real `fanfold serve` (unix socket plus TCP with a token), then measures, in the
same run: sequential exec of `true` through the embedded fleet, the unix socket and TCP
(p50, p99), and `--clients` clients, each with its own sandbox, running exec concurrently
over the unix socket (calls/s), with the embedded figure beside it. The last line is one
JSON object with unix_exec_p50_ms, tcp_exec_p50_ms, embedded_exec_p50_ms and
concurrent_exec_per_s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fanfold import AsyncFleet, EngineConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import leaked, pct  # noqa: E402


def start_server(config: EngineConfig, where: Path, token: str) -> tuple[subprocess.Popen[str], str, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "fanfold.cli", "--state-dir", str(config.state_dir), "serve",
         "--socket", str(where / "bench.sock"), "--port", "0", "--token", token],
        stdout=subprocess.PIPE, text=True,
    )
    assert process.stdout is not None
    match = re.search(r"listening on (unix://\S+) (http://\S+)", process.stdout.readline())
    if match is None:
        process.kill()
        raise SystemExit("fanfold serve did not start")
    return process, match.group(1), match.group(2)


async def sequential(fleet: AsyncFleet, calls: int) -> list[float]:
    sandbox = await fleet.create()
    try:
        for _ in range(20):  # warm-up: connections, caches
            await sandbox.exec(["true"])
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            result = await sandbox.exec(["true"])
            times.append((time.perf_counter() - start) * 1000)
            if not result.ok:
                raise RuntimeError(f"exec failed: {result}")
        return times
    finally:
        await sandbox.kill()


async def concurrent(fleet: AsyncFleet, clients: int, calls: int) -> float:
    sandboxes = await asyncio.gather(*(fleet.create(memory_mb=64) for _ in range(clients)))
    per_client = max(1, calls // clients)

    async def client(sandbox) -> None:  # type: ignore[no-untyped-def]
        for _ in range(per_client):
            if not (await sandbox.exec(["true"])).ok:
                raise RuntimeError("exec failed")

    try:
        start = time.perf_counter()
        await asyncio.gather(*(client(s) for s in sandboxes))
        return round(per_client * clients / (time.perf_counter() - start), 1)
    finally:
        await asyncio.gather(*(s.kill() for s in sandboxes))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=500, help="sequential calls per transport, and concurrent calls in all")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print only the final JSON line on stdout")
    args = parser.parse_args()
    config = EngineConfig()
    token = "bench-" + secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="fanfold-bench-") as where:
        async with AsyncFleet(config=config) as embedded:
            await embedded.create()  # build the base image once
            process, unix_url, tcp_url = start_server(config, Path(where), token)
            try:
                async with AsyncFleet(unix_url) as unix, AsyncFleet(tcp_url, token=token) as tcp:
                    times = {name: await sequential(fleet, args.calls)
                             for name, fleet in (("embedded", embedded), ("unix", unix), ("tcp", tcp))}
                    rates = {name: await concurrent(fleet, args.clients, args.calls * 4)
                             for name, fleet in (("embedded", embedded), ("unix", unix))}
            finally:
                process.send_signal(signal.SIGTERM)
                server_exit = process.wait(timeout=120)
    result = {
        "calls": args.calls,
        "clients": args.clients,
        **{f"{name}_exec_{q}_ms": pct(values, fraction) for name, values in times.items()
           for q, fraction in (("p50", 0.5), ("p99", 0.99))},
        "concurrent_exec_per_s": rates["unix"],
        "embedded_concurrent_exec_per_s": rates["embedded"],
        "server_exit_code": server_exit,
        "leaked": leaked(config),
    }
    result["unix_minus_embedded_p50_ms"] = round(result["unix_exec_p50_ms"] - result["embedded_exec_p50_ms"], 3)
    if not args.json:
        for name, values in times.items():
            print(f"{name:9s} exec p50 {pct(values, 0.5)} ms  p99 {pct(values, 0.99)} ms")
        print(f"{args.clients} clients: unix {rates['unix']} calls/s, embedded {rates['embedded']} calls/s")
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
