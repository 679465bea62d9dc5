"""fanfold's entry in /etc/subuid and /etc/subgid: the host uids and gids its sandboxes' user
namespaces map to.

Other tools (podman, LXD, systemd-nspawn) take ranges from these files too; sandboxes take theirs
(``idmap.claim``) only within the entry named ``fanfold``, the same stretch in both files. With
none, ``ensure`` adds one on the lowest free stretch from uid 1048576 up, big enough for the ranges
asked for. Ranges are 65536 ids from a multiple of 65536, numbered as ``idmap`` slots, so claims
made before the entry existed keep their meaning.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from ..errors import HostNotReady
from .idmap import FIRST_SLOT, RANGE, SLOTS

NAME = "fanfold"
SUBUID, SUBGID = Path("/etc/subuid"), Path("/etc/subgid")
LOWEST = FIRST_SLOT * RANGE
"""The first id an entry may hold: the ids below 1048576 stay the host's."""
HIGHEST = (FIRST_SLOT + SLOTS) * RANGE
"""One past the last id a range may hold (the top range stays free: uid 4294967295 means "none")."""


@dataclass(frozen=True)
class Entry:
    """One ``name:start:count`` line."""

    name: str
    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count

    def slots(self) -> range:
        """The ``idmap`` slots whose whole range lies in this entry (and between LOWEST and HIGHEST)."""
        first = max(-(-max(self.start, LOWEST) // RANGE), FIRST_SLOT)
        stop = min(self.end, HIGHEST) // RANGE
        return range(first - FIRST_SLOT, max(stop, first) - FIRST_SLOT)

    def line(self) -> str:
        return f"{self.name}:{self.start}:{self.count}\n"


def parse(text: str) -> list[Entry]:
    """The entries of a subuid or subgid file; lines that are not ``name:start:count`` are skipped."""
    found = []
    for line in text.splitlines():
        name, _, rest = line.strip().partition(":")
        start, _, count = rest.partition(":")
        if name and not name.startswith("#") and start.isdigit() and count.isdigit():
            found.append(Entry(name, int(start), int(count)))
    return found


def ours(entries: list[Entry]) -> Entry | None:
    return next((entry for entry in entries if entry.name == NAME), None)


def slots(subuid: Path = SUBUID, subgid: Path = SUBGID) -> range | None:
    """The slots both files' fanfold entries allow (read only), or None when either has none."""
    try:
        uids, gids = ours(parse(subuid.read_text())), ours(parse(subgid.read_text()))
    except FileNotFoundError:
        return None
    return None if uids is None or gids is None else _overlap(uids.slots(), gids.slots())


def ensure(ranges: int, subuid: Path = SUBUID, subgid: Path = SUBGID) -> range:
    """The slots sandboxes may take: those of the fanfold entries, added first (to both files, on a
    stretch free in both) when there are none, holding ``ranges`` ranges. HostNotReady when the
    files cannot be written or leave no room."""
    try:
        with _locked(subuid) as uid_file, _locked(subgid) as gid_file:
            uid_entries, gid_entries = parse(uid_file.read()), parse(gid_file.read())
            uids, gids = ours(uid_entries), ours(gid_entries)
            if uids is None and gids is None:
                uids = gids = Entry(NAME, _free(uid_entries + gid_entries, ranges * RANGE), ranges * RANGE)
                _append(uid_file, uids)
                _append(gid_file, gids)
            elif uids is None or gids is None:
                uids, gids = _complete(uids, gids, uid_entries, gid_entries, uid_file, gid_file, subuid, subgid)
    except OSError as err:
        raise HostNotReady(f"cannot add fanfold's uid ranges to {subuid} and {subgid}: {err}; add the line"
                           f" `{NAME}:{LOWEST}:{ranges * RANGE}` to both (at ids no other entry has),"
                           " or set FANFOLD_USERNS=0") from None
    found = _overlap(uids.slots(), gids.slots())
    if not found:
        raise HostNotReady(f"fanfold's entries in {subuid} ({uids.line().strip()}) and {subgid}"
                           f" ({gids.line().strip()}) share no whole range of {RANGE} ids from {LOWEST} up: make"
                           " them the same stretch, a multiple of 65536 long, from a multiple of 65536")
    return found


def _complete(uids: Entry | None, gids: Entry | None, uid_entries: list[Entry], gid_entries: list[Entry],
              uid_file: IO[str], gid_file: IO[str], subuid: Path, subgid: Path) -> tuple[Entry, Entry]:
    """One file has a fanfold entry: the same stretch goes into the other, where it must be free."""
    have, others, file, path = (uids, gid_entries, gid_file, subgid) if uids else (gids, uid_entries, uid_file, subuid)
    assert have is not None
    taken = [e for e in others if e.start < have.end and have.start < e.end]
    if taken:
        raise HostNotReady(f"fanfold's entry {have.line().strip()} overlaps {taken[0].line().strip()} in {path}:"
                           f" add a fanfold entry to {path} by hand, at ids no other entry there has")
    _append(file, have)
    return have, have


def _free(entries: list[Entry], size: int) -> int:
    """The lowest start, a multiple of RANGE from LOWEST up, of ``size`` ids no entry holds."""
    start = LOWEST
    for entry in sorted(entries, key=lambda e: e.start):
        if entry.end <= start or entry.count == 0:
            continue
        if entry.start >= start + size:
            break
        start = -(-entry.end // RANGE) * RANGE
    if start + size > HIGHEST:
        raise HostNotReady(f"no stretch of {size} ids from {LOWEST} up is free of the entries in /etc/subuid and"
                           " /etc/subgid: ask for fewer ranges (FANFOLD_UID_RANGES) or free some")
    return start


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), max(min(a.stop, b.stop), max(a.start, b.start)))


def _append(file: IO[str], entry: Entry) -> None:
    """One line at the end, as one write (readers see the file with it or without it)."""
    file.seek(0)
    text = file.read()
    file.write(("\n" if text and not text.endswith("\n") else "") + entry.line())
    file.flush()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[IO[str]]:
    """``path`` open for reading and appending (made 0644 when missing), locked against other
    engines doing the same; read from the start."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "r+", encoding="utf-8") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        file.seek(0)
        yield file
