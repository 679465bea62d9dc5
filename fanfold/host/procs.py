"""What /proc says of a process: one reader for every liveness check."""

from __future__ import annotations

import os


def read_small(path: str) -> bytes:
    """A small file (/proc, /sys, a pid file) whole, in four syscalls: ``open()``'s buffered text
    file takes nine, and the engine reads several such files for each sandbox."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first), or [] when it is gone."""
    try:
        return read_small(f"/proc/{pid}/stat").decode(errors="replace").rsplit(")", 1)[1].split()
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
