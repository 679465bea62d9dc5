"""The remote transport's HTTP/1.1 client against real sockets: the edges a fanfold server
rarely shows on its own (a kept-alive connection closed under it, chunked replies, a stream
dropped half read). Everything else it does runs in every unix and tcp test of the SDK."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fanfold.transport.h1 import Client, ConnectionLost


class Server:
    """A real asyncio server on a unix socket that answers each request with ``reply`` and
    then, per ``hang_up``, closes the connection without saying so; it records what it saw."""

    def __init__(self, path: Path, reply: bytes, *, hang_up: bool = False) -> None:
        self.path, self.reply, self.hang_up = path, reply, hang_up
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed_by_client = asyncio.Event()

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_unix_server(self._serve, str(self.path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                if b"\r\ntransfer-encoding: chunked\r\n" in head.lower():
                    self.requests.append(head + await reader.readuntil(b"\r\n0\r\n\r\n"))
                else:
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    self.requests.append(head + await reader.readexactly(length))
                writer.write(self.reply)
                await writer.drain()
                if self.hang_up:
                    break
            if reader.at_eof():
                self.closed_by_client.set()
        except asyncio.IncompleteReadError:
            self.closed_by_client.set()
        finally:
            writer.close()


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"


async def test_keep_alive_reuses_one_connection_and_sends_json(tmp_path):
    async with Server(tmp_path / "s.sock", OK) as server:
        client = Client(socket_path=str(server.path), headers={"Authorization": "Bearer t"})
        for _ in range(3):
            async with client.request("POST", "/v1/x", json={"a": 1}, params=[("label", "k=v")]) as response:
                assert (response.status, await response.json()) == (200, {})
        await client.close()
    assert server.connections == 1 and len(server.requests) == 3
    first = server.requests[0]
    assert first.startswith(b"POST /v1/x?label=k%3Dv HTTP/1.1\r\n") and first.endswith(b'\r\n\r\n{"a": 1}')
    assert b"Authorization: Bearer t\r\n" in first and b"Host: fanfold\r\n" in first


async def test_a_connection_the_server_closed_while_idle_is_replaced(tmp_path):
    async with Server(tmp_path / "s.sock", OK, hang_up=True) as server:
        client = Client(socket_path=str(server.path))
        for _ in range(3):  # each reply's connection is gone by the next request
            async with client.request("GET", "/v1/x") as response:
                assert await response.read() == b"{}"
        await client.close()
    assert server.connections == 3


async def test_chunked_replies_stream_piece_by_piece(tmp_path):
    body = b"".join(b"%x\r\n%b\r\n" % (len(part), part) for part in (b'{"a":1}\n', b'{"b":', b"2}\n")) + b"0\r\n\r\n"
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    async with Server(tmp_path / "s.sock", reply) as server:
        client = Client(socket_path=str(server.path))
        async with client.request("GET", "/stream") as response:
            assert [chunk async for chunk in response.iter_any()] == [b'{"a":1}\n', b'{"b":', b"2}\n"]
        async with client.request("GET", "/stream") as response:  # the connection was left clean for reuse
            assert await response.read() == b'{"a":1}\n{"b":2}\n'
        await client.close()
    assert server.connections == 1


async def test_a_reply_dropped_half_read_hangs_up_so_the_server_sees_it(tmp_path):
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"  # and more, never sent
    async with Server(tmp_path / "s.sock", reply) as server:
        client = Client(socket_path=str(server.path))
        async with client.request("POST", "/exec", json={"cmd": "sleep 60"}) as response:
            async for chunk in response.iter_any():
                assert chunk == b"hello"
                break
        await asyncio.wait_for(server.closed_by_client.wait(), 30)
        await client.close()
    assert server.requests[0].startswith(b"POST /exec HTTP/1.1\r\n")


async def test_no_server_is_connection_lost(tmp_path):
    client = Client(socket_path=str(tmp_path / "none.sock"))
    with pytest.raises(ConnectionLost, match="cannot connect"):
        async with client.request("GET", "/"):
            pass


async def test_a_streamed_body_goes_chunked(tmp_path):
    async def parts():
        for part in (b"hello ", b"", b"world"):
            yield part

    async with Server(tmp_path / "s.sock", OK) as server:
        client = Client(socket_path=str(server.path))
        async with client.request("PUT", "/content", data=parts()) as response:
            assert await response.json() == {}
        await client.close()
    head, body = server.requests[0].split(b"\r\n\r\n", 1)
    assert b"Transfer-Encoding: chunked" in head and b"Content-Length" not in head
    assert body == b"6\r\nhello \r\n5\r\nworld\r\n0\r\n\r\n"


async def test_a_reply_that_says_connection_close_is_not_kept(tmp_path):
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    async with Server(tmp_path / "s.sock", reply) as server:
        client = Client(socket_path=str(server.path))
        for _ in range(2):
            async with client.request("GET", "/v1/x") as response:
                assert await response.json() == {}
        await client.close()
    assert server.connections == 2


@pytest.mark.parametrize("reply, match", [
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "not HTTP/1.1"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello", "broke off"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n", "broke off"),
], ids=["not-http", "short-body", "bad-chunk"])
async def test_a_malformed_or_cut_reply_is_connection_lost(tmp_path, reply, match):
    async with Server(tmp_path / "s.sock", reply, hang_up=True) as server:
        client = Client(socket_path=str(server.path))
        with pytest.raises(ConnectionLost, match=match):
            async with client.request("GET", "/v1/x") as response:
                await response.read()
        assert not client._idle  # the broken connection is not kept for the next request
        await client.close()


async def test_a_tcp_connection_reset_before_it_is_set_up_is_connection_lost(monkeypatch):
    """A server that dies just after accepting (a Ray node going away) resets the connection before
    the client sets its keepalive options: the closed socket is a lost connection, not a bare OSError."""
    server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    opening = asyncio.open_connection

    async def reset_at_once(*args: object, **kwargs: object):
        reader, writer = await opening(*args, **kwargs)
        writer.transport.abort()  # the socket is closed before the caller sees it, as after a reset
        await writer.wait_closed()
        return reader, writer

    monkeypatch.setattr(asyncio, "open_connection", reset_at_once)
    client = Client(host="127.0.0.1", port=port)
    try:
        with pytest.raises(ConnectionLost, match="closed as it opened"):
            async with client.request("GET", "/"):
                pass
    finally:
        server.close()
        await server.wait_closed()
