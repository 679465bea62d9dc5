"""The HTTP API: a thin FastAPI app over one engine (auth, validation, errors to status codes)."""

from __future__ import annotations

import dataclasses
import logging
import re
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..__version__ import __version__
from ..config import EngineConfig
from ..engine import Engine
from ..errors import FanfoldError, InvalidRequest, NotFound, host_full
from ..integrations import e2b, openenv, rft
from ..web import rollouts
from ..web.auth import Tenants
from ..web.deps import ClientGone, seen_by, tenant
from ..web.schemas import WhoAmI
from ..web.status import bug_body, error_response
from . import compose, files, groups, host, images, network, sandboxes, snapshots, ssh
from .creates import CreateRegistry

log = logging.getLogger("fanfold.server")
MAX_JSON_BODY = 96 * 1024 * 1024
"""Largest JSON request body (64 MiB of exec stdin, base64); file contents and build contexts stream."""
_FILE_CONTENT = re.compile(r"^/v1/sandboxes/[^/]+/files/content$")
_PORT_ROUTE = re.compile(r"^/v1/sandboxes/[^/]+/ports/[0-9]+/")
"""Bodies sent to a sandbox's service stream through, whatever their size."""
_OPEN_PATHS = ("/v1/health",)

DESCRIPTION = """Isolated sandboxes for RL rollouts, on one host.

Authenticate with `Authorization: Bearer <token>` (optional on the unix socket). Errors are
JSON `{"kind", "message"}`: 401 bad token, 404 unknown sandbox or snapshot (or another
tenant's), 409 wrong state or a snapshot still in use, 410 a rollout that ended, 413 body too
large, 422 bad input (a tool call's also carries a `function_call_output` for the model),
429/503 retry after `Retry-After` seconds, 500 only for fanfold's own bugs.
"""


def create_app(config: EngineConfig | None = None, tenants: Tenants | None = None) -> FastAPI:
    """The app with its own engine, started and closed with the app's lifespan."""
    tenants = tenants or Tenants()
    engine = Engine(dataclasses.replace(config or EngineConfig(), quotas=tuple(tenants.quotas.items())))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await app.state.creates.close()
            await app.state.rollouts.close()
            await engine.close()

    app = FastAPI(title="fanfold", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.engine = engine
    app.state.tenants = tenants
    app.state.creates = CreateRegistry(engine)
    app.state.rollouts = rollouts.Rollouts(engine)
    _add_error_handlers(app)
    app.add_middleware(Gate, tenants=app.state.tenants, limit=MAX_JSON_BODY)
    app.add_middleware(e2b.SandboxHosts)  # outside the Gate: E2B's PORT-SANDBOX.DOMAIN hosts, to the port route
    for router in (sandboxes.router, groups.router, compose.router, snapshots.router, files.router, images.router,
                   images.registries, host.router, rollouts.router, network.router, network.recordings_router,
                   ssh.router):
        app.include_router(router)
    app.include_router(rft.router)  # Agent RFT's tool and grader endpoints
    app.include_router(openenv.router)  # OpenEnv environment servers: /openenv/{env}/ws
    # E2B's API and envd: /e2b, /e2b/envd (its lifespan ends its processes); E2B's protocol, not
    # fanfold's: its statuses are what the e2b SDK expects (502 for a sandbox that is not there)
    app.include_router(e2b.router, include_in_schema=False)

    @app.get("/v1/whoami", response_model=WhoAmI, responses=sandboxes.ERRORS, tags=["server"])
    async def whoami(caller: str = Depends(tenant)) -> dict[str, str]:
        """The caller's tenant ("" for the local tenant); checks the token."""
        return {"tenant": caller, "version": __version__}

    @app.get("/metrics", tags=["host"], response_class=Response, responses=sandboxes.ERRORS)
    async def metrics(request: Request) -> Response:
        """Prometheus metrics, where scrapers look by default (the bearer token is checked here too)."""
        caller = app.state.tenants.tenant_for(request)
        return Response(await engine.metrics_text(tenant=seen_by(caller)), media_type=host.PROMETHEUS)

    @app.get("/v1/health", tags=["server"])
    async def health() -> dict[str, bool]:
        return {"ok": True}

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(FanfoldError)
    async def fanfold_error(_: Request, err: FanfoldError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        problems = "; ".join(_describe(item) for item in err.errors()[:5])
        return error_response(InvalidRequest(f"invalid request: {problems}"))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException) -> JSONResponse:
        cls = NotFound if err.status_code == 404 else InvalidRequest
        return error_response(cls(str(err.detail)), err.status_code)

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def gone(_: Request, err: Exception) -> JSONResponse:
        return error_response(InvalidRequest("the client disconnected; the work was cancelled"), 499)

    @app.exception_handler(Exception)
    async def bug(_: Request, err: Exception) -> JSONResponse:
        if (full := host_full(err)) is not None:
            log.warning("fanfold server: %s", full)
            return error_response(full)
        log.exception("fanfold server: unexpected error")
        return JSONResponse(bug_body(err), 500)


def _describe(item: dict[str, Any]) -> str:
    where = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
    return f"{where or 'body'}: {item.get('msg', 'invalid')}"


class Gate:
    """Before any body is read: the bearer token (401 at once), then the size of JSON bodies
    (413). File contents and tar build contexts stream, so they are not capped here."""

    def __init__(self, app: ASGIApp, tenants: Tenants, limit: int) -> None:
        self.app = app
        self.tenants = tenants
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/") or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        try:
            if "tenant" not in state:  # else a layer before this one vouched for it (an E2B sandbox host's token)
                state["tenant"] = self.tenants.tenant_for(HTTPConnection(scope))
        except FanfoldError as err:
            await error_response(err)(scope, receive, send)
            return
        headers = dict(scope["headers"])
        streamed = (scope["method"] == "PUT" and _FILE_CONTENT.match(scope["path"])) or _PORT_ROUTE.match(scope["path"]) or (
            scope["method"] == "POST" and scope["path"] in ("/v1/images", "/v1/images/import")
            and headers.get(b"content-type", b"").startswith(b"application/x-tar")
        )
        if streamed:
            await self.app(scope, receive, send)
            return
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            await error_response(InvalidRequest(self._message()), 413)(scope, receive, send)
            return
        seen = 0
        refused = False

        async def counted() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                # Answer 413 here: the app only sees the client leave, and its reply is dropped.
                refused = True
                await error_response(InvalidRequest(self._message()), 413)(scope, receive, send)
                return {"type": "http.disconnect"}
            return message

        async def unless_refused(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counted, unless_refused)

    def _message(self) -> str:
        return f"the request body is over {self.limit // (1024 * 1024)} MiB: stream large files with PUT .../files/content"
