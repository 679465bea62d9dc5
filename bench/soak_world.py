"""What the soak runs against: its own small state filesystem, a real ``fanfold serve`` with two
tenants, an HTTP origin on loopback that network policies allow, a registry with a relay that
stalls, and the host-side handles its faults pull on (a sandbox's PID 1, netd, a page server).
"""

from __future__ import annotations

import errno
import http.server
import os
import re
import select
import signal
import sqlite3
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from fanfold import EngineConfig
from fanfold.host import mounts
from fanfold.runtime import lazy, oci_sandbox

ROOT = Path(__file__).resolve().parents[1]
TOKENS = {"alice": "alice-soak-token-0123456789abcdef", "bob": "bob-soak-token-0123456789abcdef0"}
ORIGIN_NAME = "origin.soak.test"
"""The name sandboxes with a network policy fetch from; netd resolves it to the origin on loopback."""
FILL = ".soak-fill"


class StateFs:
    """An ext4 of ``size_gb`` in a sparse file, mounted at the state dir, so that filling it is quick
    and touches no one else's disk; the sandboxes' disks get a btrfs of their own at ``<state>/disk``.

    Not one btrfs for both, nor the engine's own ``disk.img`` inside the state fs: a full filesystem
    under a loop btrfs aborts that btrfs (every sandbox's disk turns read-only), and SQLite's mapped
    WAL index on a full btrfs kills its process with SIGBUS (copy-on-write needs room for every write)."""

    def __init__(self, state_dir: Path, size_gb: float) -> None:
        self.state_dir, self.size = state_dir, int(size_gb * (1 << 30))
        self.image, self.disk_image = (state_dir.with_name(state_dir.name + suffix) for suffix in (".img", ".disk.img"))

    def __enter__(self) -> StateFs:
        if mounts.is_mount_point(self.state_dir):
            raise SystemExit(f"{self.state_dir} is already mounted: another soak runs, or one died; unmount it first")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for image, mkfs in ((self.image, ["mkfs.ext4", "-q", "-F", "-m", "0"]),
                            (self.disk_image, ["mkfs.btrfs", "-q", "-f", "-m", "single", "-d", "single"])):
            with open(image, "wb") as handle:
                handle.truncate(self.size)
            _run([*mkfs, str(image)])
        _run(["mount", "-o", "loop,noatime", str(self.image), str(self.state_dir)])
        (self.state_dir / "disk").mkdir()
        _run(["mount", "-o", "loop,noatime,nodev,nosuid", str(self.disk_image), str(self.state_dir / "disk")])
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()
        for point in (self.state_dir / "disk", self.state_dir):  # the last engine to close unmounts the disk
            if mounts.is_mount_point(point):
                subprocess.run(["umount", str(point)], check=False)
        if not mounts.is_mount_point(self.state_dir):
            self.image.unlink(missing_ok=True)
            self.disk_image.unlink(missing_ok=True)

    def fill(self) -> int:
        """Take every free byte with one file; how many it took."""
        taken = 0
        with open(self.state_dir / FILL, "ab") as handle:
            for chunk in (256 << 20, 16 << 20, 1 << 20, 64 << 10):
                while True:
                    try:
                        os.posix_fallocate(handle.fileno(), taken, chunk)
                    except OSError as err:
                        if err.errno != errno.ENOSPC:
                            raise
                        break
                    taken += chunk
        return taken

    def free(self) -> None:
        (self.state_dir / FILL).unlink(missing_ok=True)


@dataclass
class Server:
    """A ``fanfold serve`` process: alice and bob over TCP, the host's own tenant over the unix socket."""

    process: subprocess.Popen[str]
    unix_url: str
    tcp_url: str

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=300)


def start_server(config: EngineConfig, where: Path, env: dict[str, str]) -> Server:
    """``fanfold serve`` on the state dir, with this soak's tokens and ``env``; waits until it listens."""
    where.mkdir(parents=True, exist_ok=True)
    tokens = where / "tokens"
    tokens.write_text("".join(f"{tenant} {token}\n" for tenant, token in TOKENS.items()))
    (where / "ff.sock").unlink(missing_ok=True)
    process = subprocess.Popen(
        [sys.executable, "-m", "fanfold.cli", "--state-dir", str(config.state_dir), "serve", "--socket",
         str(where / "ff.sock"), "--port", "0", "--tokens-file", str(tokens)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("FANFOLD_")}, "PYTHONPATH": str(ROOT), **env},
    )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], 300)
    line = process.stdout.readline() if ready else ""
    match = re.search(r"listening on (unix://\S+) (http://\S+)", line)
    if match is None:
        process.kill()
        raise SystemExit(f"fanfold serve did not start: {line!r}")
    threading.Thread(target=process.stdout.read, daemon=True).start()  # never let its pipe fill
    return Server(process, match.group(1), match.group(2))


class Origin(http.server.ThreadingHTTPServer):
    """An HTTP server on loopback answering every GET with ``soak ok``: the sandboxes' internet."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Hello)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = b"soak ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def sandbox_pid(config: EngineConfig, sandbox_id: str) -> int | None:
    """The host pid of a sandbox's PID 1 (its agent), from the engine's database."""
    db = sqlite3.connect(f"file:{config.state_dir / 'fanfold.db'}?mode=ro", uri=True, timeout=30)
    try:
        row = db.execute("SELECT pid FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
    finally:
        db.close()
    return row[0] if row and row[0] else None


def netd_pids(config: EngineConfig) -> list[int]:
    """Pids of this state dir's egress proxies (``fanfold netd``: its settings name ``<state>/net``)."""
    net_dir = str(config.state_dir / "net").encode()
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if b"fanfold.net.daemon" in argv and net_dir in argv:
            found.append(int(name))
    return found


def page_server_pid(config: EngineConfig, sandbox_id: str) -> int | None:
    """The pid of the page server of a lazily restored sandbox, while it serves."""
    try:
        return int((oci_sandbox.paths(config, sandbox_id).lazy / lazy.PID_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def kill(pid: int | None) -> bool:
    """SIGKILL ``pid``; whether there was one to kill."""
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.strip()}")
