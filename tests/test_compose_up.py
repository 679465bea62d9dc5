"""Compose files brought up as real sandbox groups: the SDK (embedded and over HTTP) and the CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import httpx
import pytest

from fanfold import AsyncFleet, InvalidSpec
from fanfold.compose import PROJECT_LABEL

from conftest import STATE_DIR, fleet_args, run_cli
from doc_blocks import ROOT

EXAMPLE = ROOT / "examples" / "compose" / "docker-compose.yaml"
"""An app (HTTP on 8080, as uid 1000) that counts visits in a tiny TCP key-value database, ``db``."""


def db_command(command: str) -> str:
    """A shell command that sends ``command`` to the database by its name and prints the answer."""
    return ("python3 -c \"import socket; c = socket.create_connection(('db', 7000), timeout=5);"
            f" c.sendall(b'{command}\\n'); print(c.makefile().readline().strip())\"")


@pytest.mark.parametrize("transport", ["embedded", "tcp"])
async def test_an_app_and_its_database_come_up_as_a_group_and_the_app_reaches_it_by_name(transport, request, config):
    progress: list[str] = []
    async with AsyncFleet(**fleet_args(transport, request, config)) as fleet:
        group = await fleet.compose_up(EXAMPLE, on_progress=lambda service, what: progress.append(f"{service}: {what}"))
        try:
            assert sorted(group.members) == ["app", "db"] and group.info.labels[PROJECT_LABEL] == "visits"
            assert progress[0] == "db: building" and progress[1].startswith("db: built img-")
            assert progress[-1] == ": starting 2 services as project 'visits'"

            reached = await group["app"].exec(db_command("INCR visits"))
            assert (reached.exit_code, reached.stdout.decode().strip()) == (0, "1")  # the app's sandbox reached db by name
            url = group.info.ports["app"][8080]  # the app's port, exposed on this host
            page = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=30).read())
            assert page == b"visit 2\n"  # the app's own request went to the database too

            owner = await group["app"].exec("pgrep -u 1000 -f 'app.py --port 8080' && id -u")
            assert owner.exit_code == 0 and owner.stdout.decode().split()[-1] == "1000"  # user: "1000"
        finally:
            assert await fleet.compose_down(EXAMPLE) == [group.id]  # the project's groups, killed
        assert group.id not in [info.id for info in await fleet.groups()]


async def test_a_refused_key_fails_before_anything_is_built_or_started(tmp_path, config):
    path = tmp_path / "docker-compose.yaml"
    path.write_text(textwrap.dedent("""\
        services:
          db: {image: host, command: sleep infinity}
          app: {image: host, privileged: true, depends_on: [db]}
        """))
    async with AsyncFleet(config=config) as fleet:
        before = await fleet.groups()
        with pytest.raises(InvalidSpec, match=r"unsupported compose key 'services.app.privileged': remove it"):
            await fleet.compose_up(path)
        assert await fleet.groups() == before


IMAGE_ONLY = """\
services:
  db:
    image: host
    command: python3 -m http.server 8000
    healthcheck:
      test: ["CMD", "python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000')"]
      interval: 200ms
  app:
    image: host
    depends_on: {db: {condition: service_healthy}}
    environment: {DB_URL: "http://db:${DB_PORT}", FROM_SERVER: "${HOME}"}
    command: sleep infinity
"""


async def test_the_http_route_brings_up_a_file_from_its_body_with_the_bodys_variables_only(server):
    headers = {"Authorization": f"Bearer {server.tokens['alice']}"}
    async with httpx.AsyncClient(base_url=server.tcp_url, headers=headers, timeout=120) as http:
        made = await http.post("/v1/compose", json={"file": IMAGE_ONLY, "env": {"DB_PORT": "8000"}, "project": "shop"})
        assert made.status_code == 201, made.text
        info = made.json()
        assert sorted(info["members"]) == ["app", "db"] and info["labels"][PROJECT_LABEL] == "shop"
        async with AsyncFleet(server.tcp_url, token=server.tokens["alice"]) as fleet:
            group = await fleet.group(info["id"])
            async with group:
                reached = await group["app"].exec(
                    "python3 -c \"import os, urllib.request as u; print(u.urlopen(os.environ['DB_URL']).status)\";"
                    " echo \"[$FROM_SERVER]\"")
                assert reached.stdout.decode().split() == ["200", "[]"], reached  # ${HOME}: not the server's
        restarting = IMAGE_ONLY.replace("    command: sleep infinity\n", "    command: sleep infinity\n    restart: always\n")
        refused = await http.post("/v1/compose", json={"file": restarting})
        assert refused.status_code == 422 and refused.json()["kind"] == "invalid_spec"
        assert "unsupported compose key 'services.app.restart'" in refused.json()["message"]
        built = await http.post("/v1/compose", json={"file": "services:\n  app: {build: .}\n"})
        assert built.status_code == 422 and "services ['app'] have a build" in built.json()["message"]
        odd = await http.post("/v1/compose", json={"file": IMAGE_ONLY, "volume": 1})
        assert odd.status_code == 422 and "unknown fields ['volume']" in odd.json()["message"]
        quoted = await http.post("/v1/compose", json={"file": IMAGE_ONLY, "env": {"DB_PORT": "8000"}, "detached": "false"})
        assert quoted.status_code == 422 and "detached is true or false" in quoted.json()["message"]


def test_the_cli_brings_a_project_up_lists_it_and_takes_it_down(tmp_path: Path):
    up = run_cli("compose", "up", "-d", "-f", str(EXAMPLE), timeout=300)
    assert up.returncode == 0, up.stderr
    group_id = up.stdout.strip()
    try:
        assert group_id.startswith("grp-"), up.stdout
        lines = up.stderr.splitlines()
        assert "db: building" in lines and "app: building" in lines
        assert any(line.startswith("app: running in sb-") and "port 8080 at http://127.0.0.1:" in line for line in lines)
        ps = run_cli("compose", "ps", "-f", str(EXAMPLE))
        assert ps.returncode == 0, ps.stderr
        rows = [line.split("\t") for line in ps.stdout.splitlines()]
        assert [(row[0], row[1], row[2]) for row in rows] == [("visits", group_id, "db"), ("visits", group_id, "app")]
        assert rows[1][5].startswith("8080->http://127.0.0.1:")
    finally:
        down = run_cli("compose", "down", "-p", "visits")
    assert (down.returncode, down.stdout.split()) == (0, [group_id]), down.stderr
    assert run_cli("compose", "ps", "-p", "visits").stdout == ""


def test_the_cli_in_the_foreground_removes_the_group_on_ctrl_c():
    env = {**os.environ, "FANFOLD_STATE_DIR": str(STATE_DIR)}
    process = subprocess.Popen(  # SIGINT's default restored: a shell may start background jobs with it ignored
        [sys.executable, "-m", "fanfold.cli", "compose", "up", "-f", str(EXAMPLE)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert process.stdout is not None
        group_id = process.stdout.readline().strip()  # printed once the group is up
        assert group_id in run_cli("compose", "ps", "-f", str(EXAMPLE)).stdout
        logged = process.stdout.readline()  # then the services' logs: the app's health checks were requests
        assert logged.startswith("app | ") and "GET /health" in logged, logged
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130 and "Ctrl-C stops and removes it" in err, err
    assert run_cli("compose", "ps", "-f", str(EXAMPLE)).stdout == ""


def test_the_cli_refuses_a_key_by_name_and_needs_a_file(tmp_path: Path):
    (tmp_path / "compose.yaml").write_text("services:\n  app: {image: host, restart: always}\n")
    done = run_cli("compose", "up", "-f", str(tmp_path / "compose.yaml"))
    assert done.returncode == 2
    assert "InvalidSpec: unsupported compose key 'services.app.restart': remove it" in done.stderr
    missing = run_cli("compose", "up", "-f", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "cannot read compose file" in missing.stderr
