"""Sandbox and snapshot ids, and the node tag a cluster node's ids carry.

On one host an id is ``sb-<12 hex>``; an engine given a node tag (``FANFOLD_NODE_TAG``, set by the
cluster layer for each node) mints ``sb-<tag>-<12 hex>``, so a cluster client routes any id to the
node that holds it without asking. Imports nothing else of fanfold.
"""

from __future__ import annotations

import re
import secrets

SANDBOX = "sb-"
SNAPSHOT = "snap-"
GROUP = "grp-"
GROUP_SNAPSHOT = "gsnap-"
_TAG = re.compile(r"^[a-z0-9]{1,12}$")
_ID = re.compile(r"^(?:sb|snap|grp|gsnap)-(?:(?P<tag>[a-z0-9]{1,12})-)?[0-9a-f]{12}$")


def check_node_tag(tag: str | None) -> str | None:
    """``tag`` if it is 1-12 lowercase letters and digits (or None), else ValueError."""
    if tag is not None and not _TAG.match(tag):
        raise ValueError(f"node tag {tag!r} must be 1-12 lowercase letters and digits")
    return tag


def new_id(prefix: str, node_tag: str | None = None, shard: tuple[int, int] | None = None) -> str:
    """A fresh id: ``prefix`` + (``node_tag-``) + 12 random hex digits; with ``shard`` (index, count),
    digits that ``shard_of`` maps to that index."""
    number = secrets.randbits(48)
    if shard is not None:
        index, count = shard
        number = number // count * count + index
        if number >= 1 << 48:
            number -= count
    digits = f"{number:012x}"
    return f"{prefix}{node_tag}-{digits}" if node_tag else prefix + digits


def shard_of(any_id: str, count: int) -> int:
    """Which of ``count`` engine workers holds a sandbox: its id's random digits modulo ``count``
    (0 for what is not an id, whose calls then fail there as for any unknown id)."""
    match = _ID.match(any_id) if isinstance(any_id, str) else None
    return int(any_id[-12:], 16) % count if match else 0


def node_of(any_id: str) -> str | None:
    """The node tag a sandbox or snapshot id carries, or None (a single host's id, or not an id)."""
    match = _ID.match(any_id) if isinstance(any_id, str) else None
    return match["tag"] if match else None


def is_snapshot_id(text: object) -> bool:
    """Whether ``text`` is a snapshot id (``snap-…``, with or without a node tag), not a name."""
    return isinstance(text, str) and text.startswith(SNAPSHOT) and _ID.match(text) is not None
