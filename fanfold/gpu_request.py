"""How a GPU request is written (``Limits.gpus``, ``EnvSpec.gpus``, an image's ``fanfold.gpus`` label),
checked without importing anything else of fanfold: ``all``, a count, ``device=`` and GPU indexes or
UUIDs, ``none``; None leaves it unset."""

from __future__ import annotations

from typing import Any

MAX_GPUS = 1024
NO_GPUS = "none"
"""``gpus`` saying "no GPU" outright, where None leaves it to the image: the engine turns it into None as
it resolves a create's limits, so what runs never holds it."""


def parse(value: Any, *, what: str = "gpus") -> str | None:
    """``value`` in its one written form: ``all``, a count (``"2"``), ``device=ID,...``, ``none``, or None;
    ValueError, its message naming ``what``, when it is no GPU request.

    Takes what Docker's ``--gpus`` does (``all``, ``2``, ``device=0,1``, ``"device=GPU-..."``), an int, a
    list of indexes or UUIDs, ``0``/``none``/False for none outright, and None/``""`` for unset."""
    if value is None:
        return None
    if value is False:
        return NO_GPUS
    if isinstance(value, (list, tuple)):
        value = "device=" + ",".join(str(item) for item in value)
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"{what} must be all, a count or device=ID,..., got {value!r}")
    text = value.strip().strip('"').strip()
    if text == "":
        return None
    if text in ("0", NO_GPUS):
        return NO_GPUS
    if text == "all":
        return text
    if text.isdigit():
        if int(text) > MAX_GPUS:
            raise ValueError(f"{what}={text} is out of range: ask for at most {MAX_GPUS}")
        return str(int(text))
    ids = text.removeprefix("device=").split(",")
    if not text.startswith("device=") and not all(_gpu_id(i) for i in ids):
        raise ValueError(f"{what}={value!r} is not a GPU request: use all, a count (2),"
                         " or device= and GPU indexes or UUIDs (device=0,1)")
    ids = [i.strip() for i in ids]
    bad = [i for i in ids if not _gpu_id(i)]
    if bad or len(ids) > MAX_GPUS or len(set(ids)) != len(ids):
        why = f"{bad[0]!r} is not a GPU index or UUID" if bad else "each GPU may be named once"
        raise ValueError(f"{what}={value!r}: {why} (device=0,1 or device=GPU-<uuid>)")
    return "device=" + ",".join(ids)


def _gpu_id(text: str) -> bool:
    text = text.strip()
    return text.isdigit() or (4 <= len(text) <= 96 and text[:4] in ("GPU-", "MIG-")
                              and all(c.isalnum() or c in "-/" for c in text))


def wanted(value: str | None) -> str | None:
    """What a written ``gpus`` asks of a host: None for no GPU, whether unset or ``none``."""
    return None if value == NO_GPUS else value
