"""A real git repository served over HTTP on loopback, for repo steps that clone over http.

``serve_git`` serves a bare repository by git's "dumb" HTTP protocol (plain files, kept current by
``git update-server-info``: no CGI, nothing of git runs in the server) from a thread of the test
process, and answers any path under ``/moved/`` with a 302 to ``redirect`` + the rest of it, as a
forge that moved a repository does. ``GitServer.commit`` adds a commit to the served repository.
"""

from __future__ import annotations

import functools
import http.server
import subprocess
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

_GIT = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]


@dataclass
class GitServer:
    port: int
    work: Path
    """A clone of the served repository, whose commits ``commit`` pushes."""

    @property
    def url(self) -> str:
        """The served repository, as a tenant names it: ``http://127.0.0.1:PORT/repo.git``."""
        return f"http://127.0.0.1:{self.port}/repo.git"

    @property
    def moved_url(self) -> str:
        """The repository at a path the server redirects."""
        return f"http://127.0.0.1:{self.port}/moved/repo.git"

    def commit(self, name: str, text: str) -> str:
        """Commit ``name`` holding ``text`` and publish it; its commit id."""
        (self.work / name).write_text(text)
        for args in (["add", name], ["commit", "-qm", f"{name}: {text}"], ["push", "-q", "origin", "HEAD:main"]):
            subprocess.run([*_GIT, "-C", str(self.work), *args], check=True, capture_output=True)
        bare = self.work.parent / "repo.git"
        subprocess.run(["git", "-C", str(bare), "update-server-info"], check=True)
        return subprocess.run(["git", "-C", str(self.work), "rev-parse", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()


class _Handler(http.server.SimpleHTTPRequestHandler):
    redirect = ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.startswith("/moved/") and self.redirect:
            self.send_response(302)
            self.send_header("Location", self.redirect + self.path.removeprefix("/moved/"))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def serve_git(where: Path, *, redirect: str = "") -> Iterator[GitServer]:
    """A bare repository ``repo.git`` under ``where`` with one commit (README: v1), served on a free
    loopback port until the block ends."""
    bare, work = where / "repo.git", where / "work"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(bare)], check=True)
    subprocess.run(["git", "clone", "-q", str(bare), str(work)], check=True, capture_output=True)
    handler = type("Handler", (_Handler,), {"redirect": redirect})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(where)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        served = GitServer(httpd.server_address[1], work)
        served.commit("README", "v1\n")
        yield served
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
