"""E2B's sandbox hosts: ``sbx.get_host(port)`` is ``PORT-SANDBOX.DOMAIN``, and a request for that host
reaches the service on that port inside the sandbox, through fanfold's port route
(``/v1/sandboxes/{id}/ports/{port}/...``).

The domain is ``FANFOLD_E2B_DOMAIN`` (wildcard DNS to the server), else the host the client reached
the API at. A request must carry the sandbox's traffic token (``e2b-traffic-access-token``, the
SDK's ``sbx.traffic_access_token``): fanfold's sandbox ports are never public.
"""

from __future__ import annotations

import hmac
import re

from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ...config import env_e2b_domain
from .auth import envd_tokens

TOKEN_HEADER = "e2b-traffic-access-token"
_SANDBOX_HOST = re.compile(r"([0-9]{1,5})-(sb-[0-9a-z-]{1,64})\.[^/]+")


def domain(request: HTTPConnection) -> str:
    """Where the SDK names a sandbox's hosts: the configured domain, else the API's own host."""
    return env_e2b_domain() or request.headers.get("host") or request.url.netloc


class SandboxHosts:
    """Passes a request for ``PORT-SANDBOX.DOMAIN`` with the sandbox's traffic token to fanfold's port
    route, as the sandbox's tenant; any other request goes on untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = dict(scope.get("headers", ())).get(b"host", b"").decode("latin-1") if scope["type"] == "http" else ""
        found = _SANDBOX_HOST.fullmatch(host)
        if found is None:
            await self.app(scope, receive, send)
            return
        port, sandbox_id = found.groups()
        app = scope["app"]
        given = HTTPConnection(scope).headers.get(TOKEN_HEADER, "")
        owner = app.state.engine.tenant_of(sandbox_id)
        if owner is None or not hmac.compare_digest(envd_tokens(app).token(sandbox_id), given):
            await JSONResponse({"code": 404, "message": f"no sandbox {sandbox_id} for this traffic token (send it"
                                " in e2b-traffic-access-token)"}, 404)(scope, receive, send)
            return
        prefix = f"/v1/sandboxes/{sandbox_id}/ports/{port}"
        scope = {**scope, "path": prefix + scope["path"], "raw_path": prefix.encode() + scope.get("raw_path", b"/"),
                 "state": {**scope.get("state", {}), "tenant": owner}}
        await self.app(scope, receive, send)
