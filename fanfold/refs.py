"""Names of images and bases, checked without importing anything else of fanfold: what a spec's base,
a create's image and a Dockerfile's FROM may be."""

from __future__ import annotations

import re

BASES = ("host", "debian:bookworm")
"""Bases fanfold makes itself; any other base is an image reference or a local image id."""
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The PATH of build steps and commands on fanfold's own bases."""

# An image reference as the distribution project's grammar has it: [domain[:port]/]path[:tag][@digest].
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_REFERENCE = re.compile(
    rf"^(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
_IMAGE_ID = re.compile(r"^img-[0-9a-f]{16}$")


def is_image_id(text: str) -> bool:
    """True for a local image's id (``img-`` and 16 hex digits)."""
    return isinstance(text, str) and bool(_IMAGE_ID.match(text))


def is_image_ref(text: str) -> bool:
    """True for a registry reference (``python:3.12-slim``, ``ghcr.io/org/env@sha256:...``,
    ``localhost:5000/env:v1``) that is neither a fanfold base nor a local image id."""
    if not isinstance(text, str) or text in BASES or is_image_id(text) or len(text) > 512:
        return False
    match = _REFERENCE.match(text)
    if match is None:
        return False
    name = f"{match['domain']}/{match['path']}" if match["domain"] else match["path"]
    return len(name) <= 255  # the distribution spec's limit on a repository's whole name
