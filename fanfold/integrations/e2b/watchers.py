"""The directory watchers of ``files.watch_dir`` (see ``watch``), kept per app in ``E2B.watchers``."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from ...models import FileEntry
from .connect import RpcError

MAX_WATCHERS = 64
"""Per sandbox: each holds a listing."""
Listing = dict[str, FileEntry]
"""A directory's entries by their path relative to it."""


@dataclass
class Watcher:
    sandbox_id: str
    path: str
    recursive: bool
    include_entry: bool
    seen: Listing = field(default_factory=dict)


class Watchers:
    """Every sandbox's watchers, by id (``app.state.e2b.watchers``)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Watcher] = {}

    def add(self, watcher: Watcher) -> str:
        if sum(w.sandbox_id == watcher.sandbox_id for w in self._by_id.values()) >= MAX_WATCHERS:
            raise RpcError("resource_exhausted", f"a sandbox watches at most {MAX_WATCHERS} directories: remove one")
        watcher_id = secrets.token_hex(8)
        self._by_id[watcher_id] = watcher
        return watcher_id

    def get(self, sandbox_id: str, watcher_id: str) -> Watcher:
        found = self._by_id.get(watcher_id)
        if found is None or found.sandbox_id != sandbox_id:
            raise RpcError("not_found", f"no watcher {watcher_id!r} in sandbox {sandbox_id}")
        return found

    def remove(self, sandbox_id: str, watcher_id: str) -> None:
        self.get(sandbox_id, watcher_id)
        del self._by_id[watcher_id]

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: its watchers too."""
        for watcher_id in [k for k, w in self._by_id.items() if w.sandbox_id == sandbox_id]:
            del self._by_id[watcher_id]
