"""Where a create goes: candidate nodes ranked by headroom and locality, and warm pools split over nodes.

Pure functions over ``NodeLoad`` figures (each node's last ``stats()`` plus this client's creates in
flight), so they are tested without Ray or a network. No node's word is fresh: stats lag by up to a
poll, and other drivers place creates at the same time; hence the random pick between two good
candidates (power of two choices), which keeps drivers that read the same stats from herding.

A create with ``gpus`` goes only to nodes whose GPUs (as their own stats list them) could ever give
it, those with the shares free now first, the most free shares first; one without goes to nodes
without GPUs unless they have much less room (``GPU_NODE_PENALTY``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from ..engine.gpus import Slots as GpuLoad
from ..engine.gpus import pick

LOCALITY_BONUS = 0.3
"""Headroom (as a fraction of a node) that holding the create's image or snapshot is worth: a node
with it wins over one with up to this much more room, since a pull or build costs seconds."""
CPU_WEIGHT = 0.05
"""How much the fraction of CPU left counts beside memory and creating slots."""
CHOICE_MARGIN = 0.1
"""How far under the best score a fitting node may be and still be drawn for the first choice."""
GPU_NODE_PENALTY = 0.2
"""Headroom a node with GPUs gives up for a create that needs none: such creates go to nodes without
GPUs unless those have this much less room, keeping GPU nodes' memory and slots for the creates only
they can take (Ray's scheduler keeps CPU tasks off GPU nodes the same way)."""


def gpu_load(entry: dict[str, Any]) -> GpuLoad:
    """One GPU of a node as its stats list it (``host.gpu_inventory``)."""
    names = {str(entry["id"]), str(entry.get("index", "")), *map(str, entry.get("names") or ())} - {""}
    return GpuLoad(id=str(entry["id"]), index=int(entry.get("index", 0)), names=frozenset(names),
                   shares=int(entry.get("shares", 1)), used=int(entry.get("used", 0)))


def could_ever_hold(gpus: tuple[GpuLoad, ...], asked: str) -> bool:
    """Whether a node with ``gpus`` could give ``asked`` once its sandboxes are gone."""
    if not gpus:
        return False
    if asked.startswith("device="):
        return all(any(name in gpu.names for gpu in gpus) for name in asked.removeprefix("device=").split(","))
    return asked == "all" or int(asked) <= len(gpus)


@dataclass
class NodeLoad:
    """One node's capacity and load as a client sees it."""

    tag: str
    memory_mb: float
    """The node's capacity for sandboxes."""
    cpus: float
    """CPU capacity for sandboxes."""
    memory_committed_mb: float
    """Memory limits of its live sandboxes (stats' ``host.memory_committed_mb``)."""
    cpus_committed: float
    """CPU limits of its live sandboxes (stats' ``host.cpus_committed``)."""
    memory_available_mb: float
    """The host's MemAvailable (stats' ``host.memory_available_mb``)."""
    creating: int = 0
    """Creates holding a slot (stats' ``queue.creating``)."""
    max_creating: int = 4
    waiting: int = 0
    """Creates queued for a slot (stats' ``queue.waiting``)."""
    inflight: int = 0
    """Creates this client sent there and has no answer for yet."""
    inflight_memory_mb: float = 0.0
    """The memory limits of those creates."""
    images: frozenset[str] = frozenset()
    """Ids and names of the images it holds."""
    snapshots: frozenset[str] = frozenset()
    """Ids and names of the snapshots it holds."""
    gpus: tuple[GpuLoad, ...] = ()
    """Its GPUs and their shares (stats' ``host.gpu_inventory``): the node's own discovery, the one word on them."""
    inflight_gpus: tuple[tuple[str, bool], ...] = ()
    """The ``(gpus, gpu_exclusive)`` of this client's creates in flight there."""
    ray_gpus: float = 0.0
    """The GPUs Ray counts on the node: a hint for errors only (Ray may count GPUs fanfold cannot use)."""
    alive: bool = True

    @classmethod
    def from_stats(
        cls, tag: str, stats: dict[str, Any] | None, *, memory_mb: float, cpus: float,
        images: Iterable[str] = (), snapshots: Iterable[str] = (),
    ) -> NodeLoad:
        """A node's load from its ``stats()`` dict; ``None`` (no answer) makes a dead node."""
        host, queue = (stats or {}).get("host") or {}, (stats or {}).get("queue") or {}
        return cls(
            tag=tag, memory_mb=memory_mb, cpus=cpus,
            memory_committed_mb=host.get("memory_committed_mb", 0), cpus_committed=host.get("cpus_committed", 0.0),
            memory_available_mb=host.get("memory_available_mb", 0), creating=queue.get("creating", 0),
            max_creating=queue.get("max_creating", 4), waiting=queue.get("waiting", 0),
            images=frozenset(images), snapshots=frozenset(snapshots), alive=stats is not None,
            gpus=tuple(gpu_load(entry) for entry in host.get("gpu_inventory") or ()),
        )

    def sent(self, memory_mb: float) -> NodeLoad:
        """This load with one more create of ``memory_mb`` in flight."""
        return replace(self, inflight=self.inflight + 1, inflight_memory_mb=self.inflight_memory_mb + memory_mb)

    def fits(self, memory_mb: float, reserve_mb: float) -> bool:
        """Whether a create with this memory limit fits under capacity and in the host's free memory."""
        committed = self.memory_committed_mb + self.inflight_memory_mb + memory_mb
        return committed <= self.memory_mb and self.memory_available_mb - reserve_mb >= memory_mb

    def headroom(self, memory_mb: float, cpus: float) -> float:
        """The smaller fraction left of memory and of free creating slots once this create is placed
        (negative when over), plus ``CPU_WEIGHT`` times the fraction of CPU left: CPU limits are
        overcommitted as a rule (most sandboxes idle), so CPU leans on the choice without ruling it."""
        memory = _left(self.memory_mb, self.memory_committed_mb + self.inflight_memory_mb + memory_mb)
        cpu = max(_left(self.cpus, self.cpus_committed + cpus), -1.0)
        slots = _left(max(self.max_creating, 1), self.creating + self.waiting + self.inflight)
        return min(memory, slots) + CPU_WEIGHT * cpu

    def holds(self, source: str | None) -> bool:
        return source is not None and (source in self.images or source in self.snapshots)

    def gpus_now(self) -> tuple[GpuLoad, ...]:
        """Its GPUs with the shares this client's creates in flight there will take (as the engine would pick)."""
        gpus = {gpu.id: gpu for gpu in self.gpus}
        for asked, exclusive in self.inflight_gpus:
            for gpu_id in pick(tuple(gpus.values()), asked, exclusive) or ():
                gpu = gpus[gpu_id]
                gpus[gpu_id] = replace(gpu, used=gpu.used + (gpu.shares if exclusive else 1))
        return tuple(gpus.values())

    def gpu_free(self) -> int:
        """Shares free over all its GPUs, creates in flight counted."""
        return sum(max(gpu.shares - gpu.used, 0) for gpu in self.gpus_now())

    def gives_gpus(self, asked: str, exclusive: bool) -> bool:
        """Whether it has the GPU shares for ``asked`` free now."""
        return pick(self.gpus_now(), asked, exclusive) is not None


def _left(capacity: float, used: float) -> float:
    return (capacity - used) / capacity if capacity > 0 else -1.0


def rank(
    nodes: Iterable[NodeLoad], *, memory_mb: float, cpus: float, source: str | None,
    gpus: str | None = None, gpu_exclusive: bool = False, reserve_mb: float = 256,
    rng: random.Random | None = None,
) -> list[NodeLoad]:
    """Alive nodes, best first, to try a create on in turn (the next after a ``CapacityExceeded``).

    Nodes the create fits come first: the first of them drawn by power of two choices among those
    within ``CHOICE_MARGIN`` of the best score, the others by score (headroom, plus ``LOCALITY_BONUS``
    on a node holding ``source``, less ``GPU_NODE_PENALTY`` on a node with GPUs when it needs none).
    Nodes it does not fit follow, least full first, so that when all are full the create queues on
    the emptiest instead of failing.

    With ``gpus`` only nodes that could ever give them are listed (none: no node could); it fits
    where the shares are free now, and the most free shares rank first, then the score; when every
    GPU is taken, it queues on the node with the most shares free.
    """
    rng = rng or random.Random()
    alive = [node for node in nodes if node.alive]
    if gpus is not None:
        alive = [node for node in alive if could_ever_hold(node.gpus, gpus)]

    def gives(node: NodeLoad) -> bool:
        return gpus is None or node.gives_gpus(gpus, gpu_exclusive)

    fitting = [node for node in alive if node.fits(memory_mb, reserve_mb) and gives(node)]
    full = [node for node in alive if not (node.fits(memory_mb, reserve_mb) and gives(node))]

    def score(node: NodeLoad) -> float:
        penalty = GPU_NODE_PENALTY if gpus is None and node.gpus else 0.0
        return node.headroom(memory_mb, cpus) + (LOCALITY_BONUS if node.holds(source) else 0.0) - penalty

    def key(node: NodeLoad) -> tuple[int, float]:  # the GPU shares free lead, where the create asks for GPUs
        return (0 if gpus is None else node.gpu_free(), score(node))

    fitting.sort(key=key, reverse=True)
    full.sort(key=lambda node: (gives(node), 0 if gpus is None else node.gpu_free(), node.headroom(memory_mb, cpus)),
              reverse=True)
    if len(fitting) > 1:
        most_free, best = key(fitting[0])
        drawn = [node for node in fitting if key(node)[0] == most_free and score(node) >= best - CHOICE_MARGIN]
        first = _better_of_two(drawn, score, rng)
        fitting.remove(first)
        fitting.insert(0, first)
    return fitting + full


def no_gpu_node(nodes: Iterable[NodeLoad], gpus: str) -> str:
    """Why no alive node could ever give ``gpus``, for an InvalidRequest (Ray's GPU count as a hint)."""
    alive = [node for node in nodes if node.alive]
    with_gpus = [node for node in alive if node.gpus]
    if not with_gpus:
        why = f"no node of the cluster has a GPU ({len(alive)} node{'' if len(alive) == 1 else 's'} answering)"
        hinted = [node.tag for node in alive if node.ray_gpus > 0]
        if hinted:
            why += (f"; Ray counts GPUs on {', '.join(hinted)}, where fanfold finds no NVIDIA device node or CDI"
                    " spec: check the driver there (FANFOLD_GPU_DEV_DIR, FANFOLD_GPU_CDI_DIRS)")
        return f"limit gpus={gpus}: {why}; create the sandbox without gpus, or add a node with GPUs"
    if gpus.isdigit():
        most = max(with_gpus, key=lambda node: len(node.gpus))
        return (f"limit gpus={gpus}: no node of the cluster has {gpus} GPUs (the most: {len(most.gpus)} on node"
                f" {most.tag}); ask for at most {len(most.gpus)}")
    listed = "; ".join(f"{node.tag}: {', '.join(_gpu_name(gpu) for gpu in node.gpus)}" for node in with_gpus)
    return f"limit gpus={gpus}: no node of the cluster has all those GPUs (nodes with GPUs: {listed})"


def _gpu_name(gpu: GpuLoad) -> str:
    return gpu.id if gpu.id == str(gpu.index) else f"{gpu.index} ({gpu.id})"


def _better_of_two(nodes: list[NodeLoad], score: Callable[[NodeLoad], float], rng: random.Random) -> NodeLoad:
    if len(nodes) == 1:
        return nodes[0]
    one, other = rng.sample(nodes, 2)
    return other if score(other) > score(one) else one


def split_pool(size: int, nodes: Iterable[NodeLoad], *, gpus: str | None = None) -> dict[str, int]:
    """A cluster-wide warm pool of ``size`` split over the alive nodes in proportion to their memory
    (largest remainders), at least 1 each when ``size`` reaches the node count; dead nodes get 0.
    A pool with ``gpus`` goes only to nodes that could give them, in proportion to their GPU shares."""
    nodes = list(nodes)
    alive = [node for node in nodes if node.alive and (gpus is None or could_ever_hold(node.gpus, gpus))]
    split = {node.tag: 0 for node in nodes}
    if size <= 0 or not alive:
        return split

    def weight(node: NodeLoad) -> float:
        return max(node.memory_mb, 0) if gpus is None else sum(gpu.shares for gpu in node.gpus)

    total = sum(weight(node) for node in alive)
    shares = [size * (weight(node) / total if total > 0 else 1 / len(alive)) for node in alive]
    counts = [int(share) for share in shares]
    by_remainder = sorted(range(len(alive)), key=lambda i: shares[i] - counts[i], reverse=True)
    for i in by_remainder[: size - sum(counts)]:
        counts[i] += 1
    if size >= len(alive):
        _give_each_one(counts, shares)
    split.update({node.tag: count for node, count in zip(alive, counts)})
    return split


def _give_each_one(counts: list[int], shares: list[float]) -> None:
    """Move one from the node most over its share to each node left with none."""
    for empty in [i for i, count in enumerate(counts) if count == 0]:
        donor = max((i for i, count in enumerate(counts) if count > 1), key=lambda i: counts[i] - shares[i])
        counts[donor] -= 1
        counts[empty] += 1
