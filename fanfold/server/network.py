"""Routes of sandboxes' networks: their policy, what went through the proxy, and exposed ports
(``/v1/sandboxes/{id}/ports/{port}/...`` passes HTTP requests to a service inside, under the
caller's token)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import h11
from fastapi import APIRouter, Depends, Path, Request, Response
from fastapi.responses import StreamingResponse

from ..engine import Engine
from ..errors import InvalidRequest, PortUnreachable
from ..wire import info_to_json
from ..web.deps import ERRORS, LOCAL_TENANT, engine, owned_sandbox, tenant
from ..web.schemas import NetworkRequest, PortBody, SandboxBody, network_value

router = APIRouter(prefix="/v1/sandboxes", tags=["network"])
recordings_router = APIRouter(prefix="/v1/recordings", tags=["network"])
PortNumber = Path(ge=1, le=65535, description="A TCP port inside the sandbox.")
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
              b"transfer-encoding", b"upgrade", b"host", b"authorization", b"content-length"}
"""Request headers not passed on: the hop's own, and the caller's fanfold token (never the sandbox's business)."""
RESPONSE_HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"proxy-authenticate", b"trailer",
                       b"upgrade"}
CHUNK = 65536
RESPONSE_TIMEOUT_S = 300.0
"""How long the port route waits for a service's response head."""
PORT_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


@recordings_router.get("", responses=ERRORS)
async def recordings(request: Request, caller: str = Depends(tenant)) -> list[dict[str, Any]]:
    """The caller's network recordings: name, exchanges, bytes of bodies, when made."""
    return await engine(request).recordings(tenant=caller)


@recordings_router.delete("/{name}", status_code=204, responses=ERRORS)
async def delete_recording(request: Request, name: str, caller: str = Depends(tenant)) -> Response:
    """Delete one of the caller's recordings that no sandbox records into or replays from now."""
    await engine(request).delete_recording(name, tenant=caller)
    return Response(status_code=204)


@router.put("/{sandbox_id}/network", response_model=SandboxBody, responses=ERRORS)
async def set_network(body: NetworkRequest, request: Request, sandbox_id: str = Depends(owned_sandbox),
                      caller: str = Depends(tenant)) -> dict[str, Any]:
    """Change the sandbox's network policy while it runs: new connections and later commands follow it
    at once; with ``cut``, connections already open end too."""
    info = await engine(request).set_network(sandbox_id, network_value(body.network), cut=body.cut, tenant=caller)
    return info_to_json(info)


@router.get("/{sandbox_id}/network", responses=ERRORS)
async def network_stats(request: Request, sandbox_id: str = Depends(owned_sandbox)) -> dict[str, Any]:
    """The sandbox's traffic through the proxy: connections, requests, bytes up and down, denials and why."""
    return await engine(request).network_stats(sandbox_id)


@router.post("/{sandbox_id}/ports/{port}", response_model=PortBody, responses=ERRORS)
async def expose(request: Request, port: int = PortNumber, sandbox_id: str = Depends(owned_sandbox),
                 caller: str = Depends(tenant)) -> dict[str, Any]:
    """Where ``port`` inside the sandbox is reached: this server's port route (HTTP, with the caller's
    token) and, for the host's own tenant, a port on the server host's loopback (any TCP)."""
    fleet: Engine = engine(request)
    if port == fleet.config.proxy_port:
        raise InvalidRequest(f"port {port} inside a sandbox is its egress proxy's, not a service of its own")
    direct = await fleet.expose(sandbox_id, port) if caller == LOCAL_TENANT else None
    if direct is None:
        await fleet.get(sandbox_id)
    return {"port": port, "path": f"/v1/sandboxes/{sandbox_id}/ports/{port}/", "direct": direct}


async def to_port(request: Request, path: str, port: int = PortNumber,
                  sandbox_id: str = Depends(owned_sandbox)) -> Response:
    """Pass an HTTP request to the service on ``port`` inside the sandbox and stream its answer back
    (502 when nothing answers there)."""
    sock = await engine(request).connect_port(sandbox_id, port)  # PortUnreachable: a 502 with fanfold's error body
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        return await _forward(request, path, port, reader, writer)
    except BaseException:
        writer.close()
        raise


for _method in PORT_METHODS:  # one operation each: OpenAPI ids must be unique
    router.add_api_route("/{sandbox_id}/ports/{port}/{path:path}", to_port, methods=[_method], responses=ERRORS,
                         name=f"to_port_{_method.lower()}", operation_id=f"to_port_{_method.lower()}")


async def _forward(request: Request, path: str, port: int, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> Response:
    conn = h11.Connection(h11.CLIENT)
    # The path as the caller sent it, still percent-encoded: decoded, %2F would become a separator
    raw = request.scope.get("raw_path") or request.url.path.encode()
    prefix = f"/v1/sandboxes/{request.path_params['sandbox_id']}/ports/{port}".encode()
    target = raw[len(prefix):] if raw.startswith(prefix) else b"/" + path.encode()
    if request.url.query:
        target += b"?" + request.url.query.encode()
    headers = [(k, v) for k, v in request.headers.raw if k.lower() not in HOP_BY_HOP]
    headers += [(b"host", f"127.0.0.1:{port}".encode()), (b"transfer-encoding", b"chunked"), (b"connection", b"close")]
    if request.method in ("GET", "HEAD", "OPTIONS", "DELETE") and b"content-length" not in dict(request.headers.raw):
        headers = [h for h in headers if h[0] != b"transfer-encoding"]
        body_stream = None
    else:
        body_stream = request.stream()
    writer.write(conn.send(h11.Request(method=request.method, target=target, headers=headers)))
    if body_stream is not None:
        async for chunk in body_stream:
            if chunk:
                writer.write(conn.send(h11.Data(data=chunk)))
                await writer.drain()
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()
    try:
        event = await asyncio.wait_for(_next_event(conn, reader), RESPONSE_TIMEOUT_S)
        while isinstance(event, h11.InformationalResponse):
            event = await asyncio.wait_for(_next_event(conn, reader), RESPONSE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise PortUnreachable(f"the service on port {port} did not answer within {RESPONSE_TIMEOUT_S:g} s") from None
    if not isinstance(event, h11.Response):
        writer.close()
        raise PortUnreachable(f"the service on port {port} closed the connection without answering")
    passed = [(k.lower(), v) for k, v in event.headers if k.lower() not in RESPONSE_HOP_BY_HOP]

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                part = await _next_event(conn, reader)
                if isinstance(part, h11.Data):
                    yield bytes(part.data)
                else:
                    return
        finally:
            writer.close()

    answer = StreamingResponse(body(), status_code=event.status_code)
    answer.raw_headers = passed  # as the service sent them, repeated ones (Set-Cookie) included
    if not any(k == b"content-length" for k, _ in passed) and request.method != "HEAD":
        answer.raw_headers.append((b"transfer-encoding", b"chunked"))
    return answer


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return h11.ConnectionClosed()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(CHUNK))
            continue
        return event
