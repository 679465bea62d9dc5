"""skopeo and containers/storage at fanfold's edge: how they are invoked, and their errors mapped.

skopeo (containers/image) fetches, authenticates, verifies digests and resolves multi-arch
indexes; its ``containers-storage:`` transport unpacks layers safely into a storage root fanfold
owns (overlay driver, whiteouts as 0/0 char devices, opaque dirs as xattrs). Every failure of
either is turned into a FanfoldError here, in one place.
"""

from __future__ import annotations

import asyncio
import bz2
import fcntl
import gzip
import hashlib
import json
import lzma
import os
import platform as host_platform
import pty
import re
import struct
import tarfile
import termios
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from ..config import PULL_STALL_S, env_insecure_registries, env_pull_stall_s, env_registry_auth, env_registry_certs
from ..errors import (
    HostNotReady, ImageCorrupt, ImageNotFound, InfrastructureError, InvalidRequest, RegistryDenied, RegistryUnavailable,
)
from ..host import spawn
from ..refs import DOMAIN, split_ref

ARCHES = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x"}
TIMEOUT_S = 3600.0
"""The longest one skopeo call may take (a copy of many GB over a slow link); a stalled one is killed then."""


@dataclass(frozen=True)
class Ref:
    """A parsed image reference: ``registry`` is the host (``docker.io`` when none is written)."""

    text: str
    registry: str
    repository: str
    tag: str | None
    digest: str | None


def parse_ref(text: str) -> Ref:
    """Parse ``python:3.12-slim``, ``host:5000/env@sha256:...``; InvalidRequest if it is not a reference."""
    parts = split_ref(text)
    if parts is None:
        raise InvalidRequest(
            f"{text!r} is not an image reference: write NAME[:TAG][@sha256:DIGEST], e.g. python:3.12-slim"
            " or registry.example.com:5000/team/env@sha256:<64 hex> (repository names are lower case;"
            " a registry host has a dot or a port)"
        )
    domain, path, tag, digest = parts
    if domain is None:
        domain, path = "docker.io", path if "/" in path else f"library/{path}"
    return Ref(text, domain, path, tag, digest)


def is_registry_host(text: str) -> bool:
    """``ghcr.io``, ``localhost:5000``, ``127.0.0.1:5000``: what ``fanfold login`` takes."""
    return re.fullmatch(DOMAIN, text) is not None


def parse_platform(text: str | None) -> tuple[str, str, str]:
    """``os/arch[/variant]`` (default: this host's) as (os, arch, variant)."""
    if text is None:
        return "linux", ARCHES.get(host_platform.machine(), host_platform.machine()), ""
    parts = text.split("/")
    if len(parts) not in (2, 3) or not all(re.fullmatch(r"[a-z0-9_]+", p) for p in parts):
        raise InvalidRequest(f"platform {text!r} is not OS/ARCH[/VARIANT], e.g. linux/amd64 or linux/arm64/v8")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else ""


@dataclass(frozen=True, kw_only=True)
class Options:
    """How skopeo talks to registries: credentials, TLS and the certificate dirs (``fanfold.config``'s ``env_*``)."""

    auth_file: Path
    insecure: frozenset[str] = frozenset()
    """``host:port`` of registries reached without TLS verification (``FANFOLD_INSECURE_REGISTRIES``)."""
    certs_dir: Path | None = None
    """A dir laid out like ``/etc/containers/certs.d``: ``<host:port>/ca.crt`` (``FANFOLD_REGISTRY_CERTS``)."""
    stall_s: float = PULL_STALL_S
    """How long a registry may send nothing (a request unanswered, a blob stopped mid-way) before the
    pull fails with RegistryUnavailable (``FANFOLD_PULL_STALL_S``)."""

    @classmethod
    def from_env(cls, state_dir: Path) -> Options:
        return cls(auth_file=env_registry_auth() or state_dir / "auth.json", insecure=env_insecure_registries(),
                   certs_dir=env_registry_certs(), stall_s=env_pull_stall_s())

    def flags(self, registry: str, tls_verify: bool | None, *, anonymous: bool = False) -> list[str]:
        """``--tls-verify``, ``--authfile`` and ``--cert-dir`` for one registry (``copy`` takes them as ``--src-...``)."""
        verify = tls_verify if tls_verify is not None else registry not in self.insecure
        auth = self.auth_file.with_name("anonymous-auth.json") if anonymous else self.auth_file
        if anonymous and not auth.exists():  # no logins: skopeo reaches the registry as nobody
            auth.write_text('{"auths": {}}')
        flags = [f"--tls-verify={'true' if verify else 'false'}", f"--authfile={auth}"]
        if self.certs_dir is not None and (self.certs_dir / registry).is_dir():
            flags.append(f"--cert-dir={self.certs_dir / registry}")
        return flags


class Storage:
    """The containers/storage root fanfold owns: graphroot ``<state>/storage``, runroot ``<state>/storage-run``."""

    def __init__(self, state_dir: Path) -> None:
        self.graphroot = state_dir / "storage"
        self.runroot = state_dir / "storage-run"
        self.graphroot.mkdir(parents=True, exist_ok=True)
        self.runroot.mkdir(parents=True, exist_ok=True)

    def transport(self, name: str = "") -> str:
        # skip_mount_home: otherwise containers/storage bind-mounts <graphroot>/overlay on itself, and leaks it.
        return f"containers-storage:[overlay@{self.graphroot}+{self.runroot}:overlay.skip_mount_home=true]{name}"

    def diff_dir(self, layer_id: str) -> Path:
        return self.graphroot / "overlay" / layer_id / "diff"

    async def cli(self, *args: str) -> bytes:
        """Run the ``containers-storage`` tool on this root; its stdout."""
        try:
            done = await spawn.run(["containers-storage", "-g", str(self.graphroot), "-R", str(self.runroot),
                                    "-s", "overlay", "--storage-opt", "overlay.skip_mount_home=true", *args],
                                   timeout=300, env=tool_env())
        except FileNotFoundError:
            raise HostNotReady("the containers-storage tool is missing: apt-get install containers-storage") from None
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip()[-500:]
            raise InfrastructureError(f"containers-storage {' '.join(args[:2])} on {self.graphroot} failed: {said}")
        return done.stdout

    async def images(self) -> list[dict]:
        return json.loads(await self.cli("images", "--json") or b"[]") or []

    async def layers(self) -> list[dict]:
        return json.loads(await self.cli("layers", "--json") or b"[]") or []


def tool_env() -> dict[str, str]:
    """The environment of skopeo and containers-storage: this process's, less every place
    containers/image looks for credentials or config of the user running fanfold (``~/.docker``,
    ``~/.config/containers``, ``/run/containers/UID``): only ``--authfile`` counts."""
    env = {k: v for k, v in os.environ.items() if k not in ("DOCKER_CONFIG", "REGISTRY_AUTH_FILE", "CONTAINERS_CONF",
                                                            "CONTAINERS_REGISTRIES_CONF", "CONTAINERS_STORAGE_CONF")}
    env.update(HOME=NO_HOME, XDG_CONFIG_HOME=NO_HOME, XDG_RUNTIME_DIR=NO_HOME)
    return env


NO_HOME = "/nonexistent/fanfold"
"""A home with nothing in it, for the tools (it never exists)."""


class Route(Protocol):
    """How a tool (skopeo, git) goes out when not straight from the host (a server tenant's fetch:
    ``fanfold.net.outbound``)."""

    fds: dict[int, int]
    """Descriptors the wrapped command needs (child fd -> ours)."""

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as run on this route."""

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """The tools' environment on this route."""


async def skopeo(args: list[str], *, registry: str, file: bool = False, fds: dict[int, int] | None = None,
                 timeout: float = TIMEOUT_S, route: Route | None = None) -> bytes:
    """Run skopeo (on ``route``, when given); its stdout, or its failure as a FanfoldError about
    ``registry`` (a path, with ``file``)."""
    argv, env = ["skopeo", *args], tool_env()
    if route is not None:
        argv, env, fds = route.command(argv), route.environment(env), {**(fds or {}), **route.fds}
    try:
        done = await spawn.run(argv, fds=fds, timeout=timeout, env=env)
    except FileNotFoundError:
        raise HostNotReady("skopeo is missing, needed for images from registries and files: apt-get install skopeo") from None
    except asyncio.TimeoutError:
        raise RegistryUnavailable(f"{registry} did not finish within {timeout:.0f}s; nothing was kept, try again") from None
    if done.returncode != 0:
        raise map_error(done.stderr.decode(errors="replace"), registry, file=file)
    return done.stdout


# skopeo draws a bar per blob when stdout is a terminal: "Copying blob 3892abe6c6b5 [===>--] 7.1MiB / 95.4MiB",
# then "Copying blob 3892abe6c6b5 done" or "... skipped: already exists".
_BAR = re.compile(rb"Copying blob ([0-9a-f]{12}) (?:\[[^\]]*\] ([\d.]+)([KMGT]?i?B|b) / [\d.]+\S+|(done|skipped))")
_UNITS = {b"b": 1, b"B": 1, b"KiB": 1 << 10, b"MiB": 1 << 20, b"GiB": 1 << 30, b"TiB": 1 << 40}
OnBlob = Callable[[str, int, bool], None]
"""Progress of one blob: (first 12 hex of its digest, bytes so far, finished)."""


async def skopeo_copy(args: list[str], *, registry: str, file: bool, on_blob: OnBlob, route: Route | None = None,
                      stall_s: float = PULL_STALL_S) -> None:
    """``skopeo copy`` with its stdout on a pseudo-terminal, so it draws progress bars; each bar's state goes to ``on_blob``.

    While no blob has begun or one is still coming, a registry that sends no byte for ``stall_s``
    fails the copy with RegistryUnavailable (skopeo would wait on a silent connection for ever);
    once every blob is in, skopeo's own work (unpacking) may take as long as it takes."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # wide enough for whole lines
    os.set_blocking(master, False)
    loop = asyncio.get_running_loop()
    pending = b""
    blobs: dict[bytes, tuple[int, bool]] = {}
    moved = loop.time()

    def readable() -> None:
        nonlocal pending, moved
        try:
            data = os.read(master, 65536)
        except (BlockingIOError, OSError):  # EIO once skopeo has exited
            return
        *lines, pending = re.split(rb"[\r\n]+", pending + data)
        for line in lines:
            for match in _BAR.finditer(line):
                short, amount, unit, end = match.groups()
                size = int(float(amount) * _UNITS.get(unit, 1)) if amount else 0
                if blobs.get(short) != (size, end is not None):  # a redraw with the same count is no progress
                    blobs[short] = (size, end is not None)
                    moved = loop.time()
                on_blob(short.decode(), size, end is not None)

    def stalled() -> bool:
        waiting = not blobs or not all(done for _, done in blobs.values())
        return waiting and loop.time() - moved > stall_s

    loop.add_reader(master, readable)
    copying = asyncio.ensure_future(skopeo(args, registry=registry, file=file, fds={1: slave}, route=route))
    try:
        while not (await asyncio.wait({copying}, timeout=min(1.0, stall_s)))[0]:
            if stalled():
                raise RegistryUnavailable(f"{registry} sent nothing for {stall_s:.0f}s in the middle of a pull;"
                                          " nothing was kept, try again")
        await copying
    finally:
        if not copying.done():  # a stall, or the pull was cancelled: skopeo is killed before we go on
            copying.cancel()
            await asyncio.gather(copying, return_exceptions=True)
        loop.remove_reader(master)
        os.close(master)
        os.close(slave)


_DENIED = re.compile(r"unauthorized|authentication required|\b401\b|\bdenied\b|invalid username/password")
_NOT_FOUND = re.compile(r"manifest unknown|name unknown|\bnot found\b|\b404\b|no such image")
_UNREACHED = re.compile(
    r"no such host|connection refused|network is unreachable|no route to host|server misbehaving"
    r"|temporary failure in name resolution|dial tcp[^\n]*i/o timeout|proxyconnect"
)
_UNAVAILABLE = re.compile(
    r"connection reset|\beof\b|timeout|\b50[0-4]\b|internal server error|bad gateway"
    r"|service unavailable|broken pipe|unexpected end|too many requests|\b429\b"
)


def map_error(stderr: str, registry: str, *, file: bool = False) -> Exception:
    """skopeo's stderr as the FanfoldError it means; the tail of the message says what skopeo said."""
    said = _tail(stderr)
    low = stderr.lower()
    if file and "digest" not in low:
        return ImageCorrupt(f"{registry} could not be read as an image, so nothing was stored: {said}")
    mismatch = "digest" in low and ("did not match" in low or "mismatch" in low or "does not match" in low)
    if mismatch or "gzip: invalid" in low or "flate: corrupt" in low:  # whichever check a damaged blob trips first
        return ImageCorrupt(f"a blob from {registry} does not match its digest (damaged in the registry or on the way),"
                            f" so nothing was stored: {said}")
    if "invalid tar header" in low or "archive/tar" in low:
        return ImageCorrupt(f"a layer from {registry} is not a valid tar: {said}")
    if "x509:" in low or ("certificate" in low and "tls" in low):
        return InvalidRequest(
            f"{registry}'s TLS certificate is not trusted: put its CA in $FANFOLD_REGISTRY_CERTS/{registry}/ca.crt,"
            f" or list it in FANFOLD_INSECURE_REGISTRIES if it has no TLS: {said}"
        )
    if "server gave http response to https client" in low:
        return InvalidRequest(f"{registry} speaks plain HTTP: list it in FANFOLD_INSECURE_REGISTRIES"
                              f": {said}")
    if _DENIED.search(low):
        return RegistryDenied(
            f"{registry} refused access: log in with `fanfold login {registry}`, or point FANFOLD_REGISTRY_AUTH at a"
            f" Docker config.json holding credentials for it: {said}"
        )
    if _NOT_FOUND.search(low):
        return ImageNotFound(f"{registry} has no such image (check the name, tag or digest): {said}")
    if _UNREACHED.search(low):
        return RegistryUnavailable(f"{registry} could not be reached; nothing was kept, try again: {said}",
                                   reached=False)
    if _UNAVAILABLE.search(low):
        return RegistryUnavailable(f"{registry} did not answer or broke off; nothing was kept, try again: {said}")
    return RegistryUnavailable(f"pulling from {registry} failed; nothing was kept, try again: {said}")


def _tail(stderr: str) -> str:
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    text = lines[-1] if lines else "(no output)"
    text = re.sub(r'^time="[^"]*" level=\w+ msg="(.*)"$', r"\1", text).replace('\\"', '"')
    text = re.sub(r'^Error parsing image name "[^"]*": ', "", text)  # containers/image's preamble, not the cause
    text = re.sub(r'storing blob to file "[^"]*": ', "", text)
    return text[-400:]


def chain_ids(diff_ids: list[str]) -> list[str]:
    """containers/storage's layer ids (as containers/image names them): the first layer's diff id,
    then sha256 of ``parent id + "+" + diff id`` (hex), so a layer's id names its whole stack."""
    chain = [diff_ids[0].removeprefix("sha256:")]
    for diff_id in diff_ids[1:]:
        chain.append(hashlib.sha256(f"{chain[-1]}+{diff_id.removeprefix('sha256:')}".encode()).hexdigest())
    return chain


def choose_platform(manifests: list[dict], platform: tuple[str, str, str]) -> str | None:
    """The digest of the index entry for ``platform`` (os, arch, variant), as containers/image picks it."""
    os_, arch, variant = platform
    fits = [m for m in manifests if (m.get("platform") or {}).get("os") == os_
            and (m.get("platform") or {}).get("architecture") == arch]
    exact = [m for m in fits if not variant or (m.get("platform") or {}).get("variant") == variant]
    return (exact or fits or [{}])[0].get("digest")


def file_transport(path: Path, ref: str | None = None) -> str:
    """What skopeo reads ``path`` as: ``oci:DIR``, ``oci-archive:FILE`` or ``docker-archive:FILE``; an OCI
    layout holding several images needs ``ref`` to name one (its tag, or its whole ``ref.name``)."""
    if path.is_dir():
        if not (path / "oci-layout").is_file():
            raise InvalidRequest(f"{path} is a directory but not an OCI image layout (it has no oci-layout file)")
        return f"oci:{path}" + _pick(path, (path / "index.json").read_bytes(), ref)
    if not path.is_file():
        raise InvalidRequest(f"no such file: {path}")
    try:
        with tarfile.open(path, "r:*") as tar:
            members = {member.name.removeprefix("./"): member for member in tar}
            index = tar.extractfile(members["index.json"]).read() if "index.json" in members else b"{}"
    except (tarfile.TarError, OSError, EOFError) as err:
        raise InvalidRequest(f"{path} is not an image archive: neither a tar from `docker save` nor an OCI archive"
                             f" ({type(err).__name__})") from None
    if "oci-layout" in members:
        return f"oci-archive:{path}" + _pick(path, index, ref)
    if "manifest.json" in members:
        return f"docker-archive:{path}"
    raise InvalidRequest(f"{path} is a tar but holds no image: neither manifest.json (docker save) nor oci-layout (OCI)")


def _pick(path: Path, index: bytes, ref: str | None) -> str:
    """``:NAME`` choosing one image of an OCI layout's index, or nothing when it holds one."""
    try:
        manifests = json.loads(index).get("manifests") or []
    except (ValueError, AttributeError):
        raise ImageCorrupt(f"{path}: index.json is not valid JSON") from None
    if len(manifests) <= 1:
        return ""
    names = [(m.get("annotations") or {}).get("org.opencontainers.image.ref.name", "") for m in manifests]
    for name in names:
        if ref and name and (name == ref or name == ref.rsplit(":", 1)[-1]):
            return f":{name}"
    raise InvalidRequest(f"{path} holds {len(manifests)} images ({', '.join(n or '(unnamed)' for n in names)}):"
                         " pass the one to import as ref=")


MAX_UNPACKED = 64 << 30
"""The most a compressed ``docker save`` file may expand to (a bomb must not fill the state disk)."""


def decompress(path: Path, out: Path, limit: int = MAX_UNPACKED) -> bool:
    """Write ``path`` decompressed to ``out`` if it is gzip, bzip2 or xz; whether it was.
    More than ``limit`` bytes out is an ``InvalidRequest`` (``out`` is then the caller's to remove)."""
    with open(path, "rb") as handle:
        magic = handle.read(6)
    for prefix, opener in ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ", lzma.open)):
        if magic.startswith(prefix):
            written = 0
            with opener(path, "rb") as source, open(out, "wb") as target:
                while chunk := source.read(1 << 20):
                    written += len(chunk)
                    if written > limit:
                        raise InvalidRequest(f"{path.name} expands past {limit >> 30} GiB: not importing it")
                    target.write(chunk)
            return True
    return False
