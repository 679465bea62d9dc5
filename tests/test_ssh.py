"""SSH into sandboxes: ``fanfold ssh`` over the agent channel on a real terminal, and a real sshd in a
sandbox that the real OpenSSH client logs into, through an exposed port and through a server's API."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fanfold import AsyncFleet, InvalidRequest, SshAccess
from fanfold.host import census
from fanfold.ssh import check_public_keys, parse_tenant_keys

from conftest import STATE_DIR, TOKENS, run_cli, start_server, stop_server
from test_pty import _cli_on_a_terminal

SSH_OPTIONS = ("-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
               "-o", "IdentitiesOnly=yes", "-o", "ConnectTimeout=30", "-o", "LogLevel=ERROR")


def keygen(where: Path, name: str) -> Path:
    """A fresh ed25519 key pair; returns the private key's path (the public one is beside it, .pub)."""
    key = where / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True)
    return key


def public(key: Path) -> str:
    return key.with_suffix(".pub").read_text()


async def ssh(key: Path, *where: str, command: str = "hostname; id -un",
              env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The real ssh client, in a process of its own (the embedded fleet's port forwarding runs on this loop)."""
    proc = await asyncio.create_subprocess_exec("ssh", "-i", str(key), *SSH_OPTIONS, *where, command,
                                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, env=env)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode(), err.decode()


def sshd_processes() -> list[int]:
    """Host pids of the sshds that fanfold started in sandboxes (their config path says so)."""
    return [pid for pid, argv in census.processes() if b"/etc/fanfold-ssh/sshd_config" in b"\0".join(argv)]


# -- the plain logic -------------------------------------------------------------------------------


def test_public_keys_are_checked_and_options_refused(tmp_path):
    line = public(keygen(tmp_path, "k"))
    assert check_public_keys([line, line]) == (line.strip(),)  # one line per key, duplicates dropped
    kind, blob, _ = line.split()
    for bad in (f'command="sh" {line}', f"ssh-ed25519 {blob[:-8]}AAAAAAA=", f"ssh-rsa {blob}", "hello"):
        with pytest.raises(InvalidRequest):
            check_public_keys([bad])
    with pytest.raises(InvalidRequest, match="list"):
        check_public_keys(line)
    keys = parse_tenant_keys(f"# alice's laptop\nalice {line}\nbob {line}\n", "keys")
    assert keys == {"alice": (line.strip(),), "bob": (line.strip(),)}
    with pytest.raises(InvalidRequest, match="keys:1"):
        parse_tenant_keys("alice not-a-key\n", "keys")
    access = SshAccess(sandbox_id="sb-1", port=22, host_key="ssh-ed25519 AAAA", address="127.0.0.1:4022")
    assert access.known_hosts() == "[127.0.0.1]:4022 ssh-ed25519 AAAA"  # as ssh looks a host on a port up
    assert SshAccess.from_dict(access.to_dict()) == access


# -- fanfold ssh: a login shell over the agent channel -----------------------------------------------


@pytest.fixture
def cli_sandbox():
    made = run_cli("create")
    assert made.returncode == 0, made.stderr
    sandbox_id = made.stdout.split()[0]
    yield sandbox_id
    assert run_cli("rm", sandbox_id).returncode == 0


def test_ssh_logs_in_with_the_users_login_shell_on_a_terminal(cli_sandbox):
    shown, code = _cli_on_a_terminal("ssh", cli_sandbox, steps=[
        (b"# ", b"shopt -q login_shell && echo lo''gin; echo \"$PWD $SHELL $TERM\"; stty size\n"),
        (b"login\r\n", b"exit 3\n"),
    ])
    term = os.environ.get("TERM") or "xterm-256color"  # ours, passed on
    assert code == 3, shown
    assert f"/root /bin/bash {term}\r\n".encode() in shown and b"24 80\r\n" in shown, shown


def test_ssh_runs_a_command_with_the_users_shell_and_passes_its_exit_status(cli_sandbox):
    done = run_cli("ssh", cli_sandbox, "--", "echo", "$HOME", "$USER;", "tty;", "exit", "7")
    assert done.returncode == 7 and done.stdout == "/root root\nnot a tty\n", done
    shown, code = _cli_on_a_terminal("ssh", "-t", cli_sandbox, "--", "tty; exit 4", steps=[])
    assert code == 4 and b"/dev/pts/" in shown, shown


def test_ssh_as_another_user_gets_that_users_shell_and_home(cli_sandbox):
    made = run_cli("exec", cli_sandbox, "--", "sh", "-c", "echo 'dev:x:1234:1234::/home/dev:/bin/sh' >> /etc/passwd"
                   " && mkdir -p /home/dev && chown 1234 /home/dev")
    assert made.returncode == 0, made.stderr
    done = run_cli("ssh", "-u", "dev", cli_sandbox, "--", 'echo "$(id -u) $PWD $SHELL $LOGNAME"')
    assert done.returncode == 0 and done.stdout == "1234 /home/dev /bin/sh dev\n", done


def test_ssh_through_a_server(server, tmp_path):
    url = ["--url", server.unix_url]
    made = run_cli(*url, "create")
    assert made.returncode == 0, made.stderr
    sandbox_id = made.stdout.split()[0]
    try:
        shown, code = _cli_on_a_terminal(*url, "ssh", sandbox_id, steps=[(b"# ", b"echo h''i $PWD; exit 9\n")])
        assert code == 9 and b"hi /root\r\n" in shown, shown
        big = run_cli(*url, "ssh", sandbox_id, "--", "head -c 70000000 /dev/zero")  # past any cap of kept output
        assert big.returncode == 0 and len(big.stdout) == 70_000_000, big.stderr
        key = keygen(tmp_path, "k")
        enabled = run_cli(*url, "ssh", "--sshd", "--key", str(key.with_suffix(".pub")), sandbox_id)
        assert enabled.returncode == 0 and "host key: ssh-ed25519 " in enabled.stderr, enabled
        command = enabled.stdout.split()  # ssh -p N root@127.0.0.1: the server holds the port open
        assert command[:2] == ["ssh", "-p"] and command[3] == "root@127.0.0.1", command
        done = subprocess.run([*command[:3], "-i", str(key), *SSH_OPTIONS, command[3], "hostname"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout == f"{sandbox_id}\n", done
        tcp = run_cli("--url", server.tcp_url, "ssh", sandbox_id, "--", "true",
                      env={"FANFOLD_TOKEN": server.tokens["alice"]})
        assert tcp.returncode == 2 and "SandboxNotFound" in tcp.stderr  # the host's sandbox is not alice's
    finally:
        assert run_cli(*url, "rm", sandbox_id).returncode == 0


# -- a real sshd ------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["embedded", "unix"])
async def test_the_ssh_client_logs_into_sshd_through_the_exposed_port(transport, config, request, tmp_path):
    from conftest import fleet_args

    good, wrong = keygen(tmp_path, "good"), keygen(tmp_path, "wrong")
    async with AsyncFleet(**fleet_args(transport, request, config)) as fleet:
        async with await fleet.create() as sandbox:
            access = await sandbox.enable_ssh([public(good)])
            assert access.address is not None and access.port == 22 and access.host_key.startswith("ssh-ed25519 ")
            host, _, port = access.address.rpartition(":")
            code, out, err = await ssh(good, "-p", port, f"root@{host}")
            assert code == 0 and out == f"{sandbox.id}\nroot\n", err
            code, out, err = await ssh(wrong, "-p", port, f"root@{host}")
            assert code == 255 and "Permission denied" in err and not out
            with pytest.raises(InvalidRequest, match="at least one public key"):
                await sandbox.enable_ssh([])  # no key at all: sshd here takes keys only

            again = await sandbox.enable_ssh([public(wrong)])  # keys replaced, the same sshd and host key
            assert again.port == access.port and again.host_key == access.host_key
            assert (await ssh(wrong, "-p", port, f"root@{host}"))[0] == 0
            assert (await ssh(good, "-p", port, f"root@{host}"))[0] == 255
            processes = await sandbox.exec("ps -eo ppid=,comm= | grep sshd")
            assert processes.text.split() == ["1", "sshd"]  # one listener, a child of the agent
            assert len(sshd_processes()) == 1
    assert sshd_processes() == []  # it went with its sandbox


async def test_sshd_survives_suspend_and_a_forks_children_keep_its_host_key(config, tmp_path):
    key = keygen(tmp_path, "k")
    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create() as parent:
            access = await parent.enable_ssh([public(key)])
            async with await parent.fork(1) as fork:
                child = fork.children[0]
                reached = await child.enable_ssh([public(key)])
                assert reached.host_key == access.host_key and reached.address != access.address
                code, out, err = await ssh(key, "-p", reached.address.rpartition(":")[2], "root@127.0.0.1")
                assert code == 0 and out == f"{child.id}\nroot\n", err
            await parent.suspend()  # sshd is checkpointed with the agent's tree; a connection resumes it
            code, out, err = await ssh(key, "-p", access.address.rpartition(":")[2], "root@127.0.0.1")
            assert code == 0 and out == f"{parent.id}\nroot\n", err


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """A server whose tenants alice and bob each registered a key (``--ssh-keys``)."""
    where = tmp_path_factory.mktemp("ssh-server")
    keys = {tenant: keygen(where, tenant) for tenant in TOKENS}
    (where / "ssh-keys").write_text("".join(f"{tenant} {public(key)}" for tenant, key in keys.items()))
    running = start_server(STATE_DIR, where, "--ssh-keys", str(where / "ssh-keys"))
    yield running, keys
    assert stop_server(running) == 0


async def test_a_tenants_registered_key_opens_its_sandboxes_and_no_one_elses(keyed_server, tmp_path):
    running, keys = keyed_server
    async with AsyncFleet(running.tcp_url, token=running.tokens["alice"]) as alice:
        async with await alice.create() as sandbox:
            access = await sandbox.enable_ssh([])  # the tenant's registered key is enough
            assert access.address is None  # over TCP: SSH rides on the server's API
            cli = f"{sys.executable} -m fanfold.cli --url {running.tcp_url} ssh --stdio %h"
            proxy = ("-o", f"ProxyCommand={cli}")
            env = {**os.environ, "FANFOLD_TOKEN": running.tokens["alice"], "PYTHONPATH": os.pathsep.join(sys.path)}
            code, out, err = await ssh(keys["alice"], *proxy, f"root@{sandbox.id}", env=env)
            assert code == 0 and out == f"{sandbox.id}\nroot\n", err
            code, out, err = await ssh(keys["bob"], *proxy, f"root@{sandbox.id}", env=env)
            assert code == 255 and "Permission denied" in err and not out
            bob = {**env, "FANFOLD_TOKEN": running.tokens["bob"]}  # bob's token does not even reach it
            code, out, err = await ssh(keys["bob"], *proxy, f"root@{sandbox.id}", env=bob)
            assert code == 255 and "SandboxNotFound" in err and not out


def test_ssh_stdio_without_sshd_says_what_to_do(cli_sandbox):
    done = run_cli("ssh", "--stdio", cli_sandbox)
    assert done.returncode == 255 and "ssh is not enabled in this sandbox" in done.stderr
