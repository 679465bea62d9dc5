"""Integrations: the unmodified e2b, e2b-code-interpreter and OpenEnv SDKs beside fanfold's own, on one server.

    python bench/integrations.py [--creates 100] [--calls 500] [--files 200] [--kernels 20] [--episodes 20]
                                 [--steps 10] [--state-dir /var/lib/fanfold-bench] [--json]

Starts a real `fanfold serve` (TCP with a token), then measures against it, in the same run, each
e2b figure interleaved call by call with fanfold's synchronous SDK over the same TCP port: create +
kill of a ``host`` sandbox (``e2b.Sandbox.create``/``kill`` vs ``Fleet.create("host")``/``kill``);
a command round trip on a warm sandbox (``commands.run("true")``, which runs ``/bin/bash -l -c``,
vs ``exec(["/bin/bash", "-l", "-c", "true"])``); a write + read of 64 KiB (``files.write``/``read``
on both). Then, e2b-only and OpenEnv-only: ``e2b_code_interpreter``'s ``run_code("1 + 1")`` on a
warm context and the first ``run_code`` of a fresh sandbox (the kernel's start); and OpenEnv's
``GenericEnvClient`` on ``/openenv/codefix`` (the token as the URL's password): a reset in a fresh
session (connect included), a reset in an open one, and a cheap step (``read_file``). The SDKs are
configured only by E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY. The last line is one JSON object;
``*_ratio`` is e2b's p50 over fanfold's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from api import start_server  # noqa: E402
from common import leaked, pct  # noqa: E402
from fanfold import EngineConfig, Fleet  # noqa: E402

PAYLOAD = os.urandom(64 << 10)
BASH_TRUE = ["/bin/bash", "-l", "-c", "true"]
READ_STATS = {"name": "read_file", "arguments": {"path": "stats.py"}}


def ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = call()
    return ms(start), value


def point_e2b_at(tcp_url: str, token: str) -> None:
    """The SDKs' whole configuration: fanfold's e2b routes and the token as the API key."""
    os.environ.update(E2B_API_URL=f"{tcp_url}/e2b", E2B_SANDBOX_URL=f"{tcp_url}/e2b/envd", E2B_API_KEY=token)
    os.environ.pop("E2B_DEBUG", None)
    os.environ.pop("E2B_DOMAIN", None)


def in_turn(index: int, *calls: Callable[[], None]) -> None:
    """Run ``calls`` one after another, reversed every other time: neither SDK always goes first."""
    for call in calls if index % 2 == 0 else calls[::-1]:
        call()


def creates(fleet: Fleet, count: int) -> dict[str, list[float]]:
    """Create then kill, e2b and fanfold in turn; create and kill timed apart."""
    import e2b

    times: dict[str, list[float]] = {"e2b_create": [], "e2b_kill": [], "fanfold_create": [], "fanfold_kill": []}

    def e2b_once() -> None:
        took, sbx = timed(e2b.Sandbox.create)
        times["e2b_create"].append(took)
        times["e2b_kill"].append(timed(sbx.kill)[0])

    def fanfold_once() -> None:
        took, sandbox = timed(lambda: fleet.create("host"))
        times["fanfold_create"].append(took)
        times["fanfold_kill"].append(timed(sandbox.kill)[0])

    for index in range(count):
        in_turn(index, e2b_once, fanfold_once)
    return times


def round_trips(fleet: Fleet, calls: int, file_calls: int) -> dict[str, list[float]]:
    """Commands, then 64 KiB write + read, on one warm sandbox of each, in turn."""
    import e2b

    times: dict[str, list[float]] = {"e2b_run": [], "fanfold_exec": [], "e2b_files": [], "fanfold_files": []}

    def e2b_run() -> None:
        took, result = timed(lambda: sbx.commands.run("true"))
        times["e2b_run"].append(took)
        assert result.exit_code == 0, result

    def fanfold_exec() -> None:
        took, result = timed(lambda: sandbox.exec(BASH_TRUE))
        times["fanfold_exec"].append(took)
        assert result.ok, result

    def e2b_files() -> None:
        took, back = timed(lambda: (sbx.files.write("/tmp/bench.bin", PAYLOAD),
                                    sbx.files.read("/tmp/bench.bin", format="bytes"))[1])
        times["e2b_files"].append(took)
        assert bytes(back) == PAYLOAD

    def fanfold_files() -> None:
        took, back = timed(lambda: (sandbox.files.write("/tmp/bench.bin", PAYLOAD),
                                    sandbox.files.read("/tmp/bench.bin"))[1])
        times["fanfold_files"].append(took)
        assert back == PAYLOAD

    sbx = e2b.Sandbox.create()
    try:
        with fleet.create("host") as sandbox:
            for index in range(10):  # warm-up: connections, the login shell's files in the page cache
                in_turn(index, e2b_run, fanfold_exec, e2b_files, fanfold_files)
            for values in times.values():
                values.clear()
            for index in range(calls):
                in_turn(index, e2b_run, fanfold_exec)
            for index in range(file_calls):
                in_turn(index, e2b_files, fanfold_files)
    finally:
        sbx.kill()
    return times


def interpreter(calls: int, kernels: int) -> dict[str, list[float]]:
    """``run_code("1 + 1")`` on a warm context, and the first ``run_code`` of ``kernels`` fresh sandboxes."""
    from e2b_code_interpreter import Sandbox

    times: dict[str, list[float]] = {"kernel_start": [], "run_code": []}
    for index in range(kernels + 1):
        with Sandbox.create() as sbx:
            took, first = timed(lambda: sbx.run_code("1 + 1"))
            assert first.text == "2", first
            if index:  # the first sandbox's is a warm-up: the SDK's and the server's code paths loaded
                times["kernel_start"].append(took)
            if index == kernels:
                for _ in range(calls):
                    took, cell = timed(lambda: sbx.run_code("1 + 1"))
                    times["run_code"].append(took)
                    assert cell.text == "2", cell
    return times


async def openenv(base_url: str, episodes: int, steps: int) -> dict[str, list[float]]:
    """Per episode: a fresh session's connect + reset, a second reset in it, then ``steps`` steps."""
    from openenv.core.generic_client import GenericEnvClient

    times: dict[str, list[float]] = {"session_reset": [], "reset": [], "step": []}
    for index in range(episodes + 1):
        start = time.perf_counter()
        async with GenericEnvClient(base_url=base_url) as env:
            await env.reset()
            took = {"session_reset": [ms(start)], "reset": [], "step": []}
            start = time.perf_counter()
            await env.reset()
            took["reset"].append(ms(start))
            for _ in range(steps):
                start = time.perf_counter()
                result = await env.step(READ_STATS)
                took["step"].append(ms(start))
                assert "def mean" in result.observation["text"] and not result.done, result
        if index:  # the first episode builds the env's image: a warm-up
            for name, values in took.items():
                times[name] += values
    return times


def ratio(e2b_values: list[float], fanfold_values: list[float]) -> float | None:
    e2b_p50, fanfold_p50 = pct(e2b_values, 0.5), pct(fanfold_values, 0.5)
    return round(e2b_p50 / fanfold_p50, 2) if e2b_p50 and fanfold_p50 else None


def measure(tcp_url: str, token: str, args: argparse.Namespace, say: Callable[..., None]) -> dict[str, list[float]]:
    point_e2b_at(tcp_url, token)
    with Fleet(tcp_url, token=token) as fleet:
        fleet.create("host").kill()  # the host image made, the connection open
        say("creates...")
        times = creates(fleet, args.creates)
        say("round trips...")
        times.update(round_trips(fleet, args.calls, args.files))
    say("code interpreter...")
    times.update({f"interpreter_{k}": v for k, v in interpreter(args.calls, args.kernels).items()})
    say("openenv...")
    base_url = f"http://fanfold:{token}@{urlsplit(tcp_url).netloc}/openenv/codefix"
    times.update({f"openenv_{k}": v for k, v in asyncio.run(openenv(base_url, args.episodes, args.steps)).items()})
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--creates", type=int, default=100, help="create + kill pairs of each SDK")
    parser.add_argument("--calls", type=int, default=500, help="command round trips of each SDK, and warm run_code")
    parser.add_argument("--files", type=int, default=200, help="64 KiB write + read round trips of each SDK")
    parser.add_argument("--kernels", type=int, default=20, help="fresh code interpreter sandboxes: kernel starts")
    parser.add_argument("--episodes", type=int, default=20, help="OpenEnv sessions, each with two resets")
    parser.add_argument("--steps", type=int, default=10, help="OpenEnv steps per episode (codefix allows 15)")
    parser.add_argument("--state-dir", default="/var/lib/fanfold-bench")
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")
    args = parser.parse_args()
    config = EngineConfig(state_dir=Path(args.state_dir))
    token = "bench-" + secrets.token_hex(16)
    say = (lambda *a: None) if args.json else print
    with tempfile.TemporaryDirectory(prefix="fanfold-bench-") as where:
        process, _, tcp_url = start_server(config, Path(where), token)
        try:
            times = measure(tcp_url, token, args, say)
        finally:
            process.send_signal(signal.SIGTERM)
            server_exit = process.wait(timeout=120)
    for name in ("e2b", "fanfold"):
        times[f"{name}_create_kill"] = [c + k for c, k in zip(times[f"{name}_create"], times[f"{name}_kill"])]
    result: dict[str, Any] = {
        f"{name}_{q}_ms": pct(values, fraction) for name, values in times.items()
        for q, fraction in (("p50", 0.5), ("p99", 0.99))
    }
    result.update({
        "create_kill_ratio": ratio(times["e2b_create_kill"], times["fanfold_create_kill"]),
        "create_ratio": ratio(times["e2b_create"], times["fanfold_create"]),
        "command_ratio": ratio(times["e2b_run"], times["fanfold_exec"]),
        "files_ratio": ratio(times["e2b_files"], times["fanfold_files"]),
        "creates": args.creates, "calls": args.calls, "files": args.files, "kernels": args.kernels,
        "episodes": args.episodes, "steps": args.steps,
        "server_exit_code": server_exit,
        "leaked": leaked(config),
    })
    if not args.json:
        for name, values in times.items():
            print(f"{name:30s} p50 {pct(values, 0.5)} ms  p99 {pct(values, 0.99)} ms  (n={len(values)})")
        print(" ".join(f"{k} {result[k]}" for k in result if k.endswith("_ratio")))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
