"""One trajectory store for a Ray cluster: rollouts on every node write, the trainer reads.

A store served by one process: an actor (``fanfold-trajectories`` in the ``fanfold`` namespace)
owns a ``TrajectoryStore`` SQLite file on one node, the creator's (the trainer's) unless told
otherwise, and ``ClusterTrajectoryStore`` offers its methods to any process of the cluster, so
``run_episode(..., store=...)`` takes either store. Chosen over Parquet files on shared storage:
it needs no shared filesystem, keeps step-by-step writes (a rollout cut short leaves its steps,
marked), and ``export`` still writes Parquet (on the actor's node) for trainers that read files.

The actor is not detached: it lives as long as the driver that made it (the trainer), so no
orphan holds the file after a run; the file keeps everything, and the next run's actor reopens it
(episodes the last one left running become ``partial``). Create it in the driver: an actor made
by a task would die with that task's worker. Tasks attach by name, or get the client passed (it
pickles). Ray's errors stop here: the store's own errors arrive as themselves, and a dead or
unreachable actor as ``InfrastructureError``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..errors import InfrastructureError, InvalidRequest, NotFound
from ..rl.store import TrajectoryStore, default_path
from ..rl.trajectory import Episode, Step
from .joining import first_line
from .node import NAMESPACE, connect

STORE_NAME = "fanfold-trajectories"
METHODS = ("begin", "add_step", "finish", "add", "recover", "delete", "dedupe", "expire",
           "get", "joint_episode", "resolve", "episodes", "count", "steps", "step_counts", "export")
"""The ``TrajectoryStore`` methods served: writers call the first four, trainers the reads."""


class TrajectoryActor:
    """The process that owns the store's file; every call runs ``TrajectoryStore``'s method here."""

    def __init__(self, path: str) -> None:
        self.error: Exception | None = None
        try:
            self.store: TrajectoryStore | None = TrajectoryStore(path)
        except Exception as err:  # noqa: BLE001 - kept for info(): Ray keeps only the text of an __init__'s error
            self.store, self.error = None, err

    def info(self) -> dict[str, Any]:
        """Where the file is and which process holds it; ``error``: why it could not be opened."""
        path = None if self.store is None else str(self.store.path)
        return {"path": path, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "error": self.error}

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method not in METHODS:
            raise InvalidRequest(f"the trajectory store has no method {method!r}")
        if self.store is None:
            raise InvalidRequest(f"the trajectory store could not be opened: {self.error}")
        return getattr(self.store, method)(*args, **kwargs)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


class ClusterTrajectoryStore:
    """``TrajectoryStore``'s methods, run by the store's actor: usable from any task, actor or driver.

    ``ClusterTrajectoryStore(path)`` in the driver gets the actor named ``name``, or makes it on
    ``node_id`` (default: this node) with the file at ``path`` (default: ``default_path()``);
    with ``create=False`` a missing actor is ``NotFound``. ``path`` here, and ``export``'s, are
    paths on the actor's node. A process outside Ray joins the cluster at ``address`` first.
    ``close()`` lets go of the actor; ``stop()`` ends it.
    """

    def __init__(self, path: str | Path | None = None, *, name: str = STORE_NAME, node_id: str | None = None,
                 create: bool = True, address: str | None = "auto") -> None:
        connect(address)
        self.name = name
        self._actor: Any = _existing(name)
        if self._actor is None:
            if not create:
                raise NotFound(f"no trajectory store {name!r} on this Ray cluster (namespace {NAMESPACE!r})")
            self._actor = _create(name, _absolute(path), node_id)
        info = self._remote("info")
        if info["error"] is not None:
            ray.kill(self._actor, no_restart=True)  # it could not open the file: free the name
            raise info["error"]
        self.path: str = info["path"]
        self.node_id: str = info["node_id"]
        self.pid: int = info["pid"]
        """The actor's process, the one holding the file."""
        if path is not None and str(_absolute(path)) != self.path:
            raise InvalidRequest(f"trajectory store {name!r} keeps {self.path}, not {path}; give another name")

    def __repr__(self) -> str:
        return f"ClusterTrajectoryStore({self.path!r}, name={self.name!r}, node_id={self.node_id[:12]!r})"

    def close(self) -> None:
        """Let go of the actor (it serves the others on); further calls raise ``InvalidRequest``."""
        self._actor = None

    def stop(self) -> None:
        """Close the file and end the actor: every writer's next call raises ``InfrastructureError``."""
        if self._actor is not None:
            actor, self._actor = self._actor, None
            try:
                _result(self.name, actor.close.remote())
            finally:
                ray.kill(actor, no_restart=True)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._remote("call", method, args, kwargs)

    def _remote(self, method: str, *args: Any) -> Any:
        if self._actor is None:
            raise InvalidRequest(f"this client of trajectory store {self.name!r} is closed")
        return _result(self.name, getattr(self._actor, method).remote(*args))

    # Writing: one actor call each, as TrajectoryStore's are one transaction each.

    def begin(self, episode: Episode) -> str:
        return self._call("begin", episode)

    def add_step(self, episode_id: str, step: Step) -> None:
        self._call("add_step", episode_id, step)

    def finish(self, episode_id: str, outcome: str, *, total_reward: float | None = None,
               error: str | None = None) -> None:
        self._call("finish", episode_id, outcome, total_reward=total_reward, error=error)

    def add(self, episode: Episode, *, dedupe: bool = False) -> str:
        return self._call("add", episode, dedupe=dedupe)

    def recover(self) -> int:
        return self._call("recover")

    def delete(self, episode_id: str) -> None:
        self._call("delete", episode_id)

    def dedupe(self) -> int:
        return self._call("dedupe")

    def expire(self, older_than_s: float) -> int:
        return self._call("expire", older_than_s)

    # Reading

    def get(self, episode_id: str, *, with_steps: bool = True) -> Episode:
        return self._call("get", episode_id, with_steps=with_steps)

    def joint_episode(self, joint_id: str, *, with_steps: bool = True) -> dict[str, Episode]:
        return self._call("joint_episode", joint_id, with_steps=with_steps)

    def resolve(self, prefix: str) -> str:
        return self._call("resolve", prefix)

    def episodes(self, *, task: str | Sequence[str] | None = None, outcome: str | Sequence[str] | None = None,
                 include_incomplete: bool = False, since: float | None = None, limit: int | None = None,
                 with_steps: bool = True) -> list[Episode]:
        return self._call("episodes", task=task, outcome=outcome, include_incomplete=include_incomplete, since=since,
                          limit=limit, with_steps=with_steps)

    def count(self, *, task: str | Sequence[str] | None = None, outcome: str | Sequence[str] | None = None,
              include_incomplete: bool = False, since: float | None = None) -> int:
        return self._call("count", task=task, outcome=outcome, include_incomplete=include_incomplete, since=since)

    def steps(self, episode_id: str, start: int = 0, stop: int | None = None) -> list[Step]:
        return self._call("steps", episode_id, start, stop)

    def step_counts(self, episode_ids: Iterable[str]) -> dict[str, int]:
        return self._call("step_counts", list(episode_ids))

    def export(self, path: str | Path, *, format: str | None = None, task: str | Sequence[str] | None = None,
               outcome: str | Sequence[str] | None = None, include_incomplete: bool = False,
               since: float | None = None, limit: int | None = None) -> int:
        return self._call("export", str(_absolute(path)), format=format, task=task, outcome=outcome,
                          include_incomplete=include_incomplete, since=since, limit=limit)


for _name in METHODS:  # the same words as the local store's: the behaviour is the same
    getattr(ClusterTrajectoryStore, _name).__doc__ = getattr(TrajectoryStore, _name).__doc__


def _existing(name: str) -> Any:
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def _create(name: str, path: Path, node_id: str | None) -> Any:
    context = ray.get_runtime_context()
    if getattr(getattr(context, "worker", None), "mode", ray.SCRIPT_MODE) != ray.SCRIPT_MODE:
        raise InvalidRequest(f"no trajectory store {name!r} yet: make it in the driver (the trainer) first; "
                             "an actor made by a task dies with that task's worker")
    return ray.remote(TrajectoryActor).options(
        name=name, namespace=NAMESPACE, get_if_exists=True, num_cpus=0, max_concurrency=8,
        # Restarted where its file is, never elsewhere; calls are not replayed (a begin twice would fail).
        max_restarts=-1, max_task_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id or context.get_node_id(), soft=False),
    ).remote(str(path))


def _absolute(path: str | Path | None) -> Path:
    if path == ":memory:":
        return Path(path)
    return Path(os.path.abspath(path if path is not None else default_path()))


def _result(name: str, ref: Any) -> Any:
    """The call's value; the store's own error as itself, Ray's as ``InfrastructureError``."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, Exception):
            raise err.cause from None
        raise InfrastructureError(f"trajectory store {name!r}: {err.cause!r}") from None
    except ray.exceptions.RayActorError as err:
        raise InfrastructureError(f"trajectory store {name!r}: its actor is gone or unreachable ({first_line(err)});"
                                  " what it wrote stays in its file") from None
    except ray.exceptions.RayError as err:
        raise InfrastructureError(f"trajectory store {name!r}: {first_line(err)}") from None
