"""The remote transport: the engine's methods, spoken over HTTP to ``fanfold serve``.

It has the engine's signatures, so AsyncFleet and AsyncSandbox work unchanged on either.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import tarfile
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator
from urllib.parse import quote, urlsplit

from .. import groups, wire
from .._agent.client import ExecControl
from ..engine.checks import check_mode, file_bytes
from ..engine.execution import check_exec_args
from ..errors import (
    CapacityExceeded, CheckpointFailed, FanfoldError, GroupNotFound, InfrastructureError, InvalidRequest, InvalidSpec,
    LeaseNotFound, NotFound, SandboxNotFound, SnapshotNotFound,
)
from ..groups import GroupInfo, GroupParams, GroupSnapshotInfo
from ..images import Image
from ..images.builder import Network, OnStep, check_network, source_path
from ..models import (
    CreateParams, ExecResult, FileEntry, ForkResult, LeaseInfo, Limits, PoolInfo, SandboxInfo, SnapshotInfo,
)
from ..spec import REMOTE_LOCAL_REPO, EnvSpec, is_repo_url
from ..ssh import SshAccess, check_port, check_public_keys
from ..transport.h1 import Client, ConnectionLost, Response

if TYPE_CHECKING:
    from ..engine.api import OnOutput
    from ..images.oci import OnPull

log = logging.getLogger("fanfold.client")
CHUNK = 1 << 20
LEASE_TTL_S = 30.0
"""This client's lease (``FANFOLD_LEASE_TTL``): if it stops renewing (its process died, its
network went) for this long, the server destroys the sandboxes it made."""
CREATE_ATTEMPTS = 5
"""Tries of a create or fork (one X-Request-ID: the server makes its sandboxes once)."""


def _endpoint(url: str) -> tuple[str, str | None]:
    """``unix:///run/fanfold.sock`` or ``http(s)://host:port`` to a base URL and a socket path."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        if not parts.path:
            raise InvalidRequest(f"a unix URL names a socket path, e.g. unix:///run/fanfold.sock, not {url!r}")
        return "http://fanfold", parts.path
    if parts.scheme in ("http", "https") and parts.netloc:
        return url.rstrip("/"), None
    raise InvalidRequest(f"a fanfold server URL is unix:///path/to.sock or http://host:port, not {url!r}")


class HttpTransport:
    """One server, one tenant (the token's); tracks the sandboxes it creates or forks to kill them on close.

    ``transport.h1.Client`` carries the calls: asyncio streams, keep-alive and h11 (~10 ms to import;
    aiohttp cost every CLI call ~0.3 s of imports), with a per-request cost below aiohttp's.
    """

    def __init__(self, url: str, token: str | None, *, lease_ttl: float = LEASE_TTL_S) -> None:
        self.url = url
        self._base, self._socket = _endpoint(url)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client: Client | None = None
        self._created: set[str] = set()
        self._lease_ttl = lease_ttl
        self.lease: LeaseInfo | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._beat: Client | None = None
        self._abandoned = False

    # -- plumbing -----------------------------------------------------------------------------

    @property
    def client(self) -> Client:
        if self._abandoned:
            raise InfrastructureError(f"lost the fanfold server at {self.url}: its node left the cluster")
        if self._client is None:  # made on first use, inside the loop that will drive it
            self._client = self._new_client()
        return self._client

    def _new_client(self, limit: int = 256) -> Client:
        parts = urlsplit(self._base)
        tls = parts.scheme == "https"
        return Client(socket_path=self._socket, host=parts.hostname or "localhost",
                      port=parts.port or (443 if tls else 80), tls=tls, headers=self._headers, limit=limit)

    @asynccontextmanager
    async def _request(self, method: str, path: str, *, via: Client | None = None,
                       **kwargs: Any) -> AsyncIterator[Response]:
        """A reply whose status is below 400; a fanfold error body raises its exception."""
        try:
            async with (via or self.client).request(method, path, **kwargs) as response:
                if response.status >= 400:
                    raise await _error(response)
                yield response
        except ConnectionLost as err:
            raise InfrastructureError(f"lost the fanfold server at {self.url}: {err}") from None

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        async with self._request(method, path, **kwargs) as response:
            return None if response.status == 204 else await response.json()

    async def _lines(self, method: str, path: str, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """NDJSON lines of a streamed reply (of any length); an ``error`` line raises it."""
        async with self._request(method, path, **kwargs) as response:
            pending = bytearray()
            async for chunk in response.iter_any():
                if b"\n" not in chunk:  # a long line (an exec's whole output) grows without rescanning
                    pending += chunk
                    continue
                first, *rest = chunk.split(b"\n")
                lines = [bytes(pending + first), *rest[:-1]]
                pending = bytearray(rest[-1])
                for text in lines:
                    if text:
                        try:
                            item = json.loads(text)
                        except ValueError:
                            raise InfrastructureError(f"the server sent a malformed stream line: {text[:200]!r}") from None
                        if "error" in item:
                            raise wire.error_from_json(item["error"], 200)
                        yield item

    # -- the engine's surface -----------------------------------------------------------------

    async def start(self) -> None:
        """Check that the server answers and takes the token, and take a lease for this client's sandboxes."""
        try:
            await self._json("GET", "/v1/whoami")
            self.lease = await self._open_lease()
            self._heartbeat = asyncio.create_task(self._renew_forever())
        except BaseException:
            await self.close()
            raise

    async def _open_lease(self) -> LeaseInfo:
        return LeaseInfo(**await self._json("POST", "/v1/leases", json={"ttl": self._lease_ttl}))

    async def _renew_forever(self) -> None:
        """The heartbeat: renew at a third of the ttl, riding out a server restart or a dropped link."""
        while True:
            await asyncio.sleep(self._lease_ttl / 3)
            try:
                assert self.lease is not None
                if self._beat is None:  # its own connection: a burst holding every pooled one must not starve it
                    self._beat = self._new_client(limit=1)
                self.lease = LeaseInfo(**await self._json("POST", f"/v1/leases/{self.lease.id}/renew", via=self._beat))
            except LeaseNotFound:
                log.warning("fanfold: the server reaped this client's sandboxes (lease %s expired); taking a new lease",
                            self.lease.id if self.lease else "?")
                self._created.clear()
                try:
                    self.lease = await self._open_lease()
                except FanfoldError as err:
                    log.warning("fanfold: cannot take a new lease: %s", err)
            except FanfoldError as err:
                log.warning("fanfold: lease heartbeat failed (will retry): %s", err)

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        await asyncio.gather(*(self._kill_quietly(i) for i in list(self._created)))
        if self.lease is not None:
            try:
                await self._json("DELETE", f"/v1/leases/{self.lease.id}")
            except FanfoldError:
                pass  # expired already, or the server is gone: it reaps the lease itself
            self.lease = None
        for client in (self._client, self._beat):
            if client is not None:
                await client.close()
        self._client = self._beat = None

    def abandon(self) -> None:
        """Give the server up for lost, without a word to it: stop the heartbeat (its lease lapses and
        the server, if it lives, reaps this client's sandboxes) and hang up every connection, so calls
        in flight fail at once with InfrastructureError; later calls fail the same way."""
        self._abandoned = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        for client in (self._client, self._beat):
            if client is not None:
                client.abort()
        self._client = self._beat = None

    async def _kill_quietly(self, sandbox_id: str) -> None:
        try:
            await self.kill(sandbox_id)
        except FanfoldError:
            pass

    async def build(self, spec: EnvSpec, on_step: OnStep | None = None, *, network: Network = "isolated",
                    tag: str | None = None) -> Image:
        if not isinstance(spec, EnvSpec):
            raise InvalidRequest(f"build() takes an EnvSpec, got {type(spec).__name__}")
        params = {"network": check_network(network), **({"tag": tag} if tag is not None else {})}
        body, kind = await asyncio.to_thread(_build_request, spec)
        async with aclosing(self._lines("POST", "/v1/images", data=body, headers={"Content-Type": kind},
                                        params=params)) as lines:
            async for item in lines:
                if "event" in item and on_step is not None:
                    on_step(wire.event_from_json(item["event"]))
                elif "image" in item:
                    return wire.image_from_json(item["image"])
        raise InfrastructureError("the server ended the build without an image")

    async def images(self) -> list[Image]:
        return [wire.image_from_json(i) for i in await self._json("GET", "/v1/images")]

    async def pull(self, ref: str, *, platform: str | None = None, on_progress: OnPull | None = None) -> Image:
        body = {"ref": ref, "platform": platform}
        return await self._image_stream("POST", "/v1/images/pull", on_progress, json=body)

    async def import_image(self, path: str | Path, *, ref: str | None = None,
                           on_progress: OnPull | None = None) -> Image:
        local = Path(path)
        if not local.exists():
            raise InvalidRequest(f"no file or directory {str(path)!r} to import")
        # An OCI layout directory travels as an OCI archive: the same files in one tar.
        archive = await asyncio.to_thread(_tar_dir, local) if local.is_dir() else None
        params = {"ref": ref} if ref else {}
        try:
            return await self._image_stream(
                "POST", "/v1/images/import", on_progress, data=_read_chunks(archive or local), params=params,
                headers={"Content-Type": "application/x-tar"},
            )
        finally:
            if archive is not None:
                archive.unlink(missing_ok=True)

    async def _image_stream(self, method: str, path: str, on_progress: OnPull | None, **kwargs: Any) -> Image:
        async with aclosing(self._lines(method, path, **kwargs)) as lines:
            async for item in lines:
                if "event" in item and on_progress is not None:
                    on_progress(wire.pull_event_from_json(item["event"]))
                elif "image" in item:
                    return wire.image_from_json(item["image"])
        raise InfrastructureError("the server ended the pull without an image")

    async def remove_image(self, ref: str, *, force: bool = False) -> str:
        done = await self._json("DELETE", "/v1/images", params={"ref": ref, "force": "true" if force else "false"})
        return done["id"]

    async def share_image(self, ref: str, shared: bool = True) -> Image:
        return wire.image_from_json(await self._json("POST", "/v1/images/share", json={"ref": ref, "shared": shared}))

    async def login(self, registry: str, username: str, password: str) -> None:
        await self._json("POST", "/v1/registries/login", json={"registry": registry, "username": username,
                                                               "password": password})

    async def logout(self, registry: str) -> None:
        await self._json("POST", "/v1/registries/logout", json={"registry": registry})

    async def _make(self, path: str, body: dict[str, Any]) -> Any:
        """POST a create or fork, retried on connection loss and 429/503 under one X-Request-ID."""
        request_id = uuid.uuid4().hex
        for attempt in range(CREATE_ATTEMPTS):
            try:
                return await self._json("POST", path, json=body, headers={"X-Request-ID": request_id})
            except (InfrastructureError, CapacityExceeded) as err:
                # A failed checkpoint fails the same way again: only the caller knows whether to retry it.
                if attempt == CREATE_ATTEMPTS - 1 or isinstance(err, CheckpointFailed):
                    raise
                await asyncio.sleep(0.2 * 2**attempt)  # the same X-Request-ID makes the retry safe

    def _track(self, info: SandboxInfo) -> None:
        """Kill it on close, unless it is meant to outlive this client."""
        if not info.detached and info.persistence == "ephemeral":
            self._created.add(info.id)

    async def create(self, params: CreateParams) -> SandboxInfo:
        owned = self.lease is not None and not params.detached and params.persistence == "ephemeral"
        body = {**wire.create_to_json(params), "network": _network(params.network),
                "lease": self.lease.id if owned and self.lease is not None else None}
        info = wire.info_from_json(await self._make("/v1/sandboxes", body))
        self._track(info)
        return info

    # -- groups: one call each (a group's create is not retried: a second try would make a second group) --

    async def create_group(self, params: GroupParams) -> GroupInfo:
        owned = self.lease is not None and not params.detached
        body = {**groups.params_to_wire(params), "network": _network(params.network),
                "lease": self.lease.id if owned and self.lease is not None else None}
        info = groups.info_from_wire(await self._json("POST", "/v1/groups", json=body))
        if not params.detached:
            self._created.update(info.members.values())
        return info

    async def get_group(self, group_id: str) -> GroupInfo:
        return groups.info_from_wire(await self._json("GET", f"/v1/groups/{_group(group_id)}"))

    async def list_groups(self) -> list[GroupInfo]:
        return [groups.info_from_wire(item) for item in await self._json("GET", "/v1/groups")]

    async def kill_group(self, group_id: str) -> None:
        members = (await self.get_group(group_id)).members.values()
        await self._json("DELETE", f"/v1/groups/{_group(group_id)}")
        self._created.difference_update(members)

    async def snapshot_group(self, group_id: str, *, memory: bool = False,
                             name: str | None = None) -> GroupSnapshotInfo:
        body = {"memory": memory, "name": name}
        return groups.snapshot_from_wire(await self._json("POST", f"/v1/groups/{_group(group_id)}/snapshot", json=body))

    async def fork_group(self, group_id: str, count: int) -> list[GroupInfo]:
        if isinstance(count, bool) or not isinstance(count, int):  # JSON would carry True as 1
            raise InvalidRequest(f"count must be a whole number of copies, got {count!r}")
        made = [groups.info_from_wire(item)
                for item in await self._json("POST", f"/v1/groups/{_group(group_id)}/fork", json={"count": count})]
        for info in made:
            self._created.update(info.members.values())
        return made

    async def group_snapshots(self) -> list[GroupSnapshotInfo]:
        return [groups.snapshot_from_wire(item) for item in await self._json("GET", "/v1/group-snapshots")]

    async def delete_group_snapshot(self, snapshot_id: str) -> None:
        await self._json("DELETE", f"/v1/group-snapshots/{_group(snapshot_id)}")

    async def set_pool(self, image: str | Image, size: int | None, *, limits: Limits | None = None,
                       wait: float | None = None) -> PoolInfo:
        body = {"image": image.id if isinstance(image, Image) else image, "size": size, **(limits or Limits()).__dict__,
                "wait": wait}
        return wire.pool_from_json(await self._json("PUT", "/v1/pools", json=body))

    async def pools_info(self) -> list[PoolInfo]:
        return [wire.pool_from_json(p) for p in await self._json("GET", "/v1/pools")]

    async def stats(self, *, sandboxes: bool = True) -> dict[str, Any]:
        """The server's figures; ``sandboxes=False`` leaves out the per-sandbox list (a cheap poll)."""
        return await self._json("GET", "/v1/stats" if sandboxes else "/v1/stats?sandboxes=false")

    async def metrics_text(self) -> str:
        """The server's Prometheus metrics, as text (not in ``EngineAPI``: a cluster gathers them)."""
        async with self._request("GET", "/v1/metrics") as response:
            return (await response.read()).decode()

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return wire.info_from_json(await self._json("GET", _sandbox(sandbox_id)))

    async def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        return [wire.info_from_json(i) for i in await self._json("GET", "/v1/sandboxes", params=params)]

    async def set_network(self, sandbox_id: str, network: Any, *, cut: bool = False) -> SandboxInfo:
        body = {"network": _network(network), "cut": cut}
        return wire.info_from_json(await self._json("PUT", _sandbox(sandbox_id) + "/network", json=body))

    async def network_stats(self, sandbox_id: str) -> dict[str, Any]:
        return await self._json("GET", _sandbox(sandbox_id) + "/network")

    async def recordings(self) -> list[dict[str, Any]]:
        return await self._json("GET", "/v1/recordings")

    async def delete_recording(self, name: str) -> None:
        await self._json("DELETE", f"/v1/recordings/{quote(name, safe='')}")

    async def expose(self, sandbox_id: str, port: int) -> str:
        if isinstance(port, bool) or not isinstance(port, int):
            raise InvalidRequest(f"a port is a whole number from 1 to 65535, got {port!r}")
        made = await self._json("POST", f"{_sandbox(sandbox_id)}/ports/{port}")
        if self._socket is not None and made.get("direct"):
            return str(made["direct"])  # the host's own tenant, on the server's host: any TCP, no token
        return self._base + made["path"]  # through the server, with this client's token

    async def enable_ssh(self, sandbox_id: str, authorized_keys: list[str] | tuple[str, ...], *,
                         port: int = 22) -> SshAccess:
        body = {"authorized_keys": list(check_public_keys(authorized_keys)), "port": check_port(port)}
        access = SshAccess.from_dict(await self._json("POST", _sandbox(sandbox_id) + "/ssh", json=body))
        if self._socket is None:  # an address on the server host's loopback is no use from here
            access = replace(access, address=None)
        return access

    async def kill(self, sandbox_id: str) -> None:
        await self._json("DELETE", _sandbox(sandbox_id))
        self._created.discard(sandbox_id)

    # -- snapshots, forks and the sandbox's life ----------------------------------------------

    async def snapshot(self, sandbox_id: str, *, memory: bool = False, name: str | None = None) -> SnapshotInfo:
        body = {"memory": memory, "name": name}
        return wire.snapshot_from_json(await self._json("POST", _sandbox(sandbox_id) + "/snapshot", json=body))

    async def fork(
        self, sandbox_id: str, count: int, *, cmd: str | list[str] | None = None, deadline: float | None = None,
    ) -> ForkResult:
        if isinstance(count, bool) or not isinstance(count, int):  # JSON would carry True as 1
            raise InvalidRequest(f"count must be a whole number of children, got {count!r}")
        result = wire.fork_from_json(await self._make(_sandbox(sandbox_id) + "/fork", {"count": count, "cmd": cmd,
                                                                            "deadline": deadline}))
        for child in result.children:
            self._track(child)
        return result

    async def _life(self, sandbox_id: str, verb: str) -> SandboxInfo:
        return wire.info_from_json(await self._json("POST", f"{_sandbox(sandbox_id)}/{verb}"))

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        return await self._life(sandbox_id, "pause")

    async def unpause(self, sandbox_id: str) -> SandboxInfo:
        return await self._life(sandbox_id, "unpause")

    async def suspend(self, sandbox_id: str) -> SandboxInfo:
        return await self._life(sandbox_id, "suspend")

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await self._life(sandbox_id, "resume")

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        return await self._life(sandbox_id, "reset")

    async def snapshots(self) -> list[SnapshotInfo]:
        return [wire.snapshot_from_json(s) for s in await self._json("GET", "/v1/snapshots")]

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return wire.snapshot_from_json(await self._json("GET", _snapshot(snapshot_id)))

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._json("DELETE", _snapshot(snapshot_id))

    async def gc(self) -> list[str]:
        return (await self._json("POST", "/v1/snapshots/gc"))["removed"]

    async def import_snapshot(self, source_url: str, snapshot_id: str, *, token: str | None = None) -> SnapshotInfo:
        """Have this server pull ``snapshot_id`` from the server at ``source_url`` (node to node) and keep it
        under the same id; ``token`` is the source's (default: this client's). The host's own tenant only."""
        body = {"source": source_url, "snapshot": snapshot_id, "token": token}
        return wire.snapshot_from_json(await self._json("POST", "/v1/snapshots/import", json=body))

    async def exec(
        self, sandbox_id: str, cmd: str | list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
        stdin: bytes | str | None = None, timeout: float | None = None, max_output: int | None = None,
        on_output: OnOutput | None = None, user: str | None = None, control: ExecControl | None = None,
    ) -> ExecResult:
        # The engine's own checks, so bad arguments fail here exactly as they do in-process.
        _, stdin_bytes, _ = check_exec_args(cmd, stdin, timeout, max_output, 0)
        body = {"cmd": cmd, "cwd": cwd, "env": env or {}, "timeout": timeout, "max_output": max_output,
                "stdin": None if stdin_bytes is None else wire.b64(stdin_bytes), "user": user}
        path = _sandbox(sandbox_id) + "/exec"
        if control is not None:  # live: the stream names the exec, and a pump posts the control's input
            body["live"] = True
            body["pty"] = None if control.pty is None else dict(zip(("rows", "cols"), control.pty))
        elif on_output is None:
            return wire.result_from_json(await self._json("POST", path, json=body, headers={"Accept": "application/json"}))
        pump: asyncio.Task[None] | None = None
        try:
            async with aclosing(self._lines("POST", path, json=body)) as lines:
                async for item in lines:
                    if "result" in item:
                        return wire.result_from_json(item["result"])
                    if "started" in item and control is not None and pump is None:
                        control._started(int(item["started"]["pid"]))
                        pump = asyncio.create_task(self._pump(f"{path}/{item['started']['exec']}/input", control))
                        continue
                    if on_output is not None:
                        maybe = on_output(item["stream"], wire.unb64(item["data"], "output"))
                        if maybe is not None:
                            await maybe
        finally:
            if pump is not None:
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
        raise InfrastructureError("the server ended the exec stream without a result")

    async def _pump(self, path: str, control: ExecControl) -> None:
        """Post what ``control`` is asked (stdin, signals, a resize) to a live exec, in order, until it ends."""
        while True:
            await control.changed()
            stdin, signals, size = control.take()
            data = b"".join(stdin)
            body: dict[str, Any] = {"stdin": wire.b64(data) if data else None, "eof": b"" in stdin,
                                    "signals": signals,
                                    "resize": None if size is None else {"rows": size[0], "cols": size[1]}}
            try:
                await self._json("POST", path, json=body)
            except NotFound:
                return  # the exec ended: its stream says how
            finally:
                control.taken(len(data))

    # -- files --------------------------------------------------------------------------------

    def _content(self, sandbox_id: str) -> str:
        return _sandbox(sandbox_id) + "/files/content"

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        async with self._request("GET", self._content(sandbox_id), params={"path": path}) as response:
            return await response.read()

    async def write_file(self, sandbox_id: str, path: str, data: bytes | str, mode: int = 0o644) -> None:
        params = {"path": path, "mode": check_mode(mode)}
        await self._json("PUT", self._content(sandbox_id), params=params, data=file_bytes(data))

    async def upload(self, sandbox_id: str, local_path: str | Path, path: str) -> int:
        if not Path(local_path).is_file():
            raise InvalidRequest(f"local file {local_path} does not exist or is not a file")
        mode = os.stat(local_path).st_mode & 0o7777
        written = await self._json(
            "PUT", self._content(sandbox_id), params={"path": path, "mode": mode}, data=_read_chunks(Path(local_path))
        )
        return written["bytes"]

    async def download(self, sandbox_id: str, path: str, local_path: str | Path) -> int:
        async with self._request("GET", self._content(sandbox_id), params={"path": path}) as response:
            try:
                handle = open(local_path, "wb")  # opened only once the sandbox file is known to exist
            except OSError as err:
                raise InvalidRequest(f"cannot write the local file {local_path}: {err.strerror}") from None
            total = 0
            with handle:
                async for chunk in response.iter_any():
                    await asyncio.to_thread(handle.write, chunk)
                    total += len(chunk)
            return total

    async def list_files(self, sandbox_id: str, path: str = ".") -> list[FileEntry]:
        entries = await self._json("GET", _sandbox(sandbox_id) + "/files", params={"path": path})
        return [wire.entry_from_json(e) for e in entries]

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        await self._json("DELETE", _sandbox(sandbox_id) + "/files", params=params)


def _group(group_id: str) -> str:
    """A group or group snapshot id (or name) as a path segment."""
    if not isinstance(group_id, str) or not group_id or "/" in group_id:
        raise GroupNotFound(f"bad group id {group_id!r}")
    return quote(group_id, safe="")


def _sandbox(sandbox_id: str) -> str:
    if not isinstance(sandbox_id, str) or not sandbox_id or "/" in sandbox_id:
        raise SandboxNotFound(f"bad sandbox id {sandbox_id!r}")
    return "/v1/sandboxes/" + quote(sandbox_id, safe="")


def _snapshot(snapshot_id: str) -> str:
    if not isinstance(snapshot_id, str) or not snapshot_id or "/" in snapshot_id:
        raise SnapshotNotFound(f"bad snapshot id {snapshot_id!r}")
    return "/v1/snapshots/" + quote(snapshot_id, safe="")


async def _error(response: Response) -> FanfoldError:
    try:
        body = await response.json()
    except ValueError:
        body = None
    return wire.error_from_json(body, response.status)


async def _read_chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as handle:
        while chunk := await asyncio.to_thread(handle.read, CHUNK):
            yield chunk


def _tar_dir(directory: Path) -> Path:
    """An OCI layout directory as one uncompressed tar (an OCI archive) in a temp file; the caller removes it."""
    handle, name = tempfile.mkstemp(prefix="fanfold-import-", suffix=".tar")
    try:
        with os.fdopen(handle, "wb") as out, tarfile.open(fileobj=out, mode="w") as tar:
            for child in sorted(directory.iterdir()):
                tar.add(child, arcname=child.name)
    except BaseException:
        os.unlink(name)
        raise
    return Path(name)


def _upload_sources(spec: EnvSpec, data: dict, context: Path, sources: dict[str, Path]) -> None:
    """Name each local copy source of ``spec`` and of the stages it copies from ``srcN`` in ``data``
    (numbered across them all, as they share one upload) and note the path to send."""
    for step, item in zip(spec.steps, data["steps"]):
        if step.kind == "repo" and not is_repo_url(item["src"]):
            raise InvalidSpec(REMOTE_LOCAL_REPO.format(src=item["src"]))
        if step.kind == "copy":
            name = f"src{len(sources)}"
            # A top-level link is followed, as an in-process copy does.
            sources[name] = source_path(item["src"], context).resolve()
            item["src"] = name
        elif step.kind == "copy_from" and isinstance(step.arg("source"), EnvSpec):
            stage = step.arg("source")
            _upload_sources(stage, item["source"], stage.context or context, sources)


def _build_request(spec: EnvSpec) -> tuple[bytes, str]:
    """The spec as JSON, or, when it copies local sources, a tar of spec.json and those sources."""
    data = wire.spec_to_json(spec)
    sources: dict[str, Path] = {}
    _upload_sources(spec, data, spec.context or Path.cwd(), sources)
    if not sources:
        return json.dumps(data).encode(), "application/json"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        encoded = json.dumps(data).encode()
        info = tarfile.TarInfo("spec.json")
        info.size = len(encoded)
        tar.addfile(info, io.BytesIO(encoded))
        for name, local in sources.items():
            tar.add(local, arcname=f"context/{name}")
    return buffer.getvalue(), "application/x-tar"


def _network(network: Any) -> Any:
    """A policy as JSON carries it (a ``NetworkPolicy`` as its plain form)."""
    to_wire = getattr(network, "to_wire", None)
    return to_wire() if callable(to_wire) else network
