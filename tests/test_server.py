"""``fanfold serve`` over real HTTP: auth and tenancy, idempotency, streaming, bad input, shutdown.

The SDK's behaviour on the server is covered by the transport-parametrised suites
(test_exec, test_files, test_build, ...); these tests speak raw HTTP where the wire matters.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gzip
import io
import json
import os
import stat
import tarfile
import warnings
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from conftest import TOKENS, Server, leaks, run_cli, start_server, stop_server
from fanfold import (
    AsyncFleet, CreateParams, FanfoldError, InvalidRequest, Limits, Retryable, SandboxNotFound, Unauthorized,
)
from fanfold import errors as fe
from fanfold.web.schemas import CreateRequest
from fanfold.web.status import status_for


def client(server: Server, tenant: str | None = "alice", transport: str = "tcp") -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {TOKENS[tenant]}"} if tenant else {}
    if transport == "unix":
        uds = httpx.AsyncHTTPTransport(uds=urlsplit(server.unix_url).path)
        return httpx.AsyncClient(base_url="http://fanfold", transport=uds, headers=headers, timeout=60)
    return httpx.AsyncClient(base_url=server.tcp_url, headers=headers, timeout=60)


async def test_openapi_documents_every_verb(server):
    async with client(server, None) as http:
        document = (await http.get("/openapi.json")).json()
    routes = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    assert {
        ("POST", "/v1/images"), ("GET", "/v1/images"), ("POST", "/v1/sandboxes"), ("GET", "/v1/sandboxes"),
        ("GET", "/v1/sandboxes/{sandbox_id}"), ("DELETE", "/v1/sandboxes/{sandbox_id}"),
        ("POST", "/v1/sandboxes/{sandbox_id}/exec"), ("GET", "/v1/sandboxes/{sandbox_id}/files"),
        ("DELETE", "/v1/sandboxes/{sandbox_id}/files"), ("GET", "/v1/sandboxes/{sandbox_id}/files/content"),
        ("PUT", "/v1/sandboxes/{sandbox_id}/files/content"), ("POST", "/v1/sandboxes/{sandbox_id}/snapshot"),
        ("POST", "/v1/sandboxes/{sandbox_id}/fork"), ("POST", "/v1/sandboxes/{sandbox_id}/pause"),
        ("POST", "/v1/sandboxes/{sandbox_id}/unpause"), ("POST", "/v1/sandboxes/{sandbox_id}/suspend"),
        ("POST", "/v1/sandboxes/{sandbox_id}/resume"), ("POST", "/v1/sandboxes/{sandbox_id}/reset"),
        ("GET", "/v1/snapshots"), ("GET", "/v1/snapshots/{snapshot_id}"), ("DELETE", "/v1/snapshots/{snapshot_id}"),
        ("POST", "/v1/snapshots/gc"),
    } <= routes


async def test_unix_socket_is_private_and_needs_no_token(server):
    path = urlsplit(server.unix_url).path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    async with client(server, None, "unix") as http:
        assert (await http.get("/v1/whoami")).json()["tenant"] == ""


async def test_tcp_needs_a_valid_token(server):
    async with client(server, None) as http:
        missing = await http.get("/v1/sandboxes")
        wrong = await http.get("/v1/sandboxes", headers={"Authorization": "Bearer not-a-valid-token-at-all"})
    for response in (missing, wrong):
        assert response.status_code == 401 and response.json()["kind"] == "unauthorized"
        assert response.headers["www-authenticate"] == "Bearer"
    with pytest.raises(Unauthorized):
        async with AsyncFleet(server.tcp_url, token="not-a-valid-token-at-all"):
            pass


async def test_a_tenant_sees_and_touches_only_its_own_sandboxes(server):
    async with AsyncFleet(server.tcp_url, token=TOKENS["alice"]) as alice, \
            AsyncFleet(server.tcp_url, token=TOKENS["bob"]) as bob:
        mine = await alice.create(labels={"who": "alice"})
        assert mine.id not in {info.id for info in await bob.list()}
        assert mine.id in {info.id for info in await alice.list()}
        for attempt in (bob.get(mine.id), bob._transport.exec(mine.id, "true"), bob._transport.kill(mine.id),
                        bob._transport.read_file(mine.id, "/etc/hostname")):
            with pytest.raises(SandboxNotFound):
                await attempt
        assert (await mine.exec("true")).ok  # untouched by bob's attempts
    async with client(server, "bob") as http:
        response = await http.delete(f"/v1/sandboxes/{mine.id}")
    assert response.status_code == 404 and response.json()["kind"] == "sandbox_not_found"


async def test_a_tenant_sees_and_touches_only_its_own_snapshots(server):
    async with AsyncFleet(server.tcp_url, token=TOKENS["alice"]) as alice, \
            AsyncFleet(server.tcp_url, token=TOKENS["bob"]) as bob:
        sandbox = await alice.create()
        taken = await sandbox.snapshot(name=f"alices-{sandbox.id}")
        assert taken.id in {s.id for s in await alice.snapshots()}
        assert taken.id not in {s.id for s in await bob.snapshots()}
        assert (await alice.get_snapshot(taken.name)).id == taken.id  # a name works where an id does
        for attempt in (bob.get_snapshot(taken.id), bob.get_snapshot(taken.name), bob.delete_snapshot(taken.id),
                        bob.create(taken.id)):
            with pytest.raises(fe.SnapshotNotFound):
                await attempt
        # alice's name is no name of bob's: his create of it is answered as one of a name nobody holds.
        unheld = f"nobodys-{sandbox.id}"
        with pytest.raises(fe.ImageNotFound) as theirs:
            await bob.create(taken.name)
        with pytest.raises(fe.ImageNotFound) as nobodys:
            await bob.create(unheld)
        assert str(theirs.value).replace(taken.name, unheld) == str(nobodys.value)
        for verb in ("pause", "unpause", "suspend", "resume", "reset"):
            with pytest.raises(SandboxNotFound):
                await getattr(bob._transport, verb)(sandbox.id)
        for attempt in (bob._transport.snapshot(sandbox.id), bob._transport.fork(sandbox.id, 1)):
            with pytest.raises(SandboxNotFound):
                await attempt
        assert taken.id not in await bob.gc()
        async with client(server, "bob") as http:
            for response in (await http.get(f"/v1/snapshots/{taken.id}"),
                             await http.delete(f"/v1/snapshots/{taken.id}"),
                             await http.post("/v1/sandboxes", json={"image": taken.id})):
                assert response.status_code == 404 and response.json()["kind"] == "snapshot_not_found", response.text
        async with await alice.create(taken) as copy:
            assert copy.info.source == taken.id
        await sandbox.kill()
        await alice.delete_snapshot(taken.id)
        with pytest.raises(fe.SnapshotNotFound):
            await alice.get_snapshot(taken.id)


async def test_a_snapshot_named_like_a_base_does_not_shadow_it_for_others(server):
    async with AsyncFleet(server.tcp_url, token=TOKENS["alice"]) as alice, \
            AsyncFleet(server.tcp_url, token=TOKENS["bob"]) as bob:
        async with await alice.create() as sandbox:
            squatter = await sandbox.snapshot(name="host")
        try:
            async with await bob.create("host") as theirs:
                assert theirs.info.source.startswith("img-")
        finally:
            await alice.delete_snapshot(squatter.id)


async def test_fork_children_die_with_the_remote_fleet_that_made_them(server):
    async with AsyncFleet(server.tcp_url, token=TOKENS["alice"]) as keeper:
        async with AsyncFleet(server.tcp_url, token=TOKENS["alice"]) as fleet:
            parent = await fleet.create()
            fork = await parent.fork(2)
            assert len(fork.children) == 2 and fork.result.parent_id == parent.id
            assert [c.id for c in fork.children] == [c.id for c in fork.result.children]
            ids = {parent.id, *(c.id for c in fork.children)}
        assert not ids & {s.id for s in await keeper.list()}
        detached = await keeper.create(detached=True)
        try:
            async with AsyncFleet(server.tcp_url, token=TOKENS["alice"]) as fleet:
                kept = await (await fleet.get(detached.id)).fork(1)
            assert kept.children[0].id in {s.id for s in await keeper.list()}  # a detached parent's children stay
            await kept.kill()
        finally:
            await detached.kill()
        snapshots = {s.id for s in await keeper.snapshots()}
        assert fork.result.snapshot_id not in snapshots and kept.result.snapshot_id not in snapshots  # went with them


async def test_a_retried_fork_with_one_request_id_makes_one_set_of_children(server):
    async with client(server) as http:
        parent = (await http.post("/v1/sandboxes", json={"memory_mb": 128})).json()["id"]
        headers = {"X-Request-ID": "fork-retry-0001"}
        first, second = await asyncio.gather(*(
            http.post(f"/v1/sandboxes/{parent}/fork", json={"count": 2}, headers=headers) for _ in range(2)
        ))
        assert first.status_code == second.status_code == 201, first.text
        assert first.json()["children"] == second.json()["children"]
        other = await http.post(f"/v1/sandboxes/{parent}/fork", json={"count": 1}, headers=headers)
        assert other.status_code == 422
        for child in first.json()["children"]:
            assert (await http.delete(f"/v1/sandboxes/{child['id']}")).status_code == 204
        assert (await http.delete(f"/v1/sandboxes/{parent}")).status_code == 204


async def test_a_retried_create_with_one_request_id_makes_one_sandbox(server):
    body = {"memory_mb": 64, "labels": {"test": "idempotent"}}
    async with client(server) as http:
        headers = {"X-Request-ID": "retry-0001"}
        first, second = await asyncio.gather(
            http.post("/v1/sandboxes", json=body, headers=headers), http.post("/v1/sandboxes", json=body, headers=headers)
        )
        third = await http.post("/v1/sandboxes", json=body, headers=headers)
        assert first.status_code == second.status_code == third.status_code == 201
        assert first.json()["id"] == second.json()["id"] == third.json()["id"]
        listed = (await http.get("/v1/sandboxes", params={"label": "test=idempotent"})).json()
        assert [s["id"] for s in listed] == [first.json()["id"]]
        reused = await http.post("/v1/sandboxes", json={**body, "memory_mb": 128}, headers=headers)
        assert reused.status_code == 422 and "different create" in reused.json()["message"]
        # Another tenant's identical request ID is its own create.
        async with client(server, "bob") as bob:
            other = await bob.post("/v1/sandboxes", json=body, headers=headers)
            assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
            assert (await bob.delete(f"/v1/sandboxes/{other.json()['id']}")).status_code == 204
        assert (await http.delete(f"/v1/sandboxes/{first.json()['id']}")).status_code == 204


def test_errors_map_to_status_codes_in_one_place():
    expected = {
        fe.SandboxNotFound: 404, fe.ImageNotFound: 404, fe.FileNotFoundInSandbox: 404, fe.SandboxGone: 409,
        fe.InvalidRequest: 422, fe.InvalidPath: 422, fe.InvalidSpec: 422, fe.LimitExceeded: 422, fe.BuildFailed: 422,
        fe.ServiceFailed: 422,
        fe.CapacityExceeded: 429, fe.InfrastructureError: 503, fe.HostNotReady: 503, fe.Unauthorized: 401,
        fe.SnapshotNotFound: 404, fe.SnapshotInUse: 409, fe.CheckpointFailed: 503, fe.FanfoldError: 500,
    }
    for cls, status in expected.items():
        assert status_for(cls("x")) == status, cls


async def test_bad_input_gets_a_typed_error_never_a_500(server):
    async with client(server) as http:
        cases = [
            await http.post("/v1/sandboxes", content=b"{not json", headers={"Content-Type": "application/json"}),
            await http.post("/v1/sandboxes", json={"memory_mb": "lots"}),
            await http.post("/v1/sandboxes", json={"image": "img-0000000000000000"}),
            await http.post("/v1/sandboxes", json={"unknown_field": 1}),
            await http.post("/v1/images", json={"base": "host", "steps": [{"kind": "copy", "src": "/etc/shadow", "dst": "/x"}]}),
            await http.post("/v1/images", json={"base": "Not An Image"}),
            await http.post("/v1/images", content=b"not a tar", headers={"Content-Type": "application/x-tar"}),
            await http.get("/v1/sandboxes/sb-000000000000"),
            await http.get("/v1/sandboxes", params={"label": "no-equals-sign"}),
            await http.get("/v1/nowhere"),
        ]
    statuses = [response.status_code for response in cases]
    assert statuses == [422, 422, 404, 422, 422, 422, 422, 404, 422, 404]
    for response in cases:
        body = response.json()
        assert body["kind"] and body["message"], body


SCHEMA_BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "min_length": "minLength",
                 "max_length": "maxLength"}


def test_a_network_policy_body_serializes_as_its_own_type():
    """A create body's rules keep their list defaults: dumping it (as the server does for every create)
    warns of no value off its declared type."""
    body = CreateRequest.model_validate({"network": {"allow": ["example.com"]}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert body.model_dump()["network"]["deny"] == []


async def test_bounds_are_the_models_own_and_enforced_alike_embedded_and_over_http(server):
    """Limits' and CreateParams' bounds are written once, in their fields: every body that carries them
    serves those bounds, and a value just past one is refused by the dataclass and by the server alike."""
    async with client(server, None) as http:
        schemas = (await http.get("/openapi.json")).json()["components"]["schemas"]
    carriers = [("CreateRequest", Limits), ("PoolRequest", Limits), ("RolloutLimits", Limits),
                ("CreateRequest", CreateParams)]
    for body, cls in carriers:
        for spec in dataclasses.fields(cls):
            if not spec.metadata:
                continue
            served = schemas[body]["properties"][spec.name]
            served = next(s for s in served.get("anyOf", [served]) if s.get("type") != "null")
            wanted = {SCHEMA_BOUNDS[key]: value for key, value in spec.metadata.items()}
            assert {key: served[key] for key in SCHEMA_BOUNDS.values() if key in served} == wanted, (body, spec.name)
    async with client(server) as http:
        before = (await http.get("/v1/sandboxes")).json()
        for spec in dataclasses.fields(Limits):
            if not spec.metadata:  # gpus, gpu_exclusive: no range (tests/test_gpu_doors.py)
                continue
            step = 0.001 if spec.type == "float" else 1
            for past in (spec.metadata["ge"] - step, spec.metadata["le"] + step):
                with pytest.raises(InvalidRequest, match=f"limit {spec.name}={past} is out of range"):
                    Limits(**{spec.name: past})
                refused = await http.post("/v1/sandboxes", json={spec.name: past})
                assert refused.status_code == 422 and spec.name in refused.json()["message"], refused.text
                pool = await http.put("/v1/pools", json={"size": 0, spec.name: past})
                assert pool.status_code == 422, pool.text
        assert (await http.get("/v1/sandboxes")).json() == before


async def test_huge_headers_and_bodies_are_refused_and_the_server_lives_on(server):
    address = urlsplit(server.tcp_url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    writer.write(f"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKENS['alice']}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {1 << 40}\r\n\r\n{{".encode())
    await writer.drain()
    assert (await reader.readline()).startswith(b"HTTP/1.1 413")
    writer.close()
    async with client(server) as http:

        async def endless():
            for _ in range(120):  # past the 96 MiB cap on JSON bodies
                yield b" " * (1 << 20)

        chunked = await http.post("/v1/sandboxes", content=endless(), headers={"Content-Type": "application/json"})
        assert chunked.status_code == 413
        try:
            huge_header = await http.get("/v1/whoami", headers={"X-Big": "y" * (1 << 20)})
            assert 400 <= huge_header.status_code < 500
        except httpx.RemoteProtocolError:
            pass  # closing the connection is an acceptable refusal
        assert (await http.get("/v1/whoami")).status_code == 200


async def test_exec_output_streams_as_ndjson_while_the_command_runs(server):
    async with AsyncFleet(server.tcp_url, token=TOKENS["alice"]) as fleet, await fleet.create() as sandbox:
        cmd = "echo started; while [ ! -e /tmp/go ]; do sleep 0.01; done; echo finished"
        async with client(server) as http, http.stream(
            "POST", f"/v1/sandboxes/{sandbox.id}/exec", json={"cmd": cmd}
        ) as response:
            assert response.headers["content-type"].startswith("application/x-ndjson")
            lines = response.aiter_lines()
            first = json.loads(await anext(lines))
            assert first == {"stream": "stdout", "data": base64.b64encode(b"started\n").decode()}
            await sandbox.files.write("/tmp/go", "")  # the command could not have finished before this
            rest = [json.loads(text) async for text in lines if text]
        result = rest[-1]["result"]
        assert result["outcome"] == "exited" and result["exit_code"] == 0
        assert base64.b64decode(result["stdout"]) == b"started\nfinished\n"


async def wait_until(predicate, timeout: float = 20.0) -> None:
    async def poll() -> None:
        while not await predicate():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout)


async def test_a_client_that_disconnects_mid_exec_kills_the_command(server):
    async with AsyncFleet(server.unix_url) as fleet, await fleet.create() as sandbox:
        for accept in ("application/x-ndjson", "application/json"):
            body = json.dumps({"cmd": "touch /tmp/running; exec sleep 1000"}).encode()
            reader, writer = await asyncio.open_unix_connection(urlsplit(server.unix_url).path)
            writer.write(f"POST /v1/sandboxes/{sandbox.id}/exec HTTP/1.1\r\nHost: x\r\nAccept: {accept}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()

            async def running() -> bool:
                return (await sandbox.exec("test -e /tmp/running")).ok

            await wait_until(running)
            writer.close()  # the client goes away: the server must kill the command

            async def gone() -> bool:
                return (await sandbox.exec("pgrep -x sleep")).exit_code == 1

            await wait_until(gone)
            await sandbox.exec("rm /tmp/running")


async def test_an_upload_cut_off_midway_leaves_no_file(server):
    async with AsyncFleet(server.unix_url) as fleet, await fleet.create() as sandbox:
        async def broken():
            yield b"x" * (1 << 20)
            raise ConnectionAbortedError("the client died")

        async with client(server, None, "unix") as http:
            with pytest.raises(ConnectionAbortedError):
                await http.put(f"/v1/sandboxes/{sandbox.id}/files/content", params={"path": "/tmp/partial"},
                               content=broken())

        async def settled() -> bool:
            return (await sandbox.exec("ls -A /tmp")).text == ""

        await wait_until(settled)
        assert (await sandbox.exec("true")).ok


def vm_peak_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


async def test_a_1gb_file_moves_both_ways_with_bounded_server_memory(config, tmp_path):
    private = start_server(config.state_dir, tmp_path)
    try:
        size = 1 << 30
        source = tmp_path / "big.bin"
        with open(source, "wb") as handle:
            handle.truncate(size)  # sparse: costs no disk here
        before = vm_peak_kb(private.process.pid)
        async with AsyncFleet(private.unix_url) as fleet:
            async with await fleet.create(disk_mb=1100, memory_mb=1400) as sandbox:
                assert await sandbox.files.upload(source, "/tmp/big.bin") == size
                assert (await sandbox.exec("stat -c %s /tmp/big.bin")).text.strip() == str(size)
                assert await sandbox.files.download("/tmp/big.bin", tmp_path / "back.bin") == size
        assert os.path.getsize(tmp_path / "back.bin") == size
        grew_mb = (vm_peak_kb(private.process.pid) - before) / 1024
        assert grew_mb < 128, f"the server's peak memory grew {grew_mb:.0f} MB moving 1 GB"
    finally:
        assert stop_server(private) == 0


async def test_a_thousand_concurrent_connections(server):
    path = urlsplit(server.unix_url).path

    async def one() -> bytes:
        reader, writer = await asyncio.open_unix_connection(path)
        try:
            writer.write(b"GET /v1/whoami HTTP/1.1\r\nHost: fanfold\r\nConnection: close\r\n\r\n")
            await writer.drain()
            return await reader.readline()
        finally:
            writer.close()

    statuses = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(1000))), 120)
    assert all(line.startswith(b"HTTP/1.1 200") for line in statuses), {s[:20] for s in statuses}


async def test_shutdown_finishes_calls_in_flight_and_releases_what_it_owns(config, tmp_path):
    private = start_server(config.state_dir, tmp_path, "--grace", "20")
    socket_path = urlsplit(private.unix_url).path
    async with AsyncFleet(private.unix_url) as fleet:
        owned = await fleet.create()
        kept = await fleet.create(detached=True)
        started = asyncio.Event()

        async def seen(stream: str, data: bytes) -> None:
            started.set()

        call = asyncio.create_task(owned.exec("echo started; sleep 1; echo finished", on_output=seen))
        await asyncio.wait_for(started.wait(), 20)
        code = await asyncio.to_thread(stop_server, private)
        result = await call
        assert code == 0 and result.ok and result.text == "started\nfinished\n"
        with pytest.raises(FanfoldError):  # the server is gone
            await fleet.list()
    assert not os.path.exists(socket_path)
    async with AsyncFleet(config=config) as local:
        ids = {info.id for info in await local.list()}
        assert owned.id not in ids and kept.id in ids
        await local._transport.kill(kept.id)
    assert leaks(config) == {"mounts": 0, "cgroups": 0, "containers": 0}


async def test_calls_a_stopping_server_cannot_finish_get_a_retryable_answer_and_the_log_stays_clean(
    config, tmp_path, capfd
):
    private = start_server(config.state_dir, tmp_path, "--grace", "1")
    try:
        async with client(private) as http, AsyncFleet(private.unix_url) as fleet:
            sandbox = (await http.post("/v1/sandboxes", json={})).json()["id"]
            other = await fleet.create()
            started = asyncio.Event()

            async def seen(stream: str, data: bytes) -> None:
                started.set()

            async def streamed() -> list[dict]:
                body = {"cmd": "echo started; sleep 60"}
                async with http.stream("POST", f"/v1/sandboxes/{sandbox}/exec", json=body) as response:
                    return [json.loads(line) async for line in response.aiter_lines()]

            plain = asyncio.create_task(http.post(f"/v1/sandboxes/{sandbox}/exec", json={"cmd": ["sleep", "60"]},
                                                  headers={"Accept": "application/json"}))
            stream = asyncio.create_task(streamed())
            sdk = asyncio.create_task(other.exec("echo started; sleep 60", on_output=seen))
            await asyncio.wait_for(started.wait(), 20)
            # the plain and the streamed call are running too (each one sleep) before the server stops
            both = await (await fleet.get(sandbox)).exec(
                "until [ \"$(pgrep -c -x sleep)\" -ge 2 ]; do sleep 0.02; done", timeout=20)
            assert both.ok, both
            code = await asyncio.to_thread(stop_server, private)
            answered, lines = await plain, await stream
            with pytest.raises(Retryable, match="the server stopped before the call finished"):
                await sdk
    finally:
        if private.process.poll() is None:
            private.process.kill()
            private.process.wait()
    assert code == 0
    assert answered.status_code == 503 and answered.headers["Retry-After"] == "1"
    assert answered.json()["kind"] == "infrastructure_error", answered.text
    assert lines[0]["stream"] == "stdout" and lines[-1]["error"]["kind"] == "infrastructure_error", lines
    log = capfd.readouterr().err
    assert "Traceback" not in log and "Exception in ASGI" not in log and "Cancel" not in log, log


def test_cli_works_against_a_server(server):
    env = {"FANFOLD_URL": server.tcp_url, "FANFOLD_TOKEN": TOKENS["bob"]}
    done = run_cli("run", "--", "sh", "-c", "echo remote; exit 3", env=env)
    assert (done.returncode, done.stdout) == (3, "remote\n"), done.stderr
    created = run_cli("create", "--label", "via=cli", env=env)
    sandbox_id = created.stdout.strip()
    assert run_cli("exec", sandbox_id, "--", "hostname", env=env).stdout == sandbox_id + "\n"
    assert [s["id"] for s in json.loads(run_cli("ls", "--json", env=env).stdout)] == [sandbox_id]
    assert sandbox_id not in run_cli("--url", server.tcp_url, "--token", TOKENS["alice"], "ls", "--json").stdout
    assert run_cli("rm", sandbox_id, env=env).returncode == 0
    refused = run_cli("--url", server.tcp_url, "ls")
    assert refused.returncode == 2 and "Unauthorized" in refused.stderr and "Traceback" not in refused.stderr


def test_bad_urls_are_clear_errors():
    for url in ("ftp://host", "unix://", "nothing"):
        with pytest.raises(InvalidRequest, match="URL"):
            AsyncFleet(url)


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


async def test_a_build_never_reads_or_writes_the_servers_own_files(server, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    spec = json.dumps({"base": "host", "steps": [{"kind": "copy", "src": "src0", "dst": "/x"}]}).encode()
    archives = {
        "symlinked source": tar_of((member("spec.json"), spec), (member("context/src0", tarfile.SYMTYPE, "/etc"), None)),
        "dot-dot member": tar_of((member("spec.json"), spec), (member("../escaped"), b"x")),
        "absolute member": tar_of((member("spec.json"), spec), (member(f"{outside}/abs"), b"x")),
        "hard link": tar_of((member("spec.json"), spec), (member("context/src0", tarfile.LNKTYPE, "/etc/shadow"), None)),
        "device node": tar_of((member("spec.json"), spec), (member("context/src0", tarfile.CHRTYPE), None)),
        "compressed": gzip.compress(tar_of((member("spec.json"), spec))),
    }
    async with client(server) as http:
        for what, body in archives.items():
            response = await http.post("/v1/images", content=body, headers={"Content-Type": "application/x-tar"})
            assert response.status_code == 422, (what, response.text)
        # A symlink planted by one member cannot carry a later member outside.
        through_link = tar_of(
            (member("spec.json"), spec), (member("context/src0/README"), b"ok"),
            (member("context/escape", tarfile.SYMTYPE, str(outside)), None), (member("context/escape/pwned"), b"x"),
        )
        response = await http.post("/v1/images", content=through_link, headers={"Content-Type": "application/x-tar"})
        assert 400 <= response.status_code < 500 and response.json()["kind"], response.text
        for step in (
            {"kind": "copy", "src": "/etc/shadow", "dst": "/x"},
            {"kind": "copy", "src": "a" * 300, "dst": "/x"},
            {"kind": "repo", "src": "file:///root", "dst": "/x"},
            {"kind": "repo", "src": "/root", "dst": "/x"},
            {"kind": "repo", "src": "https://example.invalid/x.git", "dst": "/x", "ref": 1},
        ):
            response = await http.post("/v1/images", json={"base": "host", "steps": [step]})
            assert response.status_code == 422 and response.json()["kind"] == "invalid_spec", (step, response.text)
    assert list(outside.iterdir()) == []


async def test_unauthenticated_callers_are_refused_before_their_body_is_read(server):
    address = urlsplit(server.tcp_url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    writer.write(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 50000000\r\n\r\n{")
    await writer.drain()
    assert (await reader.readline()).startswith(b"HTTP/1.1 401")
    writer.close()
