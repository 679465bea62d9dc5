"""Names of images and bases, checked without importing anything else of fanfold: what a spec's base,
a create's image and a Dockerfile's FROM may be."""

from __future__ import annotations

import re

BASES = ("host", "debian:bookworm")
"""Bases fanfold makes itself; any other base is an image reference or a local image id."""
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The PATH of build steps and commands on fanfold's own bases."""

# An image reference as the distribution project's grammar has it: [domain[:port]/]path[:tag][@digest].
PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_REFERENCE = re.compile(
    rf"^(?:(?P<domain>{DOMAIN})/)?(?P<path>{PATH_COMPONENT}(?:/{PATH_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
_IMAGE_ID = re.compile(r"^img-[0-9a-f]{16}$")


def is_image_id(text: str) -> bool:
    """True for a local image's id (``img-`` and 16 hex digits)."""
    return isinstance(text, str) and bool(_IMAGE_ID.match(text))


def is_id_shaped(text: str) -> bool:
    """True for a name that looks like a local image id (``img-`` and no registry or path): such a
    name is never pulled from a registry, whether or not it is a well-formed id."""
    return isinstance(text, str) and text.startswith("img-") and "/" not in text


def split_ref(text: str) -> tuple[str | None, str, str | None, str | None] | None:
    """A reference's (registry host or None, repository path, tag, digest), or None when ``text`` is
    not one. As Docker reads it, a first component is a host only with a dot, a port or as
    ``localhost``; else it is part of the (lower-case) path, and the whole name is 255 characters at most."""
    match = _REFERENCE.match(text) if isinstance(text, str) and len(text) <= 512 else None
    if match is None:
        return None
    domain, path = match["domain"], match["path"]
    if domain is not None and "." not in domain and ":" not in domain and domain != "localhost":
        if not re.fullmatch(PATH_COMPONENT, domain):
            return None
        domain, path = None, f"{domain}/{path}"
    if len(f"{domain}/{path}" if domain else path) > 255:
        return None
    return domain, path, match["tag"], match["digest"]


def is_image_ref(text: str) -> bool:
    """True for a registry reference (``python:3.12-slim``, ``ghcr.io/org/env@sha256:...``,
    ``localhost:5000/env:v1``) that is neither a fanfold base nor a local image id."""
    return isinstance(text, str) and text not in BASES and not is_image_id(text) and split_ref(text) is not None
