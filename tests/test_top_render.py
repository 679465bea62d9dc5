"""``fanfold top`` frames, rendered from ``/v1/stats`` dicts (no server needed)."""

from __future__ import annotations

import copy
import io

from rich.console import Console

from fanfold.cli.top import render, watch
from fanfold.errors import FanfoldError

SAMPLE = {
    "sandboxes_by_state": {"creating": 1, "pooled": 3, "running": 2},
    "queue": {"waiting": 0, "creating": 1, "max_creating": 4},
    "pools": [{"source": "img-c4be15c69f12676b", "limits": {"cpus": 1.0, "memory_mb": 512, "pids": 256, "disk_mb": 1024},
               "size": 4, "target": 4, "ready": 3, "filling": 1, "handouts": 2, "misses": 0, "last_error": None}],
    "host": {"memory_available_mb": 23393, "kernel_tasks": 98, "kernel_tasks_max": 32768, "shortage": None, "leases": 0},
    "window_s": 300.0,
    "create_ms": {"p50": 1.594, "p90": 28.327, "p99": 28.327, "max": 28.327},
    "exec_ms": {"p50": 84.38, "p90": 84.38, "p99": 84.38, "max": 84.38},
    "creates": 3, "infra_errors": 0, "infra_error_rate": 0.0, "execs": 2, "timeouts": 0, "timeout_rate": 0.0,
    "alerts": [],
    "sandboxes": [
        {"id": "sb-2b341d1d55f6", "state": "running", "cpu_s": 0.095, "memory_bytes": 1048576, "age_s": 12.3,
         "rollout_id": None, "source": "img-c4be15c69f12676b"},
        {"id": "sb-hotcpu000001", "state": "running", "cpu_s": 7.5, "memory_bytes": 3 * 2**20, "age_s": 125.0,
         "rollout_id": "ro-7", "source": "img-c4be15c69f12676b",
         "memory_pages": {"copied": 170, "total": 16990, "faults": 170, "state": "serving"}},
    ],
}


def _text(stats: dict, width: int = 120, **kwargs) -> str:
    console = Console(file=io.StringIO(), width=width)
    console.print(render(stats, source="http://fleet:8000", **kwargs))
    return console.file.getvalue()


def _alarming() -> dict:
    stats = copy.deepcopy(SAMPLE)
    stats["create_ms"] = {"p50": 900.0, "p90": 11_000.0, "p99": 12_000.0, "max": 12_500.0}
    stats["exec_ms"] = {"p50": None, "p90": None, "p99": None, "max": None}
    stats["infra_errors"], stats["infra_error_rate"] = 2, 0.05
    stats["timeouts"], stats["timeout_rate"] = 1, 0.5
    stats["host"]["shortage"] = "memory: 180 MB available, under 256 MB"
    stats["alerts"] = ["provisioning p99 12.0 s is over 10 s", "timeouts 50.0% of execs, over 1%"]
    stats["pools"][0]["last_error"] = "image pull failed"
    return stats


def test_sample_frame_shows_the_figures():
    out = _text(SAMPLE)
    for figure in ("http://fleet:8000", "no alerts", "running", "max_creating", "1.59", "28.3", "84.4",
                   "23,393 MB", "98 / 32,768", "img-c4be15c69f12676b", "3/4", "sb-2b341d1d55f6", "1.0", "2m05s",
                   "ro-7", "last 300 s", "paged in", " 1%"):
        assert figure in out, figure
    assert out.index("sb-hotcpu000001") < out.index("sb-2b341d1d55f6")  # busiest first


def test_an_80_column_terminal_cuts_no_figure():
    """Boxes that do not fit side by side go on to the next line; table cells fold, never end in "…"."""
    for stats in (SAMPLE, _cluster()):
        out = _text(stats, width=80)
        assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
        latency = next(line for line in out.splitlines() if " ms " in line)
        assert latency.split()[1:6] == ["ms", "p50", "p90", "p99", "max"], latency
        assert "1.59  28.3  28.3  28.3" in out and "84.4  84.4  84.4  84.4" in out
        for sandbox in stats["sandboxes"]:
            assert sandbox["id"] in out
        assert "img-c4be15c69f12676b" in out


def test_alarming_frame_shows_alerts_shortage_and_dashes():
    out = _text(_alarming())
    for figure in ("provisioning p99 12.0 s is over 10 s", "timeouts 50.0% of execs", "12,000", "2 (5.0%)",
                   "1 (50.0%)", "memory: 180 MB available", "image pull failed"):
        assert figure in out, figure
    assert "no alerts" not in out
    exec_row = next(line for line in out.splitlines() if "exec " in line)
    assert exec_row.count("-") == 4


def test_limit_cuts_the_sandbox_table():
    stats = copy.deepcopy(SAMPLE)
    stats["sandboxes"] = [dict(SAMPLE["sandboxes"][0], id=f"sb-{i:012d}", cpu_s=float(i)) for i in range(30)]
    out = _text(stats, limit=5)
    assert "sb-000000000029" in out and "sb-000000000024" not in out
    assert "... and 25 more" in out


def test_empty_stats_render():
    assert "no alerts" in _text({})


class _Flaky:
    """Fails once (a restarting server), then answers, then the user presses Ctrl-C."""

    def __init__(self) -> None:
        self.calls = 0

    def metrics(self) -> dict:
        self.calls += 1
        if self.calls == 1:
            raise FanfoldError("connection refused")
        if self.calls == 3:
            raise KeyboardInterrupt
        return SAMPLE


def test_watch_once_and_live_survive_errors():
    console = Console(file=io.StringIO(), width=120)
    fleet = _Flaky()
    fleet.calls = 1  # skip the failure: once mode lets errors propagate to the CLI
    watch(fleet, source="http://fleet:8000", once=True, console=console)
    assert "sb-2b341d1d55f6" in console.file.getvalue()
    live = Console(file=io.StringIO(), width=120, force_terminal=True)
    watch(_Flaky(), source="http://fleet:8000", interval=0.0, console=live)  # returns quietly on Ctrl-C
    out = live.file.getvalue()
    assert "cannot read stats: connection refused" in out and "sb-2b341d1d55f6" in out


def _cluster() -> dict:
    """Two nodes' merged stats: one answering, one down."""
    stats = copy.deepcopy(SAMPLE)
    stats["sandboxes"] = [dict(sb, id=f"sb-n1a2b3-{sb['id'][3:]}", node="n1a2b3") for sb in SAMPLE["sandboxes"]]
    stats["pools"] = [dict(SAMPLE["pools"][0], node="n1a2b3")]
    stats["alerts"] = ["n9f8e7: node not answering"]
    stats["nodes"] = [
        {"node": "n1a2b3", "sandboxes": 2, "memory_committed_mb": 2048, "memory_available_mb": 23393, "creating": 1,
         "waiting": 3, "create_p50_ms": 1.594, "exec_p50_ms": 84.38, "alive": True},
        {"node": "n9f8e7", "alive": False},
    ]
    return stats


def test_cluster_frame_shows_nodes_and_where_each_sandbox_is():
    out = _text(_cluster())
    assert "nodes" in out and "n9f8e7: node not answering" in out
    node_row = next(line for line in out.splitlines() if "n1a2b3" in line and "yes" in line)
    for figure in ("2,048 / 23,393", "1/3", "1.59", "84.4"):
        assert figure in node_row, figure
    down_row = next(line for line in out.splitlines() if "n9f8e7" in line and "no" in line.split())
    assert down_row.count("-") >= 5
    sandbox_row = next(line for line in out.splitlines() if "sb-n1a2b3-hotcpu000001" in line)
    assert sandbox_row.split()[0] == "n1a2b3"
    pool_row = next(line for line in out.splitlines() if "3/4" in line)
    assert "n1a2b3" in pool_row


def test_single_host_frame_has_no_node_column():
    out = _text(SAMPLE)
    assert "node" not in out.lower().replace("nodes", "")
