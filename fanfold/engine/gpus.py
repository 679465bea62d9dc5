"""GPUs as a resource the engine schedules: which GPUs a sandbox gets, and how many share one.

Each GPU has ``EngineConfig.gpu_shares`` shares. A sandbox that asks for GPUs takes one share of
each GPU it gets (time-sliced with the others there, or through an MPS daemon where one runs), or
all of them with ``gpu_exclusive``. A count goes to the GPUs with the most shares free. The
database is the ledger: a sandbox's row names its GPUs (``gpu_ids``), and the choice and the row's
insert happen in one write transaction (``claim``), so engines sharing a state dir never give out
more shares than a GPU has. A create short of shares waits in admission like one short of memory.
"""

from __future__ import annotations

import json
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ..config import EngineConfig
from ..errors import CapacityExceeded, InvalidRequest
from ..host import gpus as hostgpus
from ..host.cdi import Edits, Mount
from ..host.gpus import GpuHost
from ..models import Limits
from . import db as dbmod

MPS_PATH = "/run/nvidia-mps"
"""Where a shared GPU sandbox finds the MPS daemon's pipe directory."""


@dataclass(frozen=True)
class Slots:
    """One GPU's shares: how many it has and how many its sandboxes (warm ones too) hold."""

    id: str
    index: int
    names: frozenset[str]
    """Every name that picks it in ``gpus=device=...``: its index, UUID and CDI names."""
    shares: int
    used: int


def pick(gpus: Sequence[Slots], asked: str, exclusive: bool) -> list[str] | None:
    """The ids of the GPUs a sandbox asking ``asked`` (``Limits.gpus``' written form) gets now, or None when
    their shares are taken: ``exclusive`` takes all of a GPU's; a count goes to those with the most free."""
    fits = [gpu for gpu in gpus if gpu.used + (gpu.shares if exclusive else 1) <= gpu.shares]
    if asked == "all":
        wanted = list(gpus)
    elif asked.startswith("device="):
        wanted = [gpu for name in asked.removeprefix("device=").split(",") for gpu in gpus if name in gpu.names]
    else:
        fits.sort(key=lambda gpu: (gpu.used - gpu.shares, gpu.index))
        wanted = fits[:int(asked)] if len(fits) >= int(asked) else []
    if not wanted or any(gpu not in fits for gpu in wanted):
        return None
    return [gpu.id for gpu in wanted]


class Gpus:
    def __init__(self, config: EngineConfig, db: dbmod.Database) -> None:
        self.config = config
        self.db = db
        self._host: GpuHost | None = None

    def host(self) -> GpuHost:
        """The host's GPUs, found at the first call that needs them (a host without any pays nothing)."""
        if self._host is None:
            cfg = self.config
            self._host = hostgpus.discover(cdi_dirs=cfg.gpu_cdi_dirs, cdi_kind=cfg.gpu_cdi_kind, dev_dir=cfg.gpu_dev_dir,
                                           proc_dir=cfg.gpu_proc_dir, driver_dirs=cfg.gpu_driver_dirs)
        return self._host

    # -- what a request means -------------------------------------------------------------------

    def check(self, limits: Limits) -> None:
        """InvalidRequest when this host could never give ``limits.gpus``, whatever else ran."""
        asked = limits.gpus
        if asked is None:
            return
        host = self.host()
        if not host.gpus:
            raise InvalidRequest(f"limit gpus={asked}: this host has no GPU ({host.source}); create the sandbox"
                                 " without gpus, or on a host with GPUs")
        if asked.isdigit() and int(asked) > len(host.gpus):
            raise InvalidRequest(f"limit gpus={asked} is more than this host's {len(host.gpus)} GPUs:"
                                 f" ask for at most {len(host.gpus)}")
        if asked.startswith("device="):
            for name in asked.removeprefix("device=").split(","):
                if host.find(name) is None:
                    known = ", ".join(gpu.id for gpu in host.gpus)
                    raise InvalidRequest(f"limit gpus={asked}: this host has no GPU {name!r}; its GPUs: {known}"
                                         " (or their indexes)")

    def count(self, limits: Limits) -> int:
        """How many GPUs ``limits`` asks for on this host."""
        asked = limits.gpus
        if asked is None:
            return 0
        if asked == "all":
            return len(self.host().gpus)
        return int(asked) if asked.isdigit() else len(asked.split(","))

    def weight(self, limits: Limits) -> float:
        """GPUs' worth a sandbox with ``limits`` holds, for quotas: 1 a GPU held alone, ``1/gpu_shares`` shared."""
        return self.count(limits) * (1.0 if limits.gpu_exclusive else 1.0 / self.config.gpu_shares)

    def row_weight(self, row: Any) -> float:
        ids = json.loads(row["gpu_ids"])
        if not ids:
            return 0.0
        exclusive = json.loads(row["limits"]).get("gpu_exclusive", False)
        return len(ids) * (1.0 if exclusive else 1.0 / self.config.gpu_shares)

    # -- who holds what -------------------------------------------------------------------------

    def used(self) -> Counter[str]:
        """Shares taken of each GPU, by every sandbox with a row (warm and dying ones too)."""
        used: Counter[str] = Counter()
        for ids, limits in self.db.gpu_holders():
            take = self.config.gpu_shares if json.loads(limits).get("gpu_exclusive") else 1
            for gpu_id in json.loads(ids):
                used[gpu_id] += take
        return used

    def choose(self, limits: Limits, used: Counter[str]) -> list[str] | None:
        """The GPUs a sandbox with ``limits`` gets given the shares ``used``, or None when they are taken."""
        slots = [Slots(gpu.id, gpu.index, frozenset(gpu.names), self.config.gpu_shares, used[gpu.id])
                 for gpu in self.host().gpus]
        return pick(slots, limits.gpus or "", limits.gpu_exclusive)

    def shortage(self, limits: Limits) -> str | None:
        """What this host lacks to give ``limits.gpus`` now, or None."""
        if limits.gpus is None or self.choose(limits, self.used()) is not None:
            return None
        how = "alone" if limits.gpu_exclusive else f"as one of up to {self.config.gpu_shares} sandboxes a GPU"
        return f"no GPUs free for gpus={limits.gpus} {how} (in use: {self._in_use()})"

    def _in_use(self) -> str:
        used = self.used()
        return ", ".join(f"{gpu.id} {used[gpu.id]}/{self.config.gpu_shares} shares" for gpu in self.host().gpus)

    @contextmanager
    def claim(self, limits: Limits) -> Iterator[list[str]]:
        """The GPUs a new sandbox gets, within a write transaction its row's insert joins (no await inside);
        CapacityExceeded when they are taken."""
        if limits.gpus is None:
            yield []
            return
        with self.db.exclusive():
            chosen = self.choose(limits, self.used())
            if chosen is None:
                raise CapacityExceeded(f"the host cannot hold another sandbox: {self.shortage(limits)}")
            yield chosen

    # -- what a sandbox with GPUs gets ----------------------------------------------------------

    def edits(self, gpu_ids: list[str], limits: Limits) -> Edits | None:
        """Device nodes, driver files and hooks for a sandbox holding ``gpu_ids``; None for none."""
        if not gpu_ids:
            return None
        edits = self.host().edits(gpu_ids)
        if self.config.gpu_mps_dir and not limits.gpu_exclusive:
            edits = edits + Edits(mounts=(Mount(self.config.gpu_mps_dir, MPS_PATH, ("rw", "nosuid", "nodev", "bind")),),
                                  env=(f"CUDA_MPS_PIPE_DIRECTORY={MPS_PATH}",))
        return edits

    def env(self, gpu_ids: list[str], limits: Limits, image_env: dict[str, str], default_path: str) -> dict[str, str]:
        """The variables a sandbox holding ``gpu_ids`` runs with (PATH and LD_LIBRARY_PATH before the image's)."""
        edits = self.edits(gpu_ids, limits)
        if edits is None:
            return {}
        return hostgpus.merged_env(edits, image_env, default_path)
