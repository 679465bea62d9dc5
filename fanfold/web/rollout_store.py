"""The server's rollouts on disk: a SQLite file of the server's own beside the engine's.

The engine's database holds what the engine owns (sandboxes, snapshots, leases); a rollout
is the server's record of which lease and sandbox serve a tenant's rollout id. Servers
before this file kept the rows in the engine's database: a new store adopts them once.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    params TEXT NOT NULL,
    created_at REAL NOT NULL,
    deadline_at REAL NOT NULL,
    lease TEXT,
    sandbox_id TEXT,
    forked_from TEXT,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX IF NOT EXISTS rollouts_deadline ON rollouts(deadline_at);  -- pruning reads only the ended
"""
COLUMNS = "tenant, id, params, created_at, deadline_at, lease, sandbox_id, forked_from"


class RolloutStore:
    """Rollout rows by (tenant, id); WAL, so several servers on one state dir share them."""

    def __init__(self, state_dir: Path) -> None:
        path = state_dir / "server.db"
        fresh = not path.exists()
        self.conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.executescript(SCHEMA)
        self.conn.row_factory = sqlite3.Row
        if fresh:
            self._adopt(state_dir / "fanfold.db")

    def _adopt(self, engine_db: Path) -> None:
        """Copy the rollouts an older server kept in the engine's database (idempotent)."""
        if not engine_db.exists():
            return
        self.conn.execute("ATTACH DATABASE ? AS engine", (str(engine_db),))
        try:
            found = self.conn.execute(
                "SELECT 1 FROM engine.sqlite_master WHERE type='table' AND name='rollouts'").fetchone()
            if found:
                self.conn.execute(f"INSERT OR IGNORE INTO rollouts ({COLUMNS}) SELECT {COLUMNS} FROM engine.rollouts")
        finally:
            self.conn.execute("DETACH DATABASE engine")

    def close(self) -> None:
        self.conn.close()

    def insert(self, tenant: str, rollout_id: str, params: str, deadline_at: float,
               forked_from: str | None = None) -> bool:
        """Record a rollout; False when the tenant has one of that id already."""
        cursor = self.conn.execute(
            "INSERT OR IGNORE INTO rollouts (tenant, id, params, created_at, deadline_at, forked_from)"
            " VALUES (?, ?, ?, ?, ?, ?)", (tenant, rollout_id, params, time.time(), deadline_at, forked_from),
        )
        return cursor.rowcount == 1

    def get(self, tenant: str, rollout_id: str) -> sqlite3.Row | None:
        return self.conn.execute("SELECT * FROM rollouts WHERE tenant=? AND id=?", (tenant, rollout_id)).fetchone()

    def of(self, tenant: str) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM rollouts WHERE tenant=? ORDER BY created_at", (tenant,)).fetchall()

    def set_sandbox(self, tenant: str, rollout_id: str, lease: str, sandbox_id: str) -> None:
        self.conn.execute("UPDATE rollouts SET lease=?, sandbox_id=? WHERE tenant=? AND id=?",
                          (lease, sandbox_id, tenant, rollout_id))

    def delete(self, tenant: str, rollout_id: str) -> None:
        self.conn.execute("DELETE FROM rollouts WHERE tenant=? AND id=?", (tenant, rollout_id))

    def prune(self, ended_before: float) -> None:
        """Forget rollouts whose deadline passed before ``ended_before``."""
        self.conn.execute("DELETE FROM rollouts WHERE deadline_at < ?", (ended_before,))
