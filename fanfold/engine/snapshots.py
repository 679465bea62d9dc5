"""Snapshots on disk and in SQLite: their layers, memory images, lineage and collection.

A snapshot's disk is one layer (``layers/snap-…``) stacked on its parent's layers, so a
sandbox made from it mounts the stack like any image. Taken from a sandbox whose disk is a btrfs
subvolume, the layer is a snapshot of that subvolume (``<state>/disk/layers/snap-…``, linked from
``layers/``): taken by reference, not copied. A memory snapshot also keeps CRIU's
images in ``snapshots/snap-…/memory``. Both are written under temporary names and renamed
into place before the row is inserted, so a crash leaves no half snapshot behind a row.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sqlite3
import threading
import time
from pathlib import Path

from .. import ids
from ..errors import InvalidRequest, SnapshotInUse, SnapshotNotFound
from ..images import LayerStore
from ..models import SnapshotInfo
from . import db as dbmod

PREFIX = "snap-"
TIER_FILE = "fanfold-backend"
"""In a memory checkpoint: the name of the backend that took it."""
_ORPHAN_AGE_S = 300


def new_id(node_tag: str | None = None) -> str:
    return ids.new_id(PREFIX, node_tag)


def check_name(name: str | None) -> str | None:
    if name is None:
        return None
    ok = isinstance(name, str) and 0 < len(name) <= 128 and all(c.isalnum() or c in "_.-" for c in name)
    if not ok or name.startswith(PREFIX):
        raise InvalidRequest(
            f"bad snapshot name {name!r}: 1-128 letters, digits and _.- , not starting with {PREFIX!r}"
        )
    return name


class SnapshotStore:
    """The ``snapshots/`` directory and the snapshots table of one state directory."""

    def __init__(self, state_dir: Path, layers: LayerStore, db: dbmod.Database) -> None:
        self.dir = state_dir / "snapshots"
        self.dir.mkdir(exist_ok=True)
        self.layers = layers
        self.db = db

    def memory_dir(self, snapshot_id: str) -> Path:
        return self.dir / snapshot_id / "memory"

    def memory_tier(self, snapshot_id: str) -> str:
        """The backend whose checkpoint a memory snapshot holds (``TIER_FILE``; older ones by their
        contents: the fake backend's state file, else CRIU's images, the oci backend's)."""
        memory = self.memory_dir(snapshot_id)
        try:
            return (memory / TIER_FILE).read_text().strip() or "oci"
        except OSError:
            return "fake" if (memory / "fake.json").exists() else "oci"

    def staging(self, snapshot_id: str) -> Path:
        """A private dir for a snapshot being taken; ``commit`` moves it into place, ``discard`` removes it."""
        path = self.dir / f".tmp-{os.getpid()}-{snapshot_id}"
        path.mkdir()
        return path

    def discard(self, staged: Path) -> None:
        """Remove a staged snapshot that was not committed, and the subvolume its layer links to."""
        layer = staged / "layer"
        if layer.is_symlink():
            self.layers.delete_referenced(Path(os.readlink(layer)).parent.name)
        shutil.rmtree(staged, ignore_errors=True)

    def commit(self, staged: Path, info: SnapshotInfo, layers: tuple[str, ...], tenant: str) -> SnapshotInfo:
        """Move a staged snapshot (``layer/``, maybe ``memory/``) into place and record it."""
        self.layers.commit(staged / "layer", info.id)
        os.rename(staged, self.dir / info.id)
        size = _size(self.layers.layer_path(info.id)) + _size(self.dir / info.id)
        info = dataclasses.replace(info, size_bytes=size)
        try:
            self.db.insert_snapshot(info, layers=layers, tenant=tenant)
        except sqlite3.IntegrityError:
            self._remove_files(info.id)
            raise InvalidRequest(f"a snapshot named {info.name!r} exists already: pick another name") from None
        return info

    def row(self, ref: str, tenant: str = "") -> sqlite3.Row:
        """A snapshot's row by id, or by the name ``tenant`` gave it ("": the host's names)."""
        row = self.db.snapshot(ref, tenant) if isinstance(ref, str) and ref else None
        if row is None:
            raise SnapshotNotFound(f"no snapshot {ref!r}: it was never taken, or was deleted or collected")
        return row

    def drop_memory(self, snapshot_id: str) -> None:
        """Free a suspend snapshot's memory images once restored; its layer stays in use. The images
        are renamed aside at once and removed by a thread of their own (a 256 MB image took 30 ms
        to remove: not the resume's to wait for); one left by a crash goes with its snapshot's dir."""
        aside = self.dir / snapshot_id / f".drop-{os.getpid()}-{time.monotonic_ns()}"
        try:
            os.rename(self.memory_dir(snapshot_id), aside)
        except FileNotFoundError:
            return
        threading.Thread(target=shutil.rmtree, args=(aside, True), name="fanfold-drop-memory").start()

    # -- what is still needed -----------------------------------------------------------------

    def _needed(self) -> set[str]:
        """Snapshots a sandbox stands on, named ones, and every snapshot whose layer those stack on."""
        rows = self.db.snapshot_rows()
        needed: set[str] = set()
        for sandbox in self.db.rows():
            needed.add(sandbox["source"])
            needed.update(json.loads(sandbox["layers"]))
            if sandbox["suspended_to"]:
                needed.add(sandbox["suspended_to"])
        needed.update(row["id"] for row in rows if row["name"])
        needed.update(self._in_group_snapshots())
        by_id = {row["id"]: row for row in rows}
        for snapshot_id in list(needed):
            if snapshot_id in by_id:
                needed.update(json.loads(by_id[snapshot_id]["layers"]))
        return {snapshot_id for snapshot_id in needed if snapshot_id.startswith(PREFIX)}

    def delete(self, ref: str) -> None:
        """Delete one snapshot (by id, or a name of the host's); refused while a sandbox or a later
        snapshot stands on it."""
        row = self.row(ref)
        users = [s["id"] for s in self.db.rows() if s["source"] == row["id"] or row["id"] in json.loads(s["layers"])]
        later = [s["id"] for s in self.db.snapshot_rows() if s["id"] != row["id"] and row["id"] in json.loads(s["layers"])]
        later += [group for group, members in self._group_snapshots() if row["id"] in members]
        if users or later:
            raise SnapshotInUse(
                f"snapshot {row['id']} is in use by {', '.join((users + later)[:5])}: kill those sandboxes"
                " and delete those snapshots first"
            )
        self._remove(row["id"])

    def _group_snapshots(self) -> list[tuple[str, set[str]]]:
        """Each group snapshot and the member snapshots it holds (``engine.groups``)."""
        rows = self.db.conn.execute("SELECT id, members FROM group_snapshots").fetchall()
        return [(row["id"], set(json.loads(row["members"]).values())) for row in rows]

    def _in_group_snapshots(self) -> set[str]:
        return {member for _, members in self._group_snapshots() for member in members}

    def collect(self, only: set[str] | None = None, tenant: str | None = None) -> list[str]:
        """Remove snapshots nothing needs (of ``only``, or all); return their ids."""
        needed = self._needed()
        removed = []
        for row in self.db.snapshot_rows():
            if row["id"] in needed or (only is not None and row["id"] not in only):
                continue
            if tenant is not None and row["tenant"] != tenant:
                continue
            if self._remove(row["id"]):
                removed.append(row["id"])
        return removed

    def _remove(self, snapshot_id: str) -> bool:
        """Its row, then its files, by whoever deleted the row: two releases collecting at once (a
        fork's children killed together) would otherwise both remove the same files."""
        if not self.db.delete_snapshot(snapshot_id):
            return False
        self._remove_files(snapshot_id)
        return True

    def _remove_files(self, snapshot_id: str) -> None:
        self.layers.remove_layer(snapshot_id)
        shutil.rmtree(self.dir / snapshot_id, ignore_errors=True)

    def discard_orphans(self) -> int:
        """Remove staging dirs of dead engines and snapshot files no row names (a crash mid-commit)."""
        removed = 0
        for path in self.dir.glob(".tmp-*"):
            pid = path.name.split("-")[1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
        known = {row["id"] for row in self.db.snapshot_rows()}
        old = time.time() - _ORPHAN_AGE_S
        leftovers = [*self.dir.glob(PREFIX + "*"), *self.layers.layers_dir.glob(PREFIX + "*"),
                     *(p for p in self.layers.referenced() if p.name.startswith(PREFIX))]
        for path in leftovers:
            try:
                young = path.name in known or os.lstat(path).st_mtime >= old  # lstat: a link's own age
            except FileNotFoundError:
                continue  # removed meanwhile (its layer's link, then its subvolume)
            if not young:
                if path.parent == self.dir:
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    self.layers.remove_layer(path.name)
                removed += 1
        return removed


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total
