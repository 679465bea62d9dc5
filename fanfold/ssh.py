"""SSH into sandboxes, two ways, and the logic of both without I/O.

- ``fanfold ssh ID``: a login shell over fanfold's own agent channel (no sshd, any transport):
  ``LOGIN`` finds the user's shell in the sandbox's /etc/passwd and runs it as ssh's server would.
- ``enable_ssh``: a real OpenSSH server inside the sandbox, for tools that insist on SSH (VS Code
  remote, Harbor's stream mode). ``setup_script`` writes its config, host key and authorized keys
  under ``SSHD_DIR`` and starts ``sshd`` under the sandbox's agent; the engine then exposes its
  port. It authorizes public keys only: the caller's, and on a server its tenant's registered keys
  (``fanfold serve --ssh-keys``), never another tenant's.

A fork copies the disk and the running sshd, so its children keep the parent's host key: they are
copies of one machine, all the same tenant's, and a known_hosts entry stays valid for each.
"""

from __future__ import annotations

import base64
import binascii
import shlex
import struct
from dataclasses import asdict, dataclass
from typing import Any

from .errors import InvalidRequest

SSHD_DIR = "/etc/fanfold-ssh"
"""Inside the sandbox: sshd_config, the host key and authorized_keys (all root's)."""
SSHD_CONFIG = f"{SSHD_DIR}/sshd_config"
SSHD = "/usr/sbin/sshd"
DEFAULT_PORT = 22
MAX_KEYS = 256
"""The most public keys one sandbox authorizes."""
SESSION_OUTPUT = 1 << 62
"""Output one ``fanfold ssh`` session may carry: no limit in practice (a live exec keeps none)."""
KEY_TYPES = frozenset({"ssh-ed25519", "ssh-rsa", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384",
                       "ecdsa-sha2-nistp521", "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com"})


@dataclass(frozen=True)
class SshAccess:
    """Where a sandbox's sshd is reached, and the host key that proves it is that sandbox's."""

    sandbox_id: str
    port: int
    """sshd's port inside the sandbox."""
    host_key: str
    """sshd's public host key (``ssh-ed25519 AAAA...``), for a known_hosts line."""
    address: str | None = None
    """``127.0.0.1:N`` on the host (embedded, or the host's own tenant of a server); None through a server
    over TCP: then ``ProxyCommand fanfold ssh --stdio ID`` carries SSH over the server's API."""

    def known_hosts(self, host: str | None = None) -> str:
        """A known_hosts line for this sandbox's host key (``host``: as the client will name it)."""
        if host is None and self.address is not None:
            address, _, port = self.address.rpartition(":")
            host = f"[{address}]:{port}"  # how ssh names a host on a port other than 22
        name = host or self.sandbox_id
        return f"{name} {self.host_key}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SshAccess:
        return cls(sandbox_id=data["sandbox_id"], port=int(data["port"]), host_key=data["host_key"],
                   address=data.get("address"))


def check_public_keys(keys: Any) -> tuple[str, ...]:
    """OpenSSH public key lines (``TYPE BASE64 [COMMENT]``), checked and normalized. Options
    (``command="..."``, ``from=...``) are refused: a key opens the sandbox, nothing more, nothing less."""
    if isinstance(keys, str) or not isinstance(keys, (list, tuple)):
        raise InvalidRequest(f"authorized_keys is a list of public key lines, got {type(keys).__name__}")
    lines = [line for key in keys for line in _lines(key)]
    if len(lines) > MAX_KEYS:
        raise InvalidRequest(f"at most {MAX_KEYS} public keys, got {len(lines)}")
    return tuple(dict.fromkeys(_check_key(line) for line in lines))


def _lines(key: Any) -> list[str]:
    if not isinstance(key, str):
        raise InvalidRequest(f"a public key is a string, got {type(key).__name__}")
    return [line.strip() for line in key.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _check_key(line: str) -> str:
    parts = line.split(None, 2)
    shown = line if len(line) < 60 else line[:57] + "..."
    if len(parts) < 2 or parts[0] not in KEY_TYPES:
        raise InvalidRequest(f"not an OpenSSH public key (TYPE BASE64 [COMMENT], no options): {shown!r}; give the"
                             " contents of a .pub file, e.g. ~/.ssh/id_ed25519.pub")
    try:
        fields = _fields(base64.b64decode(parts[1], validate=True))
        inner = fields[0].decode()
    except (binascii.Error, struct.error, UnicodeDecodeError, ValueError, IndexError):
        inner = None
    if inner != parts[0]:
        raise InvalidRequest(f"the public key {shown!r} is damaged: its data is not a {parts[0]} key")
    comment = "".join(ch for ch in (parts[2] if len(parts) > 2 else "") if ch.isprintable())
    return " ".join(p for p in (parts[0], parts[1], comment) if p)


def _fields(blob: bytes) -> list[bytes]:
    """A key's wire form: length-prefixed strings that fill it exactly (a cut or padded key does not)."""
    fields, at = [], 0
    while at < len(blob):
        (size,) = struct.unpack(">I", blob[at:at + 4])
        if at + 4 + size > len(blob):
            raise ValueError("a field runs past the end")
        fields.append(blob[at + 4:at + 4 + size])
        at += 4 + size
    return fields


def parse_tenant_keys(text: str, source: str) -> dict[str, tuple[str, ...]]:
    """``fanfold serve --ssh-keys FILE``: lines of ``TENANT TYPE BASE64 [COMMENT]`` (blank lines and
    ``#`` comments skipped); a tenant may have many lines."""
    found: dict[str, list[str]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        tenant, _, key = line.strip().partition(" ")
        try:
            found.setdefault(tenant, []).extend(check_public_keys([key]))
        except InvalidRequest as err:
            raise InvalidRequest(f"{source}:{number}: expected 'TENANT TYPE BASE64 [COMMENT]': {err}") from None
    return {tenant: tuple(dict.fromkeys(keys)) for tenant, keys in found.items()}


def check_port(port: Any) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidRequest(f"sshd's port is a whole number from 1 to 65535, got {port!r}")
    return port


def setup_script(port: int) -> str:
    """A POSIX sh script, run as root in the sandbox with the authorized keys on its stdin: it writes
    them, makes the host key once, adds the privilege separation user sshd needs when the image lacks
    it, and starts sshd unless it runs already. It prints the port sshd listens on, then the host key.
    Exit 3: the image has no OpenSSH server."""
    return _SETUP.replace("@DIR@", SSHD_DIR).replace("@SSHD@", SSHD).replace("@PORT@", str(check_port(port)))


# sshd always separates privileges (OpenSSH >= 7.5): it needs a user named sshd and a root-owned
# /run/sshd to chroot into, both of which work as root of the sandbox's user namespace. Without
# UsePAM (an image's PAM stack expects a host's login setup) sshd itself refuses locked accounts.
_SETUP = r"""set -eu
d=@DIR@
umask 022
if [ ! -x @SSHD@ ] || ! command -v ssh-keygen >/dev/null; then
  echo "this image has no OpenSSH server (@SSHD@, ssh-keygen): install openssh-server in it" >&2; exit 3
fi
mkdir -p "$d" /run/sshd
chmod 0755 "$d" /run/sshd
cat > "$d/authorized_keys.new"
mv "$d/authorized_keys.new" "$d/authorized_keys"
if ! grep -q '^sshd:' /etc/passwd; then
  uid=100
  while cut -d: -f3 /etc/passwd | grep -qx "$uid"; do uid=$((uid + 1)); done
  echo "sshd:x:$uid:65534:sshd privilege separation:/run/sshd:/usr/sbin/nologin" >> /etc/passwd
fi
[ -s "$d/ssh_host_ed25519_key" ] || ssh-keygen -q -t ed25519 -N '' -C '' -f "$d/ssh_host_ed25519_key"
pid=$(cat "$d/sshd.pid" 2>/dev/null || true)
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
  sed -n 's/^Port //p' "$d/sshd_config"; cat "$d/ssh_host_ed25519_key.pub"; exit 0
fi
cat > "$d/sshd_config" <<EOF
Port @PORT@
ListenAddress 127.0.0.1
HostKey $d/ssh_host_ed25519_key
AuthorizedKeysFile $d/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
PidFile $d/sshd.pid
AcceptEnv LANG LC_*
Subsystem sftp internal-sftp
EOF
@SSHD@ -t -f "$d/sshd_config"
rm -f "$d/sshd.pid"
(setsid @SSHD@ -D -f "$d/sshd_config" -E "$d/sshd.log" </dev/null >/dev/null 2>&1 & echo $! > "$d/starting")
pid=$(cat "$d/starting")
# sshd writes its pid file once it listens; until then it may still fail (the port taken)
tries=0
until [ -s "$d/sshd.pid" ]; do
  if ! kill -0 "$pid" 2>/dev/null || [ "$tries" -ge 500 ]; then
    echo "sshd did not start:" >&2; tail -n 5 "$d/sshd.log" >&2; exit 1
  fi
  tries=$((tries + 1)); sleep 0.02
done
echo @PORT@; cat "$d/ssh_host_ed25519_key.pub"
"""

LOGIN = r"""me=$(id -u); found=
while IFS=: read -r name _ uid _ _ home shell; do
  if [ "$uid" = "$me" ]; then found=1; break; fi
done < /etc/passwd
[ -n "$found" ] || { name=$(id -un 2>/dev/null || echo "$me"); home=/; shell=; }
[ -n "$shell" ] && [ -x "$shell" ] || shell=/bin/sh
HOME=${home:-/}; USER=$name; LOGNAME=$name; SHELL=$shell
export HOME USER LOGNAME SHELL
cd "$HOME" 2>/dev/null || cd /
if [ $# -eq 0 ]; then exec "$shell" -l; fi
exec "$shell" -c "$1"
"""
"""``fanfold ssh``'s start inside the sandbox, as sshd starts a session: the user's shell from
/etc/passwd (``/bin/sh`` when it names none that runs), HOME, USER, LOGNAME and SHELL set, in HOME;
a login shell, or with a command ``SHELL -c COMMAND``."""


def login_argv(command: tuple[str, ...]) -> list[str]:
    """The argv of ``fanfold ssh ID [COMMAND...]``: ssh joins a command's words with spaces, and the
    user's shell parses the line."""
    return ["/bin/sh", "-c", LOGIN, "fanfold-ssh", *([" ".join(command)] if command else [])]


def stdio_argv() -> list[str]:
    """``fanfold ssh --stdio``: sshd in inetd mode, speaking SSH on its stdin and stdout."""
    missing = "ssh is not enabled in this sandbox: run `fanfold ssh --sshd ID` (or enable_ssh) first"
    return ["/bin/sh", "-c", f"[ -s {SSHD_CONFIG} ] || {{ echo {shlex.quote(missing)} >&2; exit 255; }};"
            f" exec {SSHD} -i -f {SSHD_CONFIG} -E {SSHD_DIR}/sshd.log"]
