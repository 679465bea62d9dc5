"""What a state dir's engines hold on the host, counted: the leak check of the tests, benches and soak.

Every kind of thing an engine makes and must release is counted here, under one name each:
mounts, cgroups, runtime containers, agent processes, network namespaces, nftables tables,
uid-range claims and CRIU page-server daemons. Once every engine of a state dir has closed,
each count must be 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from ..config import EngineConfig
from . import cgroups, idmap, mounts, procs

NETNS_DIR = Path("/run/netns")
CLAIM_SETTLE_S = 3.0
KINDS = ("mounts", "cgroups", "containers", "agents", "netns", "nft_tables", "uid_claims", "page_servers")


def census(config: EngineConfig, *, claims_before: frozenset[str] = frozenset()) -> dict[str, int]:
    """How many of each kind this state dir's engines still hold (``KINDS``, in that order).

    uid-range claims are host-wide, not per state dir: those counted are the orphans (a claim
    whose sandbox has no cgroup under any engine on this host, or half a claim) that are not in
    ``claims_before``, what was already orphaned before the caller began, and that stay orphans
    for a moment (``lasting_orphan_claims``).
    """
    runtime_root = config.run_dir / config.runtime
    return {
        "mounts": sum(len(mounts.mounts_under(config.state_dir / part)) for part in ("sandboxes", "groups")),
        "cgroups": len(cgroups.leftover_ids(config.cgroup_parent)),
        "containers": len(list(runtime_root.iterdir())) if runtime_root.is_dir() else 0,
        "agents": len(agent_pids(config)),
        "netns": len(named_netns(config)) + len(held_netns()),
        "nft_tables": len(nft_tables(config)),
        "uid_claims": len(lasting_orphan_claims(claims_before)),
        "page_servers": len(page_servers(config)),
    }


def agent_pids(config: EngineConfig) -> list[int]:
    """Host pids of this state dir's agents: a binary named ``agent`` started with ``--listen``, in
    one of its cgroups."""
    found = []
    for pid, argv in processes():
        if argv and argv[0].endswith(b"agent") and b"--listen" in argv:
            try:
                ours = config.cgroup_parent in Path(f"/proc/{pid}/cgroup").read_text()
            except OSError:
                continue
            if ours:
                found.append(pid)
    return found


def named_netns(config: EngineConfig) -> list[str]:
    """Network namespaces of this state dir pinned under /run/netns (build networks carry its tag)."""
    try:
        return sorted(name for name in os.listdir(NETNS_DIR) if name.startswith(f"fanfold-{config.tag}-"))
    except FileNotFoundError:
        return []


def held_netns(pid: int | str = "self") -> list[str]:
    """Network namespaces other than its own that process ``pid`` holds an fd of (one an engine of
    this process opened for a sandbox and never closed)."""
    try:
        own = os.readlink(f"/proc/{pid}/ns/net")
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    held = set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own fd among them)
        if target.startswith("net:[") and target != own:
            held.add(target)
    return sorted(held)


def nft_tables(config: EngineConfig) -> list[str]:
    """The host's nftables tables named after this state dir (``fanfold_TAG_...``); none without nft."""
    nft = shutil.which("nft")
    if nft is None:
        return []
    done = subprocess.run([nft, "-j", "list", "tables"], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        return []
    prefix = f"fanfold_{config.tag}_"
    tables = [item["table"] for item in json.loads(done.stdout or "{}").get("nftables", []) if "table" in item]
    return sorted(f"{t['family']} {t['name']}" for t in tables if t.get("name", "").startswith(prefix))


def orphan_claims(claims: Path = idmap.CLAIMS) -> set[str]:
    """uid-range claims (host-wide) whose sandbox has no cgroup under any engine of this host, and
    halves of a claim: a slot's link without its ``by-id`` twin or the other way round."""
    try:
        slots = {name: os.readlink(claims / name) for name in os.listdir(claims) if name.isdigit()}
    except FileNotFoundError:
        return set()
    try:
        by_id = {name: os.readlink(claims / "by-id" / name) for name in os.listdir(claims / "by-id")}
    except FileNotFoundError:
        by_id = {}
    live = _sandboxes_with_cgroups()
    orphans = {f"slot {slot} -> {sandbox}" for slot, sandbox in slots.items()
               if sandbox not in live or by_id.get(sandbox) != slot}
    orphans |= {f"by-id {sandbox} -> {slot}" for sandbox, slot in by_id.items()
                if sandbox not in live or slots.get(slot) != sandbox}
    return orphans


def lasting_orphan_claims(claims_before: frozenset[str] = frozenset(), settle_s: float = CLAIM_SETTLE_S) -> set[str]:
    """Orphan claims not in ``claims_before`` that stay orphans for ``settle_s``: a claim is made just
    before its sandbox's cgroup and released just after it goes, so an engine of another state dir
    creating or releasing a sandbox meanwhile holds one for a moment."""
    orphans = orphan_claims() - claims_before
    give_up = time.monotonic() + settle_s
    while orphans and time.monotonic() < give_up:
        time.sleep(0.1)
        orphans &= orphan_claims()
    return orphans


def page_servers(config: EngineConfig) -> list[int]:
    """Pids of CRIU ``lazy-pages`` daemons serving a restore of this state dir."""
    root = str(config.state_dir).encode()
    found = []
    for pid, argv in processes():
        if b"lazy-pages" in argv and any(arg == root or arg.startswith(root + b"/") for arg in argv):
            found.append(pid)
    return found


def _sandboxes_with_cgroups() -> set[str]:
    """Sandbox ids that have a cgroup under any engine's parent (``fanfold-*``), in any hierarchy."""
    parents: set[str] = set()
    for top in cgroups.sandbox_dirs(""):  # the hierarchies' roots
        try:
            parents.update(p.name for p in top.iterdir() if p.name.startswith("fanfold-"))
        except OSError:
            continue
    found: set[str] = set()
    for parent in parents:
        found |= cgroups.leftover_ids(parent)
    return found


def processes() -> list[tuple[int, list[bytes]]]:
    """Every live process's pid and argv (kernel threads, with none, left out)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or not procs.running(name):
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0]:
            found.append((int(name), argv[:-1] if argv[-1] == b"" else argv))
    return found
