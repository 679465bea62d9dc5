"""Users as an image sees them: ``name[:group]`` or ``uid[:gid]`` resolved in its own /etc/passwd and /etc/group.

The sandbox owns those files, so they are read through ``host.safefs`` inside its root (no
symlink leads out) with a size bound, and every line is parsed defensively. The rules are
Docker's: a name must be in /etc/passwd; a numeric uid need not be (its gid is then the one
given, or 0, and its home ``/``); a group, when given, overrides the user's primary group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import FileNotFoundInSandbox, InvalidRequest
from ..host import safefs
from ..spec import check_user

MAX_DB_BYTES = 1 << 20
"""The most of /etc/passwd or /etc/group read: a sandbox may make them as large as it likes."""
_MAX_ID = 0xFFFFFFFE  # (uid_t)-1 means "unchanged" to the kernel


@dataclass(frozen=True)
class User:
    """Whom a command runs as."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    """Supplementary gids: the primary one, then every group that lists the user by name."""
    home: str
    name: str = ""
    """The passwd name, or "" for a uid that has none."""

    def env(self) -> dict[str, str]:
        """``HOME``, ``USER`` and ``LOGNAME`` as a login would set them."""
        named = {"USER": self.name, "LOGNAME": self.name} if self.name else {}
        return {"HOME": self.home, **named}


def resolve(root: Path, user: str, *, where: str = "the sandbox's") -> User:
    """Resolve ``user`` against the files of the root filesystem at ``root``; InvalidRequest
    names the user and the file (``where`` says whose) when it is not there."""
    check_user(user)
    name, _, group = user.partition(":")
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        passwd = _entries(root_fd, "/etc/passwd", 7)
        groups = _entries(root_fd, "/etc/group", 4)
    finally:
        os.close(root_fd)
    entry = _find(passwd, name)
    if entry is None:
        if not name.isdigit():
            if name == "root":  # an image without /etc/passwd still has root
                entry = ["root", "", "0", "0", "", "/root", ""]
            else:
                raise InvalidRequest(f"no user {name!r} in {where} /etc/passwd: create it first"
                                     " (e.g. `useradd`) or give a numeric uid[:gid]")
        else:
            entry = ["", "", name, "0", "", "/", ""]
    uid, gid = _id(entry[2], user), _id(entry[3], user)
    if group:
        found = _find(groups, group)
        if found is None and not group.isdigit():
            raise InvalidRequest(f"no group {group!r} in {where} /etc/group: create it first"
                                 " (e.g. `groupadd`) or give a numeric gid")
        gid = _id(found[2] if found else group, user)
    extra = [_id(g[2], user) for g in groups if entry[0] and entry[0] in g[3].split(",")]
    return User(uid=uid, gid=gid, groups=tuple(dict.fromkeys([gid, *extra])), home=entry[5] or "/", name=entry[0])


def _entries(root_fd: int, path: str, fields: int) -> list[list[str]]:
    """The well-formed lines of a colon-separated database; none when the file is missing."""
    try:
        data = safefs.read(root_fd, path, MAX_DB_BYTES)
    except FileNotFoundInSandbox:
        return []
    lines = (line.split(":") for line in data.decode("utf-8", "replace").splitlines())
    return [parts for parts in lines if len(parts) == fields and parts[0] and not parts[0].startswith("#")
            and parts[2].isdigit()]


def _find(entries: list[list[str]], key: str) -> list[str] | None:
    """The entry named ``key``, else (for a number) the first with that id."""
    for parts in entries:
        if parts[0] == key:
            return parts
    if key.isdigit():
        for parts in entries:
            if parts[2] == key:
                return parts
    return None


def _id(text: str, user: str) -> int:
    value = int(text) if text.isdigit() else -1
    if not 0 <= value <= _MAX_ID:
        raise InvalidRequest(f"user {user!r} resolves to an id out of range ({text!r})")
    return value
