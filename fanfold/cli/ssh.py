"""``fanfold ssh``: a login shell in a sandbox over fanfold's own channel, or a real sshd in it."""

from __future__ import annotations

import glob
import os
import sys
import threading
from pathlib import Path

import click

from .common import _fleet, console
from .terminal import exit_code, interact


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id", metavar="SANDBOX")
@click.option("-u", "--user", default=None, metavar="USER",
              help="Log in as this user (a name or uid in the sandbox's /etc/passwd); default: the image's USER, else root.")
@click.option("-t", "force_tty", is_flag=True, help="Run COMMAND on a terminal too (as ssh -t).")
@click.option("-T", "no_tty", is_flag=True, help="No terminal, even for the login shell (as ssh -T).")
@click.option("--sshd", is_flag=True, help="Start a real sshd in the sandbox instead (for VS Code, Harbor and other"
              " SSH clients), authorizing --key; print the ssh command that reaches it.")
@click.option("--key", "keys", multiple=True, metavar="PUBFILE",
              help="With --sshd: a public key file to authorize (repeatable; default: ~/.ssh/id_*.pub).")
@click.option("--port", type=click.IntRange(1, 65535), default=22, show_default=True,
              help="With --sshd: sshd's port inside the sandbox.")
@click.option("--stdio", is_flag=True, help="Speak SSH on stdin and stdout to the sandbox's sshd, through any"
              " fleet: an ssh ProxyCommand (docs/ssh.md).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def ssh(ctx: click.Context, sandbox_id: str, user: str | None, force_tty: bool, no_tty: bool, sshd: bool,
        keys: tuple[str, ...], port: int, stdio: bool, command: tuple[str, ...]) -> None:
    """Log in to SANDBOX over fanfold's own channel, or start a real sshd in it (--sshd).

    The user's shell from the sandbox's /etc/passwd runs as a login shell on our terminal; with
    COMMAND, that shell runs it (`-c`, words joined as ssh does) and this exits with its status.

    No sshd is needed: this goes over fanfold's own channel, embedded or with --url. A terminal is
    used when no COMMAND is given and our stdin is one (-t forces it, -T refuses it); our TERM and
    the terminal's size go with it.

    With --sshd, a real OpenSSH server starts in the sandbox instead, authorizing the --key files
    (and on a server, the tenant's registered keys), and the ssh command that reaches it is printed.
    Embedded, its port is forwarded from this host's loopback until Ctrl-C. --stdio is the
    ProxyCommand for it from anywhere: ssh -o ProxyCommand='fanfold ssh --stdio %h' root@SANDBOX.
    """
    if sshd and stdio:
        raise click.UsageError("--sshd starts sshd, --stdio talks to it: give one")
    if (sshd or stdio) and command:
        raise click.UsageError("--sshd and --stdio take no command: ssh to the sandbox runs it")
    if sshd:
        return _sshd(ctx, sandbox_id, user, _public_keys(keys), port)
    from ..ssh import SESSION_OUTPUT, login_argv, stdio_argv

    tty = not no_tty and (force_tty or not command)
    if tty and not (sys.stdin is not None and sys.stdin.isatty()):
        if force_tty:
            console.print("Pseudo-terminal will not be allocated because stdin is not a terminal.", highlight=False)
        tty = False
    with _fleet(ctx) as fleet:
        sandbox = fleet.get(sandbox_id)
        if stdio:
            result = interact(sandbox, tuple(stdio_argv()), tty=False, user="0", max_output=SESSION_OUTPUT)
        else:
            result = interact(sandbox, tuple(login_argv(command)), tty=tty, user=user, max_output=SESSION_OUTPUT)
    sys.exit(exit_code(result))


def _public_keys(files: tuple[str, ...]) -> list[str]:
    """The contents of the --key files, or of ~/.ssh/id_*.pub when none is named."""
    paths = list(files) or sorted(glob.glob(os.path.expanduser("~/.ssh/id_*.pub")))
    if not paths:
        raise click.UsageError("no public key to authorize: pass --key ~/.ssh/id_ed25519.pub (make one with ssh-keygen)")
    texts = []
    for path in paths:
        try:
            texts.append(Path(path).read_text())
        except (OSError, UnicodeDecodeError) as err:
            raise click.BadParameter(f"cannot read {path}: {err}", param_hint="--key") from None
    return texts


def _sshd(ctx: click.Context, sandbox_id: str, user: str | None, keys: list[str], port: int) -> None:
    login = user or "root"
    with _fleet(ctx) as fleet:
        access = fleet.get(sandbox_id).enable_ssh(keys, port=port)
        console.print(f"host key: {access.host_key}", highlight=False, soft_wrap=True)
        if access.address is None:  # through a server over TCP: SSH rides on its API
            proxy = f"fanfold --url {ctx.obj['url']} ssh --stdio %h"  # the token comes from FANFOLD_TOKEN
            click.echo(f"ssh -o ProxyCommand='{proxy}' {login}@{sandbox_id}")
            return
        host, _, host_port = access.address.rpartition(":")
        click.echo(f"ssh -p {host_port} {login}@{host}")
        if ctx.obj["url"]:
            return  # the server holds the port open as long as the sandbox lives
        console.print(f"forwarding {access.address} to sshd in {sandbox_id}; Ctrl-C to stop", highlight=False)
        threading.Event().wait()
