"""The Ray side: a ``FanfoldNode`` actor per node runs that node's ``fanfold serve``, and one
controller actor keeps a node actor on every alive node (nodes joining are picked up within
``interval_s``; a dead node's actor dies with it and its server with the actor).

Both are detached named actors in the ``fanfold`` namespace, so they outlive the driver that
started them; ``stop_cluster`` ends them, and each server destroys its sandboxes as it stops.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..errors import InvalidRequest

log = logging.getLogger("fanfold.cluster")

NAMESPACE = "fanfold"
CONTROLLER = "fanfold-controller"
NODE_PREFIX = "fanfold-node-"
TAG_FILE = "node-tag"
"""In a node's state dir: the tag its ids carry, written at its first start and kept."""
START_TIMEOUT_S = 120.0
_LISTENING = re.compile(r"listening on (\S+)")


@dataclass(frozen=True)
class ClusterConfig:
    """How the controller starts ``fanfold serve`` on each node."""

    token: str = field(default_factory=lambda: "ff_" + secrets.token_urlsafe(32), repr=False)
    """The host token every node server accepts (the host's own tenant there) and drivers use."""
    state_dir: str = "/var/lib/fanfold"
    """Each node's state dir; ``{node_id}`` is replaced by the Ray node id (several nodes on one machine)."""
    host: str | None = None
    """The address node servers listen on (default: the node's address as Ray knows it)."""
    port: int = 0
    """Their TCP port (0: any free one)."""
    backend: str | None = None
    runtime: str | None = None
    resource: str | None = None
    """Only nodes offering this Ray custom resource get a server (default: every node)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the node servers (``FANFOLD_*`` settings)."""
    pools: tuple[str, ...] = ()
    """``IMAGE=SIZE`` warm pools every node keeps from its start."""
    interval_s: float = 2.0
    """How often the controller looks for nodes that joined or left."""

    def public(self) -> dict[str, Any]:
        """The settings, without the token."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "token"}


def node_tag(state_dir: Path) -> str:
    """The tag of the node using ``state_dir``: read from it, or made and written at first use."""
    path = state_dir / TAG_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        tag = secrets.token_hex(3)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(tag + "\n")
        os.replace(tmp, path)
        return tag


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the forked child may not dlopen


def _die_with_parent() -> None:  # the server goes when its actor's process does (PR_SET_PDEATHSIG)
    _PRCTL(1, signal.SIGKILL)


class FanfoldNode:
    """One node's ``fanfold serve``, a child of this actor's process: it starts with the actor and
    dies with it, so a node that leaves the cluster takes its server along."""

    def __init__(self, config: ClusterConfig, node_id: str) -> None:
        self.node_id = node_id
        self.state_dir = Path(config.state_dir.format(node_id=node_id))
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.tag = node_tag(self.state_dir)
        host = config.host or ray.util.get_node_ip_address()
        argv = [sys.executable, "-m", "fanfold.cli", "--state-dir", str(self.state_dir)]
        argv += ["--backend", config.backend] if config.backend else []
        argv += ["--runtime", config.runtime] if config.runtime else []
        argv += ["serve", "--no-socket", "--host", host, "--port", str(config.port)]
        for pool in config.pools:
            argv += ["--pool", pool]
        env = {**os.environ, **config.env, "FANFOLD_NODE_TAG": self.tag, "FANFOLD_HOST_TOKEN": config.token}
        self.log_path = self.state_dir / "serve.log"
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent)
        self.url = self._await_listening()
        threading.Thread(target=self._drain, name="fanfold-serve-log", daemon=True).start()

    def _await_listening(self) -> str:
        """Read the server's output to its "listening" line; its URL (RuntimeError if it exits first)."""
        assert self.proc.stdout is not None
        timer = threading.Timer(START_TIMEOUT_S, self.proc.kill)
        timer.start()
        seen: list[str] = []
        try:
            for line in self.proc.stdout:
                seen.append(line)
                if match := _LISTENING.search(line):
                    return match[1].split()[0]
        finally:
            timer.cancel()
        self.proc.wait()
        raise RuntimeError(f"fanfold serve on node {self.node_id[:12]} exited ({self.proc.returncode}) before"
                           f" listening:\n{''.join(seen[-20:])}")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "a") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()

    def info(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "tag": self.tag, "url": self.url, "state_dir": str(self.state_dir),
                "pid": self.proc.pid, "running": self.proc.poll() is None}

    def stop(self, grace_s: float = 30.0) -> int | None:
        """Stop the server (it destroys the sandboxes it owns); its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Controller:
    """Keeps a ``FanfoldNode`` on every alive node (with ``config.resource``, if set) and answers
    drivers with the list of node servers and the token."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.nodes: dict[str, dict[str, Any]] = {}
        self.errors: dict[str, str] = {}
        self._actors: dict[str, Any] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._pass = asyncio.Lock()

    async def start(self) -> list[dict[str, Any]]:
        """Start the node servers missing now (waiting for them), then keep watching."""
        await self.reconcile()
        return await self.list_nodes()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.reconcile()
            except Exception:  # noqa: BLE001 - the watch must outlive one bad pass
                log.exception("fanfold controller: reconcile failed")

    async def reconcile(self) -> None:
        """One pass: forget nodes that left, check the others' servers, start the missing ones."""
        if self._loop_task is None:  # Ray restarted this actor: its watch starts with the first call
            self._loop_task = asyncio.get_running_loop().create_task(self._watch())
        async with self._pass:
            alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"] and self._serves(n)}
            for node_id in [n for n in self.nodes if n not in alive]:
                self.nodes.pop(node_id, None)
                self._actors.pop(node_id, None)
            for node_id in [n for n in self.errors if n not in alive]:
                del self.errors[node_id]
            await asyncio.gather(*(self._ensure(node_id, node) for node_id, node in alive.items()))

    def _serves(self, node: dict[str, Any]) -> bool:
        return self.config.resource is None or node["Resources"].get(self.config.resource, 0) > 0

    async def _ensure(self, node_id: str, node: dict[str, Any]) -> None:
        actor = self._actors.get(node_id)
        if actor is None:
            # No Ray resources: its sandboxes' CPUs, memory and GPU shares are the server's own to admit
            # (it finds the GPUs by their device nodes, whatever CUDA_VISIBLE_DEVICES Ray sets). Taking
            # num_gpus would keep the server, and every sandbox, off a node whose GPUs Ray tasks hold,
            # and take whole GPUs from Ray's accounting that the sandboxes share time-sliced.
            actor = ray.remote(FanfoldNode).options(
                name=NODE_PREFIX + node_id, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, num_gpus=0, max_restarts=-1, max_concurrency=4,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(self.config, node_id)
            self._actors[node_id] = actor
        try:
            info = await asyncio.wait_for(actor.info.remote(), START_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - recorded for `fanfold ray status`; retried next pass
            self.errors[node_id] = f"{type(err).__name__}: {err}"[:2000]
            self.nodes.pop(node_id, None)
            self._actors.pop(node_id, None)
            return
        if not info["running"]:  # its server exited: restarting the actor starts a new one on the state dir
            self.errors[node_id] = f"fanfold serve exited; restarting it (log: {info['state_dir']}/serve.log)"
            self.nodes.pop(node_id, None)
            ray.kill(actor, no_restart=False)
            return
        resources = node["Resources"]
        info.update(memory_mb=resources.get("memory", 0) / 2**20, cpus=resources.get("CPU", 0.0),
                    ray_gpus=resources.get("GPU", 0.0), address=node.get("NodeManagerAddress"))
        self.errors.pop(node_id, None)
        self.nodes[node_id] = info

    async def list_nodes(self) -> list[dict[str, Any]]:
        if self._loop_task is None:
            await self.reconcile()
        return sorted(self.nodes.values(), key=lambda info: info["tag"])

    async def status(self) -> dict[str, Any]:
        return {"nodes": await self.list_nodes(), "errors": dict(self.errors), "config": self.config.public()}

    async def token(self) -> str:
        return self.config.token

    async def stop(self) -> None:
        """Stop every node server (each destroys its sandboxes) and end the node actors."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        async with self._pass:
            actors = list(self._actors.values()) + _named_nodes(exclude=set(self._actors))
            await asyncio.gather(*(actor.stop.remote() for actor in actors), return_exceptions=True)
            for actor in actors:
                ray.kill(actor, no_restart=True)
            self._actors.clear()
            self.nodes.clear()


def _named_nodes(exclude: set[str]) -> list[Any]:
    """Node actors found by name (those a restarted controller has not met again yet)."""
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        node_id = entry["name"].removeprefix(NODE_PREFIX)
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(NODE_PREFIX) and node_id not in exclude:
            try:
                found.append(ray.get_actor(entry["name"], namespace=NAMESPACE))
            except ValueError:
                pass  # gone meanwhile
    return found


class _TokenNotice(logging.Filter):
    """Drops Ray's notice that token authentication is on, logged at every ``ray.init("auto")`` on a
    machine that holds a token: that is how a secured cluster runs, not news. Other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TOKEN_NOTICE)


TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"
_TOKEN_LOGGER = logging.getLogger("ray._private.authentication.authentication_token_setup")


def quiet_token_notice() -> None:
    """Filter Ray's token notice out of this process's log (once)."""
    if not any(isinstance(f, _TokenNotice) for f in _TOKEN_LOGGER.filters):
        _TOKEN_LOGGER.addFilter(_TokenNotice())


def connect(address: str | None = "auto") -> None:
    """Join the Ray cluster at ``address`` (``auto``, ``ray://host:10001``) unless this process has."""
    if not ray.is_initialized():
        quiet_token_notice()
        try:
            ray.init(address=address or "auto", namespace=NAMESPACE, logging_level=logging.WARNING,
                     log_to_driver=False)
        except ConnectionError as err:
            raise InvalidRequest(f"no Ray cluster at {address or 'auto'}: {err} (start one with `ray start --head`,"
                                 " or pass its address)") from None


def controller() -> Any:
    """The cluster's controller actor; InvalidRequest when fanfold was not started on it."""
    try:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        raise InvalidRequest("fanfold is not started on this Ray cluster: run `fanfold ray start` "
                             "(or fanfold.cluster.start_cluster) first") from None


async def start_cluster(config: ClusterConfig | None = None, *, address: str | None = "auto",
                        nodes: int | None = None, timeout: float = START_TIMEOUT_S) -> list[dict[str, Any]]:
    """Start fanfold on the Ray cluster (a no-op where it runs already) and return its node servers,
    waiting until at least ``nodes`` of them answer."""
    connect(address)
    here = ray.get_runtime_context().get_node_id()  # the head, as a rule: preferred, not required
    actor = ray.remote(Controller).options(
        name=CONTROLLER, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_restarts=-1, max_concurrency=64, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
    ).remote(config or ClusterConfig())
    infos = await actor.start.remote()
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while nodes is not None and len(infos) < nodes:
        if loop.time() > end:
            status = await actor.status.remote()
            raise InvalidRequest(f"only {len(infos)} of {nodes} fanfold nodes started in {timeout:g} s;"
                                 f" errors: {status['errors'] or 'none'}")
        await asyncio.sleep(0.2)  # a node joining takes a second or more; poll its arrival gently
        await actor.reconcile.remote()
        infos = await actor.list_nodes.remote()
    return infos


async def stop_cluster(*, address: str | None = "auto") -> None:
    """Stop fanfold on the Ray cluster: every node server (and its sandboxes) and the controller."""
    connect(address)
    try:
        actor = controller()
    except InvalidRequest:
        return
    await actor.stop.remote()
    ray.kill(actor, no_restart=True)
