"""Images benchmark: pull from a registry on loopback, create from the pulled image, write 1 GB.

    python bench/images.py [--mb 300] [--creates 40] [--json]

Starts Debian's reference registry on loopback, pushes a ~MB-sized image to it (a small
runnable base of the host's shell and coreutils, then layers of random data, which no
compression shrinks), and measures with an embedded engine in a fresh state dir:
- pull_cold_s: the first pull (nothing stored), pull_warm_s: the same pull again (every layer stored);
- create_from_pulled_p50_ms beside create_from_host_p50_ms (create, exec `true`, and destroy
  timed apart; creates from each are interleaved so both see the same host);
- write_1g_ok: `dd` of 1 GiB into a sandbox with memory_mb=256 and disk_mb=2048 exits 0.
Where podman runs here, its cold and warm pull of the same image from the same registry are
measured too (a peer built on the same containers/image and containers/storage).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from common import leaked, pct  # noqa: E402
from registry import push_tree, run_registry, runnable_tree  # noqa: E402
from fanfold import AsyncFleet, EngineConfig  # noqa: E402

def random_layer(root: Path, mb: int, seed: int) -> None:
    (root / "data").mkdir(parents=True)
    with open(root / "data" / f"blob{seed}", "wb") as out:
        for _ in range(mb):
            out.write(os.urandom(1 << 20))


def podman_pulls(ref: str) -> dict[str, float | None]:
    """podman's cold and warm pull of ``ref`` into a storage root of its own; None where podman does not run."""
    if shutil.which("podman") is None:
        return {"podman_pull_cold_s": None, "podman_pull_warm_s": None}
    with tempfile.TemporaryDirectory(prefix="bench-podman-") as tmp:
        argv = ["podman", "--root", f"{tmp}/root", "--runroot", f"{tmp}/run", "--storage-opt",
                "overlay.skip_mount_home=true", "--cgroup-manager", "cgroupfs", "pull", "-q", "--tls-verify=false", ref]
        times = []
        for _ in range(2):
            started = time.perf_counter()
            done = subprocess.run(argv, capture_output=True, text=True)
            times.append(time.perf_counter() - started)
            if done.returncode != 0:
                return {"podman_pull_cold_s": None, "podman_pull_warm_s": None}
        subprocess.run(["podman", "--root", f"{tmp}/root", "--runroot", f"{tmp}/run", "--storage-opt",
                        "overlay.skip_mount_home=true", "rmi", "-a", "-f"], capture_output=True)
        return {"podman_pull_cold_s": round(times[0], 3), "podman_pull_warm_s": round(times[1], 3)}


async def timed_creates(fleet: AsyncFleet, image: str, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        sandbox = await fleet.create(image)
        times.append((time.perf_counter() - started) * 1000)
        result = await sandbox.exec(["true"])
        await sandbox.kill()
        if not result.ok:
            raise RuntimeError(f"`true` failed in a sandbox of {image}: {result}")
    return times


async def measure(ref: str, state: Path, creates: int) -> dict[str, object]:
    config = EngineConfig(state_dir=state)
    out: dict[str, object] = {}
    async with AsyncFleet(config=config) as fleet:
        started = time.perf_counter()
        image = await fleet.pull(ref)
        out["pull_cold_s"] = round(time.perf_counter() - started, 3)
        warm = []
        for _ in range(3):
            started = time.perf_counter()
            again = await fleet.pull(ref)
            warm.append(time.perf_counter() - started)
            assert again.id == image.id
        out["pull_warm_s"] = pct(warm, 0.5)
        await timed_creates(fleet, image.id, 3)  # warm-up: the host base builds, the page cache fills
        await timed_creates(fleet, "host", 3)
        pulled: list[float] = []
        host: list[float] = []
        for _ in range(creates // 5):
            pulled += await timed_creates(fleet, image.id, 5)
            host += await timed_creates(fleet, "host", 5)
        out["create_from_pulled_p50_ms"] = pct(pulled, 0.5)
        out["create_from_pulled_p99_ms"] = pct(pulled, 0.99)
        out["create_from_host_p50_ms"] = pct(host, 0.5)
        out["create_from_host_p99_ms"] = pct(host, 0.99)
        out["create_pulled_over_host"] = round(pct(pulled, 0.5) / pct(host, 0.5), 3)  # type: ignore[operator]
        async with await fleet.create(image.id, memory_mb=256, disk_mb=2048) as sandbox:
            started = time.perf_counter()
            result = await sandbox.exec("dd if=/dev/zero of=/root/big bs=1M count=1024 2>&1 && rm /root/big", timeout=600)
            out["write_1g_s"] = round(time.perf_counter() - started, 3)
            out["write_1g_ok"] = result.ok
            if not result.ok:
                out["write_1g_outcome"] = f"{result.outcome.value} exit={result.exit_code}: {result.text[-300:]}"
        await fleet.remove_image(image.id)
        out["gc_removed"] = len(await fleet.gc())
    out["leaks"] = leaked(config)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=300, help="Image size in MB (random data beside a small base).")
    parser.add_argument("--creates", type=int, default=40, help="Creates from each image (pulled and host).")
    parser.add_argument("--json", action="store_true", help="Only the final JSON line.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-images-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        roots = [work / "base"]
        runnable_tree(roots[0])
        per_layer = max(1, (args.mb - 10) // 3)
        for seed in range(3):
            roots.append(work / f"data{seed}")
            random_layer(roots[-1], per_layer, seed)
        with run_registry(work / "registry") as registry:
            os.environ["FANFOLD_INSECURE_REGISTRIES"] = registry.host  # plain HTTP on loopback
            ref = push_tree(registry, "bench/image:v1", roots, config={"Cmd": ["/bin/sh"], "Env": ["PATH=/usr/bin:/bin"]})
            for root in roots:
                shutil.rmtree(root)
            result: dict[str, object] = {"image_mb": args.mb, "layers": len(roots)}
            result.update(asyncio.run(measure(ref, work / "state", args.creates)))
            result.update(podman_pulls(ref))
    if result.get("podman_pull_cold_s"):
        result["pull_cold_vs_podman"] = round(result["pull_cold_s"] / result["podman_pull_cold_s"], 3)  # type: ignore[operator]
    if not args.json:
        for key, value in result.items():
            print(f"{key:>28}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
