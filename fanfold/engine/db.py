"""The engine's SQLite record of sandboxes, shared safely by every engine on one state directory."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Iterator, TypeVar

from ..errors import host_full
from ..models import Limits, SandboxInfo, SnapshotInfo
from ..runtime.base import Handle

T = TypeVar("T", SandboxInfo, SnapshotInfo)

SNAPSHOTS_TABLE = """
CREATE TABLE IF NOT EXISTS {table} (
    id TEXT PRIMARY KEY,
    parent TEXT NOT NULL,
    image_id TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    layers TEXT NOT NULL,
    memory INTEGER NOT NULL,
    kind TEXT NOT NULL,
    name TEXT,
    limits TEXT NOT NULL,
    size_bytes INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    tenant TEXT NOT NULL DEFAULT ''
);
"""
# A snapshot's name is unique within its tenant's names ("" is the host's), as image references are.
SNAPSHOT_INDEXES = """
CREATE INDEX IF NOT EXISTS snapshots_sandbox ON snapshots(sandbox_id);
CREATE UNIQUE INDEX IF NOT EXISTS snapshots_tenant_name ON snapshots(tenant, name);
"""
SCHEMA = SNAPSHOTS_TABLE.format(table="snapshots") + SNAPSHOT_INDEXES + """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    image_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    detached INTEGER NOT NULL DEFAULT 0,
    limits TEXT NOT NULL,
    labels TEXT NOT NULL,
    env TEXT NOT NULL,
    pid INTEGER,
    created_at REAL NOT NULL,
    deadline_at REAL,
    tenant TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS sandboxes_owner ON sandboxes(owner);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    ttl REAL NOT NULL,
    expires_at REAL NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS image_tenants (
    image_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    PRIMARY KEY (image_id, tenant)
);
CREATE TABLE IF NOT EXISTS shared_images (
    image_id TEXT PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS groups (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    state TEXT NOT NULL,
    params TEXT NOT NULL,
    addresses TEXT NOT NULL,
    ports TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    deadline_at REAL,
    source TEXT NOT NULL DEFAULT '',
    claimed_by TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS group_snapshots (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    group_id TEXT NOT NULL,
    name TEXT,
    members TEXT NOT NULL,
    params TEXT NOT NULL,
    memory INTEGER NOT NULL,
    created_at REAL NOT NULL
);
"""
# Columns added after the first release: (name, SQL type and default). Old databases get them.
LATER_COLUMNS = [
    ("tenant", "TEXT NOT NULL DEFAULT ''"),
    ("source", "TEXT NOT NULL DEFAULT ''"),
    ("layers", "TEXT NOT NULL DEFAULT '[]'"),
    ("persistence", "TEXT NOT NULL DEFAULT 'ephemeral'"),
    ("priority", "INTEGER NOT NULL DEFAULT 0"),
    ("idle_timeout", "REAL"),
    ("active_at", "REAL NOT NULL DEFAULT 0"),
    ("suspended_to", "TEXT"),
    ("claimed_by", "TEXT"),
    ("exec_user", "TEXT NOT NULL DEFAULT ''"),
    ("seccomp", "TEXT NOT NULL DEFAULT 'default'"),
    ("backend", "TEXT NOT NULL DEFAULT ''"),
    ("network", "TEXT NOT NULL DEFAULT '\"none\"'"),
    ("gpu_ids", "TEXT NOT NULL DEFAULT '[]'"),
    ("group_id", "TEXT NOT NULL DEFAULT ''"),
    ("member", "TEXT NOT NULL DEFAULT ''"),
    ("nested", "INTEGER NOT NULL DEFAULT 0"),
]


class _Cursor(sqlite3.Cursor):
    """A cursor whose statements on a full state filesystem raise the typed ``CapacityExceeded``
    (SQLite rolls the statement back), not a raw ``sqlite3.OperationalError``: at execute, and at
    the fetch where a write with RETURNING ends and commits. Each step holds its connection's lock."""

    def execute(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with self.connection.lock, _typed():
            return super().execute(*args, **kwargs)

    def executemany(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with self.connection.lock, _typed():
            return super().executemany(*args, **kwargs)

    def fetchone(self):  # type: ignore[no-untyped-def]
        with self.connection.lock, _typed():
            return super().fetchone()

    def fetchall(self):  # type: ignore[no-untyped-def]
        with self.connection.lock, _typed():
            return super().fetchall()

    def __next__(self):  # type: ignore[no-untyped-def]
        with self.connection.lock, _typed():
            return super().__next__()


class _Connection(sqlite3.Connection):
    """A connection whose ``execute`` runs on a ``_Cursor``, and whose ``close`` waits for a statement
    another thread is running: closed under a running statement, sqlite3 crashes the process (an
    engine closed by one loop while a late kill on another still read). A statement after the close
    raises ``sqlite3.ProgrammingError``."""

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.lock = threading.RLock()

    def execute(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.cursor(_Cursor).execute(*args, **kwargs)

    def executemany(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.cursor(_Cursor).executemany(*args, **kwargs)

    def executescript(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with self.lock:
            return super().executescript(*args, **kwargs)

    def close(self) -> None:
        with self.lock:
            super().close()


@contextlib.contextmanager
def _typed() -> Iterator[None]:
    try:
        yield
    except sqlite3.OperationalError as err:
        full = host_full(err)
        if full is None:
            raise
        raise full from None


class Database:
    """One connection per engine; WAL so other engines and CLI calls read while we write."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False,
                                    factory=_Connection)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.executescript(SCHEMA)
        columns = {row[1] for row in self.conn.execute("PRAGMA table_info(sandboxes)")}
        for name, kind in LATER_COLUMNS:
            if name not in columns:
                self.conn.execute(f"ALTER TABLE sandboxes ADD COLUMN {name} {kind}")
        if "claimed_by" not in {row[1] for row in self.conn.execute("PRAGMA table_info(groups)")}:
            self.conn.execute("ALTER TABLE groups ADD COLUMN claimed_by TEXT NOT NULL DEFAULT ''")
        self._names_per_tenant()
        self.conn.row_factory = sqlite3.Row

    def _names_per_tenant(self) -> None:
        """Move a database whose snapshot names were one namespace for every tenant (``name TEXT UNIQUE``)
        to names per tenant. SQLite drops no constraint in place: the table is copied into a new one,
        in one write transaction, so another engine opening the database meanwhile sees either."""
        if not self._names_unique_across_tenants():
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            if self._names_unique_across_tenants():  # another engine may have moved it while we waited
                old = {row[1] for row in self.conn.execute("PRAGMA table_info(snapshots)")}
                self.conn.execute("DROP TABLE IF EXISTS snapshots_moving")
                self.conn.execute(SNAPSHOTS_TABLE.format(table="snapshots_moving"))
                new = [row[1] for row in self.conn.execute("PRAGMA table_info(snapshots_moving)")]
                kept = ", ".join(name for name in new if name in old)
                self.conn.execute(f"INSERT INTO snapshots_moving ({kept}) SELECT {kept} FROM snapshots")
                self.conn.execute("DROP TABLE snapshots")
                self.conn.execute("ALTER TABLE snapshots_moving RENAME TO snapshots")
                for statement in filter(str.strip, SNAPSHOT_INDEXES.split(";")):
                    self.conn.execute(statement)
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    def _names_unique_across_tenants(self) -> bool:
        """Whether the snapshots table still has the first release's UNIQUE constraint on its name alone."""
        for index in self.conn.execute("PRAGMA index_list(snapshots)").fetchall():
            columns = [row[2] for row in self.conn.execute(f"PRAGMA index_info({index[1]!r})")]
            if index[2] and columns == ["name"]:
                return True
        return False

    def close(self) -> None:
        self.conn.close()

    def insert(self, info: SandboxInfo, *, owner: str, env: dict[str, str], layers: tuple[str, ...], tenant: str = "",
               claimed_by: str | None = None, backend: str = "") -> None:
        self._insert("sandboxes", {
            **columns_of(info), "owner": owner, "env": json.dumps(env), "layers": json.dumps(list(layers)),
            "tenant": tenant, "active_at": info.created_at, "claimed_by": claimed_by, "backend": backend,
        })

    def _insert(self, table: str, columns: dict[str, object]) -> None:
        marks = ", ".join("?" * len(columns))
        self.conn.execute(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})", tuple(columns.values()))

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """One write transaction around the statements inside (no await among them): other engines of the
        state dir wait for it, so what they read and write inside is one step."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def gpu_holders(self) -> list[tuple[str, str]]:
        """Each sandbox holding GPUs: its ``gpu_ids`` and ``limits``, as JSON."""
        return self.conn.execute("SELECT gpu_ids, limits FROM sandboxes WHERE gpu_ids != '[]'").fetchall()

    def update(self, sandbox_id: str, *, if_state: str | None = None, **fields: object) -> bool:
        """Set ``fields`` of the row (only while its state is ``if_state``, when given); whether it was there."""
        names = ", ".join(f"{name}=?" for name in fields)
        values = [json.dumps(list(v)) if isinstance(v, tuple) else v for v in fields.values()]
        if if_state is None:
            cursor = self.conn.execute(f"UPDATE sandboxes SET {names} WHERE id=?", (*values, sandbox_id))
        else:
            cursor = self.conn.execute(f"UPDATE sandboxes SET {names} WHERE id=? AND state=?",
                                       (*values, sandbox_id, if_state))
        return cursor.rowcount == 1

    def update_returning(self, sandbox_id: str, **fields: object) -> sqlite3.Row | None:
        """``update`` and ``get`` in one statement: the row as it is after, or None when there is none."""
        names = ", ".join(f"{name}=?" for name in fields)
        rows = self.conn.execute(f"UPDATE sandboxes SET {names} WHERE id=? RETURNING *",
                                 (*fields.values(), sandbox_id)).fetchall()  # all: the statement ends, and commits
        return rows[0] if rows else None

    def claim(self, sandbox_id: str, owner: str) -> bool:
        """Take a sandbox for a policy action (idle suspend) so one engine of several does it."""
        cursor = self.conn.execute(
            "UPDATE sandboxes SET claimed_by=? WHERE id=? AND claimed_by IS NULL", (owner, sandbox_id)
        )
        return cursor.rowcount == 1

    def unclaim(self, sandbox_id: str) -> None:
        self.conn.execute("UPDATE sandboxes SET claimed_by=NULL WHERE id=?", (sandbox_id,))

    def touch(self, sandbox_id: str) -> None:
        # Written at once, not batched: another engine on this state dir applies the idle
        # policies of detached sandboxes from this column.
        self.conn.execute("UPDATE sandboxes SET active_at=? WHERE id=?", (now(), sandbox_id))

    def touch_running(self, sandbox_id: str, backends: tuple[str, ...]) -> sqlite3.Row | None:
        """Stamp activity on a running sandbox whose backend column is one of ``backends`` and return
        its row, in one statement; None, with nothing written, when it is no such sandbox."""
        marks = ", ".join("?" * len(backends))
        rows = self.conn.execute(
            f"UPDATE sandboxes SET active_at=? WHERE id=? AND state='running' AND backend IN ({marks}) RETURNING *",
            (now(), sandbox_id, *backends)).fetchall()
        return rows[0] if rows else None

    # -- snapshots ----------------------------------------------------------------------------

    def insert_snapshot(self, info: SnapshotInfo, *, layers: tuple[str, ...], tenant: str) -> None:
        self._insert("snapshots", {**columns_of(info), "layers": json.dumps(list(layers)), "tenant": tenant})

    def snapshot(self, ref: str, tenant: str = "") -> sqlite3.Row | None:
        """A snapshot by id (any tenant's: ids are unique on the host), or by the name ``tenant`` gave it
        (each tenant names its own; "" is the host's)."""
        return self.conn.execute("SELECT * FROM snapshots WHERE id=? OR (name=? AND tenant=?)",
                                 (ref, ref, tenant)).fetchone()

    def snapshot_rows(self) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM snapshots ORDER BY created_at").fetchall()

    def snapshot_ids(self, *, kind: str, sandbox_id: str) -> set[str]:
        rows = self.conn.execute("SELECT id FROM snapshots WHERE kind=? AND sandbox_id=?", (kind, sandbox_id))
        return {row["id"] for row in rows}

    def stray_suspends(self) -> dict[str, str]:
        """Suspend snapshots whose sandbox has no row (an engine died as it destroyed it): id -> sandbox id."""
        rows = self.conn.execute("SELECT id, sandbox_id FROM snapshots WHERE kind='suspend'"
                                 " AND sandbox_id NOT IN (SELECT id FROM sandboxes)")
        return {row["id"]: row["sandbox_id"] for row in rows}

    def delete_snapshot(self, snapshot_id: str) -> bool:
        """Delete its row; False if there was none (another caller deleted it first)."""
        return self.conn.execute("DELETE FROM snapshots WHERE id=?", (snapshot_id,)).rowcount > 0

    # -- which server tenants see which images ------------------------------------------------

    def grant_image(self, image_id: str, tenant: str) -> None:
        self.conn.execute("INSERT OR IGNORE INTO image_tenants (image_id, tenant) VALUES (?, ?)", (image_id, tenant))

    def revoke_image(self, image_id: str, tenant: str | None = None) -> None:
        """Take ``image_id`` from ``tenant`` (from every tenant, and unshare it, when None)."""
        if tenant is not None:
            self.conn.execute("DELETE FROM image_tenants WHERE image_id=? AND tenant=?", (image_id, tenant))
            return
        self.conn.execute("DELETE FROM image_tenants WHERE image_id=?", (image_id,))
        self.conn.execute("DELETE FROM shared_images WHERE image_id=?", (image_id,))

    def image_grants(self) -> dict[str, set[str]]:
        """Each image id a tenant made, and the tenants that made it."""
        found: dict[str, set[str]] = {}
        for image_id, tenant in self.conn.execute("SELECT image_id, tenant FROM image_tenants"):
            found.setdefault(image_id, set()).add(tenant)
        return found

    def share_image(self, image_id: str, shared: bool) -> None:
        if shared:
            self.conn.execute("INSERT OR IGNORE INTO shared_images (image_id) VALUES (?)", (image_id,))
        else:
            self.conn.execute("DELETE FROM shared_images WHERE image_id=?", (image_id,))

    def shared_images(self) -> set[str]:
        return {row[0] for row in self.conn.execute("SELECT image_id FROM shared_images")}

    # -- leases -------------------------------------------------------------------------------

    def insert_lease(self, lease_id: str, tenant: str, ttl: float) -> float:
        at = now()
        self.conn.execute(
            "INSERT INTO leases (id, tenant, ttl, expires_at, created_at) VALUES (?, ?, ?, ?, ?)",
            (lease_id, tenant, ttl, at + ttl, at),
        )
        return at + ttl

    def lease(self, lease_id: str) -> sqlite3.Row | None:
        return self.conn.execute("SELECT * FROM leases WHERE id=?", (lease_id,)).fetchone()

    def renew_lease(self, lease_id: str) -> float | None:
        """Push a live lease's expiry out by its ttl; None when it expired or never existed."""
        at = now()
        row = self.conn.execute(
            "UPDATE leases SET expires_at=? + ttl WHERE id=? AND expires_at > ? RETURNING expires_at",
            (at, lease_id, at),
        ).fetchone()
        return None if row is None else row[0]

    def live_lease_ids(self) -> set[str]:
        return {r[0] for r in self.conn.execute("SELECT id FROM leases WHERE expires_at > ?", (now(),))}

    def expired_leases(self) -> list[str]:
        return [r[0] for r in self.conn.execute("SELECT id FROM leases WHERE expires_at <= ?", (now(),))]

    def delete_lease(self, lease_id: str) -> None:
        self.conn.execute("DELETE FROM leases WHERE id=?", (lease_id,))

    def count_leases(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM leases").fetchone()[0]

    def owned_by(self, owner: str) -> list[str]:
        return [r[0] for r in self.conn.execute("SELECT id FROM sandboxes WHERE owner=?", (owner,))]

    def count(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM sandboxes").fetchone()[0]

    def disk_mb(self) -> dict[str, int]:
        """Each sandbox's ``disk_mb`` (pooled, suspended and destroying ones too: their disks are there)."""
        return dict(self.conn.execute("SELECT id, json_extract(limits, '$.disk_mb') FROM sandboxes").fetchall())

    def disk_mb_total(self) -> int:
        """The ``disk_mb`` of every sandbox added up."""
        return self.conn.execute("SELECT COALESCE(SUM(json_extract(limits, '$.disk_mb')), 0) FROM sandboxes").fetchone()[0]

    def count_by_state(self) -> dict[str, int]:
        return dict(self.conn.execute("SELECT state, COUNT(*) FROM sandboxes GROUP BY state").fetchall())

    def delete(self, sandbox_id: str) -> None:
        self.conn.execute("DELETE FROM sandboxes WHERE id=?", (sandbox_id,))

    def get(self, sandbox_id: str) -> sqlite3.Row | None:
        return self.conn.execute("SELECT * FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()

    def rows(self) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM sandboxes ORDER BY created_at").fetchall()


def row_handle(row: sqlite3.Row) -> Handle:
    """What the backend knows the row's sandbox by."""
    return Handle(row["id"], row["pid"])


def row_layers(row: sqlite3.Row) -> tuple[str, ...]:
    return tuple(json.loads(row["layers"]))


# A record's fields are its row's columns, but for these: kept under another name, or as JSON.
COLUMN_OF = {"user": "exec_user"}
AS_JSON = ("limits", "labels", "network", "gpu_ids")


def columns_of(record: SandboxInfo | SnapshotInfo) -> dict[str, object]:
    """A sandbox's or snapshot's record as its row's columns (a snapshot without limits: the defaults)."""
    columns: dict[str, object] = {}
    for spec in dataclasses.fields(record):
        value = getattr(record, spec.name)
        if spec.name == "limits":  # flat numbers: no deep copy (asdict's) needed
            value = {field.name: getattr(value or Limits(), field.name) for field in dataclasses.fields(Limits)}
        columns[COLUMN_OF.get(spec.name, spec.name)] = json.dumps(value) if spec.name in AS_JSON else value
    return columns


def _record(cls: type[T], row: sqlite3.Row) -> T:
    values = {}
    for spec in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = row[COLUMN_OF.get(spec.name, spec.name)]
        values[spec.name] = json.loads(value) if spec.name in AS_JSON else bool(value) if spec.type == "bool" else value
    return cls(**{**values, "limits": Limits(**values["limits"])})


def row_info(row: sqlite3.Row) -> SandboxInfo:
    return _record(SandboxInfo, row)


def snapshot_info(row: sqlite3.Row) -> SnapshotInfo:
    return _record(SnapshotInfo, row)


def now() -> float:
    return time.time()
