"""The engine's SQLite record of sandboxes, shared safely by every engine on one state directory."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from ..models import Limits, SandboxInfo

SCHEMA = """
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
"""


class Database:
    """One connection per engine; WAL so other engines and CLI calls read while we write."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.executescript(SCHEMA)
        columns = {row[1] for row in self.conn.execute("PRAGMA table_info(sandboxes)")}
        if "tenant" not in columns:  # a database made before the server existed
            self.conn.execute("ALTER TABLE sandboxes ADD COLUMN tenant TEXT NOT NULL DEFAULT ''")

    def close(self) -> None:
        self.conn.close()

    def insert(self, info: SandboxInfo, *, owner: str, env: dict[str, str], tenant: str = "") -> None:
        self.conn.execute(
            "INSERT INTO sandboxes (id, state, image_id, owner, detached, limits, labels, env, created_at, deadline_at,"
            " tenant) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (info.id, info.state, info.image_id, owner, int(info.detached), json.dumps(info.limits.__dict__),
             json.dumps(info.labels), json.dumps(env), info.created_at, info.deadline_at, tenant),
        )

    def set_state(self, sandbox_id: str, state: str, *, pid: int | None = None) -> None:
        if pid is None:
            self.conn.execute("UPDATE sandboxes SET state=? WHERE id=?", (state, sandbox_id))
        else:
            self.conn.execute("UPDATE sandboxes SET state=?, pid=? WHERE id=?", (state, pid, sandbox_id))

    def delete(self, sandbox_id: str) -> None:
        self.conn.execute("DELETE FROM sandboxes WHERE id=?", (sandbox_id,))

    def get(self, sandbox_id: str) -> sqlite3.Row | None:
        self.conn.row_factory = sqlite3.Row
        return self.conn.execute("SELECT * FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()

    def rows(self) -> list[sqlite3.Row]:
        self.conn.row_factory = sqlite3.Row
        return self.conn.execute("SELECT * FROM sandboxes ORDER BY created_at").fetchall()


def row_info(row: sqlite3.Row) -> SandboxInfo:
    return SandboxInfo(
        id=row["id"], state=row["state"], image_id=row["image_id"], limits=Limits(**json.loads(row["limits"])),
        labels=json.loads(row["labels"]), created_at=row["created_at"], deadline_at=row["deadline_at"],
        detached=bool(row["detached"]),
    )


def now() -> float:
    return time.time()
