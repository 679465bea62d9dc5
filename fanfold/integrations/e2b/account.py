"""E2B's ``user`` account: E2B's templates have a user ``user`` (uid 1000, home /home/user) whom
commands and file calls run as unless the client names another (``user="root"``).

fanfold makes the account as an E2B sandbox starts, not in an image: any image or snapshot can be
an E2B template, and a sandbox from a snapshot of one already has it (the making is idempotent).
The sandbox carries its default user in a label, so every later call, on any server, knows it.
"""

from __future__ import annotations

import logging

from ...engine import Engine
from ...errors import FanfoldError, FileNotFoundInSandbox
from ...models import SandboxInfo

log = logging.getLogger("fanfold.e2b")
DEFAULT_USER = "user"
USER_LABEL = "e2b.user"
"""The label keeping a sandbox's default E2B user (left out of its metadata)."""
UID = 1000
HOME = "/home/user"
_SETUP_TIMEOUT_S = 30.0


def default_user(info: SandboxInfo) -> str | None:
    """Whom an E2B call runs as when the client names nobody: the sandbox's label, else its own default."""
    return info.labels.get(USER_LABEL) or None


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _has(lines: list[str], name: str) -> bool:
    return any(line.split(":", 1)[0] == name for line in lines)


def _free_id(lines: list[str], column: int) -> int:
    """``UID`` when no entry takes it, else the first free id above it."""
    taken = {fields[column] for fields in (line.split(":") for line in lines) if len(fields) > column}
    found = UID
    while str(found) in taken:
        found += 1
    return found


async def _read(engine: Engine, sandbox_id: str, path: str) -> str | None:
    try:
        return (await engine.read_file(sandbox_id, path)).decode(errors="replace")
    except FileNotFoundInSandbox:
        return None


async def make_account(engine: Engine, sandbox_id: str) -> None:
    """Add ``user`` (uid 1000 where free) with its group, a locked password and its home, unless the
    sandbox has it already. Runs as root; raises FanfoldError when the sandbox cannot run the setup."""
    passwd = _lines(await _read(engine, sandbox_id, "/etc/passwd") or "root:x:0:0:root:/root:/bin/sh")
    if _has(passwd, DEFAULT_USER):
        return
    groups = _lines(await _read(engine, sandbox_id, "/etc/group") or "root:x:0:")
    uid = _free_id(passwd, 2)
    gid = uid if not any(line.split(":")[2:3] == [str(uid)] for line in groups) else _free_id(groups, 2)
    made = await engine.exec(
        sandbox_id, ["/bin/sh", "-c", f"mkdir -p {HOME} && chown {uid}:{gid} {HOME} && chmod 755 {HOME}"
                     " && if [ -x /bin/bash ]; then echo /bin/bash; else echo /bin/sh; fi"],
        user="root", timeout=_SETUP_TIMEOUT_S)
    if made.exit_code != 0:
        raise FanfoldError(f"could not make {HOME} in sandbox {sandbox_id}: {made.stderr.decode(errors='replace')}")
    shell = made.stdout.decode().strip()
    passwd.append(f"{DEFAULT_USER}:x:{uid}:{gid}::{HOME}:{shell}")
    await engine.write_file(sandbox_id, "/etc/passwd", "\n".join(passwd) + "\n")
    if not _has(groups, DEFAULT_USER):
        await engine.write_file(sandbox_id, "/etc/group", "\n".join([*groups, f"{DEFAULT_USER}:x:{gid}:"]) + "\n")
    shadow = await _read(engine, sandbox_id, "/etc/shadow")
    if shadow is not None and not _has(_lines(shadow), DEFAULT_USER):  # PAM (su, sudo) wants an entry
        await engine.write_file(sandbox_id, "/etc/shadow",
                                "\n".join([*_lines(shadow), f"{DEFAULT_USER}:*:20000:0:99999:7:::"]) + "\n", mode=0o600)
