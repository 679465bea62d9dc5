"""An "outside" for the network tests, which have no internet: servers in a network namespace of their own.

``Outside`` starts tests/outside_server.py under ``unshare --net`` (the namespace is that one
process's, and dies with it) and joins it to the host by a veth pair: ``ffo-XXXX`` on the host
(203.0.113.1/24, routes to 198.51.100.0/24 and 10.238.77.0/24 through the outside), ``eth0`` in
the namespace with 203.0.113.2 (``address``), 198.51.100.2 (a second public address) and
10.238.77.2 (a private one). The host must still reach its package indexes and DNS servers,
which a workplace may serve from those very networks: each such address keeps the way it had
before, through a /32 route, while the outside is up (``kept_routes``). Nothing else on the
host changes. Inside: DNS on 53 (udp and tcp)
answering ``names``, HTTP on 80 and 8080, HTTPS on 443 with a certificate from a test CA
(``ca_pem``), and a PEP 503 index of two tiny wheels (``fanfold-probe``, which needs
``fanfold-probe-dep``) at ``pypi.outside.test``, linking to ``files.outside.test``. The routes
are in outside_server.py's docstring; ``requests()`` and ``queries()`` are what reached the outside.

The addresses are the host's: one outside at a time per host (a lock file; a second test run
waits for the first's to stop) and per process (an error). ``stop()`` deletes the veth (and the
routes with it) and ends the server; a test process that dies closes the server's stdin, and the
server exits, taking the namespace and the veth with it.

From a test module, with ``outside`` registered in conftest::

    def test_reaches_the_outside(outside):
        request = urllib.request.Request(f"http://{outside.address}/hello", headers={"Host": "www.outside.test"})
        assert urllib.request.urlopen(request).read() == b"hello from www.outside.test"
        with outside.down():  # shut down for the block, up again after it
            ...
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import secrets
import select
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Iterable, Iterator

import pytest

HOST_ADDRESS = "203.0.113.1"
ADDRESS = "203.0.113.2"
PUBLIC_ADDRESS = "198.51.100.2"
PRIVATE_ADDRESS = "10.238.77.2"
ROUTED = ("198.51.100.0/24", "10.238.77.0/24")
TAKEN = tuple(ipaddress.ip_network(network, strict=False) for network in (f"{HOST_ADDRESS}/24", *ROUTED))
"""The networks the host routes to the outside while it is up."""

DEFAULT_NAMES = {
    "www.outside.test": ADDRESS,
    "api.outside.test": ADDRESS,
    "pypi.outside.test": ADDRESS,
    "files.outside.test": ADDRESS,
    "other.example": PUBLIC_ADDRESS,
    "internal.outside.test": PRIVATE_ADDRESS,
    "metadata.outside.test": "169.254.169.254",
    "loop.outside.test": "127.0.0.1",
}
PROBES = (("fanfold-probe", "1.0", ("fanfold-probe-dep",)), ("fanfold-probe-dep", "1.0", ()))
"""The index's projects: name, version, requirements."""

SERVER = Path(__file__).with_name("outside_server.py")
LOCK = Path("/run/fanfold-outside.lock")
READY_TIMEOUT = 30.0


class OutsideError(RuntimeError):
    """The outside did not come up."""


_up_here: Outside | None = None  # one per process: a second would wait for the host lock forever


class Outside:
    """The outside namespace and its servers; a context manager, and ``start``/``stop`` as often as needed."""

    def __init__(self, where: Path, names: dict[str, str] | None = None, *, lock_timeout: float = 600.0) -> None:
        self.where = Path(where)
        self.names = dict(DEFAULT_NAMES if names is None else names)
        """The DNS map, name -> address (the server's from the first start on)."""
        self.address = ADDRESS
        self.host_address = HOST_ADDRESS
        self.dns = f"{ADDRESS}:53"
        self.ca_pem = self.where / "ca.pem"
        self.log = self.where / "requests.jsonl"
        self.interface: str | None = None
        """The host end of the veth while up."""
        self.kept: list[str] = []
        """The /32 routes that keep the host's package indexes and DNS servers reachable while up."""
        self._lock_timeout = lock_timeout
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> Outside:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        """The server's pid (the namespace's one process) while up."""
        return self._process.pid if self._process else None

    @property
    def wheels(self) -> dict[str, str]:
        """The index's files: name -> sha256."""
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((self.where / "packages").glob("*.whl"))}

    def start(self) -> None:
        """Bring the outside up; again after ``stop`` with the same CA, wheels, names and log."""
        global _up_here
        if self._process is not None:
            return
        if _up_here is not None:
            raise OutsideError("an outside is already up in this process: its addresses are the host's")
        config = self._prepare()
        lock = take_lock(self._lock_timeout)
        try:
            with open(self.where / "server.err", "ab") as errors:
                self._process = subprocess.Popen(
                    ["unshare", "--net", "--", sys.executable, str(SERVER), str(config)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True,
                    pass_fds=(lock,),  # the server holds the lock as long as it lives
                )
        finally:
            os.close(lock)
        _up_here = self
        atexit.register(self.stop)
        try:
            self._wait_ready()
            self.interface = f"ffo-{secrets.token_hex(2)}"
            keep = kept_routes()  # the ways as they are before the outside takes its networks
            plumb(self._process.pid, self.interface)
            if keep:
                ip_batch(["ip"], [f"route replace {route}" for route in keep])
                self.kept = keep
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Servers down, veth and namespace gone; idempotent."""
        global _up_here
        process, self._process = self._process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        _up_here = None
        if self.interface is not None:  # now, rather than when the kernel gets round to the namespace
            subprocess.run(["ip", "link", "del", self.interface], capture_output=True, check=False)
            self.interface = None
        for route in self.kept:
            subprocess.run(["ip", "route", "del", route.split()[0]], capture_output=True, check=False)
        self.kept = []
        with contextlib.suppress(OSError):
            process.stdin.close()  # end of input: the server exits
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """The outside shut down for the block, up again after it (a session's fixture stays usable)."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def release(self, key: str) -> None:
        """Let ``GET /slow/KEY`` answer (those waiting and those to come)."""
        if self._process is None:
            raise OutsideError("the outside is down")
        self._process.stdin.write(f"release {key}\n")
        self._process.stdin.flush()

    def requests(self) -> list[dict]:
        """Every HTTP(S) request that reached the outside, oldest first, across restarts: time, kind
        ("http" or "https"), method, path, host (the Host header), peer ("ip:port"), address and
        port (where it arrived), sni (None over plain HTTP or without SNI)."""
        return [entry for entry in self._log() if entry["kind"] != "dns"]

    def queries(self) -> list[dict]:
        """Every DNS query that reached the outside: time, kind "dns", transport, peer, name, type, rcode."""
        return [entry for entry in self._log() if entry["kind"] == "dns"]

    def _log(self) -> list[dict]:
        try:
            text = self.log.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.split("\n")[:-1]]  # not a line still being written

    def _prepare(self) -> Path:
        """The CA, certificate, wheels and server config, made on the first start."""
        config = self.where / "config.json"
        if not config.exists():
            self.where.mkdir(parents=True, exist_ok=True)
            make_certificates(self.where, self.names)
            packages = self.where / "packages"
            packages.mkdir(exist_ok=True)
            for project, version, requires in PROBES:
                build_wheel(packages, project, version, requires)
            config.write_text(json.dumps({
                "names": self.names, "log": str(self.log), "packages": str(packages),
                "cert": str(self.where / "server.pem"), "key": str(self.where / "server.key"),
                "http_ports": [80, 8080], "https_ports": [443], "dns_port": 53,
            }))
        return config

    def _wait_ready(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], READY_TIMEOUT)
        line = self._process.stdout.readline() if ready else ""
        if line.strip() != "ready":
            errors = (self.where / "server.err").read_text(errors="replace")[-2000:]
            raise OutsideError(f"the outside's server did not start ({line!r}): {errors}")


def take_lock(timeout: float) -> int:
    """The host-wide lock on the outside's addresses, as an fd; waits for another test run's outside."""
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise OutsideError(f"another test run's outside held {LOCK} for {timeout:.0f}s") from None
            time.sleep(0.1)  # waiting on another process's whole outside, not synchronising a test


def plumb(pid: int, interface: str) -> None:
    """The veth between the host and ``pid``'s namespace, its addresses and the host's two routes."""
    ip_batch(["ip"], [
        f"link add {interface} type veth peer name eth0 netns {pid}",
        f"link set {interface} addrgenmode none",  # no IPv6 link-local chatter on the host
        f"addr add {HOST_ADDRESS}/24 dev {interface}",
        f"link set {interface} up",
    ])
    ip_batch(["nsenter", f"--net=/proc/{pid}/ns/net", "ip"], [
        "link set lo up",
        *(f"addr add {address}/24 dev eth0" for address in (ADDRESS, PUBLIC_ADDRESS, PRIVATE_ADDRESS)),
        "link set eth0 up",
        f"route add default via {HOST_ADDRESS}",  # answers to any of the host's addresses
    ])
    # replace: a crashed run's veth may linger for a moment while the kernel frees its namespace
    ip_batch(["ip"], [f"route replace {network} via {ADDRESS} dev {interface}" for network in ROUTED])


def kept_routes() -> list[str]:
    """``ADDRESS/32 via GATEWAY dev DEVICE`` for each address the host must still reach that lies
    in a network the outside takes, as ``ip route get`` finds its way now: the hosts of pip's
    index and file store and of apt's sources, and the DNS servers."""
    from pip._internal.models.index import PyPI  # the index pip installs from unless told otherwise

    hosts = {PyPI.netloc, PyPI.file_storage_domain}
    for variable in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        hosts.update(re.findall(r"https?://([^/\s:]+)", os.environ.get(variable, "")))
    sources = [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]
    for source in sources:
        with contextlib.suppress(OSError):
            hosts.update(re.findall(r"https?://([^/\s:\]]+)", source.read_text(errors="replace")))
    addresses = set()
    with contextlib.suppress(OSError):
        addresses.update(re.findall(r"^\s*nameserver\s+(\S+)", Path("/etc/resolv.conf").read_text(), re.M))
    for host in hosts:
        with contextlib.suppress(OSError):
            addresses.update(info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET))
    kept = []
    for address in sorted(addresses):
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            continue
        if not any(ip in network for network in TAKEN if network.version == ip.version):
            continue
        way = subprocess.run(["ip", "-o", "route", "get", address], capture_output=True, text=True).stdout
        gateway, device = re.search(r" via (\S+)", way), re.search(r" dev (\S+)", way)
        if device:
            kept.append(f"{address}/32{f' via {gateway[1]}' if gateway else ''} dev {device[1]}")
    return kept


def ip_batch(ip: list[str], commands: list[str]) -> None:
    done = subprocess.run([*ip, "-batch", "-"], input="\n".join(commands) + "\n", capture_output=True, text=True)
    if done.returncode != 0:
        raise OutsideError(f"{' '.join(ip)} -batch failed: {done.stderr.strip()}")


def make_certificates(where: Path, names: Iterable[str]) -> None:
    """A test CA (``ca.pem``) and a server certificate it signed (``server.pem``, ``server.key``)."""
    dns_names = dict.fromkeys(["*.outside.test", "outside.test", "other.example", *names])
    addresses = (ADDRESS, PUBLIC_ADDRESS, PRIVATE_ADDRESS)
    san = ",".join([*(f"DNS:{name}" for name in dns_names), *(f"IP:{address}" for address in addresses)])
    (where / "server.ext").write_text(
        f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for command in (
        ["req", "-x509", *new_key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "30",
         "-subj", "/CN=fanfold outside test CA", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ["req", "-new", *new_key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=outside.test"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-days", "30",
         "-set_serial", f"0x{secrets.token_hex(8)}", "-extfile", "server.ext", "-out", "server.pem"],
    ):
        done = subprocess.run(["openssl", *command], cwd=where, capture_output=True, text=True)
        if done.returncode != 0:
            raise OutsideError(f"openssl {command[0]} failed: {done.stderr.strip()}")


def build_wheel(dest: Path, project: str, version: str, requires: Iterable[str] = ()) -> Path:
    """A tiny valid pure-Python wheel (METADATA, WHEEL, RECORD), the same bytes on every run."""
    module = project.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f'NAME = "{project}"\nVERSION = "{version}"\n'.encode(),
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n"
            "Summary: A probe for fanfold's network tests\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
        ).encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: fanfold-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},sha256={_record_digest(data)},{len(data)}\n" for path, data in files.items())
    files[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    wheel = dest / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            entry = zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0))
            entry.external_attr = 0o644 << 16
            archive.writestr(entry, data, compress_type=zipfile.ZIP_DEFLATED)
    return wheel


def _record_digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def pattern(size: int) -> bytes:
    """What ``GET /bytes/SIZE`` answers: byte i is ``i % 256``."""
    return (bytes(range(256)) * (size // 256 + 1))[:size]


_session: list[Outside] = []


@pytest.fixture(scope="session")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outside]:
    """The outside, up for the session. A test that stops it starts it again (``with outside.down():``)."""
    if _session:  # registered twice (conftest and a module): still one outside
        yield _session[0]
        return
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("unshare", "nsenter", "ip", "openssl")):
        pytest.skip("the outside needs root, unshare, nsenter, ip and openssl")
    with Outside(tmp_path_factory.mktemp("outside")) as running:
        _session.append(running)
        try:
            yield running
        finally:
            _session.clear()
