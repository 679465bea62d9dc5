"""``fanfold top``: a live terminal view of one host's ``/v1/stats``, or a cluster's merged stats
(which add a ``nodes`` list, and a ``node`` key on each pool and sandbox)."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Column, Table
from rich.text import Text

from ..engine.telemetry import ALERTS
from ..errors import FanfoldError
from .. import models

STATES = (*models.STATES, "pooled")  # warm pool sandboxes are the operator's to see too
HOT = "bold red"


def _ms(value: float | None) -> str:
    """Milliseconds with as many decimals as the magnitude deserves."""
    if value is None:
        return "-"
    if value < 10:
        return f"{value:.2f}"
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    return f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def _short(text: str | None, width: int = 24) -> str:
    if not text:
        return "-"
    return text if len(text) <= width else text[: width - 1] + "…"


def _small(title: str, rows: list[tuple[str, Any]]) -> Panel:
    """A two-column key/value box; values may be str or rich Text (to carry a highlight)."""
    table = Table.grid(padding=(0, 1))
    table.add_column(style="dim")
    table.add_column(justify="right")
    for key, value in rows:
        table.add_row(key, value if isinstance(value, Text) else str(value))
    return Panel(table, title=title, expand=False)


def _states(stats: dict) -> Panel:
    by_state = stats.get("sandboxes_by_state") or {}
    # Known states first, in lifecycle order, then anything newer servers report.
    names = [s for s in STATES if s in by_state] + sorted(set(by_state) - set(STATES))
    return _small("sandboxes", [(name, by_state[name]) for name in names] or [("none", 0)])


def _queue(stats: dict) -> Panel:
    queue = stats.get("queue") or {}
    return _small("create queue", [(k, queue.get(k, "-")) for k in ("waiting", "creating", "max_creating")])


def _latency(stats: dict) -> Panel:
    table = Table("ms", "p50", "p90", "p99", "max", box=None, padding=(0, 1))
    for name in ("create", "exec"):
        p = stats.get(f"{name}_ms") or {}
        p99 = Text(_ms(p.get("p99")))
        if name == "create" and (p.get("p99") or 0) / 1000 > ALERTS["provision_p99_s"]:
            p99.stylize(HOT)
        table.add_row(name, _ms(p.get("p50")), _ms(p.get("p90")), p99, _ms(p.get("max")))
    return Panel(table, title="latency", expand=False)


def _rate(count: Any, rate: float | None, limit: float) -> Text:
    rate = rate or 0.0
    return Text(f"{count} ({rate:.1%})", style=HOT if rate > limit else "")


def _rates(stats: dict) -> Panel:
    rows = [
        ("creates", stats.get("creates", 0)),
        ("infra errors", _rate(stats.get("infra_errors", 0), stats.get("infra_error_rate"), ALERTS["infra_error_rate"])),
        ("execs", stats.get("execs", 0)),
        ("timeouts", _rate(stats.get("timeouts", 0), stats.get("timeout_rate"), ALERTS["timeout_rate"])),
    ]
    return _small(f"last {stats.get('window_s', 0):g} s", rows)


def _host(stats: dict) -> Panel:
    host = stats.get("host") or {}
    shortage = host.get("shortage")
    rows = [
        ("memory free", f"{host.get('memory_available_mb', 0):,} MB"),
        ("kernel tasks", f"{host.get('kernel_tasks', 0):,} / {host.get('kernel_tasks_max', 0):,}"),
        ("leases", host.get("leases", 0)),
        ("shortage", Text(str(shortage), style="bold yellow") if shortage is not None else Text("none", style="green")),
    ]
    return _small("host", rows)


def _network(stats: dict) -> Panel:
    net = stats.get("network") or {}
    rows = [
        ("requests", f"{net.get('requests', 0):,}"),
        ("denied", Text(f"{net.get('denied', 0):,}", style="yellow" if net.get("denied") else "")),
        ("out / in", f"{_bytes(net.get('bytes_up', 0))} / {_bytes(net.get('bytes_down', 0))}"),
        ("cache hits", f"{net.get('cache_hits', 0):,} ({_bytes(net.get('cache_bytes', 0))})"),
        ("replayed", f"{net.get('replayed', 0):,} ({net.get('replay_misses', 0):,} missed)"),
        ("errors", f"{net.get('errors', 0):,}"),
    ]
    return _small("egress proxy", rows)


def _bytes(count: int | None) -> str:
    size = float(count or 0)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return "-"


def _pools(stats: dict) -> RenderableType:
    pools = stats.get("pools") or []
    if not pools:
        return Text("no warm pools", style="dim")
    cluster = "nodes" in stats
    sources = max((len(_short(pool.get("source"))) for pool in pools), default=4)
    others = [Column(name, overflow="fold") for name in ("ready/target", "filling", "handouts", "misses", "last error")]
    table = Table(*([Column("node", no_wrap=True)] if cluster else []), Column("pool", no_wrap=True, min_width=sources),
                  *others, title="pools")
    for pool in pools:
        error = pool.get("last_error")
        table.add_row(
            *([pool.get("node", "?")] if cluster else []), _short(pool.get("source")), f"{pool.get('ready', 0)}/{pool.get('target', 0)}", str(pool.get("filling", 0)),
            str(pool.get("handouts", 0)), str(pool.get("misses", 0)),
            Text(_short(error, 60), style="red") if error else "-",
        )
    return table


def _gpus(stats: dict) -> list[RenderableType]:
    """The host's GPUs (none: no panel): each one's use, memory and how many sandboxes share it."""
    gpus = stats.get("gpus") or []
    if not gpus:
        return []
    cluster = "nodes" in stats
    nvml = (stats.get("host") or {}).get("nvml")
    title = "GPUs" if nvml in (None, "ok") else f"GPUs ({nvml})"
    table = Table(*([Column("node", no_wrap=True)] if cluster else []), Column("gpu", no_wrap=True),
                  *(Column(name, overflow="fold") for name in ("model", "util", "memory used / total", "sandboxes")),
                  title=title)
    for gpu in gpus:
        used, total = gpu.get("memory_used_bytes"), gpu.get("memory_total_bytes")
        table.add_row(
            *([gpu.get("node", "?")] if cluster else []), _short(str(gpu.get("id", "?")), 20), _short(gpu.get("name")),
            _percent(gpu.get("util_percent")), "-" if used is None else f"{_bytes(used)} / {_bytes(total)}",
            str(gpu.get("sandboxes", 0)),
        )
    return [table]


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _sandboxes(stats: dict, limit: int) -> RenderableType:
    rows = sorted(stats.get("sandboxes") or [], key=lambda s: s.get("cpu_s") or 0.0, reverse=True)
    cluster = "nodes" in stats
    # Whole ids and states, whatever the width; the other figures fold onto a second line, never to "…".
    longest = max((len(str(sb.get("id", "?"))) for sb in rows[:limit]), default=2)
    nodes = max((len(str(sb.get("node", "?"))) for sb in rows[:limit]), default=4)
    gpu = any("gpu_ids" in sb for sb in rows)  # GPU columns only where some sandbox holds or uses a GPU
    others = [Column(name, overflow="fold") for name in
              ("CPU s", "mem MB", *(("GPU %", "GPU MB") if gpu else ()), "paged in", "net out/in", "denied", "age",
               "rollout")]
    table = Table(*([Column("node", no_wrap=True, min_width=nodes)] if cluster else []),
                  Column("id", no_wrap=True, min_width=longest),
                  Column("state", no_wrap=True), *others, title="sandboxes by CPU", box=box.SIMPLE_HEAD,
                  padding=(0, 1, 0, 0), pad_edge=False, show_edge=False)
    for sb in rows[:limit]:
        memory = sb.get("memory_bytes")
        offline = sb.get("network", "none") == "none"
        table.add_row(
            *([sb.get("node", "?")] if cluster else []), sb.get("id", "?"), sb.get("state", "?"), f"{sb.get('cpu_s') or 0.0:.2f}",
            "-" if memory is None else f"{memory / 2**20:,.1f}", *(_gpu_use(sb) if gpu else ()),
            _paged_in(sb.get("memory_pages")),
            "-" if offline else f"{_bytes(sb.get('net_bytes_up'))} / {_bytes(sb.get('net_bytes_down'))}",
            "-" if offline else str(sb.get("net_denied", 0)), _age(sb.get("age_s")), _short(sb.get("rollout_id")),
        )
    more = len(rows) - limit
    return Group(table, Text(f"... and {more} more", style="dim")) if more > 0 else table


def _gpu_use(sandbox: dict) -> tuple[str, str]:
    """SM utilisation and GPU memory ("-": it holds no GPU, or the host has no NVML to tell)."""
    used = sandbox.get("gpu_memory_bytes")
    return _percent(sandbox.get("gpu_util_percent")), "-" if used is None else f"{used / 2**20:,.1f}"


def _paged_in(pages: dict | None) -> str:
    """How much of a lazily restored sandbox's memory its page server copied in ("-": all of it, or eager)."""
    if not pages or pages.get("state") == "done" or not pages.get("total"):
        return "-"
    return f"{100 * pages.get('copied', 0) / pages['total']:.0f}%"


def _nodes(stats: dict) -> RenderableType:
    """A cluster's nodes, one row each; a node not answering shows in red with dashes."""
    table = Table(Column("node", no_wrap=True), *(Column(name, overflow="fold") for name in (
        "alive", "sandboxes", "memory committed / free MB", "creating/waiting", "create p50 ms", "exec p50 ms")),
        title="nodes")
    for node in stats["nodes"]:
        if not node.get("alive"):
            table.add_row(Text(node.get("node", "?"), style=HOT), Text("no", style=HOT), *["-"] * 5)
            continue
        table.add_row(
            node.get("node", "?"), Text("yes", style="green"), str(node.get("sandboxes", 0)),
            f"{node.get('memory_committed_mb') or 0:,.0f} / {node.get('memory_available_mb') or 0:,.0f}",
            f"{node.get('creating') or 0}/{node.get('waiting') or 0}",
            _ms(node.get("create_p50_ms")), _ms(node.get("exec_p50_ms")),
        )
    return table


def _alerts(stats: dict) -> RenderableType:
    alerts = stats.get("alerts") or []
    if not alerts:
        return Text("no alerts", style="green")
    return Panel(Text("\n".join(alerts), style=HOT), title="alerts", border_style="red")


class _Row:
    """Boxes side by side, each at its natural width; those that do not fit the terminal go on to the
    next line, since a squeezed box cuts its figures to ``…``."""

    def __init__(self, *boxes: RenderableType) -> None:
        self.boxes = boxes

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        line: list[RenderableType] = []
        used = 0
        for part in self.boxes:
            width = Measurement.get(console, options, part).maximum
            if line and used + 1 + width > options.max_width:
                yield _grid(line)
                line, used = [], 0
            used += width + (1 if line else 0)
            line.append(part)
        if line:
            yield _grid(line)


def _grid(boxes: list[RenderableType]) -> Table:
    # A grid, not rich's Columns: Columns aligns boxes to a uniform grid and pads them apart.
    row = Table.grid(padding=(0, 1))
    row.add_row(*boxes)
    return row


def _header(source: str) -> Text:
    return Text.assemble(("fanfold top", "bold"), f"  {source}  ", (datetime.now().strftime("%H:%M:%S"), "dim"))


def render(stats: dict, *, source: str, limit: int = 20) -> RenderableType:
    """One frame of ``fanfold top`` for a ``/v1/stats`` dict; ``limit`` caps the sandbox rows."""
    counts = _Row(_states(stats), _queue(stats), _host(stats))
    timing = _Row(_latency(stats), _rates(stats), _network(stats))
    nodes = [_nodes(stats)] if "nodes" in stats else []
    return Group(_header(source), _alerts(stats), counts, timing, *nodes, _pools(stats), *_gpus(stats),
                 _sandboxes(stats, limit))


def _frame(fleet: Any, source: str, limit: int, last: dict | None) -> tuple[RenderableType, dict | None]:
    """The next frame and the stats it shows; on an error, the last good stats under a red line."""
    try:
        stats = fleet.metrics()
    except FanfoldError as exc:
        # The server may be restarting: say so and keep the previous figures on screen.
        error = Text(f"cannot read stats: {exc} (retrying)", style=HOT)
        return (Group(error, render(last, source=source, limit=limit)) if last else Group(_header(source), error)), last
    return render(stats, source=source, limit=limit), stats


def watch(
    fleet: Any, *, source: str, interval: float = 1.0, once: bool = False, limit: int = 20,
    console: Console | None = None,
) -> None:
    """Show ``fleet.metrics()`` once, or live every ``interval`` seconds until Ctrl-C."""
    console = console or Console()
    if once:
        console.print(render(fleet.metrics(), source=source, limit=limit))
        return
    try:
        frame, last = _frame(fleet, source, limit, None)
        with Live(frame, console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                frame, last = _frame(fleet, source, limit, last)
                live.update(frame, refresh=True)
    except KeyboardInterrupt:
        pass
