"""Where a create goes: candidate nodes ranked by headroom and locality, and warm pools split over nodes.

Pure functions over ``NodeLoad`` figures (each node's last ``stats()`` plus this client's creates in
flight), so they are tested without Ray or a network. No node's word is fresh: stats lag by up to a
poll, and other drivers place creates at the same time; hence the random pick between two good
candidates (power of two choices), which keeps drivers that read the same stats from herding.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

LOCALITY_BONUS = 0.3
"""Headroom (as a fraction of a node) that holding the create's image or snapshot is worth: a node
with it wins over one with up to this much more room, since a pull or build costs seconds."""
CPU_WEIGHT = 0.05
"""How much the fraction of CPU left counts beside memory and creating slots."""
CHOICE_MARGIN = 0.1
"""How far under the best score a fitting node may be and still be drawn for the first choice."""


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


def _left(capacity: float, used: float) -> float:
    return (capacity - used) / capacity if capacity > 0 else -1.0


def rank(
    nodes: Iterable[NodeLoad], *, memory_mb: float, cpus: float, source: str | None,
    reserve_mb: float = 256, rng: random.Random | None = None,
) -> list[NodeLoad]:
    """Alive nodes, best first, to try a create on in turn (the next after a ``CapacityExceeded``).

    Nodes the create fits come first: the first of them drawn by power of two choices among those
    within ``CHOICE_MARGIN`` of the best score, the others by score (headroom, plus ``LOCALITY_BONUS``
    on a node holding ``source``). Nodes it does not fit follow, least full first, so that when all
    are full the create queues on the emptiest instead of failing.
    """
    rng = rng or random.Random()
    alive = [node for node in nodes if node.alive]
    fitting = [node for node in alive if node.fits(memory_mb, reserve_mb)]
    full = [node for node in alive if not node.fits(memory_mb, reserve_mb)]

    def score(node: NodeLoad) -> float:
        return node.headroom(memory_mb, cpus) + (LOCALITY_BONUS if node.holds(source) else 0.0)

    fitting.sort(key=score, reverse=True)
    full.sort(key=lambda node: node.headroom(memory_mb, cpus), reverse=True)
    if len(fitting) > 1:
        best = score(fitting[0])
        drawn = [node for node in fitting if score(node) >= best - CHOICE_MARGIN]
        first = _better_of_two(drawn, score, rng)
        fitting.remove(first)
        fitting.insert(0, first)
    return fitting + full


def _better_of_two(nodes: list[NodeLoad], score: Callable[[NodeLoad], float], rng: random.Random) -> NodeLoad:
    if len(nodes) == 1:
        return nodes[0]
    one, other = rng.sample(nodes, 2)
    return other if score(other) > score(one) else one


def split_pool(size: int, nodes: Iterable[NodeLoad]) -> dict[str, int]:
    """A cluster-wide warm pool of ``size`` split over the alive nodes in proportion to their memory
    (largest remainders), at least 1 each when ``size`` reaches the node count; dead nodes get 0."""
    nodes = list(nodes)
    alive = [node for node in nodes if node.alive]
    split = {node.tag: 0 for node in nodes}
    if size <= 0 or not alive:
        return split
    total = sum(max(node.memory_mb, 0) for node in alive)
    shares = [size * (max(node.memory_mb, 0) / total if total > 0 else 1 / len(alive)) for node in alive]
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
