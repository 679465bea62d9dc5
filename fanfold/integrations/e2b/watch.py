"""Watching a directory (``files.watch_dir``): ``CreateWatcher``/``GetWatcherEvents``/``RemoveWatcher``
(the sync SDK's) and the ``WatchDir`` stream (the async SDK's).

fanfold's engine has no file notifications, so a watcher compares listings: each ``GetWatcherEvents``
lists the directory (its subdirectories too when ``recursive``) and answers what changed since the
last call, and ``WatchDir`` does so every ``POLL_S``. A change is seen once however often it
happened in between (several writes are one ``WRITE``), and a file made and removed in between is
not seen at all; a new file that has content is a ``CREATE`` then a ``WRITE``, as inotify reports it.
"""

from __future__ import annotations

import asyncio
import posixpath
from typing import Any, AsyncIterator

from ...errors import FanfoldError, FileNotFoundInSandbox
from ...models import FileEntry
from .connect import RpcError, envelope, field as message_field, rpc_error
from .entries import entry_info
from .envd import Call
from .watchers import Listing, Watcher

POLL_S = 0.5
MAX_ENTRIES = 50_000
"""The most entries a watcher compares: a bigger tree is refused."""
MAX_EVENTS = 10_000
"""The most events one answer holds."""


async def listing(call: Call, path: str, recursive: bool) -> Listing:
    """Every entry under ``path`` by its path relative to it; not_found when it is not a directory."""
    found: Listing = {}
    level = [""]
    while level:
        below = []
        for relative in level:
            try:
                entries = await call.engine.list_files(call.sandbox_id, posixpath.join(path, relative) if relative else path)
            except FileNotFoundInSandbox:
                if not relative:
                    raise RpcError("not_found", f"no directory {path} in the sandbox") from None
                continue  # removed while we looked
            except FanfoldError as err:
                raise rpc_error(err, call.sandbox_id) from None
            for entry in entries:
                name = posixpath.join(relative, entry.name) if relative else entry.name
                found[name] = entry
                if recursive and entry.type == "dir":
                    below.append(name)
            if len(found) > MAX_ENTRIES:
                raise RpcError("resource_exhausted", f"{path} holds over {MAX_ENTRIES} entries: watch a smaller directory")
        level = below
    return found


def changes(before: Listing, after: Listing, include_entry: bool) -> list[dict[str, Any]]:
    """FilesystemEvents (proto3 JSON) that turn ``before`` into ``after``."""
    events: list[dict[str, Any]] = []

    def add(name: str, kind: str, entry: FileEntry | None) -> None:
        event: dict[str, Any] = {"name": name, "type": f"EVENT_TYPE_{kind}"}
        if include_entry and entry is not None:
            event["entry"] = entry_info(entry)
        events.append(event)

    for name, entry in after.items():
        old = before.get(name)
        if old is None or old.type != entry.type:
            if old is not None:
                add(name, "REMOVE", None)
            add(name, "CREATE", entry)
            if entry.type == "file" and entry.size:
                add(name, "WRITE", entry)
        elif entry.type != "dir" and (old.size, old.mtime) != (entry.size, entry.mtime):
            add(name, "WRITE", entry)
        elif old.mode != entry.mode:
            add(name, "CHMOD", entry)
    events += [{"name": name, "type": "EVENT_TYPE_REMOVE"} for name in before if name not in after]
    return events[:MAX_EVENTS]


def _watch_options(message: dict[str, Any]) -> tuple[str, bool, bool]:
    path = message_field(message, "path", str, "")
    if not path:
        raise RpcError("invalid_argument", "path is empty")
    return path, message_field(message, "recursive", bool, False), message_field(message, "includeEntry", bool, False)


async def create_watcher(call: Call, message: dict[str, Any]) -> dict[str, Any]:
    path, recursive, include_entry = _watch_options(message)
    watcher = Watcher(call.sandbox_id, path, recursive, include_entry, await listing(call, path, recursive))
    return {"watcherId": call.e2b.watchers.add(watcher)}


async def get_watcher_events(call: Call, message: dict[str, Any]) -> dict[str, Any]:
    watcher = call.e2b.watchers.get(call.sandbox_id, message_field(message, "watcherId", str, ""))
    now = await listing(call, watcher.path, watcher.recursive)
    events, watcher.seen = changes(watcher.seen, now, watcher.include_entry), now
    return {"events": events}


async def remove_watcher(call: Call, message: dict[str, Any]) -> dict[str, Any]:
    call.e2b.watchers.remove(call.sandbox_id, message_field(message, "watcherId", str, ""))
    return {}


async def watch_dir(call: Call, message: dict[str, Any]) -> AsyncIterator[bytes]:
    path, recursive, include_entry = _watch_options(message)
    seen = await listing(call, path, recursive)

    async def events() -> AsyncIterator[bytes]:
        nonlocal seen
        yield envelope({"start": {}})
        quiet = 0.0
        while True:
            await asyncio.sleep(POLL_S)  # the poll interval: the engine has no file notifications
            now = await listing(call, path, recursive)
            found, seen = changes(seen, now, include_entry), now
            for event in found:
                yield envelope({"filesystem": event})
            quiet = 0.0 if found else quiet + POLL_S
            if quiet >= call.keepalive:
                quiet = 0.0
                yield envelope({"keepalive": {}})

    return events()
