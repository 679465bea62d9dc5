"""``RayTransport``: the fleet's ``EngineAPI`` over every node of a Ray cluster.

Ray only finds the nodes (the controller's list); each call goes over HTTP straight to the node's
``fanfold serve`` (one ``HttpTransport`` per node, each with its own lease). Ids carry their
node's tag (``fanfold.ids``), so a call on a sandbox or snapshot goes to the node holding it;
creates are placed by headroom with affinity to the nodes holding the image or snapshot, and a
create with ``gpus`` on the nodes whose own stats list the GPU shares for it (``placement.rank``);
listings and figures are gathered from every node and merged.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator, TypeVar

from .. import ids
from ..client import LEASE_TTL_S, HttpTransport
from ..errors import (
    CapacityExceeded, FanfoldError, GroupNotFound, InfrastructureError, InvalidRequest, NotFound, SandboxNotFound,
    SnapshotNotFound,
)
from ..groups import GroupInfo, GroupParams, GroupSnapshotInfo
from ..gpu_request import wanted as wanted_gpus
from ..images import Image
from ..models import CreateParams, ExecResult, FileEntry, ForkResult, Limits, PoolInfo, SandboxInfo, SnapshotInfo
from ..refs import BASES
from . import node as nodemod
from .joining import first_line, join
from .merge import merge_stats
from .placement import NodeLoad, no_gpu_node, rank, split_pool

if TYPE_CHECKING:
    from ..engine.api import OnOutput
    from ..ssh import SshAccess
    from ..images.builder import Network, OnStep
    from ..images.oci import OnPull
    from ..spec import EnvSpec

log = logging.getLogger("fanfold.cluster")
T = TypeVar("T")

LOAD_TIMEOUT_S = 10.0
"""How long a node may take to report its load before it counts as down until the next refresh."""
CONTROLLER_WAIT_S = 30.0
"""How long a call waits for the controller while Ray restarts it."""
REFRESH_S = 2.0
"""How often the node list and each node's load are read again."""
HOLDINGS_EVERY = 5
"""Every how many refreshes each node's images and snapshots are listed again (this driver's own
builds, pulls and snapshots are counted as they happen)."""


@dataclass
class Node:
    """One node server as this driver sees it."""

    tag: str
    node_id: str
    url: str
    memory_mb: float
    cpus: float
    http: HttpTransport
    ray_gpus: float = 0.0
    alive: bool = True
    stats: dict[str, Any] = field(default_factory=dict)
    images: frozenset[str] = frozenset()
    snapshots: frozenset[str] = frozenset()
    inflight: int = 0
    inflight_memory_mb: float = 0.0
    inflight_gpus: list[tuple[str, bool]] = field(default_factory=list)

    def commit(self, limits: Limits, gpu_ids: list[str], sign: int = 1) -> None:
        """Count a sandbox made (``sign`` 1) or destroyed (-1) here in its last stats, until they are read again."""
        host = self.stats.setdefault("host", {})
        host["memory_committed_mb"] = max(host.get("memory_committed_mb", 0) + sign * limits.memory_mb, 0)
        host["cpus_committed"] = max(host.get("cpus_committed", 0.0) + sign * limits.cpus, 0.0)
        for gpu in host.get("gpu_inventory") or ():
            if gpu["id"] in gpu_ids:
                take = gpu["shares"] if limits.gpu_exclusive else 1
                gpu["used"] = max(gpu["used"] + sign * take, 0)

    def load(self) -> NodeLoad:
        return replace(
            NodeLoad.from_stats(self.tag, self.stats, memory_mb=self.memory_mb, cpus=self.cpus,
                                images=self.images | frozenset(BASES), snapshots=self.snapshots),
            alive=self.alive, inflight=self.inflight, inflight_memory_mb=self.inflight_memory_mb,
            inflight_gpus=tuple(self.inflight_gpus), ray_gpus=self.ray_gpus,
        )


class RayTransport:
    """Every fanfold node of a Ray cluster behind one ``EngineAPI``.

    ``address`` is Ray's: ``auto`` (from a process on the cluster), ``ray://host:10001`` (Ray
    Client, for discovery only: the calls themselves go to the nodes), or None to use the Ray
    connection this process already has.
    """

    def __init__(self, address: str | None = "auto", *, token: str | None = None,
                 lease_ttl: float = LEASE_TTL_S) -> None:
        self.address = address
        self._token = token
        self._lease_ttl = lease_ttl
        self.nodes: dict[str, Node] = {}
        self._controller: Any = None
        self._refresher: asyncio.Task[None] | None = None
        self._refreshing = asyncio.Lock()
        self._specs: dict[str, EnvSpec] = {}
        """Images built through this transport, by id: rebuilt (from cache where layers are) on a node lacking one."""
        self._refs: dict[str, str] = {}
        """Images pulled through this transport: pulled again on a node lacking one."""
        self._departed: set[str] = set()
        """Tags of nodes given up: calls on their ids fail at once, without a refresh each."""
        self._refreshed_at = 0.0
        self._made: dict[str, tuple[Limits, list[str]]] = {}
        """The limits and GPUs of the sandboxes this transport made, counted on their node until killed."""

    # -- nodes ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Join the Ray cluster, find the node servers and take a lease on each; on failure keep nothing."""
        try:
            join(self.address)  # in this thread: Ray wants its driver's signal handlers on the main one
            with _ray_errors("find fanfold on the Ray cluster"):
                self._controller = nodemod.controller()
                if self._token is None:
                    self._token = await self._ask("token")
            await self.refresh()
            if not self.nodes:
                raise InfrastructureError("no fanfold node is up on this Ray cluster yet: see `fanfold ray status`")
            self._refresher = asyncio.create_task(self._refresh_forever())
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Close every node's connection (each destroys this driver's sandboxes there)."""
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
            self._refresher = None
        await asyncio.gather(*(node.http.close() for node in self.nodes.values()), return_exceptions=True)
        self.nodes.clear()

    async def _refresh_forever(self) -> None:
        for passes in itertools.count(1):
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh(holdings=passes % HOLDINGS_EVERY == 0)
            except Exception as err:  # noqa: BLE001 - the next pass tries again; calls go on meanwhile
                log.warning("fanfold: cannot refresh the cluster's nodes: %s", err)

    async def refresh(self, *, holdings: bool = True) -> None:
        """Read the node list (new nodes get a connection, nodes gone are dropped) and every node's load,
        with ``holdings`` what each holds too (a node that joined: always)."""
        async with self._refreshing:
            with _ray_errors("read the cluster's nodes"):
                infos = {info["tag"]: info for info in await self._ask("list_nodes")}
                alive = {n["NodeID"] for n in await asyncio.to_thread(_alive_nodes)}
            # Dropped only when Ray has the node dead or its server moved: a controller that restarted
            # and lists nothing yet must not cost the sandboxes on healthy nodes.
            for tag in [t for t, node in self.nodes.items()
                        if node.node_id not in alive or (t in infos and infos[t]["url"] != node.url)]:
                self._drop(tag)
            fresh = [info for tag, info in infos.items()
                     if info["node_id"] in alive and (tag not in self.nodes or self.nodes[tag].url != info["url"])]
            await asyncio.gather(*(self._join(info) for info in fresh))
            joined = [self.nodes[info["tag"]] for info in fresh if info["tag"] in self.nodes]
            await asyncio.gather(*(self._read_load(node, holdings or node in joined)
                                   for node in list(self.nodes.values())))
            self._made.clear()  # the fresh stats count them; kills from now on show at the next read
            self._refreshed_at = time.monotonic()

    async def _ask(self, method: str) -> Any:
        """A call to the controller that rides out its restart (Ray brings it back within seconds)."""
        from ray.exceptions import ActorUnavailableError

        loop = asyncio.get_running_loop()
        end = loop.time() + CONTROLLER_WAIT_S
        while True:
            try:
                return await getattr(self._controller, method).remote()
            except ActorUnavailableError:
                if loop.time() > end:
                    raise
            await asyncio.sleep(0.2)  # "the actor is restarting": ask again shortly

    async def _join(self, info: dict[str, Any]) -> None:
        if info["tag"] in self.nodes:
            self._drop(info["tag"])
        http = HttpTransport(info["url"], self._token, lease_ttl=self._lease_ttl)
        try:
            await http.start()
        except FanfoldError as err:
            log.warning("fanfold: node %s at %s does not answer yet: %s", info["tag"], info["url"], err)
            return
        self.nodes[info["tag"]] = Node(tag=info["tag"], node_id=info["node_id"], url=info["url"],
                                       memory_mb=info["memory_mb"], cpus=info["cpus"], http=http,
                                       ray_gpus=info.get("ray_gpus", 0.0))

    def _drop(self, tag: str) -> None:
        """Give up a node whose server is gone or replaced: calls in flight there fail at once (retryable)."""
        node = self.nodes.pop(tag, None)
        if node is not None:
            self._departed.add(tag)
            node.http.abandon()

    async def _read_load(self, node: Node, holdings: bool) -> None:
        """A node's counts, and with ``holdings`` what it holds (images, snapshots)."""
        try:
            async with asyncio.timeout(LOAD_TIMEOUT_S):  # a vanished machine must not stall every refresh
                node.stats, node.alive = await node.http.stats(sandboxes=False), True
                if not holdings:
                    return
                images, snapshots = await asyncio.gather(node.http.images(), node.http.snapshots())
        except (InfrastructureError, TimeoutError):
            node.alive = False
            return
        node.images = frozenset(n for image in images for n in (image.id, *image.names))
        for image in images:  # a pulled image can be pulled on any node: remember from where
            if image.source.startswith("registry "):
                ref = image.source.removeprefix("registry ")
                self._refs.update(dict.fromkeys((image.id, *image.names), ref))
        node.snapshots = frozenset(n for snap in snapshots for n in (snap.id, snap.name) if n)

    def _alive(self) -> list[Node]:
        alive = [node for node in self.nodes.values() if node.alive]
        if not alive:
            raise InfrastructureError("no fanfold node of the Ray cluster answers")
        return alive

    async def _node_of(self, any_id: str, missing: type[NotFound]) -> Node:
        """The node an id names (refreshing once for a node not seen yet)."""
        tag = ids.node_of(any_id)
        if tag is None:
            raise missing(f"{any_id!r} is not an id of a cluster node's sandbox or snapshot")
        if tag not in self.nodes and tag not in self._departed and time.monotonic() - self._refreshed_at > 0.5:
            await self.refresh()  # a node that joined since; not once per call on a node that left
        node = self.nodes.get(tag)
        if node is None:
            raise InfrastructureError(f"node {tag} of {any_id} has left the cluster (or its server stopped)")
        return node

    async def _on(self, node: Node, call: Awaitable[T]) -> T:
        """A call to one node; a lost server marks the node down until the next refresh finds it."""
        try:
            return await call
        except InfrastructureError as err:
            if "lost the fanfold server" in str(err):
                node.alive = False
            raise

    async def _to(self, any_id: str, verb: Callable[[HttpTransport], Awaitable[T]],
                  missing: type[NotFound] = SandboxNotFound) -> T:
        node = await self._node_of(any_id, missing)
        return await self._on(node, verb(node.http))

    async def _each(self, verb: Callable[[HttpTransport], Awaitable[T]]) -> list[T]:
        return list(await asyncio.gather(*(self._on(node, verb(node.http)) for node in self._alive())))

    # -- images -----------------------------------------------------------------------------

    def _best(self, source: str | None = None, limits: Limits | None = None) -> list[Node]:
        """Nodes to place on, best first; with ``limits.gpus``, only those that could give them."""
        loads = [node.load() for node in self._alive()]
        if limits is None:  # a build or pull: the roomiest node
            order = rank(loads, memory_mb=0.0, cpus=0.0, source=source)
        else:
            order = rank(loads, memory_mb=limits.memory_mb, cpus=limits.cpus, source=source,
                         gpus=wanted_gpus(limits.gpus), gpu_exclusive=limits.gpu_exclusive)
        return [self.nodes[load.tag] for load in order]

    async def _placeable(self, source: str | None, limits: Limits) -> list[Node]:
        """``_best`` for a create or pool; with GPUs, InvalidRequest when no node could give them (after a
        refresh, for a GPU node that joined since)."""
        nodes, gpus = self._best(source, limits), wanted_gpus(limits.gpus)
        if not nodes and gpus is not None:
            await self.refresh()
            nodes = self._best(source, limits)
        if not nodes and gpus is not None:
            raise InvalidRequest(no_gpu_node([node.load() for node in self.nodes.values()], gpus))
        return nodes

    async def build(self, spec: EnvSpec, on_step: OnStep | None = None, *, network: Network = "isolated",
                    tag: str | None = None) -> Image:
        """Build on the node with the most headroom; others build it (from their cache) when a create needs it."""
        node = self._best()[0]
        image = await self._on(node, node.http.build(spec, on_step, network=network, tag=tag))
        self._specs[image.id] = spec
        node.images |= {image.id, *image.names}
        return image

    async def images(self) -> list[Image]:
        merged: dict[str, Image] = {}
        for images in await self._each(lambda http: http.images()):
            for image in images:
                known = merged.get(image.id)
                merged[image.id] = image if known is None else replace(
                    known, names=tuple(dict.fromkeys(known.names + image.names)))
        return list(merged.values())

    async def pull(self, ref: str, *, platform: str | None = None, on_progress: OnPull | None = None) -> Image:
        node = self._best()[0]
        image = await self._on(node, node.http.pull(ref, platform=platform, on_progress=on_progress))
        self._refs[image.id] = ref
        node.images |= {image.id, *image.names, ref}
        return image

    async def import_image(self, path: str | Path, *, ref: str | None = None,
                           on_progress: OnPull | None = None) -> Image:
        """Import onto one node: sandboxes of this image are placed there."""
        node = self._best()[0]
        image = await self._on(node, node.http.import_image(path, ref=ref, on_progress=on_progress))
        node.images |= {image.id, *image.names}
        return image

    async def remove_image(self, ref: str, *, force: bool = False) -> str:
        return await self._on_holders(ref, lambda http: http.remove_image(ref, force=force))

    async def share_image(self, ref: str, shared: bool = True) -> Image:
        return await self._on_holders(ref, lambda http: http.share_image(ref, shared))

    async def _on_holders(self, ref: str, verb: Callable[[HttpTransport], Awaitable[T]]) -> T:
        """``verb`` on every node holding image ``ref`` (every node when none is known to): the first answer."""
        holders = [node for node in self._alive() if ref in node.images] or self._alive()
        return _first_or_raise(await asyncio.gather(*(self._on(n, verb(n.http)) for n in holders),
                                                    return_exceptions=True))

    async def login(self, registry: str, username: str, password: str) -> None:
        await self._each(lambda http: http.login(registry, username, password))

    async def logout(self, registry: str) -> None:
        await self._each(lambda http: http.logout(registry))

    # -- sandboxes --------------------------------------------------------------------------

    async def create(self, params: CreateParams) -> SandboxInfo:
        """Place the create (headroom, then the image's or snapshot's locality) and make it there,
        bringing the image (rebuild or pull) or the snapshot (a pull from its node) over first."""
        source, limits = params.image, params.limits or Limits()
        candidates = await self._candidates(source, limits)
        last: FanfoldError | None = None
        gpus = wanted_gpus(limits.gpus)
        asks_gpus = [(gpus, limits.gpu_exclusive)] if gpus is not None else []
        for node in candidates[:3]:
            node.inflight += 1
            node.inflight_memory_mb += limits.memory_mb
            node.inflight_gpus += asks_gpus
            try:
                await self._bring(source, node)
                info = await self._on(node, node.http.create(params))
                node.commit(info.limits, info.gpu_ids)  # placement sees it before the next stats read
                self._made[info.id] = (info.limits, info.gpu_ids)
                return info
            except CapacityExceeded as err:  # its queue is full: the next candidate may have room
                last = err
            except InfrastructureError as err:
                last = err
                if node.alive:
                    raise
            finally:
                node.inflight -= 1
                node.inflight_memory_mb -= limits.memory_mb
                for ask in asks_gpus:
                    node.inflight_gpus.remove(ask)
        assert last is not None
        raise last

    async def _candidates(self, source: str, limits: Limits) -> list[Node]:
        """Nodes to try, best first: any node for a source every node can get, else only its holders."""
        nodes = await self._placeable(source, limits)
        if self._anywhere(source):
            return nodes
        holders = [node for node in nodes if source in node.images]
        if not holders:
            await self.refresh()
            nodes = await self._placeable(source, limits)
            holders = [node for node in nodes if source in node.images]
        return holders or nodes  # no holder: let a node say what is wrong with the name

    def _anywhere(self, source: str) -> bool:
        """Whether any node can have ``source``: a base, an image this driver built or any node pulled
        (built again or pulled there), a snapshot (pulled from its node), or a reference none holds
        (the chosen node pulls it). Not: an imported image, or one another driver built."""
        if source in BASES or source in self._specs or source in self._refs:
            return True
        if ids.node_of(source) is not None or any(source in node.snapshots for node in self.nodes.values()):
            return True
        return not source.startswith("img-") and not any(source in node.images for node in self.nodes.values())

    async def _bring(self, source: str, node: Node) -> None:
        """Make ``source`` available on ``node`` if another node holds it."""
        if source in node.images or source in node.snapshots or source in BASES:
            return
        if ids.node_of(source) is not None or any(source in other.snapshots for other in self.nodes.values()):
            await self._import_snapshot(source, node)
        elif source in self._specs:
            image = await self._on(node, node.http.build(self._specs[source]))
            if image.id != source:
                raise InvalidRequest(f"image {source} built again on node {node.tag} came out as {image.id} (its base"
                                     " differs there): build it on every node, or pass the image id it has there")
            node.images |= {source}
        elif source in self._refs:
            await self._on(node, node.http.pull(self._refs[source]))
            node.images |= {source}

    async def _import_snapshot(self, ref: str, node: Node) -> None:
        holder_tag = ids.node_of(ref)
        holder = self.nodes.get(holder_tag) if holder_tag else None
        if holder is None:
            holder = next((other for other in self._alive() if ref in other.snapshots), None)
        if holder is None or holder is node:
            return
        info = await self._on(holder, holder.http.get_snapshot(ref))
        started = time.perf_counter()
        await self._on(node, node.http.import_snapshot(holder.url, info.id))
        log.info("fanfold: snapshot %s moved from node %s to %s in %.0f ms", info.id, holder.tag, node.tag,
                 (time.perf_counter() - started) * 1e3)
        node.snapshots |= {info.id, *([info.name] if info.name else [])}

    async def set_network(self, sandbox_id: str, network: Any, *, cut: bool = False) -> SandboxInfo:
        return await self._to(sandbox_id, lambda http: http.set_network(sandbox_id, network, cut=cut))

    async def network_stats(self, sandbox_id: str) -> dict[str, Any]:
        return await self._to(sandbox_id, lambda http: http.network_stats(sandbox_id))

    async def expose(self, sandbox_id: str, port: int) -> str:
        return await self._to(sandbox_id, lambda http: http.expose(sandbox_id, port))

    async def enable_ssh(self, sandbox_id: str, authorized_keys: list[str] | tuple[str, ...], *,
                         port: int = 22) -> SshAccess:
        return await self._to(sandbox_id, lambda http: http.enable_ssh(sandbox_id, authorized_keys, port=port))

    async def recordings(self) -> list[dict[str, Any]]:
        nodes = self._alive()
        found = await asyncio.gather(*(self._on(node, node.http.recordings()) for node in nodes))
        return [dict(item, node=node.tag) for node, items in zip(nodes, found) for item in items]

    async def delete_recording(self, name: str) -> None:
        """Delete it on every node that has it (NotFound when none does)."""
        results = await asyncio.gather(*(self._on(n, n.http.delete_recording(name)) for n in self._alive()),
                                       return_exceptions=True)
        if any(result is None for result in results):
            _raise_unless_not_found(results)
            return
        _first_or_raise(results)

    async def set_pool(self, image: str | Image, size: int | None, *, limits: Limits | None = None,
                       wait: float | None = None) -> PoolInfo:
        """A cluster-wide pool: ``size`` spread over the nodes by memory, a pool with GPUs over the nodes that
        could give them by their GPU shares (``None``: each node follows its demand)."""
        source = image.id if isinstance(image, Image) else image
        gpus = wanted_gpus(limits.gpus) if limits is not None else None
        nodes = self._alive() if limits is None or gpus is None else await self._placeable(source, limits)
        loads = [n.load() for n in nodes]
        shares = {n.tag: None for n in nodes} if size is None else split_pool(size, loads, gpus=gpus)
        for node in nodes:
            if shares.get(node.tag):
                await self._bring(source, node)
        infos = await asyncio.gather(*(self._on(n, n.http.set_pool(source, shares.get(n.tag, 0), limits=limits,
                                                                   wait=wait)) for n in nodes))
        return _sum_pools(infos, size)

    async def pools_info(self) -> list[PoolInfo]:
        by_key: dict[tuple[str, Limits], list[PoolInfo]] = {}
        for infos in await self._each(lambda http: http.pools_info()):
            for info in infos:
                by_key.setdefault((info.source, info.limits), []).append(info)
        return [_sum_pools(group, None if any(i.size is None for i in group) else sum(i.size or 0 for i in group))
                for group in by_key.values()]

    async def stats(self) -> dict[str, Any]:
        """Every node's figures and the totals (``merge_stats``); a node that does not answer is listed down."""
        nodes = list(self.nodes.values())
        results = await asyncio.gather(*(node.http.stats() for node in nodes), return_exceptions=True)
        per_node: dict[str, dict[str, Any] | None] = {}
        for node, result in zip(nodes, results):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
            per_node[node.tag] = None if isinstance(result, Exception) else result
            if not isinstance(result, Exception):
                node.stats = result
        return merge_stats(per_node)

    async def metrics_text(self) -> str:
        """Every node's Prometheus metrics, each sample labelled with its node."""
        from .merge import merge_metrics

        nodes = self._alive()
        texts = await asyncio.gather(*(node.http.metrics_text() for node in nodes), return_exceptions=True)
        return merge_metrics({n.tag: t for n, t in zip(nodes, texts) if isinstance(t, str)})

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self._to(sandbox_id, lambda http: http.get(sandbox_id))

    async def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        return [info for infos in await self._each(lambda http: http.list(labels)) for info in infos]

    async def kill(self, sandbox_id: str) -> None:
        node = await self._node_of(sandbox_id, SandboxNotFound)
        await self._on(node, node.http.kill(sandbox_id))
        if (made := self._made.pop(sandbox_id, None)) is not None:
            node.commit(*made, sign=-1)

    # -- groups: a group lives on one node (its id names it) -----------------------------------

    async def create_group(self, params: GroupParams) -> GroupInfo:
        """Place the whole group on one node (room for every member, the first member's source local
        there when one has it), bring each member's source over, and make it there."""
        if params.source is not None:
            return await self._to(params.source, lambda http: http.create_group(params), GroupNotFound)
        sources = [member.params.image for member in params.members]
        total = Limits(memory_mb=sum((m.params.limits or Limits()).memory_mb for m in params.members),
                       cpus=max((m.params.limits or Limits()).cpus for m in params.members))
        (node, *_) = await self._candidates(sources[0], total) or [None]
        if node is None:
            raise CapacityExceeded("no node of the cluster can take this group now; try again later")
        for source in dict.fromkeys(sources):
            await self._bring(source, node)
        return await self._on(node, node.http.create_group(params))

    async def get_group(self, group_id: str) -> GroupInfo:
        return await self._to(group_id, lambda http: http.get_group(group_id), GroupNotFound)

    async def list_groups(self) -> list[GroupInfo]:
        return [info for infos in await self._each(lambda http: http.list_groups()) for info in infos]

    async def kill_group(self, group_id: str) -> None:
        await self._to(group_id, lambda http: http.kill_group(group_id), GroupNotFound)

    async def snapshot_group(self, group_id: str, *, memory: bool = False,
                             name: str | None = None) -> GroupSnapshotInfo:
        return await self._to(group_id, lambda http: http.snapshot_group(group_id, memory=memory, name=name),
                              GroupNotFound)

    async def fork_group(self, group_id: str, count: int) -> list[GroupInfo]:
        return await self._to(group_id, lambda http: http.fork_group(group_id, count), GroupNotFound)

    async def group_snapshots(self) -> list[GroupSnapshotInfo]:
        return [info for infos in await self._each(lambda http: http.group_snapshots()) for info in infos]

    async def delete_group_snapshot(self, snapshot_id: str) -> None:
        await self._to(snapshot_id, lambda http: http.delete_group_snapshot(snapshot_id), GroupNotFound)

    # -- checkpoints: on the sandbox's node ------------------------------------------------

    async def snapshot(self, sandbox_id: str, *, memory: bool = False, name: str | None = None) -> SnapshotInfo:
        node = await self._node_of(sandbox_id, SandboxNotFound)
        info = await self._on(node, node.http.snapshot(sandbox_id, memory=memory, name=name))
        node.snapshots |= {info.id, *([info.name] if info.name else [])}
        return info

    async def fork(self, sandbox_id: str, count: int, *, cmd: str | list[str] | None = None,
                   deadline: float | None = None) -> ForkResult:
        return await self._to(sandbox_id, lambda http: http.fork(sandbox_id, count, cmd=cmd, deadline=deadline))

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        return await self._to(sandbox_id, lambda http: http.pause(sandbox_id))

    async def unpause(self, sandbox_id: str) -> SandboxInfo:
        return await self._to(sandbox_id, lambda http: http.unpause(sandbox_id))

    async def suspend(self, sandbox_id: str) -> SandboxInfo:
        return await self._to(sandbox_id, lambda http: http.suspend(sandbox_id))

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await self._to(sandbox_id, lambda http: http.resume(sandbox_id))

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        return await self._to(sandbox_id, lambda http: http.reset(sandbox_id))

    async def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot once (a copy pulled to another node is listed under its own node's id)."""
        merged: dict[str, SnapshotInfo] = {}
        for infos in await self._each(lambda http: http.snapshots()):
            for info in infos:
                merged.setdefault(info.id, info)
        return list(merged.values())

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        if ids.node_of(snapshot_id) is not None:
            return await self._to(snapshot_id, lambda http: http.get_snapshot(snapshot_id), SnapshotNotFound)
        results = await asyncio.gather(*(self._on(n, n.http.get_snapshot(snapshot_id)) for n in self._alive()),
                                       return_exceptions=True)
        return _first_or_raise(results)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete it on its node and every node holding a copy."""
        info = await self.get_snapshot(snapshot_id)
        holders = [n for n in self._alive() if info.id in n.snapshots or n.tag == ids.node_of(info.id)]
        results = await asyncio.gather(*(self._on(n, n.http.delete_snapshot(info.id)) for n in holders),
                                       return_exceptions=True)
        for node in holders:
            node.snapshots -= {info.id, info.name}
        _raise_unless_not_found(results)

    async def gc(self) -> list[str]:
        return [item for items in await self._each(lambda http: http.gc()) for item in items]

    # -- commands and files: on the sandbox's node -----------------------------------------

    async def exec(self, sandbox_id: str, cmd: str | list[str], *, cwd: str | None = None,
                   env: dict[str, str] | None = None, stdin: bytes | str | None = None, timeout: float | None = None,
                   max_output: int | None = None, on_output: OnOutput | None = None,
                   user: str | None = None) -> ExecResult:
        node = await self._node_of(sandbox_id, SandboxNotFound)
        return await self._on(node, node.http.exec(sandbox_id, cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout,
                                                   max_output=max_output, on_output=on_output, user=user))

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._to(sandbox_id, lambda http: http.read_file(sandbox_id, path))

    async def write_file(self, sandbox_id: str, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await self._to(sandbox_id, lambda http: http.write_file(sandbox_id, path, data, mode))

    async def upload(self, sandbox_id: str, local_path: str | Path, path: str) -> int:
        return await self._to(sandbox_id, lambda http: http.upload(sandbox_id, local_path, path))

    async def download(self, sandbox_id: str, path: str, local_path: str | Path) -> int:
        return await self._to(sandbox_id, lambda http: http.download(sandbox_id, path, local_path))

    async def list_files(self, sandbox_id: str, path: str = ".") -> list[FileEntry]:
        return await self._to(sandbox_id, lambda http: http.list_files(sandbox_id, path))

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self._to(sandbox_id, lambda http: http.remove_file(sandbox_id, path, recursive))


@contextmanager
def _ray_errors(doing: str) -> Iterator[None]:
    """Ray's own failures (the controller gone, the GCS unreachable) as InfrastructureError."""
    from ray.exceptions import RayError

    try:
        yield
    except RayError as err:
        raise InfrastructureError(f"cannot {doing}: {type(err).__name__}: {first_line(err)[:300]}") from None


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [node for node in ray.nodes() if node["Alive"]]


def _first_or_raise(results: list[Any]) -> Any:
    """The first result that is not an error; else the first error (a NotFound only when all are)."""
    for result in results:
        if result is not None and not isinstance(result, BaseException):
            return result
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return None
    for error in errors:
        if not isinstance(error, NotFound):
            raise error
    raise errors[0]


def _raise_unless_not_found(results: list[Any]) -> None:
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, NotFound):
            raise result


def _sum_pools(infos: list[PoolInfo], size: int | None) -> PoolInfo:
    if not infos:
        raise InvalidRequest("no node holds that pool")
    first = infos[0]
    errors = [i.last_error for i in infos if i.last_error]
    return PoolInfo(source=first.source, limits=first.limits, size=size, target=sum(i.target for i in infos),
                    ready=sum(i.ready for i in infos), filling=sum(i.filling for i in infos),
                    handouts=sum(i.handouts for i in infos), misses=sum(i.misses for i in infos),
                    last_error=errors[0] if errors else None)

