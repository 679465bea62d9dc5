"""The bottom layers: ``host`` (a read-only view of the host's system) and ``debian:bookworm``."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from ..errors import BuildFailed, HostNotReady, ImageNotFound
from ..host import mounts
from ..spec import BASES
from ..store import LayerStore

HOST_SKELETON_VERSION = "host-skeleton-5"
# System files safe to show a sandbox: nothing with secrets (no shadow, ssh keys or machine-id).
# PAM's, the shadow suite's and sudo's configuration let su, runuser, sudo and useradd work inside.
HOST_ETC = [
    "pam.conf", "pam.d", "security", "default/useradd", "default/su", "default/runuser", "skel", "sudoers",
    "sudoers.d", "sudo.conf",
    "alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "ssl/certs", "ca-certificates",
    "ca-certificates.conf", "python3", "python3.11", "mime.types", "localtime", "timezone", "os-release",
    "debian_version", "profile", "bash.bashrc", "shells", "protocols", "services", "gai.conf",
    "host.conf", "inputrc", "login.defs", "issue", "libaudit.conf", "mke2fs.conf", "adduser.conf",
]
SECRET_NAMES = ("opasswd", "shadow", "shadow-", "gshadow", "gshadow-")
"""Never copied from the host's /etc, wherever they sit (security/opasswd keeps old password hashes)."""
USR_MERGE_CANDIDATES = ["bin", "sbin", "lib", "lib32", "lib64", "libx32"]
SKELETON_DIRS = {
    "tmp": 0o1777, "root": 0o700, "home": 0o755, "var": 0o755, "var/tmp": 0o1777, "var/log": 0o755,
    "var/lib": 0o755, "var/cache": 0o755, "run": 0o755, "proc": 0o555, "sys": 0o555, "dev": 0o755,
    "opt": 0o755, "srv": 0o755, "mnt": 0o755, "media": 0o755, "usr": 0o755, "etc": 0o755, ".fanfold": 0o755,
}
PASSWD = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"
# Locked entries for the skeleton's users: PAM's account checks (su, runuser) want one per user.
SHADOW = "root:*:20000:0:99999:7:::\nnobody:*:20000:0:99999:7:::\n"
GSHADOW = "root:*::\nnogroup:*::\n"
HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


def base_digest(base: str) -> str:
    if base == "host":
        key = HOST_SKELETON_VERSION
    elif base == "debian:bookworm":
        key = "debian:bookworm:minbase:1"
    else:
        raise ImageNotFound(f"unknown base {base!r}: use one of {', '.join(BASES)}")
    return hashlib.sha256(key.encode()).hexdigest()


def host_dirs() -> tuple[str, ...]:
    """Host directories the ``host`` base overlays: /usr, plus any top-level dir not merged into it."""
    extra = [f"/{name}" for name in USR_MERGE_CANDIDATES if os.path.isdir(f"/{name}") and not os.path.islink(f"/{name}")]
    return ("/usr", *extra)


def ensure_base(store: LayerStore, base: str, mirror: str) -> str:
    """Make sure the base's layer exists; return its digest."""
    digest = base_digest(base)
    if store.has_layer(digest):
        return digest
    with store.lock(digest):
        if store.has_layer(digest):
            return digest
        tree = store.scratch()
        try:
            if base == "host":
                _host_skeleton(tree)
            else:
                _debootstrap(tree, mirror)
            (tree / ".fanfold").mkdir(exist_ok=True)
            store.commit(tree, digest)
        except BaseException:
            shutil.rmtree(tree, ignore_errors=True)
            raise
    return digest


def _host_skeleton(tree: Path) -> None:
    for name, mode in SKELETON_DIRS.items():
        (tree / name).mkdir(parents=True, exist_ok=True)
        os.chmod(tree / name, mode)
    for name in USR_MERGE_CANDIDATES:
        if os.path.islink(f"/{name}"):
            os.symlink(os.readlink(f"/{name}"), tree / name)
        elif os.path.isdir(f"/{name}"):
            (tree / name).mkdir(exist_ok=True)
    etc = tree / "etc"
    for rel in HOST_ETC:
        src = Path("/etc") / rel
        if not os.path.lexists(src):
            continue
        dst = etc / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(*SECRET_NAMES))
        else:
            shutil.copy2(src, dst, follow_symlinks=False)
    for name, text in {"passwd": PASSWD, "group": GROUP, "hosts": HOSTS, "resolv.conf": "", "hostname": "sandbox\n"}.items():
        (etc / name).write_text(text)
    for name, text in {"shadow": SHADOW, "gshadow": GSHADOW}.items():
        (etc / name).write_text(text)
        os.chmod(etc / name, 0o600)


DEBOOTSTRAP_TRIES = 3
DEBOOTSTRAP_PAUSE_S = 5.0
_NETWORK_FAILURES = ("Failed getting release file", "Couldn't download", "Failed to fetch", "Could not connect",
                     "Temporary failure resolving", "Connection timed out", "No route to host")


def _network_failure(output: str) -> bool:
    """Whether debootstrap failed to reach the archive (worth another try), not on the archive's content."""
    return any(marker in output for marker in _NETWORK_FAILURES)


def _debootstrap(tree: Path, mirror: str) -> None:
    if shutil.which("debootstrap") is None:
        raise HostNotReady("the debian:bookworm base needs debootstrap: run `apt-get install debootstrap`")
    for attempt in range(1, DEBOOTSTRAP_TRIES + 1):
        done = subprocess.run(
            ["debootstrap", "--variant=minbase", "bookworm", str(tree), mirror], capture_output=True, text=True
        )
        if done.returncode == 0 or attempt == DEBOOTSTRAP_TRIES or not _network_failure(done.stdout + done.stderr):
            break
        if mounts.mounts_under(tree):  # a second stage that failed left its /proc: no fresh start to make
            break
        # The archive or the network to it failed for a moment: start again from an empty tree.
        for child in tree.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        time.sleep(DEBOOTSTRAP_PAUSE_S * attempt)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-2000:]
        raise BuildFailed(
            f"building base debian:bookworm with debootstrap failed (exit {done.returncode}):\n{tail}",
            step="BASE debian:bookworm", exit_code=done.returncode, output_tail=tail,
        )
    for cache in (tree / "var/cache/apt/archives").glob("*.deb"):
        cache.unlink()
    (tree / "etc/resolv.conf").write_text("")
    (tree / "etc/hostname").write_text("sandbox\n")
