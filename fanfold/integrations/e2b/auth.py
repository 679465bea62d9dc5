"""Who an E2B call is. The control plane's ``X-API-KEY`` is a fanfold token (its tenant); envd
calls carry ``X-Access-Token``, a per-sandbox token derived from a key kept in the state dir,
so it holds across server restarts and needs no table."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

from ...errors import SandboxNotFound, Unauthorized
from ...web.auth import Tenants

KEY_FILE = "e2b/envd.key"


def tenant_of_key(tenants: Tenants, key: str | None) -> str:
    """The tenant whose fanfold token is the E2B API key ``key``; Unauthorized otherwise."""
    if not key:
        raise Unauthorized("missing X-API-KEY: set E2B_API_KEY to a token of this fanfold server")
    tenant = tenants.tenant_of_token(key)
    if tenant is None:
        raise Unauthorized("the API key is not a token of this fanfold server")
    return tenant


class EnvdTokens:
    """Each sandbox's envd access token: HMAC-SHA256 of its id under a key made once per state dir."""

    def __init__(self, state_dir: Path) -> None:
        self._key = _load_key(Path(state_dir) / KEY_FILE)

    def token(self, sandbox_id: str) -> str:
        return hmac.new(self._key, sandbox_id.encode(), hashlib.sha256).hexdigest()

    def check(self, sandbox_id: str, given: str | None) -> None:
        """SandboxNotFound unless ``given`` is the sandbox's token: a wrong token reveals nothing."""
        if not given or not hmac.compare_digest(self.token(sandbox_id), given):
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} for this access token")


def _load_key(path: Path) -> bytes:
    try:
        return bytes.fromhex(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fresh = secrets.token_hex(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(fresh + "\n")
    try:
        os.link(tmp, path)  # the first writer wins; a racing one reads the winner's key
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return bytes.fromhex(path.read_text().strip())


def envd_tokens(app: Any) -> EnvdTokens:
    """The app's EnvdTokens, made on first use from its engine's state dir."""
    found = getattr(app.state, "e2b_envd_tokens", None)
    if found is None:
        found = app.state.e2b_envd_tokens = EnvdTokens(app.state.engine.config.state_dir)
    return found
