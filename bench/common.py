"""What the benchmarks share: percentiles and the leak count taken after a run."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from fanfold import EngineConfig
from fanfold.host import cgroups, mounts


BWRAP_TRUE = ["--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib",
              "/lib", "--symlink", "usr/lib64", "/lib64", "true"]
"""bubblewrap's arguments for the peer of a sandbox: `true` in fresh namespaces over the host's /usr."""


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (nearest rank), rounded; None when there are none."""
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else None


def agent_pids(config: EngineConfig) -> list[int]:
    """Host pids of this state dir's agents: a binary named ``agent`` started with ``--listen``."""
    pids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            ours = config.cgroup_parent in Path(f"/proc/{name}/cgroup").read_text()
        except OSError:
            continue
        if ours and argv[0].endswith(b"agent") and b"--listen" in argv:
            pids.append(int(name))
    return pids


def leaked(config: EngineConfig) -> dict[str, int]:
    """Mounts, cgroups, runtime containers, agent processes and rows of this state dir still there."""
    runtime_root = config.run_dir / config.runtime
    db = sqlite3.connect(config.state_dir / "fanfold.db")
    try:
        rows = db.execute("SELECT COUNT(*) FROM sandboxes").fetchone()[0]
    finally:
        db.close()
    return {
        "mounts": len(mounts.mounts_under(config.state_dir / "sandboxes")),
        "cgroups": len(cgroups.leftover_ids(config.cgroup_parent))
        + sum(d.exists() for d in cgroups.sandbox_dirs(config.cgroup_parent)),
        "containers": len(list(runtime_root.iterdir())) if runtime_root.is_dir() else 0,
        "agents": len(agent_pids(config)),
        "rows": rows,
    }
