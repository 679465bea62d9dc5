"""``enable_ssh``: a real sshd in a sandbox, started through any fleet's own calls (exec, expose),
so the in-process engine, its workers and a server share this one piece."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InvalidRequest
from ..ssh import SshAccess, check_port, check_public_keys, setup_script

if TYPE_CHECKING:
    from .api import EngineAPI

SETUP_TIMEOUT_S = 30.0


async def enable_ssh(fleet: EngineAPI, sandbox_id: str, authorized_keys: list[str] | tuple[str, ...], *,
                     port: int = 22, expose: bool = True) -> SshAccess:
    """Start (or keep) sshd in the sandbox, authorizing exactly ``authorized_keys``; with ``expose``,
    reach it from the host's loopback too."""
    keys = check_public_keys(authorized_keys)
    if not keys:
        raise InvalidRequest("give at least one public key to authorize (the contents of a .pub file):"
                             " sshd here accepts keys only")
    done = await fleet.exec(sandbox_id, ["/bin/sh", "-c", setup_script(check_port(port))], user="0",
                            stdin="".join(key + "\n" for key in keys), timeout=SETUP_TIMEOUT_S)
    lines = done.stdout.decode(errors="replace").split("\n")
    if done.outcome.value != "exited" or done.exit_code != 0 or len(lines) < 2 or not lines[0].isdigit():
        why = done.stderr.decode(errors="replace").strip() or f"setup {done.outcome.value} ({done.exit_code})"
        raise InvalidRequest(f"cannot start sshd in sandbox {sandbox_id}: {why}")
    listening = int(lines[0])
    address = None
    if expose:
        url = await fleet.expose(sandbox_id, listening)
        address = url.removeprefix("http://").rstrip("/")
    return SshAccess(sandbox_id=sandbox_id, port=listening, host_key=lines[1].strip(), address=address)
