"""A real registry on loopback, and images built from plain trees and pushed into it.

``Registry`` runs Debian's reference registry (``docker-registry``) with filesystem storage in
a temp dir on a free loopback port, optionally with TLS (a self-signed CA) and htpasswd auth,
and always stops it. Images are written as OCI layouts with ``tarfile`` and JSON and pushed
with ``skopeo copy``, as a user's CI would push them. Other tests and the benchmark reuse
``push_image``, ``push_tree`` and the archive writers.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import ssl
import subprocess
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Union

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


WHITEOUT = _Marker("WHITEOUT")
"""In a layer's dict: delete this path from the layers below (a ``.wh.`` entry)."""
OPAQUE = _Marker("OPAQUE")
"""In a layer's dict: this directory hides whatever the layers below put in it."""


@dataclass(frozen=True)
class Symlink:
    target: str


Content = Union[bytes, str, None, _Marker, Symlink]
"""A file's content (bytes or text), None for a directory, a Symlink, WHITEOUT or OPAQUE."""


# -- the registry -------------------------------------------------------------------------------


@dataclass
class Registry:
    """A running reference registry: ``host`` is ``127.0.0.1:PORT``; ``storage`` its blob store."""

    host: str
    storage: Path
    process: subprocess.Popen[bytes]
    ca: Path | None = None
    users: dict[str, str] = field(default_factory=dict)

    @property
    def tls(self) -> bool:
        return self.ca is not None

    @property
    def certs_dir(self) -> Path | None:
        """A dir laid out like /etc/containers/certs.d holding this registry's CA (for FANFOLD_REGISTRY_CERTS)."""
        return self.ca.parent.parent if self.ca else None

    def blob_path(self, digest: str) -> Path:
        """Where the registry keeps blob ``digest`` (to tamper with it)."""
        hexa = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexa[:2] / hexa / "data"

    def push_args(self) -> list[str]:
        if not self.tls:
            return ["--dest-tls-verify=false"]
        args = ["--dest-cert-dir", str(self.ca.parent)]
        if self.users:
            user, password = next(iter(self.users.items()))
            args += ["--dest-creds", f"{user}:{password}"]
        return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def run_registry(where: Path, *, tls: bool = False, users: dict[str, str] | None = None,
                 storage: Path | None = None, redirect: str | None = None) -> Iterator[Registry]:
    """Start a registry with its storage under ``where`` (or the ``storage`` of another, to serve its images);
    with ``redirect``, a blob is answered with a 307 to ``redirect`` + its path in the storage (the ``redirect``
    storage middleware, as registries on S3 or a CDN send blob downloads elsewhere). Stopped on the way
    out, whatever happens."""
    where.mkdir(parents=True, exist_ok=True)
    storage = storage or where / "storage"
    storage.mkdir(exist_ok=True)
    port = free_port()
    host = f"127.0.0.1:{port}"
    http: dict[str, object] = {"addr": host}
    auth = None
    ca = None
    if tls:
        pki = where / "pki"
        make_certs(pki, host)
        http["tls"] = {"certificate": str(pki / "server.cert"), "key": str(pki / "server.key")}
        ca = where / "certs.d" / host / "ca.crt"  # the layout FANFOLD_REGISTRY_CERTS and certs.d use
        ca.parent.mkdir(parents=True)
        shutil.copy(pki / "ca.crt", ca)
    if users:
        lines = [subprocess.run(["htpasswd", "-Bbn", u, p], check=True, capture_output=True, text=True).stdout.strip()
                 for u, p in users.items()]
        (where / "htpasswd").write_text("\n".join(lines) + "\n")
        auth = {"htpasswd": {"realm": "fanfold-test", "path": str(where / "htpasswd")}}
    config = {"version": 0.1, "log": {"level": "error", "accesslog": {"disabled": True}},
              "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
              "http": http}
    if auth:
        config["auth"] = auth
    if redirect:
        config["middleware"] = {"storage": [{"name": "redirect", "options": {"baseurl": redirect}}]}
    (where / "config.yml").write_text(json.dumps(config))  # JSON is YAML
    log = open(where / "registry.log", "wb")
    process = subprocess.Popen(["/usr/bin/docker-registry", "serve", str(where / "config.yml")],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    registry = Registry(host, storage, process, ca, dict(users or {}))
    try:
        _wait_ready(registry, where / "registry.log")
        yield registry
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def run_insecure_registry(where: Path) -> Iterator[Registry]:
    """A plain-HTTP registry (``run_registry``) named in FANFOLD_INSECURE_REGISTRIES while it runs."""
    with run_registry(where) as running:
        before = os.environ.get("FANFOLD_INSECURE_REGISTRIES")
        os.environ["FANFOLD_INSECURE_REGISTRIES"] = running.host
        try:
            yield running
        finally:
            if before is None:
                os.environ.pop("FANFOLD_INSECURE_REGISTRIES", None)
            else:
                os.environ["FANFOLD_INSECURE_REGISTRIES"] = before


def _wait_ready(registry: Registry, log: Path, timeout: float = 20) -> None:
    scheme = "https" if registry.tls else "http"
    context = ssl.create_default_context(cafile=str(registry.ca)) if registry.ca else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if registry.process.poll() is not None:
            raise RuntimeError(f"registry exited: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"{scheme}://{registry.host}/v2/", timeout=2, context=context)
            return
        except urllib.error.HTTPError:
            return  # 401: up, and asking for credentials
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"registry did not answer within {timeout}s: {log.read_text()[-2000:]}")


def make_certs(where: Path, host: str) -> None:
    """Write a self-signed CA (``ca.crt``) and a server certificate for ``host`` (an IP:port) signed by it
    (``server.cert``, ``server.key``) into ``where``."""
    where.mkdir(parents=True, exist_ok=True)
    ip = host.rsplit(":", 1)[0]

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=where)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=fanfold test CA",
            "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={ip}", "-keyout", "server.key", "-out", "server.csr")
    (where / "ext.cnf").write_text(f"subjectAltName=IP:{ip}\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "ext.cnf", "-out", "server.cert")
    (where / "ca.key").unlink()


class Relay:
    """A TCP relay in front of a registry that, while ``cut_after`` is set, breaks each connection off
    (a reset) once the registry has sent that many bytes on it: a registry dying mid-pull."""

    def __init__(self, target: str, cut_after: int | None = None, *, stall: bool = False) -> None:
        self.target = target.rsplit(":", 1)
        self.cut_after = cut_after
        self.stall = stall
        """Instead of breaking the connection off, hold it open and silent until the relay stops (a hung registry)."""
        self.cuts = 0
        self._stopping = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.host = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._lock = threading.Lock()

    def __enter__(self) -> Relay:
        self._threads[0].start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self._lock:
            for sock in self._sockets:
                _reset(sock)
            threads = list(self._threads)
        for thread in threads:
            thread.join(10)
        for sock in self._sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((self.target[0], int(self.target[1])))
            with self._lock:
                self._sockets += [client, upstream]
                pumps = [threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True),
                         threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True)]
                self._threads += pumps
            for pump in pumps:
                pump.start()

    def _pump(self, source: socket.socket, dest: socket.socket, from_registry: bool) -> None:
        sent = 0
        try:
            while data := source.recv(65536):
                limit = self.cut_after
                if from_registry and limit is not None and sent + len(data) > limit:
                    dest.sendall(data[: max(0, limit - sent)])
                    self.cuts += 1
                    if self.stall:
                        self._stopping.wait()
                    _reset(source)
                    _reset(dest)
                    return
                dest.sendall(data)
                sent += len(data)
            dest.shutdown(socket.SHUT_WR)  # pass the end of the stream on, gracefully
        except OSError:
            pass


def _reset(sock: socket.socket) -> None:
    """Break a connection off as a dying server does: a reset, unsent data dropped."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked in recv on it
    except OSError:
        pass


# -- images -------------------------------------------------------------------------------------


def layer_tar(files: dict[str, Content]) -> bytes:
    """An uncompressed layer tar of ``files`` (paths relative to /); parents are made as dirs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        made: set[str] = set()

        def add_dir(path: str) -> None:
            if not path or path in made:
                return
            add_dir(os.path.dirname(path))
            made.add(path)
            tar.addfile(_info(path, tarfile.DIRTYPE, 0o755))

        for path, content in sorted(files.items()):
            path = path.strip("/")
            add_dir(os.path.dirname(path))
            if content is None or content is OPAQUE:
                if path not in made:
                    made.add(path)
                    tar.addfile(_info(path, tarfile.DIRTYPE, 0o755))
                if content is OPAQUE:
                    tar.addfile(_info(f"{path}/.wh..wh..opq", tarfile.REGTYPE, 0o644))
            elif content is WHITEOUT:
                tar.addfile(_info(os.path.join(os.path.dirname(path), ".wh." + os.path.basename(path)),
                                  tarfile.REGTYPE, 0o644))
            elif isinstance(content, Symlink):
                info = _info(path, tarfile.SYMTYPE, 0o777)
                info.linkname = content.target
                tar.addfile(info)
            else:
                data = content.encode() if isinstance(content, str) else content
                info = _info(path, tarfile.REGTYPE, 0o755 if path.startswith(("bin/", "usr/bin/")) else 0o644)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def tree_tar(root: Path, out: Path) -> Path:
    """Write an uncompressed layer tar of the directory tree ``root`` (owned by root, times kept) to ``out``."""
    with tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(root)))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if info.isreg():
                with open(path, "rb") as handle:
                    tar.addfile(info, handle)
            else:
                tar.addfile(info)
    return out


def _info(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = 1_700_000_000
    return info


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def image_config(diff_ids: list[str], *, arch: str = "amd64", config: dict | None = None) -> bytes:
    """An image's config blob; a ``history`` key in ``config`` goes to the top level, where images keep it."""
    settings = dict(config or {})
    history = settings.pop("history", None)
    return json.dumps({
        "architecture": arch, "os": "linux", "created": "2026-01-01T00:00:00Z",
        "config": settings, "rootfs": {"type": "layers", "diff_ids": diff_ids},
        **({"history": history} if history is not None else {}),
    }, sort_keys=True).encode()


@dataclass
class Built:
    """An image written into an OCI layout: ``manifest`` is its digest, ``tars`` its uncompressed layers."""

    manifest: str
    config: bytes
    tars: list[bytes]


class Layout:
    """An OCI image layout directory being written (``oci:PATH:TAG`` for skopeo)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        (path / "blobs/sha256").mkdir(parents=True, exist_ok=True)
        (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self.index: list[dict] = []

    def blob(self, data: bytes) -> str:
        digest = _sha(data)
        (self.path / "blobs/sha256" / digest[7:]).write_bytes(data)
        return digest

    def blob_file(self, path: Path) -> str:
        """Move the file at ``path`` in as a blob, hashed as it streams (layers of hundreds of MB)."""
        sha = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                sha.update(chunk)
        digest = "sha256:" + sha.hexdigest()
        shutil.move(path, self.path / "blobs/sha256" / digest[7:])
        return digest

    def image(self, tars: list[bytes | Path], *, config: dict | None = None, arch: str = "amd64",
              compress: bool = True) -> tuple[dict, Built]:
        """Write an image's blobs and manifest; return its descriptor (not yet in the index).

        A layer is tar bytes (gzipped with ``compress``) or an uncompressed tar file, moved in as it is.
        """
        layers, diff_ids = [], []
        for tar in tars:
            if isinstance(tar, Path):
                size = tar.stat().st_size
                digest = self.blob_file(tar)
                layers.append({"mediaType": LAYER_TAR, "digest": digest, "size": size})
                diff_ids.append(digest)
                continue
            data = gzip.compress(tar, compresslevel=1, mtime=0) if compress else tar
            layers.append({"mediaType": LAYER_GZIP if compress else LAYER_TAR, "digest": self.blob(data), "size": len(data)})
            diff_ids.append(_sha(tar))
        config_blob = image_config(diff_ids, arch=arch, config=config)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": self.blob(config_blob), "size": len(config_blob)},
            "layers": layers,
        }).encode()
        descriptor = {"mediaType": OCI_MANIFEST, "digest": self.blob(manifest), "size": len(manifest),
                      "platform": {"architecture": arch, "os": "linux"}}
        return descriptor, Built(descriptor["digest"], config_blob, [t for t in tars if isinstance(t, bytes)])

    def add(self, descriptor: dict, tag: str) -> None:
        self.index.append({**descriptor, "annotations": {"org.opencontainers.image.ref.name": tag}})
        (self.path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": self.index}))

    def multi(self, descriptors: list[dict]) -> dict:
        """Write an image index over per-platform manifests; return its descriptor."""
        index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": descriptors}).encode()
        return {"mediaType": OCI_INDEX, "digest": self.blob(index), "size": len(index)}


def skopeo_push(registry: Registry, source: str, name: str, *extra: str) -> str:
    """``skopeo copy source docker://registry/name``; return the pushed manifest's digest."""
    with tempfile.NamedTemporaryFile() as digest_file:
        subprocess.run(["skopeo", "copy", "-q", *extra, *registry.push_args(), "--digestfile", digest_file.name,
                        source, f"docker://{registry.host}/{name}"], check=True, capture_output=True)
        return Path(digest_file.name).read_text().strip()


def push_image(registry: Registry, name: str, layers: list[dict[str, Content]], *, config: dict | None = None,
               compress: bool = True) -> str:
    """Build an image of ``layers`` (bottom first), push it as ``name`` (``repo:tag``); return ``host/repo@digest``."""
    with tempfile.TemporaryDirectory() as tmp:
        layout = Layout(Path(tmp) / "layout")
        descriptor, _ = layout.image([layer_tar(files) for files in layers], config=config, compress=compress)
        layout.add(descriptor, "t")
        digest = skopeo_push(registry, f"oci:{layout.path}:t", name)
    return f"{registry.host}/{name.partition(':')[0]}@{digest}"


def push_tree(registry: Registry, name: str, roots: list[Path], *, config: dict | None = None) -> str:
    """Push an image whose layers are the directory trees ``roots`` (bottom first); return ``host/repo@digest``.

    Layers are streamed through files, not memory (the benchmark pushes ~300 MB of random data);
    skopeo gzips them on the way into the registry, at level 1 to keep the set-up short.
    """
    with tempfile.TemporaryDirectory() as tmp:
        layout = Layout(Path(tmp) / "layout")
        tars = [tree_tar(root, Path(tmp) / f"layer{i}.tar") for i, root in enumerate(roots)]
        descriptor, _ = layout.image(tars, config=config)
        layout.add(descriptor, "t")
        digest = skopeo_push(registry, f"oci:{layout.path}:t", name, "--dest-compress-level", "1")
    return f"{registry.host}/{name.partition(':')[0]}@{digest}"


def random_tree(root: Path, total_bytes: int, *, files: int = 4) -> Path:
    """A directory of ``files`` files of random (incompressible) data, ``total_bytes`` in all."""
    root.mkdir(parents=True, exist_ok=True)
    each = total_bytes // files
    for i in range(files):
        with open(root / f"blob{i}.bin", "wb") as handle:
            for _ in range(each // (1 << 20)):
                handle.write(os.urandom(1 << 20))
            handle.write(os.urandom(each % (1 << 20)))
    return root


def push_multiarch(registry: Registry, name: str, per_arch: dict[str, list[dict[str, Content]]]) -> str:
    """Push an image index with one manifest per architecture (``{"amd64": layers, ...}``); return ``host/repo@digest``."""
    with tempfile.TemporaryDirectory() as tmp:
        layout = Layout(Path(tmp) / "layout")
        descriptors = [layout.image([layer_tar(f) for f in layers], arch=arch)[0] for arch, layers in per_arch.items()]
        layout.add(layout.multi(descriptors), "t")
        digest = skopeo_push(registry, f"oci:{layout.path}:t", name, "--all")
    return f"{registry.host}/{name.partition(':')[0]}@{digest}"


# -- files --------------------------------------------------------------------------------------


def write_oci_layout(path: Path, layers: list[dict[str, Content]], *, config: dict | None = None,
                     tag: str = "latest") -> Built:
    """Write an OCI layout dir at ``path`` holding one image tagged ``tag``."""
    layout = Layout(path)
    descriptor, built = layout.image([layer_tar(files) for files in layers], config=config)
    layout.add(descriptor, tag)
    return built


def write_oci_archive(path: Path, layers: list[dict[str, Content]], *, config: dict | None = None) -> Built:
    """An OCI archive: a tar of an OCI layout dir."""
    with tempfile.TemporaryDirectory() as tmp:
        built = write_oci_layout(Path(tmp) / "layout", layers, config=config)
        with tarfile.open(path, "w") as tar:
            for child in sorted((Path(tmp) / "layout").iterdir()):
                tar.add(child, arcname=child.name)
    return built


def write_docker_archive(path: Path, layers: list[dict[str, Content]], *, config: dict | None = None,
                         tag: str = "example.com/saved:latest") -> bytes:
    """A ``docker save`` tarball, written by hand: ``manifest.json``, the config, ``<id>/layer.tar``s; return the config."""
    tars = [layer_tar(files) for files in layers]
    config_blob = image_config([_sha(t) for t in tars], config=config)
    config_name = hashlib.sha256(config_blob).hexdigest() + ".json"
    names = [f"{hashlib.sha256(t).hexdigest()}/layer.tar" for t in tars]
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": names}]).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in [(config_name, config_blob), *zip(names, tars), ("manifest.json", manifest)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return config_blob



RUNNABLE_TOOLS = ("sh", "dash", "true", "cat", "dd", "ls", "rm", "mkdir", "id", "env", "sleep", "pwd", "touch", "stat")


def runnable_tree(root: Path) -> Path:
    """A tiny root filesystem that runs commands: the host's shell and a few coreutils with the
    libraries they load, merged-/usr style, with /etc/passwd naming root and ``app`` (1000)."""
    (root / "usr/bin").mkdir(parents=True)
    for name, target in (("bin", "usr/bin"), ("sbin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
        os.symlink(target, root / name)
    for name in ("etc", "tmp", "root", "home/app", "usr/lib", "usr/lib64"):
        (root / name).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\napp:x:1000:\n")
    os.chown(root / "home/app", 1000, 1000)
    libs: set[str] = set()
    for tool in RUNNABLE_TOOLS:
        found = shutil.which(tool)
        if found is None:
            continue
        real = Path(found).resolve()
        shutil.copy2(real, root / "usr/bin" / tool)
        listed = subprocess.run(["ldd", str(real)], capture_output=True, text=True).stdout
        libs.update(part for line in listed.splitlines() for part in line.split() if part.startswith("/"))
    for lib in libs:
        rel = lib.lstrip("/")
        target = root / (rel if rel.startswith("usr/") else f"usr/{rel}")  # /lib is a link to usr/lib here
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(lib).resolve(), target)
    return root
