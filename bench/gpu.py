"""GPU sandboxes: create with a GPU, time to the first CUDA kernel inside, and N sandboxes sharing one GPU.

    python bench/gpu.py [--rounds 20] [--sandboxes 16] [--seconds 10] [--size 2048] [--state-dir DIR] [--json]

Measured on the host's first GPU, with ``gpu_shares`` set to ``--sandboxes``:
- ``create`` with ``gpus=1`` then ``kill``, ``--rounds`` times, beside the same without a GPU (p50, p99);
- time to the first CUDA kernel: from the create call to a kernel's result inside (python3 with
  PyTorch starts, initialises CUDA, runs one kernel), beside the same python3 run on the host;
- ``--sandboxes`` sandboxes on the one GPU, each running the same loop of ``--size`` square fp16
  matmuls for ``--seconds``, all at once: aggregate matmuls/s against that loop alone on the host, and
  against ``--sandboxes`` copies of it on the host at once (what time-slicing costs with no sandbox);
- leaks after the run (the census), which must be 0.

Needs an NVIDIA GPU and PyTorch with CUDA in the host's ``python3``; elsewhere the last line says
which is missing (``"skipped"``) and the status is 0. Progress goes to stderr; the last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import leaked, pct  # noqa: E402
from fanfold import AsyncFleet, EngineConfig, InvalidRequest  # noqa: E402

FIRST_KERNEL = ("import torch; x = torch.ones(8, device='cuda'); torch.cuda.synchronize(); print(float(x.sum()))")
LOOP = """\
import sys, time, torch
size, seconds = int(sys.argv[1]), float(sys.argv[2])
a = torch.randn(size, size, device="cuda", dtype=torch.float16)
b = torch.randn(size, size, device="cuda", dtype=torch.float16)
torch.cuda.synchronize()
done, start = 0, time.perf_counter()
while time.perf_counter() - start < seconds:
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    done += 10
print(done / (time.perf_counter() - start))
"""


QUIET = False


def say(text: str) -> None:
    if not QUIET:
        print(text, file=sys.stderr, flush=True)


def host_loops(count: int, size: int, seconds: float) -> float:
    """Matmuls/s of ``count`` copies of the loop on the host at once, summed."""
    runs = [subprocess.Popen(["python3", "-c", LOOP, str(size), str(seconds)], stdout=subprocess.PIPE, text=True)
            for _ in range(count)]
    return sum(float(run.communicate()[0]) for run in runs)


async def timed_creates(fleet: AsyncFleet, rounds: int, **limits: object) -> list[float]:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        sandbox = await fleet.create(**limits)
        times.append((time.perf_counter() - started) * 1000)
        await sandbox.kill()
    return times


async def first_kernels(fleet: AsyncFleet, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        sandbox = await fleet.create(gpus=1, memory_mb=8192)
        result = await sandbox.exec(["python3", "-c", FIRST_KERNEL], timeout=120)
        times.append((time.perf_counter() - started) * 1000)
        await sandbox.kill()
        if result.exit_code != 0:
            raise RuntimeError(f"the first kernel failed inside: {result.stderr.decode()[-400:]}")
    return times


async def shared(fleet: AsyncFleet, count: int, size: int, seconds: float) -> list[float]:
    made = await asyncio.gather(*(fleet.create(gpus=1, memory_mb=8192) for _ in range(count)))
    try:
        results = await asyncio.gather(*(s.exec(["python3", "-c", LOOP, str(size), str(seconds)], timeout=seconds + 300)
                                         for s in made))
    finally:
        await asyncio.gather(*(s.kill() for s in made))
    failed = [r for r in results if r.exit_code != 0]
    if failed:
        raise RuntimeError(f"{len(failed)} of {count} loops failed: {failed[0].stderr.decode()[-400:]}")
    return [float(r.stdout) for r in results]


def host_ms(rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        subprocess.run(["python3", "-c", FIRST_KERNEL], check=True, capture_output=True)
        times.append((time.perf_counter() - started) * 1000)
    return times


async def main(args: argparse.Namespace) -> dict[str, object]:
    base = {} if args.state_dir is None else {"state_dir": Path(args.state_dir)}
    config = EngineConfig(**base, gpu_shares=max(args.sandboxes, 1))
    async with AsyncFleet(config=config) as fleet:
        try:
            probe = await fleet.create(gpus=1)
        except InvalidRequest as err:
            return {"skipped": str(err)}
        has_torch = await probe.exec(["python3", "-c", "import torch; print(torch.cuda.get_device_name(0))"])
        await probe.kill()
        if has_torch.exit_code != 0:
            return {"skipped": "the host's python3 has no PyTorch that sees the GPU"}
        gpu = has_torch.stdout.decode().strip()
        say(f"GPU: {gpu}; {args.rounds} creates with and without a GPU")
        with_gpu = await timed_creates(fleet, args.rounds, gpus=1)
        without = await timed_creates(fleet, args.rounds)
        kernel_rounds = max(3, args.rounds // 4)
        say(f"first kernel: {kernel_rounds} rounds inside and on the host")
        inside, outside = await first_kernels(fleet, kernel_rounds), host_ms(kernel_rounds)
        say(f"{args.sandboxes} sandboxes share the GPU for {args.seconds:g} s")
        loops = await shared(fleet, args.sandboxes, args.size, args.seconds)
    say("the same loop on the host: alone, then as many copies at once")
    alone = host_loops(1, args.size, args.seconds)
    many = host_loops(args.sandboxes, args.size, args.seconds)
    aggregate = sum(loops)
    return {
        "gpu": gpu, "cores": os.cpu_count(),
        "create_gpu_p50_ms": pct(with_gpu, 0.5), "create_gpu_p99_ms": pct(with_gpu, 0.99),
        "create_p50_ms": pct(without, 0.5), "create_p99_ms": pct(without, 0.99),
        "first_kernel_p50_ms": pct(inside, 0.5), "first_kernel_p99_ms": pct(inside, 0.99),
        "host_first_kernel_p50_ms": pct(outside, 0.5),
        "first_kernel_over_host": round(pct(inside, 0.5) / pct(outside, 0.5), 3),
        "sandboxes": args.sandboxes, "matmul_size": args.size, "seconds": args.seconds,
        "shared_matmuls_per_s": round(aggregate, 1), "per_sandbox_min": round(min(loops), 1),
        "per_sandbox_max": round(max(loops), 1), "host_alone_matmuls_per_s": round(alone, 1),
        "host_many_matmuls_per_s": round(many, 1), "shared_over_host_alone": round(aggregate / alone, 3),
        "shared_over_host_many": round(aggregate / many, 3),
        "leaks": leaked(config),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="creates of each kind (default 20)")
    parser.add_argument("--sandboxes", type=int, default=16, help="sandboxes sharing the GPU (default 16)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each matmul loop (default 10)")
    parser.add_argument("--size", type=int, default=2048, help="matrix size of the loop's matmuls (default 2048)")
    parser.add_argument("--state-dir", help="the engine's state dir (default: FANFOLD_STATE_DIR or /var/lib/fanfold)")
    parser.add_argument("--json", action="store_true", help="no progress on stderr: only the JSON line")
    args = parser.parse_args()
    QUIET = args.json
    report = asyncio.run(main(args))
    print(json.dumps(report))
