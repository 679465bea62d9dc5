"""A SQLite store of trajectories, written step by step so that a killed rollout leaves a partial episode.

One file in WAL mode: rollout workers write while trainers and ``fanfold traj`` read. The API
is synchronous and thread-safe (one connection behind a lock); calls are short transactions.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from ..config import EngineConfig, env_trajectories
from ..errors import InfrastructureError, InvalidRequest, NotFound
from ..host import procs
from .export import format_of, jsonl_writer, parquet_writer
from .trajectory import COMPLETE_OUTCOMES, FORMAT_VERSION, Episode, Step, check_outcome, digest_of

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS episodes (
    id TEXT PRIMARY KEY,
    task TEXT NOT NULL,
    seed INTEGER,
    rollout_id TEXT,
    image_id TEXT,
    snapshot_id TEXT,
    parent_id TEXT,
    fork_step INTEGER,
    outcome TEXT NOT NULL,
    total_reward REAL NOT NULL,
    error TEXT,
    metadata TEXT NOT NULL,
    created_at REAL NOT NULL,
    finished_at REAL,
    format_version INTEGER NOT NULL,
    digest TEXT,
    writer_pid INTEGER,
    writer_start INTEGER,
    writer_boot TEXT
);
CREATE INDEX IF NOT EXISTS episodes_created ON episodes(created_at);
CREATE INDEX IF NOT EXISTS episodes_task ON episodes(task, created_at);
CREATE INDEX IF NOT EXISTS episodes_outcome ON episodes(outcome, created_at);
CREATE INDEX IF NOT EXISTS episodes_digest ON episodes(digest);
CREATE TABLE IF NOT EXISTS steps (
    episode_id TEXT NOT NULL REFERENCES episodes(id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    model_output TEXT NOT NULL,
    tool_call TEXT,
    tool_result TEXT,
    reward REAL NOT NULL,
    token_ids BLOB,
    logprobs BLOB,
    loss_mask BLOB,
    policy_version TEXT,
    snapshot_id TEXT,
    started_at REAL NOT NULL,
    duration_s REAL NOT NULL,
    info TEXT NOT NULL,
    PRIMARY KEY (episode_id, idx)
);
"""
EPISODE_COLUMNS = ("id", "task", "seed", "rollout_id", "image_id", "snapshot_id", "parent_id", "fork_step", "outcome",
                   "total_reward", "error", "metadata", "created_at", "finished_at", "format_version")
STEP_COLUMNS = ("idx", "model_output", "tool_call", "tool_result", "reward", "token_ids", "logprobs", "loss_mask",
                "policy_version", "snapshot_id", "started_at", "duration_s", "info")
# Token lists are packed as little-endian arrays: a quarter of JSON's size for logprobs, and exact.
ARRAYS = {"token_ids": "q", "logprobs": "d", "loss_mask": "b"}
CHUNK = 500  # ids per IN (...) query, well under SQLite's parameter limit


def default_path(state_dir: str | Path | None = None) -> Path:
    """``FANFOLD_TRAJECTORIES`` if set, else ``trajectories.db`` in the state directory."""
    return env_trajectories() or Path(state_dir or EngineConfig().state_dir) / "trajectories.db"


class TrajectoryStore:
    """Episodes and their steps in one SQLite file; safe to share between threads and processes."""

    def __init__(self, path: str | Path | None = None, *, create: bool = True) -> None:
        """Open (or, with ``create``, make) the store at ``path``; ``None`` means ``default_path()``.

        Opening also runs ``recover()``, so episodes of writers that died show as ``partial``.
        """
        self.path = ":memory:" if path == ":memory:" else Path(path) if path is not None else default_path()
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = self._connect(create)
        self.recover()

    def _connect(self, create: bool) -> sqlite3.Connection:
        if isinstance(self.path, Path):
            if not create and not self.path.exists():
                raise NotFound(f"no trajectory store at {self.path}")
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as err:
            raise InvalidRequest(f"cannot open trajectory store {self.path}: {err}") from None
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")  # in WAL a killed process loses nothing committed
            conn.execute("PRAGMA foreign_keys=ON")  # steps go with their episode
            conn.executescript(SCHEMA)
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('format_version', ?)", (str(FORMAT_VERSION),))
            version = int(conn.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone()[0])
        except sqlite3.Error as err:
            conn.close()
            raise InvalidRequest(f"cannot open trajectory store {self.path}: {err}") from None
        if version > FORMAT_VERSION:
            conn.close()
            raise InvalidRequest(f"trajectory store {self.path} has format version {version}; this fanfold reads "
                                 f"up to {FORMAT_VERSION}")
        return conn

    def close(self) -> None:
        """Close the connection; further calls raise ``InvalidRequest``."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self, write: bool = False) -> Iterator[sqlite3.Connection]:
        """One transaction under the lock; SQLite's errors leave as fanfold's."""
        with self._lock:
            if self._conn is None:
                raise InvalidRequest(f"trajectory store {self.path} is closed")
            conn = self._conn
            try:
                # IMMEDIATE takes the write lock up front, so a busy file waits here rather than failing mid-way.
                conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                try:
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    _roll_back(conn)
                    raise
            except sqlite3.IntegrityError as err:
                raise InvalidRequest(f"trajectory store {self.path}: {err}") from None
            except sqlite3.Error as err:
                raise InfrastructureError(f"trajectory store {self.path}: {err}") from None

    # Writing -----------------------------------------------------------------------------------

    def begin(self, episode: Episode) -> str:
        """Record ``episode`` as running, with any steps it already has; return its id."""
        with self._tx(write=True) as conn:
            _insert(conn, episode, running=True)
        return episode.id

    def add_step(self, episode_id: str, step: Step) -> None:
        """Append ``step`` to a running episode; it is on disk when this returns."""
        with self._tx(write=True) as conn:
            _require_running(conn, episode_id)
            _insert_steps(conn, episode_id, [step])

    def finish(self, episode_id: str, outcome: str, *, total_reward: float | None = None,
               error: str | None = None) -> None:
        """End a running episode; ``total_reward`` defaults to the sum of its steps' rewards.

        ``error`` (for the ``error`` and ``infra_error`` outcomes) replaces the episode's, if given.
        """
        if check_outcome(outcome) == "running":
            raise InvalidRequest("finish needs an outcome other than 'running'")
        with self._tx(write=True) as conn:
            _require_running(conn, episode_id)
            steps = [Step(index=row[0], model_output=row[1], tool_call=_loads(row[2]), tool_result=row[3],
                          reward=row[4]) for row in conn.execute(
                "SELECT idx, model_output, tool_call, tool_result, reward FROM steps WHERE episode_id = ?",
                (episode_id,))]
            task, seed, image_id, snapshot_id = conn.execute(
                "SELECT task, seed, image_id, snapshot_id FROM episodes WHERE id = ?", (episode_id,)).fetchone()
            total = sum(s.reward for s in steps) if total_reward is None else total_reward
            conn.execute("UPDATE episodes SET outcome = ?, total_reward = ?, error = COALESCE(?, error), finished_at = ?, "
                         "digest = ? "
                         "WHERE id = ?", (outcome, float(total), error, time.time(),
                                          digest_of(task, seed, image_id, snapshot_id, steps), episode_id))

    def add(self, episode: Episode, *, dedupe: bool = False) -> str:
        """Write a whole episode as given and return its id.

        With ``dedupe``, a complete episode identical (same ``digest()``) to a stored complete
        one is not written; the stored one's id is returned.
        """
        with self._tx(write=True) as conn:
            if dedupe and episode.complete:
                row = conn.execute(f"SELECT id FROM episodes WHERE digest = ? AND outcome IN {_marks(COMPLETE_OUTCOMES)} "
                                   "ORDER BY created_at, rowid LIMIT 1", (episode.digest(), *COMPLETE_OUTCOMES)).fetchone()
                if row is not None:
                    return str(row[0])
            _insert(conn, episode, running=False)
        return episode.id

    def recover(self) -> int:
        """Mark running episodes whose writer is dead (or ran before a reboot) as ``partial``; return how many."""
        with self._tx() as conn:
            rows = conn.execute("SELECT id, writer_pid, writer_start, writer_boot FROM episodes "
                                "WHERE outcome = 'running'").fetchall()
        dead = [(row[0], row[1]) for row in rows if not _alive(*row[1:])]
        if not dead:  # a reader on a read-only file never needs the write lock
            return 0
        with self._tx(write=True) as conn:
            for episode_id, pid in dead:
                conn.execute(
                    "UPDATE episodes SET outcome = 'partial', finished_at = ?, error = COALESCE(error, ?), "
                    "total_reward = (SELECT COALESCE(SUM(reward), 0) FROM steps WHERE episode_id = episodes.id) "
                    "WHERE id = ? AND outcome = 'running'",
                    (time.time(), f"its writer (pid {pid}) ended before finishing it", episode_id))
        return len(dead)

    def delete(self, episode_id: str) -> None:
        """Delete one episode and its steps."""
        with self._tx(write=True) as conn:
            if conn.execute("DELETE FROM episodes WHERE id = ?", (episode_id,)).rowcount == 0:
                raise NotFound(f"no episode {episode_id} in {self.path}")

    def dedupe(self) -> int:
        """Delete complete episodes identical to an earlier complete one; return how many went."""
        with self._tx(write=True) as conn:
            ids = [row[0] for row in conn.execute(
                "SELECT id FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY digest ORDER BY created_at, rowid) AS n "
                f"FROM episodes WHERE digest IS NOT NULL AND outcome IN {_marks(COMPLETE_OUTCOMES)}) WHERE n > 1",
                COMPLETE_OUTCOMES)]
            for chunk in _chunks(ids):
                conn.execute(f"DELETE FROM episodes WHERE id IN {_marks(chunk)}", chunk)
        return len(ids)

    def expire(self, older_than_s: float) -> int:
        """Delete episodes created more than ``older_than_s`` ago, except running ones; return how many."""
        if older_than_s < 0:
            raise InvalidRequest(f"older_than_s must be >= 0, got {older_than_s}")
        with self._tx(write=True) as conn:
            # A running episode has a live writer (recover() ran at open): deleting it would break its next add_step.
            return conn.execute("DELETE FROM episodes WHERE created_at < ? AND outcome != 'running'",
                                (time.time() - older_than_s,)).rowcount

    # Reading -----------------------------------------------------------------------------------

    def get(self, episode_id: str, *, with_steps: bool = True) -> Episode:
        """The episode with this id."""
        with self._tx() as conn:
            found = _episodes(conn, "WHERE id = ?", [episode_id], with_steps)
        if not found:
            raise NotFound(f"no episode {episode_id} in {self.path}")
        return found[0]

    def joint_episode(self, joint_id: str, *, with_steps: bool = True) -> dict[str, Episode]:
        """A multi-agent episode's per-agent episodes (``metadata["joint_episode"]``), by agent; every
        outcome, running ones included."""
        with self._tx() as conn:
            found = _episodes(conn, "WHERE json_extract(metadata, '$.joint_episode') = ? ORDER BY created_at, rowid",
                              [joint_id], with_steps)
        if not found:
            raise NotFound(f"no multi-agent episode {joint_id} in {self.path}")
        return {episode.metadata.get("agent", episode.id): episode for episode in found}

    def resolve(self, prefix: str) -> str:
        """The id of the one episode whose id starts with ``prefix``."""
        with self._tx() as conn:
            ids = [row[0] for row in conn.execute("SELECT id FROM episodes WHERE substr(id, 1, ?) = ? LIMIT 2",
                                                  (len(prefix), prefix))]
        if not prefix or len(ids) > 1:
            raise InvalidRequest(f"episode id prefix {prefix!r} is ambiguous; give more of it")
        if not ids:
            raise NotFound(f"no episode {prefix} in {self.path}")
        return str(ids[0])

    def episodes(self, *, task: str | Sequence[str] | None = None, outcome: str | Sequence[str] | None = None,
                 include_incomplete: bool = False, since: float | None = None, limit: int | None = None,
                 with_steps: bool = True) -> list[Episode]:
        """Episodes newest first; only complete ones unless ``include_incomplete`` or an ``outcome`` names others.

        ``task`` and ``outcome`` take one value or several; ``since`` is a unix time of creation.
        """
        where, params = _where(task, outcome, include_incomplete, since)
        if limit is not None:
            if limit < 0:
                raise InvalidRequest(f"limit must be >= 0, got {limit}")
            where, params = where + " LIMIT ?", [*params, limit]
        with self._tx() as conn:
            return _episodes(conn, where, params, with_steps)

    def count(self, *, task: str | Sequence[str] | None = None, outcome: str | Sequence[str] | None = None,
              include_incomplete: bool = False, since: float | None = None) -> int:
        """How many episodes ``episodes()`` would return with the same filters."""
        where, params = _where(task, outcome, include_incomplete, since)
        with self._tx() as conn:
            return int(conn.execute(f"SELECT COUNT(*) FROM episodes {where}", params).fetchone()[0])

    def steps(self, episode_id: str, start: int = 0, stop: int | None = None) -> list[Step]:
        """The steps of an episode with ``start <= index < stop`` (``stop=None``: to the end)."""
        if start < 0 or (stop is not None and stop < 0):
            raise InvalidRequest(f"step slice {start}:{'' if stop is None else stop} must not be negative")
        with self._tx() as conn:
            if conn.execute("SELECT 1 FROM episodes WHERE id = ?", (episode_id,)).fetchone() is None:
                raise NotFound(f"no episode {episode_id} in {self.path}")
            rows = conn.execute(f"SELECT {', '.join(STEP_COLUMNS)} FROM steps WHERE episode_id = ? AND idx >= ? "
                                "AND idx < ? ORDER BY idx", (episode_id, start, sys.maxsize if stop is None else stop))
            return [_step(row) for row in rows]

    def step_counts(self, episode_ids: Iterable[str]) -> dict[str, int]:
        """How many steps each of these episodes has, without loading them."""
        ids, counts = list(episode_ids), {}
        with self._tx() as conn:
            for chunk in _chunks(ids):
                counts.update(conn.execute(f"SELECT episode_id, COUNT(*) FROM steps WHERE episode_id IN {_marks(chunk)} "
                                           "GROUP BY episode_id", chunk).fetchall())
        return {episode_id: counts.get(episode_id, 0) for episode_id in ids}

    def export(self, path: str | Path, *, format: str | None = None, task: str | Sequence[str] | None = None,
               outcome: str | Sequence[str] | None = None, include_incomplete: bool = False,
               since: float | None = None, limit: int | None = None) -> int:
        """Write the episodes ``episodes()`` would return to ``path``; return how many.

        ``format`` is ``jsonl`` (one ``Episode.to_dict()`` a line) or ``parquet`` (one row per
        step); by default it follows the file's suffix. The file appears whole or not at all.
        """
        path = Path(path)
        kind = format_of(path, format)
        ids = [e.id for e in self.episodes(task=task, outcome=outcome, include_incomplete=include_incomplete,
                                           since=since, limit=limit, with_steps=False)]
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with (jsonl_writer if kind == "jsonl" else parquet_writer)(partial) as write:
                for chunk in _chunks(ids, 100):  # a chunk at a time: writers are blocked only briefly
                    with self._tx() as conn:
                        write(_episodes(conn, f"WHERE id IN {_marks(chunk)}", chunk, True, order=chunk))
            os.replace(partial, path)
        except OSError as err:
            raise InvalidRequest(f"cannot write {path}: {err.strerror or err}") from None
        finally:
            partial.unlink(missing_ok=True)
        return len(ids)


# Rows ------------------------------------------------------------------------------------------


def _insert(conn: sqlite3.Connection, episode: Episode, *, running: bool) -> None:
    """The episode's row and steps; ``running`` records it as begun by this process, else as given."""
    outcome = "running" if running else episode.outcome
    finished_at = None if outcome == "running" else episode.finished_at or time.time()
    writer = _writer() if outcome == "running" else (None, None, None)
    digest = None if outcome == "running" else episode.digest()
    values = (episode.id, episode.task, episode.seed, episode.rollout_id, episode.image_id, episode.snapshot_id,
              episode.parent_id, episode.fork_step, outcome, float(episode.total_reward), episode.error,
              _dumps(episode.metadata, "metadata"), episode.created_at, finished_at, episode.format_version,
              digest, *writer)
    try:
        conn.execute(f"INSERT INTO episodes VALUES {_marks(values)}", values)
    except sqlite3.IntegrityError:
        raise InvalidRequest(f"episode {episode.id} is already in the store") from None
    _insert_steps(conn, episode.id, episode.steps)


def _insert_steps(conn: sqlite3.Connection, episode_id: str, steps: list[Step]) -> None:
    for step in steps:
        step.validate()  # fields may have changed since it was made
        where = f"step {step.index}"
        values = (episode_id, step.index, step.model_output,
                  None if step.tool_call is None else _dumps(step.tool_call, f"{where} tool_call"), step.tool_result,
                  float(step.reward), *(_pack(getattr(step, name), code, f"{where} {name}") for name, code in ARRAYS.items()),
                  step.policy_version, step.snapshot_id, step.started_at, step.duration_s,
                  _dumps(step.info, f"{where} info"))
        try:
            conn.execute(f"INSERT INTO steps VALUES {_marks(values)}", values)
        except sqlite3.IntegrityError:
            raise InvalidRequest(f"episode {episode_id} already has a step {step.index}") from None


def _require_running(conn: sqlite3.Connection, episode_id: str) -> None:
    row = conn.execute("SELECT outcome FROM episodes WHERE id = ?", (episode_id,)).fetchone()
    if row is None:
        raise NotFound(f"no episode {episode_id} (begin it first)")
    if row[0] != "running":
        raise InvalidRequest(f"episode {episode_id} already ended ({row[0]}); it takes no more steps")


def _episodes(conn: sqlite3.Connection, where: str, params: Sequence[Any], with_steps: bool,
              order: list[str] | None = None) -> list[Episode]:
    rows = conn.execute(f"SELECT {', '.join(EPISODE_COLUMNS)} FROM episodes {where}", params).fetchall()
    episodes = [_episode(row) for row in rows]
    if with_steps:
        by_id = {e.id: e for e in episodes}
        for chunk in _chunks(list(by_id)):
            for row in conn.execute(f"SELECT episode_id, {', '.join(STEP_COLUMNS)} FROM steps "
                                    f"WHERE episode_id IN {_marks(chunk)} ORDER BY episode_id, idx", chunk):
                by_id[row[0]].steps.append(_step(row[1:]))
    if order is not None:
        rank = {episode_id: n for n, episode_id in enumerate(order)}
        episodes.sort(key=lambda e: rank[e.id])
    return episodes


def _episode(row: Sequence[Any]) -> Episode:
    values = dict(zip(EPISODE_COLUMNS, row))
    values["metadata"] = json.loads(values["metadata"])
    return Episode(**values)


def _step(row: Sequence[Any]) -> Step:
    values = dict(zip(STEP_COLUMNS, row))
    for name, code in ARRAYS.items():
        values[name] = _unpack(values[name], code)
    values["tool_call"], values["info"] = _loads(values["tool_call"]), json.loads(values["info"])
    return Step(index=values.pop("idx"), **values)


def _where(task: str | Sequence[str] | None, outcome: str | Sequence[str] | None, include_incomplete: bool,
           since: float | None) -> tuple[str, list[Any]]:
    """The WHERE and ORDER BY of the filters ``episodes``, ``count`` and ``export`` share."""
    clauses: list[str] = []
    params: list[Any] = []
    if task is not None:
        tasks = [task] if isinstance(task, str) else list(task)
        clauses.append(f"task IN {_marks(tasks)}")
        params += tasks
    outcomes = [outcome] if isinstance(outcome, str) else list(outcome or [])
    if not outcomes and not include_incomplete:
        outcomes = list(COMPLETE_OUTCOMES)
    if outcomes:
        clauses.append(f"outcome IN {_marks([check_outcome(o) for o in outcomes])}")
        params += outcomes
    if since is not None:
        clauses.append("created_at >= ?")
        params.append(since)
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    return f"{where} ORDER BY created_at DESC, rowid DESC", params


# Encoding --------------------------------------------------------------------------------------


def _dumps(value: Any, what: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as err:
        raise InvalidRequest(f"{what} must be JSON-able: {err}") from None


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _pack(values: list[Any] | None, code: str, what: str) -> bytes | None:
    if values is None:
        return None
    try:
        packed = array(code, values)
    except (TypeError, OverflowError) as err:
        raise InvalidRequest(f"{what}: {err}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _unpack(blob: bytes | None, code: str) -> list[Any] | None:
    if blob is None:
        return None
    values = array(code)
    values.frombytes(blob)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _marks(values: Sequence[Any]) -> str:
    return f"({', '.join('?' * len(values))})"


def _chunks(items: list[str], size: int = CHUNK) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


# Writers' liveness -----------------------------------------------------------------------------


@cache
def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None



def _roll_back(conn: sqlite3.Connection) -> None:
    """End the transaction a failed statement or COMMIT left open (a COMMIT that failed for a full
    disk leaves it so, and every later BEGIN would fail), if SQLite has not ended it already."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # the statement's own error is the one to report


def _writer() -> tuple[int, int | None, str | None]:
    pid = os.getpid()
    return pid, procs.start_time(pid), _boot_id()


def _alive(pid: int | None, start: int | None, boot: str | None) -> bool:
    """Whether the writer still runs: same boot, same pid, same start time (pids are reused), not a zombie."""
    if pid is None or boot != _boot_id():
        return False
    return procs.running(pid) and (start is None or procs.start_time(pid) == start)
