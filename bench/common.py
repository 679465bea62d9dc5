"""What the benchmarks share: percentiles, CPU per engine process, and the leak count taken after a run."""

from __future__ import annotations

import argparse
import os
import resource
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from fanfold import EngineConfig
from fanfold.host import census


BWRAP_TRUE = ["--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib",
              "/lib", "--symlink", "usr/lib64", "/lib64", "true"]
"""bubblewrap's arguments for the peer of a sandbox: `true` in fresh namespaces over the host's /usr."""


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (nearest rank), rounded; None when there are none."""
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else None


def agent_pids(config: EngineConfig) -> list[int]:
    """Host pids of this state dir's agents (see ``fanfold.host.census``)."""
    return census.agent_pids(config)


def leaked(config: EngineConfig, claims_before: frozenset[str] = frozenset()) -> dict[str, int]:
    """Everything the census counts (mounts, cgroups, containers, agents, network namespaces, nftables
    tables, orphan uid claims not in ``claims_before``, page servers) and the rows of this state dir
    still there."""
    db = sqlite3.connect(config.state_dir / "fanfold.db")
    try:
        rows = db.execute("SELECT COUNT(*) FROM sandboxes").fetchone()[0]
    finally:
        db.close()
    return {**census.census(config, claims_before=claims_before), "rows": rows}


WORKER_COMM = "fanfold-worker"
"""The process name (/proc/PID/comm) of an engine worker process (``EngineConfig.workers``)."""

_TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcessCpu:
    """CPU (user + system, ms) of one process: its own, and that of its children it has reaped."""

    own_ms: float
    reaped_children_ms: float


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU used so far by the engine's processes: this one (which runs the fleet) and its workers.

    Take one before and one after the measured work, the second before the fleet closes (its
    workers exit then). Workers are assumed to live through the interval: one reaped inside it
    would move its whole lifetime's CPU into this process's reaped children and be counted twice.
    """

    bench: ProcessCpu
    """This process's own CPU (every thread) and that of its reaped children (crun, CRIU, ...)."""
    workers: dict[tuple[int, int], ProcessCpu] = field(default_factory=dict)
    """Each live engine worker, keyed by (pid, start time) so a reused pid is a new process."""


def cpu_snapshot() -> CpuSnapshot:
    """CPU used so far by this process, its reaped children, and each live ``fanfold-worker`` below it."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    bench = ProcessCpu((own.ru_utime + own.ru_stime) * 1000, (children.ru_utime + children.ru_stime) * 1000)
    return CpuSnapshot(bench, _worker_cpu(os.getpid()))


def cpu_per_cycle(before: CpuSnapshot, after: CpuSnapshot, cycles: int) -> dict[str, float | int]:
    """CPU ms per cycle between two snapshots: the busiest single process's own, and everything's.

    ``busiest_process_cpu_ms_per_cycle`` is the largest own CPU of one process (this one, or any one
    worker): the ceiling a host's throughput meets whatever its cores. ``total_cpu_ms_per_cycle`` adds
    every process: this one, each worker, and the children each reaped (crun and other short processes,
    which are not "a process" of the engine). ``worker_processes`` counts the workers seen at the end.
    """
    zero = ProcessCpu(0.0, 0.0)
    deltas = [ProcessCpu(after.bench.own_ms - before.bench.own_ms,
                         after.bench.reaped_children_ms - before.bench.reaped_children_ms)]
    for key, now in after.workers.items():  # a worker started inside the interval counts from zero
        then = before.workers.get(key, zero)
        deltas.append(ProcessCpu(now.own_ms - then.own_ms, now.reaped_children_ms - then.reaped_children_ms))
    cycles = max(1, cycles)
    return {
        "busiest_process_cpu_ms_per_cycle": round(max(d.own_ms for d in deltas) / cycles, 2),
        "total_cpu_ms_per_cycle": round(sum(d.own_ms + d.reaped_children_ms for d in deltas) / cycles, 2),
        "worker_processes": len(after.workers),
    }


def _worker_cpu(root: int) -> dict[tuple[int, int], ProcessCpu]:
    """Live ``fanfold-worker`` processes descended from ``root`` (a fork server may sit between)."""
    stats = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            stats[int(name)] = _stat(int(name))
        except (OSError, ValueError, IndexError):
            continue  # exited while listed
    parents = {pid: stat[1] for pid, stat in stats.items()}

    def below_root(pid: int) -> bool:
        seen = set()
        while pid > 1 and pid not in seen:
            seen.add(pid)
            pid = parents.get(pid, 0)
            if pid == root:
                return True
        return False

    return {(pid, stat[2]): stat[3] for pid, stat in stats.items() if stat[0] == WORKER_COMM and below_root(pid)}


def _stat(pid: int) -> tuple[str, int, int, ProcessCpu]:
    """(comm, parent pid, start time, CPU) from /proc/PID/stat; comm may hold spaces and parentheses."""
    text = Path(f"/proc/{pid}/stat").read_text()
    comm, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state): utime, stime, cutime, cstime are fields 14-17, starttime field 22
    utime, stime, cutime, cstime = (int(n) for n in rest[11:15])
    return comm, int(rest[1]), int(rest[19]), ProcessCpu((utime + stime) * _TICK_MS, (cutime + cstime) * _TICK_MS)


def add_workers_option(parser: argparse.ArgumentParser) -> None:
    """``--workers N``: the engine's worker processes (``EngineConfig.workers``)."""
    parser.add_argument("--workers", type=int, metavar="N",
                        help="engine worker processes, EngineConfig(workers=N) (default: FANFOLD_WORKERS, else 0)")


def engine_config(workers: int | None) -> EngineConfig:
    """The fleet's config: ``workers`` worker processes, or the config's default when None."""
    return EngineConfig() if workers is None else EngineConfig(workers=workers)
