"""Extra CA certificates the operator gives build steps and sandboxes (``FANFOLD_EXTRA_CA_FILE``): a
host whose HTTPS goes through an intercepting proxy trusts that proxy's CA, and an image does not.

At set-up, over the image's layers, goes one more read-only layer of fanfold's (``Trust.layer``):
the image's own system bundle with the extra CAs appended, at the path the image keeps it
(``/etc/ssl/certs/ca-certificates.crt`` when it has none), ``/etc/fanfold/extra-ca.pem`` (those CAs
alone) and ``/etc/fanfold/trust.pem``, a link to the bundle that ``trust_env``'s variables name for
tools that ignore the system's store (pip, requests, Node). Nothing is written into an image's
layers or a sandbox's disk: a step that regenerates the bundle (``update-ca-certificates``) writes
the image's own, and a snapshot carries none of it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import stat
import uuid
from pathlib import Path

from ..errors import FanfoldError, HostNotReady
from ..host import safefs

SYSTEM_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")
"""Where images keep their system CA bundle (Debian, Ubuntu and Alpine; RHEL; others), first found wins."""
EXTRA_CA = "/etc/fanfold/extra-ca.pem"
TRUST_LINK = "/etc/fanfold/trust.pem"
MAX_BUNDLE = 16 << 20


def trust_env() -> dict[str, str]:
    """What points the tools that do not read the system's store at the bundle: Python's ssl where the
    image has no OpenSSL dir, requests, pip, curl, git; Node takes the extra CAs beside its own."""
    env = {name: TRUST_LINK for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE",
                                          "GIT_SSL_CAINFO")}
    env["NODE_EXTRA_CA_CERTS"] = EXTRA_CA
    return env


class Trust:
    """The extra CAs of one file, and the layers made of them (under ``cache_dir``, one per bundle)."""

    def __init__(self, pem: bytes, cache_dir: Path) -> None:
        self.pem = pem.rstrip(b"\n") + b"\n"
        self.cache_dir = cache_dir
        self._stacks: dict[tuple[str, ...], Path] = {}
        """The layer made for each stack of layers (layers never change, so neither does it)."""

    def known(self, stack: tuple[str, ...]) -> Path | None:
        """The layer already made for ``stack`` (its layers and host dirs), or None."""
        return self._stacks.get(stack)

    def layer(self, rootfs: Path, stack: tuple[str, ...]) -> Path:
        """The layer that makes the root mounted at ``rootfs`` (made of ``stack``) trust the extra CAs.
        Blocking: call off the event loop."""
        root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            where, own = _system_bundle(root, rootfs)
        finally:
            os.close(root)
        bundle = (own.rstrip(b"\n") + b"\n" if own.strip() else b"") + self.pem
        key = hashlib.sha256(where.encode() + b"\0" + bundle).hexdigest()[:32]
        layer = self.cache_dir / key
        if not layer.is_dir():
            self._make(layer, rootfs, where, bundle)
        self._stacks[stack] = layer
        return layer

    def _make(self, layer: Path, rootfs: Path, where: str, bundle: bytes) -> None:
        tmp = self.cache_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            for path, data in ((where, bundle), (EXTRA_CA, self.pem)):
                _dirs_like(tmp, rootfs, os.path.dirname(path))
                (tmp / path.lstrip("/")).write_bytes(data)
                os.chmod(tmp / path.lstrip("/"), 0o644)
            (tmp / TRUST_LINK.lstrip("/")).symlink_to(where)  # absolute: resolved in the sandbox's root
            os.chmod(tmp, 0o755)
            # Made as a user namespace's mapped root (a create's set-up), these are that host uid's on
            # disk; a layer's files are uid 0's (the idmapped mount shows them as root inside).
            for top, dirs, files in os.walk(tmp):
                for name in (".", *dirs, *files):
                    os.lchown(os.path.join(top, name), 0, 0)
            try:
                tmp.rename(layer)
            except OSError:  # another process made it meanwhile: the same bytes
                if not layer.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _system_bundle(root: int, rootfs: Path) -> tuple[str, bytes]:
    """The path (links resolved, inside the root) and bytes of the image's system bundle; the usual path
    and nothing when it has none."""
    for path in SYSTEM_BUNDLES:
        try:
            with safefs.opened(root, path, os.O_RDONLY) as fd:
                real = Path(os.readlink(f"/proc/self/fd/{fd}"))
                data = os.read(fd, MAX_BUNDLE)
        except (FanfoldError, OSError):
            continue
        if real.is_relative_to(rootfs):
            return "/" + str(real.relative_to(rootfs)), data
    return SYSTEM_BUNDLES[0], b""


def _dirs_like(tree: Path, rootfs: Path, path: str) -> None:
    """Make ``path``'s directories in ``tree`` with the modes the image gives them: overlayfs shows a
    merged directory with its topmost layer's attributes."""
    current = tree
    current.mkdir(exist_ok=True)
    for part in Path(path).parts[1:]:
        current, image = current / part, rootfs / os.path.relpath(current / part, tree)
        current.mkdir(exist_ok=True)
        try:
            info = os.lstat(image)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode):  # the owner stays root: a root mapped into a user namespace shows another
            os.chmod(current, stat.S_IMODE(info.st_mode))


def load(ca_file: str | None, state_dir: Path) -> Trust | None:
    """The operator's extra CAs (``EngineConfig.extra_ca_file``), or None when there are none; HostNotReady
    when the file is unreadable or holds no certificate. Read again when the file changes."""
    if not ca_file:
        return None
    try:
        info = os.stat(ca_file)
    except OSError as err:
        raise HostNotReady(f"FANFOLD_EXTRA_CA_FILE names {ca_file}, which cannot be read: {err.strerror}") from None
    return _load(ca_file, info.st_mtime_ns, info.st_size, str(state_dir))


@functools.lru_cache(maxsize=8)
def _load(ca_file: str, _mtime: int, _size: int, state_dir: str) -> Trust:
    try:
        pem = Path(ca_file).read_bytes()
    except OSError as err:
        raise HostNotReady(f"FANFOLD_EXTRA_CA_FILE names {ca_file}, which cannot be read: {err.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise HostNotReady(f"FANFOLD_EXTRA_CA_FILE names {ca_file}, which holds no PEM certificate"
                           " (-----BEGIN CERTIFICATE-----)")
    cache = Path(state_dir) / "trust"
    cache.mkdir(mode=0o755, exist_ok=True)
    return Trust(pem, cache)
