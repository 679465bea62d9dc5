"""Per-layer progress of a pull or import, as callers see it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class PullEvent:
    """One layer's progress: ``status`` is ``waiting``, ``pulling``, ``done`` or ``exists`` (already stored)."""

    layer: str
    index: int
    total: int
    done_bytes: int
    total_bytes: int
    status: str


OnPull = Callable[[PullEvent], None]


class LayerProgress:
    """Turns skopeo's per-blob progress into a PullEvent per layer."""

    def __init__(self, chain: list[str], stored: dict[str, dict], blobs: list[tuple[str, int]], on_progress: OnPull) -> None:
        self.chain, self.on_progress = chain, on_progress
        self.sizes = [size for _, size in blobs] if len(blobs) == len(chain) else [0] * len(chain)
        self.by_blob: dict[str, list[int]] = {}
        for i, (digest, _) in enumerate(blobs if len(blobs) == len(chain) else []):
            self.by_blob.setdefault(digest.removeprefix("sha256:")[:12], []).append(i)
        self.missing = {i for i, layer in enumerate(chain) if layer not in stored}
        for i in range(len(chain)):
            self._emit(i, 0 if i in self.missing else self.sizes[i], "waiting" if i in self.missing else "exists")

    def blob(self, short: str, done_bytes: int, finished: bool) -> None:
        for i in self.by_blob.get(short, ()):
            if i in self.missing and not finished:
                self._emit(i, min(done_bytes, self.sizes[i] or done_bytes), "pulling")

    def finish(self, stored: dict[str, dict]) -> None:
        for i in sorted(self.missing):
            size = self.sizes[i] or (stored.get(self.chain[i]) or {}).get("compressed-size") or 0
            self._emit(i, size, "done")

    def _emit(self, i: int, done_bytes: int, status: str) -> None:
        self.on_progress(PullEvent(self.chain[i], i, len(self.chain), done_bytes, self.sizes[i], status))
