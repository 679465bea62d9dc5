"""What /proc says of a process: one reader for every liveness check."""

from __future__ import annotations


def stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first), or [] when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def running(pid: int | str | None) -> bool:
    """Whether ``pid`` runs (a zombie not yet reaped counts as dead)."""
    fields = stat_fields(pid) if pid else []
    return bool(fields) and fields[0] != "Z"


def start_time(pid: int | str) -> int | None:
    """When ``pid`` started (clock ticks since boot), telling it from a later process with its pid."""
    fields = stat_fields(pid)
    return int(fields[19]) if len(fields) > 19 else None
