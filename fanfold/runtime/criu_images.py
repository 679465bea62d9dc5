"""CRIU images of a sandbox in a user namespace, readied for a restore into another uid range.

CRIU restores a user namespace from the image's ``userns-*.img``: a fork's child would run as
its parent's uids over a root idmapped for its own. ``private_copy`` gives each restore an image
dir of its own (links to the shared files, and that one file rewritten), so the children of one
fork restore at once from one dump.

The image (CRIU 4): magics ``IMG_COMMON`` and ``USERNS``, then one entry: a 32-bit size and a
protobuf ``UsernsEntry`` {``repeated UidGidExtent uid_map = 1; gid_map = 2``}, an extent being
{``uint32 first = 1; lower_first = 2; count = 3``}. Small enough to read and write here.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Iterator

from ..errors import CheckpointFailed

IMG_COMMON, USERNS_MAGIC = 0x54564319, 0x55474906
Extent = tuple[int, int, int]


def has_userns(images: Path) -> bool:
    """Whether the checkpoint in ``images`` is of processes in a user namespace of their own."""
    return any(images.glob("userns-*.img"))


def private_copy(images: Path, dest: Path, base: int) -> Path:
    """``dest`` (on the filesystem of ``images``): hard links to every file of ``images`` but the
    user namespace's, rewritten so the restored root is host uid ``base`` (one extent per map, 0 to
    ``base``, as fanfold makes them). The caller removes it once the restore is done."""
    shutil.rmtree(dest, ignore_errors=True)  # a crashed restore's
    dest.mkdir()
    for entry in os.scandir(images):
        if entry.name.startswith("userns-") and entry.name.endswith(".img"):
            maps = read_maps(Path(entry.path))
            for name, extents in maps.items():
                if len(extents) != 1 or extents[0][0] != 0:
                    raise CheckpointFailed(f"the checkpoint's {name} {extents} is not one range from 0:"
                                           " it was not made by fanfold")
                maps[name] = [(0, base, extents[0][2])]
            write_maps(dest / entry.name, maps)
        else:
            os.link(entry.path, dest / entry.name)
    return dest


def read_maps(path: Path) -> dict[str, list[Extent]]:
    data = path.read_bytes()
    try:
        magic, kind, size = struct.unpack_from("<III", data)
        if (magic, kind) != (IMG_COMMON, USERNS_MAGIC):
            raise ValueError("not a userns image")
        maps: dict[str, list[Extent]] = {"uid_map": [], "gid_map": []}
        for number, extent in _fields(data[12:12 + size]):
            if number in (1, 2) and isinstance(extent, bytes):
                fields = {n: v for n, v in _fields(extent) if isinstance(v, int)}
                maps["uid_map" if number == 1 else "gid_map"].append((fields.get(1, 0), fields.get(2, 0), fields.get(3, 0)))
    except (ValueError, IndexError, struct.error) as err:
        raise CheckpointFailed(f"the checkpoint's user namespace image {path.name} cannot be read: {err}") from None
    return maps


def write_maps(path: Path, maps: dict[str, list[Extent]]) -> None:
    body = bytearray()
    for number, name in ((1, "uid_map"), (2, "gid_map")):
        for first, lower, count in maps[name]:
            extent = b"\x08" + _varint(first) + b"\x10" + _varint(lower) + b"\x18" + _varint(count)
            body += _varint(number << 3 | 2) + _varint(len(extent)) + extent
    path.write_bytes(struct.pack("<III", IMG_COMMON, USERNS_MAGIC, len(body)) + bytes(body))


def _fields(message: bytes) -> Iterator[tuple[int, int | bytes]]:
    at = 0
    while at < len(message):
        key, at = _read_varint(message, at)
        if key & 7 == 0:
            value, at = _read_varint(message, at)
            yield key >> 3, value
        elif key & 7 == 2:
            size, at = _read_varint(message, at)
            yield key >> 3, message[at:at + size]
            at += size
        else:
            raise ValueError(f"wire type {key & 7}")


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)
