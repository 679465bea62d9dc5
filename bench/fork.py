"""Memory-state benchmark: fork, memory snapshots, suspend/resume, pause/unpause, reset; lazy and eager restore.

    python bench/fork.py [--sizes 64,256,1024] [--state-mb 256] [--rounds 10] [--state-dir DIR] [--frozen-dump] [--json]

A sandbox runs a Python process (the holder) holding N MB of live, touched memory, for each N of
``--sizes``. Measured for each size, with lazy restore on (``DIR``) and off (a second engine on
``DIR-eager``, ``lazy_restore=False``), rounds alternating between the two: ``fork(8)`` (total, how
long the parent was frozen), then each child's holder reading 1% of its pages (every 100th) and
then all of them, timed inside the holder, and the fork plus all eight children's touches as the
caller sees them; ``snapshot(memory=True)`` (time and size), ``create`` from that snapshot,
``suspend``/``resume`` and the resumed holder's 1% and 100% touches, ``pause``/``unpause``. A lazy
sandbox's page counters (``metrics()``) are read after its restore and after each touch, and the page
server's resident memory while it serves a fork's children (``page_server_kb_serving_8``). The peer is
what you would do without memory checkpoints: create a sandbox and rebuild the state (start Python,
touch the memory), the cold start. ``reset`` (of a sandbox made from the image) is measured once,
lazy engine. Forks get a third of ``--rounds``; sizes above 256 MB fewer rounds (``--rounds * 256 /
N``), at least 3 of each unless ``--rounds`` is less: the default run does 3 forks and 10 resumes at
64 and 256 MB, 3 and 3 at 1 GB, and takes 3-4 minutes on an idle 2-core machine (7 on a busy one).
Memory: both holders of a size plus 8 children, up to 10 GB at 1 GB; the
children are killed as soon as measured.

The flat keys of the old report (``fork8_total_ms``, ``resume_p50_ms``, ...) describe the lazy
engine at the size nearest ``--state-mb``; ``..._by_mb`` keys give the medians per size,
``..._eager`` the same with lazy restore off, ``copy_on_write_dump`` whether forks and memory
snapshots wrote pages after the parent ran again (the default) or while it was frozen (``--frozen-dump``), ``eager_over_lazy_by_mb`` their ratios and ``p99_by_mb``
the p99s. Progress goes to stderr; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import leaked, pct  # noqa: E402
from fanfold import AsyncFleet, EngineConfig  # noqa: E402
from fanfold.host import census  # noqa: E402

# Reads one byte of every `step`-th page of its bytearray each time a step arrives on /tmp/touch.in
# and answers on /tmp/touch.out with the time it took and how many of those bytes were still 1.
HOLDER_PY = """\
import os, sys, time
PAGE = 4096
state = bytearray(int(sys.argv[1]) << 20)
for i in range(0, len(state), PAGE):
    state[i] = 1
os.mkfifo("/tmp/touch.in")
os.mkfifo("/tmp/touch.out")
open("/tmp/ready", "w").write("1")
while True:
    with open("/tmp/touch.in") as trigger:
        step = int(trigger.read()) * PAGE
    start = time.perf_counter()
    intact = state[::step].count(1)
    took = (time.perf_counter() - start) * 1000
    with open("/tmp/touch.out", "w") as answer:
        answer.write(f"{took:.3f} {intact}")
"""
START_HOLDER = "nohup python3 /tmp/holder.py {mb} >/dev/null 2>&1 &"
WAIT_READY = "while [ ! -f /tmp/ready ]; do sleep 0.01; done"
TOUCH = "echo {step} > /tmp/touch.in && cat /tmp/touch.out"
ONE_PCT, ALL = 100, 1
"""Page steps of a touch: every 100th page, every page."""
FORK_COUNT = 8

OLD_KEYS = ("fork8_total", "fork8_parent_pause", "snapshot_memory", "create_from_memory", "suspend", "resume",
            "pause", "unpause", "reset", "cold_start")
"""The timings the report gave before sizes and the eager peer: summaries at the reference size."""
BY_MB = ("fork8_total", "fork8_parent_pause", "fork8_then_1pct", "fork8_then_100pct", "first_touch_1pct",
         "first_touch_100pct", "resume", "resume_touch_1pct", "resume_touch_100pct", "suspend",
         "create_from_memory", "snapshot_memory", "cold_start")
"""Timings reported per size, for both engines."""
KEY_NAMES = {"resume": "resume_p50"}


@dataclass
class Engine:
    """One fleet (lazy or eager restore) and what was measured on it, by size."""

    name: str
    fleet: AsyncFleet
    config: EngineConfig
    times: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    pages: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    sizes: dict[int, list[int]] = field(default_factory=dict)

    def record(self, mb: int, key: str, *values: float) -> None:
        self.times.setdefault(mb, {}).setdefault(key, []).extend(values)

    def count_pages(self, mb: int, key: str, *values: int) -> None:
        self.pages.setdefault(mb, {}).setdefault(key, []).extend(values)


def summary(values: list[float]) -> dict[str, float | None]:
    return {"p50": pct(values, 0.5), "p99": pct(values, 0.99), "mean": round(statistics.fmean(values), 2) if values else None}


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def pages_touched(mb: int, step: int) -> int:
    return math.ceil((mb << 20) / 4096 / step)


def rounds_at(mb: int, rounds: int) -> tuple[int, int]:
    """(fork rounds, resume rounds) at ``mb``: fewer above 256 MB; 3 of each at least (a true median),
    unless ``rounds`` is less."""
    resumes = rounds if mb <= 256 else min(rounds, max(3, rounds * 256 // mb))
    return min(resumes, max(3, resumes // 3)), resumes


async def holder(fleet: AsyncFleet, mb: int):  # type: ignore[no-untyped-def]
    """A sandbox whose Python process holds ``mb`` MiB of touched memory; and how long that took."""
    start = time.perf_counter()
    sandbox = await fleet.create(memory_mb=mb + 256)
    await sandbox.files.write("/tmp/holder.py", HOLDER_PY)
    await sandbox.exec(START_HOLDER.format(mb=mb))
    await sandbox.exec(WAIT_READY, timeout=120)
    return sandbox, ms_since(start)


async def touch(sandbox, mb: int, step: int) -> float:  # type: ignore[no-untyped-def]
    """Have the holder read every ``step``-th page; the time it took, as the holder saw it."""
    result = await sandbox.exec(TOUCH.format(step=step), timeout=300)
    took, _, intact = result.text.partition(" ") if result.ok else ("", "", "")
    if not intact or int(intact) != pages_touched(mb, step):
        raise RuntimeError(f"the holder in {sandbox.id} lost its state: {result}")
    return float(took)


async def page_counts(fleet: AsyncFleet, ids: list[str]) -> list[dict[str, Any]]:
    """The lazy page counters of these sandboxes (those with none, eager ones, left out)."""
    by_id = {s["id"]: s.get("memory_pages") for s in (await fleet.metrics())["sandboxes"]}
    return [by_id[i] for i in ids if by_id.get(i)]


async def note_pages(engine: Engine, mb: int, stage: str, ids: list[str]) -> None:
    for counts in await page_counts(engine.fleet, ids):
        engine.count_pages(mb, f"{stage}_copied", counts["copied"])
        engine.count_pages(mb, "total", counts["total"])
        engine.count_pages(mb, f"{stage}_faults", counts["faults"])


def page_server_kb(config: EngineConfig) -> int:
    """Resident anonymous memory of the state dir's page servers, kB (0: none runs)."""
    total = 0
    for pid in census.page_servers(config):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("RssAnon:")), 0)
    return total


async def fork_round(engine: Engine, parent, mb: int) -> None:  # type: ignore[no-untyped-def]
    """fork(8), then every child touches 1% of the state, then all of it; the children are killed."""
    start = time.perf_counter()
    fork = await parent.fork(FORK_COUNT)
    try:
        forked = ms_since(start)
        engine.record(mb, "fork8_total", forked)
        engine.record(mb, "fork8_parent_pause", fork.result.parent_pause_ms)
        ids = [child.id for child in fork.children]
        await note_pages(engine, mb, "fork_restored", ids)
        if serving := page_server_kb(engine.config):  # its whole resident memory: malloc keeps what it freed
            engine.count_pages(mb, "page_server_kb_serving_8", serving)
        spent = forked
        for step, stage in ((ONE_PCT, "1pct"), (ALL, "100pct")):
            start = time.perf_counter()
            engine.record(mb, f"first_touch_{stage}", *await asyncio.gather(*(touch(c, mb, step) for c in fork.children)))
            spent += ms_since(start)
            engine.record(mb, f"fork8_then_{stage}", spent)
            await note_pages(engine, mb, f"fork_{stage}", ids)
    finally:
        await fork.kill()


async def resume_round(engine: Engine, parent, mb: int) -> None:  # type: ignore[no-untyped-def]
    """A memory snapshot and a create from it; suspend, resume and the resumed holder's touches; pause."""
    fleet = engine.fleet
    start = time.perf_counter()
    snapshot = await parent.snapshot(memory=True)
    engine.record(mb, "snapshot_memory", ms_since(start))
    engine.sizes.setdefault(mb, []).append(snapshot.size_bytes)
    start = time.perf_counter()
    copy = await fleet.create(snapshot.id)
    engine.record(mb, "create_from_memory", ms_since(start))
    await copy.kill()
    await fleet.delete_snapshot(snapshot.id)
    for verb, key in ((parent.suspend, "suspend"), (parent.resume, "resume")):
        start = time.perf_counter()
        await verb()
        engine.record(mb, key, ms_since(start))
    await note_pages(engine, mb, "resume_restored", [parent.id])
    for step, stage in ((ONE_PCT, "1pct"), (ALL, "100pct")):
        engine.record(mb, f"resume_touch_{stage}", await touch(parent, mb, step))
        await note_pages(engine, mb, f"resume_{stage}", [parent.id])
    for verb, key in ((parent.pause, "pause"), (parent.unpause, "unpause")):
        start = time.perf_counter()
        await verb()
        engine.record(mb, key, ms_since(start))


def alternating(engines: list[Engine], rounds: int):  # type: ignore[no-untyped-def]
    """The engines ``rounds`` times over, their order swapped every round."""
    for number in range(rounds):
        for engine in (engines if number % 2 == 0 else engines[::-1]):
            yield engine


async def measure_size(engines: list[Engine], mb: int, rounds: int, progress: Callable[[str], None]) -> None:
    """Both engines at ``mb``: a holder each, fork rounds, then resume rounds, interleaved; cold starts."""
    forks, resumes = rounds_at(mb, rounds)
    parents = {}
    try:
        for engine in engines:
            parents[engine.name], cold = await holder(engine.fleet, mb)
            engine.record(mb, "cold_start", cold)
        for number, engine in enumerate(alternating(engines, forks)):
            await fork_round(engine, parents[engine.name], mb)
            progress(f"{mb} MB fork {number // len(engines) + 1}/{forks}")
        for number, engine in enumerate(alternating(engines, resumes)):
            await resume_round(engine, parents[engine.name], mb)
            progress(f"{mb} MB resume {number // len(engines) + 1}/{resumes}")
    finally:
        await asyncio.gather(*(parent.kill() for parent in parents.values()))
    for engine in engines:
        sandbox, cold = await holder(engine.fleet, mb)
        engine.record(mb, "cold_start", cold)
        await sandbox.kill()


async def measure_reset(engine: Engine, mb: int, count: int) -> None:
    plain = await engine.fleet.create()
    try:
        for _ in range(count):
            await plain.exec("echo dirty > /root/dirty")
            start = time.perf_counter()
            await plain.reset()
            engine.record(mb, "reset", ms_since(start))
    finally:
        await plain.kill()


async def warm_up(fleet: AsyncFleet) -> None:
    """A first create builds the agent and caches the image: not a cold start worth timing."""
    await (await fleet.create()).kill()


def p50(engine: Engine, mb: int, key: str) -> float | None:
    return pct(engine.times.get(mb, {}).get(key, []), 0.5)


def ratio(top: float | None, bottom: float | None) -> float | None:
    return round(top / bottom, 2) if top and bottom else None


def old_report(engine: Engine, mb: int) -> dict[str, object]:
    """The keys the report had before sizes and the eager peer, at ``mb``."""
    times = engine.times.get(mb, {})
    out: dict[str, object] = {"state_mb": mb}
    for key in OLD_KEYS:
        out[key] = summary(times.get(key, []))
    sizes = engine.sizes.get(mb, [])
    out["snapshot_memory_size_mb"] = round(statistics.median(sizes) / (1 << 20), 1) if sizes else None
    resume, cold = p50(engine, mb, "resume"), p50(engine, mb, "cold_start")
    out.update({
        "fork8_total_ms": p50(engine, mb, "fork8_total"),
        "fork8_parent_pause_ms": p50(engine, mb, "fork8_parent_pause"),
        "resume_p50_ms": resume,
        "unpause_p50_ms": p50(engine, mb, "unpause"),
        "reset_p50_ms": p50(engine, mb, "reset"),
        "cold_start_p50_ms": cold,
        "cold_start_over_resume": ratio(cold, resume),
    })
    return out


def by_size(engine: Engine, sizes: list[int], suffix: str) -> dict[str, object]:
    """Medians per size, derived figures and page counters of one engine, keys ending in ``suffix``."""
    out: dict[str, object] = {}
    for key in BY_MB:
        out[f"{KEY_NAMES.get(key, key)}_ms_by_mb{suffix}"] = {str(mb): p50(engine, mb, key) for mb in sizes}
    then_1pct = out[f"fork8_then_1pct_ms_by_mb{suffix}"]
    out[f"fork8_growth_64_to_1024_1pct{suffix}"] = ratio(then_1pct.get("1024"), then_1pct.get("64"))  # type: ignore[union-attr]
    out[f"resume_faster_than_cold_by_mb{suffix}"] = {
        str(mb): (resume < cold) if (resume := p50(engine, mb, "resume")) and (cold := p50(engine, mb, "cold_start")) else None
        for mb in sizes}
    return out


def pages_report(engine: Engine, sizes: list[int]) -> dict[str, dict[str, object]]:
    """Median page counters of lazily restored sandboxes per size, beside the holder's own pages."""
    out: dict[str, dict[str, object]] = {}
    for mb in sizes:
        counted = engine.pages.get(mb, {})
        if counted:
            out[str(mb)] = {"holder_pages": pages_touched(mb, ALL), "touched_1pct": pages_touched(mb, ONE_PCT),
                            **{key: pct([float(v) for v in values], 0.5) for key, values in sorted(counted.items())}}
    return out


def report(lazy: Engine, eager: Engine, sizes: list[int], reference: int, rounds: int) -> dict[str, object]:
    out = old_report(lazy, reference)
    out["sizes_mb"] = sizes
    for engine, suffix in ((lazy, ""), (eager, "_eager")):
        out.update(by_size(engine, sizes, suffix))
        out[f"first_touch_1pct_ms{suffix}"] = p50(engine, reference, "first_touch_1pct")
    out["eager_over_lazy_by_mb"] = {
        key: {str(mb): ratio(p50(eager, mb, key), p50(lazy, mb, key)) for mb in sizes} for key in BY_MB}
    out["p99_by_mb"] = {engine.name: {key: {str(mb): pct(engine.times.get(mb, {}).get(key, []), 0.99) for mb in sizes}
                                      for key in BY_MB} for engine in (lazy, eager)}
    out["lazy_pages_by_mb"] = pages_report(lazy, sizes)
    out["rounds_by_mb"] = {str(mb): dict(zip(("fork", "resume"), rounds_at(mb, rounds))) for mb in sizes}
    return out


async def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, object]:
    sizes = sorted({int(size) for size in args.sizes.split(",")})
    reference = min(sizes, key=lambda mb: abs(mb - args.state_mb))
    base = EngineConfig(state_dir=args.state_dir) if args.state_dir else EngineConfig()
    cow = not args.frozen_dump
    configs = (EngineConfig(state_dir=base.state_dir, lazy_restore=True, copy_on_write_dump=cow),
               EngineConfig(state_dir=f"{base.state_dir}-eager", lazy_restore=False, copy_on_write_dump=cow))
    async with AsyncFleet(config=configs[0]) as lazy_fleet, AsyncFleet(config=configs[1]) as eager_fleet:
        lazy, eager = Engine("lazy", lazy_fleet, configs[0]), Engine("eager", eager_fleet, configs[1])
        await asyncio.gather(warm_up(lazy_fleet), warm_up(eager_fleet))
        for mb in sizes:
            await measure_size([lazy, eager], mb, args.rounds, progress)
        await measure_reset(lazy, reference, args.rounds * 3)
    out = report(lazy, eager, sizes, reference, args.rounds)
    out["copy_on_write_dump"] = cow
    out["leaked"] = leaked(configs[0])
    out["leaked_eager"] = leaked(configs[1])
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256,1024", help="live memory the holder holds, MB, comma-separated")
    parser.add_argument("--state-mb", type=int, default=256, help="the size the flat (old) keys describe: the nearest of --sizes")
    parser.add_argument("--rounds", type=int, default=10, help="repetitions of each measurement up to 256 MB (fewer above)")
    parser.add_argument("--state-dir", default=None,
                        help="lazy engine's state directory (default: FANFOLD_STATE_DIR or /var/lib/fanfold); the eager one's is DIR-eager")
    parser.add_argument("--frozen-dump", action="store_true",
                        help="write every page while the parent is frozen, as before copy-on-write dumps (FANFOLD_COW_DUMP=0)")
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")
    args = parser.parse_args()
    started = time.perf_counter()

    def progress(what: str) -> None:
        if not args.json:
            print(f"  {what} ({ms_since(started) / 1000:.0f} s)", file=sys.stderr)

    out = await run(args, progress)
    out["wall_s"] = round(ms_since(started) / 1000, 1)
    if not args.json:
        for key, value in out.items():
            print(f"{key:34} {value}")
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
