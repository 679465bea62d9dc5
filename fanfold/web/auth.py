"""Tenancy: each bearer token is a tenant; a tenant sees only its own sandboxes, snapshots,
images and pools, and holds at most what its quota allows.

Callers on the unix socket (mode 0600, so root on this host) may omit the token and act as
the local tenant, which also owns what the embedded SDK and the CLI create, sees every
image and has no quota. Over TCP a token is always required.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from starlette.requests import HTTPConnection

from ..config import Quota
from ..errors import InvalidRequest, Unauthorized

LOCAL_TENANT = ""


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "ff_" + secrets.token_urlsafe(32)


class Tenants:
    """Token digests to tenant names (tokens themselves are never kept)."""

    def __init__(self, tokens: dict[str, str] | None = None, quotas: dict[str, Quota] | None = None) -> None:
        self._by_digest: dict[str, str] = {}
        self.quotas: dict[str, Quota] = dict(quotas or {})
        """Each tenant's quota; a tenant not named here has none."""
        self.ssh_keys: dict[str, tuple[str, ...]] = {}
        """Each tenant's registered SSH public keys: what its sandboxes' sshd authorizes (``enable_ssh``)."""
        for token, tenant in (tokens or {}).items():
            self.add(token, tenant)

    def add(self, token: str, tenant: str | None = None) -> str:
        if len(token) < 16 or not token.isprintable() or " " in token:
            raise InvalidRequest("a token needs at least 16 printable characters and no spaces")
        name = tenant if tenant is not None else "t-" + _digest(token)[:12]  # LOCAL_TENANT: the host's own
        self._by_digest[_digest(token)] = name
        return name

    @classmethod
    def from_file(cls, path: str | Path) -> Tenants:
        """Lines of ``TENANT TOKEN [QUOTA=N ...]``, quotas being ``sandboxes``, ``memory_mb``, ``disk_mb``,
        ``pools``, ``recordings`` and ``recordings_mb`` (``alice ff_... sandboxes=8 memory_mb=8192``); blank
        lines and ``#`` comments are skipped. A tenant with several tokens gives its quotas on one of its lines."""
        tenants = cls()
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as err:
            raise InvalidRequest(f"cannot read the tokens file {path}: {err.strerror}") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            parts = line.split()
            if len(parts) < 2:
                raise InvalidRequest(f"{path}:{number}: expected 'TENANT TOKEN [QUOTA=N ...]'")
            tenants.add(parts[1], parts[0])
            if len(parts) > 2:
                if parts[0] in tenants.quotas:
                    raise InvalidRequest(f"{path}:{number}: tenant {parts[0]!r} has quotas on an earlier line already")
                try:
                    tenants.quotas[parts[0]] = Quota.parse(parts[2:])
                except ValueError as err:
                    raise InvalidRequest(f"{path}:{number}: {err}") from None
        return tenants

    def load_ssh_keys(self, path: str | Path) -> None:
        """Register tenants' SSH public keys from lines of ``TENANT TYPE BASE64 [COMMENT]``."""
        from ..ssh import parse_tenant_keys

        try:
            text = Path(path).read_text()
        except OSError as err:
            raise InvalidRequest(f"cannot read the SSH keys file {path}: {err.strerror}") from None
        self.ssh_keys = parse_tenant_keys(text, str(path))

    def __len__(self) -> int:
        return len(self._by_digest)

    def tenant_of_token(self, token: str) -> str | None:
        """The tenant a raw token stands for (an E2B API key, say), or None."""
        return self._by_digest.get(_digest(token.strip()))

    def tenant_for(self, conn: HTTPConnection) -> str:
        """The caller's tenant, or Unauthorized."""
        header = conn.headers.get("authorization")
        if header is None:
            if _over_unix_socket(conn):
                return LOCAL_TENANT
            raise Unauthorized("this server needs a bearer token: pass token= or set FANFOLD_TOKEN")
        scheme, _, token = header.partition(" ")
        tenant = self._by_digest.get(_digest(token.strip())) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise Unauthorized("the bearer token is not valid on this server")
        return tenant


def _over_unix_socket(conn: HTTPConnection) -> bool:
    # uvicorn reports (path, None) as the server address of a unix socket, (host, port) for
    # TCP; anything else is treated as TCP, which needs a token.
    server = conn.scope.get("server")
    return isinstance(server, (tuple, list)) and len(server) == 2 and server[1] is None
