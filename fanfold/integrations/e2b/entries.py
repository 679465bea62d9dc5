"""envd's EntryInfo in proto3 JSON, for listings and watch events."""

from __future__ import annotations

import stat
from typing import Any

from ...models import FileEntry
from .connect import int64, timestamp

_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_MODE_BITS = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK}


def entry_info(entry: FileEntry) -> dict[str, Any]:
    """An EntryInfo in proto3 JSON."""
    return {
        "name": entry.name, "type": _TYPES.get(entry.type, "FILE_TYPE_UNSPECIFIED"), "path": entry.path,
        "size": int64(entry.size), "mode": entry.mode,
        "permissions": stat.filemode(_MODE_BITS.get(entry.type, 0) | entry.mode),
        "owner": "", "group": "", "modifiedTime": timestamp(entry.mtime),
    }
